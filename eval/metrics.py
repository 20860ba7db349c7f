"""Metrics of one evaluation: pure functions over the calls the runner recorded.

A `Call` is one generate call of one method on one batch of prompts. From a method's calls we
compute:

    tau          tokens emitted per target forward, BONUS TOKEN INCLUDED (EAGLE convention):
                 sum of tokens / sum of per-row verification forwards; prefill excluded.
                 Target-only decoding has tau = 1 by construction.
    tau_mean/std per-prompt tau, mean and standard deviation (the spread over prompts)
    acceptance   per draft position k (1-based): P(draft k accepted) = accepted_k / drafted_k
    tokens_per_s all new tokens / all wall time (prefill included)
    speedup      baseline wall time / method wall time over the same prompts
    time_split   seconds in draft / verify / prefill / other (engine methods)
    chosen_lengths / chosen_parts   adaptive and hybrid proposers: how many (row, step) pairs
                 verified a draft of each length / came from each part (summed over calls)
    theory       REFERENCES.md: alpha (position-1 acceptance), gamma, c (draft cost per token /
                 target-only step), predicted tau (1 - a^(g+1)) / (1 - a), predicted speedup
                 (1 - a^(g+1)) / ((1 - a)(g c + 1)), and the same with the measured tau
    per_category the same per benchmark category (at batch > 1 a call's wall time is split
                 between its rows in proportion to their tokens)
    repetition   fraction of repeated 4-grams in each output, fraction of its 4-grams found in
                 the prompt (copy-friendly outputs flatter n-gram drafters)

Each method's figures come back as a `results.MethodSummary` (the report's typed schema).

Deliberately not here: running models (runner.py), near-tie checks (they need the target), the
report's schema (results.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from drafttrain.eval.results import CategorySummary, MethodSummary, Repetition, Spread, Theory, TimeSplit

__all__ = ["Call", "mean_std", "repetition", "summarize", "add_speedups", "add_prompt_speedups", "speedup_ci95", "throughput_ratio", "theory",
           "first_divergence", "iid_tau", "iid_speedup"]


@dataclass
class Call:
    """One generate call of one method.

    Attributes:
        method: method name ("target", "ngram", "hf", ...).
        prompts: indices of the benchmark prompts in the batch.
        sequences: new token ids per row (EOS included when hit).
        wall_s: wall time of the call.
        stats: `DecodeStats.as_dict()` for engine methods, None for HF baselines.
    """

    method: str
    prompts: list[int]
    sequences: list[list[int]]
    wall_s: float
    stats: dict | None = None
    extra: dict = field(default_factory=dict)


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation (0, 0 for an empty list)."""
    if not xs:
        return 0.0, 0.0
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def repetition(output: list[int], prompt: list[int], n: int = 4) -> tuple[float, float]:
    """(fraction of the output's n-grams that repeat an earlier one of the output,
    fraction of the output's n-grams that occur in the prompt). (0, 0) when too short."""
    grams = _ngrams(output, n)
    if not grams:
        return 0.0, 0.0
    seen: set = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    in_prompt = set(_ngrams(prompt, n))
    return repeats / len(grams), sum(g in in_prompt for g in grams) / len(grams)


def first_divergence(ref: list[int], out: list[int]) -> int | None:
    """First index where two outputs differ (a length difference counts); None if identical."""
    for i, (a, b) in enumerate(zip(ref, out)):
        if a != b:
            return i
    return None if len(ref) == len(out) else min(len(ref), len(out))


def iid_tau(alpha: float, gamma: float) -> float:
    """Expected tokens per cycle with i.i.d. acceptance alpha and gamma drafts (bonus included)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def iid_speedup(alpha: float, gamma: float, c: float) -> float:
    """(1 - a^(g+1)) / ((1 - a)(g c + 1)): speedup over target-only decoding (Leviathan et al.)."""
    return iid_tau(alpha, gamma) / (gamma * c + 1.0)


def _add(into: list, new: list) -> None:
    into.extend([0] * (len(new) - len(into)))
    for i, v in enumerate(new):
        into[i] += v


def summarize(calls: list[Call], prompt_ids: list[list[int]], categories: list[str], *,
              kind: str | None = None) -> MethodSummary:
    """Aggregates one method's calls (see the module docstring for each field); `kind` is the
    method's ("engine" / "hf"), for the report."""
    tokens = sum(len(s) for c in calls for s in c.sequences)
    wall = sum(c.wall_s for c in calls)
    engine = [c for c in calls if c.stats is not None]
    out = MethodSummary(kind=kind, num_prompts=sum(len(c.prompts) for c in calls), tokens=tokens, wall_s=wall,
                        tokens_per_s=tokens / wall if wall > 0 else 0.0, repetition=_repetition(calls, prompt_ids))
    if engine:
        _add_engine_figures(out, engine)
        _add_choices(out, engine)
    out.per_category = _per_category(calls, categories, engine=bool(engine))
    return out


def _repetition(calls: list[Call], prompt_ids: list[list[int]]) -> Repetition:
    """Mean repeated-4-gram fraction and prompt overlap over every output."""
    pairs = [repetition(seq, prompt_ids[p]) for c in calls for p, seq in zip(c.prompts, c.sequences)]
    return Repetition(repeated_4gram_frac=mean_std([r for r, _ in pairs])[0],
                      prompt_4gram_overlap=mean_std([o for _, o in pairs])[0])


def _add_engine_figures(out: MethodSummary, engine: list[Call]) -> None:
    """tau, acceptance per position, forwards and the time split, from the engine's stats."""
    split = {k: 0.0 for k in ("draft", "verify", "prefill", "other")}
    acc: list[int] = []
    drafted: list[int] = []
    taus: list[float] = []
    row_fwd = fwd = 0
    for c in engine:
        for k in split:
            split[k] += c.stats[f"time_{k}"]
        _add(acc, c.stats["accept_counts"])
        _add(drafted, c.stats["draft_counts"])
        row_fwd += c.stats["row_forwards"]
        fwd += c.stats["target_forwards"]
        taus += [t / max(f, 1) for t, f in zip(c.stats["per_row_tokens"], c.stats["per_row_forwards"])]
    out.tau = out.tokens / max(row_fwd, 1)
    out.tau_mean, out.tau_std = mean_std(taus)
    out.tau_per_prompt, out.target_forwards, out.row_forwards = taus, fwd, row_fwd
    out.accept_counts, out.draft_counts = acc, drafted
    out.acceptance = [a / d if d else 0.0 for a, d in zip(acc, drafted)]
    out.drafted_per_cycle = sum(drafted) / max(row_fwd, 1)
    out.time_split = TimeSplit(**split)


def _add_choices(out: MethodSummary, engine: list[Call]) -> None:
    """chosen_lengths / chosen_parts, summed over calls (filled by adaptive / hybrid proposers only)."""
    lengths: list[int] = []
    parts: dict[str, int] = defaultdict(int)
    for c in engine:
        _add(lengths, c.stats.get("chosen_lengths") or [])
        for k, v in (c.stats.get("chosen_parts") or {}).items():
            parts[k] += v
    if sum(lengths) or parts:
        out.chosen_lengths, out.chosen_parts = lengths, dict(sorted(parts.items()))


def _per_category(calls: list[Call], categories: list[str], *, engine: bool) -> dict[str, CategorySummary]:
    """Tokens, time, prompts (and row forwards, tau for engine methods) per benchmark category; at
    batch > 1 a call's wall time is split between its rows in proportion to their tokens."""
    per_cat: dict[str, CategorySummary] = defaultdict(lambda: CategorySummary(row_forwards=0 if engine else None))
    for c in calls:
        call_tokens = max(sum(len(s) for s in c.sequences), 1)
        for row, (p, seq) in enumerate(zip(c.prompts, c.sequences)):
            cat = per_cat[categories[p]]
            cat.tokens += len(seq)
            cat.wall_s += c.wall_s * (len(seq) / call_tokens if len(c.sequences) > 1 else 1.0)
            cat.num_prompts += 1
            if c.stats is not None:
                cat.row_forwards += c.stats["per_row_forwards"][row]
    for v in per_cat.values():
        v.tokens_per_s = v.tokens / v.wall_s if v.wall_s > 0 else 0.0
        v.tau = v.tokens / max(v.row_forwards, 1) if engine else None
    return dict(sorted(per_cat.items()))


def throughput_ratio(tokens: float, wall: float, base_tokens: float, base_wall: float) -> float:
    """(tokens / wall) / (base_tokens / base_wall): the speedup in tokens per second. Equal to the
    wall-time ratio when both emitted the same tokens (greedy); at T > 0 samples end at different
    lengths, and a wall-time ratio would credit a method for the tokens it did not write."""
    if wall <= 0 or base_tokens <= 0 or base_wall <= 0:
        return 0.0
    return (tokens / wall) / (base_tokens / base_wall)


def add_speedups(methods: dict[str, MethodSummary], baselines: list[str]) -> None:
    """Sets `speedup` {vs_<baseline>: method tokens/s / baseline tokens/s} on every method, overall
    and per category."""
    for m in methods.values():
        m.speedup = {}
        for b in baselines:
            if b not in methods or m.wall_s <= 0:
                continue
            base = methods[b]
            m.speedup[f"vs_{b}"] = throughput_ratio(m.tokens, m.wall_s, base.tokens, base.wall_s)
            for cat, v in m.per_category.items():
                bc = base.per_category.get(cat)
                if bc is not None and v.wall_s > 0:
                    v.speedup = v.speedup if v.speedup is not None else {}
                    v.speedup[f"vs_{b}"] = throughput_ratio(v.tokens, v.wall_s, bc.tokens, bc.wall_s)


def add_prompt_speedups(methods: dict[str, MethodSummary], walls: dict[str, list[float]],
                        tokens: dict[str, list[int]] | None = None) -> None:
    """Per-prompt speedup spread vs target-only decoding from per-call wall times (and tokens:
    tokens/s ratios; without them, wall-time ratios), and a 95% bootstrap interval of the overall
    speedup (the calls are the prompts at batch 1)."""
    if "target" not in walls:
        return
    tok = tokens or {k: [1] * len(w) for k, w in walls.items()}
    for name, w in walls.items():
        if name in methods and len(w) == len(walls["target"]):
            t, bt, bw = tok[name], tok["target"], walls["target"]
            mu, sd = mean_std([throughput_ratio(t[i], w[i], bt[i], bw[i]) for i in range(len(w)) if w[i] > 0])
            methods[name].speedup_per_prompt_vs_target = Spread(mean=mu, std=sd)
            if name != "target" and len(w) >= 2:
                methods[name].speedup_ci95_vs_target = speedup_ci95(bw, w, base_tokens=bt, tokens=t)


def speedup_ci95(base: list[float], walls: list[float], *, base_tokens: list[int] | None = None,
                 tokens: list[int] | None = None, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the overall speedup, resampling the paired calls
    (prompts) with replacement: how much the speedup owes to which prompts were drawn. With token
    counts the speedup is (sum tokens / sum walls) / (sum base_tokens / sum base); without, the
    wall-time ratio sum(base) / sum(walls)."""
    g = torch.Generator().manual_seed(seed)
    b, w = torch.tensor(base, dtype=torch.float64), torch.tensor(walls, dtype=torch.float64)
    bt = torch.ones_like(b) if base_tokens is None else torch.tensor(base_tokens, dtype=torch.float64)
    t = torch.ones_like(w) if tokens is None else torch.tensor(tokens, dtype=torch.float64)
    idx = torch.randint(0, len(b), (resamples, len(b)), generator=g)
    ratios = (t[idx].sum(1) / w[idx].sum(1).clamp_min(1e-12)) / (bt[idx].sum(1) / b[idx].sum(1).clamp_min(1e-12))
    lo, hi = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [round(lo, 4), round(hi, 4)]


def theory(method: MethodSummary, target: MethodSummary | None) -> Theory | None:
    """Predicted vs measured speedup over target-only decoding, from measured acceptance and costs.

    Costs are per cycle (one target forward): t_step = target-only seconds per forward (draft +
    verify + other of the target run); the method's draft / verify / other seconds per forward.
    c = draft seconds per drafted token / t_step (the formula's draft-to-target cost ratio).
    `verify_ratio` = method's verify forward / target-only step: > 1 when verifying gamma+1
    tokens costs more than decoding one, which the formula ignores.
    """
    if method.tau is None or target is None or target.tau is None or target.target_forwards == 0:
        return None
    ts = target.time_split
    t_step = (ts.draft + ts.verify + ts.other) / target.target_forwards
    f = max(method.target_forwards, 1)
    sp = method.time_split
    draft, verify, other = sp.draft / f, sp.verify / f, sp.other / f
    gamma = method.drafted_per_cycle
    c = (draft / gamma) / t_step if gamma > 0 and t_step > 0 else 0.0
    alpha = method.acceptance[0] if method.acceptance else 0.0
    return Theory(
        alpha=alpha, gamma=gamma, c=c, t_step_s=t_step,
        draft_s_per_cycle=draft, verify_s_per_cycle=verify, other_s_per_cycle=other,
        verify_ratio=verify / t_step if t_step > 0 else 0.0,
        tau_iid=iid_tau(alpha, gamma),
        speedup_iid=iid_speedup(alpha, gamma, c),
        speedup_formula_measured_tau=method.tau / (gamma * c + 1.0),
        speedup_cost_model=method.tau * t_step / (draft + verify + other) if draft + verify + other > 0 else 0.0,
    )
