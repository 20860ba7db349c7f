"""Greedy token ids straight from hidden states: argmax(hidden @ W^T) without the full logits.

What it does: for M hidden states and an LM head W [V, H] it returns the argmax token per row,
lowest id on ties, with an optional Gemma-style soft cap (cap * tanh(logits / cap), which is
monotone but can create ties by saturating). The reference walks the vocabulary in chunks so it
never holds [M, V] float32 logits for a large V; the Triton kernel fuses the projection with a
blocked argmax (per vocab block: max and index; then a tiny reduction across blocks).

What it deliberately does not do: sampling (see ``rejection.py``), returning logits, or a
backward pass.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from drafttrain.decode.kernels.dispatch import resolve_impl

__all__ = ["greedy_lm_head_argmax", "greedy_lm_head_argmax_ref", "greedy_lm_head_argmax_triton"]


def greedy_lm_head_argmax(hidden: Tensor, weight: Tensor, softcap: float | None = None, *,
                          impl: str = "auto") -> Tensor:
    """Dispatches to the reference or the Triton kernel (see ``resolve_impl``)."""
    if resolve_impl(impl, hidden) == "triton":
        return greedy_lm_head_argmax_triton(hidden, weight, softcap)
    return greedy_lm_head_argmax_ref(hidden, weight, softcap)


def greedy_lm_head_argmax_ref(hidden: Tensor, weight: Tensor, softcap: float | None = None,
                              *, chunk: int = 0) -> Tensor:
    """Reference: logits one vocab chunk at a time, running float32 max, lowest index on ties.

    ``chunk=0`` (default) takes the whole vocabulary in one matmul while [M, V] float32 stays
    under 32 MB (decode steps: Gemma's 262k vocabulary for up to 32 rows), else 32,768 rows at a
    time: on a 2-core CPU the eight chunked matmuls of a one-row step cost ~2 ms (~10%) more than
    one (`bench/decode_profile.py`).

    Args:
        hidden: [M, H] hidden states (cast to the weight's dtype; scores compared in float32).
        weight: [V, H] LM head.
        softcap: optional logit soft cap.
        chunk: vocab rows per chunk; peak extra memory is [M, chunk] float32.

    Returns:
        [M] long token ids.
    """
    M = hidden.shape[0]
    if chunk <= 0:
        chunk = weight.shape[0] if M * weight.shape[0] <= (1 << 23) else 32768
    # The matmul runs in the weight's own dtype (a bf16 LM head stays bf16: casting a 262k x 640
    # head to float32 on every call costs more than the matmul itself) and the scores are
    # compared in float32. For a bf16 model this is exactly what its own forward computes.
    h = hidden.to(weight.dtype)
    best_val = torch.full((M,), float("-inf"), device=hidden.device)
    best_idx = torch.zeros(M, dtype=torch.long, device=hidden.device)
    for start in range(0, weight.shape[0], chunk):
        logits = (h @ weight[start:start + chunk].T).float()  # [M, chunk]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        val, idx = logits.max(dim=-1)  # first maximum within the chunk
        better = val > best_val  # strict: an earlier chunk wins a tie
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx + start, best_idx)
    return best_idx


def greedy_lm_head_argmax_triton(hidden: Tensor, weight: Tensor, softcap: float | None = None, *,
                                 block_m: int = 16, block_v: int = 128, block_h: int = 64) -> Tensor:
    """Fused projection + blocked argmax in Triton. Same arguments and result as the reference.

    Each program computes a [block_m, block_v] tile of logits with ``tl.dot`` (IEEE float32
    accumulation, no TF32), applies the soft cap, and stores the tile's per-row max and index;
    the [M, V / block_v] partials are reduced in PyTorch (first block wins a tie).
    """
    import triton  # lazy: the CPU path never imports triton

    kernel = _argmax_kernel()
    M, H = hidden.shape
    V = weight.shape[0]
    hidden = hidden.contiguous()
    weight = weight.contiguous()
    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    n_blocks = triton.cdiv(V, block_v)
    part_val = torch.empty(M, n_blocks, dtype=torch.float32, device=hidden.device)
    part_idx = torch.empty(M, n_blocks, dtype=torch.long, device=hidden.device)
    grid = (triton.cdiv(M, block_m), n_blocks)
    kernel[grid](hidden, weight, part_val, part_idx, M, V, H, n_blocks,
                 float(softcap) if softcap is not None else 1.0,
                 HAS_SOFTCAP=softcap is not None, BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_H=block_h)
    blk = part_val.argmax(dim=1, keepdim=True)  # first maximum = lowest vocab block
    return part_idx.gather(1, blk)[:, 0]


@functools.cache
def _argmax_kernel():
    """Builds the @triton.jit kernel on first use (keeps triton out of module import)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(h_ptr, w_ptr, val_ptr, idx_ptr, M, V, H, NB, softcap,
               HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_H: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_v = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for k in range(0, H, BLOCK_H):
            offs_h = k + tl.arange(0, BLOCK_H)
            h = tl.load(h_ptr + offs_m[:, None] * H + offs_h[None, :],
                        mask=(offs_m[:, None] < M) & (offs_h[None, :] < H), other=0.0)  # [BM, BH]
            w = tl.load(w_ptr + offs_v[None, :].to(tl.int64) * H + offs_h[:, None],
                        mask=(offs_v[None, :] < V) & (offs_h[:, None] < H), other=0.0)  # [BH, BV]
            acc = tl.dot(h, w, acc, input_precision="ieee")
        if HAS_SOFTCAP:
            # tanh(y) = 1 - 2 / (exp(2y) + 1): saturates cleanly to +-1 for large |y|
            acc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * acc / softcap) + 1.0))
        acc = tl.where(offs_v[None, :] < V, acc, float("-inf"))
        val = tl.max(acc, axis=1)  # [BM]
        idx = tl.argmax(acc, axis=1, tie_break_left=True)  # lowest index within the block
        out = offs_m * NB + pid_v
        tl.store(val_ptr + out, val, mask=offs_m < M)
        tl.store(idx_ptr + out, (idx + pid_v * BLOCK_V).to(tl.int64), mask=offs_m < M)

    return kernel
