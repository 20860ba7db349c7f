"""The oracle bound in hindsight for adaptive and hybrid speculation, from greedy step logs.

Input: one greedy (T = 0) generate call's final new tokens per row and its step log
(`speculative_generate(..., log_steps=True)`: one entry per active row per step with the root
position, the tokens emitted and drafted, the part used and every part's full draft chain).
At T = 0 the target's output does not depend on the drafts, so for each logged (row, step) and
each part p the hindsight accepted length a_p is known: the longest prefix of p's chain that
equals the final output after the root.

    tau_oracle          per (row, step) 1 + max_p a_p: best part, drafting exactly what is accepted
    tokens/s, oracle    the best any per-step chooser of parts and length could reach over these
                        steps under the cost model. Per batched step it picks the parts S to run
                        and a length cap L; row b emits 1 + max_{p in S} min(a_bp, L) and the step
                        costs verify_time(B, 1 + longest draft) + sum_{p in S} of p's chain cost
                        at its longest draft (`planning.chain_ms`: its call's own part + draft_time
                        per step). sum tokens / sum ms is maximised exactly
                        (Dinkelbach: per step maximise tokens - lambda ms, lambda = ratio reached,
                        repeat until it stops rising).
    tokens/s, achieved  the steps as run, costed by the same model (the like-for-like reference);
                        the measured tokens/s times oracle/achieved is the bound in measured units
    fixed               per part and length g: always draft g tokens with that part, same steps;
                        the best g in hindsight per part
    target              target-only decoding of the same tokens under the cost model

The bound is computed ALONG THE TRAJECTORY ACTUALLY VISITED: only the root positions this
method reached are scored, and a chooser that accepted more would have visited other ones.
It bounds per-step choices over these steps, not decoding in general. At batch > 1 a step
costs a forward over its active rows only: the engine drops finished rows from the batch
(`compact=True`), in the bound as in the run; target-only decoding is costed the same way. Proposals are chains (a tree's first-child path), so a tree method's achieved
figure can exceed what its logged chain explains. At T > 0 the target's tokens depend on the
draft, so there is no hindsight: `not_applicable` says so.

The result is a `results.OracleBound` (its fields, as results.json holds them: eval/results.py).

Deliberately not here: running anything (runner.py), the cost model itself
(drafttrain.decode.costmodel: `verify_time(batch, tokens_per_row)` and `draft_time(name, batch)`,
milliseconds), tables and plots (report.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import combinations
from typing import Protocol

from drafttrain.decode.planning import chain_ms
from drafttrain.eval.results import FixedLength, OracleBound, OracleCategory, OracleChoice, OracleRates

__all__ = ["CostModelLike", "RowStep", "Step", "CallSteps", "hindsight_accepted", "visited_steps",
           "oracle_figures", "analyze_calls", "not_applicable", "NOT_APPLICABLE_SAMPLED"]

NOT_APPLICABLE_SAMPLED = ("temperature > 0: the target's tokens depend on the drafts, so there is no "
                          "hindsight; the oracle bound is computed at T = 0 only")


class CostModelLike(Protocol):
    """What the bound needs from `drafttrain.decode.costmodel.CostModel` (milliseconds)."""

    def verify_time(self, batch: int, tokens_per_row: int) -> float: ...

    def draft_time(self, name: str, batch: int) -> float: ...


@dataclass
class RowStep:
    """One active row at one step, scored in hindsight.

    Attributes:
        row: row in the batch.
        category: benchmark category of the row's prompt.
        emitted / drafted / part: what the method did (part None: no draft).
        remaining: tokens of the final output after the root (an upper cap on what a step emits).
        accepted: part -> hindsight accepted length of its chain.
        proposed: part -> length of its chain.
    """

    row: int
    category: str
    emitted: int
    drafted: int
    part: str | None
    remaining: int
    accepted: dict[str, int] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)


@dataclass
class Step:
    """One batched target forward: its active rows."""

    rows: list[RowStep]


@dataclass
class CallSteps:
    """One generate call: batch size, new tokens per row, its steps."""

    batch: int
    lengths: list[int]
    steps: list[Step]


def hindsight_accepted(proposal: list[int], continuation: list[int]) -> int:
    """Length of the longest prefix of `proposal` equal to `continuation` (what greedy
    verification accepts)."""
    n = 0
    for a, b in zip(proposal, continuation):
        if a != b:
            break
        n += 1
    return n


def visited_steps(step_log: list[dict], sequences: list[list[int]], prompt_lens: list[int],
                  categories: list[str] | None = None) -> CallSteps:
    """Scores one greedy call's step log against its final outputs.

    Args:
        step_log: `DecodeStats.step_log`: dicts {row, pos (root position, prompt included),
            emitted, drafted, part, proposals: {part: draft chain}}, rows in order within a step
            (an optional `step` key groups entries; else a new step starts when `row` does not rise).
        sequences: new tokens per row (the call's final output).
        prompt_lens: unpadded prompt length per row.
        categories: benchmark category per row (default "all").

    Returns:
        CallSteps with every (row, step) scored.
    """
    cats = categories or ["all"] * len(sequences)
    steps: list[Step] = []
    last_row, last_step = None, None
    for e in step_log:
        b = int(e["row"])
        new = e["step"] != last_step if "step" in e else last_row is None or b <= last_row
        if new or not steps:
            steps.append(Step([]))
        last_row, last_step = b, e.get("step")
        cont = sequences[b][int(e["pos"]) + 1 - prompt_lens[b]:]  # final output after the root
        props = {str(p): list(c) for p, c in (e.get("proposals") or {}).items()}
        steps[-1].rows.append(RowStep(
            row=b, category=cats[b], emitted=int(e["emitted"]), drafted=int(e["drafted"]),
            part=e.get("part") or None, remaining=len(cont),
            accepted={p: hindsight_accepted(c, cont) for p, c in props.items()},
            proposed={p: len(c) for p, c in props.items()}))
    return CallSteps(batch=len(sequences), lengths=[len(s) for s in sequences], steps=steps)


def not_applicable(reason: str = NOT_APPLICABLE_SAMPLED) -> OracleBound:
    """The oracle entry of a run where the bound does not exist (sampling)."""
    return OracleBound(applicable=False, reason=reason)


# ---- costing ----------------------------------------------------------------------------------
class _Costs:
    """Memoised cost model lookups (ms)."""

    def __init__(self, cost: CostModelLike):
        self.cost, self._v, self._d = cost, {}, {}

    def verify(self, batch: int, width: int) -> float:
        if (batch, width) not in self._v:
            self._v[batch, width] = float(self.cost.verify_time(batch, width))
        return self._v[batch, width]

    def draft(self, part: str, batch: int, length: int) -> float:
        if (part, batch, length) not in self._d:  # "name#i": the i-th of two parts with one cost key
            self._d[part, batch, length] = float(chain_ms(self.cost, part.split("#")[0], batch, length))
        return self._d[part, batch, length]


def _step_ms(costs: _Costs, batch: int, drafts: list[tuple[str | None, int]]) -> float:
    """verify(B, 1 + longest draft) + per part used: its call's own part + draft_time x its longest draft."""
    longest: dict[str, int] = {}
    for part, d in drafts:
        if part is not None and d > 0:
            longest[part] = max(longest.get(part, 0), d)
    width = 1 + max((d for _, d in drafts), default=0)
    return costs.verify(batch, width) + sum(costs.draft(p, batch, d) for p, d in longest.items())


def _options(step: Step, batch: int, parts: list[str], costs: _Costs) -> list[tuple[float, float, list]]:
    """Every (tokens, ms, per-row (part, length)) a hindsight chooser could pick at this step:
    a set of parts to run x a length cap (cap 0 = no draft)."""
    rows = step.rows
    opts = [(float(sum(min(1, r.remaining) for r in rows)), costs.verify(batch, 1), [(None, 0)] * len(rows))]
    here = [p for p in parts if any(r.accepted.get(p, 0) for r in rows)]
    subsets = [s for k in range(1, len(here) + 1) for s in combinations(here, k)] if len(here) <= 4 else \
        [(p,) for p in here] + [tuple(here)]
    for subset in subsets:
        cheap_first = sorted(subset, key=lambda p: costs.draft(p, batch, 1))
        top = max(r.accepted.get(p, 0) for r in rows for p in subset)
        for cap in range(1, top + 1):
            choice = []
            for r in rows:
                best = max(cheap_first, key=lambda p: min(r.accepted.get(p, 0), cap))  # ties: cheaper
                choice.append((best, min(r.accepted.get(best, 0), cap)))
            tokens = sum(min(1 + d, r.remaining) for r, (_, d) in zip(rows, choice))
            opts.append((float(tokens), _step_ms(costs, batch, choice), choice))
    return opts


def _best_ratio(options: list[list[tuple[float, float, list]]]) -> tuple[float, list[int]]:
    """max over one option per step of sum tokens / sum ms (Dinkelbach); returns (ratio, picks)."""
    lam, picks = 0.0, [0] * len(options)
    for _ in range(100):
        picks = [max(range(len(o)), key=lambda i, o=o: (o[i][0] - lam * o[i][1], -o[i][1])) for o in options]
        tok = sum(o[i][0] for o, i in zip(options, picks))
        ms = sum(o[i][1] for o, i in zip(options, picks))
        new = tok / ms if ms > 0 else 0.0
        if new <= lam * (1 + 1e-12):
            break
        lam = new
    return lam, picks


def _per_s(tokens: float, ms: float) -> float:
    return 1000.0 * tokens / ms if ms > 0 else 0.0


def oracle_figures(calls: list[CallSteps], cost: CostModelLike, *,
                   measured_tokens_per_s: float | None = None) -> OracleBound:
    """The oracle bound, the achieved figure and the fixed-length baselines over visited steps.

    Args:
        calls: `visited_steps` of each greedy call of one method.
        cost: the cost model (verify_time / draft_time in ms).
        measured_tokens_per_s: the method's measured tokens/s; when given, the bound is also
            expressed in measured units (measured x oracle / achieved under the model).

    Returns:
        An applicable `OracleBound` (its fields: eval/results.py). Tokens/s "model" figures come
        from the cost model.
    """
    costs = _Costs(cost)
    parts = sorted({p for c in calls for s in c.steps for r in s.rows for p in r.proposed})
    flat = [(len(s.rows), s) for c in calls for s in c.steps if s.rows]  # finished rows are dropped
    row_steps = sum(len(s.rows) for _, s in flat)

    target_tok = sum(sum(c.lengths) for c in calls)
    target_ms = sum(costs.verify(sum(n > t for n in c.lengths), 1)  # rows still generating at step t
                    for c in calls for t in range(max(c.lengths, default=0)))

    achieved = [(float(sum(r.emitted for r in s.rows)), _step_ms(costs, b, [(r.part, r.drafted) for r in s.rows]))
                for b, s in flat]
    options = [_options(s, b, parts, costs) for b, s in flat]
    ratio, picks = _best_ratio(options)
    cat, lengths, chosen_parts = _tally(flat, achieved, options, picks)

    a_tok, a_ms = sum(t for t, _ in achieved), sum(m for _, m in achieved)
    o_tok = sum(o[i][0] for o, i in zip(options, picks))
    o_ms = sum(o[i][1] for o, i in zip(options, picks))
    target = _per_s(target_tok, target_ms)
    rates = OracleRates(target=target, achieved=_per_s(a_tok, a_ms), oracle=ratio * 1000.0)
    over = (o_tok / o_ms) / (a_tok / a_ms) if a_tok > 0 and o_ms > 0 else 0.0
    return OracleBound(
        applicable=True, along="the steps this method visited (T = 0); per-step hindsight choices, cost-model time",
        parts=parts, steps=len(flat), row_steps=row_steps,
        tau_achieved=a_tok / max(row_steps, 1),
        tau_oracle=sum(c["oracle_tau_tok"] for c in cat.values()) / max(row_steps, 1),
        tokens_per_s_model=rates, oracle_over_achieved=over,
        oracle_choice=OracleChoice(lengths=[lengths[k] for k in range(max(lengths, default=-1) + 1)],
                                   parts=dict(sorted(chosen_parts.items()))),
        fixed={p: _fixed(flat, p, costs, target) for p in parts},
        speedup_model=OracleRates(achieved=rates.achieved / target if target > 0 else 0.0,
                                  oracle=rates.oracle / target if target > 0 else 0.0),
        tokens_per_s_measured=measured_tokens_per_s,
        tokens_per_s_oracle=None if measured_tokens_per_s is None else measured_tokens_per_s * over,
        per_category={k: OracleCategory(row_steps=int(v["row_steps"]), tau_achieved=v["emitted"] / v["row_steps"],
                                        tau_oracle=v["oracle_tau_tok"] / v["row_steps"],
                                        tokens_per_s_model_achieved=_per_s(v["emitted"], v["achieved_ms"]),
                                        tokens_per_s_model_oracle=_per_s(v["oracle_tok"], v["oracle_ms"]))
                      for k, v in sorted(cat.items())},
    )


def _tally(flat: list[tuple[int, Step]], achieved: list[tuple[float, float]], options: list, picks: list[int]):
    """Per category sums over the (row, step) pairs (a batched step's time shared by its rows),
    and the oracle's chosen lengths and parts: (categories, lengths, parts)."""
    cat: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    lengths: Counter = Counter()
    chosen_parts: Counter = Counter()
    for (_, s), (_, a_ms), o, i in zip(flat, achieved, options, picks):
        o_ms, choice = o[i][1], o[i][2]
        for r, (part, d) in zip(s.rows, choice):
            c = cat[r.category]
            c["row_steps"] += 1
            c["emitted"] += r.emitted
            c["oracle_tau_tok"] += min(1 + max(r.accepted.values(), default=0), r.remaining)
            c["oracle_tok"] += min(1 + d, r.remaining)
            c["achieved_ms"] += a_ms / len(s.rows)
            c["oracle_ms"] += o_ms / len(s.rows)
            lengths[d] += 1
            chosen_parts[part or "none"] += 1
    return cat, lengths, chosen_parts


def analyze_calls(calls: list, prompt_ids: list[list[int]], categories: list[str], cost: CostModelLike | None, *,
                  temperature: float, measured_tokens_per_s: float | None = None) -> OracleBound:
    """`oracle_figures` over one method's runner calls (`metrics.Call` with a step log in stats).

    Returns `not_applicable(...)` at T > 0, without a cost model, or when no call has a step log.
    """
    if temperature > 0:
        return not_applicable()
    if cost is None:
        return not_applicable("no cost model (give cost_model=PATH or use an adaptive / hybrid proposer)")
    scored = [visited_steps(c.stats["step_log"], c.sequences, [len(prompt_ids[p]) for p in c.prompts],
                            [categories[p] for p in c.prompts])
              for c in calls if c.stats is not None and c.stats.get("step_log")]
    if not scored:
        return not_applicable("the engine returned no step log (log_steps=True)")
    try:
        return oracle_figures(scored, cost, measured_tokens_per_s=measured_tokens_per_s)
    except KeyError as e:  # a part the cost model has no draft cost for
        return not_applicable(str(e.args[0]) if e.args else "the cost model lacks a part")


def _fixed(flat: list[tuple[int, Step]], part: str, costs: _Costs, target: float) -> FixedLength:
    """Always `part` with g drafts (g = 1 .. its longest chain) over the same steps; best g."""
    longest = max((r.proposed.get(part, 0) for _, s in flat for r in s.rows), default=0)
    by_gamma, taus = {}, {}
    rows = sum(len(s.rows) for _, s in flat)
    for g in range(1, longest + 1):
        tok = ms = 0.0
        for b, s in flat:
            drafts = [(part, min(r.proposed.get(part, 0), g)) for r in s.rows]
            tok += sum(min(1 + min(r.accepted.get(part, 0), g), r.remaining) for r in s.rows)
            ms += _step_ms(costs, b, drafts)
        by_gamma[g], taus[g] = _per_s(tok, ms), tok / max(rows, 1)
    if not by_gamma:
        return FixedLength(best_gamma=None, tokens_per_s_model=0.0, tau=0.0, speedup_model=0.0, by_gamma={})
    best = max(by_gamma, key=by_gamma.get)
    return FixedLength(best_gamma=best, tokens_per_s_model=by_gamma[best], tau=taus[best],
                       speedup_model=by_gamma[best] / target if target > 0 else 0.0,
                       by_gamma={str(g): v for g, v in by_gamma.items()})
