"""C++ sources of the bf16 decode-step linear kernels that `cpu_linear` compiles on first use.

Kept apart from the loader so each file reads on its own: ``NORM_SOURCE`` (RMS norms of bf16 rows) and ``COMMON_SOURCE`` (bf16 stores and rounding, the
argmax block merge, the row count as a template argument), both compiled into every kernel, ``AVX512_SOURCE`` (``vdpbf16ps`` over one weight row at a time for 1-16 rows of x, the older tiles
of four or two weight rows with a software prefetch behind `set_stream_rows(0)`, and the fused greedy
head argmax), ``Q7_SOURCE`` (7-bit drafter weights), ``AVX512_DECLS`` / ``AVX512_BINDINGS`` (the bound functions'
declarations and `m.def` lines, for the bindings unit that `build.load_kernels` compiles apart) and
`avx512_layer_linear` (the fused layers' projections). Every kernel sums exact bf16 products in
fp32; `cpu_linear`'s docstring gives the numbers and the routing. The AVX2 kernel's source is in
`cpu_linear_avx2_src`, the AMX tiles (appended to the AVX-512 source) in `cpu_linear_amx_src`.
"""

NORM_SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float norm_widen(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t norm_round(float f) {  // round to nearest even, as PyTorch's casts do
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays NaN
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// RMS norm of bf16 rows with an fp32 scale s (the module's weight, or 1 + weight, as fp32):
// r = 1 / sqrt(mean(x^2) + eps) in fp32, then y = bf16(x r s) (Gemma: scaled in fp32, rounded once)
// or y = bf16(bf16(x r) s) (Llama, Qwen: rounded to bf16 before the weight). Sixteen partial sums
// of squares; one thread (a decode step's few rows cost microseconds).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor scale, double eps, bool round_first) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2, "x: contiguous bf16 [M, D]");
    TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == x.size(1),
                "scale: contiguous fp32 [D]");
    const int64_t M = x.size(0), D = x.size(1);
    auto y = torch::empty_like(x);
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    const float* sp = scale.data_ptr<float>();
    const float e = float(eps);
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = xp + m * D;
        float part[16] = {0.f};
        int64_t d = 0;
        for (; d + 16 <= D; d += 16)
            for (int j = 0; j < 16; ++j) {
                const float v = norm_widen(xr[d + j]);
                part[j] += v * v;
            }
        for (; d < D; ++d) {
            const float v = norm_widen(xr[d]);
            part[0] += v * v;
        }
        float sum = 0.f;
        for (int j = 0; j < 16; ++j) sum += part[j];
        const float r = 1.0f / std::sqrt(sum / float(D) + e);
        uint16_t* yr = yp + m * D;
        if (round_first)
            for (d = 0; d < D; ++d) yr[d] = norm_round(norm_widen(norm_round(norm_widen(xr[d]) * r)) * sp[d]);
        else
            for (d = 0; d < D; ++d) yr[d] = norm_round(norm_widen(xr[d]) * r * sp[d]);
    }
    return y;
}
"""

COMMON_SOURCE = r"""
#include <algorithm>
#include <type_traits>
#include <vector>

constexpr int kMaxRows = 16;  // rows of x in one pass over the weights (more: passes of 16)

// an output stored as fp32, or as bf16
static inline void put(float* y, float v) { *y = v; }
static inline void put(uint16_t* y, float v) {  // bf16, rounded to nearest even as PyTorch's casts round
    uint32_t u;
    std::memcpy(&u, &v, 4);
    *y = ((u & 0x7FFFFFFFu) > 0x7F800000u) ? uint16_t((u >> 16) | 0x40u) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> bf16 -> fp32, rounding to nearest even: the value PyTorch's bf16 logits hold
static inline float round_bf16(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&v, &u, 4);
    return v;
}

// out[m] = the id of row m's best over blocks 0 .. nblocks - 1 (bval / bidx [nblocks][rows]), merged
// in block order: a later block wins only when strictly greater (the lowest id among equal maxima)
static inline void merge_blocks(const std::vector<float>& bval, const std::vector<int64_t>& bidx, int64_t nblocks,
                                int64_t rows, int64_t* out) {
    for (int64_t m = 0; m < rows; ++m) {
        float best = -INFINITY;
        int64_t arg = 0;
        for (int64_t b = 0; b < nblocks; ++b)
            if (bval[b * rows + m] > best) best = bval[b * rows + m], arg = bidx[b * rows + m];
        out[m] = arg;
    }
}

// f(std::integral_constant<int, n>{}) for n in 1 .. kMaxRows: the row count as a template argument
template <typename F>
static void by_rows(int64_t n, F&& f) {
    switch (n) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        case 8: f(std::integral_constant<int, 8>{}); break;
        case 9: f(std::integral_constant<int, 9>{}); break;
        case 10: f(std::integral_constant<int, 10>{}); break;
        case 11: f(std::integral_constant<int, 11>{}); break;
        case 12: f(std::integral_constant<int, 12>{}); break;
        case 13: f(std::integral_constant<int, 13>{}); break;
        case 14: f(std::integral_constant<int, 14>{}); break;
        case 15: f(std::integral_constant<int, 15>{}); break;
        default: f(std::integral_constant<int, 16>{}); break;
    }
}
"""

AVX512_SOURCE = r"""
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// y[m * ys + r] = sum_k x[m, k] * w[o + r, k] for r < R and all MT rows of x, in one pass over the
// weights: each 64-byte chunk of the R weight rows is loaded once and held while the MT rows of x
// (a few KB, L1-resident) stream past it; vdpbf16ps sums bf16 pairs into fp32 lanes. `pf`, when
// set, is the weight row PF rows ahead, prefetched chunk by chunk so the memory stream keeps going
// while the core computes (without it the kernel's time was memory time plus compute time).
template <int R, int MT, typename T>
static inline void tile(const uint16_t* x, const uint16_t* w, T* y, int64_t K, int64_t ys, int64_t o,
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
        for (int m = 0; m < MT; ++m) put(y + m * ys + r, _mm512_reduce_add_ps(acc[r][m]));
}

// Weight rows per tile: four for up to four rows of x (four independent sums per row; session 15's
// Zen 4 ran the LM head in 14.9 ms for one row where two weight rows took 18.1), two beyond (four
// would keep 4 x MT accumulators and spill registers from six rows on). Prefetch distance: 8 rows.
template <int MT>
constexpr int64_t tile_rows() { return MT <= 4 ? 4 : 2; }
constexpr int64_t kPrefetchRows = 8;

// Rows of x against ONE weight row o, read front to back as one sequential stream per thread (the
// row four ahead prefetched a line at a time), A sums per row of x (chunk c into sum c mod A): y[m * ys]
// for m < MT.
// Zen 4 (session 38, `bench/linear_kernels.py`): the four-row tiles above read four streams at once
// and reached ~half the memory speed for 1-8 rows; this is the AVX2 kernel's `row_tile` order.
template <int MT, int A, typename T>
static inline void stream_row(const uint16_t* x, const uint16_t* w, T* y, int64_t K, int64_t ys, int64_t o,
                              bool prefetch) {
    __m512 acc[MT][A];
    for (int m = 0; m < MT; ++m)
        for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
    const uint16_t* row = w + o * K;
    const uint16_t* pf = row + 4 * K;
    int64_t k = 0;
    for (; k + 32 * A <= K; k += 32 * A) {
        if (prefetch)
            for (int a = 0; a < A; ++a) _mm_prefetch(reinterpret_cast<const char*>(pf + k + 32 * a), _MM_HINT_T0);
        for (int a = 0; a < A; ++a) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k + 32 * a);
            for (int m = 0; m < MT; ++m)
                acc[m][a] = _mm512_dpbf16_ps(acc[m][a], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * a));
        }
    }
    for (; k < K; k += 32) {  // the rest, 32 at a time, the last masked
        const __mmask32 mask = (K - k >= 32) ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
        for (int m = 0; m < MT; ++m)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
    for (int m = 0; m < MT; ++m) {
        __m512 v = acc[m][0];
        for (int a = 1; a < A; ++a) v = _mm512_add_ps(v, acc[m][a]);
        put(y + m * ys, _mm512_reduce_add_ps(v));
    }
}

// Every row of x gets the same two sums (even / odd 32-weight chunks) in the same order, whatever the
// number of rows: an output does not depend on how many rows share the call, so a verification of
// many tokens computes exactly what a one-token step computes for each (greedy speculative decoding
// stays token for token the target's own, bf16 included). More than 8 rows run as groups of up to 8
// against the same weight row, read again from L1 (2 x 16 accumulators would not fit the registers).
static int64_t g_stream_rows = kMaxRows;

int64_t set_stream_rows(int64_t n) {  // bound: inputs of up to n rows take `stream`; returns the old n
    const int64_t old = g_stream_rows;
    g_stream_rows = n;
    return old;
}

template <int MT, typename T>
static inline void stream(const uint16_t* x, const uint16_t* w, T* y, int64_t K, int64_t ys, int64_t o,
                          bool prefetch) {
    if constexpr (MT <= 8) {
        stream_row<MT, 2>(x, w, y, K, ys, o, prefetch);
    } else {
        stream_row<8, 2>(x, w, y, K, ys, o, prefetch);
        stream_row<MT - 8, 2>(x + 8 * K, w, y + 8 * ys, K, ys, o, false);
    }
}

template <int MT, typename T>
static void rows(const uint16_t* x, const uint16_t* w, T* y, int64_t K, int64_t O) {
    if constexpr (MT <= 8) {  // the tiles (1-8 rows), when the stream is switched off for MT rows
        if (MT > g_stream_rows) {
            constexpr int64_t R = tile_rows<MT>();
            const int64_t tiles = O / R;
            at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
                for (int64_t p = begin; p < end; ++p) {
                    const int64_t o = R * p;
                    const bool ahead = o + kPrefetchRows + R <= O;
                    tile<R, MT>(x, w, y + o, K, O, o, ahead ? w + (o + kPrefetchRows) * K : nullptr);
                }
            });
            for (int64_t o = R * tiles; o < O; ++o) tile<1, MT>(x, w, y + o, K, O, o, nullptr);
            return;
        }
    }
    at::parallel_for(0, O, 128, [&](int64_t begin, int64_t end) {
        for (int64_t o = begin; o < end; ++o)
            stream<MT>(x, w, y + o, K, O, o, o + 4 < end);
    });
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
            constexpr int64_t R = tile_rows<MT>();
            float best[MT], y[MT * R];
            int64_t arg[MT];
            for (int m = 0; m < MT; ++m) best[m] = -INFINITY, arg[m] = o0;
            int64_t o = o0;
            if (MT > 8 || MT <= g_stream_rows) {
                for (; o < o1; ++o) {
                    stream<MT>(x, w, y, K, 1, o, o + 4 < O);
                    for (int m = 0; m < MT; ++m) {
                        const float v = round_bf16(y[m]);
                        if (v > best[m]) best[m] = v, arg[m] = o;
                    }
                }
            }
            if constexpr (MT <= 8)
            for (; o + R <= o1; o += R) {
                const bool ahead = o + kPrefetchRows + R <= O;
                tile<R, MT>(x, w, y, K, R, o, ahead ? w + (o + kPrefetchRows) * K : nullptr);
                for (int m = 0; m < MT; ++m)
                    for (int r = 0; r < R; ++r) {
                        const float v = round_bf16(y[m * R + r]);
                        if (v > best[m]) best[m] = v, arg[m] = o + r;
                    }
            }
            if constexpr (MT <= 8)
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
    merge_blocks(bval, bidx, nblocks, MT, out);
}


template <typename T>
static void passes(const uint16_t* xp, const uint16_t* wp, T* yp, int64_t M, int64_t K, int64_t O) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)  // passes of up to 16 rows (more rows work, slowly)
        by_rows(std::min<int64_t>(kMaxRows, M - m0), [&](auto mt) {
            rows<decltype(mt)::value>(xp + m0 * K, wp, yp + m0 * O, K, O);
        });
}

torch::Tensor bf16_linear_bf16x(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2, "x: contiguous bf16 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w: contiguous bf16 [O, K]");
    const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
    TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
    auto y = torch::empty({M, O}, x.options().dtype(torch::kFloat32));
    passes(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), y.data_ptr<float>(), M, K, O);
    return y;
}

// The decode path's call: bf16 x [..., K] (any leading shape) @ w^T -> bf16 [..., O], each sum
// rounded once, in one call from Python (no fp32 [M, O] buffer, no cast, no reshapes around it).
torch::Tensor bf16_linear_bf16(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() >= 1, "x: bf16 [..., K]");
    TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 2 && w.size(1) == x.size(-1), "w: bf16 [O, K]");
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int64_t K = w.size(1), O = w.size(0), M = K ? xc.numel() / K : 0;
    auto shape = x.sizes().vec();
    shape.back() = O;
    auto y = torch::empty(shape, x.options());
    passes(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()),
           reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, O);
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
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        by_rows(std::min<int64_t>(kMaxRows, M - m0), [&](auto mt) {
            rows_argmax<decltype(mt)::value>(xp + m0 * K, wp, op + m0, K, O);
        });
    return out;
}

"""

# 7-bit weights for the drafter's small decode steps (AVX-512 bf16 and AMX extensions; appended
# after AVX512_SOURCE, whose `put` it uses). Why 7 bits in a byte, not 8: a byte u in [1, 127] becomes
# the bf16 of 128 + u with one OR of its zero-extended 16-bit lane (0x4300 | u: exponent 2^7, u the
# mantissa), so widening 32 weights costs 2 instructions where int8 -> fp32 -> bf16 costs 5-7 and
# left the kernel compute-bound (session 33: 0.53 ms for the EAGLE-3 drafter's 11.8M weights with
# hot caches, the bf16 kernel's cold time 0.80). q = u - 64 in [-63, 63] with one fp32 scale per
# weight row; sum_k x_k q_k = sum_k x_k (128 + u_k) - 192 sum_k x_k, each product exact in fp32.
Q7_SOURCE = r"""
static inline __m512bh q7_widen(__m256i u) {  // 32 bytes u -> the bf16 of 128 + u, in order
    return (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(u), _mm512_set1_epi16(0x4300));
}

template <int R, int MT, typename T>
static inline void q7_tile(const uint16_t* x, const float* xsum, const uint8_t* w, const float* s, T* y,
                           int64_t K, int64_t ys, int64_t o, const uint8_t* pf) {
    __m512 acc[R][MT];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = (K - k >= 32) ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        if (pf && (k & 63) == 0)  // one 64-byte line per weight row every other chunk
            for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T0);
        __m512bh wv[R];  // masked-off lanes widen to 128.0 but meet x's zeros
        for (int r = 0; r < R; ++r)  // a 512-bit masked load (no AVX-512 VL needed), low half kept
            wv[r] = q7_widen(_mm512_castsi512_si256(_mm512_maskz_loadu_epi8((__mmask64)mask, w + (o + r) * K + k)));
        for (int m = 0; m < MT; ++m) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
            for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m)
            put(y + m * ys + r, (_mm512_reduce_add_ps(acc[r][m]) - 192.0f * xsum[m]) * s[o + r]);
}

// One 7-bit weight row against MT rows of x, two sums per row of x, as `stream_row` reads bf16 rows
// (one sequential stream per thread; every row of x summed in the same order whatever MT).
template <int MT, typename T>
static inline void q7_stream_row(const uint16_t* x, const float* xsum, const uint8_t* w, const float* s, T* y,
                                 int64_t K, int64_t ys, int64_t o, bool prefetch) {
    __m512 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const uint8_t* row = w + o * K;
    const uint8_t* pf = row + 8 * K;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
        const __m512bh w0 = q7_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
        const __m512bh w1 = q7_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 32)));
        for (int m = 0; m < MT; ++m) {
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
        }
    }
    for (; k < K; k += 32) {  // the rest, the last chunk masked (its widened 128.0s meet x's zeros)
        const __mmask32 mask = (K - k >= 32) ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
        const __m512bh wv = q7_widen(_mm512_castsi512_si256(_mm512_maskz_loadu_epi8((__mmask64)mask, row + k)));
        for (int m = 0; m < MT; ++m)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
    for (int m = 0; m < MT; ++m)
        put(y + m * ys, (_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - 192.0f * xsum[m]) * s[o]);
}

constexpr int64_t kQ7PrefetchRows = 16;  // rows are half as long as bf16's: the same ~10 KB ahead
//: rows of x the 7-bit kernel serves in one call; more (a long catch-up) take the dequantized bf16 weights
constexpr int64_t kQ7Rows = 8;

template <int MT, typename T>
static void q7_rows(const uint16_t* x, const float* xsum, const uint8_t* w, const float* s, T* y, int64_t K,
                    int64_t O) {
    if (MT <= g_stream_rows) {
        at::parallel_for(0, O, 128, [&](int64_t begin, int64_t end) {
            for (int64_t o = begin; o < end; ++o) q7_stream_row<MT>(x, xsum, w, s, y + o, K, O, o, o + 8 < end);
        });
        return;
    }
    constexpr int64_t R = tile_rows<MT>();
    const int64_t tiles = O / R;
    at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const int64_t o = R * p;
            const bool ahead = o + kQ7PrefetchRows + R <= O;
            q7_tile<R, MT>(x, xsum, w, s, y + o, K, O, o, ahead ? w + (o + kQ7PrefetchRows) * K : nullptr);
        }
    });
    for (int64_t o = R * tiles; o < O; ++o) q7_tile<1, MT>(x, xsum, w, s, y + o, K, O, o, nullptr);
}

// bf16 x [..., K] (at most kQ7Rows rows) @ (7-bit u [O, K] as q = u - 64, times fp32 s [O])^T -> bf16 [..., O]
torch::Tensor q7_linear_bf16(torch::Tensor x, torch::Tensor u, torch::Tensor s) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() >= 1, "x: bf16 [..., K]");
    TORCH_CHECK(u.dtype() == torch::kUInt8 && u.dim() == 2 && u.is_contiguous() && u.size(1) == x.size(-1),
                "u: contiguous uint8 [O, K]");
    TORCH_CHECK(s.dtype() == torch::kFloat32 && s.is_contiguous() && s.numel() == u.size(0), "s: contiguous fp32 [O]");
    auto xc = x.contiguous();
    const int64_t K = u.size(1), O = u.size(0), M = K ? xc.numel() / K : 0;
    TORCH_CHECK(M <= kQ7Rows, "the 7-bit kernel takes at most ", kQ7Rows, " rows, got ", M);
    auto shape = x.sizes().vec();
    shape.back() = O;
    auto y = torch::empty(shape, x.options());
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    float xsum[kQ7Rows];
    for (int64_t m = 0; m < M; ++m) {  // the 192 sum_k x_k each weight's offset adds
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 mask = (K - k >= 16) ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1u);
            const __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)mask, xp + m * K + k));
            acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        xsum[m] = _mm512_reduce_add_ps(acc);
    }
    const uint8_t* up = u.data_ptr<uint8_t>();
    const float* sp = s.data_ptr<float>();
    uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    switch (M) {
        case 0: break;
        case 1: q7_rows<1>(xp, xsum, up, sp, yp, K, O); break;
        case 2: q7_rows<2>(xp, xsum, up, sp, yp, K, O); break;
        case 3: q7_rows<3>(xp, xsum, up, sp, yp, K, O); break;
        case 4: q7_rows<4>(xp, xsum, up, sp, yp, K, O); break;
        case 5: q7_rows<5>(xp, xsum, up, sp, yp, K, O); break;
        case 6: q7_rows<6>(xp, xsum, up, sp, yp, K, O); break;
        case 7: q7_rows<7>(xp, xsum, up, sp, yp, K, O); break;
        default: q7_rows<8>(xp, xsum, up, sp, yp, K, O); break;
    }
    return y;
}
"""

#: the bound functions of NORM_SOURCE + AVX512_SOURCE + Q7_SOURCE, for the bindings unit (`build.load_kernels`)
AVX512_DECLS = r"""
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor scale, double eps, bool round_first);
torch::Tensor bf16_linear_bf16x(torch::Tensor x, torch::Tensor w);
torch::Tensor bf16_linear_bf16(torch::Tensor x, torch::Tensor w);
int64_t set_stream_rows(int64_t n);
torch::Tensor bf16_linear_argmax(torch::Tensor x, torch::Tensor w);
torch::Tensor q7_linear_bf16(torch::Tensor x, torch::Tensor u, torch::Tensor s);
"""

#: their `m.def` lines (the module's body; `cpu_linear` adds the other parts' and builds the module)
AVX512_BINDINGS = r"""
    m.def("rms_norm", &rms_norm, "RMS norm of bf16 rows [M, D] with an fp32 scale [D] -> bf16 [M, D]");
    m.def("bf16_linear_bf16x", &bf16_linear_bf16x, "x bf16 [M, K] @ w bf16 [O, K]^T -> fp32 [M, O]");
    m.def("bf16_linear_bf16", &bf16_linear_bf16, "x bf16 [..., K] @ w bf16 [O, K]^T -> bf16 [..., O]");
    m.def("set_stream_rows", &set_stream_rows,
          "inputs of up to n rows read one weight row at a time (0: the weight-row tiles for all); returns the old n");
    m.def("bf16_linear_argmax", &bf16_linear_argmax, "argmax_o bf16(x bf16 [M, K] @ w bf16 [O, K]^T) -> int64 [M]");
    m.def("q7_linear_bf16", &q7_linear_bf16, "x bf16 [..., K] (<= 8 rows) @ ((u uint8 [O, K] - 64) * s fp32 [O])^T -> bf16 [..., O]");
"""



def avx512_layer_linear(amx: bool) -> str:
    """C++ `layer_linear` for the AVX-512 / AMX extensions: the fused layer's projections (bf16 x
    [..., K] @ w^T -> bf16 [..., O]), routed as `cpu_linear._Forward` routes a linear on that backend:
    a packed weight (4 dims) through the packed kernel for any rows, otherwise AMX tiles for 2-16
    rows on its 32 grid, the AVX-512 path (`stream_row`) for the other shapes up to 16 rows,
    PyTorch's matmul beyond."""
    amx_rows = """
    if (M >= 2 && M <= 16 && K % 32 == 0 && O % 32 == 0) {
        auto shape = x.sizes().vec();
        shape.back() = O;
        return amx_linear(x.reshape({M, K}).contiguous(), w).to(torch::kBFloat16).view(shape);
    }""" if amx else ""
    return f"""
static torch::Tensor layer_linear(torch::Tensor x, torch::Tensor w, int64_t) {{
    if (w.dim() == 4) return packed_linear_bf16(x, w);  // packed by `cpu_linear.pack` (cpu_linear_packed_src)
    const int64_t K = w.size(1), O = w.size(0), M = K ? x.numel() / K : 0;{amx_rows}
    if (M <= 16) return bf16_linear_bf16(x, w);
    return at::linear(x, w);
}}
"""

