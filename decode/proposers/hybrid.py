"""Hybrid proposer: several proposers draft each step; each row verifies the most promising one.

Per step the parts run cheapest first (by the cost model's draft-step time; n-gram is free). With
a cost model, a part runs only if it can pay (the skip rule, `Scheduler._worth_running` in
decode/adaptive.py): from its calibrated prior and the scores of the trees the cheaper parts
already drafted, the rows it could win must repay its drafting ms (and any wider verification)
in expected tokens per ms; a part kept out `explore_every` steps in a row runs once anyway. A
skipped part still observes every step (own = no rows). Without a cost model every part runs.
With `adaptive`, each part's length is also planned (0: not run). Each part's tree gets, per
row, an expected accepted length from its calibrated node confidences (n-gram: match length;
EAGLE / draft LM / early exit / Medusa: draft probability), and each row takes the best part's
tree. The merged,
padded tree keeps each row's node ids identical to its source tree (padding only appended), so a
part's bookkeeping of its own drafts stays valid; after verification every part observes, with
`own` = the rows that verified its tree (the others catch up from the accepted tokens).

The expected accepted length of a SAMPLED tree (T > 0 chains) uses only its first node's
confidence and per-depth priors: its deeper confidences depend on drafts already drawn, and a
choice that looked at them would bias the output (adaptive.py, non-anticipation). Sampled and
deterministic rows share one batch through a one-hot q for the deterministic chains.

"Adaptive hybrid" is this class with a cost model and adaptive=True (spec `adaptive:hybrid:a+b`):
lengths are planned per part, parts that cannot pay are not run, the merged tree is trimmed.

Deliberately not here: merging proposals of different parts into one tree (each row verifies
one part's tree), the math (adaptive.py), the parts themselves.
"""

from __future__ import annotations

from drafttrain.decode.adaptive import AcceptanceCalibrator, Scheduler
from drafttrain.decode.costmodel import CostModel
from drafttrain.decode.proposers.base import Proposer

__all__ = ["HybridProposer"]


class HybridProposer(Scheduler):
    """Picks, per row and step, the part with the highest expected accepted length.

    Args:
        parts: the proposers (AdaptiveProposer parts are unwrapped: their inner proposer,
            calibrator and cost model are used).
        cost_model: the target's CostModel; needed for adaptive=True.
        calibrator: an AcceptanceCalibrator whose settings each part's fresh one copies, or
            {part name: calibrator}, or None.
        gamma: chain length of every part when not adaptive (default: the caller's gamma, else
            each part's default).
        max_gamma: longest chain an adaptive plan considers.
        adaptive: plan lengths, skip parts that cannot pay, trim (default: True iff a cost model
            is given).
        free_extension: see adaptive.trim_tree.
        explore_every: with a cost model, a part the skip rule kept out this many steps in a row
            drafts once anyway, and so does a part whose plan was 0 that long; 0 turns the skip
            rule off (every part whose plan is > 0 drafts) and never overrides a plan.
        free_draft: see Scheduler (n-gram-cheap parts always draft their cap; trimming decides).
        shadow: see Scheduler (learn from unverified deterministic drafts against the emitted tokens).
    """

    name = "hybrid"

    def __init__(self, parts: list[Proposer], *, cost_model: CostModel | None = None,
                 calibrator: AcceptanceCalibrator | dict | None = None, gamma: int | None = None,
                 max_gamma: int = 8, adaptive: bool | None = None, free_extension: bool = True,
                 explore_every: int = 32, free_draft: float = 0.05, shadow: bool = True):
        if len(parts) < 2:
            raise ValueError(f"a hybrid needs at least two parts, got {len(parts)}")
        if adaptive is None:
            adaptive = cost_model is not None or any(getattr(p, "adaptive", False) for p in parts)
        super().__init__(parts, cost_model=cost_model, calibrator=calibrator, adaptive=adaptive,
                         max_gamma=max_gamma, gamma=gamma, free_extension=free_extension,
                         explore_every=explore_every, free_draft=free_draft, shadow=shadow)
