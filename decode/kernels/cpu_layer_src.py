"""C++ source of one whole decoder layer per call (Gemma 3's, and the EAGLE-3 drafter's), for decode
steps through drafttrain's CPU kernels (AVX2, AVX-512 bf16, AMX).

``LAYER_SOURCE`` is compiled into each kernel's extension after the sources that define what it
calls: `rms_norm` (`cpu_linear_src.NORM_SOURCE`), `load_bf16x8` and `hsum` (AVX2 intrinsics, which
every one of these CPUs has: `cpu_linear_avx2_src.AVX2_HELPERS`) and `layer_linear` (bf16 rows @ a bf16 weight -> bf16, each backend's routing of
a projection: `AVX2_SOURCE`'s, or `cpu_linear_src.AVX512_LAYER_LINEAR`). `cpu_layers` (the Python
side) says why and what it measured.

Numerics: every step rounds to bf16 where the transformers layer's bf16 ops round (each norm, each
projection, the rotary embedding's two products and their sum, the gelu, the gate product, each
residual add), so a layer's output differs from PyTorch's by what the kernels' own summation order
and the attention's differ: the attention sums q·k and p·v in fp32 over the whole context at once
(PyTorch's CPU flash attention works in blocks of keys and rounds the probabilities to bf16 before
p·v), then rounds once. The gelu's tanh, the SiLU's and the softmax's exp are SLEEF's vectorised
1-ulp functions, the ones PyTorch's own bf16 gelu calls (libtorch_cpu exports them), declared here
rather than included: ``Sleef_tanhf8_u10avx2`` / ``Sleef_expf8_u10avx2``.
"""

LAYER_SOURCE = r"""
#include <cmath>

static inline float gelu_tanh(float x) {  // what F.gelu(x, approximate="tanh") computes, in fp32
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    return 0.5f * x * (1.0f + std::tanh(k0 * (x + k1 * x * x * x)));
}

static inline float to_bf16(float f) { return norm_widen(norm_round(f)); }

// PyTorch's own vectorised tanh and exp (the SLEEF functions libtorch_cpu bundles and exports, 1 ulp):
// what its bf16 gelu computes on AVX2, 8 lanes at a time. Scalar std::tanh cost ~30 ns an element,
// 3 ms of a 5-token Gemma 3 270M step (2048 x 5 x 18 of them; perf, session 28).
// Weak: a torch build that does not export them loads the extension with null pointers and takes
// the scalar loops below instead of failing to import.
extern "C" __m256 Sleef_tanhf8_u10avx2(__m256) __attribute__((weak));
extern "C" __m256 Sleef_expf8_u10avx2(__m256) __attribute__((weak));

// 8 fp32 lanes -> their bf16 bits (low half of each lane), rounded to nearest even as norm_round
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
}

static inline __m256 to_bf16x8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

static inline void store_bf16x8(uint16_t* p, __m256 v) {
    const __m256i b = bf16_bits8(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// act[i] = bf16(bf16(gelu_tanh(g[i])) u[i]) for i < I (Gemma 3's gated MLP), 8 lanes at a time
static void gelu_gate(const uint16_t* g, const uint16_t* u, uint16_t* act, int64_t I) {
    const __m256 k0 = _mm256_set1_ps(0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f);
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; Sleef_tanhf8_u10avx2 && i + 8 <= I; i += 8) {
        const __m256 x = load_bf16x8(g + i);
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 t = Sleef_tanhf8_u10avx2(_mm256_mul_ps(k0, _mm256_add_ps(x, _mm256_mul_ps(k1, cube))));
        const __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
        store_bf16x8(act + i, _mm256_mul_ps(to_bf16x8(y), load_bf16x8(u + i)));
    }
    for (; i < I; ++i) act[i] = norm_round(to_bf16(gelu_tanh(norm_widen(g[i]))) * norm_widen(u[i]));
}

// act[i] = bf16(bf16(silu(g[i])) u[i]) for i < I (the drafter's SiLU-gated MLP), 8 lanes at a time
static void silu_gate(const uint16_t* g, const uint16_t* u, uint16_t* act, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; Sleef_expf8_u10avx2 && i + 8 <= I; i += 8) {
        const __m256 x = load_bf16x8(g + i);
        const __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10avx2(_mm256_xor_ps(x, neg))));
        store_bf16x8(act + i, _mm256_mul_ps(to_bf16x8(y), load_bf16x8(u + i)));
    }
    for (; i < I; ++i) {
        const float x = norm_widen(g[i]);
        act[i] = norm_round(to_bf16(x / (1.0f + std::exp(-x))) * norm_widen(u[i]));
    }
}

// s[t] = exp(s[t] - mx) for t < T; returns their sum. Every s[t] goes through the same vector exp in
// lane t % 8 (the tail as one more vector, its lanes past T set to -inf: exp 0), and the eight lane
// sums are added in one order: s[t] and the sum do not depend on T beyond the entries that are there.
// A verification's query sees the keys a one-token step sees plus masked ones (score -inf: exp 0),
// so it gets that step's bits (session 39: a scalar tail moved with T and flipped a bf16 near-tie).
static float exp_shifted(float* s, int64_t T, float mx) {
    if (!Sleef_expf8_u10avx2) {  // no SLEEF: one scalar sum in order (zeros past T change nothing)
        float total = 0.f;
        for (int64_t t = 0; t < T; ++t) total += (s[t] = std::exp(s[t] - mx));
        return total;
    }
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) {
        const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (t < T) {
        alignas(32) float tail[8];
        for (int64_t j = 0; j < 8; ++j) tail[j] = t + j < T ? s[t + j] : -INFINITY;
        const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_load_ps(tail), m));
        _mm256_store_ps(tail, e);
        for (int64_t j = 0; t + j < T; ++j) s[t + j] = tail[j];
        acc = _mm256_add_ps(acc, e);
    }
    return hsum(acc);
}

static inline const uint16_t* bits(const torch::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

static inline uint16_t* wbits(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// y = bf16(a + b) elementwise over bf16 tensors of one shape (a residual add)
static torch::Tensor add_bf16(const torch::Tensor& a, const torch::Tensor& b) {
    auto y = torch::empty_like(a);
    const uint16_t *ap = bits(a), *bp = bits(b);
    uint16_t* yp = wbits(y);
    for (int64_t i = 0; i < a.numel(); ++i) yp[i] = norm_round(norm_widen(ap[i]) + norm_widen(bp[i]));
    return y;
}

// Rotary embedding in place on bf16 rows t [M, heads * hd]: t = bf16(bf16(t cos) + bf16(rot(t) sin)),
// rot(t) = (-t[half:], t[:half]); cos / sin: bf16 [M, hd] (one row per token).
static void rope_inplace(torch::Tensor& t, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                         int64_t hd) {
    const int64_t M = cos.size(0), half = hd / 2;
    uint16_t* tp = wbits(t);
    const uint16_t *cp = bits(cos), *sp = bits(sin);
    std::vector<float> row(hd);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t h = 0; h < heads; ++h) {
            uint16_t* r = tp + (m * heads + h) * hd;
            for (int64_t d = 0; d < hd; ++d) row[d] = norm_widen(r[d]);
            for (int64_t d = 0; d < hd; ++d) {
                const float rot = d < half ? -row[d + half] : row[d - half];
                r[d] = norm_round(to_bf16(row[d] * norm_widen(cp[m * hd + d])) +
                                  to_bf16(rot * norm_widen(sp[m * hd + d])));
            }
        }
}

// s[i * T + j] = q_i . k_j for NQ query rows (fp32, stride hd) and NK consecutive key rows (bf16,
// stride hd): one accumulator per pair, summed over d in order, so a pair's sum does not depend on
// the tile it falls in (NQ x NK = 8 sums in flight hide the FMA latency; the keys are widened once
// for all NQ queries).
template <int NQ, int NK>
static inline void qk_tile(const float* q, const uint16_t* k, float* s, int64_t hd, int64_t T) {
    __m256 acc[NQ][NK];
    for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < NK; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
        __m256 kv[NK];
        for (int j = 0; j < NK; ++j) kv[j] = load_bf16x8(k + j * hd + d);
        for (int i = 0; i < NQ; ++i) {
            const __m256 qv = _mm256_loadu_ps(q + i * hd + d);
            for (int j = 0; j < NK; ++j) acc[i][j] = _mm256_fmadd_ps(qv, kv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < NK; ++j) s[i * T + j] = hsum(acc[i][j]);
}

template <int NQ>
static inline void qk_rows(const float* q, const uint16_t* k, float* s, int64_t hd, int64_t T) {
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) qk_tile<NQ, 2>(q, k + t * hd, s + t, hd, T);
    if (t < T) qk_tile<NQ, 1>(q, k + t * hd, s + t, hd, T);
}

// a[i * hd + d0 .. d0 + 8 DC] = sum_t p[i * T + t] v[t, d0 .. d0 + 8 DC] for NQ rows of probabilities,
// summed over t in order (each lane's sum as a loop over keys would give it); DC x NQ sums in flight.
template <int NQ, int DC>
static inline void pv_tile(const float* p, const uint16_t* v, float* a, int64_t hd, int64_t T, int64_t d0) {
    __m256 acc[NQ][DC];
    for (int i = 0; i < NQ; ++i)
        for (int c = 0; c < DC; ++c) acc[i][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < T; ++t) {
        __m256 vv[DC];
        for (int c = 0; c < DC; ++c) vv[c] = load_bf16x8(v + t * hd + d0 + 8 * c);
        for (int i = 0; i < NQ; ++i) {
            const __m256 pi = _mm256_broadcast_ss(p + i * T + t);
            for (int c = 0; c < DC; ++c) acc[i][c] = _mm256_fmadd_ps(pi, vv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < NQ; ++i)
        for (int c = 0; c < DC; ++c) _mm256_storeu_ps(a + i * hd + d0 + 8 * c, acc[i][c]);
}

template <int DC>
static void pv_rows(const float* p, const uint16_t* v, float* a, int64_t hd, int64_t T, int64_t d0, int64_t Q) {
    int64_t i = 0;
    for (; i + 4 <= Q; i += 4) pv_tile<4, DC>(p + i * T, v, a + i * hd, hd, T, d0);
    switch (Q - i) {
        case 3: pv_tile<3, DC>(p + i * T, v, a + i * hd, hd, T, d0); break;
        case 2: pv_tile<2, DC>(p + i * T, v, a + i * hd, hd, T, d0); break;
        case 1: pv_tile<1, DC>(p + i * T, v, a + i * hd, hd, T, d0); break;
    }
}

// Attention of the n new tokens of each of B rows over the T = L + n entries of their cache rows.
// q: bf16 [B * n, Hq * hd]; kbuf / vbuf: bf16 [B, Hkv, cap, hd] (entries 0 .. T); mask: fp32 [B, n, T]
// additive. Returns bf16 [B * n, Hq * hd]. fp32 sums, softmax over the whole row, one rounding.
// The queries that share a KV head (Hq / Hkv heads x n tokens) walk its keys and values together in
// register tiles (4 queries x 2 keys for q.k, 4 queries x 16 lanes for p.v), split into as many tasks
// as there are threads; each query's sums run in an order that does not depend on its tile or task,
// so the result does not depend on the split. Session 28 (perf, 5-token Gemma 3 270M step at context
// 256): a query at a time per key was load- and store-bound, ~2 ms of the step.
static torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& kbuf, const torch::Tensor& vbuf,
                            const torch::Tensor& mask, int64_t n, int64_t T, int64_t Hq, int64_t Hkv,
                            int64_t hd, float scaling) {
    const int64_t B = kbuf.size(0), cap = kbuf.size(2), groups = Hq / Hkv, per_kv = groups * n;
    const int64_t heads = B * Hkv, threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t split = std::min<int64_t>(per_kv, (threads + heads - 1) / heads);
    const int64_t chunk = (per_kv + split - 1) / split;
    auto out = torch::empty_like(q);
    const uint16_t *qp = bits(q), *kp = bits(kbuf), *vp = bits(vbuf);
    uint16_t* op = wbits(out);
    const float* mp = mask.data_ptr<float>();
    at::parallel_for(0, heads * split, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> score(chunk * T), qf(chunk * hd), acc(chunk * hd), inv(chunk);
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / (Hkv * split), g = (task / split) % Hkv, c = task % split;
            const int64_t q0 = c * chunk, Q = std::min(per_kv, q0 + chunk) - q0;
            if (Q <= 0) continue;
            // query qi of this KV head (0 .. per_kv): token qi % n of query head head_of(qi)
            auto head_of = [&](int64_t qi) { return g * groups + qi / n; };
            for (int64_t i = 0; i < Q; ++i) {
                const int64_t h = head_of(q0 + i), j = (q0 + i) % n;
                const uint16_t* qr = qp + ((b * n + j) * Hq + h) * hd;
                for (int64_t d = 0; d < hd; ++d) qf[i * hd + d] = norm_widen(qr[d]);
            }
            const uint16_t* kb = kp + (b * Hkv + g) * cap * hd;
            const uint16_t* vb = vp + (b * Hkv + g) * cap * hd;
            int64_t i = 0;
            for (; i + 4 <= Q; i += 4) qk_rows<4>(qf.data() + i * hd, kb, score.data() + i * T, hd, T);
            switch (Q - i) {
                case 3: qk_rows<3>(qf.data() + i * hd, kb, score.data() + i * T, hd, T); break;
                case 2: qk_rows<2>(qf.data() + i * hd, kb, score.data() + i * T, hd, T); break;
                case 1: qk_rows<1>(qf.data() + i * hd, kb, score.data() + i * T, hd, T); break;
            }
            for (i = 0; i < Q; ++i) {
                const float* mrow = mp + (b * n + (q0 + i) % n) * T;
                float* si = score.data() + i * T;
                float mx = -INFINITY;
                for (int64_t t = 0; t < T; ++t) mx = std::max(mx, si[t] = si[t] * scaling + mrow[t]);
                inv[i] = 1.f / exp_shifted(si, T, mx);
            }
            int64_t d0 = 0;
            for (; d0 + 16 <= hd; d0 += 16) pv_rows<2>(score.data(), vb, acc.data(), hd, T, d0, Q);
            if (d0 < hd) pv_rows<1>(score.data(), vb, acc.data(), hd, T, d0, Q);
            for (i = 0; i < Q; ++i) {
                const int64_t h = head_of(q0 + i), j = (q0 + i) % n;
                uint16_t* orow = op + ((b * n + j) * Hq + h) * hd;
                for (int64_t d = 0; d < hd; ++d) orow[d] = norm_round(acc[i * hd + d] * inv[i]);
            }
        }
    });
    return out;
}

// The attention of both layers below, from their stacked projection qkv [M = B n, (Hq + 2 Hkv) hd]:
// q, k, v split off; q and k RMS-normed per head where scales are given (Gemma 3; the drafter has
// none); rotary on q and k; k and v written into the cache buffers at entries L .. L + n of each
// row; then `attend`. Checks the cache buffers and the mask both layers pass. Returns bf16 [M, Hq hd].
static torch::Tensor attention_block(const torch::Tensor& qkv, const torch::Tensor* q_scale,
                                     const torch::Tensor* k_scale, double eps, torch::Tensor& kbuf,
                                     torch::Tensor& vbuf, int64_t L, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& mask, int64_t n,
                                     int64_t Hq, int64_t Hkv, int64_t hd, double scaling) {
    TORCH_CHECK(hd % 8 == 0 && Hq % Hkv == 0, "head_dim a multiple of 8, query heads a multiple of KV heads");
    const int64_t M = qkv.size(0), B = M / n, T = L + n;
    TORCH_CHECK(kbuf.dtype() == torch::kBFloat16 && kbuf.is_contiguous() && vbuf.is_contiguous() &&
                kbuf.size(0) == B && kbuf.size(1) == Hkv && kbuf.size(2) >= T && kbuf.size(3) == hd,
                "kbuf / vbuf: contiguous bf16 [B, Hkv, >= L + n, hd]");
    TORCH_CHECK(mask.dtype() == torch::kFloat32 && mask.is_contiguous() && mask.numel() == B * n * T,
                "mask: contiguous fp32 [B, n, L + n]");
    auto q = qkv.narrow(1, 0, Hq * hd).contiguous();
    auto k = qkv.narrow(1, Hq * hd, Hkv * hd).contiguous();
    auto v = qkv.narrow(1, (Hq + Hkv) * hd, Hkv * hd).contiguous();
    if (q_scale) q = rms_norm(q.view({M * Hq, hd}), *q_scale, eps, false).view({M, Hq * hd});
    if (k_scale) k = rms_norm(k.view({M * Hkv, hd}), *k_scale, eps, false).view({M, Hkv * hd});
    auto cs = cos.reshape({M, hd}).contiguous(), sn = sin.reshape({M, hd}).contiguous();
    rope_inplace(q, cs, sn, Hq, hd);
    rope_inplace(k, cs, sn, Hkv, hd);
    const int64_t cap = kbuf.size(2);
    uint16_t *kd = wbits(kbuf), *vd = wbits(vbuf);
    const uint16_t *ks = bits(k), *vs = bits(v);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t b = m / n, j = m % n, at = ((b * Hkv + g) * cap + L + j) * hd;
            std::memcpy(kd + at, ks + (m * Hkv + g) * hd, hd * 2);
            std::memcpy(vd + at, vs + (m * Hkv + g) * hd, hd * 2);
        }
    return attend(q, kbuf, vbuf, mask, n, T, Hq, Hkv, hd, float(scaling));
}

// One Gemma 3 decoder layer for n new tokens of B rows: h bf16 [B, n, D] -> bf16 [B, n, D]. Writes the
// new keys / values into kbuf / vbuf [B, Hkv, cap, hd] at entries L .. L + n. w: the q, k and v weights
// stacked ([(Hq + 2 Hkv) hd, D]: one pass over them), o, the gate and up weights stacked ([2 I, D]),
// down (bf16 [O, K]); s: fp32 scales (1 + weight) of the input, q, k, post-attention, pre-feedforward
// and post-feedforward norms; cos / sin: bf16 [B, n, hd]; mask: fp32 [B, n, L + n].
torch::Tensor gemma3_layer(torch::Tensor h, std::vector<torch::Tensor> w, std::vector<torch::Tensor> s,
                           torch::Tensor kbuf, torch::Tensor vbuf, int64_t L, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor mask, int64_t Hq, int64_t Hkv, int64_t hd,
                           double eps, double scaling, int64_t chunk) {
    TORCH_CHECK(h.dtype() == torch::kBFloat16 && h.dim() == 3 && h.is_contiguous(), "h: contiguous bf16 [B, n, D]");
    TORCH_CHECK(w.size() == 4 && s.size() == 6, "4 weights (qkv, o, gate-up, down) and 6 norm scales");
    const int64_t n = h.size(1), D = h.size(2), M = h.size(0) * n;
    auto h2 = h.view({M, D});
    auto x = rms_norm(h2, s[0], eps, false);
    auto qkv = layer_linear(x, w[0], chunk);  // [M, (Hq + 2 Hkv) hd]
    auto att = attention_block(qkv, &s[1], &s[2], eps, kbuf, vbuf, L, cos, sin, mask, n, Hq, Hkv, hd, scaling);
    auto o = rms_norm(layer_linear(att, w[1], chunk), s[3], eps, false);
    auto h1 = add_bf16(h2, o);
    auto x2 = rms_norm(h1, s[4], eps, false);
    auto gu = layer_linear(x2, w[2], chunk);  // [M, 2 I]: gate | up
    const int64_t I = gu.size(1) / 2;
    auto act = torch::empty({M, I}, h.options());
    uint16_t* ap = wbits(act);
    const uint16_t* gup = bits(gu);
    for (int64_t m = 0; m < M; ++m) gelu_gate(gup + m * 2 * I, gup + m * 2 * I + I, ap + m * I, I);
    auto f = rms_norm(layer_linear(act, w[3], chunk), s[5], eps, false);
    return add_bf16(h1, f).view(h.sizes());
}

// One EAGLE-3 drafter layer (the Llama layout EAGLE-3 drafters use: RMS norms rounding x r to bf16
// before the weight, no q / k norm, rotate-half rotary, SiLU-gated MLP) for n new tokens of B rows:
// token embeddings e and features f, bf16 [B, n, H] -> the layer's output bf16 [B, n, H]. The
// attention input is [norm(e) | norm(f)] (2H wide), the residual is f. w: q, k and v stacked
// ([(Hq + 2 Hkv) hd, 2H]), o, gate and up stacked ([2 I, H]), down; s: fp32 weights of the
// embedding, feature and post-attention norms; q: empty, or the 7-bit weights of the four (u, s for
// each: 8 tensors) for steps of at most kQ7Rows rows. Cache and mask as `gemma3_layer`.
// Projection i of the drafter's layer: through the 7-bit kernel where q holds its weights (u, s per
// projection, cpu_linear_src.Q7_SOURCE) and the rows fit it; else the bf16 weights (the dequantized
// ones when q is set) through the backend's layer_linear.
static torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                             const std::vector<torch::Tensor>& q, size_t i, int64_t chunk) {
    if (!q.empty() && x.numel() <= kQ7Rows * w[i].size(1)) return q7_linear_bf16(x, q[2 * i], q[2 * i + 1]);
    return layer_linear(x, w[i], chunk);
}

torch::Tensor eagle3_layer(torch::Tensor e, torch::Tensor f, std::vector<torch::Tensor> w, std::vector<torch::Tensor> q,
                           std::vector<torch::Tensor> s,
                           torch::Tensor kbuf, torch::Tensor vbuf, int64_t L, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor mask, int64_t Hq, int64_t Hkv, int64_t hd,
                           double eps, double scaling, int64_t chunk) {
    TORCH_CHECK(e.dtype() == torch::kBFloat16 && f.dtype() == torch::kBFloat16 && e.dim() == 3 && e.is_contiguous() &&
                f.is_contiguous() && f.sizes() == e.sizes(), "e, f: contiguous bf16 [B, n, H] of one shape");
    TORCH_CHECK(w.size() == 4 && s.size() == 3, "4 weights (qkv, o, gate-up, down) and 3 norm weights");
    TORCH_CHECK(q.empty() || q.size() == 8, "q: empty or (u, s) for each of the 4 weights");
    const int64_t n = e.size(1), H = e.size(2), M = e.size(0) * n;
    auto f2 = f.view({M, H});
    auto x = torch::cat({rms_norm(e.view({M, H}), s[0], eps, true), rms_norm(f2, s[1], eps, true)}, 1);  // [M, 2H]
    auto qkv = project(x, w, q, 0, chunk);
    auto att = attention_block(qkv, nullptr, nullptr, eps, kbuf, vbuf, L, cos, sin, mask, n, Hq, Hkv, hd, scaling);
    auto h1 = add_bf16(f2, project(att, w, q, 1, chunk));
    auto gu = project(rms_norm(h1, s[2], eps, true), w, q, 2, chunk);  // [M, 2 I]: gate | up
    const int64_t I = gu.size(1) / 2;
    auto act = torch::empty({M, I}, e.options());
    uint16_t* ap = wbits(act);
    const uint16_t* gup = bits(gu);
    for (int64_t m = 0; m < M; ++m) silu_gate(gup + m * 2 * I, gup + m * 2 * I + I, ap + m * I, I);
    return add_bf16(h1, project(act, w, q, 3, chunk)).view(e.sizes());
}

// the attention's exp and sum of one fp32 score row, as `exp_shifted` computes them (for the tests)
std::tuple<torch::Tensor, double> softmax_exp(torch::Tensor s, double mx) {
    auto e = s.to(torch::kFloat32).contiguous().clone();
    const float total = exp_shifted(e.data_ptr<float>(), e.numel(), float(mx));
    return std::make_tuple(e, double(total));
}
"""

#: the bound functions' declarations and `m.def` lines (in the backend's bindings unit)
LAYER_DECLS = r"""
torch::Tensor gemma3_layer(torch::Tensor h, std::vector<torch::Tensor> w, std::vector<torch::Tensor> s,
                           torch::Tensor kbuf, torch::Tensor vbuf, int64_t L, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor mask, int64_t Hq, int64_t Hkv, int64_t hd, double eps, double scaling,
                           int64_t chunk);
torch::Tensor eagle3_layer(torch::Tensor e, torch::Tensor f, std::vector<torch::Tensor> w, std::vector<torch::Tensor> q,
                           std::vector<torch::Tensor> s, torch::Tensor kbuf, torch::Tensor vbuf, int64_t L,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor mask, int64_t Hq, int64_t Hkv,
                           int64_t hd, double eps, double scaling, int64_t chunk);
std::tuple<torch::Tensor, double> softmax_exp(torch::Tensor s, double mx);
"""
LAYER_BINDINGS = r"""
    m.def("gemma3_layer", &gemma3_layer, "one Gemma 3 decoder layer for a decode step (bf16)");
    m.def("eagle3_layer", &eagle3_layer, "one EAGLE-3 drafter layer for a draft step (bf16)");
    m.def("softmax_exp", &softmax_exp,
          "exp(s - mx) of fp32 scores s [T] and their sum, as the fused attention computes them");
"""

