"""Adaptive speculation: per step, draft only what is expected to pay, given the text and the load.

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

Layout: AcceptanceCalibrator, expected_tokens, choose_length (the math); trim_tree and the
shared loop (`Scheduler`); AdaptiveProposer (one part). HybridProposer lives in
proposers/hybrid.py and is the same loop over several parts.

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

Deliberately not here: measuring costs (costmodel.py), verification (verify.py), the proposers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from drafttrain.decode.costmodel import CostModel, proposer_key
from drafttrain.decode.proposers.base import Proposer
from drafttrain.decode.tree import DraftTree, DynamicTree, StaticTree, root_only
from drafttrain.decode.verify import VerifyResult

if TYPE_CHECKING:
    from drafttrain.decode.engine import DecodeState

__all__ = ["AcceptanceCalibrator", "expected_tokens", "choose_length", "path_products", "trim_tree",
           "stopping_lengths", "AdaptiveProposer", "Scheduler"]


# ---- calibration ----------------------------------------------------------------------------------
class AcceptanceCalibrator:
    """Online estimate of P(node accepted | parent accepted) from (confidence, depth).

    Counts, all Beta-prior smoothed and decayed by `decay` at every update (so estimates follow
    the text, and a bin that is never tried drifts back to its prior and gets tried again):

        depth marginal  g[d]    = (A[d] + k * g[d - 1]) / (N[d] + k),   g[-1] = prior_mean
        per row         r[b, d] = (A_b[d] + k_row * g[d]) / (N_b[d] + k_row)   (reset per call)
        per cell        c[d, i] = (a[d, i] + k * g[d]) / (n[d, i] + k),  i = confidence bin

    A depth with little evidence is assumed to behave like the depth above it (shrinkage toward
    g[d - 1], not toward a fixed prior): once depth 1 proves reliable, depth 2 is worth trying at
    once (at batch 16 on a CPU, a fixed 0.6 kept chains at one draft while n-gram's deeper drafts
    were accepted 80 % of the time), and a depth that disappoints is learned from its own trials.
    `prior` (before drafting) reads g or r; `prob` (after drafting) reads c. Depths beyond
    `max_depth` share the last bin. Trials: every draft node whose parent was accepted (or is the
    root); successes: those accepted.

    Args:
        bins: confidence bins over [0, 1].
        max_depth: depth bins.
        prior_mean: depth-1 acceptance assumed before any evidence (optimistic enough to try
            drafting); deeper depths shrink toward the depth above.
        prior_strength: k, pseudo-counts of the prior.
        row_strength: k_row, pseudo-counts of the depth marginal in a row's estimate.
        decay: multiplies every count at each update (1 = never forget).
    """

    def __init__(self, *, bins: int = 10, max_depth: int = 16, prior_mean: float = 0.6,
                 prior_strength: float = 4.0, row_strength: float = 8.0, decay: float = 0.98):
        if not 0 < prior_mean < 1 or not 0 < decay <= 1 or bins < 1 or max_depth < 1:
            raise ValueError("need 0 < prior_mean < 1, 0 < decay <= 1, bins >= 1, max_depth >= 1")
        self.settings = dict(bins=bins, max_depth=max_depth, prior_mean=prior_mean,
                             prior_strength=prior_strength, row_strength=row_strength, decay=decay)
        self.bins, self.max_depth, self.prior_mean = bins, max_depth, prior_mean
        self.k, self.k_row, self.decay = prior_strength, row_strength, decay
        D = max_depth
        self.depth_n = torch.zeros(D, dtype=torch.float64)
        self.depth_a = torch.zeros(D, dtype=torch.float64)
        self.cell_n = torch.zeros(D, bins, dtype=torch.float64)
        self.cell_a = torch.zeros(D, bins, dtype=torch.float64)
        self.reset_rows(0)

    def fresh(self) -> AcceptanceCalibrator:
        """A calibrator with the same settings and no evidence."""
        return AcceptanceCalibrator(**self.settings)

    def reset_rows(self, batch: int) -> None:
        """Forgets the per-row evidence (a new generate call with `batch` rows)."""
        self.row_n = torch.zeros(batch, self.max_depth, dtype=torch.float64)
        self.row_a = torch.zeros(batch, self.max_depth, dtype=torch.float64)

    def select_rows(self, idx: Tensor) -> None:
        """Keeps the per-row evidence of batch rows `idx` only (finished rows left the batch)."""
        if self.row_n.shape[0]:
            i = idx.cpu()
            self.row_n, self.row_a = self.row_n[i], self.row_a[i]

    # ---- estimates ------------------------------------------------------------------------------
    def _marginal(self) -> Tensor:
        g, prev = [], self.prior_mean
        for a, n in zip(self.depth_a.tolist(), self.depth_n.tolist()):
            prev = (a + self.k * prev) / (n + self.k)
            g.append(prev)
        return torch.tensor(g, dtype=torch.float64)  # [D]

    def prior(self, depth: int, rows: bool = False) -> Tensor:
        """Estimates for depths 1..depth before drafting: [depth], or [B, depth] per row."""
        g = self._marginal()
        est = (self.row_a + self.k_row * g) / (self.row_n + self.k_row) if rows else g
        idx = torch.arange(depth).clamp(max=self.max_depth - 1)
        return est[..., idx].float()

    def prob(self, confidence: Tensor | None, depths: Tensor) -> Tensor:
        """Calibrated per-node estimate [B, N] from confidences and depths (node 0 -> 1).

        Without confidences (a proposer that gives none) the depth marginal is used.
        """
        g = self._marginal()
        d = (depths.cpu() - 1).clamp(0, self.max_depth - 1)
        if confidence is None:
            est = g[d]
        else:
            cell = (self.cell_a + self.k * g[:, None]) / (self.cell_n + self.k)  # [D, bins]
            est = cell[d, self._bin(confidence.cpu())]
        est = torch.where(depths.cpu() == 0, torch.ones_like(est), est)
        return est.float().to(depths.device)

    def _bin(self, confidence: Tensor) -> Tensor:
        return (confidence.float().nan_to_num(0.0) * self.bins).long().clamp(0, self.bins - 1)

    # ---- evidence -------------------------------------------------------------------------------
    def add(self, confidence: Tensor | None, depth: Tensor, accepted: Tensor, rows: Tensor | None = None) -> None:
        """Adds flat evidence: node confidences [M] (or None), depths [M] (>= 1), accepted [M] bool,
        and optionally the batch row [M] of each node (for the per-row estimate)."""
        d = (depth.cpu().long() - 1).clamp(0, self.max_depth - 1)
        acc = accepted.cpu().double()
        one = torch.ones_like(acc)
        self.depth_n.index_add_(0, d, one)
        self.depth_a.index_add_(0, d, acc)
        if confidence is not None:
            c = self._bin(confidence.cpu())
            self.cell_n.index_put_((d, c), one, accumulate=True)
            self.cell_a.index_put_((d, c), acc, accumulate=True)
        if rows is not None and self.row_n.shape[0]:
            r = rows.cpu().long()
            self.row_n.index_put_((r, d), one, accumulate=True)
            self.row_a.index_put_((r, d), acc, accumulate=True)

    def step(self) -> None:
        """Decays every count once (called once per verification step, drafted or not)."""
        for t in (self.depth_n, self.depth_a, self.cell_n, self.cell_a, self.row_n, self.row_a):
            t.mul_(self.decay)

    def update(self, tree: DraftTree, result: VerifyResult, rows: Tensor | None = None) -> None:
        """Decays, then counts one verification of `tree` (rows [B] bool: which rows count)."""
        self.step()
        B, N = tree.tokens.shape
        if N == 1:
            return
        on_path = torch.zeros(B, N, dtype=torch.bool, device=tree.tokens.device)
        on_path[:, 0] = True
        acc = result.accepted.clamp(min=0)
        valid = torch.arange(acc.shape[1], device=acc.device)[None] < result.num_accepted[:, None]
        on_path.scatter_(1, acc, valid | on_path.gather(1, acc))
        par = tree.parents
        trial = (par >= 0) & on_path.gather(1, par.clamp(min=0))  # parent accepted: this node was tested
        if rows is not None:
            trial &= rows[:, None]
        if not bool(trial.any()):
            return
        b, i = trial.nonzero(as_tuple=True)
        depths = tree.depths()[b, i]
        conf = tree.confidence[b, i] if tree.confidence is not None else None
        if self.row_n.shape[0] != B:
            self.reset_rows(B)
        self.add(conf, depths, on_path[b, i], b)


# ---- the math -------------------------------------------------------------------------------------
def expected_tokens(p_node: Tensor) -> Tensor:
    """Expected emitted tokens (bonus included) of chains of length 0..L.

    Args:
        p_node: [B, L] P(draft k accepted | drafts < k accepted), k = 1..L.

    Returns:
        [B, L + 1]: E_L = 1 + sum_{k <= L} prod_{j <= k} p_j (E_0 = 1).
    """
    reach = torch.cumprod(p_node.double(), dim=1)  # [B, L] P(first k all accepted)
    ones = torch.ones(p_node.shape[0], 1, dtype=torch.float64, device=p_node.device)
    return torch.cat([ones, 1 + reach.cumsum(1)], 1).to(p_node.dtype if p_node.is_floating_point() else torch.float32)


def _rates(exp_tokens: Tensor, batch: int, cost_model: CostModel, draft_name: str | None, active: Tensor,
           draft_batch: int | None = None) -> list[float]:
    """Expected tokens per ms of every common length m = 0..L (all active rows draft m)."""
    L = exp_tokens.shape[1] - 1
    tokens = exp_tokens[active.to(exp_tokens.device)].sum(0).tolist()  # [L + 1] summed over active rows
    d = cost_model.draft_time(draft_name, draft_batch or batch) if draft_name is not None and L else 0.0
    return [tokens[m] / (cost_model.verify_time(batch, 1 + m) + m * d) for m in range(L + 1)]


def choose_length(exp_tokens: Tensor, batch: int, cost_model: CostModel, draft_name: str | None,
                  active: Tensor) -> Tensor:
    """Chain lengths that maximise expected emitted tokens per ms for the whole batch.

    Honest about the engine: verification pads every row to the longest tree, so one forward of
    `batch` rows x (1 + max L_b) tokens costs `verify_time(batch, 1 + max L_b)`; drafting runs the
    rows in lockstep, so it costs `max L_b * draft_time(draft_name, batch)`. Hence every active row
    gets the same length m*, the argmax over m of sum_b E_b(m) / (verify(1 + m) + m * draft);
    ties go to the shorter length, and m* = 0 when no length pays for itself.

    Args:
        exp_tokens: [B, L + 1] expected tokens per row per length (`expected_tokens`).
        batch: rows in the target's forward: the active rows (the engine drops finished rows
            from the batch; with `compact=False`, or a proposer that cannot compact, finished
            rows stay and count here).
        cost_model: a CostModel (or anything with verify_time / draft_time in ms).
        draft_name: the proposer's cost key (None: drafting is free).
        active: [B] bool rows still generating (inactive rows get 0 and count for nothing).

    Returns:
        [B] long lengths.
    """
    rates = _rates(exp_tokens, batch, cost_model, draft_name, active)
    best = max(range(len(rates)), key=lambda m: (rates[m], -m))
    return torch.where(active.to(exp_tokens.device), best, 0).long()


def path_products(p_node: Tensor, parents: Tensor) -> Tensor:
    """[B, N] cumulative estimate of each node along its path from the root (padding 0)."""
    pi = torch.zeros_like(p_node)
    pi[:, 0] = 1.0
    for i in range(1, p_node.shape[1]):
        par = parents[:, i]
        pi[:, i] = torch.where(par >= 0, pi.gather(1, par.clamp(min=0)[:, None])[:, 0] * p_node[:, i], 0.0)
    return pi


def stopping_lengths(pi: Tensor, tau: Tensor, lengths: Tensor) -> Tensor:
    """Per row, the number of leading chain drafts k with pi[:, k] >= tau[k] for every j <= k.

    Args:
        pi: [B, N] cumulative estimate per chain node (node k at column k).
        tau: [N] thresholds (tau[0] unused).
        lengths: [B] drafts each row has.

    Returns:
        [B] long kept lengths; `kept >= k` depends only on pi[:, :k + 1] (a stopping time).
    """
    N = pi.shape[1]
    k = torch.arange(N, device=pi.device)
    ok = (pi >= tau.to(pi.device)[None]) & (k[None] <= lengths[:, None])
    ok[:, 0] = True
    return ok.long().cumprod(1).sum(1) - 1


def trim_tree(tree: DraftTree, p_node: Tensor, *, batch: int, active: Tensor, cost_model: CostModel,
              sunk_ms: float, rate: float, free_extension: bool = True) -> Tensor:
    """Which nodes to verify after drafting: keep mask [B, N] (root always, padding never).

    Sampled chains (`tree.draft_probs` given): the stopping rule with tau_k = rate * (verify(1 + k)
    - verify(k)) / active rows (a draft pays if its expected tokens beat its share of the extra
    verification time at the planned rate), then, with `free_extension`, each row also verifies up
    to the longest kept chain of the other rows (padding makes that free).
    Deterministic drafts: the node budget n* that maximises sum_b (1 + top-n pi of row b) /
    (sunk_ms + verify(1 + n)); each row keeps its n* best nodes (closed under ancestors).

    Args:
        tree: the drafted tree.
        p_node: [B, N] calibrated P(accepted | parent accepted) per node.
        batch: rows in the target's forward.
        active: [B] bool.
        cost_model: verify / draft times (ms).
        sunk_ms: drafting time already spent this step.
        rate: planned expected tokens per ms (from the plan; fixed before drafting).
        free_extension: see above (sampled chains only).
    """
    B, N = tree.tokens.shape
    real = tree.parents != -2
    real &= active[:, None] | (torch.arange(N, device=real.device) == 0)[None]
    pi = torch.where(real, path_products(p_node, tree.parents), 0.0)
    n_active = max(int(active.sum()), 1)
    if tree.draft_probs is not None:
        tau = torch.tensor([0.0] + [rate * (cost_model.verify_time(batch, 1 + k) - cost_model.verify_time(batch, k))
                                    / n_active for k in range(1, N)])
        has = (real[:, 1:].long().sum(1)).clamp(max=N - 1)  # chain drafts per row
        kept = torch.where(active, stopping_lengths(pi, tau, has), 0)
        if free_extension and B > 1:
            top2 = kept.topk(min(2, B)).values  # [2]
            others = torch.where(kept == top2[0], top2[-1], top2[0])  # longest kept among the other rows
            kept = torch.maximum(kept, torch.minimum(others, has))
            kept = torch.where(active, kept, 0)
        return (torch.arange(N, device=pi.device)[None] <= kept[:, None]) & real
    drafts = torch.where(real[:, 1:], pi[:, 1:], -1.0)  # [B, N - 1]; padding sorts last
    order = drafts.sort(dim=1, descending=True, stable=True)
    gain = order.values.clamp(min=0).double().cumsum(1)[active].sum(0).tolist()  # [N - 1]
    tokens = [float(n_active)] + [n_active + g for g in gain]
    best = max(range(N), key=lambda n: (tokens[n] / (sunk_ms + cost_model.verify_time(batch, 1 + n)), -n))
    rank = torch.empty_like(order.indices)
    rank.scatter_(1, order.indices, torch.arange(N - 1, device=rank.device).expand(B, -1))
    keep = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=pi.device), (rank < best) & real[:, 1:]], 1)
    return keep


# ---- tree surgery ---------------------------------------------------------------------------------
def _compact(tree: DraftTree, keep: Tensor) -> tuple[DraftTree, Tensor]:
    """Drops unkept nodes, renumbering per row; returns (tree, kept_ids [B, N'] old id per new node,
    -1 for padding)."""
    B, N = tree.tokens.shape
    count = keep.sum(1)
    Np = int(count.max())
    order = torch.sort((~keep).long(), dim=1, stable=True).indices[:, :Np]  # kept ids first, in order
    slot_ok = torch.arange(Np, device=keep.device)[None] < count[:, None]
    kept_ids = torch.where(slot_ok, order, -1)
    new_of = torch.full((B, N), -1, dtype=torch.long, device=keep.device)
    new_of.scatter_(1, order, torch.where(slot_ok, torch.arange(Np, device=keep.device).expand(B, -1), -1))
    idx = kept_ids.clamp(min=0)
    old_par = tree.parents.gather(1, idx)
    parents = torch.where(old_par >= 0, new_of.gather(1, old_par.clamp(min=0)), old_par)
    parents = torch.where(slot_ok, parents, -2)
    parents[:, 0] = -1
    probs = None
    if tree.draft_probs is not None:
        probs = tree.draft_probs.gather(1, idx[:, :, None].expand(-1, -1, tree.draft_probs.shape[-1]))
        probs = probs * slot_ok[:, :, None]
    conf = tree.confidence.gather(1, idx) if tree.confidence is not None else None
    return DraftTree(tree.tokens.gather(1, idx), parents, probs, conf), kept_ids


def _prefix(tree: DraftTree, length: int) -> DraftTree:
    """A chain cut to its first `length` drafts (node ids unchanged)."""
    n = length + 1
    return DraftTree(tree.tokens[:, :n], tree.parents[:, :n],
                     None if tree.draft_probs is None else tree.draft_probs[:, :n],
                     None if tree.confidence is None else tree.confidence[:, :n])


def _first_child_path(tree: DraftTree) -> list[list[int]]:
    """Per row, the tokens along the path of first children (a chain's drafts)."""
    on = _first_path(tree, tree.size)
    return [t[m][1:].tolist() for t, m in zip(tree.tokens, on)]


def _first_path(tree: DraftTree, depth: int) -> Tensor:
    """[B, N] bool: the nodes of each row's first-child path down to `depth` (root included)."""
    B, N = tree.tokens.shape
    on = torch.zeros(B, N, dtype=torch.bool, device=tree.parents.device)
    on[:, 0] = True
    cur = torch.zeros(B, dtype=torch.long, device=on.device)  # last node on the path
    level = torch.zeros(B, dtype=torch.long, device=on.device)
    for i in range(1, N):
        hit = (tree.parents[:, i] == cur) & (level < depth)
        on[:, i] = hit
        cur = torch.where(hit, i, cur)
        level = level + hit.long()
    return on


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


# ---- the loop ---------------------------------------------------------------------------------------
class Scheduler(Proposer):
    """Plan, draft, choose, trim, learn over one or more parts (see the module docstring).

    Use AdaptiveProposer (one part) or HybridProposer (several); this class holds their loop.

    Args:
        parts: the proposers (AdaptiveProposer parts are unwrapped into their inner proposer).
        cost_model: needed when `adaptive`; kept as `self.cost_model` either way.
        calibrator: one AcceptanceCalibrator (used as is for one part; its settings for fresh
            ones per part when several), {part name: calibrator}, or None (defaults).
        adaptive: plan lengths and trim with the cost model; False: each part drafts `gamma`.
        max_gamma: longest chain an adaptive plan considers (the caller's gamma, when given,
            is the cap instead).
        gamma: non-adaptive chain length (default: the caller's gamma, else each part's default).
        free_extension: see `trim_tree`.
        explore_every: every this many steps a part is probed: it drafts one deeper than it last
            reached whatever the estimate says, and (sampled drafts; deterministic ones are
            scored as shadows) the rows that verify its tree keep that path (so a pessimistic
            estimate can recover: a cold start's early rejections
            would otherwise stop drafting for good at high batch, and deeper drafts that are
            never verified would never be learned again); and with several parts a part
            the skip rule kept out this many steps in a row runs once (`_worth_running`). 0: plans
            are never overridden and the skip rule is off (every part whose plan is > 0 drafts).
        free_draft: a part whose whole chain (the cap) costs at most this fraction of a one-token
            verification is always drafted in full (n-gram lookup: ~1 %); trimming then decides
            per row with the drafts' own confidences (match lengths), which say far more than
            the per-depth estimate the plan has before drafting. 0 turns this off.
        shadow: also learn from deterministic drafts that were not verified, by comparing them
            with the tokens the row emitted (`_shadow`; unbiased and lossless).
    """

    name = "scheduler"

    def __init__(self, parts: list[Proposer], *, cost_model: CostModel | None = None, calibrator=None,
                 adaptive: bool = True, max_gamma: int = 8, gamma: int | None = None,
                 free_extension: bool = True, explore_every: int = 32, free_draft: float = 0.05,
                 shadow: bool = True):
        if not parts:
            raise ValueError("need at least one part")
        inner, cals = [], {}
        for p in parts:
            if isinstance(p, AdaptiveProposer):
                if cost_model is None:
                    cost_model = p.cost_model
                cals[id(p.parts[0])] = p.calibrators[p.names[0]]
                p = p.parts[0]
            elif isinstance(p, Scheduler):
                raise ValueError("a hybrid part cannot itself be a hybrid")
            inner.append(p)
        if adaptive and cost_model is None:
            raise ValueError("adaptive speculation needs a cost model (see drafttrain.decode.costmodel)")
        self.parts = inner
        keys = [proposer_key(p) for p in inner]
        self.names = [k if keys.count(k) == 1 else f"{k}#{i}" for i, k in enumerate(keys)]
        self.calibrators: dict[str, AcceptanceCalibrator] = {}
        for p, n in zip(inner, self.names):
            if isinstance(calibrator, dict):
                cal = calibrator.get(n) or AcceptanceCalibrator()
            elif isinstance(calibrator, AcceptanceCalibrator):
                cal = calibrator if len(inner) == 1 else calibrator.fresh()
            else:
                cal = cals.get(id(p)) or AcceptanceCalibrator()
            self.calibrators[n] = cal
        self.cost_model, self.adaptive, self.max_gamma, self.gamma = cost_model, adaptive, max_gamma, gamma
        self.free_extension, self.explore_every, self.free_draft = free_extension, explore_every, free_draft
        self.shadow = shadow
        self._skipped = [0] * len(inner)  # per part: steps skipped in a row by the skip rule
        self._since = dict.fromkeys(self.names, 0)  # per part: steps since its last probe
        self._reach = dict.fromkeys(self.names, 0)  # per part: most drafts accepted at its last verified step
        self.needs_hidden_states = tuple(sorted({i for p in inner for i in p.needs_hidden_states}))
        self.default_gamma = gamma or max_gamma

    def reset(self) -> None:
        """Forgets everything learned (calibrators, probe and skip counters): a cold start."""
        self.calibrators = {n: c.fresh() for n, c in self.calibrators.items()}
        self._skipped = [0] * len(self.parts)
        self._since, self._reach = dict.fromkeys(self.names, 0), dict.fromkeys(self.names, 0)

    # ---- engine hooks ---------------------------------------------------------------------------
    def prefill(self, state: DecodeState, hidden: dict[int, Tensor]) -> None:
        for p in self.parts:
            p.prefill(state, hidden)
        for cal in self.calibrators.values():
            cal.reset_rows(state.root.shape[0])
        self._step = 0

    def propose(self, state: DecodeState) -> DraftTree:
        B = state.root.shape[0]
        active = state.active.clone()
        log = bool((state.options or {}).get("log_steps"))
        plans = [self._plan(state, p, n) for p, n in zip(self.parts, self.names)]  # (length, rate, ms)
        P = len(self.parts)
        trees: list[DraftTree | None] = [None] * P
        p_nodes: list[Tensor | None] = [None] * P
        used, draft_ms, proposals = [False] * P, [0.0] * P, {}
        probes = [self._probe_depth(n, self._cap(state, p)) for p, n in zip(self.parts, self.names)]
        for i in self._order(state):  # cheap parts first: their proposals inform the skip rule
            p, n, (length, _, _) = self.parts[i], self.names[i], plans[i]
            cap = self._cap(state, p)
            if probes[i]:
                length = max(length, 1 if state.tree is not None else probes[i])
            run = length > 0 and (probes[i] > 0 or self._worth_running(state, i, length, trees, p_nodes, draft_ms))
            if length > 0 and self._skippable():
                self._skipped[i] = 0 if run else self._skipped[i] + 1
            if not run and not log:
                tree = root_only(state.root)
            else:
                tree = self._run(state, p, cap if log else length)
                if log:  # every part drafts in full for the step log; the choice is as without it
                    proposals[n] = [c[:cap] for c in _first_child_path(tree)]
                    if not run:
                        tree = root_only(state.root)
                    elif state.tree is None and length < cap:
                        tree = _prefix(tree, length)  # as if `length` had been drafted
            trees[i], used[i] = tree, run
            p_nodes[i] = self.calibrators[n].prob(tree.confidence, tree.depths())
            draft_ms[i] = self._draft_ms(state, i, length) if run else 0.0
        choice = self._pick(state, self._scores(state, trees, p_nodes))  # [B] part index
        merged, p_merged = self._merge(trees, p_nodes, choice)
        if state.room is not None and merged.size > 1:  # drafts the row cannot emit are worth nothing
            d = merged.depths()
            p_merged = torch.where(d > state.room.to(d.device)[:, None], 0.0, p_merged)
        kept_ids = None
        verified = merged
        if self.adaptive and merged.size > 1:
            sunk = sum(draft_ms)
            rate = max(r for _, r, _ in plans)
            keep = trim_tree(merged, p_merged, batch=B, active=active, cost_model=self.cost_model,
                             sunk_ms=sunk, rate=rate, free_extension=self.free_extension)
            for i, depth in enumerate(probes):
                rows = (choice.to(keep.device) == i) & active.to(keep.device)
                if self.shadow and trees[i].draft_probs is None:
                    continue  # deterministic drafts: the shadow evidence is the probe, verification is not needed
                if depth and used[i] and bool(rows.any()):  # the probe's rows keep its first path
                    keep |= rows[:, None] & _first_path(merged, depth)
            same = keep[:, 1:] == (merged.parents[:, 1:] != -2)
            if not bool((same | ~active[:, None]).all()):
                verified, kept_ids = _compact(merged, keep)
        self._last = dict(active=active, choice=choice, used=used, merged=merged, kept_ids=kept_ids,
                          pos=state.root_pos.tolist(), proposals=proposals if log else None,
                          draft_ms=sum(draft_ms), batch=B, trees=trees)
        return verified

    # ---- the skip rule ----------------------------------------------------------------------------
    def _skippable(self) -> bool:
        """The skip rule needs several parts and a cost model."""
        return len(self.parts) > 1 and self.cost_model is not None

    def _draft_ms(self, state: DecodeState, i: int, length: int) -> float:
        """Modelled drafting ms of part i at the planned `length` (trees: the whole tree)."""
        if self.cost_model is None or length == 0:
            return 0.0
        B, spec, name = state.root.shape[0], state.tree, proposer_key(self.parts[i])
        if spec is None:
            return length * self.cost_model.draft_time(name, B)
        top_k = spec.top_k if isinstance(spec, DynamicTree) else max(len(lv) for lv in spec.levels())
        return spec.depth * self.cost_model.draft_time(name, B * top_k)

    def _order(self, state: DecodeState) -> list[int]:
        """Part indices by modelled draft-step cost, cheapest first (ties: the given order)."""
        if not self._skippable():
            return list(range(len(self.parts)))
        B = state.root.shape[0]
        return sorted(range(len(self.parts)), key=lambda i: (self.cost_model.draft_time(proposer_key(self.parts[i]), B), i))

    def _worth_running(self, state: DecodeState, i: int, length: int, trees: list, p_nodes: list,
                       draft_ms: list[float]) -> bool:
        """Whether part i should draft this step, decided before it drafts (the skip rule).

        Rows gain max(0, E_i - best) expected accepted tokens, where E_i is part i's calibrated
        prior for its planned length (past steps only) and best the score of the best tree the
        cheaper parts already drafted (free signals such as n-gram's match length). Part i runs
        iff that gain raises the step's expected tokens per modelled ms, counting its drafting
        ms and any wider verification. Exploration: a part skipped `explore_every` steps in a
        row runs once (besides the calibrator's decay drifting its estimate back to the prior).
        """
        ran = [j for j, t in enumerate(trees) if t is not None]  # cheaper parts, drafted or skipped
        if not self._skippable() or not ran or self._skipped[i] >= self.explore_every:
            return True
        B, active, spec = state.root.shape[0], state.active.cpu(), state.tree
        best = self._scores(state, [trees[j] for j in ran], [p_nodes[j] for j in ran]).max(0).values.cpu()
        cal = self.calibrators[self.names[i]]
        if spec is None:
            prior = cal.prior(length, rows=True)
            if prior.shape[0] != B:
                prior = cal.prior(length).expand(B, -1)
            size = 1 + length
        else:
            prior = cal.prior(spec.depth).expand(B, -1)
            size = 1 + (len(spec.choices) if isinstance(spec, StaticTree) else spec.budget)
        exp = expected_tokens(prior)[:, -1] - 1  # [B] expected accepted drafts
        gain = float((exp - best).clamp(min=0)[active].sum())
        tokens = float(active.sum()) + float(best[active].sum())
        width = max(trees[j].size for j in ran)
        sunk = sum(draft_ms)
        t0 = sunk + self.cost_model.verify_time(B, width)
        t1 = sunk + self._draft_ms(state, i, length) + self.cost_model.verify_time(B, max(width, size))
        return (tokens + gain) / t1 > tokens / t0

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult, hidden: dict[int, Tensor],
                *, own: Tensor | None = None) -> None:
        last = self._last
        active, choice = last["active"], last["choice"]
        mine = active if own is None else active & own
        full_result, full_hidden = result, hidden
        if last["kept_ids"] is not None:  # back to the merged tree's node ids (each part's own ids)
            full_result, full_hidden = _expand(result, hidden, last["kept_ids"], last["merged"].size)
        verified = tree.depths().max(1).values > 0  # [B] the row verified a draft
        accepted = result.num_accepted.to(verified.device)  # [B] accepted drafts (= depth reached)
        for i, (p, n) in enumerate(zip(self.parts, self.names)):
            rows = mine & (choice == i) & last["used"][i]
            if bool((rows & verified).any()):
                self._reach[n] = int(accepted[rows & verified].max())
            elif last["used"][i] and not bool((active & (choice != i)).any()):
                self._reach[n] = 0  # drafted, every row chose it, nothing verified
            self.calibrators[n].update(tree, result, rows)
            if self.shadow and last["used"][i]:
                self._shadow(state, i, mine)
            p.observe(state, last["merged"], full_result, full_hidden, own=rows)
        self._record(state, tree)
        self._step += 1

    def _shadow(self, state: DecodeState, i: int, rows: Tensor) -> None:
        """Counterfactual evidence: part i's deterministic drafts that were NOT verified this step
        (trimmed, or the row verified another part's tree) are scored against the tokens the row
        emitted: a node counts as a trial when its parent's path equals the emitted tokens and the
        row emitted a token at its depth, and as accepted when its token equals that token.

        Unbiased, at any temperature: for a deterministic draft x, verification accepts it with
        probability p(x), and the emitted token, a sample of the target's distribution whatever
        was verified (lossless), equals x with probability p(x); given the parent's path was
        emitted, the same holds one level down. Lossless to use: the evidence is emitted tokens,
        so later steps' plans still depend on the past only. Sampled drafts (draft_probs given)
        are accepted with min(1, p/q), not p: they get no shadow evidence.

        Without it a draft that is trimmed is never learned from: at batch 16 a cold start's
        early rejections made the trim keep nothing and the estimate could only recover through
        probes. With it n-gram, which drafts its whole cap for free every step, is calibrated on
        every step whatever was verified.
        """
        last = self._last
        tree = last["trees"][i]
        if tree is None or tree.size == 1 or tree.draft_probs is not None:
            return
        B, N = tree.tokens.shape
        verified = torch.zeros(B, N, dtype=torch.bool)  # part i's nodes that were real trials' candidates
        mine = (last["choice"].cpu() == i) & last["active"].cpu()
        if last["kept_ids"] is None:
            verified[mine] = True
        else:
            ids = last["kept_ids"].cpu()
            b, j = (ids >= 0).nonzero(as_tuple=True)
            keep = mine[b] & (ids[b, j] < N)
            verified[b[keep], ids[b[keep], j[keep]]] = True
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        conf = tree.confidence.cpu().tolist() if tree.confidence is not None else None
        rec_b, rec_d, rec_c, rec_a = [], [], [], []
        for b in rows.cpu().nonzero()[:, 0].tolist():
            emitted = state.tokens[b][last["pos"][b] + 1:]
            depth, on = [0] * N, [True] + [False] * (N - 1)  # on: the node's path was emitted
            for j in range(1, N):
                par = pars[b][j]
                if par < 0:
                    continue
                d = depth[j] = depth[par] + 1
                if not on[par] or d > len(emitted):
                    continue
                hit = toks[b][j] == emitted[d - 1]
                on[j] = hit
                if not verified[b, j]:
                    rec_b.append(b), rec_d.append(d), rec_a.append(hit)
                    rec_c.append(conf[b][j] if conf is not None else 0.0)
        if rec_b:
            cal = self.calibrators[self.names[i]]
            if cal.row_n.shape[0] != B:
                cal.reset_rows(B)
            cal.add(torch.tensor(rec_c) if conf is not None else None, torch.tensor(rec_d),
                    torch.tensor(rec_a), torch.tensor(rec_b))

    def select_rows(self, idx: Tensor) -> bool:
        if any(type(p).select_rows is Proposer.select_rows for p in self.parts):
            return False  # a part cannot: change nothing
        for p in self.parts:
            if not p.select_rows(idx):
                raise RuntimeError(f"{type(p).__name__}.select_rows refused after overriding it")
        for cal in {id(c): c for c in self.calibrators.values()}.values():  # each calibrator once
            cal.select_rows(idx)
        return True

    # ---- steps ------------------------------------------------------------------------------------
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
        B, active = state.root.shape[0], state.active
        spec, key = state.tree, proposer_key(part)  # the cost model's key (names get "#i" when keys repeat)
        if spec is None:
            prior = self.calibrators[name].prior(cap, rows=True)  # [B, cap]
            if prior.shape[0] != B:
                prior = self.calibrators[name].prior(cap).expand(B, -1)
            rates = _rates(expected_tokens(prior), B, self.cost_model, key, active)
            best = max(range(len(rates)), key=lambda m: (rates[m], -m))
            step_ms = self.cost_model.draft_time(key, B)
            if self.free_draft and cap * step_ms <= self.free_draft * self.cost_model.verify_time(B, 1):
                length = cap  # nearly free: draft it all, trim on the drafts' confidences
            else:
                length = best
            return length, rates[best], length * step_ms
        depth = spec.depth
        size = 1 + (len(spec.choices) if isinstance(spec, StaticTree) else spec.budget)
        exp = expected_tokens(self.calibrators[name].prior(depth).expand(B, -1))[:, -1]  # [B] chain proxy
        tokens = float(exp[active.cpu()].sum())
        top_k = spec.top_k if isinstance(spec, DynamicTree) else max(len(lv) for lv in spec.levels())
        draft = depth * self.cost_model.draft_time(key, B * top_k)
        tree_rate = tokens / (self.cost_model.verify_time(B, size) + draft)
        none_rate = int(active.sum()) / self.cost_model.verify_time(B, 1)
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

    def _run(self, state: DecodeState, part: Proposer, length: int) -> DraftTree:
        """The part's proposal with state.gamma = length (the caller's settings restored after)."""
        gamma, spec = state.gamma, state.tree
        state.gamma = length
        try:
            return part.propose(state)
        finally:
            state.gamma, state.tree = gamma, spec

    def _scores(self, state: DecodeState, trees: list[DraftTree], p_nodes: list[Tensor]) -> Tensor:
        """[P, B] expected accepted length of each part's tree, from information known before its
        first draft was drawn (sampled trees: first node's estimate, then per-depth priors)."""
        scores = []
        for t, p, n in zip(trees, p_nodes, self.names):
            if t.draft_probs is not None and t.size > 1:
                depths = t.depths()
                prior = self.calibrators[n].prior(t.size, rows=True)
                if prior.shape[0] != depths.shape[0]:
                    prior = self.calibrators[n].prior(t.size).expand(depths.shape[0], -1)
                deep = prior.to(p.device).gather(1, (depths - 1).clamp(min=0))
                p = torch.where(depths <= 1, p, deep)
            pi = torch.where(t.parents >= 0, path_products(p, t.parents), 0.0)
            scores.append(pi[:, 1:].sum(1))
        return torch.stack(scores)

    def _pick(self, state: DecodeState, scores: Tensor) -> Tensor:
        """[B] index of the part whose tree each row verifies (highest score; ties: first part)."""
        return scores.argmax(0)

    def _merge(self, trees: list[DraftTree], p_nodes: list[Tensor], choice: Tensor) -> tuple[DraftTree, Tensor]:
        """Per row, the chosen part's tree with its node ids unchanged (padding appended)."""
        if len(trees) == 1:
            return trees[0], p_nodes[0]
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
            V = next(t.draft_probs.shape[-1] for t, s in zip(trees, sampled) if s)
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
            if probs is not None:
                if t.draft_probs is not None:
                    probs[rows, : min(t.draft_probs.shape[1], N)] = t.draft_probs[rows, :N].float()
                else:
                    if not _is_chain(t):
                        raise ValueError("cannot verify a deterministic tree with siblings in the same batch "
                                         "as sampled drafts; use one tree setting for every part")
                    probs[rows, :n] = _one_hot_probs(t, V)[rows, :n]
        return DraftTree(tokens, parents, probs, conf), p_merged

    def _record(self, state: DecodeState, tree: DraftTree) -> None:
        stats = state.stats
        if stats is None:
            return
        last = self._last
        drafts = (tree.parents[:, 1:] != -2).sum(1).tolist()
        choice = last["choice"].tolist()
        ran = [n for n, u in zip(self.names, last["used"]) if u]
        for n in ran:
            stats.parts_run[n] = stats.parts_run.get(n, 0) + 1
        if self.cost_model is not None:
            stats.modelled_ms += last["draft_ms"] + self.cost_model.verify_time(last["batch"], tree.size)
        log = last["proposals"] is not None
        if log and stats.step_log is None:
            stats.step_log = []
        for b, on in enumerate(last["active"].tolist()):
            if not on:
                continue
            part = self.names[choice[b]] if drafts[b] > 0 else None
            stats.record_choice(drafts[b], part)
            if log:
                pos = last["pos"][b]
                row = b if state.rows is None else state.rows[b]  # the caller's row
                stats.step_log.append({"step": self._step, "row": row, "pos": pos,
                                       "emitted": len(state.tokens[b]) - 1 - pos, "drafted": drafts[b],
                                       "part": part, "ran": ran,
                                       "proposals": {n: c[b] for n, c in last["proposals"].items()}})


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


class AdaptiveProposer(Scheduler):
    """One proposer whose draft length is chosen per step (and trimmed per row).

    Args:
        inner: the proposer (n-gram, EAGLE, draft LM, early exit, Medusa).
        cost_model: the target's CostModel (costmodel.load_or_measure).
        max_gamma: longest chain considered (the caller's gamma, when given, is the cap).
        calibrator: an AcceptanceCalibrator (default: a fresh one).
        free_extension: see `trim_tree`.
        explore_every, free_draft, shadow: see Scheduler.
    """

    name = "adaptive"

    def __init__(self, inner: Proposer, cost_model: CostModel, *, max_gamma: int = 8,
                 calibrator: AcceptanceCalibrator | None = None, free_extension: bool = True,
                 explore_every: int = 32, free_draft: float = 0.05, shadow: bool = True):
        if isinstance(inner, Scheduler):
            raise ValueError("wrap the parts instead: HybridProposer(parts, cost_model=...) is the adaptive hybrid")
        super().__init__([inner], cost_model=cost_model, calibrator=calibrator, adaptive=True,
                         max_gamma=max_gamma, free_extension=free_extension, explore_every=explore_every,
                         free_draft=free_draft, shadow=shadow)
        self.inner = inner
