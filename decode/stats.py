"""Per-call decoding statistics: target forwards, τ, per-position acceptance, time split.

τ = tokens emitted per target forward, bonus token INCLUDED (the EAGLE convention), summed
over rows: a row counts the verification forwards it was active in. Prefill forwards are
counted separately and excluded from τ. Acceptance counts come from verification before any
EOS / max_new_tokens truncation (they measure the drafter, not the stopping rule).

Adaptive and hybrid proposers (proposers/scheduler.py, proposers/hybrid.py) also fill `chosen_lengths`,
`chosen_parts`, `parts_run`, `modelled_ms` and, with `speculative_generate(..., log_steps=True)`, `step_log`.

Deliberately not here: aggregation across calls or prompts, plotting, reports (eval/).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

__all__ = ["DecodeStats"]


@dataclass
class DecodeStats:
    """Counters of one `speculative_generate` call.

    Attributes:
        target_forwards: batched verification forwards of the target (prefill excluded).
        prefill_forwards: batched prefill forwards of the target.
        tokens_emitted: new tokens returned, all rows.
        row_forwards: verification forwards summed over rows while each row was active.
        accept_counts: accept_counts[d] = (row, step) pairs whose draft at depth d+1 was accepted.
        draft_counts: draft_counts[d] = (row, step) pairs that had a draft at depth d+1.
        time_draft / time_verify / time_prefill / time_other: seconds.
        per_row_tokens / per_row_forwards: per-row counts.
        chosen_lengths: adaptive / hybrid only: chosen_lengths[L] = (row, step) pairs verified
            with L drafts (draft nodes; a chain's length).
        chosen_parts: adaptive / hybrid only: {part name: (row, step) pairs verified with a
            non-empty draft of that part}.
        parts_run: adaptive / hybrid only: {part name: steps in which the part drafted} (a
            hybrid's skip rule keeps parts that cannot pay out of a step; see proposers/hybrid.py).
        modelled_ms: adaptive / hybrid with a cost model: the cost model's time of every step
            (drafting of the parts that ran + verification of the tree), summed.
        step_log: only with `log_steps=True` (adaptive / hybrid): one dict per active row per step,
            {"step", "row", "pos" (root position, prompt included), "emitted" (tokens emitted),
            "drafted" (drafts verified), "part" (name or None), "ran" (parts that drafted, as without logging), "proposals" {part name: the
            part's full untrimmed draft chain (a tree's first-child path), up to max_gamma}}.
    """

    target_forwards: int = 0
    prefill_forwards: int = 0
    tokens_emitted: int = 0
    row_forwards: int = 0
    accept_counts: list[int] = field(default_factory=list)
    draft_counts: list[int] = field(default_factory=list)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_prefill: float = 0.0
    time_other: float = 0.0
    per_row_tokens: list[int] = field(default_factory=list)
    per_row_forwards: list[int] = field(default_factory=list)
    chosen_lengths: list[int] = field(default_factory=list)
    chosen_parts: dict[str, int] = field(default_factory=dict)
    parts_run: dict[str, int] = field(default_factory=dict)
    modelled_ms: float = 0.0
    step_log: list[dict] | None = None

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward (bonus included)."""
        return self.tokens_emitted / max(self.row_forwards, 1)

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position: accepted / drafted."""
        return [a / d if d else 0.0 for a, d in zip(self.accept_counts, self.draft_counts)]

    @property
    def time_total(self) -> float:
        return self.time_draft + self.time_verify + self.time_prefill + self.time_other

    def record_step(self, depth_drafted: list[int], num_accepted: list[int], active: list[bool]) -> None:
        """Adds one verification step's acceptance, per active row."""
        self.target_forwards += 1
        for d, a, on in zip(depth_drafted, num_accepted, active):
            if not on:
                continue
            self.row_forwards += 1
            need = max(d, a)
            for lst in (self.accept_counts, self.draft_counts):
                lst.extend([0] * (need - len(lst)))
            for k in range(d):
                self.draft_counts[k] += 1
            for k in range(a):
                self.accept_counts[k] += 1

    def record_choice(self, drafts: int, part: str | None) -> None:
        """Counts one (row, step) verified with `drafts` drafts from `part` (None: no draft)."""
        self.chosen_lengths.extend([0] * (drafts + 1 - len(self.chosen_lengths)))
        self.chosen_lengths[drafts] += 1
        if part is not None and drafts > 0:
            self.chosen_parts[part] = self.chosen_parts.get(part, 0) + 1

    @contextmanager
    def timer(self, bucket: str):
        """Adds the wall time of the block to `time_<bucket>`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            name = f"time_{bucket}"
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_rates=self.acceptance_rates, time_total=self.time_total)
        return d
