"""C++ source of the AMX bf16 tile kernel (`cpu_linear`'s "amx" backend), appended to the AVX-512 source.

``AMX_SOURCE`` holds tile kernels for 2-16 rows whose K and O sit on AMX's 32 grid (``tdpbf16ps``:
16 rows x 16 outputs x 32 weights per instruction, x packed in pairs) and the fused greedy head on
them; ``AMX_BINDINGS`` their Python bindings. Other shapes and one row fall back to the AVX-512
path of `cpu_linear_src`, which the same extension compiles. Kept apart from `cpu_linear_src` so
each source file reads on its own; `cpu_linear`'s docstring gives the numbers and the routing.
"""

AMX_SOURCE = r"""
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
// pairs, tiny and L1-resident). The block one ahead is prefetched line by line across the k loop into
// L2 (_MM_HINT_T1): into L1 (T0), the two blocks in flight (80 KB at K = 640) overflowed its 48 KB
// and evicted each other (session 27, Xeon, interleaved medians of 9, Gemma 3 270M shapes, 3 / 5 / 8
// rows: layers 11.1 / 11.5 / 11.5 -> 10.0 / 10.2 / 10.4 ms, LM head 16.6 / 16.7 / 18.0 -> 14.4 / 14.6 / 14.9).
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
                    for (int64_t l = 0; l < per; ++l) _mm_prefetch(pf + (it * per + l) * 64, _MM_HINT_T1);
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
    merge_blocks(bval, bidx, nblocks, N, op);
    return out;
}

"""

#: the AMX extension's extra bound functions and `m.def` lines (beside the AVX-512 ones)
AMX_DECLS = r"""
bool amx_available();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor amx_linear_argmax(torch::Tensor x, torch::Tensor w);
"""
AMX_BINDINGS = r"""
    m.def("amx_available", &amx_available, "whether Linux granted this process AMX tile state");
    m.def("amx_linear", &amx_linear, "AMX: x bf16 [M <= 16, K] @ w bf16 [O, K]^T -> fp32 [M, O]");
    m.def("amx_linear_argmax", &amx_linear_argmax, "AMX: argmax_o bf16(x @ w^T) -> int64 [M]");
"""
