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

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from drafttrain.decode.tree import DraftTree
    from drafttrain.decode.verify import VerifyResult

__all__ = ["AcceptanceCalibrator", "shadow_trials", "host_array"]


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
        # Host-side numpy counts: a step touches a few dozen tiny arrays, where each torch op's
        # dispatch (~5 us) would cost more than the arithmetic (session 34: 0.25 -> 0.06 ms a step).
        self.depth_n = np.zeros(D)
        self.depth_a = np.zeros(D)
        self.cell_n = np.zeros((D, bins))
        self.cell_a = np.zeros((D, bins))
        self._g: np.ndarray | None = None  # the depth marginal, until the counts change
        self.reset_rows(0)

    def fresh(self) -> AcceptanceCalibrator:
        """A calibrator with the same settings and no evidence."""
        return AcceptanceCalibrator(**self.settings)

    def reset_rows(self, batch: int) -> None:
        """Forgets the per-row evidence (a new generate call with `batch` rows)."""
        self.row_n = np.zeros((batch, self.max_depth))
        self.row_a = np.zeros((batch, self.max_depth))

    def select_rows(self, idx: Tensor) -> None:
        """Keeps the per-row evidence of batch rows `idx` only (finished rows left the batch)."""
        if self.row_n.shape[0]:
            i = host_array(idx)
            self.row_n, self.row_a = self.row_n[i], self.row_a[i]

    # ---- estimates ------------------------------------------------------------------------------
    def _marginal(self) -> np.ndarray:
        if self._g is None:
            g, prev = [], self.prior_mean
            for a, n in zip(self.depth_a.tolist(), self.depth_n.tolist()):
                prev = (a + self.k * prev) / (n + self.k)
                g.append(prev)
            self._g = np.array(g)  # [D]
        return self._g

    def prior(self, depth: int, rows: bool = False) -> Tensor:
        """Estimates for depths 1..depth before drafting: [depth], or [B, depth] per row."""
        g = self._marginal()
        est = (self.row_a + self.k_row * g) / (self.row_n + self.k_row) if rows else g
        idx = np.minimum(np.arange(depth), self.max_depth - 1)
        return torch.from_numpy(est[..., idx].astype(np.float32))

    def row_prior(self, depth: int) -> list[float]:
        """`batch_prior(depth, 1)[0]` as Python floats (float32 values): a batch-1 plan's estimates."""
        g = self._marginal()
        est = (self.row_a[0] + self.k_row * g) / (self.row_n[0] + self.k_row) if self.row_n.shape[0] == 1 else g
        return est[np.minimum(np.arange(depth), self.max_depth - 1)].astype(np.float32).tolist()

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
        dep = host_array(depths)
        d = np.minimum(np.maximum(dep - 1, 0), self.max_depth - 1)
        if confidence is None:
            est = g[d]
        else:
            cell = (self.cell_a + self.k * g[:, None]) / (self.cell_n + self.k)  # [D, bins]
            est = cell[d, self._bin(host_array(confidence))]
        est = np.where(dep == 0, 1.0, est)
        return torch.from_numpy(est.astype(np.float32)).to(depths.device)

    def _bin(self, confidence: np.ndarray) -> np.ndarray:
        c = np.asarray(confidence, dtype=np.float32) * np.float32(self.bins)
        return np.fmin(np.fmax(c, 0), self.bins - 1).astype(np.int64)  # NaN -> bin 0 (fmax skips NaN)

    # ---- evidence -------------------------------------------------------------------------------
    def add(self, confidence: Tensor | np.ndarray | None, depth: Tensor | np.ndarray,
            accepted: Tensor | np.ndarray, rows: Tensor | np.ndarray | None = None) -> None:
        """Adds flat evidence: node confidences [M] (or None), depths [M] (>= 1), accepted [M] bool,
        and optionally the batch row [M] of each node (for the per-row estimate)."""
        D, bins = self.max_depth, self.bins
        d = np.minimum(np.maximum(host_array(depth).astype(np.int64) - 1, 0), D - 1)
        acc = host_array(accepted).astype(np.float64)
        self.depth_n += np.bincount(d, minlength=D)
        self.depth_a += np.bincount(d, weights=acc, minlength=D)
        if confidence is not None:
            cell = d * bins + self._bin(host_array(confidence))
            self.cell_n += np.bincount(cell, minlength=D * bins).reshape(D, bins)
            self.cell_a += np.bincount(cell, weights=acc, minlength=D * bins).reshape(D, bins)
        B = self.row_n.shape[0]
        if rows is not None and B:
            slot = host_array(rows).astype(np.int64) * D + d
            self.row_n += np.bincount(slot, minlength=B * D).reshape(B, D)
            self.row_a += np.bincount(slot, weights=acc, minlength=B * D).reshape(B, D)
        self._g = None

    def step(self) -> None:
        """Decays every count once (called once per verification step, drafted or not)."""
        for t in (self.depth_n, self.depth_a, self.cell_n, self.cell_a, self.row_n, self.row_a):
            t *= self.decay
        self._g = None

    def update(self, tree: DraftTree, result: VerifyResult, rows: Tensor | None = None) -> None:
        """Decays, then counts one verification of `tree` (rows [B] bool: which rows count)."""
        self.step()
        B, N = tree.tokens.shape
        if N == 1:
            return
        if B == 1 and self._update_chain(tree, result, rows):
            return
        par = host_array(tree.parents)
        acc, num = host_array(result.accepted), host_array(result.num_accepted)
        on_path = np.zeros((B, N), dtype=bool)
        on_path[:, 0] = True
        pb, pk = np.nonzero(np.arange(acc.shape[1])[None] < num[:, None])  # accepted path entries
        on_path[pb, acc[pb, pk]] = True
        trial = (par >= 0) & on_path[np.arange(B)[:, None], np.maximum(par, 0)]  # parent accepted: tested
        if rows is not None:
            trial &= host_array(rows)[:, None]
        b, i = np.nonzero(trial)
        if not len(b):
            return
        depths = host_array(tree.depths())[b, i]
        conf = host_array(tree.confidence)[b, i] if tree.confidence is not None else None
        if self.row_n.shape[0] != B:
            self.reset_rows(B)
        self.add(conf, depths, on_path[b, i], b)

    def _update_chain(self, tree: DraftTree, result: VerifyResult, rows: Tensor | None) -> bool:
        """`update`'s counting for one row whose tree is a chain, in Python scalars (batch 1: a
        few trials, where array ops cost more than the sums); False, counting nothing, for a tree
        with siblings. A chain has one node per depth, so each count gets at most one trial: the
        same sums, in the same order, as the array path."""
        parents = tree.parents[0].tolist()
        if any(p != j - 1 and p != -2 for j, p in enumerate(parents) if j):
            return False
        if rows is not None and not bool(rows[0]):
            return True
        n = int(result.num_accepted[0])
        real = sum(p != -2 for p in parents[1:])
        trials = min(n + 1, real)  # depths 1..n were accepted, n + 1 (when drafted) was tested
        if not trials:
            return True
        conf = tree.confidence[0, 1 : trials + 1].tolist() if tree.confidence is not None else None
        if self.row_n.shape[0] != 1:
            self.reset_rows(1)
        D = self.max_depth
        for k in range(1, trials + 1):
            d, hit = min(k - 1, D - 1), float(k <= n)
            self.depth_n[d] += 1.0
            self.depth_a[d] += hit
            if conf is not None:
                c = int(self._bin(np.float32(conf[k - 1])))
                self.cell_n[d, c] += 1.0
                self.cell_a[d, c] += hit
            self.row_n[0, d] += 1.0
            self.row_a[0, d] += hit
        self._g = None
        return True

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
        ver = host_array(verified)
        rec_b, rec_d, rec_c, rec_a = [], [], [], []
        for b, tokens in emitted.items():
            for j, d, hit in shadow_trials(toks[b], pars[b], tokens):
                if not ver[b, j]:
                    rec_b.append(b), rec_d.append(d), rec_a.append(hit)
                    rec_c.append(conf[b][j] if conf is not None else 0.0)
        if rec_b:
            if self.row_n.shape[0] != B:
                self.reset_rows(B)
            self.add(np.array(rec_c) if conf is not None else None, np.array(rec_d),
                     np.array(rec_a), np.array(rec_b))


def host_array(x: Tensor | np.ndarray) -> np.ndarray:
    """A host numpy view of a tensor (or the array itself): the calibrator's and the planning
    math's small [B, N] arrays, where torch's per-op dispatch costs more than the arithmetic."""
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


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
