"""Verification of a draft tree against the target: which drafts to keep, and the next token.

What it does: given the target's logits at every node of a draft tree (a chain is a tree with
one branch), the tree, and optionally the draft distribution, it returns the accepted path and
one more token from the target: the recovered token after a rejection or the bonus token after
a fully accepted branch. Three rules:

  * greedy (temperature == 0): keep a draft iff it equals the target's argmax at its parent;
  * lossless rejection sampling (Leviathan et al. 2023, Chen et al. 2023; siblings as in
    SpecInfer): the emitted tokens follow exactly the target's own sampling law;
  * typical acceptance (Medusa): LOSSY, opt-in through ``typical=(eps, delta)``.

Siblings and the draft distribution. ``draft_probs[b, i]`` is the distribution q from which the
children of node i were drawn. Siblings drawn i.i.d. WITH replacement from q are verified one
after another with the residual update ``p <- norm(max(p - q, 0))``. A proposer that picks
siblings WITHOUT replacement (top-k candidates, argmax chains, n-gram lookup) is deterministic
and must pass ``draft_probs=None``: each child x is then the one-hot case (accept with
probability p(x), residual = p with x zeroed). Passing q for top-k candidates is a bug: the
output law would no longer be the target's.

What it deliberately does not do: run any model, build trees, update KV caches, stop on EOS, or
process draft logits (the caller gives q already processed by ``sampling.process_logits`` with
the same settings as the target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from drafttrain.decode.kernels import cpu_verify
from drafttrain.decode.kernels.dispatch import IMPLS, resolve_impl
from drafttrain.decode.kernels.rejection import rejection_sample
from drafttrain.decode.sampling import (
    STREAM_ACCEPT,
    STREAM_EMIT,
    check_logits,
    counter_exponential,
    counter_uniform,
    exponentials_from_generator,
    process_logits,
    sample_weights,
    uniforms_from_generator,
)
from drafttrain.decode.tree import dense_probs

__all__ = [
    "VerifyResult",
    "verify_tree",
    "verify_chain",
    "verify_greedy_ref",
    "verify_sampled_ref",
    "verify_typical_ref",
    "chain_parents",
    "VERIFY_IMPLS",
]

#: verification's implementations: the kernel table's, and the CPU's C++ chain kernel
VERIFY_IMPLS = (*IMPLS, "cpu")


@dataclass
class VerifyResult:
    """Outcome of one verification step for a batch of trees.

    Attributes:
        accepted: [B, N-1] long, node indices (1..N-1) of accepted drafts along the path in order,
            padded with -1. For a chain of gamma drafts this is [B, gamma].
        num_accepted: [B] long, number of accepted drafts.
        next_token: [B] long, the recovered (after a rejection) or bonus (after a leaf) token.
        last_node: [B] long, the node whose target output produced ``next_token`` (0 = root).
    """

    accepted: Tensor
    num_accepted: Tensor
    next_token: Tensor
    last_node: Tensor


def chain_parents(batch: int, gamma: int, device: torch.device | str = "cpu") -> Tensor:
    """[B, gamma+1] parents of a chain: [-1, 0, 1, ..., gamma-1]."""
    return (torch.arange(gamma + 1, device=device) - 1).expand(batch, gamma + 1).contiguous()


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def verify_tree(target_logits: Tensor, tokens: Tensor, parents: Tensor, draft_probs: Tensor | None = None,
                *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None, seed: int | Tensor | None = None,
                positions: Tensor | None = None, typical: tuple[float, float] | None = None,
                impl: str = "auto", check: bool = True, draft_vocab: Tensor | None = None) -> VerifyResult:
    """Verifies a batch of draft trees against the target.

    Tree layout per row: node 0 is the root (the last accepted token, not a draft), nodes 1..N-1
    are drafts, ``parents[b, i] < i`` (topological order), ``parents[:, 0] == -1``, and padding
    nodes have parent -2 and are ignored. Children of a node are tried in index order.

    Randomness: float64 uniforms for the accept tests and, for the one emitted token, one more
    float64 uniform (an inverse-CDF draw) or, for the fused GPU chain kernel, Exp(1) noise. With
    ``seed`` they are keyed by (seed, root position, node) for the accept uniforms, (seed, root
    position) on the emit stream for the emit uniform, or for a row's Exp(1) vector
    (`counter_exponential`), so a row's outcome does not depend on the rest of the batch; root
    positions strictly increase from step to step, so keys are never reused. Otherwise they come
    from ``generator`` (or the global RNG): uniforms [B, N] first, then exponentials [B, V].

    Args:
        target_logits: [B, N, V] target logits at each node (the distribution of the next token).
        tokens: [B, N] long token ids (node 0's entry is unused).
        parents: [B, N] long parent indices.
        draft_probs: [B, N, V] processed draft distribution that node i's children were drawn
            from, or None for a deterministic proposer (see the module docstring). [B, N-1, V]
            is accepted too: node N-1 is always a leaf, so its row is never read.
        temperature: 0 = greedy verification; otherwise rejection sampling at this temperature.
        top_k: top-k applied to the target (the draft must have had the same).
        top_p: top-p applied to the target (the draft must have had the same).
        generator: torch generator for the draws (ignored when ``seed`` is given).
        seed: int or [B] per-row seeds for the counter-based RNG; requires ``positions``.
        positions: [B, N] or [B] absolute positions; only the root's (column 0) is used.
        typical: (eps, delta) switches to Medusa typical acceptance: LOSSY, the output law is
            no longer the target's. Accept x if p(x) > min(eps, delta * exp(-H(p))).
        impl: "auto" (Triton for sampled chains on CUDA when triton imports; on x86 CPUs with
            AVX2, `kernels.cpu_verify` for seeded chains at the temperature alone), "ref",
            "triton" or "cpu" (that C++ kernel, or a ValueError where it does not apply).
        check: validate shapes, tree structure and finiteness (a few host syncs).
        draft_vocab: [V'] long target ids of draft_probs' columns when q covers a drafter's
            reduced vocabulary (draft_probs [B, N, V'] or [B, N-1, V'], zero elsewhere); None
            when draft_probs spans the target's V. The CPU chain kernel reads it as is; the
            other paths scatter it to [B, N, V] first.

    Returns:
        VerifyResult.

    Raises:
        ValueError: on NaN / +inf logits, a malformed tree, bad shapes, or ``seed`` without
            ``positions``.
    """
    B, N, V = target_logits.shape
    if impl not in VERIFY_IMPLS:
        raise ValueError(f"impl must be one of {VERIFY_IMPLS}, got {impl!r}")
    if _cpu_chain_kernel(impl, target_logits, temperature, top_k, top_p, typical, seed, parents):
        if check:  # the kernel checks the logits and the draft rows it reads itself
            _check_inputs(target_logits, tokens, parents, draft_probs, values=False, draft_vocab=draft_vocab)
        u_accept, u_emit = _draw(B, N, V, target_logits.device, generator, seed, positions, race=False)
        n, token = cpu_verify.sampled_chain(target_logits, tokens[:, 1:], draft_probs, temperature,
                                            u_accept[:, 1:], u_emit, draft_vocab)
        idx = torch.arange(1, N)[None, :]
        return VerifyResult(torch.where(idx <= n[:, None], idx, -1), n, token, n)  # a chain's path: 1..n
    if draft_vocab is not None and draft_probs is not None:
        if check:  # q's own shape and ids here; the tree and the spread q's values below, once
            _check_draft_vocab(draft_probs, draft_vocab, B, N, V)
        draft_probs = dense_probs(draft_probs, draft_vocab, V)
    if impl == "cpu":
        raise ValueError("impl='cpu' serves seeded, temperature-only sampled chains on x86 CPUs with AVX2; "
                         "this call is not one (use impl='auto')")
    if temperature > 0 and target_logits.device.type == "cpu" and target_logits.dtype != torch.float32:
        # once, up front: the finiteness check and the softmax both read fp32 (a bf16 max over the
        # vocabulary costs ~4x an fp32 one on the CPU); the numbers are those process_logits makes
        target_logits = target_logits.float()
    if check:
        _check_inputs(target_logits, tokens, parents, draft_probs)
    if temperature == 0:
        return verify_greedy_ref(target_logits, tokens, parents)
    probs_needed = typical is not None or top_k > 0 or top_p < 1.0
    use_kernel = _resolve_chain_kernel(impl, target_logits, probs_needed)
    kernel_chain = use_kernel and _is_chain(parents)
    uniforms, exponentials = _draw(B, N, V, target_logits.device, generator, seed, positions, race=kernel_chain)
    if kernel_chain:
        return _verify_chain_kernel(target_logits, tokens[:, 1:], draft_probs, temperature, uniforms,
                                    exponentials, impl="triton")
    if impl == "triton" and use_kernel:
        raise ValueError("impl='triton' serves sampled chains only; this tree has branches or padding")
    probs = process_logits(target_logits, temperature, top_k, top_p, check=False)  # [B, N, V] f32
    if typical is not None:
        return verify_typical_ref(probs, tokens, parents, typical, exponentials)
    if _is_chain(parents):
        return verify_sampled_chain(probs, tokens, draft_probs, uniforms, exponentials)
    return verify_sampled_ref(probs, tokens, parents, draft_probs, uniforms, exponentials)


def verify_chain(target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None = None,
                 **kwargs) -> VerifyResult:
    """Verifies a chain of gamma drafts: a thin wrapper over ``verify_tree``.

    Args:
        target_logits: [B, gamma+1, V] target logits after the root and after each draft.
        draft_tokens: [B, gamma] long draft tokens.
        draft_probs: [B, gamma, V] processed draft distribution each draft was drawn from, or
            None for a deterministic drafter.
        **kwargs: the keyword arguments of ``verify_tree``.

    Returns:
        VerifyResult with ``accepted`` of shape [B, gamma] (node k = draft k-1).
    """
    B, gamma = draft_tokens.shape
    if target_logits.shape[:2] != (B, gamma + 1):
        raise ValueError(f"target_logits must be [B, gamma+1, V] = [{B}, {gamma + 1}, V], "
                         f"got {list(target_logits.shape)}")
    tokens = torch.cat([draft_tokens.new_zeros(B, 1), draft_tokens], dim=1)  # [B, gamma+1]
    parents = chain_parents(B, gamma, draft_tokens.device)
    if draft_probs is not None:
        if draft_probs.shape[:2] != (B, gamma):
            raise ValueError(f"draft_probs must be [B, gamma, V], got {list(draft_probs.shape)}")
    return verify_tree(target_logits, tokens, parents, draft_probs, **kwargs)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def verify_greedy_ref(target_logits: Tensor, tokens: Tensor, parents: Tensor) -> VerifyResult:
    """Greedy verification, vectorised over batch and nodes (no loop over nodes).

    Walk from the root; at node i take t = argmax of the target; move to the first child whose
    token is t, else stop; emit t at the last node.

    Args:
        target_logits: [B, N, V] logits (any float dtype; ties go to the lowest token id).
        tokens: [B, N] long.
        parents: [B, N] long.

    Returns:
        VerifyResult.
    """
    return verify_greedy_ids(target_logits.argmax(dim=-1), tokens, parents)


def verify_greedy_ids(top: Tensor, tokens: Tensor, parents: Tensor) -> VerifyResult:
    """Greedy verification from the target's argmax at each node (`top` [B, N] long), e.g. from
    the fused LM-head argmax kernel, which never materialises the logits."""
    par = parents.clamp_min(0)
    # a draft matches when it equals the target's choice at its parent
    match = (parents >= 0) & (tokens == top.gather(1, par))  # [B, N]
    mask, last = _walk_first_match(match, parents)
    return VerifyResult(_pack_path(mask), mask.sum(1), top.gather(1, last[:, None])[:, 0], last)


def verify_typical_ref(probs: Tensor, tokens: Tensor, parents: Tensor, typical: tuple[float, float],
                       exponentials: Tensor) -> VerifyResult:
    """Medusa typical acceptance. LOSSY: the output does not follow the target's law.

    Keep the first child x of the current node with p(x) > min(eps, delta * exp(-H(p))), where p
    is the processed target distribution at the node; emit a sample of p at the last node.

    Args:
        probs: [B, N, V] processed target probabilities.
        tokens: [B, N] long.
        parents: [B, N] long.
        typical: (eps, delta), Medusa defaults (0.09, 0.3).
        exponentials: the emitted token's noise: [B, V] Exp(1) draws or [B] float64 uniforms
            (`sampling.sample_weights`).

    Returns:
        VerifyResult.
    """
    eps, delta = typical
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)  # [B, N]
    threshold = torch.clamp(delta * torch.exp(-entropy), max=eps)  # [B, N]
    par = parents.clamp_min(0)
    rows = torch.arange(probs.shape[0], device=probs.device)[:, None]
    p_x = probs[rows, par, tokens.clamp_min(0)]  # [B, N] p at the parent of each node's token
    match = (parents >= 0) & (p_x > threshold.gather(1, par))
    mask, last = _walk_first_match(match, parents)
    p_last = probs[rows[:, 0], last]  # [B, V]
    return VerifyResult(_pack_path(mask), mask.sum(1), sample_weights(p_last, exponentials), last)


def verify_sampled_ref(probs: Tensor, tokens: Tensor, parents: Tensor, draft_probs: Tensor | None,
                       uniforms: Tensor, exponentials: Tensor) -> VerifyResult:
    """Lossless rejection sampling over a tree (multi-candidate, SpecInfer style).

    One pass over nodes in index order, vectorised over the batch. Per row the state is the
    current node and its residual r (unnormalised, mass s; the distribution is r / s):

      * a node whose parent is the current node is the next candidate x, drawn from q;
      * accept x with probability min(1, (r(x)/s) / q(x)), i.e. iff u * q(x) * s < r(x), with
        u ~ U[0, 1) in float64 (u = 0 accepts only if r(x) > 0, never a token the target
        excludes); q(x) = 0 means the proposer lied about q: reject;
      * accepted: move to x, r = p at x, s = 1;
      * rejected: r <- max(r/s - q, 0) (one-hot q: r with x zeroed), kept unnormalised; the next
        sibling is tested against this residual. If the residual is empty (p == q up to
        rounding) fall back to p at the current node.

    At the end emit a draw from r (exponential race argmax(r / E), or inverse CDF): the residual
    after a rejection, or p at the leaf (the bonus token).

    Args:
        probs: [B, N, V] float32 processed target probabilities at each node.
        tokens: [B, N] long.
        parents: [B, N] long.
        draft_probs: [B, N', V] q for the children of each node (N' >= last parent + 1), or None.
        uniforms: [B, N] float64 in [0, 1); uniforms[:, c] tests node c.
        exponentials: the emitted token's noise: [B, V] float32 Exp(1) draws (exponential race)
            or [B] float64 uniforms (inverse CDF); `sampling.sample_weights`.

    Returns:
        VerifyResult.
    """
    B, N, V = probs.shape
    rows = torch.arange(B, device=probs.device)
    cur = torch.zeros(B, dtype=torch.long, device=probs.device)  # current node
    r = probs[:, 0].clone()  # [B, V] residual at the current node
    s = torch.ones(B, dtype=torch.float64, device=probs.device)  # [B] mass of r
    mask = torch.zeros(B, N, dtype=torch.bool, device=probs.device)
    for c in range(1, N):
        active = parents[:, c] == cur  # [B] node c is the next sibling to try
        x = tokens[:, c].clamp_min(0)  # [B]
        r_x = r[rows, x].double()
        if draft_probs is None:
            q_x = torch.ones_like(r_x)
            r_rej = r.scatter(1, x[:, None], 0.0)  # p with x zeroed
        else:
            # [B, V] q at the current node (clamped: a leaf's row may be absent and is unused)
            q = draft_probs[rows, cur.clamp(max=draft_probs.shape[1] - 1)].float()
            q_x = q[rows, x].double()
            r_rej = (r - s[:, None].float() * q).clamp_min(0.0)  # max(p - q, 0), unnormalised
        ok = active & (q_x > 0) & (uniforms[:, c] * q_x * s < r_x)
        rej = active & ~ok
        s_rej = r_rej.sum(-1, dtype=torch.float64)
        empty = s_rej <= 0
        r_rej = torch.where(empty[:, None], probs[rows, cur], r_rej)
        s_rej = torch.where(empty, torch.ones_like(s_rej), s_rej)
        r = torch.where(ok[:, None], probs[:, c], torch.where(rej[:, None], r_rej, r))
        s = torch.where(ok, torch.ones_like(s), torch.where(rej, s_rej, s))
        cur = torch.where(ok, c, cur)
        mask[:, c] = ok
    return VerifyResult(_pack_path(mask), mask.sum(1), sample_weights(r, exponentials), cur)


def verify_sampled_chain(probs: Tensor, tokens: Tensor, draft_probs: Tensor | None, uniforms: Tensor,
                         exponentials: Tensor) -> VerifyResult:
    """`verify_sampled_ref` for chains, with the same result bit for bit and one vocabulary pass.

    In a chain every node has one child, so a rejection ends the walk: the accept tests need only
    the scalars p_{c-1}(x_c) and q_{c-1}(x_c) (all gathered at once), the residual is formed once,
    at the first rejected node, and nothing vocabulary-wide happens per node. The tree walk does
    seven [B, V] operations per node: 10 ms of a 6-node chain over Gemma's 262k vocabulary on the
    2-core CPU, a quarter of a target step.
    """
    B, N, V = probs.shape
    rows = torch.arange(B, device=probs.device)
    K = N - 1
    x = tokens[:, 1:].clamp_min(0)  # [B, K] the drafts; node c's token is tested at node c - 1
    p_x = probs[:, :K].gather(2, x[:, :, None])[:, :, 0].double()  # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs[:, :K].gather(2, x[:, :, None])[:, :, 0].float().double()
    ok = (q_x > 0) & (uniforms[:, 1:] * q_x < p_x)  # s = 1 at every accepted node of a chain
    run = ok.long().cumprod(1)  # accepted prefix
    n_acc = run.sum(1)  # [B]
    cur = n_acc  # the last accepted node (0 = the root)
    # [B, V]; one row: a view, not a gather (every [B, V] pass costs ~0.1-0.3 ms at a 262k vocabulary)
    p_cur = probs[:, int(cur)] if B == 1 else probs[rows, cur]
    rejected = n_acc < K
    r = p_cur
    if bool(rejected.any()):
        node = cur.clamp(max=K - 1)
        if draft_probs is None:
            r_rej = p_cur.scatter(1, x[rows, node][:, None], 0.0)
        else:
            qn = node.clamp(max=draft_probs.shape[1] - 1)
            q = (draft_probs[:, int(qn)] if B == 1 else draft_probs[rows, qn]).float()
            r_rej = (p_cur - q).clamp_min(0.0)
        # no mass left: entries are >= 0, so "sum <= 0" is exactly "max == 0" (a float max over 262k
        # entries is ~15x cheaper on the CPU than any() over a bool copy)
        empty = r_rej.amax(-1) <= 0
        if bool(empty.any()):
            r_rej = torch.where(empty[:, None], p_cur, r_rej)
        r = r_rej if bool(rejected.all()) else torch.where(rejected[:, None], r_rej, p_cur)
    mask = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=probs.device), run.bool()], 1)
    return VerifyResult(_pack_path(mask), n_acc, sample_weights(r, exponentials), cur)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _walk_first_match(match: Tensor, parents: Tensor) -> tuple[Tensor, Tensor]:
    """Nodes on the path that follows, from the root, the first matching child at every step.

    Args:
        match: [B, N] bool, whether node c may be entered from its parent.
        parents: [B, N] long.

    Returns:
        ([B, N] bool path mask without the root, [B] long last node on the path).
    """
    B, N = match.shape
    idx = torch.arange(N, device=match.device)
    par = parents.clamp_min(0)
    # only the first matching child of each parent counts (duplicate siblings)
    same_parent = (par[:, :, None] == par[:, None, :]) & (idx[None, :] < idx[:, None])  # [B, N, N]
    chosen = match & ~(same_parent & match[:, None, :]).any(-1)
    chosen[:, 0] = True
    # pointer jumping: ok[c] = AND of `chosen` over c and all its ancestors, in log2(N) rounds
    ok, ptr = chosen, par
    for _ in range(max(1, math.ceil(math.log2(max(N, 2)))) + 1):
        ok = ok & ok.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    mask = ok & (idx > 0)
    last = (mask * idx).amax(dim=1)  # topological order: the deepest node has the largest index
    return mask, last


def _pack_path(mask: Tensor) -> Tensor:
    """[B, N] bool path mask -> [B, N-1] node indices in path order, padded with -1."""
    B, N = mask.shape
    idx = torch.arange(1, N, device=mask.device).expand(B, N - 1)
    key = torch.where(mask[:, 1:], idx, idx + N)  # accepted first, in index (= path) order
    packed = key.sort(dim=1).values
    return torch.where(packed < N, packed, torch.full_like(packed, -1))


def _draw(B: int, N: int, V: int, device: torch.device, generator: torch.Generator | None,
          seed: int | Tensor | None, positions: Tensor | None, *, race: bool) -> tuple[Tensor, Tensor]:
    """Uniforms [B, N] float64 for the accept tests and the emit noise of one verification step:
    exponentials [B, V] float32 from a generator or when `race` (the fused kernel), else one keyed
    float64 uniform per row [B] (an inverse-CDF draw: 1.0 ms for 1 row and 1.4 ms for 16 rows of
    Gemma's 262k vocabulary on the 2-core CPU, where keyed Exp(1) races cost 4.6 and 82 ms)."""
    if seed is None:
        return (uniforms_from_generator((B, N), device, generator),
                exponentials_from_generator((B, V), device, generator))
    if positions is None:
        raise ValueError("seed= needs positions= (absolute positions of the tree nodes)")
    root = (positions[:, 0] if positions.dim() == 2 else positions).to(device).long()  # [B]
    nodes = torch.arange(N, device=device)
    u = counter_uniform(seed, root[:, None], nodes[None, :], STREAM_ACCEPT)  # [B, N]
    if race:
        return u, counter_exponential(seed, root, V)
    return u, counter_uniform(seed, root, torch.zeros_like(root), STREAM_EMIT)  # [B]


def _resolve_chain_kernel(impl: str, logits: Tensor, probs_needed: bool) -> bool:
    """Whether to try the fused chain kernel (it serves temperature only, no top-k/top-p)."""
    chosen = resolve_impl(impl, logits)
    if chosen == "triton" and probs_needed:
        if impl == "triton":
            raise ValueError("impl='triton' does not support top_k / top_p / typical; use impl='auto'")
        return False
    return chosen == "triton"


def _is_chain(parents: Tensor) -> bool:
    B, N = parents.shape
    return bool((parents == chain_parents(B, N - 1, parents.device)).all())


def _verify_chain_kernel(target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                         temperature: float, uniforms: Tensor, exponentials: Tensor,
                         impl: str) -> VerifyResult:
    """Chain verification through ``rejection_sample``: all positions in parallel, then a scan."""
    B, K, _ = target_logits.shape
    gamma = K - 1
    x = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)  # [B, K]; -1 = bonus
    u = torch.cat([uniforms[:, 1:], uniforms.new_zeros(B, 1)], dim=1)  # position k tests node k+1
    acc, tok = rejection_sample(target_logits, x, draft_probs, temperature, u, exponentials, impl=impl)
    n = acc[:, :gamma].long().cumprod(dim=1).sum(dim=1)  # [B] accepted prefix length
    mask = torch.zeros(B, K, dtype=torch.bool, device=acc.device)
    mask[:, 1:] = torch.arange(gamma, device=acc.device)[None, :] < n[:, None]
    return VerifyResult(_pack_path(mask), n, tok.gather(1, n[:, None])[:, 0], n)


def _cpu_chain_kernel(impl: str, logits: Tensor, temperature: float, top_k: int, top_p: float,
                      typical: tuple[float, float] | None, seed, parents: Tensor) -> bool:
    """Whether this verification runs through `kernels.cpu_verify`: sampled at the temperature alone,
    keyed draws (seed; a generator's exponential race keeps the reference), a chain, CPU tensors,
    an x86 CPU with AVX2 and a compiler; impl "auto" or "cpu"."""
    if impl not in ("auto", "cpu") or temperature <= 0 or logits.device.type != "cpu":
        return False
    if typical is not None or top_k > 0 or top_p < 1.0 or seed is None:
        return False
    if logits.dim() != 3 or parents.shape != logits.shape[:2]:
        return False  # malformed: the reference's checks say how
    return _is_chain(parents) and cpu_verify.available()


def _check_draft_vocab(draft_probs: Tensor, draft_vocab: Tensor, B: int, N: int, V: int) -> None:
    """q over a drafter's reduced vocabulary: [B, N or N-1, V'] with V' target ids in [0, V)."""
    Vq = draft_vocab.numel()
    if draft_vocab.dim() != 1 or draft_probs.shape not in ((B, N, Vq), (B, N - 1, Vq)):
        raise ValueError(f"draft_probs over a draft vocabulary of {Vq} ids must be [B, N, {Vq}] "
                         f"(or [B, N-1, {Vq}]), got {list(draft_probs.shape)}")
    if Vq and bool(((draft_vocab < 0) | (draft_vocab >= V)).any()):
        raise ValueError(f"draft_vocab ids must lie in [0, {V})")


def _check_inputs(target_logits: Tensor, tokens: Tensor, parents: Tensor,
                  draft_probs: Tensor | None, *, values: bool = True, draft_vocab: Tensor | None = None) -> None:
    """Shapes, the tree's structure and the draft tokens; with `values`, also the logits'
    finiteness and the draft probabilities' range (the CPU chain kernel checks those itself)."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, N, V], got {list(target_logits.shape)}")
    B, N, V = target_logits.shape
    if tokens.shape != (B, N) or parents.shape != (B, N):
        raise ValueError(f"tokens and parents must be [B, N] = [{B}, {N}], got "
                         f"{list(tokens.shape)} and {list(parents.shape)}")
    if values:
        check_logits(target_logits, "target_logits")
    if bool((parents[:, 0] != -1).any()):
        raise ValueError("parents[:, 0] must be -1 (node 0 is the root)")
    idx = torch.arange(N, device=parents.device)
    ok = (parents == -2) | ((parents >= 0) & (parents < idx))
    if N > 1 and not bool(ok[:, 1:].all()):
        raise ValueError("parents must satisfy 0 <= parents[b, i] < i (or -2 for padding)")
    live = parents[:, 1:] != -2
    t = tokens[:, 1:]
    if bool((live & ((t < 0) | (t >= V))).any()):
        raise ValueError(f"draft tokens must lie in [0, {V})")
    if draft_probs is not None:
        if draft_vocab is not None:
            _check_draft_vocab(draft_probs, draft_vocab, B, N, V)
        elif draft_probs.shape not in ((B, N, V), (B, N - 1, V)):
            raise ValueError(f"draft_probs must be [B, N, V] = [{B}, {N}, {V}] (or [B, N-1, V]), "
                             f"got {list(draft_probs.shape)}")
        if not values:
            return
        lo, hi = torch.aminmax(draft_probs) if draft_probs.numel() else (draft_probs.new_zeros(()),) * 2
        if not (bool(torch.isfinite(hi)) and bool(lo >= 0)):  # one pass; a NaN propagates to both
            raise ValueError("draft_probs must be finite and non-negative (processed probabilities)")

