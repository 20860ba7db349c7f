"""Sweeps: the same prompts rerun while one setting varies, target-only interleaved at each point.

    gamma        chain length 1..8 for every proposer          -> tau, acceptance, speedup vs gamma
    tree_budget  EAGLE-2 dynamic-tree token budget             -> tau, speedup vs budget
    batch_size   prompts per call 1..16 (throughput under load) -> tokens/s, speedup vs batch size

Each point is one `run_benchmark` whose methods include target-only decoding, so every speedup
is measured against a baseline timed in the same interleaved loop. Temperature is swept by
listing several `temperatures` (every sweep runs at each).

Deliberately not here: plotting (report.py), choosing the best setting for the user.
"""

from __future__ import annotations

from dataclasses import replace

from drafttrain.eval.metrics import summarize
from drafttrain.eval.runner import Method, run_benchmark

__all__ = ["run_sweep"]


def _point(summary: dict, base: dict) -> dict:
    row = {"tokens_per_s": summary["tokens_per_s"], "wall_s": summary["wall_s"],
           "speedup_vs_target": base["wall_s"] / summary["wall_s"] if summary["wall_s"] > 0 else 0.0}
    if "tau" in summary:
        row.update(tau=summary["tau"], acceptance=summary["acceptance"])
    return row


def run_sweep(kind: str, target, methods: list[Method], prompts: list[list[int]], categories: list[str], *,
              values: list[int], tree_setting, **run_kw) -> list[dict]:
    """Runs one sweep; returns rows {method, <kind>: value, tokens_per_s, speedup_vs_target, tau?}.

    Args:
        kind: "gamma", "tree_budget" or "batch_size".
        methods: engine methods to sweep (target-only is added; HF baselines are not swept).
        values: the setting's values.
        tree_setting: callable budget -> tree argument (for tree_budget).
        **run_kw: forwarded to run_benchmark (max_new_tokens, temperature, eos, ...).
    """
    target_m = Method("target", "engine")
    swept = [m for m in methods if m.kind == "engine" and m.proposer is not None]
    rows: list[dict] = []
    if kind == "batch_size":
        for b in values:
            calls = run_benchmark(target, [target_m, *swept], prompts, batch_size=b, **run_kw)
            sums = {k: summarize(v, prompts, categories) for k, v in calls.items()}
            rows += [{"method": k, "batch_size": b, **_point(s, sums["target"])} for k, s in sums.items()]
        return rows
    variants = []
    for m in swept:
        for v in values:
            over = {"gamma": v} if kind == "gamma" else {"tree": tree_setting(v)}
            variants.append((m.name, v, replace(m, name=f"{m.name}@{kind}={v}", **over)))
    run_kw.pop("batch_size", None)
    calls = run_benchmark(target, [target_m] + [x[2] for x in variants], prompts, batch_size=1, **run_kw)
    base = summarize(calls["target"], prompts, categories)
    for name, v, m in variants:
        rows.append({"method": name, kind: v, **_point(summarize(calls[m.name], prompts, categories), base)})
    return rows
