"""A bf16 linear layer for verification steps on CPUs without native bf16 matmuls.

Why: a decode step multiplies a few rows (batch × tokens fed: 1 for target-only decoding, γ + 1
for verifying a chain) by every weight matrix. On x86 CPUs with AVX2 but no AVX-512 bf16 (AMD
EPYC before Zen 4, many VMs), PyTorch's bf16 matmul for more than one row is compute-bound:
session 8 measured the Gemma 3 LM head (262,144 × 640) at 19.8 ms for one row, 70 ms for four,
88 ms for five and 282 ms for sixteen on such a 2-core VM (2 threads). Verifying five tokens then
costs about 3.5× a target step, and no drafter can pay for itself there.

What: `bf16_linear(x, w, bias)` computes ``x @ w.T (+ bias)`` for bf16 ``w`` and up to
`MAX_ROWS` rows of ``x``, reading each weight row once for all rows: bf16 → fp32 in registers
(a 16-bit shift), fp32 FMAs, fp32 sums, the result rounded to ``x``'s dtype. A small C++
extension (AVX2 + FMA, `at::parallel_for` over weight rows, so `torch.set_num_threads` holds),
compiled once per machine by `torch.utils.cpp_extension` into its cache (~40 s;
`TORCH_EXTENSIONS_DIR`). Measured on an idle AVX-512 bf16 machine (2 threads, the same LM head,
medians of 7 calls of `bf16_linear` and `F.linear`, session 9): 22.7 ms for 1 row, 25.2 for 4,
24.9 for 5, 40.9 for 8, 63.0 for 16 — slower there than PyTorch's native bf16 kernels (22.2,
16.0, 18.2, 19.9, 22.2 ms), which is why `auto` leaves such machines alone. On the AVX2 VM it was
not timed yet (that machine was gone); its figures above are what it is meant to replace.

`install(model)` routes every bf16 `nn.Linear` of an inference model through it for inputs of
`MIN_ROWS` to `MAX_ROWS` rows (one row keeps PyTorch's matrix-vector kernel, which is
memory-bound already; prefill keeps PyTorch's matmul); `uninstall(model)` undoes it. The
decoder installs it for bf16 targets on CPUs with AVX2 and without AVX-512 bf16 or AMX
(`linear_backend=auto`), or when asked (`linear_backend=avx2`).

Numerics: fp32 accumulation of exact fp32 products, in another order than PyTorch's kernel, then
one rounding to bf16, so outputs differ from PyTorch's by bf16 rounding at most; the tests check
that decoding a bf16 target through it gives what PyTorch's matmul gives. Float32 models are never
touched (greedy output in float32 equals the target's own exactly, as before).

Deliberately not here: backward (inference only), AVX-512 / AMX paths (PyTorch's own kernels are
fast there), quantised weights, GPUs.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MIN_ROWS", "MAX_ROWS", "routes", "BACKENDS", "available", "bf16_linear", "install", "is_installed", "paused", "uninstall", "resolve_backend",
           "wants_avx2_linear"]

#: rows (batch × tokens) from which and up to which the kernel runs; one row keeps PyTorch's
#: matrix-vector kernel (memory-bound already: 19.8 ms for the LM head on the AVX2 VM),
#: beyond MAX_ROWS PyTorch's matmul (compute-bound work)
MIN_ROWS, MAX_ROWS = 2, 16
BACKENDS = ("auto", "aten", "avx2")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

static inline __m256 load_bf16x8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// y[m, o] = sum_k x[m, k] * w[o, k] for rows m0 .. m0 + MT of x, weight rows o0 .. o0 + 2.
template <int MT>
static inline void tile(const float* x, const uint16_t* w, float* y, int64_t K, int64_t O,
                        int64_t o, int64_t m0, int64_t orows) {
    __m256 acc[2][MT];
    for (int r = 0; r < 2; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    const uint16_t* w0 = w + o * K;
    const uint16_t* w1 = w + (o + (orows > 1 ? 1 : 0)) * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 a = load_bf16x8(w0 + k);
        __m256 b = load_bf16x8(w1 + k);
        for (int m = 0; m < MT; ++m) {
            __m256 xv = _mm256_loadu_ps(x + (m0 + m) * K + k);
            acc[0][m] = _mm256_fmadd_ps(a, xv, acc[0][m]);
            acc[1][m] = _mm256_fmadd_ps(b, xv, acc[1][m]);
        }
    }
    for (int m = 0; m < MT; ++m) {
        float s0 = hsum(acc[0][m]), s1 = hsum(acc[1][m]);
        for (int64_t kk = k; kk < K; ++kk) {
            float xv = x[(m0 + m) * K + kk];
            s0 += bf16_to_f32(w0[kk]) * xv;
            s1 += bf16_to_f32(w1[kk]) * xv;
        }
        y[(m0 + m) * O + o] = s0;
        if (orows > 1) y[(m0 + m) * O + o + 1] = s1;
    }
}

torch::Tensor bf16_linear_f32(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous fp32 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w: contiguous bf16 [O, K]");
    const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
    TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
    auto y = torch::empty({M, O}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    float* yp = y.data_ptr<float>();
    const int64_t pairs = (O + 1) / 2;
    at::parallel_for(0, pairs, 64, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const int64_t o = 2 * p, orows = (o + 1 < O) ? 2 : 1;
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) tile<4>(xp, wp, yp, K, O, o, m, orows);
            for (; m + 2 <= M; m += 2) tile<2>(xp, wp, yp, K, O, o, m, orows);
            for (; m < M; ++m) tile<1>(xp, wp, yp, K, O, o, m, orows);
        }
    });
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("bf16_linear_f32", &bf16_linear_f32, "x fp32 [M, K] @ w bf16 [O, K]^T -> fp32 [M, O]");
}
"""

_lock = threading.Lock()
_ext = None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def available() -> bool:
    """Whether this CPU can run the kernel (x86 with AVX2 and FMA) and a C++ compiler is found."""
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return False
    from shutil import which

    return which(os.environ.get("CXX", "c++")) is not None or which("g++") is not None


def wants_avx2_linear() -> bool:
    """`auto`'s rule: the kernel where PyTorch's bf16 matmul is slow (AVX2, no AVX-512 bf16 / AMX)."""
    flags = _cpu_flags()
    return available() and not ({"avx512_bf16", "amx_bf16"} & flags)


def resolve_backend(backend: str, model: nn.Module) -> str:
    """"aten" or "avx2" for decoding with `model`.

    Raises:
        ValueError: an unknown backend, or "avx2" where the CPU or compiler cannot run it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"linear_backend must be one of {BACKENDS}, got {backend!r}")
    param = next(model.parameters())
    if backend == "aten":
        return "aten"
    if backend == "avx2":
        if not available():
            raise ValueError("linear_backend=avx2 needs an x86 CPU with AVX2 and FMA and a C++ compiler "
                             "(g++); use linear_backend=aten")
        return "avx2"
    suited = param.device.type == "cpu" and param.dtype == torch.bfloat16 and wants_avx2_linear()
    return "avx2" if suited else "aten"


def _load():
    global _ext
    with _lock:
        if _ext is None:
            from torch.utils.cpp_extension import load_inline

            _ext = load_inline(name="drafttrain_bf16_linear", cpp_sources=[_SOURCE], functions=None,
                               extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                               extra_ldflags=["-fopenmp"], verbose=False)
        return _ext


def bf16_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` for bf16 ``w`` [O, K] and at most `MAX_ROWS` rows of ``x`` [..., K].

    Returns a tensor of ``x``'s dtype and shape [..., O]. The first call compiles the extension
    (about a minute, once per machine).
    """
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = _load().bf16_linear_f32(flat, w.contiguous())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, w.shape[0])


class _Forward:
    """The replacement `forward` of one nn.Linear: the kernel for small inputs, PyTorch's otherwise."""

    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        mod = self.module
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if MIN_ROWS <= rows <= MAX_ROWS and not torch.is_grad_enabled() and x.device.type == "cpu":
            return bf16_linear(x, mod.weight, mod.bias)
        return F.linear(x, mod.weight, mod.bias)


def routes(module: nn.Module, rows: int) -> bool:
    """Whether an input of `rows` rows to `module` runs through the kernel (installed, in range)."""
    return is_installed(module) and MIN_ROWS <= rows <= MAX_ROWS


def install(model: nn.Module) -> int:
    """Routes each bf16 nn.Linear of `model` through the kernel for small inputs; returns how many.

    Compiles the extension now (not at the first step), so its one-time cost is paid up front.
    """
    _load()
    n = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.weight.dtype == torch.bfloat16 and "forward" not in vars(mod):
            mod.forward = _Forward(mod)
            n += 1
    return n


def is_installed(module: nn.Module) -> bool:
    """Whether `install` routed this module through the kernel."""
    return isinstance(vars(module).get("forward"), _Forward)


@contextmanager
def paused(model: nn.Module):
    """PyTorch's forward on every module `install` changed, for the duration of the block."""
    mods = [m for m in model.modules() if is_installed(m)]
    for m in mods:
        del m.forward
    try:
        yield
    finally:
        for m in mods:
            m.forward = _Forward(m)


def uninstall(model: nn.Module) -> None:
    """Restores PyTorch's forward on every module `install` changed."""
    for mod in model.modules():
        if is_installed(mod):
            del mod.forward
