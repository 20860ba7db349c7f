"""Adaptive speculation's loop: per step, draft only what is expected to pay, given the text and the load.

Each step, for each proposer ("part"; one for AdaptiveProposer, several for HybridProposer):

    plan    from the calibrator's per-depth acceptance estimates (past steps only) and the cost
            model, the chain length L that maximises expected tokens per ms; L = 0: the part is
            not run at all (no drafting cost)
    probe   every `explore_every` steps a part drafts one deeper than it last reached, whatever
            the estimate (exploration; past steps decide it); rows that chose a part with
            sampled drafts verify the probe's path, deterministic drafts are scored as shadows
    skip    (hybrid with a cost model) parts run cheapest first; a part runs only if the rows it
            could win (expected over the best tree of the cheaper parts) repay its drafting ms
    draft   the part drafts a chain of L (state.gamma = L), or its tree (trees: on / off only)
    choose  (hybrid) per row, the part whose tree has the highest expected accepted length
    trim    per row, drop drafts whose calibrated acceptance does not pay for their share of the
            verification forward (the drafting cost is sunk; trimming only saves verification)
    learn   after verification: calibrator counts of each part's own rows, plus shadow evidence
            (deterministic drafts that were not verified, scored against the emitted tokens);
            every part observes

`propose` hands what it decided to `observe` of the same step as a `StepRecord`: each part's
`Drafts`, the per-row choice, the merged tree and the ids of the nodes it kept.

Why the output stays exactly the target's (non-anticipation). Whether draft k is verified may
depend only on what is known before draft k is drawn (DSpark, appendix A: a scheduler that looks
at the drafted token itself turns p = (0.7, 0.3) into (0.85, 0.15)). So:
  * L and the part set come from past outcomes and earlier parts' scores (themselves known
    before their drafts were drawn) only;
  * a node's confidence is known before its token is drawn (the drafter's top probability, not
    q(x) of the sampled x, see tree.py);
  * sampled chains (draft_probs given) are trimmed by a stopping rule: draft k is kept iff every
    j <= k has cumulative estimate pi_j >= tau_j, a threshold fixed before drafting; a row may
    also verify for free up to the longest kept chain among the OTHER rows (their drafts are
    independent of this row's);
  * the hybrid ranks a sampled part by its first node's confidence and per-depth priors, never
    by confidences of deeper, already-drawn nodes;
  * deterministic drafts (draft_probs None: argmax chains, top-k trees, n-gram) are functions of
    the prefix, so any rule over them is safe: they get the exact token budget that maximises
    expected tokens per ms over the batch, EAGLE-2-style reranking by cumulative estimate.

Trees: supported as on / off before drafting (a chain of the tree's depth is the conservative
value estimate) and as budget trimming after (top nodes by cumulative estimate, one node budget
for the whole batch since verification pads every row to the widest). Not supported: choosing
the dynamic tree's depth / top_k per step, sampled trees (none of the proposers drafts them).

Layout: StepRecord and Drafts (one step's record), Scheduler (the loop over parts), AdaptiveProposer
(one part). The hybrid (proposers/hybrid.py) overrides the loop's three several-part hooks:
`_order` and `_should_run` (the skip rule), `_choose` (the per-row choice and the merged tree).

Deliberately not here: the estimates (calibrator.py), the planning math (planning.py), measuring
costs (costmodel.py), verification (verify.py), choosing among several parts (hybrid.py), the
proposers themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from drafttrain.decode.calibrator import AcceptanceCalibrator
from drafttrain.decode.planning import (
    best_length,
    chain_ms,
    drafting_ms,
    expected_tokens,
    length_rates,
    row_length_rates,
    tree_nodes,
    trim_tree,
)
from drafttrain.decode.proposers.base import Proposer, proposer_key
from drafttrain.decode.tree import DraftTree, chain_prefix, compact_tree, first_path, root_only
from drafttrain.decode.verify import VerifyResult

if TYPE_CHECKING:
    from drafttrain.decode.costmodel import CostModel
    from drafttrain.decode.engine import DecodeState

__all__ = ["Scheduler", "AdaptiveProposer", "StepRecord", "Drafts", "part_names"]


# ---- one step's record ------------------------------------------------------------------------------
@dataclass
class Drafts:
    """What each part drafted this step, in part order (filled as the parts run, cheapest first).

    Attributes:
        trees: [P] each part's tree (root-only when it did not run); None until it is its turn.
        p_nodes: [P] per tree, [B, N_i] calibrated P(node accepted | parent accepted).
        used: [P] whether the part drafted this step (its plan, probe and the skip rule decide).
        draft_ms: [P] modelled drafting ms of each part (0 when it did not run).
        proposals: with `log_steps`: {part name: per row, the part's full untrimmed chain (a
            tree's first-child path)}, every part drafting its cap for the log; else None.
    """

    trees: list[DraftTree | None]
    p_nodes: list[Tensor | None]
    used: list[bool]
    draft_ms: list[float]
    proposals: dict[str, list[list[int]]] | None

    @classmethod
    def empty(cls, parts: int, log: bool) -> Drafts:
        """Nothing drafted yet by any of `parts` parts (`log`: collect proposals)."""
        return cls([None] * parts, [None] * parts, [False] * parts, [0.0] * parts, {} if log else None)


@dataclass(frozen=True)
class StepRecord:
    """What `propose` decided, for `observe` of the same step (learning, the parts' bookkeeping, stats).

    Attributes:
        active: [B] bool rows generating when the step was planned (a copy of state.active).
        pos: [B] each row's root position (prompt included) when the step was planned.
        batch: rows in the target's forward (B).
        drafts: each part's tree, estimates, whether it ran and its drafting ms.
        choice: [B] long index of the part whose tree each row verifies.
        merged: per row, the chosen part's tree with that part's node ids (padding appended).
        kept_ids: [B, N'] the merged tree's id of each verified node (-1: padding); None when the
            verified tree is `merged` itself (nothing trimmed).
    """

    active: Tensor
    pos: list[int]
    batch: int
    drafts: Drafts
    choice: Tensor
    merged: DraftTree
    kept_ids: Tensor | None

    @property
    def draft_ms(self) -> float:
        """Modelled drafting ms of the step (every part that ran)."""
        return sum(self.drafts.draft_ms)


def part_names(parts: list[Proposer]) -> list[str]:
    """Each part's name: its cost key, with "#i" appended when several parts share a key."""
    keys = [proposer_key(p) for p in parts]
    return [k if keys.count(k) == 1 else f"{k}#{i}" for i, k in enumerate(keys)]


def part_calibrators(names: list[str], calibrator: AcceptanceCalibrator | dict | None
                     ) -> list[AcceptanceCalibrator]:
    """Each part's calibrator from one calibrator (itself for one part, fresh copies of its
    settings for several), {part name: calibrator} (missing names: new ones) or None (new ones)."""
    if isinstance(calibrator, dict):
        return [calibrator.get(n) or AcceptanceCalibrator() for n in names]
    if isinstance(calibrator, AcceptanceCalibrator):
        return [calibrator if len(names) == 1 else calibrator.fresh() for _ in names]
    return [AcceptanceCalibrator() for _ in names]


# ---- the loop ---------------------------------------------------------------------------------------
class Scheduler(Proposer):
    """Plan, draft, choose, trim, learn over one or more parts (see the module docstring).

    Use AdaptiveProposer (one part) or HybridProposer (several, proposers/hybrid.py); this class
    holds their loop. With several parts it runs every part whose plan is > 0 and verifies the
    first part's tree: the choice among parts is the hybrid's (`_order`, `_should_run`, `_choose`).

    Args:
        parts: the proposers (plain ones: the hybrid unwraps AdaptiveProposer parts).
        cost_model: needed when `adaptive`; kept as `self.cost_model` either way.
        calibrator: one AcceptanceCalibrator (used as is for one part; its settings for fresh
            ones per part when several), {part name: calibrator}, or None (defaults).
        adaptive: plan lengths and trim with the cost model; False: each part drafts `gamma`.
        max_gamma: longest chain an adaptive plan considers (the caller's gamma, when given,
            is the cap instead).
        gamma: non-adaptive chain length (default: the caller's gamma, else each part's default).
        free_extension: see `planning.trim_tree`.
        explore_every: every this many steps a part is probed: it drafts one deeper than it last
            reached whatever the estimate says, and (sampled drafts; deterministic ones are
            scored as shadows) the rows that verify its tree keep that path (so a pessimistic
            estimate can recover: a cold start's early rejections would otherwise stop drafting
            for good at high batch, and deeper drafts that are never verified would never be
            learned again); and with several parts a part the skip rule kept out this many steps
            in a row runs once. 0: plans are never overridden and the skip rule is off (every
            part whose plan is > 0 drafts).
        free_draft: a part whose whole chain (the cap) costs at most this fraction of a one-token
            verification is always drafted in full (n-gram lookup: ~1 %); trimming then decides
            per row with the drafts' own confidences (match lengths), which say far more than
            the per-depth estimate the plan has before drafting. 0 turns this off.
        shadow: also learn from deterministic drafts that were not verified, by comparing them
            with the tokens the row emitted (`AcceptanceCalibrator.add_shadow`; unbiased, lossless).
    """

    name = "scheduler"

    def __init__(self, parts: list[Proposer], *, cost_model: CostModel | None = None,
                 calibrator: AcceptanceCalibrator | dict | None = None, adaptive: bool = True,
                 max_gamma: int = 8, gamma: int | None = None, free_extension: bool = True,
                 explore_every: int = 32, free_draft: float = 0.05, shadow: bool = True):
        if not parts:
            raise ValueError("need at least one part")
        if adaptive and cost_model is None:
            raise ValueError("adaptive speculation needs a cost model (see drafttrain.decode.costmodel)")
        self.parts = list(parts)
        self.names = part_names(self.parts)
        cals = part_calibrators(self.names, calibrator)
        self.calibrators: dict[str, AcceptanceCalibrator] = dict(zip(self.names, cals))
        self.cost_model, self.adaptive, self.max_gamma, self.gamma = cost_model, adaptive, max_gamma, gamma
        self.free_extension, self.explore_every, self.free_draft = free_extension, explore_every, free_draft
        self.shadow = shadow
        self._since = dict.fromkeys(self.names, 0)  # per part: steps since its last probe
        self._reach = dict.fromkeys(self.names, 0)  # per part: most drafts accepted at its last verified step
        self._last_step: StepRecord | None = None  # propose -> observe
        self.needs_hidden_states = tuple(sorted({i for p in self.parts for i in p.needs_hidden_states}))
        self.default_gamma = gamma or max_gamma

    def reset(self) -> None:
        """Forgets everything learned (calibrators, probe counters): a cold start."""
        self.calibrators = {n: c.fresh() for n, c in self.calibrators.items()}
        self._since, self._reach = dict.fromkeys(self.names, 0), dict.fromkeys(self.names, 0)

    # ---- engine hooks ---------------------------------------------------------------------------
    def prefill(self, state: DecodeState, hidden: dict[int, Tensor]) -> None:
        for p in self.parts:
            p.prefill(state, hidden)
        for cal in self.calibrators.values():
            cal.reset_rows(state.root.shape[0])
        self._step = 0

    def propose(self, state: DecodeState) -> DraftTree:
        active = state.active.clone()  # [B] the rows this step was planned for
        log = bool((state.options or {}).get("log_steps"))
        plans = [self._plan(state, p, n) for p, n in zip(self.parts, self.names)]  # (length, rate, ms)
        probes = [self._probe_depth(n, self._cap(state, p)) for p, n in zip(self.parts, self.names)]
        drafts = self._draft_parts(state, plans, probes, log)
        choice, merged, p_merged = self._choose(state, drafts)  # [B] part index
        if state.room is not None and merged.size > 1:  # drafts the row cannot emit are worth nothing
            d = merged.depths()
            p_merged = torch.where(d > state.room.to(d.device)[:, None], 0.0, p_merged)
        rate = max(r for _, r, _ in plans)
        verified, kept_ids = self._trim(state, active, merged, p_merged, choice, rate, probes, drafts)
        self._last_step = StepRecord(active=active, pos=state.root_pos.tolist(), batch=state.root.shape[0],
                                     drafts=drafts, choice=choice, merged=merged, kept_ids=kept_ids)
        return verified

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult, hidden: dict[int, Tensor],
                *, own: Tensor | None = None) -> None:
        step = self._last_step
        mine = step.active if own is None else step.active & own
        full_result, full_hidden = result, hidden
        if step.kept_ids is not None:  # back to the merged tree's node ids (each part's own ids)
            full_result, full_hidden = _expand(result, hidden, step.kept_ids, step.merged.size)
        verified = tree.depths().max(1).values > 0  # [B] the row verified a draft
        accepted = result.num_accepted.to(verified.device)  # [B] accepted drafts (= depth reached)
        for i, (p, n) in enumerate(zip(self.parts, self.names)):
            rows = mine & (step.choice == i) & step.drafts.used[i]
            self._note_reach(step, i, rows & verified, accepted)
            self.calibrators[n].update(tree, result, rows)
            if self.shadow and step.drafts.used[i]:
                self._shadow(state, step, i, mine)
            p.observe(state, step.merged, full_result, full_hidden, own=rows)
        self._record(state, step, tree)
        self._step += 1

    def select_rows(self, idx: Tensor) -> bool:
        if any(type(p).select_rows is Proposer.select_rows for p in self.parts):
            return False  # a part cannot: change nothing
        for p in self.parts:
            if not p.select_rows(idx):
                raise RuntimeError(f"{type(p).__name__}.select_rows refused after overriding it")
        for cal in {id(c): c for c in self.calibrators.values()}.values():  # each calibrator once
            cal.select_rows(idx)
        return True

    # ---- plan -------------------------------------------------------------------------------------
    def _costs(self, state: DecodeState) -> CostModel | None:
        """The cost model at this decode's temperature: sampled costs at T > 0 (`CostModel.at`)."""
        cm = self.cost_model
        return None if cm is None else cm.at(state.temperature)

    def _cap(self, state: DecodeState, part: Proposer) -> int:
        cap = state.gamma or (self.max_gamma if self.adaptive else self.gamma or part.default_gamma)
        heads = getattr(part, "K", None)  # Medusa: one head per depth
        return max(1, min(cap, heads) if isinstance(heads, int) else cap)

    def _plan(self, state: DecodeState, part: Proposer, name: str) -> tuple[int, float, float]:
        """(length to draft, planned tokens per ms, drafting ms); trees: length 1 = draft the tree,
        0 = do not. Uses past steps only (the calibrator and the cost model)."""
        cap = self._cap(state, part)
        if not self.adaptive:
            return cap, 0.0, 0.0
        if state.tree is None:
            return self._plan_chain(state, part, name, cap)
        return self._plan_tree(state, part, name)

    def _plan_chain(self, state: DecodeState, part: Proposer, name: str, cap: int
                    ) -> tuple[int, float, float]:
        """A chain's plan: the length that pays best, or the whole cap when drafting is nearly free."""
        B, cm, key = state.root.shape[0], self._costs(state), proposer_key(part)  # names get "#i", keys do not
        if B == 1:  # one row: Python floats, the same rates (planning.row_length_rates)
            prior1 = self.calibrators[name].row_prior(cap)
            rates = row_length_rates(prior1, cm, key) if bool(state.active[0]) else [0.0] * (cap + 1)
        else:
            prior = self.calibrators[name].batch_prior(cap, B)  # [B, cap]
            rates = length_rates(expected_tokens(prior), B, cm, key, state.active)
        best = best_length(rates)
        nearly_free = self.free_draft and chain_ms(cm, key, B, cap) <= self.free_draft * cm.verify_time(B, 1)
        length = cap if nearly_free else best  # nearly free: draft it all, trim on the drafts' confidences
        return length, rates[best], chain_ms(cm, key, B, length)

    def _plan_tree(self, state: DecodeState, part: Proposer, name: str) -> tuple[int, float, float]:
        """A tree's plan: draft it (1) iff its rate, valued as a chain of its depth, beats no draft (0)."""
        B, active, spec, key = state.root.shape[0], state.active, state.tree, proposer_key(part)
        prior = self.calibrators[name].prior(spec.depth).expand(B, -1)  # a chain of the tree's depth
        exp = expected_tokens(prior)[:, -1]  # [B]
        tokens = float(exp[active.cpu()].sum())
        cm = self._costs(state)
        draft = drafting_ms(cm, key, B, spec, 1)
        tree_rate = tokens / (cm.verify_time(B, tree_nodes(spec)) + draft)
        none_rate = int(active.sum()) / cm.verify_time(B, 1)
        return (1, tree_rate, draft) if tree_rate > none_rate else (0, none_rate, 0.0)

    def _probe_depth(self, name: str, cap: int) -> int:
        """0, or the depth this step's probe of the part drafts (and, for sampled drafts, verifies):
        one deeper than the most drafts of it accepted at its last verified step (past steps only,
        so the output stays lossless).

        Without probes a pessimistic estimate is final: nothing drafted, no evidence (at high
        batch a cold start's early rejections stopped drafting for good), and a depth that is
        never tried is never learned. Deterministic drafts only need to be drafted: their shadow
        evidence (`_shadow`) scores them against the emitted tokens, so their probe costs no
        verification. Sampled drafts are verified along the probe's path: one token of wider
        verification per `explore_every` steps."""
        if not (self.adaptive and self.explore_every):
            return 0
        self._since[name] += 1
        if self._since[name] < self.explore_every:
            return 0
        self._since[name] = 0
        return min(cap, self._reach[name] + 1)

    def _draft_ms(self, state: DecodeState, i: int, length: int) -> float:
        """Modelled drafting ms of part i at the planned `length` (trees: the whole tree)."""
        if self.cost_model is None or length == 0:
            return 0.0
        key = proposer_key(self.parts[i])
        return drafting_ms(self._costs(state), key, state.root.shape[0], state.tree, length)

    # ---- draft ------------------------------------------------------------------------------------
    def _draft_parts(self, state: DecodeState, plans: list[tuple[int, float, float]], probes: list[int],
                     log: bool) -> Drafts:
        """Runs the parts in `_order`, each at its planned (or probed) length if `_should_run`."""
        drafts = Drafts.empty(len(self.parts), log)
        for i in self._order(state):
            length = plans[i][0]
            if probes[i]:
                length = max(length, 1 if state.tree is not None else probes[i])
            run = self._should_run(state, i, length, probes[i], drafts)
            tree = self._draft_part(state, i, length, run, drafts.proposals)
            drafts.trees[i], drafts.used[i] = tree, run
            drafts.p_nodes[i] = self.calibrators[self.names[i]].prob(tree.confidence, tree.depths())
            drafts.draft_ms[i] = self._draft_ms(state, i, length) if run else 0.0
        return drafts

    def _draft_part(self, state: DecodeState, i: int, length: int, run: bool,
                    proposals: dict[str, list[list[int]]] | None) -> DraftTree:
        """Part i's tree (root-only when it does not run). With `proposals` (the step log) every
        part drafts its cap, recorded there; the tree is then what it would have been without."""
        part = self.parts[i]
        if proposals is None:
            return self._run(state, part, length) if run else root_only(state.root)
        cap = self._cap(state, part)
        tree = self._run(state, part, cap)
        proposals[self.names[i]] = [c[:cap] for c in _first_child_path(tree)]
        if not run:
            return root_only(state.root)
        if state.tree is None and length < cap:
            return chain_prefix(tree, length)  # as if `length` had been drafted
        return tree

    def _run(self, state: DecodeState, part: Proposer, length: int) -> DraftTree:
        """The part's proposal with state.gamma = length (the caller's settings restored after)."""
        gamma, spec = state.gamma, state.tree
        state.gamma = length
        try:
            return part.propose(state)
        finally:
            state.gamma, state.tree = gamma, spec

    # ---- several-part hooks (the hybrid overrides them) -------------------------------------------
    def _order(self, state: DecodeState) -> list[int]:
        """The order the parts draft in."""
        return list(range(len(self.parts)))

    def _should_run(self, state: DecodeState, i: int, length: int, probe: int, drafts: Drafts) -> bool:
        """Whether part i drafts this step, decided before it drafts (`drafts`: the parts before it)."""
        return length > 0

    def _choose(self, state: DecodeState, drafts: Drafts) -> tuple[Tensor, DraftTree, Tensor]:
        """(choice [B] part per row, the tree to verify, its p_nodes [B, N]): the first part's tree."""
        tree = drafts.trees[0]
        choice = torch.zeros(tree.tokens.shape[0], dtype=torch.long, device=tree.tokens.device)
        return choice, tree, drafts.p_nodes[0]

    # ---- trim -------------------------------------------------------------------------------------
    def _trim(self, state: DecodeState, active: Tensor, merged: DraftTree, p_merged: Tensor, choice: Tensor,
              rate: float, probes: list[int], drafts: Drafts) -> tuple[DraftTree, Tensor | None]:
        """The tree to verify and, when nodes were dropped, the merged tree's id of each kept node."""
        if not (self.adaptive and merged.size > 1):
            return merged, None
        keep = trim_tree(merged, p_merged, batch=state.root.shape[0], active=active,
                         cost_model=self._costs(state), sunk_ms=sum(drafts.draft_ms), rate=rate,
                         free_extension=self.free_extension)
        if any(probes):
            keep = self._keep_probes(keep, merged, choice, active, probes, drafts)
        kept, real = keep.cpu().numpy(), merged.parents.cpu().numpy() != -2  # host arrays: a handful of ops
        if bool(((kept[:, 1:] == real[:, 1:]) | ~active.cpu().numpy()[:, None]).all()):
            return merged, None
        return compact_tree(merged, keep)

    def _keep_probes(self, keep: Tensor, merged: DraftTree, choice: Tensor, active: Tensor, probes: list[int],
                     drafts: Drafts) -> Tensor:
        """`keep` plus, in the rows that verify a probed part's sampled tree, the probe's first path
        (deterministic drafts need no verification: their shadow evidence is the probe)."""
        for i, depth in enumerate(probes):
            rows = (choice.to(keep.device) == i) & active.to(keep.device)
            if self.shadow and drafts.trees[i].draft_probs is None:
                continue
            if depth and drafts.used[i] and bool(rows.any()):
                keep |= rows[:, None] & first_path(merged, depth)
        return keep

    # ---- learn ------------------------------------------------------------------------------------
    def _note_reach(self, step: StepRecord, i: int, hit: Tensor, accepted: Tensor) -> None:
        """Part i's reach (`_probe_depth`): the most drafts accepted in the rows `hit` [B] that
        verified its drafts; 0 when it drafted, every row chose it and none verified a draft."""
        name = self.names[i]
        if bool(hit.any()):
            self._reach[name] = int(accepted[hit].max())
        elif step.drafts.used[i] and not bool((step.active & (step.choice != i)).any()):
            self._reach[name] = 0

    def _shadow(self, state: DecodeState, step: StepRecord, i: int, rows: Tensor) -> None:
        """Shadow evidence for part i (`AcceptanceCalibrator.add_shadow`): its drafts that were not
        verified this step (trimmed, or the row verified another part's tree), scored against the
        tokens each of `rows` [B] emitted."""
        tree = step.drafts.trees[i]
        if tree.size == 1 or tree.draft_probs is not None:
            return
        emitted = {b: state.tokens[b][step.pos[b] + 1:] for b in rows.cpu().nonzero()[:, 0].tolist()}
        self.calibrators[self.names[i]].add_shadow(tree, _verified_nodes(step, i), emitted)

    def _record(self, state: DecodeState, step: StepRecord, tree: DraftTree) -> None:
        """The step's stats: parts run, modelled ms, per row the chosen length and part (and the log)."""
        stats = state.stats
        if stats is None:
            return
        drafts = (tree.parents[:, 1:] != -2).sum(1).tolist()
        choice = step.choice.tolist()
        ran = [n for n, u in zip(self.names, step.drafts.used) if u]
        for n in ran:
            stats.parts_run[n] = stats.parts_run.get(n, 0) + 1
        if self.cost_model is not None:
            stats.modelled_ms += step.draft_ms + self._costs(state).verify_time(step.batch, tree.size)
        log = step.drafts.proposals is not None
        if log and stats.step_log is None:
            stats.step_log = []
        for b, on in enumerate(step.active.tolist()):
            if not on:
                continue
            part = self.names[choice[b]] if drafts[b] > 0 else None
            stats.record_choice(drafts[b], part)
            if log:
                stats.step_log.append(self._log_entry(state, step, b, drafts[b], part, ran))

    def _log_entry(self, state: DecodeState, step: StepRecord, b: int, drafted: int, part: str | None,
                   ran: list[str]) -> dict:
        """Row b's step-log entry (see DecodeStats.step_log)."""
        pos = step.pos[b]
        row = b if state.rows is None else state.rows[b]  # the caller's row
        return {"step": self._step, "row": row, "pos": pos, "emitted": len(state.tokens[b]) - 1 - pos,
                "drafted": drafted, "part": part, "ran": ran,
                "proposals": {n: c[b] for n, c in step.drafts.proposals.items()}}


def _verified_nodes(step: StepRecord, i: int) -> Tensor:
    """[B, N_i] bool: the nodes of part i's tree that were verified this step."""
    tree = step.drafts.trees[i]
    B, N = tree.tokens.shape
    verified = torch.zeros(B, N, dtype=torch.bool)
    mine = (step.choice.cpu() == i) & step.active.cpu()
    if step.kept_ids is None:
        verified[mine] = True
    else:
        ids = step.kept_ids.cpu()
        b, j = (ids >= 0).nonzero(as_tuple=True)
        keep = mine[b] & (ids[b, j] < N)
        verified[b[keep], ids[b[keep], j[keep]]] = True
    return verified


def _first_child_path(tree: DraftTree) -> list[list[int]]:
    """Per row, the tokens along the path of first children (a chain's drafts)."""
    on = first_path(tree, tree.size)
    return [t[m][1:].tolist() for t, m in zip(tree.tokens, on)]


def _expand(result: VerifyResult, hidden: dict[int, Tensor], kept_ids: Tensor, size: int
            ) -> tuple[VerifyResult, dict[int, Tensor]]:
    """A verification of a compacted tree, re-expressed in the uncompacted tree's node ids."""
    ids = kept_ids.to(result.accepted.device)
    acc = torch.where(result.accepted >= 0, ids.gather(1, result.accepted.clamp(min=0)), -1)
    last = ids.gather(1, result.last_node[:, None])[:, 0]
    full = {}
    for k, h in hidden.items():  # [B, N', H] -> [B, N, H], zeros at dropped nodes
        out = h.new_zeros(h.shape[0], size, h.shape[-1])
        ok = ids >= 0
        b, j = ok.nonzero(as_tuple=True)
        out[b, ids[b, j]] = h[b, j]
        full[k] = out
    return VerifyResult(acc, result.num_accepted, result.next_token, last), full


# ---- one part -----------------------------------------------------------------------------------------
class AdaptiveProposer(Scheduler):
    """One proposer whose draft length is chosen per step (and trimmed per row).

    Args:
        inner: the proposer (n-gram, EAGLE, draft LM, early exit, Medusa).
        cost_model: the target's CostModel (costmodel.load_or_measure).
        max_gamma: longest chain considered (the caller's gamma, when given, is the cap).
        calibrator: an AcceptanceCalibrator (default: a fresh one).
        free_extension: see `planning.trim_tree`.
        explore_every, free_draft, shadow: see Scheduler.
    """

    name = "adaptive"

    def __init__(self, inner: Proposer, cost_model: CostModel, *, max_gamma: int = 8,
                 calibrator: AcceptanceCalibrator | None = None, free_extension: bool = True,
                 explore_every: int = 32, free_draft: float = 0.05, shadow: bool = True):
        if isinstance(inner, Scheduler):
            raise ValueError("wrap the parts instead: "
                             "HybridProposer(parts, cost_model=...) is the adaptive hybrid")
        super().__init__([inner], cost_model=cost_model, calibrator=calibrator, adaptive=True,
                         max_gamma=max_gamma, free_extension=free_extension, explore_every=explore_every,
                         free_draft=free_draft, shadow=shadow)
        self.inner = inner
