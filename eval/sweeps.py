"""Sweeps: the same prompts rerun while one setting varies, target-only interleaved at each point.

    gamma        chain length 1..8 for every proposer          -> tau, acceptance, speedup vs gamma
    tree_budget  EAGLE-2 dynamic-tree token budget             -> tau, speedup vs budget
    batch_size   prompts per call 1..16 (throughput under load) -> tokens/s, speedup vs batch size

Each point is one `run_benchmark` whose methods include target-only decoding, so every speedup
is measured against a baseline timed in the same interleaved loop. Temperature is swept by
listing several `temperatures` (every sweep runs at each).

The batch_size sweep also compares adaptive speculation with fixed draft lengths. Its rows, per
batch size, by `kind`:

    target      target-only decoding
    fixed       a non-adaptive proposer at each chain length of `fixed_gammas` ("ngram@gamma=3")
    proposer    a non-adaptive proposer at its default length (when no fixed_gammas are given)
    best_fixed  derived: the fastest fixed length of that proposer at that batch size, chosen in
                hindsight ("ngram@best")
    adaptive    adaptive / hybrid proposers, with chosen_lengths and the margin against the best
                fixed length of their parts (tokens/s relative difference)
    oracle      derived (T = 0, oracle on): the hindsight bound along the adaptive method's own
                steps, in measured units (oracle.py); not a measurement

With `repeats` > 1 every batch size runs that many times (each repeat the whole interleaved loop,
adaptive proposers reset to cold before each), and each method's row is its median-time repeat,
with every repeat's tokens/s in `tokens_per_s_repeats`: one short call at batch 16 (~10 s on a
CPU) is at the mercy of the machine, the median of several is not.

Rows are `results.SweepRow`s (their fields, as results.json holds them: eval/results.py).

Deliberately not here: plotting (report.py), choosing the best setting for the user.
"""

from __future__ import annotations

from dataclasses import replace

from drafttrain.eval.metrics import summarize, throughput_ratio
from drafttrain.eval.results import MethodSummary, OracleBound, SweepCategory, SweepRow
from drafttrain.eval.runner import Method, run_benchmark

__all__ = ["run_sweep", "part_specs"]


def _point(summary: MethodSummary, base: MethodSummary, **head) -> SweepRow:
    """One method's row at one point; `head`: its method name, swept value and batch-sweep kind."""
    return SweepRow(**head, tokens_per_s=summary.tokens_per_s, wall_s=summary.wall_s,
                    speedup_vs_target=throughput_ratio(summary.tokens, summary.wall_s, base.tokens, base.wall_s),
                    tau=summary.tau, acceptance=summary.acceptance, chosen_lengths=summary.chosen_lengths,
                    chosen_parts=summary.chosen_parts, per_category=_categories(summary, base))


def _categories(summary: MethodSummary, base: MethodSummary) -> dict[str, SweepCategory] | None:
    """Per category tokens/s, speedup vs target and tau, when there is more than one category."""
    if len(summary.per_category) <= 1:
        return None
    out = {}
    for cat, v in summary.per_category.items():
        b = base.per_category.get(cat)
        ratio = throughput_ratio(v.tokens, v.wall_s, b.tokens, b.wall_s) if b is not None else 0.0
        out[cat] = SweepCategory(tokens_per_s=v.tokens_per_s, tau=v.tau, speedup_vs_target=ratio)
    return out


def part_specs(name: str) -> list[str]:
    """The proposer specs an adaptive / hybrid spec is built from: "adaptive:ngram" -> ["ngram"],
    "hybrid:ngram+runs/x" -> ["ngram", "runs/x"]; a plain spec -> [itself]."""
    for prefix in ("adaptive:", "hybrid:", "adaptive-hybrid:"):
        if name.startswith(prefix):
            return [p for part in name[len(prefix):].split("+") for p in part_specs(part)]
    return [name]


def run_sweep(kind: str, target, methods: list[Method], prompts: list[list[int]], categories: list[str], *,
              values: list[int], tree_setting, fixed_gammas: list[int] | None = None, oracle=None,
              repeats: int = 1, progress: bool = False, **run_kw) -> list[SweepRow]:
    """Runs one sweep; returns its rows (method, <kind>: value, tokens/s, speedup vs target, tau, ...).

    Args:
        kind: "gamma", "tree_budget" or "batch_size".
        methods: engine methods to sweep (target-only is added; HF baselines are not swept).
        values: the setting's values.
        tree_setting: callable budget -> tree argument (for tree_budget).
        fixed_gammas: batch_size sweep: chain lengths every non-adaptive proposer runs at.
        oracle: batch_size sweep: callable (adaptive Method, batch size, its MethodSummary) ->
            OracleBound or None (the harness re-runs the method untimed with step logs); adds an `oracle` row
            per adaptive method whose dict is applicable.
        repeats: batch_size sweep: timed runs per batch size (median per method).
        progress: show a progress bar with ETA (one tick per generate call).
        **run_kw: forwarded to run_benchmark (max_new_tokens, temperature, eos, ...).
    """
    from tqdm.auto import tqdm

    target_m = Method("target", "engine")
    swept = [m for m in methods if m.kind == "engine" and m.proposer is not None]
    n = len(prompts)
    if kind == "batch_size":
        per_method = 1 + sum(len(fixed_gammas or [1]) if not m.adaptive else 1 for m in swept)
        total = sum(-(-n // b) for b in values) * per_method * max(repeats, 1)
    else:
        total = n * (1 + len(swept) * len(values))
    temp = run_kw.get("temperature")
    bar = tqdm(total=total, desc=f"sweep {kind}" + (f" T={temp:g}" if temp is not None else ""), unit="call",
               disable=not progress)
    run_kw["on_call"] = lambda name, call: (bar.set_postfix_str(name, refresh=False), bar.update(1))
    try:
        if kind == "batch_size":
            rows = _batch_sweep(target, target_m, swept, prompts, categories, values, fixed_gammas or [], oracle,
                                max(repeats, 1), run_kw)
        else:
            rows = _value_sweep(kind, target, target_m, swept, prompts, categories, values, tree_setting, run_kw)
    finally:
        bar.close()
    for r in rows:
        r.temperature = temp
    return rows


def _value_sweep(kind: str, target, target_m: Method, swept: list[Method], prompts, categories, values,
                 tree_setting, run_kw) -> list[SweepRow]:
    rows: list[SweepRow] = []
    variants = []
    for m in swept:
        for v in values:
            over = {"gamma": v} if kind == "gamma" else {"tree": tree_setting(v)}
            variants.append((m.name, v, replace(m, name=f"{m.name}@{kind}={v}", **over)))
    run_kw.pop("batch_size", None)
    calls = run_benchmark(target, [target_m] + [x[2] for x in variants], prompts, batch_size=1, **run_kw)
    base = summarize(calls["target"], prompts, categories)
    for name, v, m in variants:
        rows.append(_point(summarize(calls[m.name], prompts, categories), base, method=name, **{kind: v}))
    return rows


def _batch_sweep(target, target_m: Method, swept: list[Method], prompts, categories, values, fixed_gammas, oracle,
                 repeats, run_kw) -> list[SweepRow]:
    run_kw.pop("batch_size", None)
    variants: list[tuple[Method, dict]] = []  # (method to run, row fields)
    for m in swept:
        if m.adaptive:
            variants.append((m, {"kind": "adaptive"}))
        elif fixed_gammas:
            variants += [(replace(m, name=f"{m.name}@gamma={g}", gamma=g), {"kind": "fixed", "proposer": m.name,
                                                                           "gamma": g}) for g in fixed_gammas]
        else:
            variants.append((m, {"kind": "proposer"}))
    rows: list[SweepRow] = []
    for b in values:
        runs: list[dict[str, MethodSummary]] = []
        for _ in range(repeats):
            for m, _ in variants:  # every batch size and repeat starts cold: no point depends on the order
                if hasattr(m.proposer, "reset"):
                    m.proposer.reset()
            calls = run_benchmark(target, [target_m, *(v[0] for v in variants)], prompts, batch_size=b, **run_kw)
            runs.append({k: summarize(v, prompts, categories) for k, v in calls.items()})
        sums = {k: sorted((r[k] for r in runs), key=lambda x: x.wall_s)[(len(runs) - 1) // 2] for k in runs[0]}
        base = sums["target"]
        point = [_point(base, base, method="target", batch_size=b, kind="target")]
        point += [_point(sums[m.name], base, method=m.name, batch_size=b, **extra) for m, extra in variants]
        if repeats > 1:
            for r in point:
                r.tokens_per_s_repeats = [x[r.method].tokens_per_s for x in runs]
        best = _best_fixed(point)
        for r in point:
            if r.kind == "adaptive":
                _add_margin(r, [best[p] for p in part_specs(r.method) if p in best] or list(best.values()))
        rows += point + list(best.values())
        if oracle is not None:
            rows += [_oracle_row(r, oracle(m, b, sums[m.name]), base, b)
                     for (m, _), r in zip(variants, point[1:]) if r.kind == "adaptive"]
    return [r for r in rows if r is not None]


def _best_fixed(point: list[SweepRow]) -> dict[str, SweepRow]:
    """proposer -> its fastest fixed-length row at this batch size, as a `best_fixed` row."""
    best: dict[str, SweepRow] = {}
    for r in point:
        if r.kind == "fixed" and (r.proposer not in best or r.tokens_per_s > best[r.proposer].tokens_per_s):
            best[r.proposer] = r
    return {p: replace(r, method=f"{p}@best", kind="best_fixed") for p, r in best.items()}


def _add_margin(adaptive: SweepRow, parts: list[SweepRow]) -> None:
    """The adaptive row against the fastest best-fixed row of its parts (tokens/s ratio - 1)."""
    if not parts:
        return
    top = max(parts, key=lambda x: x.tokens_per_s)
    adaptive.best_fixed = f"{top.proposer}@gamma={top.gamma}"
    adaptive.best_fixed_tokens_per_s = top.tokens_per_s
    adaptive.margin_vs_best_fixed = adaptive.tokens_per_s / top.tokens_per_s - 1.0 if top.tokens_per_s > 0 else 0.0


def _oracle_row(adaptive: SweepRow, res: OracleBound | dict | None, base: MethodSummary, b: int) -> SweepRow | None:
    """The adaptive method's bound as a row (None when it does not apply); a dict `res` is read as
    an OracleBound."""
    res = OracleBound.from_dict(res) if isinstance(res, dict) else res
    if res is None or not res.applicable:
        return None
    tps = res.tokens_per_s_oracle
    return SweepRow(method=f"oracle[{adaptive.method}]", batch_size=b, kind="oracle", of=adaptive.method,
                    tokens_per_s=tps, speedup_vs_target=tps / base.tokens_per_s if base.tokens_per_s > 0 else 0.0,
                    tau=res.tau_oracle, oracle=res)
