"""C++ sources of the packed-weight bf16 kernels (`cpu_linear`'s "avx512" backend since session 39, "avx2" since 40).

Why: the row-streaming kernel of `cpu_linear_src` gives each output its own dot product, so every
weight row ends in a horizontal sum of a 16-lane register and each extra row of x costs another
pass of ``vdpbf16ps`` over L1 plus that sum: on the 2-core Zen 4 a step of 4 rows took ~4 ms more
than a step of 1, and 1 row read memory at ~60% of what the machine delivers.

What: the weight [O, K] is repacked once (`pack`, in `cpu_linear`) into panels of 64 outputs,
``[O / 64, K / 2, 64, 2]``: for each pair of inputs k, 2k + 1, the 64 outputs' two weights lie in
four 64-byte registers, one after the other. A row of x is broadcast a pair at a time (one 32-bit
``vpbroadcastd``), so ``vdpbf16ps`` sums into 16 outputs per lane-register with no horizontal sum;
each thread reads its panels front to back as one sequential stream, and up to 6 rows of x (4 x 6
accumulators) share every weight register. More rows run as groups of 4 over chunks of 64 pairs
(16 KB of panel, read again from L1), partial sums kept in a small fp32 buffer.

Numerics: output o's sum is ``vdpbf16ps`` over k's pairs in order 0, 1, ..., K/2 - 1 in one fp32
lane, whatever the number of rows, the group a row falls in or the chunking: a row gets the same bits
alone or among 16 (a verification computes exactly what a one-token step computes for each token),
and the argmax head picks the lowest index among equal bf16-rounded logits.

AVX2 (session 40): the same panels, each read as two slices of 32 outputs. A 256-bit load holds 8
outputs' pairs; a shift and a mask widen it into the even-k and odd-k weights as fp32, and two FMAs per
row of x add w[o, 2p] x[2p], then w[o, 2p + 1] x[2p + 1], into output o's lane. Up to 3 rows of x
share a slice's weights (3 x 4 accumulators in 16 registers); more rows run as groups of 3 over
chunks of 64 pairs, as above. Here too each output is summed over k in order in one lane whatever
the rows, so the AVX2 backend is row-width invariant as well (its row-streaming kernel was not:
1 row and 2-5 rows summed in different orders).

`PACKED_SOURCE` (AVX-512) and `PACKED_AVX2_SOURCE` go after their backend's source and
`cpu_linear_src.COMMON_SOURCE` (`put`, `round_bf16`, `merge_blocks`, `by_rows`); each is an ISA
prelude (the accumulator, one slice's pairs) and the shared body. `PACKED_BINDINGS` goes inside the
backend's PYBIND11 module.
"""

#: the shared body (both preludes define PAcc, PX, kLanes, the group sizes, `slices_of` and `slice_pairs`)
_PACKED_BODY = r"""
// ---- the shared body: panels of 64 outputs, [O / 64, K / 2, 64, 2] ---------------------------------------
constexpr int64_t kPanel = 64;                      // outputs per panel
constexpr int64_t kPairChunk = 64;                  // pairs of k per chunk when rows run in groups (16 KB of panel)

// G rows' sums over pairs [p0, p1) of the panel (each of its slices_of<G>() slices in turn),
// continuing from buf (or from zero when first), back into buf [G][64] (row stride 64)
template <int G>
static inline void panel_group(const PX* x, int64_t xs, const uint16_t* panel, int64_t p0, int64_t p1,
                               float* buf, bool first) {
    constexpr int S = slices_of<G>(), R = kPanel / kLanes / S;  // slices, registers per slice and row
    for (int s = 0; s < S; ++s) {
        PAcc acc[G * R];
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < R; ++c) {
                const float* b = buf + g * kPanel + (s * R + c) * kLanes;
                acc[g * R + c] = first ? pacc_zero() : pacc_load(b);
            }
        slice_pairs<G, R>(x, xs, panel, s, p0, p1, acc);
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < R; ++c) pacc_store(buf + g * kPanel + (s * R + c) * kLanes, acc[g * R + c]);
    }
}

// MT rows of x (row stride xs) against panel n: fp32 sums into buf [MT][64]
template <int MT>
static inline void panel_rows(const PX* x, int64_t xs, const uint16_t* pk, int64_t K, int64_t n, float* buf) {
    const int64_t Kp = K / 2;
    const uint16_t* panel = pk + n * kPanel * K;
    if constexpr (MT <= kOneGroup && slices_of<MT>() == 1) {
        panel_group<MT>(x, xs, panel, 0, Kp, buf, true);
    } else {
        for (int64_t p0 = 0; p0 < Kp; p0 += kPairChunk) {
            const int64_t p1 = std::min(Kp, p0 + kPairChunk);
            int m = 0;
            for (; m + kGroup <= MT; m += kGroup)
                panel_group<kGroup>(x + m * xs, xs, panel, p0, p1, buf + m * kPanel, p0 == 0);
            if constexpr (MT % kGroup != 0)  // the rows left after the full groups
                panel_group<MT % kGroup>(x + m * xs, xs, panel, p0, p1, buf + m * kPanel, p0 == 0);
        }
    }
}

template <int MT, typename T>
static void packed_rows(const PX* x, int64_t xs, const uint16_t* pk, T* y, int64_t K, int64_t O) {
    at::parallel_for(0, O / kPanel, 1, [&](int64_t begin, int64_t end) {
        alignas(64) float buf[MT * kPanel];
        for (int64_t n = begin; n < end; ++n) {
            panel_rows<MT>(x, xs, pk, K, n, buf);
            for (int m = 0; m < MT; ++m)
                for (int64_t j = 0; j < kPanel; ++j) put(y + m * O + n * kPanel + j, buf[m * kPanel + j]);
        }
    });
}

// argmax over o of bf16(x[m] . w[o]) per row, lowest o on ties: blocks of panels in parallel, each
// keeps its best per row, merged in order (a later block wins only when strictly greater)
template <int MT>
static void packed_rows_argmax(const PX* x, int64_t xs, const uint16_t* pk, int64_t* out, int64_t K, int64_t O) {
    constexpr int64_t kBlock = 64;  // panels per block (4096 outputs)
    const int64_t panels = O / kPanel, nblocks = (panels + kBlock - 1) / kBlock;
    std::vector<float> bval(nblocks * MT);
    std::vector<int64_t> bidx(nblocks * MT);
    at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
        alignas(64) float buf[MT * kPanel];
        for (int64_t b = begin; b < end; ++b) {
            float best[MT];
            int64_t arg[MT];
            for (int m = 0; m < MT; ++m) best[m] = -INFINITY, arg[m] = b * kBlock * kPanel;
            for (int64_t n = b * kBlock; n < std::min(panels, (b + 1) * kBlock); ++n) {
                panel_rows<MT>(x, xs, pk, K, n, buf);
                for (int m = 0; m < MT; ++m)
                    for (int64_t j = 0; j < kPanel; ++j) {
                        const float v = round_bf16(buf[m * kPanel + j]);
                        if (v > best[m]) best[m] = v, arg[m] = n * kPanel + j;
                    }
            }
            for (int m = 0; m < MT; ++m) bval[b * MT + m] = best[m], bidx[b * MT + m] = arg[m];
        }
    });
    merge_blocks(bval, bidx, nblocks, MT, out);
}

static void check_packed(const torch::Tensor& pk, int64_t K) {
    TORCH_CHECK(pk.dtype() == torch::kBFloat16 && pk.is_contiguous() && pk.dim() == 4 && pk.size(2) == kPanel
                && pk.size(3) == 2, "pk: a packed weight, contiguous bf16 [O / 64, K / 2, 64, 2]");
    TORCH_CHECK(pk.size(1) * 2 == K, "x and the packed weight disagree on K");
}

// bf16 x [..., K] @ w^T -> bf16 [..., O] for w packed [O / 64, K / 2, 64, 2]; any rows (passes of 16)
torch::Tensor packed_linear_bf16(torch::Tensor x, torch::Tensor pk) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() >= 1, "x: bf16 [..., K]");
    const int64_t K = x.size(-1);
    check_packed(pk, K);
    auto xc = x.contiguous();
    const int64_t O = pk.size(0) * kPanel, M = K ? xc.numel() / K : 0;
    auto shape = x.sizes().vec();
    shape.back() = O;
    auto y = torch::empty(shape, x.options());
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(pk.data_ptr<at::BFloat16>());
    uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    std::vector<float> xbuf;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
        const PX* xr = packed_x(xp + m0 * K, rows, K, xbuf);
        by_rows(rows, [&](auto mt) {
            packed_rows<decltype(mt)::value>(xr, K / 2 * kXPerPair, wp, yp + m0 * O, K, O);
        });
    }
    return y;
}

torch::Tensor packed_linear_argmax(torch::Tensor x, torch::Tensor pk) {
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2, "x: contiguous bf16 [M, K]");
    const int64_t M = x.size(0), K = x.size(1);
    check_packed(pk, K);
    TORCH_CHECK(pk.size(0) > 0, "the packed weight is empty");
    auto out = torch::empty({M}, x.options().dtype(torch::kLong));
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(pk.data_ptr<at::BFloat16>());
    int64_t* op = out.data_ptr<int64_t>();
    std::vector<float> xbuf;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
        const PX* xr = packed_x(xp + m0 * K, rows, K, xbuf);
        by_rows(rows, [&](auto mt) {
            packed_rows_argmax<decltype(mt)::value>(xr, K / 2 * kXPerPair, wp, op + m0, K, pk.size(0) * kPanel);
        });
    }
    return out;
}
"""

#: AVX-512 bf16 (after `cpu_linear_src.AVX512_SOURCE`)
PACKED_SOURCE = r"""
// ---- AVX-512 bf16: vdpbf16ps sums a pair of bf16 products into each fp32 lane ----------------------
using PAcc = __m512;
using PX = uint32_t;                           // x as bf16 pairs, broadcast one 32-bit pair at a time
constexpr int kLanes = 16;
template <int G>
constexpr int slices_of() { return 1; }       // a 64-output panel in one slice of 4 registers
constexpr int kOneGroup = 6;                   // up to 6 rows in one group over all of K (6 x 4 accumulators)
constexpr int kGroup = 4;                      // more rows: groups of 4 over chunks of K
static inline PAcc pacc_zero() { return _mm512_setzero_ps(); }
static inline PAcc pacc_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void pacc_store(float* p, PAcc v) { _mm512_storeu_ps(p, v); }

// x rows as the slices read them: bf16 pairs (stride K / 2), no copy
static inline const PX* packed_x(const uint16_t* x, int64_t, int64_t, std::vector<float>&) {
    return reinterpret_cast<const PX*>(x);
}
constexpr int64_t kXPerPair = 1;

// G rows of x (row stride xs) against pairs [p0, p1) of slice s of a panel (R registers): acc[g * R + c]
// += the slice's register c (16 outputs) times row g's pair, for each pair in order
template <int G, int R>
static inline void slice_pairs(const PX* x, int64_t xs, const uint16_t* panel, int, int64_t p0, int64_t p1,
                               PAcc* acc) {
    for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* wp = panel + p * 128;  // 64 outputs x 2
        __m512bh w[R];
        for (int c = 0; c < R; ++c) w[c] = (__m512bh)_mm512_loadu_si512(wp + 32 * c);
        for (int g = 0; g < G; ++g) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[g * xs + p]);
            for (int c = 0; c < R; ++c) acc[g * R + c] = _mm512_dpbf16_ps(acc[g * R + c], w[c], xb);
        }
    }
}
""" + _PACKED_BODY

#: AVX2 + FMA (after `cpu_linear_avx2_src.AVX2_SOURCE`)
PACKED_AVX2_SOURCE = r"""
// ---- AVX2: each 256-bit load of 8 outputs' pairs widened into even-k and odd-k fp32, two FMAs ----------
using PAcc = __m256;
using PX = float;                              // x widened to fp32 once per call (stride K)
constexpr int kLanes = 8;
// one row reads a 64-output panel whole (8 registers: each thread one sequential stream); more rows
// read it as two slices of 32 outputs (4 registers a row), so 3 rows' accumulators fit 16 registers
template <int G>
constexpr int slices_of() { return G == 1 ? 1 : 2; }
constexpr int kOneGroup = 3;                   // up to 3 rows in one group over all of K (3 x 4 accumulators)
constexpr int kGroup = 3;                      // more rows: groups of 3 over chunks of K
static inline PAcc pacc_zero() { return _mm256_setzero_ps(); }
static inline PAcc pacc_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void pacc_store(float* p, PAcc v) { _mm256_storeu_ps(p, v); }

static inline const PX* packed_x(const uint16_t* x, int64_t rows, int64_t K, std::vector<float>& buf) {
    buf.resize(rows * K);
    for (int64_t i = 0; i < rows * K; ++i) buf[i] = norm_widen(x[i]);
    return buf.data();
}
constexpr int64_t kXPerPair = 2;

constexpr int64_t kAhead = 16;  // pairs (4 KB of panel) between a slice's read and its prefetch

template <int G, int R>
static inline void slice_pairs(const PX* x, int64_t xs, const uint16_t* panel, int s, int64_t p0, int64_t p1,
                               PAcc* acc) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* wp = panel + p * 128 + s * 16 * R;  // this slice's 8 R outputs x 2
        for (int l = 0; l < R / 2; ++l)  // the slice's lines kAhead pairs on
            _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead * 128 + 32 * l), _MM_HINT_T0);
        for (int c = 0; c < R; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * c));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));    // w[o, 2p]
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));     // w[o, 2p + 1]
            for (int g = 0; g < G; ++g) {
                acc[g * R + c] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(x + g * xs + 2 * p), acc[g * R + c]);
                acc[g * R + c] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(x + g * xs + 2 * p + 1), acc[g * R + c]);
            }
        }
    }
}
""" + _PACKED_BODY

#: the bound functions' declarations and `m.def` lines (in the backend's bindings unit)
PACKED_DECLS = r"""
torch::Tensor packed_linear_bf16(torch::Tensor x, torch::Tensor pk);
torch::Tensor packed_linear_argmax(torch::Tensor x, torch::Tensor pk);
"""
PACKED_BINDINGS = r"""
    m.def("packed_linear_bf16", &packed_linear_bf16,
          "x bf16 [..., K] @ w^T -> bf16 [..., O], w packed bf16 [O / 64, K / 2, 64, 2] (any rows, passes of 16)");
    m.def("packed_linear_argmax", &packed_linear_argmax,
          "argmax_o bf16(x bf16 [M, K] @ w^T) -> int64 [M], w packed bf16 [O / 64, K / 2, 64, 2]");
"""
