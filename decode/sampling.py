"""Logit processing and the randomness used by verification.

What it does:
  * ``process_logits``: temperature, top-k and top-p applied to logits, returning float32
    probabilities. Target and draft MUST go through this same function with the same settings;
    a mismatch silently breaks losslessness (transformers #47932).
  * ``check_logits``: the one place that rejects NaN / +inf logits with a clear error.
  * Random draws for verification: float64 uniforms (float32 ``rand`` can return exactly 0) for
    the accept tests, and for the one emitted token either Exp(1) noise for the exponential race
    ``argmax(r / E)`` or one float64 uniform for an inverse-CDF draw; both sample from an
    unnormalised distribution ``r`` (`sample_weights` takes either). Draws come either from a
    ``torch.Generator`` or are keyed by (seed, absolute position, counter, stream): uniforms from a
    counter-based hash (the keyed emit draw is one such uniform per row, inverted through the
    weights' cumulative sums, `inverse_cdf`, instead of V random numbers), or a row's Exp(1) vector from a generator
    seeded by its key (what the fused GPU kernel consumes). Keyed draws make outputs independent
    of batch composition.

What it deliberately does not do: repetition penalties, min-p, logit bias, grammar masks. Those
belong to the caller and must be applied identically to target and draft before this module.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "check_logits",
    "process_logits",
    "uniforms_from_generator",
    "exponentials_from_generator",
    "counter_uniform",
    "counter_exponential",
    "exponential_race",
    "inverse_cdf",
    "sample_weights",
    "keyed_categorical",
    "row_seeds",
    "STREAM_ACCEPT",
    "STREAM_EMIT",
    "STREAM_DRAFT",
]

# Streams of the counter-based RNG: accept tests, emitted tokens, sampled drafts.
STREAM_ACCEPT = 0x243F6A88
STREAM_EMIT = 0x85A308D3
STREAM_DRAFT = 0x13198A2E

_M32 = 0xFFFFFFFF
_TINY = torch.finfo(torch.float32).tiny


def check_logits(logits: Tensor, name: str = "logits") -> None:
    """Raises ValueError on NaN or +inf logits, or on a row with no finite entry.

    ``-inf`` is allowed: it is how callers mask tokens (reduced draft vocab, bad words).

    Args:
        logits: [..., V] logits.
        name: the name used in the error message.
    """
    if logits.is_floating_point():
        # One reduction for the common case: a row's max is finite iff the row holds no NaN (max
        # propagates it), no +inf and at least one finite entry. Four full passes only on failure.
        if logits.numel() == 0 or bool(torch.isfinite(logits.amax(dim=-1)).all()):
            return
        bad = torch.isnan(logits) | (logits == float("inf"))
        if bool(bad.any()):
            n = int(bad.sum())
            raise ValueError(f"{name} contain {n} NaN or +inf value(s); the target or drafter diverged")
        if bool((logits == float("-inf")).all(dim=-1).any()):
            raise ValueError(f"{name} have a row where every token is -inf (masked out)")


def process_logits(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   *, check: bool = True) -> Tensor:
    """Turns logits into the sampling distribution: temperature, then top-k, then top-p.

    Args:
        logits: [..., V] logits in any float dtype.
        temperature: 0 means greedy (a one-hot at the argmax, lowest index on ties).
        top_k: keep the k largest logits (0 = off). Ties with the k-th value are all kept, so
            the result never depends on the order of equal logits.
        top_p: keep the smallest set of most probable tokens whose mass reaches ``top_p``
            (1.0 = off). The most probable token is always kept.
        check: validate the logits with ``check_logits`` (one host sync).

    Returns:
        [..., V] float32 probabilities summing to 1 on the last axis.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if check:
        check_logits(logits)
    x = logits.float()  # [..., V]
    if temperature == 0:
        idx = x.argmax(dim=-1, keepdim=True)  # first maximum = lowest index
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)
    if temperature != 1.0:  # x / 1.0 is x: one [..., V] pass saved at T = 1
        x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        drop[..., 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# ---------------------------------------------------------------------------------------------
# Random draws
# ---------------------------------------------------------------------------------------------


def uniforms_from_generator(shape: tuple[int, ...], device: torch.device,
                            generator: torch.Generator | None) -> Tensor:
    """float64 uniforms in [0, 1) from a torch generator (or the global RNG)."""
    return torch.rand(shape, dtype=torch.float64, device=device, generator=generator)


def exponentials_from_generator(shape: tuple[int, ...], device: torch.device,
                                generator: torch.Generator | None) -> Tensor:
    """float32 Exp(1) draws, built from float64 uniforms, clamped away from 0."""
    u = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    return _uniform_to_exponential(u)


def _uniform_to_exponential(u: Tensor) -> Tensor:
    # u in [0, 1) -> 1 - u in (0, 1] -> -log(1 - u) in [0, inf); 0 would make r / E blow up
    return (-torch.log1p(-u)).float().clamp_min_(_TINY)


def _mul32(x: Tensor, c: int) -> Tensor:
    # (x * c) mod 2^32 for x in [0, 2^32) held in int64, without signed overflow:
    # split x into 16-bit halves so every product stays below 2^49.
    return ((((x >> 16) * c) & _M32) << 16) + (x & 0xFFFF) * c & _M32


def _hash32(x: Tensor) -> Tensor:
    # A 32-bit integer finaliser (xorshift-multiply rounds); x in [0, 2^32) as int64.
    x = x ^ (x >> 17)
    x = _mul32(x, 0xED5AD4BB)
    x = x ^ (x >> 11)
    x = _mul32(x, 0xAC4C1B51)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x31848BAB)
    return x ^ (x >> 14)


# Stride between the seeds of consecutive rows under one int seed (2^64 / golden ratio, odd), so
# that seed s and seed s + 1 do not share rows the way `s + row` would.
_ROW_STRIDE = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def row_seeds(seed: int, rows: int, device: torch.device | str = "cpu") -> Tensor:
    """[rows] int64 per-row seeds derived from one int seed: row i gets seed + i * stride (mod 2^64).

    One int seed for a batch must give each of the caller's rows its own random stream: callers
    send N copies of a prompt for best-of-N, pass@k or data regeneration and expect N samples.
    Row 0 keeps ``seed`` itself, so a single-row call means what it always meant. The derived seeds
    are keyed by the caller's row index, never by a row's place in a compacted batch.
    """
    vals = [((seed + i * _ROW_STRIDE) & _M64) for i in range(rows)]
    vals = [v - (1 << 64) if v >= 1 << 63 else v for v in vals]  # as signed int64
    return torch.tensor(vals, dtype=torch.long, device=device)


def _row_key(seed: int | Tensor, position: Tensor, stream: int) -> Tensor:
    """32-bit key per (seed, position, stream); ``position`` is an int64 tensor of any shape."""
    pos = position.long()
    if isinstance(seed, Tensor):
        s = seed.long().to(pos.device).reshape(seed.shape + (1,) * (pos.dim() - seed.dim()))
    else:
        s = torch.tensor(int(seed), dtype=torch.long, device=pos.device)
    k = _hash32(torch.full_like(pos, stream & _M32))
    k = _hash32(k ^ (s & _M32))
    k = _hash32(k ^ ((s >> 32) & _M32))
    k = _hash32(k ^ (pos & _M32))
    return _hash32(k ^ ((pos >> 32) & _M32))


# The same hash in NumPy uint32 arithmetic (products wrap mod 2^32 by themselves), for keys on the
# CPU. The keys decoding asks for are tiny (one per row and step, or one per tree node), so the
# torch path above is ~80 elementwise calls of framework overhead: ~1 ms per draw on the 2-core
# CPU, paid by every sampled draft step and twice by every sampled verification. NumPy does the
# same arithmetic and gives the same bits (tests/decode/test_verify.py compares them): 0.37 vs
# 1.86 ms per draw with both cores busy (session 20, `bench/sampled_split.py` prints both).


def _hash32_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(17))
    x = x * np.uint32(0xED5AD4BB)
    x = x ^ (x >> np.uint32(11))
    x = x * np.uint32(0xAC4C1B51)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x31848BAB)
    return x ^ (x >> np.uint32(14))


def _halves_np(t: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Low and high 32 bits of an int64 tensor (two's complement), as uint32 arrays."""
    u = t.long().numpy().view(np.uint64)
    return (u & np.uint64(_M32)).astype(np.uint32), (u >> np.uint64(32)).astype(np.uint32)


def _row_key_np(seed: int | Tensor, position: Tensor, stream: int) -> np.ndarray:
    """`_row_key` for CPU tensors, as a uint32 array of the broadcast shape."""
    pos = position.long()
    if isinstance(seed, Tensor):
        s = seed.long().reshape(seed.shape + (1,) * (pos.dim() - seed.dim()))
    else:
        s = torch.tensor(int(seed), dtype=torch.long)
    s_lo, s_hi = _halves_np(s)
    p_lo, p_hi = _halves_np(pos)
    k = _hash32_np(np.full(s_lo.shape, stream & _M32, dtype=np.uint32))  # broadcasts as it goes
    k = _hash32_np(k ^ s_lo)
    k = _hash32_np(k ^ s_hi)
    k = _hash32_np(k ^ p_lo)
    return _hash32_np(k ^ p_hi)


def _counter_uniform_np(seed: int | Tensor, position: Tensor, counter: Tensor, stream: int) -> Tensor:
    with np.errstate(over="ignore"):  # 0-d arrays compute as NumPy scalars, which warn as they wrap
        key = _row_key_np(seed, position, stream)
        c_lo, _ = _halves_np(counter)
        h1 = _hash32_np(_hash32_np(key ^ c_lo) ^ key)
        h2 = _hash32_np(h1 ^ np.uint32(0x9E3779B9))
    bits = (np.asarray(h1, dtype=np.uint64) << np.uint64(21)) | np.asarray(h2 >> np.uint32(11), dtype=np.uint64)
    return torch.from_numpy(np.array(bits.astype(np.float64) * (2.0 ** -53)))  # a 0-d result stays 0-d


def _hash32_py(x: int) -> int:
    x ^= x >> 17
    x = (x * 0xED5AD4BB) & _M32
    x ^= x >> 11
    x = (x * 0xAC4C1B51) & _M32
    x ^= x >> 15
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 14)


def _counter_uniform_py(seed: int | Tensor, position: Tensor, counter: Tensor, stream: int) -> Tensor:
    """`_counter_uniform_np` in Python ints, for the few keys of one batch-1 step (a row's draft
    draw, its accept tests): ~30 NumPy calls on tiny arrays cost ~0.18 ms a draw, this ~10 µs.
    Python's ``&`` / ``>>`` on negative ints act on the infinite two's complement, so the 32-bit
    halves of signed int64 seeds and positions come out as the other paths take them."""
    pos = position.long()
    s = seed.long().reshape(seed.shape + (1,) * (pos.dim() - seed.dim())) if isinstance(seed, Tensor) \
        else torch.tensor(int(seed), dtype=torch.long)
    s, pos, cnt = torch.broadcast_tensors(s, pos, counter.long())
    k0 = _hash32_py(stream & _M32)
    out = []
    for sv, pv, cv in zip(s.reshape(-1).tolist(), pos.reshape(-1).tolist(), cnt.reshape(-1).tolist()):
        k = _hash32_py(k0 ^ (sv & _M32))
        k = _hash32_py(k ^ ((sv >> 32) & _M32))
        k = _hash32_py(k ^ (pv & _M32))
        key = _hash32_py(k ^ ((pv >> 32) & _M32))
        h1 = _hash32_py(_hash32_py(key ^ (cv & _M32)) ^ key)
        h2 = _hash32_py(h1 ^ 0x9E3779B9)
        out.append(((h1 << 21) | (h2 >> 11)) * 2.0 ** -53)
    return torch.tensor(out, dtype=torch.float64).reshape(s.shape)


# Up to this many keys, the Python-int path beats NumPy's per-call overhead on this 2-core CPU.
_PY_KEYS = 16


def counter_uniform(seed: int | Tensor, position: Tensor, counter: Tensor, stream: int) -> Tensor:
    """Counter-based float64 uniforms in [0, 1), a pure function of their keys.

    Args:
        seed: an int, or a [B] tensor of per-row seeds (then ``position`` is [B, ...]).
        position: int64 tensor of absolute token positions, broadcastable against ``counter``.
        counter: int64 tensor (node index, vocab index), broadcastable against ``position``.
        stream: ``STREAM_ACCEPT`` or ``STREAM_EMIT``.

    Returns:
        float64 tensor of the broadcast shape, values k / 2^53.
    """
    on_cpu = position.device.type == "cpu" and counter.device.type == "cpu"
    if on_cpu and (not isinstance(seed, Tensor) or seed.device.type == "cpu"):
        rows = seed.numel() if isinstance(seed, Tensor) else 1
        if max(rows, position.numel()) * counter.numel() <= _PY_KEYS:
            return _counter_uniform_py(seed, position, counter, stream)
        return _counter_uniform_np(seed, position, counter, stream)
    return _counter_uniform_torch(seed, position, counter, stream)


def _counter_uniform_torch(seed: int | Tensor, position: Tensor, counter: Tensor, stream: int) -> Tensor:
    key = _row_key(seed, position, stream)
    c = counter.long().to(key.device)
    h1 = _hash32(_hash32(key ^ (c & _M32)) ^ key)
    h2 = _hash32(h1 ^ 0x9E3779B9)
    bits = (h1 << 21) | (h2 >> 11)  # 53 random bits
    return bits.double() * (2.0 ** -53)


def counter_exponential(seed: int | Tensor, position: Tensor, vocab_size: int) -> Tensor:
    """[..., V] float32 Exp(1) draws keyed by (seed, position) on the emit stream.

    A pure function of the key, like ``counter_uniform``, but not hashed per vocab index: each
    (seed, position) key seeds its own ``torch.Generator`` (Mersenne Twister on CPU, Philox on
    CUDA), which draws the row's V float64 uniforms. Hashing all 262k indices of Gemma's vocab cost
    ~37 ms per row and step on one CPU core (more than half a target forward); this costs ~5.5 ms.
    The draws differ between CPU and CUDA generators (each is reproducible on its own device).
    """
    key = _row_key(seed, position, STREAM_EMIT)  # the broadcast shape of seed and position
    device = position.device
    u = torch.empty(key.numel(), vocab_size, dtype=torch.float64, device=device)
    for i, k in enumerate(key.reshape(-1).tolist()):
        u[i].uniform_(generator=torch.Generator(device=device).manual_seed(int(k)))
    return _uniform_to_exponential(u).reshape(*key.shape, vocab_size)


def exponential_race(weights: Tensor, exponentials: Tensor) -> Tensor:
    """Samples index i with probability weights[i] / sum(weights), without normalising.

    ``argmax(w / E)`` with E ~ Exp(1) i.i.d.: w_i / E_i are independent Exp(rate w_i) inverses,
    and the largest is index i with probability w_i / sum(w). Ties go to the lowest index.

    Args:
        weights: [..., V] non-negative float32 weights (not all zero).
        exponentials: [..., V] float32 Exp(1) draws.

    Returns:
        [...] long indices.
    """
    return (weights / exponentials).argmax(dim=-1)


def inverse_cdf(weights: Tensor, u: Tensor, *, block: int = 1024) -> Tensor:
    """Samples index i with probability weights[i] / sum(weights) by inverting the float64 CDF.

    Two levels, so a row is read once and only V / `block` + `block` sums are written: the sums
    of consecutive blocks of `block` entries (float32, pairwise: ~1e-7 relative, the precision of
    the float32 probabilities themselves; a float64 reduction costs 100x more on CPU) and their
    float64 cumulative sum pick the block where ``u * total`` falls; the float64 cumulative sum
    inside that block picks the index. Never an index of zero weight: the first index whose
    cumulative sum exceeds the target has positive weight, and a target that rounding puts past a
    block's (or the row's) last sum falls back to the block's last index of positive weight.

    Args:
        weights: [..., V] non-negative weights (not all zero).
        u: [...] float64 uniforms in [0, 1).
        block: entries per first-level block.

    Returns:
        [...] long indices.
    """
    lead, V = weights.shape[:-1], weights.shape[-1]
    w = weights.reshape(-1, V)
    R = w.shape[0]
    nb = -(-V // block)
    padded = w if nb * block == V else torch.nn.functional.pad(w, (0, nb * block - V))
    sums = padded.view(R, nb, block).sum(-1).double()  # [R, nb]
    csum = sums.cumsum(-1)
    if R == 1 and w.device.type == "cpu":
        return _inverse_cdf_one_row(padded[0], sums[0], csum[0], u, block).reshape(lead)
    target = u.to(w.device).double().reshape(R) * csum[:, -1]
    bi = torch.searchsorted(csum, target[:, None], right=True)[:, 0]
    # past the last block (u * total rounded up to the total): the last block of positive mass
    if bool((bi >= nb).any()):
        last_block = nb - 1 - (sums > 0).flip(-1).int().argmax(-1)
        bi = torch.where(bi >= nb, last_block, bi)
    before = torch.where(bi > 0, csum.gather(1, (bi - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    cols = bi[:, None] * block + torch.arange(block, device=w.device)  # [R, block]
    inside = padded.gather(1, cols)  # [R, block]
    within = before[:, None] + inside.cumsum(-1, dtype=torch.float64)
    j = torch.searchsorted(within, target[:, None], right=True)[:, 0]
    last_pos = block - 1 - (inside > 0).flip(-1).int().argmax(-1)
    j = torch.where(j >= block, last_pos, j)
    return (bi * block + j).reshape(lead)


def _inverse_cdf_one_row(padded: Tensor, sums: Tensor, csum: Tensor, u: Tensor, block: int) -> Tensor:
    """`inverse_cdf`'s search for one CPU row, with the index arithmetic in Python: the same sums
    and float64 products (so the same index, bit for bit), in ~6 torch calls instead of ~25 (a
    batch-1 draft or emit draw: 0.22 -> ~0.1 ms on the 2-core CPU)."""
    cs = csum.tolist()
    target = float(u.reshape(-1)[0]) * cs[-1]
    bi = bisect.bisect_right(cs, target)
    if bi >= len(cs):  # u * total rounded up to the total: the last block of positive mass
        bi = max(i for i, v in enumerate(sums.tolist()) if v > 0)
    before = cs[bi - 1] if bi > 0 else 0.0
    inside = padded[bi * block:(bi + 1) * block]
    within = (inside.cumsum(0, dtype=torch.float64) + before).tolist()
    j = bisect.bisect_right(within, target)
    if j >= block:
        j = int(inside.nonzero()[-1, 0])  # the block's last index of positive weight
    return torch.tensor(bi * block + j)


def sample_weights(weights: Tensor, noise: Tensor) -> Tensor:
    """One draw per row from unnormalised `weights` [..., V] with the given noise: Exp(1) draws
    [..., V] (exponential race) or one float64 uniform per row [...] (inverse CDF)."""
    if noise.dim() == weights.dim():
        return exponential_race(weights, noise)
    return inverse_cdf(weights, noise)


def keyed_categorical(probs: Tensor, seed: int | Tensor, position: Tensor) -> Tensor:
    """One draw per row from `probs` [B, V] (rows need not be normalised), keyed by (seed,
    position [B]) on the draft stream: inverse CDF in float64 with one counter uniform per row.

    A sampled draft thus depends on its row's seed, absolute position and distribution only, not
    on the batch's composition. A position drafted again in a later step reuses its uniform;
    that is safe because a draft beyond the first rejection never influenced what was emitted.
    """
    u = counter_uniform(seed, position.long()[:, None], torch.zeros(1, 1, dtype=torch.long), STREAM_DRAFT)
    return inverse_cdf(probs, u[:, 0])
