"""Rejection sampling for chains, every position in parallel: reference and fused Triton kernel.

What it does: for each row b and chain position k, given the target logits there, the draft token
x (or -1 at the bonus position), the draft distribution q and the random draws, it computes

  p        = softmax(logits / T)                       (float32)
  accepted = u * q(x) < p(x)   i.e. u < p(x)/q(x)      (float64 test; q(x) = 0 rejects;
                                                        q = None means one-hot q: u < p(x))
  token    = argmax(r / E) with r = max(p - q, 0)      (the residual; one-hot q: p with x zeroed;
                                                        bonus position: r = p; r empty -> p)

The caller scans ``accepted`` for the first rejection k* and emits ``token[:, k*]``; tokens at
accepted positions are never emitted (where p == q their residual is rounding noise, so the two
implementations may differ there and nowhere else that matters). The exponential
race needs no normalisation of r, which is what lets the kernel do it in one pass over vocab blocks
after a first pass that finds the softmax max and sum.

What it deliberately does not do: top-k / top-p (verification falls back to the reference tree walk
for those), tree siblings (the residual of one sibling feeds the next: sequential by nature), or
drawing the random numbers (both implementations take the same uniforms and exponentials, which
is what makes them comparable bit for bit).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from drafttrain.decode.kernels.dispatch import resolve_impl
from drafttrain.decode.sampling import process_logits

__all__ = ["rejection_sample", "rejection_sample_ref", "rejection_sample_triton"]


def rejection_sample(logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None, temperature: float,
                     uniforms: Tensor, exponentials: Tensor, *, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Dispatches to ``rejection_sample_ref`` or ``rejection_sample_triton`` (see ``resolve_impl``)."""
    fn = rejection_sample_triton if resolve_impl(impl, logits) == "triton" else rejection_sample_ref
    return fn(logits, draft_tokens, draft_probs, temperature, uniforms, exponentials)


def rejection_sample_ref(logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None, temperature: float,
                         uniforms: Tensor, exponentials: Tensor) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch reference of the per-position accept test and residual sample.

    Args:
        logits: [B, K, V] target logits at each chain position.
        draft_tokens: [B, K] long draft token tested at each position, -1 where there is none
            (the bonus position).
        draft_probs: [B, K', V] processed draft probabilities (K' >= last drafted position + 1),
            or None for a deterministic drafter.
        temperature: > 0.
        uniforms: [B, K] float64 in [0, 1).
        exponentials: [B, V] float32 Exp(1) noise shared by a row's positions (only one of them
            is ever emitted).

    Returns:
        ([B, K] bool accepted, [B, K] long residual / bonus sample at each position).
    """
    if temperature <= 0:
        raise ValueError("rejection sampling needs temperature > 0 (greedy has its own path)")
    B, K, V = logits.shape
    p = process_logits(logits, temperature, check=False)  # [B, K, V] float32
    has_draft = draft_tokens >= 0  # [B, K]
    x = draft_tokens.clamp_min(0)[..., None]  # [B, K, 1]
    p_x = p.gather(-1, x)[..., 0].double()
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        r = p.scatter(-1, x, 0.0)  # one-hot q: p with x zeroed
    else:
        q = draft_probs[:, :K].float()
        if q.shape[1] < K:  # positions without a q row have no draft
            q = torch.cat([q, q.new_zeros(B, K - q.shape[1], V)], dim=1)
        q_x = q.gather(-1, x)[..., 0].double()
        r = (p - q).clamp_min(0.0)  # max(p - q, 0)
    # accept x with probability min(1, p(x) / q(x)); q(x) = 0 (a lying proposer) rejects
    accepted = has_draft & (q_x > 0) & (uniforms * q_x < p_x)
    r = torch.where(has_draft[..., None], r, p)  # bonus position: sample p itself
    scores_r = r / exponentials[:, None, :]  # [B, K, V]
    best_r = scores_r.max(dim=-1)
    tok_p = (p / exponentials[:, None, :]).argmax(dim=-1)
    tokens = torch.where(best_r.values > 0, best_r.indices, tok_p)  # empty residual (p == q) -> p
    return accepted, tokens


def rejection_sample_triton(logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                            temperature: float, uniforms: Tensor, exponentials: Tensor,
                            *, block_v: int = 1024) -> tuple[Tensor, Tensor]:
    """Fused Triton version of ``rejection_sample_ref``: one program per (row, position).

    Pass 1 streams the logits in vocab blocks for the softmax max and sum (online, per lane);
    pass 2 streams them again with q and E, computes r = max(p - q, 0) and keeps per lane the best
    r / E and p / E with their indices; a final reduction picks the maximum, lowest index on ties.
    Same arguments and results as the reference.
    """
    import triton  # lazy: the CPU path never imports triton

    if temperature <= 0:
        raise ValueError("rejection sampling needs temperature > 0 (greedy has its own path)")
    kernel = _rejection_kernel()
    B, K, V = logits.shape
    logits = logits.contiguous()
    x = draft_tokens.contiguous().long()
    u = uniforms.contiguous().double()
    e = exponentials.contiguous().float()
    has_q = draft_probs is not None
    q = draft_probs.contiguous() if has_q else logits  # dummy pointer when absent
    kq = q.shape[1]
    accepted = torch.empty(B, K, dtype=torch.int8, device=logits.device)
    tokens = torch.empty(B, K, dtype=torch.long, device=logits.device)
    block = min(block_v, triton.next_power_of_2(V))
    kernel[(B, K)](logits, x, q, u, e, accepted, tokens, K, kq, V, float(temperature),
                   HAS_Q=has_q, BLOCK_V=block)
    return accepted.bool(), tokens


@functools.cache
def _rejection_kernel():
    """Builds the @triton.jit kernel on first use (keeps triton out of module import)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(logits_ptr, x_ptr, q_ptr, u_ptr, e_ptr, acc_ptr, tok_ptr, K, KQ, V, temperature,
               HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
        b = tl.program_id(0)
        k = tl.program_id(1)
        row = (b * K + k).to(tl.int64)
        l_row = logits_ptr + row * V
        e_row = e_ptr + b.to(tl.int64) * V
        lanes = tl.arange(0, BLOCK_V)
        neg_inf = float("-inf")

        # pass 1: per-lane online max and sum of exp for the softmax at temperature
        m_lane = tl.full([BLOCK_V], neg_inf, tl.float32)
        z_lane = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            lg = tl.load(l_row + offs, mask=offs < V, other=neg_inf).to(tl.float32) / temperature
            m_new = tl.maximum(m_lane, lg)
            scale = tl.where(m_new == m_lane, 1.0, tl.exp(m_lane - m_new))
            z_lane = z_lane * scale + tl.where(lg == neg_inf, 0.0, tl.exp(lg - m_new))
            m_lane = m_new
        m = tl.max(m_lane, axis=0)
        z = tl.sum(tl.where(m_lane == neg_inf, 0.0, z_lane * tl.exp(m_lane - m)), axis=0)

        # accept test: u * q(x) < p(x) in float64; x = -1 marks the bonus position
        x = tl.load(x_ptr + row)
        has_draft = x >= 0
        xs = tl.maximum(x, 0)
        lx = tl.load(l_row + xs).to(tl.float32) / temperature
        p_x = tl.exp(lx - m) / z
        if HAS_Q:
            q_row = q_ptr + (b.to(tl.int64) * KQ + tl.minimum(k, KQ - 1)) * V
            q_x = tl.where(has_draft, tl.load(q_row + xs).to(tl.float32), 0.0)  # row index is clamped
        else:
            q_row = q_ptr
            q_x = 1.0
        u = tl.load(u_ptr + row)
        ok = has_draft & (q_x > 0) & (u * q_x.to(tl.float64) < p_x.to(tl.float64))
        tl.store(acc_ptr + row, ok.to(tl.int8))

        # pass 2: exponential race over r = max(p - q, 0) (and over p, for an empty residual)
        best_r = tl.full([BLOCK_V], -1.0, tl.float32)
        idx_r = tl.zeros([BLOCK_V], tl.int32)
        best_p = tl.full([BLOCK_V], -1.0, tl.float32)
        idx_p = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            inside = offs < V
            lg = tl.load(l_row + offs, mask=inside, other=neg_inf).to(tl.float32) / temperature
            p = tl.exp(lg - m) / z
            if HAS_Q:
                q = tl.load(q_row + offs, mask=inside, other=0.0).to(tl.float32)
                q = tl.where(has_draft, q, 0.0)  # bonus position: r = p
                r = tl.maximum(p - q, 0.0)
            else:
                r = tl.where((offs == xs) & has_draft, 0.0, p)
            e = tl.load(e_row + offs, mask=inside, other=1.0)
            sr = tl.where(inside, r / e, -1.0)
            sp = tl.where(inside, p / e, -1.0)
            # strict '>' keeps the earliest index within a lane
            better_r = sr > best_r
            best_r = tl.where(better_r, sr, best_r)
            idx_r = tl.where(better_r, offs, idx_r)
            better_p = sp > best_p
            best_p = tl.where(better_p, sp, best_p)
            idx_p = tl.where(better_p, offs, idx_p)
        top_r = tl.max(best_r, axis=0)
        tok_r = tl.min(tl.where(best_r == top_r, idx_r, V), axis=0)  # lowest index on ties
        top_p = tl.max(best_p, axis=0)
        tok_p = tl.min(tl.where(best_p == top_p, idx_p, V), axis=0)
        tok = tl.where(top_r > 0, tok_r, tok_p)
        tl.store(tok_ptr + row, tok.to(tl.int64))

    return kernel
