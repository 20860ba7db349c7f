"""The training configuration schema: every key, its default and what it means.

Recipes (`recipes/*.yaml`) set a subset of these keys; `key=value` arguments override them.
`drafttrain train --help` prints this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafttrain.answers import AnswersConfig
from drafttrain.config import field_
from drafttrain.data import DataConfig
from drafttrain.methods.registry import BUILTIN, DEFAULT_METHOD, method_names

METHODS = tuple(BUILTIN)  # the built-in methods; registered ones are accepted too (method_names)


@dataclass
class DrafterSettings:
    draft_vocab_size: int = field_(32000, help="EAGLE-3 reduced draft vocabulary (most frequent loss-masked tokens); 0 = full target vocab")
    aux_layer_ids: list[int] = field_(default_factory=list, help="target hidden_states indices fused by EAGLE-3 (0 = embeddings, j = output of layer j-1); empty = {2, N/2, N-3}")
    mask_out_of_vocab: bool = field_(True, help="EAGLE-3: drop positions whose target argmax is outside the draft vocab (costs one full-vocab LM-head pass per token)")
    feature_scale: bool = field_(True, help="EAGLE-3: fc reads the target's features scaled per dimension (each layer by its median RMS, massive dimensions to unit RMS), measured on 16 training records and folded into fc.weight on save")
    ttt_steps: int = field_(7, help="EAGLE-3 training-time-test unroll length")
    step_weight: float = field_(0.8, help="loss weight decay per unroll step (weight = step_weight**k)")
    objective: str = field_("ce", help="EAGLE-3 per-step objective against the target over the draft vocab: soft cross-entropy, total variation (= the rejection probability of speculative sampling), or their sum", choices=("ce", "tv", "ce+tv"))
    topk: int = field_(0, help="EAGLE-3: add HASS's top-K distillation term (-sum over the teacher's top K of p log q); 0 = off")
    topk_weight: float = field_(1.0, help="EAGLE-3: weight of the top-K term")
    alignable_only: bool = field_(False, help="EAGLE-3 (GRIFFIN): train unroll step k only where the drafter's steps before it agreed with the teacher, as in decoding")
    positions: str = field_("assistant", help="EAGLE-3 training positions: assistant tokens only, or every token (the teacher is the target's distribution everywhere); held-out metrics always count assistant tokens", choices=("assistant", "all"))
    feature_weight: float = field_(1.0, help="EAGLE-1 SmoothL1 feature-regression weight")
    ce_weight: float = field_(0.1, help="EAGLE-1 cross-entropy weight")
    noise: float = field_(0.2, help="EAGLE-1 uniform noise half-width added to input features (0 = off)")
    dtype: str = field_("float32", help="drafter parameter dtype (master weights)", choices=("float32", "bfloat16"))


@dataclass
class MedusaSettings:
    num_heads: int = field_(4, help="Medusa heads; head i predicts the token i+2 ahead")
    num_layers: int = field_(1, help="residual blocks per head (zero-initialised Linear + SiLU + residual)")
    share_lm_head: bool = field_(False, help="heads share the target's LM head (not trained, not saved) instead of own copies")
    self_distill: bool = field_(False, help="train against the target's own distribution (draft vocab) instead of the data tokens")
    topk: int = field_(5, help="k of the logged per-head top-k accuracy")
    tree_budget: int = field_(16, help="draft nodes of the static tree built from held-out head accuracies")
    tree_max_rank: int = field_(5, help="candidates per head considered for the tree")
    tree_records: int = field_(32, help="held-out records used to measure per-head rank accuracy for the tree")
    warmup_steps: int = field_(50, help="Medusa-2: heads-only steps before joint training with the LoRA adapter")
    heads_coefficient: float = field_(0.2, help="Medusa-2: weight of the heads' loss in joint training")
    head_lr_mult: float = field_(4.0, help="Medusa-2: heads' learning rate = train.lr * this")
    kl_weight: float = field_(1.0, help="Medusa-2: weight of KL(original target || adapted target)")
    lora_r: int = field_(8, help="Medusa-2: LoRA rank")
    lora_alpha: int = field_(16, help="Medusa-2: LoRA alpha")
    lora_target_modules: list[str] = field_(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], help="Medusa-2: module names that get LoRA")
    save_merged: bool = field_(False, help="Medusa-2: also save the adapter-merged target in <drafter>/merged_target")


@dataclass
class DraftLMSettings:
    num_layers: int = field_(2, help="student layers when built from the target's config")
    hidden_size: int = field_(0, help="student width; 0 = the target's (then target tensors are copied in)")
    init_layers: list[int] = field_(default_factory=list, help="target layer copied into each student layer; empty = evenly spaced, first and last included")
    init_from: str = field_("", help="start from this HF causal LM id / path instead (its tokenizer must match the target's)")
    freeze_embeddings: bool = field_(False, help="keep the input embedding and LM head fixed (with a tied head: most of a small student's parameters)")
    divergence: str = field_("fkl", help="teacher-student divergence per assistant token", choices=("fkl", "rkl", "jsd", "tvd", "mix"))
    jsd_beta: float = field_(0.5, help="beta of JSD(beta) = beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q")
    mix_weights: list[float] = field_(default_factory=lambda: [0.5, 0.0, 0.0, 0.5], help="divergence=mix: weights of fkl, rkl, jsd, tvd")
    teacher_topk: int = field_(0, help="teacher distribution truncated to its top-k tokens plus one rest bucket; 0 = full vocab")
    chunk_size: int = field_(256, help="positions per LM-head chunk (no [T, V] logits tensor is held)")
    on_policy_rate: float = field_(0.0, help="probability that a batch's responses are the student's own samples (scored by the teacher)")
    on_policy_max_new_tokens: int = field_(128, help="max tokens per on-policy student sample")
    on_policy_temperature: float = field_(1.0, help="sampling temperature of on-policy student samples (0 = greedy)")
    decode_vocab: int = field_(0, help="save the N most frequent training tokens; drafttrain's decoder then drafts from those LM-head rows only (lossless; the HF folder keeps the full head); 0 = full vocab")


@dataclass
class TrainSettings:
    batch_size: int = field_(1, help="sequences per process per micro-step")
    grad_accum: int = field_(1, help="micro-steps per optimizer step")
    lr: float = field_(1e-4, help="peak learning rate (AdamW)")
    betas: list[float] = field_(default_factory=lambda: [0.9, 0.95], help="AdamW betas")
    weight_decay: float = field_(0.0, help="AdamW weight decay")
    grad_clip: float = field_(0.5, help="max gradient norm (0 = off)")
    warmup_steps: int = field_(20, help="linear warmup steps before cosine decay")
    min_lr_ratio: float = field_(0.1, help="cosine floor as a fraction of lr")
    lr_schedule: str = field_("steps", help="what the cosine decays over: steps (epochs * steps per epoch, or max_steps) or time (the training time max_minutes / run_minutes leave, so a run the clock stops still ends at the floor; whichever of the two is further along; without a time limit, the steps)", choices=("steps", "time"))
    max_steps: int = field_(0, help="optimizer steps; 0 = epochs * steps per epoch")
    epochs: int = field_(1, help="passes over the training split (used when max_steps = 0)")
    max_minutes: float = field_(0.0, help="stop (and save) after this many minutes of training; 0 = no limit")
    run_minutes: float = field_(0.0, help="stop training (and save) so the whole run, loading, answering and features included, ends within about this many minutes (a minute is kept for the final eval and save; a resumed run starts a new budget); 0 = no limit")
    mixed_precision: str = field_("auto", help="autocast dtype for the drafter forward", choices=("auto", "no", "bf16", "fp16"))
    save_every: int = field_(200, help="checkpoint every N optimizer steps (atomic); 0 = only at the end")
    keep_checkpoints: int = field_(2, help="how many recent checkpoints to keep")
    snapshot_minutes: list[float] = field_(default_factory=list, help="also write the drafter folder <run>/snapshots/train-<M>min when training time passes each of these minutes (a tau / speedup-vs-minutes curve from one run)")
    eval_every: int = field_(0, help="held-out evaluation every N steps; 0 = only at the end")
    decode_eval_every: int = field_(0, help="real decoding eval (tau from the decoder) on held-out prompts every N steps, keeping the best drafter in <run>/best_drafter; 0 = off")
    decode_eval_final: bool = field_(True, help="run the decoding eval once at the end of training")
    decode_eval_prompts: int = field_(8, help="held-out prompts per decoding eval")
    decode_eval_tokens: int = field_(64, help="max new tokens per prompt in the decoding eval")
    decode_eval_gamma: int = field_(5, help="chain length of the decoding eval")
    log_every: int = field_(10, help="log a line every N optimizer steps")
    resume: bool = field_(False, help="continue from the last checkpoint in output_dir")
    stop_after: int = field_(0, help="stop (as if killed) after N steps without the final save; for tests")
    num_workers: int = field_(0, help="DataLoader workers")


@dataclass
class FeatureSettings:
    mode: str = field_("online", help="online: target forward inside the loop; offline: read the feature cache, computed once before training where it is missing (or by `drafttrain prepare`)", choices=("online", "offline"))
    cache_dir: str = field_("", help="offline feature cache folder (default: <output_dir>/features)")
    shard_size: int = field_(256, help="records per offline cache shard")


@dataclass
class WandbSettings:
    project: str = field_("drafttrain", help="W&B project")
    entity: str = field_("", help="W&B entity (team)")
    name: str = field_("", help="run name (default: output folder name)")
    mode: str = field_("auto", help="auto = online when a key and network are there, else offline", choices=("auto", "online", "offline"))


@dataclass
class TrainConfig:
    recipe: str = field_("", help="recipe name (recipes/NAME.yaml) or path to a YAML file")
    method: str = field_(DEFAULT_METHOD, help="drafter method (drafttrain.methods)", choices=method_names)
    target: str = field_("gemma-3-270m", help="target: packaged alias, HF hub id, local folder or .gguf file")
    target_revision: str = field_("", help="hub revision of the target")
    dtype: str = field_("auto", help="target dtype (auto = bf16 where the CPU/GPU runs it fast)", choices=("auto", "bfloat16", "float32", "float16"))
    trust_remote_code: bool = field_(False, help="allow custom modelling code from the target's repo")
    output_dir: str = field_("", help="run folder (default runs/<recipe>)")
    seed: int = field_(0, help="random seed")
    threads: int = field_(0, help="CPU threads per process (torch); 0 = auto on CPU: this machine's cores divided among its processes (`accelerate launch` alone would leave OMP_NUM_THREADS=1)")
    tracking: str = field_("none", help="experiment tracker", choices=("none", "wandb"))
    print_config: bool = field_(False, help="print the resolved config and exit")
    data: DataConfig = field_(default_factory=DataConfig, help="")
    answers: AnswersConfig = field_(default_factory=AnswersConfig, help="")
    drafter: DrafterSettings = field_(default_factory=DrafterSettings, help="")
    train: TrainSettings = field_(default_factory=TrainSettings, help="")
    features: FeatureSettings = field_(default_factory=FeatureSettings, help="")
    medusa: MedusaSettings = field_(default_factory=MedusaSettings, help="")
    draft_lm: DraftLMSettings = field_(default_factory=DraftLMSettings, help="")
    wandb: WandbSettings = field_(default_factory=WandbSettings, help="")

    @property
    def run_dir(self) -> str:
        return self.output_dir or f"runs/{self.recipe or self.method}"
