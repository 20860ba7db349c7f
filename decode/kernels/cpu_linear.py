"""bf16 linear layers for decode steps on CPUs where PyTorch's bf16 matmul is slow for few rows.

Why: a decode step multiplies a few rows (batch × tokens fed: 1 for target-only decoding, γ + 1
for verifying a chain) by every weight matrix, so it should run at the speed memory delivers the
weights. PyTorch's bf16 kernels fall short of that in two ways. On x86 CPUs with AVX2 but no
AVX-512 bf16 (AMD EPYC before Zen 4, many VMs) its bf16 matmul for more than one row is
compute-bound: session 8 measured the Gemma 3 LM head (262,144 × 640) at 19.8 ms for one row, 70 ms
for four, 88 ms for five and 282 ms for sixteen on such a 2-core VM (2 threads). On an Intel Xeon
with AVX-512 bf16 and AMX (session 10, 2 threads, 13 GB/s fp32 read bandwidth) it reads memory at
half speed for few rows, and each small matmul pays ~0.1 ms of fixed cost: the LM head takes 45-60
ms for one row where 26 ms is the bandwidth's limit, and the 126 matmuls of Gemma 3 270M's 18
layers (200 MB) 35 ms where the AVX-512 kernel here takes 19 ms (`bench/decode_profile.py`).

What: `bf16_linear(x, w, bias)` computes ``x @ w.T (+ bias)`` for bf16 ``w`` and a few rows of
``x``, reading each weight row once for all rows and summing in fp32. Two small C++ extensions
(`at::parallel_for` over weight rows, so `torch.set_num_threads` holds), each compiled once per
machine by `torch.utils.cpp_extension` into its cache (~1 min; `TORCH_EXTENSIONS_DIR`):

- ``avx2``: bf16 → fp32 in registers (a 16-bit shift), fp32 FMAs; for 2 … 16 rows. On the AVX-512
  bf16 AMD EPYC of session 9 it was slower than PyTorch's native kernels (22.7 vs 22.2 ms for 1
  row, 24.9 vs 18.2 for 5), so `auto` uses it only on CPUs without AVX-512 bf16 / AMX.
- ``avx512``: ``vdpbf16ps`` (pairs of bf16 products summed into fp32 lanes, 32 weights per
  instruction, masked loads for the tail); for 1 … 8 rows in one pass over the weights (two weight
  rows held in registers while the rows of x stream past from L1), with a software prefetch of the
  weight rows eight ahead. `auto` picks it on CPUs with AVX-512 bf16. Session 10's first version
  (no prefetch, tiles of 4 rows, 1 … 4 rows) lost to PyTorch's AMX path from 6 rows on; session 14
  (this Intel Xeon, 2 threads, 12–17 GB/s, medians of 9–11 interleaved runs of Gemma 3 270M's
  shapes, `bench/linear_kernels.py`): the 126 layer matmuls / the LM head take 13.3 / 19.9 ms for
  1 row (PyTorch 40.0 / 41.3; the previous kernel 17.5 / 28.2), 14.3 / 20.7 ms for 6 rows (PyTorch
  23–43 / 30–45 as the machine's speed moved), 21–30 / 32–45 for 8 (PyTorch 29–31 / 37–44). The
  prefetch is most of it: without it the kernel's time was memory time plus compute time.
  It also fuses the greedy head (`head_argmax`): argmax ids of the bf16 logits without writing
  them, which saves the [rows, 262144] argmax (1.7 ms for 1 row, 5 ms for 6).

`install(model, backend)` routes every bf16 `nn.Linear` of an inference model through a kernel for
inputs in its row range (larger inputs, prefill included, keep PyTorch's matmul);
`uninstall(model)` undoes it. The decoder's callers (`drafttrain eval`, the bench scripts) install
it for bf16 targets on CPU as `linear_backend=auto` resolves, or when asked.

Numerics: fp32 accumulation of exact products (a bf16 × bf16 product is exact in fp32), in another
order than PyTorch's kernel, then one rounding to ``x``'s dtype, so outputs differ from PyTorch's
by bf16 rounding at most (``vdpbf16ps`` also treats bf16 subnormal inputs as zero); the tests check
exact sums and that decoding a bf16 target through each kernel gives what PyTorch's matmul gives.
Float32 models are never touched (greedy output in float32 equals the target's own exactly).

Deliberately not here: backward (inference only), AMX tiles (beyond 8 rows PyTorch's AMX path is
used), quantised weights, GPUs.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafttrain.config import LINEAR_BACKENDS

__all__ = ["KERNELS", "head_argmax", "routes", "BACKENDS", "available", "bf16_linear", "install", "installed_backend", "setup", "is_installed", "paused",
           "uninstall", "resolve_backend", "wants_amx_linear", "wants_avx2_linear", "wants_avx512_linear"]

BACKENDS = LINEAR_BACKENDS

_AVX2_SOURCE = r"""
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

_AVX512_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// y[m * ys + r] = sum_k x[m, k] * w[o + r, k] for r < R and all MT rows of x, in one pass over the
// weights: each 64-byte chunk of the R weight rows is loaded once and held while the MT rows of x
// (a few KB, L1-resident) stream past it; vdpbf16ps sums bf16 pairs into fp32 lanes. `pf`, when
// set, is the weight row PF rows ahead, prefetched chunk by chunk so the memory stream keeps going
// while the core computes (without it the kernel's time was memory time plus compute time).
template <int R, int MT>
static inline void tile(const uint16_t* x, const uint16_t* w, float* y, int64_t K, int64_t ys, int64_t o,
                        const uint16_t* pf) {
    __m512 acc[R][MT];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = (K - k >= 32) ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        if (pf)
            for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T0);
        __m512bh wv[R];
        for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (o + r) * K + k);
        for (int m = 0; m < MT; ++m) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
            for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) y[m * ys + r] = _mm512_reduce_add_ps(acc[r][m]);
}

constexpr int64_t kTileRows = 2, kPrefetchRows = 8;  // weight rows per tile; prefetch distance

template <int MT>
static void rows(const uint16_t* x, const uint16_t* w, float* y, int64_t K, int64_t O) {
    const int64_t pairs = O / kTileRows;
    at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const int64_t o = kTileRows * p;
            const bool ahead = o + kPrefetchRows + kTileRows <= O;
            tile<kTileRows, MT>(x, w, y + o, K, O, o, ahead ? w + (o + kPrefetchRows) * K : nullptr);
        }
    });
    for (int64_t o = kTileRows * pairs; o < O; ++o) tile<1, MT>(x, w, y + o, K, O, o, nullptr);
}

// fp32 -> bf16 -> fp32, rounding to nearest even: the value PyTorch's bf16 logits hold
static inline float round_bf16(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&v, &u, 4);
    return v;
}

// argmax over o of bf16(x[m] . w[o]) for each of MT rows, lowest o on ties, without storing
// [MT, O] logits: blocks of weight rows in parallel, each keeps its best per row, then the
// blocks are merged in order (a later block wins only when strictly greater).
template <int MT>
static void rows_argmax(const uint16_t* x, const uint16_t* w, int64_t* out, int64_t K, int64_t O) {
    constexpr int64_t kBlock = 4096;  // weight rows per block
    const int64_t nblocks = (O + kBlock - 1) / kBlock;
    std::vector<float> bval(nblocks * MT);
    std::vector<int64_t> bidx(nblocks * MT);
    at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            const int64_t o0 = b * kBlock, o1 = std::min(O, o0 + kBlock);
            float best[MT], y[MT * kTileRows];
            int64_t arg[MT];
            for (int m = 0; m < MT; ++m) best[m] = -INFINITY, arg[m] = o0;
            int64_t o = o0;
            for (; o + kTileRows <= o1; o += kTileRows) {
                const bool ahead = o + kPrefetchRows + kTileRows <= O;
                tile<kTileRows, MT>(x, w, y, K, kTileRows, o, ahead ? w + (o + kPrefetchRows) * K : nullptr);
                for (int m = 0; m < MT; ++m)
                    for (int r = 0; r < kTileRows; ++r) {
                        const float v = round_bf16(y[m * kTileRows + r]);
                        if (v > best[m]) best[m] = v, arg[m] = o + r;
                    }
            }
            for (; o < o1; ++o) {
                tile<1, MT>(x, w, y, K, 1, o, nullptr);
                for (int m = 0; m < MT; ++m) {
                    const float v = round_bf16(y[m]);
                    if (v > best[m]) best[m] = v, arg[m] = o;
                }
            }
            for (int m = 0; m < MT; ++m) bval[b * MT + m] = best[m], bidx[b * MT + m] = arg[m];
        }
    });
    for (int m = 0; m < MT; ++m) {
        float best = -INFINITY;
        int64_t arg = 0;
        for (int64_t b = 0; b < nblocks; ++b)
            if (bval[b * MT + m] > best) best = bval[b * MT + m], arg = bidx[b * MT + m];
        out[m] = arg;
    }
}

torch::Tensor bf16_linear_bf16x(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2, "x: contiguous bf16 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w: contiguous bf16 [O, K]");
    const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
    TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
    auto y = torch::empty({M, O}, x.options().dtype(torch::kFloat32));
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    float* yp = y.data_ptr<float>();
    for (int64_t m0 = 0; m0 < M; m0 += 8) {  // passes of up to 8 rows (more rows work, slowly)
        const uint16_t* xm = xp + m0 * K;
        float* ym = yp + m0 * O;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: rows<1>(xm, wp, ym, K, O); break;
            case 2: rows<2>(xm, wp, ym, K, O); break;
            case 3: rows<3>(xm, wp, ym, K, O); break;
            case 4: rows<4>(xm, wp, ym, K, O); break;
            case 5: rows<5>(xm, wp, ym, K, O); break;
            case 6: rows<6>(xm, wp, ym, K, O); break;
            case 7: rows<7>(xm, wp, ym, K, O); break;
            default: rows<8>(xm, wp, ym, K, O); break;
        }
    }
    return y;
}

torch::Tensor bf16_linear_argmax(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2, "x: contiguous bf16 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w: contiguous bf16 [O, K]");
    const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
    TORCH_CHECK(w.size(1) == K && O > 0, "x and w disagree on K, or w is empty");
    auto out = torch::empty({M}, x.options().dtype(torch::kLong));
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    int64_t* op = out.data_ptr<int64_t>();
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const uint16_t* xm = xp + m0 * K;
        switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: rows_argmax<1>(xm, wp, op + m0, K, O); break;
            case 2: rows_argmax<2>(xm, wp, op + m0, K, O); break;
            case 3: rows_argmax<3>(xm, wp, op + m0, K, O); break;
            case 4: rows_argmax<4>(xm, wp, op + m0, K, O); break;
            case 5: rows_argmax<5>(xm, wp, op + m0, K, O); break;
            case 6: rows_argmax<6>(xm, wp, op + m0, K, O); break;
            case 7: rows_argmax<7>(xm, wp, op + m0, K, O); break;
            default: rows_argmax<8>(xm, wp, op + m0, K, O); break;
        }
    }
    return out;
}

"""

_AVX512_BINDINGS = r"""
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("bf16_linear_bf16x", &bf16_linear_bf16x, "x bf16 [M, K] @ w bf16 [O, K]^T -> fp32 [M, O]");
    m.def("bf16_linear_argmax", &bf16_linear_argmax, "argmax_o bf16(x bf16 [M, K] @ w bf16 [O, K]^T) -> int64 [M]");
}
"""



_AMX_SOURCE = r"""
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out AMX tile state only on request, once per process (ARCH_REQ_XCOMP_PERM = 0x1023,
// XFEATURE_XTILEDATA = 18); without it the first tile instruction kills the process.
static bool amx_permit() {
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok == 1;
}

bool amx_available() { return amx_permit(); }

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// For each block of 32 weight rows: C (tiles 0, 1: 16 weight rows x N rows of x each) += A (tiles
// 2, 3: 16 weight rows x 32 k, loaded straight from w) . B (tile 4: x packed as [K/2][N][2] bf16
// pairs, tiny and L1-resident). The block one ahead is prefetched line by line across the k loop.
// `sink(o, c)` receives the block's fp32 results c[h][i][n] for weight row o + 16h + i.
template <typename Sink>
static void amx_blocks(const uint16_t* xb, const uint16_t* w, int64_t N, int64_t K, int64_t O, Sink&& sink) {
    const int64_t blocks = O / 32, lines = (32 * K * 2) / 64, per = lines / (K / 32);
    at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
        TileConfig cfg;
        std::memset(&cfg, 0, sizeof(cfg));
        cfg.palette = 1;
        for (int t = 0; t < 5; ++t) cfg.rows[t] = 16;
        cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[4] = (uint16_t)(N * 4);
        cfg.colsb[2] = cfg.colsb[3] = 64;
        _tile_loadconfig(&cfg);
        alignas(64) float c[2][16][16];
        for (int64_t b = begin; b < end; ++b) {
            const uint16_t* wb = w + 32 * b * K;
            const char* pf = b + 1 < blocks ? reinterpret_cast<const char*>(wb + 32 * K) : nullptr;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t k = 0, it = 0; k < K; k += 32, ++it) {
                if (pf)
                    for (int64_t l = 0; l < per; ++l) _mm_prefetch(pf + (it * per + l) * 64, _MM_HINT_T0);
                _tile_loadd(4, xb + k * N, N * 4);
                _tile_loadd(2, wb + k, K * 2);
                _tile_loadd(3, wb + 16 * K + k, K * 2);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 3, 4);
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            sink(32 * b, c);
        }
        _tile_release();
    });
}

static std::vector<uint16_t> pack_pairs(const uint16_t* x, int64_t N, int64_t K) {
    std::vector<uint16_t> xb(K * N);
    for (int64_t kk = 0; kk < K / 2; ++kk)
        for (int64_t n = 0; n < N; ++n) {
            xb[(kk * N + n) * 2] = x[n * K + 2 * kk];
            xb[(kk * N + n) * 2 + 1] = x[n * K + 2 * kk + 1];
        }
    return xb;
}

static void check_amx(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2, "x: contiguous bf16 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w: contiguous bf16 [O, K]");
    TORCH_CHECK(w.size(1) == x.size(1) && x.size(1) % 32 == 0 && w.size(0) % 32 == 0 && x.size(0) >= 1 &&
                x.size(0) <= 16, "the AMX kernel takes 1-16 rows, K and O multiples of 32");
    TORCH_CHECK(amx_permit(), "the Linux kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor w) {
    check_amx(x, w);
    const int64_t N = x.size(0), K = x.size(1), O = w.size(0);
    auto xb = pack_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), N, K);
    auto y = torch::empty({N, O}, x.options().dtype(torch::kFloat32));
    float* yp = y.data_ptr<float>();
    amx_blocks(xb.data(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N, K, O,
               [&](int64_t o, float (&c)[2][16][16]) {
                   for (int64_t n = 0; n < N; ++n)
                       for (int h = 0; h < 2; ++h)
                           for (int i = 0; i < 16; ++i) yp[n * O + o + 16 * h + i] = c[h][i][n];
               });
    return y;
}

// argmax ids of the bf16-rounded results, lowest id on ties (as bf16_linear_argmax)
torch::Tensor amx_linear_argmax(torch::Tensor x, torch::Tensor w) {
    check_amx(x, w);
    const int64_t N = x.size(0), K = x.size(1), O = w.size(0);
    auto xb = pack_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), N, K);
    constexpr int64_t kBlockRows = 4096;  // weight rows per merge block (a multiple of 32)
    const int64_t nblocks = (O + kBlockRows - 1) / kBlockRows;
    std::vector<float> bval(nblocks * N, -INFINITY);
    std::vector<int64_t> bidx(nblocks * N, 0);
    // merge blocks in parallel (amx_blocks runs inline inside one), each keeps its best per row
    at::parallel_for(0, nblocks, 1, [&](int64_t mb0, int64_t mb1) {
        for (int64_t mb = mb0; mb < mb1; ++mb) {
            const int64_t o0 = mb * kBlockRows, rows = std::min(O, o0 + kBlockRows) - o0;
            float* best = bval.data() + mb * N;
            int64_t* arg = bidx.data() + mb * N;
            for (int64_t n = 0; n < N; ++n) arg[n] = o0;
            amx_blocks(xb.data(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + o0 * K, N, K, rows,
                       [&](int64_t o, float (&c)[2][16][16]) {
                           for (int64_t n = 0; n < N; ++n)
                               for (int h = 0; h < 2; ++h)
                                   for (int i = 0; i < 16; ++i) {
                                       const float v = round_bf16(c[h][i][n]);
                                       if (v > best[n]) best[n] = v, arg[n] = o0 + o + 16 * h + i;
                                   }
                       });
        }
    });
    auto out = torch::empty({N}, x.options().dtype(torch::kLong));
    int64_t* op = out.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
        float best = -INFINITY;
        int64_t arg = 0;
        for (int64_t b = 0; b < nblocks; ++b)
            if (bval[b * N + n] > best) best = bval[b * N + n], arg = bidx[b * N + n];
        op[n] = arg;
    }
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("bf16_linear_bf16x", &bf16_linear_bf16x, "x bf16 [M, K] @ w bf16 [O, K]^T -> fp32 [M, O]");
    m.def("bf16_linear_argmax", &bf16_linear_argmax, "argmax_o bf16(x bf16 [M, K] @ w bf16 [O, K]^T) -> int64 [M]");
    m.def("amx_available", &amx_available, "whether Linux granted this process AMX tile state");
    m.def("amx_linear", &amx_linear, "AMX: x bf16 [M <= 16, K] @ w bf16 [O, K]^T -> fp32 [M, O]");
    m.def("amx_linear_argmax", &amx_linear_argmax, "AMX: argmax_o bf16(x @ w^T) -> int64 [M]");
}
"""


class _Kernel:
    """One compiled kernel: its source, the CPU flags it needs and the rows it serves."""

    def __init__(self, name: str, source: str, flags: set[str], cflags: list[str], rows: tuple[int, int]):
        self.name, self.source, self.flags, self.cflags = name, source, flags, cflags
        self.min_rows, self.max_rows = rows
        self._ext = None

    def load(self):
        with _lock:
            if self._ext is None:
                from torch.utils.cpp_extension import load_inline

                self._ext = load_inline(name=f"drafttrain_bf16_linear_{self.name}", cpp_sources=[self.source],
                                        functions=None, extra_cflags=["-O3", *self.cflags, "-fopenmp"],
                                        extra_ldflags=["-fopenmp"], verbose=False)
            return self._ext

    def _amx_fits(self, flat: Tensor, w: Tensor) -> bool:
        # 1-2 rows: the AVX-512 tiles, 1-2 ms faster per step there (`bench/linear_kernels.py`)
        return (self.name == "amx" and 3 <= flat.shape[0] <= 16 and flat.shape[1] % 32 == 0
                and w.shape[0] % 32 == 0)

    def __call__(self, flat: Tensor, w: Tensor) -> Tensor:
        """[M, K] rows (any float dtype) @ bf16 w [O, K]^T -> fp32 [M, O]."""
        if self.name == "avx2":
            return self.load().bf16_linear_f32(flat.float().contiguous(), w.contiguous())
        x = flat.to(torch.bfloat16).contiguous()
        if self._amx_fits(x, w):
            return self.load().amx_linear(x, w.contiguous())
        return self.load().bf16_linear_bf16x(x, w.contiguous())  # other shapes: the AVX-512 tiles

    def argmax(self, flat: Tensor, w: Tensor) -> Tensor:
        """argmax over the O outputs of bf16 ``flat`` [M, K] @ w^T, rounded to bf16, lowest index on ties -> [M] long."""
        if self.name == "avx2":
            return self(flat, w).to(torch.bfloat16).argmax(-1)
        if self._amx_fits(flat, w):
            return self.load().amx_linear_argmax(flat.contiguous(), w.contiguous())
        return self.load().bf16_linear_argmax(flat.contiguous(), w.contiguous())


_lock = threading.Lock()

#: the kernels by backend name; `min_rows` / `max_rows`: the inputs each serves (one row keeps
#: PyTorch's matrix-vector kernel under avx2, memory-bound there already; beyond `max_rows`
#: PyTorch's matmul, whose AMX / AVX-512 paths win on compute-bound work)
KERNELS = {
    "avx2": _Kernel("avx2", _AVX2_SOURCE, {"avx2", "fma"}, ["-mavx2", "-mfma"], (2, 16)),
    "avx512": _Kernel("avx512", _AVX512_SOURCE + _AVX512_BINDINGS, {"avx512f", "avx512bw", "avx512_bf16"},
                      ["-mavx512f", "-mavx512bw", "-mavx512bf16"], (1, 8)),
    "amx": _Kernel("amx", _AVX512_SOURCE + _AMX_SOURCE, {"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"},
                   ["-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"], (1, 16)),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def available(backend: str = "avx2") -> bool:
    """Whether this CPU can run `backend`'s kernel (its x86 flags; for AMX, Linux granting the
    process tile state) and a C++ compiler is found."""
    if not KERNELS[backend].flags <= _cpu_flags():
        return False
    if backend == "amx" and not _amx_permitted():
        return False
    from shutil import which

    return which(os.environ.get("CXX", "c++")) is not None or which("g++") is not None


def _amx_permitted() -> bool:
    """Asks Linux (x86-64 arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) for AMX tile state:
    granted once per process, refused by kernels before 5.16 or where a hypervisor hides it."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


def wants_amx_linear() -> bool:
    """`auto`'s first choice: the AMX kernel wherever the CPU and Linux allow AMX bf16 tiles."""
    return available("amx")


def wants_avx512_linear() -> bool:
    """`auto`'s choice where AMX is not: the AVX-512 bf16 kernel wherever the CPU has AVX-512 bf16."""
    return available("avx512")


def wants_avx2_linear() -> bool:
    """`auto`'s rule for the AVX2 kernel: where PyTorch's bf16 matmul is slow (AVX2, no AVX-512 bf16 / AMX)."""
    return available("avx2") and not ({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def resolve_backend(backend: str, model: nn.Module) -> str:
    """"aten", "avx2", "avx512" or "amx" for decoding with `model`.

    Raises:
        ValueError: an unknown backend, or a kernel the CPU or compiler cannot run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"linear_backend must be one of {BACKENDS}, got {backend!r}")
    param = next(model.parameters())
    if backend == "aten":
        return "aten"
    if backend in KERNELS:
        if not available(backend):
            need = "/".join(sorted(KERNELS[backend].flags))
            raise ValueError(f"linear_backend={backend} needs an x86 CPU with {need} and a C++ compiler "
                             "(g++); use linear_backend=aten or auto")
        return backend
    if not (param.device.type == "cpu" and param.dtype == torch.bfloat16):
        return "aten"
    if wants_amx_linear():
        return "amx"
    if wants_avx512_linear():
        return "avx512"
    return "avx2" if wants_avx2_linear() else "aten"


def bf16_linear(x: Tensor, w: Tensor, bias: Tensor | None = None, backend: str = "avx2") -> Tensor:
    """``F.linear(x, w, bias)`` for bf16 ``w`` [O, K] and a few rows of ``x`` [..., K] (the
    kernel's row range; more rows work, slowly).

    Returns a tensor of ``x``'s dtype and shape [..., O]. The first call compiles the extension
    (about a minute, once per machine).
    """
    lead = x.shape[:-1]
    y = KERNELS[backend](x.reshape(-1, x.shape[-1]), w)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, w.shape[0])


class _Forward:
    """The replacement `forward` of one nn.Linear: the kernel for small inputs, PyTorch's otherwise."""

    def __init__(self, module: nn.Linear, backend: str):
        self.module, self.backend = module, backend
        k = KERNELS[backend]
        self.min_rows, self.max_rows = k.min_rows, k.max_rows

    def __call__(self, x: Tensor) -> Tensor:
        mod = self.module
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if self.min_rows <= rows <= self.max_rows and not torch.is_grad_enabled() and x.device.type == "cpu":
            return bf16_linear(x, mod.weight, mod.bias, self.backend)
        return F.linear(x, mod.weight, mod.bias)


def head_argmax(module: nn.Linear, x: Tensor) -> Tensor:
    """``module(x).argmax(-1)`` for an installed, bias-free bf16 head and bf16 ``x`` [M, K] in its row range,
    without the [M, O] logits where the kernel fuses it (AVX-512: each thread keeps its best per row).

    Same ids as the head's own bf16 logits give: the fp32 sums rounded to bf16, first maximum on ties.
    """
    if x.dtype != torch.bfloat16 or module.bias is not None or not routes(module, x.shape[0]):
        return module(x).argmax(-1)
    return KERNELS[vars(module)["forward"].backend].argmax(x, module.weight)


def routes(module: nn.Module, rows: int) -> bool:
    """Whether an input of `rows` rows to `module` runs through a kernel (installed, in range)."""
    fwd = vars(module).get("forward")
    return isinstance(fwd, _Forward) and fwd.min_rows <= rows <= fwd.max_rows


def install(model: nn.Module, backend: str = "avx2") -> int:
    """Routes each bf16 nn.Linear of `model` through `backend`'s kernel for small inputs; returns how many.

    Compiles the extension now (not at the first step), so its one-time cost is paid up front.
    """
    KERNELS[backend].load()
    n = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.weight.dtype == torch.bfloat16 and "forward" not in vars(mod):
            mod.forward = _Forward(mod, backend)
            n += 1
    return n


def setup(model: nn.Module, backend: str = "auto") -> str:
    """Resolves `backend` for `model` and installs its kernel; returns one line saying what runs.

    Raises:
        ValueError: as `resolve_backend`.
    """
    import time

    name = resolve_backend(backend, model)
    if name == "aten":
        return f"linear_backend={backend}: PyTorch's matmul for every linear layer of the target"
    t0 = time.perf_counter()
    n = install(model, name)
    k = KERNELS[name]
    return (f"linear_backend={backend}: {n} bf16 linear layers of the target run through the {name.upper()} kernel "
            f"for decode steps of {k.min_rows}-{k.max_rows} rows (ready in {time.perf_counter() - t0:.1f} s; "
            "linear_backend=aten: PyTorch's)")


def installed_backend(model: nn.Module) -> str:
    """The kernel `install` routed `model`'s linear layers through ("avx2", "avx512"), or "aten"."""
    for mod in model.modules():
        fwd = vars(mod).get("forward")
        if isinstance(fwd, _Forward):
            return fwd.backend
    return "aten"


def is_installed(module: nn.Module) -> bool:
    """Whether `install` routed this module through a kernel."""
    return isinstance(vars(module).get("forward"), _Forward)


@contextmanager
def paused(model: nn.Module):
    """PyTorch's forward on every module `install` changed, for the duration of the block."""
    saved = [(m, vars(m)["forward"]) for m in model.modules() if is_installed(m)]
    for m, _ in saved:
        del m.forward
    try:
        yield
    finally:
        for m, fwd in saved:
            m.forward = fwd


def uninstall(model: nn.Module) -> None:
    """Restores PyTorch's forward on every module `install` changed."""
    for mod in model.modules():
        if is_installed(mod):
            del mod.forward
