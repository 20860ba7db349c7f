"""C++ source of the AVX2 bf16 linear kernel (`cpu_linear`'s "avx2" backend), for CPUs without AVX-512 bf16.

``AVX2_SOURCE``: bf16 weights widened to fp32 in registers and fp32 FMAs; up to 5 rows of x
against one weight row at a time with a prefetch (`row_tile`), 6-64 rows through tiles of up to
six rows of x over a weight pair with a prefetch, the fused bf16-in / bf16-out call that `cpu_linear._Forward` uses,
and the greedy head's argmax of bf16-rounded logits; ``AVX2_LAYER_LINEAR``, the fused layers'
projections; ``AVX2_BINDINGS``, its Python bindings. Compiled after `cpu_linear_src.NORM_SOURCE` and
`COMMON_SOURCE` (whose `norm_widen` / `norm_round` / `merge_blocks` it uses), followed by the packed
kernel (`cpu_linear_packed_src.PACKED_AVX2_SOURCE`), `AVX2_LAYER_LINEAR` and
`cpu_layer_src.LAYER_SOURCE` (one Gemma 3 layer per call, built on these kernels). `cpu_linear`'s docstring gives the numbers and the routing.
"""

#: bf16 x 8 -> fp32 lanes and a horizontal sum: this kernel's, and the fused layers' attention in every
#: extension (`cpu_layer_src`; the AVX-512 ones prepend these too)
AVX2_HELPERS = r"""
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
"""

AVX2_SOURCE = AVX2_HELPERS + r"""
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// y[m, o] = sum_k x[m, k] * w[o, k] for rows m0 .. m0 + MT of x, weight rows o0 .. o0 + 2. `pf`, when
// set, is the weight pair 16 rows ahead, prefetched a cache line at a time (session 22, Zen 2, Gemma 3
// 270M's 126 matmuls + LM head, cold weights: 4 rows 54.9 -> 32.2 ms, 16 rows 103.4 -> 80.8 ms).
template <int MT>
static inline void tile(const float* x, const uint16_t* w, float* y, int64_t K, int64_t O,
                        int64_t o, int64_t m0, int64_t orows, const uint16_t* pf = nullptr) {
    __m256 acc[2][MT];
    for (int r = 0; r < 2; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    const uint16_t* w0 = w + o * K;
    const uint16_t* w1 = w + (o + (orows > 1 ? 1 : 0)) * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (pf && (k & 31) == 0) {
            _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(pf + K + k), _MM_HINT_T0);
        }
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

// Rows m0 .. m0 + MT of x against ONE weight row o, read front to back with A accumulators per row of
// x (8 A weights per step) and the row four ahead prefetched a 64-byte line at a time. Each thread
// then reads its share of the weights as one sequential stream, which this machine's prefetchers follow
// best, and MT x A independent sums hide the FMA latency (session 24, Zen 2, LM head 262,144 x 640
// cold, 2 threads: 1 row 15.9 ms over four-row tiles with a 16-row prefetch -> 12.6 ms; 2 / 3 / 5 rows
// 15.7 / 15.0 / 15.3 ms over the weight-pair tiles -> 11.3 / 10.9 / 12.8; `bench/linear_kernels.py`,
// the 126 layer matmuls + LM head: 2 rows 30.8 -> 24.0 ms, 3: 30.6 -> 24.4, 4: 30.4 -> 26.8).
template <int MT, int A>
static inline void row_tile(const float* x, const uint16_t* w, float* y, int64_t K, int64_t O, int64_t o,
                            int64_t m0, bool prefetch) {
    __m256 acc[MT][A];
    for (int m = 0; m < MT; ++m)
        for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    const uint16_t* row = w + o * K;
    const uint16_t* pf = w + (o + 4) * K;
    const float* xm = x + m0 * K;
    int64_t k = 0;
    for (; k + 8 * A <= K; k += 8 * A) {
        if (prefetch)
            for (int a = 0; a < A; a += 4) _mm_prefetch(reinterpret_cast<const char*>(pf + k + 8 * a), _MM_HINT_T0);
        for (int a = 0; a < A; ++a) {
            const __m256 wv = load_bf16x8(row + k + 8 * a);
            for (int m = 0; m < MT; ++m)
                acc[m][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xm + m * K + k + 8 * a), acc[m][a]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = load_bf16x8(row + k);
        for (int m = 0; m < MT; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xm + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < MT; ++m) {
        __m256 v = acc[m][0];
        for (int a = 1; a < A; ++a) v = _mm256_add_ps(v, acc[m][a]);
        float s = hsum(v);
        for (int64_t kk = k; kk < K; ++kk) s += bf16_to_f32(row[kk]) * xm[m * K + kk];
        y[(m0 + m) * O + o] = s;
    }
}

// y [M, O] = x [M, K] @ w^T for fp32 x, bf16 w (fp32 sums).
static void linear_core(const float* xp, const uint16_t* wp, float* yp, int64_t M, int64_t K, int64_t O) {
    if (M <= 5) {  // memory-bound widths: one weight row at a time (`row_tile`)
        at::parallel_for(0, O, 128, [&](int64_t begin, int64_t end) {
            for (int64_t o = begin; o < end; ++o) {
                const bool pf = o + 4 < end;
                switch (M) {
                    case 1: row_tile<1, 4>(xp, wp, yp, K, O, o, 0, pf); break;
                    case 2: row_tile<2, 2>(xp, wp, yp, K, O, o, 0, pf); break;
                    case 3: row_tile<3, 2>(xp, wp, yp, K, O, o, 0, pf); break;
                    case 4: row_tile<4, 2>(xp, wp, yp, K, O, o, 0, pf); break;
                    case 5: row_tile<5, 2>(xp, wp, yp, K, O, o, 0, pf); break;
                    default: break;
                }
            }
        });
        return;
    }
    // 6 rows and more (compute-bound on AVX2: 6 rows 33.9 ms for the layers + LM head over weight pairs,
    // 35.5 over single weight rows, 40.6 as 4 + 2; 16 rows' LM head 43 vs 55-64): weight pairs, so
    // each load of x feeds two FMAs; up to 6 rows of x in one tile, beyond that fours and one tile of
    // 2..5 for the rest.
    const int64_t pairs = (O + 1) / 2;
    const int64_t head = M <= 6 ? 0 : M - (M % 4 < 2 ? M % 4 + 4 : M % 4);  // rows in tiles of 4; 2..5 left
    at::parallel_for(0, pairs, 64, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const int64_t o = 2 * p, orows = (o + 1 < O) ? 2 : 1;
            const uint16_t* pf = (p + 8 < end) ? wp + (o + 16) * K : nullptr;
            int64_t m = 0;
            for (; m < head; m += 4) tile<4>(xp, wp, yp, K, O, o, m, orows, m == 0 ? pf : nullptr);
            if (head > 0) pf = nullptr;
            switch (M - m) {  // the rest, 2..6 rows, in one tile
                case 2: tile<2>(xp, wp, yp, K, O, o, m, orows, pf); break;
                case 3: tile<3>(xp, wp, yp, K, O, o, m, orows, pf); break;
                case 4: tile<4>(xp, wp, yp, K, O, o, m, orows, pf); break;
                case 5: tile<5>(xp, wp, yp, K, O, o, m, orows, pf); break;
                case 6: tile<6>(xp, wp, yp, K, O, o, m, orows, pf); break;
                default: break;
            }
        }
    });
}

torch::Tensor bf16_linear_f32(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous fp32 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w: contiguous bf16 [O, K]");
    const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
    TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
    auto y = torch::empty({M, O}, x.options());
    linear_core(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                y.data_ptr<float>(), M, K, O);
    return y;
}

// bf16 x [..., K] -> bf16 y [..., O] in one call: x widened to fp32 and y rounded to bf16 (nearest
// even, as PyTorch's casts) inside, in chunks of `chunk` rows whose fp32 copies stay in L2, instead
// of two PyTorch casts around every linear (254 small ops per Gemma 3 270M step).
torch::Tensor bf16_linear_bf16(torch::Tensor x, torch::Tensor w, int64_t chunk) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() >= 1, "x: bf16 [..., K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(1) == x.size(-1),
                "w: contiguous bf16 [O, K]");
    auto xc = x.contiguous();
    const int64_t K = w.size(1), O = w.size(0), M = K ? xc.numel() / K : 0;
    auto shape = x.sizes().vec();
    shape.back() = O;
    auto y = torch::empty(shape, x.options());
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    chunk = std::max<int64_t>(1, chunk);
    std::vector<float> xf(std::min(M, chunk) * K), yf(std::min(M, chunk) * O);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = std::min(chunk, M - m0);
        for (int64_t i = 0; i < rows * K; ++i) xf[i] = norm_widen(xp[m0 * K + i]);
        linear_core(xf.data(), wp, yf.data(), rows, K, O);
        uint16_t* out = yp + m0 * O;
        at::parallel_for(0, rows * O, 65536, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) out[i] = norm_round(yf[i]);
        });
    }
    return y;
}

// 7-bit drafter weights are an AVX-512 bf16 kernel's (cpu_linear_src.Q7_SOURCE); `cpu_linear` never
// hands them to this one, and the fused layer's `project` never calls this with kQ7Rows = 0
constexpr int64_t kQ7Rows = 0;
torch::Tensor q7_linear_bf16(torch::Tensor, torch::Tensor, torch::Tensor) {
    TORCH_CHECK(false, "7-bit weights need the AVX-512 bf16 or AMX kernel");
    return {};
}

// argmax over each row of fp32 y [M, O] after rounding to bf16 (what `y.to(bf16).argmax(-1)` gives:
// nearest-even rounding, first maximum on ties), in one parallel pass without the bf16 copy. The
// greedy LM head's epilogue: PyTorch's bf16 argmax over 262,144 logits took ~2 ms a row here.
torch::Tensor argmax_bf16_rounded(torch::Tensor y) {
    TORCH_CHECK(y.dtype() == torch::kFloat32 && y.is_contiguous() && y.dim() == 2, "y: contiguous fp32 [M, O]");
    const int64_t M = y.size(0), O = y.size(1);
    constexpr int64_t kBlock = 16384;
    const int64_t nblocks = (O + kBlock - 1) / kBlock;
    std::vector<float> bval(nblocks * M);
    std::vector<int64_t> bidx(nblocks * M);
    const float* yp = y.data_ptr<float>();
    at::parallel_for(0, M * nblocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const int64_t m = t / nblocks, b = t % nblocks, o0 = b * kBlock, o1 = std::min(O, o0 + kBlock);
            const uint32_t* row = reinterpret_cast<const uint32_t*>(yp + m * O);
            float best = -INFINITY;
            int64_t arg = o0;
            for (int64_t o = o0; o < o1; ++o) {
                const uint32_t u = (row[o] + 0x7FFFu + ((row[o] >> 16) & 1u)) & 0xFFFF0000u;
                float v;
                std::memcpy(&v, &u, 4);
                if (v > best) best = v, arg = o;
            }
            bval[b * M + m] = best, bidx[b * M + m] = arg;
        }
    });
    auto out = torch::empty({M}, y.options().dtype(torch::kLong));
    merge_blocks(bval, bidx, nblocks, M, out.data_ptr<int64_t>());
    return out;
}

"""

#: the fused layer's projections (cpu_layer_src), after `cpu_linear_packed_src.PACKED_AVX2_SOURCE`: a
#: packed weight (4 dims, `cpu_linear.pack`) through the packed kernel, otherwise this kernel, chunked
#: as a routed linear is
AVX2_LAYER_LINEAR = r"""
static inline torch::Tensor layer_linear(torch::Tensor x, torch::Tensor w, int64_t chunk) {
    if (w.dim() == 4) return packed_linear_bf16(x, w);
    return bf16_linear_bf16(x, w, chunk);
}
"""

#: the bound functions' declarations and `m.def` lines, for the bindings unit (`build.load_kernels`;
#: `cpu_linear` adds the packed and fused-layer parts')
AVX2_DECLS = r"""
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor scale, double eps, bool round_first);
torch::Tensor bf16_linear_f32(torch::Tensor x, torch::Tensor w);
torch::Tensor bf16_linear_bf16(torch::Tensor x, torch::Tensor w, int64_t chunk);
torch::Tensor argmax_bf16_rounded(torch::Tensor y);
"""
AVX2_BINDINGS = r"""
    m.def("rms_norm", &rms_norm, "RMS norm of bf16 rows [M, D] with an fp32 scale [D] -> bf16 [M, D]");
    m.def("bf16_linear_f32", &bf16_linear_f32, "x fp32 [M, K] @ w bf16 [O, K]^T -> fp32 [M, O]");
    m.def("bf16_linear_bf16", &bf16_linear_bf16, "x bf16 [..., K] @ w bf16 [O, K]^T -> bf16 [..., O], in chunks of rows");
    m.def("argmax_bf16_rounded", &argmax_bf16_rounded, "argmax of each row of fp32 [M, O] rounded to bf16 -> [M] long");
"""
