"""The acceptance calibrator: an online estimate of P(draft accepted | parent accepted).

Adaptive speculation (proposers/scheduler.py) plans and trims drafts from these estimates. The
calibrator learns from two kinds of evidence:

    verified   every draft node whose parent was accepted (or is the root) was a trial; the ones
               verification accepted are successes (`update`)
    shadow     deterministic drafts that were NOT verified, scored against the tokens the row
               emitted (`add_shadow`; unbiased at any temperature, see there)

Deliberately not here: what the estimates are used for (planning.py: expected tokens, lengths,
trimming; proposers/scheduler.py: the loop), costs (costmodel.py), verification (verify.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from drafttrain.decode.tree import DraftTree
    from drafttrain.decode.verify import VerifyResult

__all__ = ["AcceptanceCalibrator", "shadow_trials"]


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

    def batch_prior(self, depth: int, batch: int) -> Tensor:
        """[batch, depth] estimates before drafting: per row when this calibrator tracks `batch`
        rows, else the depth marginal for every row."""
        prior = self.prior(depth, rows=True)
        if prior.shape[0] != batch:
            prior = self.prior(depth).expand(batch, -1)
        return prior

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
    def add(self, confidence: Tensor | None, depth: Tensor, accepted: Tensor,
            rows: Tensor | None = None) -> None:
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

    def add_shadow(self, tree: DraftTree, verified: Tensor, emitted: dict[int, list[int]]) -> None:
        """Counterfactual evidence: the drafts of deterministic `tree` that were NOT verified
        (`verified` [B, N] bool marks the ones that were), scored against the tokens each row in
        `emitted` ({row: tokens emitted after the root}) emitted: a node counts as a trial when
        its parent's path equals the emitted tokens and the row emitted a token at its depth, and
        as accepted when its token equals that token.

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
        if tree.size == 1 or tree.draft_probs is not None:
            return
        B = tree.tokens.shape[0]
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        conf = tree.confidence.cpu().tolist() if tree.confidence is not None else None
        rec_b, rec_d, rec_c, rec_a = [], [], [], []
        for b, tokens in emitted.items():
            for j, d, hit in shadow_trials(toks[b], pars[b], tokens):
                if not verified[b, j]:
                    rec_b.append(b), rec_d.append(d), rec_a.append(hit)
                    rec_c.append(conf[b][j] if conf is not None else 0.0)
        if rec_b:
            if self.row_n.shape[0] != B:
                self.reset_rows(B)
            self.add(torch.tensor(rec_c) if conf is not None else None, torch.tensor(rec_d),
                     torch.tensor(rec_a), torch.tensor(rec_b))


def shadow_trials(tokens: list[int], parents: list[int], emitted: list[int]) -> list[tuple[int, int, bool]]:
    """One row's draft nodes that the emitted tokens test, in node order: (node, depth, hit).

    A node is tested when its parent's path was emitted and the row emitted a token at its depth;
    it hits when its token is that token (see `AcceptanceCalibrator.add_shadow`).
    """
    N = len(tokens)
    depth, on = [0] * N, [True] + [False] * (N - 1)  # on: the node's path was emitted
    out = []
    for j in range(1, N):
        par = parents[j]
        if par < 0:
            continue
        d = depth[j] = depth[par] + 1
        if not on[par] or d > len(emitted):
            continue
        hit = tokens[j] == emitted[d - 1]
        on[j] = hit
        out.append((j, d, hit))
    return out
