"""`drafttrain eval` top to bottom: load, build methods, run interleaved, sweep, check, report.

    check_inputs       every proposer spec checked before anything loads (decode/proposers/specs.py)
    target, tokenizer  <- drafttrain.targets.load_target(cfg.target, dtype=cfg.dtype)
    prompts            <- benchmarks.load_benchmark (training template)
    methods            <- target-only, each proposer (adaptive / hybrid too), HF plain / lookup / assisted
    vLLM baselines     vllm / vllm_ngram, when asked: every temperature and batch size timed in one
                       engine process BEFORE the other rows, so that a refusal stops the eval
                       before they run (eval/vllm_baselines.py); their calls join each run as
                       peer methods
    per temperature    run_benchmark -> summarize -> speedups, theory -> greedy check (T = 0)
                       -> oracle bound of adaptive / hybrid methods (oracle=true, T = 0: an
                          untimed step-logged re-run of the same batches, eval/oracle.py)
    sweeps             gamma, tree_budget, batch_size (+ fixed-length baselines, oracle rows)
    report             a results.Results (eval/results.py: the schema; engine_baselines: every vLLM
                       run with its start-up apart) -> results.json, results.md,
                       plots, tokens.jsonl; tracker logs the same

Deliberately not here: the decoding itself (drafttrain.decode), metric formulas (metrics.py).
"""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from drafttrain.config import ConfigError, to_dict
from drafttrain.decode.proposers import check_spec
from drafttrain.eval.benchmarks import load_benchmark
from drafttrain.eval.config import EvalConfig, EvalError
from drafttrain.eval.metrics import add_prompt_speedups, add_speedups, summarize, theory
from drafttrain.eval.oracle import analyze_calls
from drafttrain.eval.report import write_report
from drafttrain.eval.results import BenchmarkInfo, Machine, MethodSummary, Results, Run, SweepRow, TargetInfo
from drafttrain.eval.runner import Method, eos_ids, greedy_check, log_pass, run_benchmark, run_call
from drafttrain.eval.sweeps import run_sweep
from drafttrain.eval.vllm_baselines import (
    VllmRuns,
    check_vllm_target,
    engine_report,
    requested,
    run_vllm_baselines,
    sweep_prompt_count,
)

__all__ = ["run_eval", "check_inputs", "build_methods", "machine_info", "is_adaptive", "cost_model_for", "cost_batch_sizes",
           "add_oracle"]

ADAPTIVE_PREFIXES = ("adaptive:", "hybrid:", "adaptive-hybrid:")
#: every method's `speedup` holds vs_<name> for each of these that ran
SPEEDUP_BASELINES = ("target", "hf", "hf_lookup", "hf_assisted", "vllm")


def is_adaptive(spec: str) -> bool:
    """Adaptive and hybrid specs choose their own length / part per step (no fixed gamma sweep)."""
    return spec.startswith(ADAPTIVE_PREFIXES)


def check_inputs(cfg: EvalConfig) -> None:
    """What can be checked before any model loads: every proposer spec (method known, folders and
    files there, no hub id when the Hub cannot be reached), the assistant, duplicates, cost_model=.

    Raises:
        EvalError: one line naming the bad spec or file and the accepted forms.
    """
    try:
        for spec in cfg.proposers:
            check_spec(spec)
        if cfg.assistant:
            check_spec(cfg.assistant, what="assistant")
    except ConfigError as e:
        raise EvalError(str(e)) from None
    twice = next((s for i, s in enumerate(cfg.proposers) if s in cfg.proposers[:i]), None)
    if twice is not None:
        raise EvalError(f"proposer {twice!r} is listed twice")
    uses_costs = cfg.oracle or any(is_adaptive(s) for s in cfg.proposers)
    if cfg.cost_model and uses_costs and not Path(cfg.cost_model).is_file():
        raise EvalError(f"cost_model {cfg.cost_model!r}: no such file (write one with `drafttrain profile`)")
    check_vllm_target(cfg)


def build_methods(cfg: EvalConfig, target, tokenizer) -> tuple[list[Method], dict[str, str]]:
    """The methods to time, and {skipped method: why}.

    Raises:
        EvalError: a proposer spec or assistant that cannot be loaded.
    """
    from drafttrain.decode import load_proposer
    from drafttrain.decode.proposers import DraftLMProposer
    from drafttrain.decode.proposers.scheduler import Scheduler

    methods, skipped = [], {}
    if "target" in cfg.baselines:
        methods.append(Method("target", "engine"))
    draft_lm = None
    for spec in cfg.proposers:
        adaptive = is_adaptive(spec)
        opts = ({"cost_model": cfg.cost_model} if cfg.cost_model else {"cost_batch_sizes": cost_batch_sizes(cfg)}) if adaptive else {}
        try:
            proposer = load_proposer(spec, target, tokenizer=tokenizer, **opts)
        except (ValueError, OSError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise EvalError(msg if repr(spec) in msg else f"proposer {spec!r}: {msg}") from None
        if isinstance(proposer, DraftLMProposer) and draft_lm is None:
            draft_lm = proposer.model
        if any(m.name == spec for m in methods):
            raise EvalError(f"proposer {spec!r} is listed twice")
        methods.append(Method(spec, "engine", proposer=proposer, adaptive=adaptive or isinstance(proposer, Scheduler)))
    if "hf" in cfg.baselines:
        methods.append(Method("hf", "hf"))
    if "hf_lookup" in cfg.baselines:
        methods.append(Method("hf_lookup", "hf", hf_kwargs={"prompt_lookup_num_tokens": cfg.hf_lookup_tokens},
                              batch1_only=True))
    if "hf_assisted" in cfg.baselines:
        if cfg.assistant:
            draft_lm = _load_assistant(cfg.assistant, target)
        if draft_lm is None:
            skipped["hf_assisted"] = "no draft LM (set assistant= or list a draft-LM proposer)"
        else:
            methods.append(Method("hf_assisted", "hf", hf_kwargs={"assistant_model": draft_lm}, batch1_only=True))
    if cfg.batch_size > 1:
        for m in methods:
            if m.batch1_only:
                skipped[m.name] = "transformers supports it at batch 1 only"
    return methods, skipped


def _load_assistant(spec: str, target):
    from drafttrain.decode import load_proposer

    try:
        return load_proposer(spec, target).model
    except (ValueError, OSError, AttributeError) as e:
        raise EvalError(f"assistant {spec!r} is not a draft LM: {str(e).splitlines()[0]}") from None


def cost_model_for(cfg: EvalConfig, methods: list[Method], target):
    """The cost model the oracle bound is costed with: cost_model= when given, else this
    target's cached one with every part of the adaptive / hybrid methods measured (the same
    cache the adaptive proposers read, so usually nothing is re-measured).

    Raises:
        EvalError: cost_model= names a file that cannot be read.
    """
    from drafttrain.decode.costmodel import CostModel, load_or_measure, proposer_key

    if cfg.cost_model:
        try:
            return CostModel.load(cfg.cost_model)
        except FileNotFoundError:
            raise EvalError(f"cost_model {cfg.cost_model!r}: no such file (write one with `drafttrain profile`)") from None
        except (OSError, ValueError) as e:
            raise EvalError(f"cost_model {cfg.cost_model!r}: {_first_line(e)}") from None
    parts = {proposer_key(p): p for m in methods if m.adaptive for p in getattr(m.proposer, "parts", [m.proposer])}
    return load_or_measure(target, parts, progress=cfg.progress, batch_sizes=cost_batch_sizes(cfg))


def cost_batch_sizes(cfg: EvalConfig) -> tuple[int, ...]:
    """The batch sizes a measured cost model needs for this eval: 1, 2 and the powers of two up to
    the largest batch it runs, plus that batch (rows finish, so smaller batches occur too). Not
    1-16 regardless: on a 2-core AVX2 CPU the batch-16 half of that grid took 20+ minutes."""
    top = max([cfg.batch_size, *(cfg.sweep_batch_sizes if "batch_size" in cfg.sweeps else [])])
    return tuple(sorted({1, 2, top, *(b for b in (4, 8, 16, 32, 64) if b < top)}))


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def add_oracle(summaries: dict[str, MethodSummary], target, methods: list[Method], prompts: list[list[int]],
               categories: list[str], cost, *, temperature: float, **run_kw) -> None:
    """Adds `oracle` to every adaptive / hybrid method's summary: at T = 0 from an untimed,
    step-logged re-run of the same batches (eval/oracle.py); at T > 0 `applicable: false`."""
    todo = [m for m in methods if m.adaptive and m.name in summaries]
    if not todo:
        return
    logged = log_pass(target, todo, prompts, temperature=temperature, **run_kw) if temperature == 0 else {}
    for m in todo:
        summaries[m.name].oracle = analyze_calls(logged.get(m.name, []), prompts, categories, cost,
                                                 temperature=temperature,
                                                 measured_tokens_per_s=summaries[m.name].tokens_per_s)


def machine_info() -> Machine:
    """CPU / GPU model, thread count and library versions, for the report."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return Machine(cpu=cpu, cpu_count=os.cpu_count(), threads=torch.get_num_threads(),
                   gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                   python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                   platform=platform.platform())


def _log_run(tracker, run: Run, step: int) -> None:
    metrics = {}
    for name, m in run.methods.items():
        base = f"eval/T{run.temperature:g}/{name}"
        metrics[f"{base}/tokens_per_s"] = m.tokens_per_s
        for k, v in m.speedup.items():
            metrics[f"{base}/speedup_{k}"] = v
        if m.tau is not None:
            metrics[f"{base}/tau"] = m.tau
            metrics.update({f"{base}/acc_{i + 1}": a for i, a in enumerate(m.acceptance[:8])})
        if m.oracle is not None and m.oracle.applicable:
            metrics[f"{base}/tau_oracle"] = m.oracle.tau_oracle
            metrics[f"{base}/tokens_per_s_oracle"] = m.oracle.tokens_per_s_oracle
    tracker.log(metrics, step=step)


def _run_sweeps(cfg: EvalConfig, target, methods: list[Method], prompts: list[list[int]], categories: list[str],
                cost, kw: dict) -> dict[str, list[SweepRow]]:
    """Every sweep of `cfg.sweeps` at every temperature: kind -> rows (eval/sweeps.py)."""
    sweeps: dict[str, list[SweepRow]] = {}
    sweep_prompts = prompts[: cfg.sweep_prompts] if cfg.sweep_prompts else prompts
    values = {"gamma": cfg.sweep_gammas, "tree_budget": cfg.sweep_budgets, "batch_size": cfg.sweep_batch_sizes}
    for kind in cfg.sweeps:
        for temp in cfg.temperatures:
            def oracle(m, b, summary, temp=temp):
                logged = log_pass(target, [m], sweep_prompts, batch_size=b, temperature=temp, seed=cfg.seed,
                                  tree=cfg.tree_setting(), **kw)
                return analyze_calls(logged[m.name], sweep_prompts, categories, cost, temperature=temp,
                                     measured_tokens_per_s=summary.tokens_per_s)

            extra = {"fixed_gammas": cfg.sweep_fixed_gammas, "repeats": cfg.sweep_repeats,
                     "oracle": oracle if cfg.oracle and temp == 0 else None} if kind == "batch_size" else {}
            rows = run_sweep(kind, target, methods, sweep_prompts, categories, values=values[kind],
                             tree_setting=cfg.tree_setting, temperature=temp, seed=cfg.seed, tree=cfg.tree_setting(),
                             progress=cfg.progress, **extra, **kw)
            sweeps.setdefault(kind, []).extend(rows)
    return sweeps


def _results(cfg: EvalConfig, info, bench, prompts: list[list[int]], categories: list[str], **body) -> Results:
    """The report: its header (config, machine, target, benchmark; created now) around `body`
    (skipped, runs, sweeps)."""
    return Results(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), config=to_dict(cfg), machine=machine_info(),
        target=TargetInfo(spec=cfg.target, dtype=info.dtype, source=info.source, path=info.path),
        benchmark=BenchmarkInfo(name=cfg.bench, num_prompts=len(bench),
                                categories={c: categories.count(c) for c in sorted(set(categories))},
                                prompt_tokens_mean=sum(map(len, prompts)) / len(prompts)),
        **body)


def _engine_rows(cfg: EvalConfig, engine: VllmRuns | None, runs: list[Run], sweeps: dict[str, list[SweepRow]],
                 n: int, reference: dict[int, list[int]] | None):
    """The report's engine_baselines block (None without vLLM baselines)."""
    if engine is None:
        return None
    return engine_report(engine, runs, sweeps, num_prompts=n, sweep_prompts=sweep_prompt_count(cfg, n),
                         reference=reference)


def _install_linear_backend(cfg: EvalConfig, target) -> None:
    from drafttrain.decode.kernels import cpu_linear

    try:
        line = cpu_linear.setup(target, cfg.linear_backend, cfg.draft_weights)
    except ValueError as e:
        raise EvalError(str(e)) from None
    if cpu_linear.installed_backend(target) != "aten":
        print(line, flush=True)


def _add_speedups(summaries: dict, calls: dict, *, per_prompt: bool) -> None:
    """Tokens/s ratios vs each baseline; at batch 1 (a call is a prompt) also per prompt, with the
    bootstrap interval."""
    add_speedups(summaries, [b for b in SPEEDUP_BASELINES if b in summaries])
    if per_prompt:
        walls = {k: [c.wall_s for c in v] for k, v in calls.items()}
        emitted = {k: [sum(len(q) for q in c.sequences) for c in v] for k, v in calls.items()}
        add_prompt_speedups(summaries, walls, emitted)


def run_eval(cfg: EvalConfig) -> Results:
    """Runs the whole evaluation described by `cfg` and writes the report; returns it."""
    from tqdm.auto import tqdm

    from drafttrain.targets import load_target
    from drafttrain.tracking import make_tracker

    check_inputs(cfg)  # seconds, where a bad spec found after the target load would cost a load
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target, tokenizer, info = load_target(cfg.target, dtype=cfg.dtype)
    _install_linear_backend(cfg, target)
    bench = load_benchmark(cfg.bench, tokenizer, cfg.data, cfg.num_prompts)
    if not bench:
        raise EvalError(f"benchmark {cfg.bench!r} gave no prompts")
    prompts = [p.ids for p in bench]
    categories = [p.category for p in bench]
    methods, skipped = build_methods(cfg, target, tokenizer)
    eos = eos_ids(target, tokenizer)
    engine = run_vllm_baselines(cfg, info, target, prompts, eos) if requested(cfg) else None
    reference = None  # drafttrain's greedy target tokens per prompt, for the engine rows
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    kw = dict(max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k, top_p=cfg.top_p, eos=eos, pad_id=pad,
              gamma=cfg.gamma or None)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tracker = make_tracker(cfg.tracking, is_main=True, project=cfg.wandb_project, entity="", name=out_dir.name,
                           mode=cfg.wandb_mode, config=to_dict(cfg), run_dir=str(out_dir))

    if cfg.warmup:  # untimed: first-call allocations, lazy imports and builds
        warm = [0.0] + [t for t in cfg.temperatures if t > 0][:1]  # T > 0 loads the sampled path's code
        for temp in warm:
            for m in methods:
                run_call(target, m, [prompts[0]], temperature=temp, tree=cfg.tree_setting(),
                         **{**kw, "max_new_tokens": 4})

    n_batches = -(-len(prompts) // cfg.batch_size)
    per_batch = sum(1 for m in methods if not (m.batch1_only and cfg.batch_size > 1))
    bar = tqdm(total=len(cfg.temperatures) * n_batches * per_batch, desc="eval", unit="call", disable=not cfg.progress)

    def on_call(name, call):
        bar.set_postfix_str(name, refresh=False)
        bar.update(1)

    wants_oracle = cfg.oracle and 0 in cfg.temperatures and any(m.adaptive for m in methods)
    cost = cost_model_for(cfg, methods, target) if wants_oracle else None
    runs, tokens = [], []
    for step, temp in enumerate(cfg.temperatures):
        calls = run_benchmark(target, methods, prompts, batch_size=cfg.batch_size, temperature=temp, seed=cfg.seed,
                              tree=cfg.tree_setting(), on_call=on_call, **kw)
        summaries = {m.name: summarize(calls[m.name], prompts, categories, kind=m.kind) for m in methods
                     if m.name in calls}
        if engine is not None:  # vLLM's peer rows: its calls at this temperature and the eval's batch size
            summaries.update(engine.summaries_at(temp, cfg.batch_size, prompts, categories))
            calls.update(engine.calls_at(temp, cfg.batch_size, len(prompts)))
            reference = reference or ({p: s for c in calls.get("target", []) for p, s in zip(c.prompts, c.sequences)}
                                      if temp == 0 else None)
        _add_speedups(summaries, calls, per_prompt=cfg.batch_size == 1)
        for name, s in summaries.items():
            s.theory = theory(s, summaries.get("target")) if name != "target" else None
        if cfg.oracle:
            add_oracle(summaries, target, methods, prompts, categories, cost, temperature=temp,
                       batch_size=cfg.batch_size, seed=cfg.seed, tree=cfg.tree_setting(), **kw)
        check = greedy_check(target, calls, prompts, tolerance=cfg.near_tie) if temp == 0 else None
        runs.append(Run(temperature=temp, batch_size=cfg.batch_size, methods=summaries, greedy_check=check))
        _log_run(tracker, runs[-1], step)
        for name, cs in calls.items():
            for c in cs:
                for p, seq in zip(c.prompts, c.sequences):
                    tokens.append({"temperature": temp, "method": name, "prompt": p, "id": bench[p].id,
                                   "category": bench[p].category, "tokens": seq})
    bar.close()

    sweeps = _run_sweeps(cfg, target, methods, prompts, categories, cost, kw)

    results = _results(cfg, info, bench, prompts, categories, skipped=skipped, runs=runs, sweeps=sweeps,
                       engine_baselines=_engine_rows(cfg, engine, runs, sweeps, len(prompts), reference))
    t0 = time.perf_counter()
    write_report(results, out_dir, tokens)
    tracker.log({"eval/report_write_s": time.perf_counter() - t0})
    tracker.finish()
    return results
