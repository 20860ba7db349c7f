"""Hybrid proposer: several proposers draft each step; each row verifies the most promising one.

The hybrid is the adaptive loop (proposers/scheduler.py) over several parts, plus the three
decisions that only several parts need, all here:

    order   parts run cheapest first (by the cost model's draft-step time; n-gram is free)
    skip    with a cost model, a part runs only if it can pay (`_worth_running`): from its
            calibrated prior and the scores of the trees the cheaper parts already drafted, the
            rows it could win must repay its drafting ms (and any wider verification) in expected
            tokens per ms; a part kept out `explore_every` steps in a row runs once anyway. A
            skipped part still observes every step (own = no rows). Without a cost model every
            part runs.
    choose  each part's tree gets, per row, an expected accepted length from its calibrated node
            confidences (n-gram: match length; EAGLE / draft LM / early exit / Medusa: draft
            probability), and each row takes the best part's tree (`_scores`, `_pick`). The
            merged, padded tree keeps each row's node ids identical to its source tree (padding
            only appended, `_merge`), so a part's bookkeeping of its own drafts stays valid;
            after verification every part observes, with `own` = the rows that verified its tree
            (the others catch up from the accepted tokens).

With `adaptive`, each part's length is also planned (0: not run) and the merged tree trimmed.

The expected accepted length of a SAMPLED tree (T > 0 chains) uses only its first node's
confidence and per-depth priors: its deeper confidences depend on drafts already drawn, and a
choice that looked at them would bias the output (scheduler.py, non-anticipation). Sampled and
deterministic rows share one batch through a one-hot q for the deterministic chains.

"Adaptive hybrid" is this class with a cost model and adaptive=True (spec `adaptive:hybrid:a+b`):
lengths are planned per part, parts that cannot pay are not run, the merged tree is trimmed.

Deliberately not here: merging proposals of different parts into one tree (each row verifies
one part's tree), the loop and the math (scheduler.py, planning.py, calibrator.py), the parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from drafttrain.decode.calibrator import AcceptanceCalibrator
from drafttrain.decode.planning import expected_tokens, path_products, tree_nodes
from drafttrain.decode.proposers.base import Proposer, proposer_key
from drafttrain.decode.proposers.scheduler import AdaptiveProposer, Drafts, Scheduler, part_names
from drafttrain.decode.tree import DraftTree

if TYPE_CHECKING:
    from drafttrain.decode.costmodel import CostModel
    from drafttrain.decode.engine import DecodeState

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
        free_extension: see planning.trim_tree.
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
        inner, cost_model, calibrator = _unwrap(parts, cost_model, calibrator)
        super().__init__(inner, cost_model=cost_model, calibrator=calibrator, adaptive=adaptive,
                         max_gamma=max_gamma, gamma=gamma, free_extension=free_extension,
                         explore_every=explore_every, free_draft=free_draft, shadow=shadow)
        self._skipped = [0] * len(inner)  # per part: steps skipped in a row by the skip rule

    def reset(self) -> None:
        """Forgets everything learned (calibrators, probe and skip counters): a cold start."""
        super().reset()
        self._skipped = [0] * len(self.parts)

    # ---- order and skip rule ----------------------------------------------------------------------
    def _skippable(self) -> bool:
        """The skip rule needs a cost model (and several parts, which a hybrid has)."""
        return len(self.parts) > 1 and self.cost_model is not None

    def _order(self, state: DecodeState) -> list[int]:
        """Part indices by modelled draft-step cost, cheapest first (ties: the given order); without
        a cost model, the given order. Cheap parts first: their proposals inform the skip rule."""
        if not self._skippable():
            return list(range(len(self.parts)))
        B = state.root.shape[0]
        return sorted(range(len(self.parts)),
                      key=lambda i: (self._costs(state).draft_time(proposer_key(self.parts[i]), B), i))

    def _should_run(self, state: DecodeState, i: int, length: int, probe: int, drafts: Drafts) -> bool:
        """A part with a plan runs when probed or when worth it; counts the steps it sat out."""
        if length <= 0:
            return False
        run = probe > 0 or self._worth_running(state, i, length, drafts)
        if self._skippable():
            self._skipped[i] = 0 if run else self._skipped[i] + 1
        return run

    def _worth_running(self, state: DecodeState, i: int, length: int, drafts: Drafts) -> bool:
        """Whether part i should draft this step, decided before it drafts (the skip rule).

        Rows gain max(0, E_i - best) expected accepted tokens, where E_i is part i's calibrated
        prior for its planned length (past steps only) and best the score of the best tree the
        cheaper parts already drafted (free signals such as n-gram's match length). Part i runs
        iff that gain raises the step's expected tokens per modelled ms, counting its drafting
        ms and any wider verification. Exploration: a part skipped `explore_every` steps in a
        row runs once (besides the calibrator's decay drifting its estimate back to the prior).
        """
        ran = [j for j, t in enumerate(drafts.trees) if t is not None]  # cheaper parts, drafted or skipped
        if not self._skippable() or not ran or self._skipped[i] >= self.explore_every:
            return True
        B, spec = state.root.shape[0], state.tree
        cal = self.calibrators[self.names[i]]
        if B == 1 and spec is None and all(drafts.trees[j].draft_probs is None for j in ran):
            # one row, chains: the same rule in Python floats (the tensors' per-op overhead was most
            # of the rule's ~0.13 ms a step)
            if not bool(state.active[0]):
                return False
            best1 = max(_row_score(drafts.trees[j], drafts.p_nodes[j]) for j in ran)
            reach, exp1 = 1.0, 0.0
            for q in cal.row_prior(length):
                reach *= q
                exp1 += reach
            return self._pays(state, i, length, ran, drafts, 1 + best1, max(0.0, exp1 - best1), 1 + length)
        active = state.active.cpu()
        best = self._scores(state, [drafts.trees[j] for j in ran], [drafts.p_nodes[j] for j in ran])
        best = best.max(0).values.cpu()  # [B]
        if spec is None:
            prior, size = cal.batch_prior(length, B), 1 + length
        else:
            prior, size = cal.prior(spec.depth).expand(B, -1), tree_nodes(spec)
        exp = expected_tokens(prior)[:, -1] - 1  # [B] expected accepted drafts
        gain = float((exp - best).clamp(min=0)[active].sum())
        tokens = float(active.sum()) + float(best[active].sum())
        return self._pays(state, i, length, ran, drafts, tokens, gain, size)

    def _pays(self, state: DecodeState, i: int, length: int, ran: list[int], drafts: Drafts, tokens: float,
              gain: float, size: int) -> bool:
        """Whether `gain` expected tokens over the step's `tokens` repay part i's drafting ms and any
        wider verification (a tree of `size` nodes) in tokens per modelled ms."""
        B = state.root.shape[0]
        width = max(drafts.trees[j].size for j in ran)
        sunk = sum(drafts.draft_ms)
        cm = self._costs(state)
        t0 = sunk + cm.verify_time(B, width)
        t1 = sunk + self._draft_ms(state, i, length) + cm.verify_time(B, max(width, size))
        return (tokens + gain) / t1 > tokens / t0

    # ---- choice -----------------------------------------------------------------------------------
    def _choose(self, state: DecodeState, drafts: Drafts) -> tuple[Tensor, DraftTree, Tensor]:
        """Per row, the best part's tree: (choice [B], the merged tree, its p_nodes [B, N])."""
        choice = self._pick(state, self._scores(state, drafts.trees, drafts.p_nodes))
        first = int(choice[0])
        if bool((choice == first).all()):  # one part for every row (always at batch 1): its tree as it is
            return choice, drafts.trees[first], drafts.p_nodes[first]  # (sampled q stays over its draft vocab)
        vocab_size = state.target.get_output_embeddings().weight.shape[0]
        merged, p_merged = self._merge(drafts.trees, drafts.p_nodes, choice, vocab_size)
        return choice, merged, p_merged

    def _scores(self, state: DecodeState | None, trees: list[DraftTree], p_nodes: list[Tensor]) -> Tensor:
        """[P, B] expected accepted length of each tree, from information known before its first
        draft was drawn (sampled trees: first node's estimate, then per-depth priors). The k-th
        tree is scored with the k-th part's calibrator."""
        if trees and trees[0].tokens.shape[0] == 1 and all(t.draft_probs is None for t in trees):
            return torch.tensor([[_row_score(t, p)] for t, p in zip(trees, p_nodes)])  # one row: Python floats
        scores = []
        for t, p, n in zip(trees, p_nodes, self.names):
            if t.size == 1:  # root only: the part did not run (most steps of a skipped part)
                scores.append(torch.zeros(t.tokens.shape[0], dtype=p.dtype, device=p.device))
                continue
            if t.draft_probs is not None:
                depths = t.depths()
                deep = self.calibrators[n].batch_prior(t.size, depths.shape[0])
                deep = deep.to(p.device).gather(1, (depths - 1).clamp(min=0))
                p = torch.where(depths <= 1, p, deep)
            pi = torch.where(t.parents >= 0, path_products(p, t.parents), 0.0)
            scores.append(pi[:, 1:].sum(1))
        return torch.stack(scores)

    def _pick(self, state: DecodeState, scores: Tensor) -> Tensor:
        """[B] index of the part whose tree each row verifies (highest score; ties: first part)."""
        return scores.argmax(0)

    def _merge(self, trees: list[DraftTree], p_nodes: list[Tensor], choice: Tensor, vocab_size: int
               ) -> tuple[DraftTree, Tensor]:
        """Per row, the chosen part's tree with its node ids unchanged (padding appended). Sampled
        q over a reduced draft vocabulary is spread over the target's `vocab_size` ids, which every
        part's rows share."""
        B = choice.shape[0]
        device = trees[0].tokens.device
        N = max(int(t.size) for i, t in enumerate(trees) if bool((choice == i).any()))
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        parents = torch.full((B, N), -2, dtype=torch.long, device=device)
        conf = torch.zeros(B, N, device=device)
        p_merged = torch.zeros(B, N, device=device)
        sampled = [t.draft_probs is not None and bool((choice == i).any()) for i, t in enumerate(trees)]
        probs = None
        if any(sampled):
            V = vocab_size
            probs = torch.zeros(B, N, V, device=device)
        for i, (t, p) in enumerate(zip(trees, p_nodes)):
            rows = choice == i
            if not bool(rows.any()):
                continue
            n = min(t.size, N)
            tokens[rows, :n] = t.tokens[rows, :n]
            parents[rows, :n] = t.parents[rows, :n]
            conf[rows, :n] = t.confidence[rows, :n] if t.confidence is not None else 1.0
            p_merged[rows, :n] = p[rows, :n]
            if probs is None:
                continue
            if t.draft_probs is not None:
                probs[rows, : min(t.draft_probs.shape[1], N)] = t.dense_probs(V)[rows, :N].float()
            elif _is_chain(t):
                probs[rows, :n] = _one_hot_probs(t, V)[rows, :n]
            else:
                raise ValueError("cannot verify a deterministic tree with siblings in the same batch "
                                 "as sampled drafts; use one tree setting for every part")
        return DraftTree(tokens, parents, probs, conf), p_merged


def _unwrap(parts: list[Proposer], cost_model: CostModel | None,
            calibrator: AcceptanceCalibrator | dict | None
            ) -> tuple[list[Proposer], CostModel | None, AcceptanceCalibrator | dict | None]:
    """The parts' plain proposers. An AdaptiveProposer part lends its cost model (when none is
    given) and, when no calibrator is given, its calibrator; a hybrid part is refused."""
    inner, own = [], {}
    for p in parts:
        if isinstance(p, AdaptiveProposer):
            if cost_model is None:
                cost_model = p.cost_model
            own[id(p.parts[0])] = p.calibrators[p.names[0]]
            p = p.parts[0]
        elif isinstance(p, Scheduler):
            raise ValueError("a hybrid part cannot itself be a hybrid")
        inner.append(p)
    if calibrator is None and own:
        calibrator = {n: own[id(p)] for n, p in zip(part_names(inner), inner) if id(p) in own}
    return inner, cost_model, calibrator


def _row_score(tree: DraftTree, p_node: Tensor) -> float:
    """A one-row deterministic tree's expected accepted length: the sum over its nodes of the
    product of `p_node` along the path from the root (what `_scores` computes with tensors)."""
    if tree.size == 1:
        return 0.0
    p, par = p_node[0].tolist(), tree.parents[0].tolist()
    prod, total = [1.0] * len(p), 0.0
    for j in range(1, len(p)):
        prod[j] = prod[par[j]] * p[j] if par[j] >= 0 else 0.0
        total += prod[j]
    return total


def _is_chain(tree: DraftTree) -> bool:
    par = tree.parents
    col = torch.arange(par.shape[1], device=par.device)[None]
    return bool(((par == col - 1) | (par == -2)).all())


def _one_hot_probs(tree: DraftTree, vocab: int) -> Tensor:
    """[B, N, V] q for a deterministic chain: a one-hot at each node's child (the verifier's
    deterministic case, expressed as a distribution so it can share a batch with sampled rows)."""
    B, N = tree.tokens.shape
    q = torch.zeros(B, N, vocab, device=tree.tokens.device)
    child = tree.parents[:, 1:] >= 0  # [B, N - 1]
    b, i = child.nonzero(as_tuple=True)
    q[b, tree.parents[b, i + 1], tree.tokens[b, i + 1]] = 1.0
    return q
