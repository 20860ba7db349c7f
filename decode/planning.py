"""The planning math of adaptive speculation: expected tokens, the length that pays, the trim.

    expected_tokens    E_L = 1 + sum_{k <= L} prod_{j <= k} p_j, per row, for every length L
    length_rates       expected tokens per modelled ms of each common chain length
    choose_length      the length that maximises it for the whole batch (`best_length`)
    path_products      pi of each tree node: the product of the estimates along its path
    stopping_lengths   the stopping rule for sampled chains (keep draft k iff pi_j >= tau_j, j <= k)
    trim_tree          which drafted nodes to verify (sampled chains: the stopping rule;
                       deterministic drafts: the node budget that pays best)
    drafting_ms        modelled ms of drafting a chain or a tree (`chain_ms`: a call's own part
                       plus its steps); `tree_nodes` / `tree_top_k`

Costs are read from a CostModel (or anything with `verify_time(batch, tokens)` and
`draft_time(name, batch)` in ms); estimates come from the calibrator (calibrator.py). Why the
trim keeps the output exactly the target's: proposers/scheduler.py (non-anticipation).

Deliberately not here: learning the estimates (calibrator.py), measuring costs (costmodel.py),
running proposers or keeping any state across steps (proposers/scheduler.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from drafttrain.decode.calibrator import host_array
from drafttrain.decode.tree import DynamicTree, StaticTree

if TYPE_CHECKING:
    from drafttrain.decode.costmodel import CostModel
    from drafttrain.decode.tree import DraftTree

__all__ = ["expected_tokens", "length_rates", "row_length_rates", "best_length", "choose_length", "path_products",
           "stopping_lengths", "trim_tree", "drafting_ms", "chain_ms", "tree_nodes", "tree_top_k"]


def expected_tokens(p_node: Tensor) -> Tensor:
    """Expected emitted tokens (bonus included) of chains of length 0..L.

    Args:
        p_node: [B, L] P(draft k accepted | drafts < k accepted), k = 1..L.

    Returns:
        [B, L + 1]: E_L = 1 + sum_{k <= L} prod_{j <= k} p_j (E_0 = 1).
    """
    reach = np.cumprod(host_array(p_node).astype(np.float64), axis=1)  # [B, L] P(first k all accepted)
    out = np.concatenate([np.ones((reach.shape[0], 1)), 1 + reach.cumsum(1)], 1)
    dtype = p_node.dtype if p_node.is_floating_point() else torch.float32
    return torch.from_numpy(out).to(device=p_node.device, dtype=dtype)


def length_rates(exp_tokens: Tensor, batch: int, cost_model: CostModel, draft_name: str | None,
                 active: Tensor, draft_batch: int | None = None) -> list[float]:
    """Expected tokens per ms of every common length m = 0..L (all active rows draft m).

    Args:
        exp_tokens: [B, L + 1] expected tokens per row per length (`expected_tokens`).
        batch: rows in the target's forward.
        cost_model: verify / draft times (ms).
        draft_name: the proposer's cost key (None: drafting is free).
        active: [B] bool rows still generating.
        draft_batch: rows of a draft step, when not `batch`.
    """
    L = exp_tokens.shape[1] - 1
    tokens = exp_tokens[active.to(exp_tokens.device)].sum(0).tolist()  # [L + 1] summed over active rows
    rows = draft_batch or batch
    return [tokens[m] / (cost_model.verify_time(batch, 1 + m) + chain_ms(cost_model, draft_name, rows, m))
            for m in range(L + 1)]


def row_length_rates(prior: list[float], cost_model: CostModel, draft_name: str | None) -> list[float]:
    """`length_rates` of one active row in Python floats (batch 1, where the plan's [1, L] arrays
    cost more in per-op overhead than in arithmetic): `prior` [L] are the row's float32 estimates,
    and the expected tokens are rounded to float32 as `expected_tokens` returns them, so the rates
    are the array path's to the last bit."""
    exp, reach, total = [1.0], 1.0, 0.0
    for p in prior:
        reach *= p
        total += reach
        exp.append(float(np.float32(1 + total)))
    return [exp[m] / (cost_model.verify_time(1, 1 + m) + chain_ms(cost_model, draft_name, 1, m))
            for m in range(len(exp))]


def best_length(rates: list[float]) -> int:
    """The length with the highest rate; ties go to the shorter length."""
    return max(range(len(rates)), key=lambda m: (rates[m], -m))


def choose_length(exp_tokens: Tensor, batch: int, cost_model: CostModel, draft_name: str | None,
                  active: Tensor) -> Tensor:
    """Chain lengths that maximise expected emitted tokens per ms for the whole batch.

    Honest about the engine: verification pads every row to the longest tree, so one forward of
    `batch` rows x (1 + max L_b) tokens costs `verify_time(batch, 1 + max L_b)`; drafting runs the
    rows in lockstep, so it costs `chain_ms(max L_b)` (a per-call part + max L_b draft steps). Hence
    every active row gets the same length m*, the argmax over m of sum_b E_b(m) / (verify(1 + m) + chain_ms(m));
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
    best = best_length(length_rates(exp_tokens, batch, cost_model, draft_name, active))
    return torch.where(active.to(exp_tokens.device), best, 0).long()


def path_products(p_node: Tensor, parents: Tensor) -> Tensor:
    """[B, N] cumulative estimate of each node along its path from the root (padding 0)."""
    return torch.from_numpy(_path_products(host_array(p_node), host_array(parents))).to(p_node.device)


def _path_products(p: np.ndarray, par: np.ndarray) -> np.ndarray:
    """`path_products` on host arrays: one column at a time (a parent precedes its children)."""
    pi = np.zeros_like(p)
    pi[:, 0] = 1.0
    rows = np.arange(p.shape[0])
    for i in range(1, p.shape[1]):
        col = par[:, i]
        pi[:, i] = np.where(col >= 0, pi[rows, np.maximum(col, 0)] * p[:, i], 0.0)
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
    kept = _stopping(host_array(pi), host_array(tau).astype(np.float32), host_array(lengths))
    return torch.from_numpy(kept).to(pi.device)


def _stopping(pi: np.ndarray, tau: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`stopping_lengths` on host arrays."""
    k = np.arange(pi.shape[1])
    ok = (pi >= tau[None]) & (k[None] <= lengths[:, None])
    ok[:, 0] = True
    return ok.astype(np.int64).cumprod(1).sum(1) - 1


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
    par, act = host_array(tree.parents), host_array(active).astype(bool)
    if par.shape[0] == 1:  # one row (batch 1): Python floats, the same decisions (tests/adaptive)
        keep1 = _trim_row(par[0].tolist(), host_array(p_node)[0].tolist(), bool(act[0]), tree.draft_probs is not None,
                          batch, cost_model, sunk_ms, rate)
        return torch.tensor([keep1], device=tree.parents.device)
    N = par.shape[1]
    real = (par != -2) & (act[:, None] | (np.arange(N) == 0)[None])
    pi = np.where(real, _path_products(host_array(p_node).astype(np.float64), par), 0.0)
    n_active = max(int(act.sum()), 1)
    if tree.draft_probs is not None:
        keep = _trim_sampled(pi, real, act, batch, n_active, cost_model, rate, free_extension)
    else:
        keep = _trim_deterministic(pi, real, act, batch, n_active, cost_model, sunk_ms)
    return torch.from_numpy(keep).to(tree.parents.device)


def _trim_row(parents: list[int], p: list[float], active: bool, sampled: bool, batch: int,
              cost_model: CostModel, sunk_ms: float, rate: float) -> list[bool]:
    """`trim_tree` of a single row in Python floats: at batch 1 the [1, N] arrays cost more in
    per-op overhead than in arithmetic (in the decode loop, after a forward has flushed the
    caches, each numpy / torch op costs several microseconds). The free extension needs other
    rows, so it never applies here."""
    N = len(parents)
    real = [j == 0 or (par != -2 and active) for j, par in enumerate(parents)]
    pi = [1.0] + [0.0] * (N - 1)
    for j in range(1, N):
        if real[j] and parents[j] >= 0:
            pi[j] = pi[parents[j]] * p[j]
    verify = cost_model.verify_time
    if sampled:  # the stopping rule: keep k while every pi_j >= tau_j, j <= k
        has = min(sum(real[1:]), N - 1)
        kept = 0
        if active:
            while kept < has and pi[kept + 1] >= rate * (verify(batch, kept + 2) - verify(batch, kept + 1)):
                kept += 1
        return [j <= kept and real[j] for j in range(N)]
    order = sorted(range(1, N), key=lambda j: (-(pi[j] if real[j] else -1.0), j))  # best first, ties in node order
    tokens, best, best_rate, gain = 1.0, 0, 1.0 / (sunk_ms + verify(batch, 1)), 0.0
    for n, j in enumerate(order, start=1):
        gain += max(pi[j] if real[j] else -1.0, 0.0)
        r = (tokens + gain) / (sunk_ms + verify(batch, 1 + n))
        if r > best_rate:
            best, best_rate = n, r
    keep = [True] + [False] * (N - 1)
    for j in order[:best]:
        keep[j] = real[j]
    return keep


def _trim_sampled(pi: np.ndarray, real: np.ndarray, active: np.ndarray, batch: int, n_active: int,
                  cost_model: CostModel, rate: float, free_extension: bool) -> np.ndarray:
    """Keep mask [B, N] of sampled chains: the stopping rule, then the free extension."""
    B, N = pi.shape
    verify = cost_model.verify_time
    extra = [rate * (verify(batch, 1 + k) - verify(batch, k)) / n_active for k in range(1, N)]
    tau = np.array([0.0] + extra)
    has = np.minimum(real[:, 1:].sum(1), N - 1)  # chain drafts per row
    kept = np.where(active, _stopping(pi, tau, has), 0)
    if free_extension and B > 1:
        top = np.sort(kept)[::-1]
        others = np.where(kept == top[0], top[1], top[0])  # longest kept among the other rows
        kept = np.where(active, np.maximum(kept, np.minimum(others, has)), 0)
    return (np.arange(N)[None] <= kept[:, None]) & real


def _trim_deterministic(pi: np.ndarray, real: np.ndarray, active: np.ndarray, batch: int, n_active: int,
                        cost_model: CostModel, sunk_ms: float) -> np.ndarray:
    """Keep mask [B, N] of deterministic drafts: each row's n* best nodes, one n* for the batch."""
    B, N = pi.shape
    drafts = np.where(real[:, 1:], pi[:, 1:], np.float32(-1))  # [B, N - 1]; padding sorts last
    order = np.argsort(-drafts, axis=1, kind="stable")  # descending, ties in node order
    values = np.take_along_axis(drafts, order, 1)
    gain = np.maximum(values, 0).astype(np.float64).cumsum(1)[active].sum(0).tolist()  # [N - 1]
    tokens = [float(n_active)] + [n_active + g for g in gain]
    best = max(range(N), key=lambda n: (tokens[n] / (sunk_ms + cost_model.verify_time(batch, 1 + n)), -n))
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(N - 1), order.shape), 1)
    return np.concatenate([np.ones((B, 1), dtype=bool), (rank < best) & real[:, 1:]], 1)


# ---- drafting costs ---------------------------------------------------------------------------------
def tree_nodes(spec: StaticTree | DynamicTree) -> int:
    """Nodes of a drafted tree, root included."""
    return 1 + (len(spec.choices) if isinstance(spec, StaticTree) else spec.budget)


def tree_top_k(spec: StaticTree | DynamicTree) -> int:
    """Rows per draft step of one batch row: the widest level (dynamic: top_k)."""
    return spec.top_k if isinstance(spec, DynamicTree) else max(len(lv) for lv in spec.levels())


def drafting_ms(cost_model: CostModel, name: str, batch: int, spec: StaticTree | DynamicTree | None,
                length: int) -> float:
    """Modelled ms to draft a chain of `length` (spec None) or the whole tree `spec`."""
    if spec is None:
        return chain_ms(cost_model, name, batch, length)
    return chain_ms(cost_model, name, batch * tree_top_k(spec), spec.depth)


def chain_ms(cost_model: CostModel, name: str | None, batch: int, length: int) -> float:
    """Modelled ms of `length` draft steps of `batch` rows in one propose call: the call's own
    part (`CostModel.draft_call_time`: catch-up, set-up) plus `length` steps; 0 for no draft or
    no drafter. A cost model without a per-call part (a test's stand-in) charges steps only."""
    if length <= 0 or name is None:
        return 0.0
    call = getattr(cost_model, "draft_call_time", None)
    return (call(name, batch) if call is not None else 0.0) + length * cost_model.draft_time(name, batch)
