"""C++ source of the packed-weight AVX-512 bf16 kernel (`cpu_linear`'s "avx512" backend since session 39).

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

`PACKED_SOURCE` goes after the AVX-512 source (it uses its `put`, `round_bf16`, `merge_blocks` and `by_rows`);
`PACKED_BINDINGS` inside its PYBIND11 module.
"""

PACKED_SOURCE = r"""
constexpr int kPanelRegs = 4;                  // 16-output registers per panel
constexpr int64_t kPanel = 16 * kPanelRegs;    // outputs per panel
constexpr int64_t kPairChunk = 64;             // pairs of k per chunk when rows run in groups (16 KB of panel)

// G rows of x (as 32-bit pairs, row stride xs) against pairs [p0, p1) of one panel: acc[g * 4 + c] +=
// the panel's register c (16 outputs) times row g's pair, for each pair in order.
template <int G>
static inline void panel_pairs(const uint32_t* x, int64_t xs, const uint16_t* panel, int64_t p0, int64_t p1,
                               __m512* acc) {
    for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* wp = panel + p * 2 * kPanel;
        __m512bh w[kPanelRegs];
        for (int c = 0; c < kPanelRegs; ++c) w[c] = (__m512bh)_mm512_loadu_si512(wp + 32 * c);
        for (int g = 0; g < G; ++g) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[g * xs + p]);
            for (int c = 0; c < kPanelRegs; ++c) acc[g * kPanelRegs + c] = _mm512_dpbf16_ps(acc[g * kPanelRegs + c], w[c], xb);
        }
    }
}

// G rows' sums over pairs [p0, p1), continuing from buf (or from zero when first), back into buf [G][64]
template <int G>
static inline void panel_group(const uint32_t* x, int64_t xs, const uint16_t* panel, int64_t p0, int64_t p1,
                               float* buf, bool first) {
    __m512 acc[G * kPanelRegs];
    for (int i = 0; i < G * kPanelRegs; ++i) acc[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(buf + 16 * i);
    panel_pairs<G>(x, xs, panel, p0, p1, acc);
    for (int i = 0; i < G * kPanelRegs; ++i) _mm512_storeu_ps(buf + 16 * i, acc[i]);
}

// MT rows of x [MT, K] against panel n: fp32 sums into buf [MT][64]
template <int MT>
static inline void panel_rows(const uint32_t* x, const uint16_t* pk, int64_t K, int64_t n, float* buf) {
    const int64_t Kp = K / 2;
    const uint16_t* panel = pk + n * kPanel * K;
    if constexpr (MT <= 6) {
        panel_group<MT>(x, Kp, panel, 0, Kp, buf, true);
    } else {
        for (int64_t p0 = 0; p0 < Kp; p0 += kPairChunk) {
            const int64_t p1 = std::min(Kp, p0 + kPairChunk);
            int m = 0;
            for (; m + 4 <= MT; m += 4) panel_group<4>(x + m * Kp, Kp, panel, p0, p1, buf + m * kPanel, p0 == 0);
            if constexpr (MT % 4 == 3) panel_group<3>(x + m * Kp, Kp, panel, p0, p1, buf + m * kPanel, p0 == 0);
            if constexpr (MT % 4 == 2) panel_group<2>(x + m * Kp, Kp, panel, p0, p1, buf + m * kPanel, p0 == 0);
            if constexpr (MT % 4 == 1) panel_group<1>(x + m * Kp, Kp, panel, p0, p1, buf + m * kPanel, p0 == 0);
        }
    }
}

template <int MT, typename T>
static void packed_rows(const uint16_t* x, const uint16_t* pk, T* y, int64_t K, int64_t O) {
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
    at::parallel_for(0, O / kPanel, 1, [&](int64_t begin, int64_t end) {
        alignas(64) float buf[MT * kPanel];
        for (int64_t n = begin; n < end; ++n) {
            panel_rows<MT>(xp, pk, K, n, buf);
            for (int m = 0; m < MT; ++m)
                for (int64_t j = 0; j < kPanel; ++j) put(y + m * O + n * kPanel + j, buf[m * kPanel + j]);
        }
    });
}

// argmax over o of bf16(x[m] . w[o]) per row, lowest o on ties: blocks of panels in parallel, each
// keeps its best per row, merged in order (a later block wins only when strictly greater)
template <int MT>
static void packed_rows_argmax(const uint16_t* x, const uint16_t* pk, int64_t* out, int64_t K, int64_t O) {
    constexpr int64_t kBlock = 64;  // panels per block (4096 outputs)
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
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
                panel_rows<MT>(xp, pk, K, n, buf);
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
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        by_rows(std::min<int64_t>(kMaxRows, M - m0), [&](auto mt) {
            packed_rows<decltype(mt)::value>(xp + m0 * K, wp, yp + m0 * O, K, O);
        });
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
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        by_rows(std::min<int64_t>(kMaxRows, M - m0), [&](auto mt) {
            packed_rows_argmax<decltype(mt)::value>(xp + m0 * K, wp, op + m0, K, pk.size(0) * kPanel);
        });
    return out;
}
"""

PACKED_BINDINGS = r"""
    m.def("packed_linear_bf16", &packed_linear_bf16,
          "x bf16 [..., K] @ w^T -> bf16 [..., O], w packed bf16 [O / 64, K / 2, 64, 2] (any rows, passes of 16)");
    m.def("packed_linear_argmax", &packed_linear_argmax,
          "argmax_o bf16(x bf16 [M, K] @ w^T) -> int64 [M], w packed bf16 [O / 64, K / 2, 64, 2]");
"""
