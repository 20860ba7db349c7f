"""Sampled (T > 0) chain verification in one C++ call on x86 CPUs with AVX2: the CPU's fused kernel.

Why: at T = 1 on the 2-core CPU, `verify_tree` cost ~1.8 ms of a ~28 ms speculative step with a
3-draft EAGLE chain (cProfile, session 29): a bf16 -> fp32 copy of the [n, 262144] logits, a full
softmax of every row, the finiteness checks, gathers, the residual and a two-level inverse-CDF
draw, each a separate pass over Gemma 3's vocabulary with PyTorch's per-op overhead around it.
Speculation pays that on every step while target-only decoding (one row) pays a third of it, so
it came straight off the speedup. Here one C++ function reads each row's logits where they lie
(bf16 or fp32): one pass per row for the max (and the NaN / inf check), one for the softmax sum
of each row the walk actually reaches (a chain stops at its first rejection), one to write the
emitted row's residual, and the draw.

What it computes is `verify.verify_sampled_chain`'s rule (its reference), for chains and the
temperature alone (no top-k / top-p / typical: those keep the reference), with the keyed
inverse-CDF draw of the emitted token (one float64 uniform per row; a generator's exponential race
keeps the reference):

  p_k      = softmax(logits_k / T)                       fp32; exp is SLEEF's, PyTorch's own
  accept   = q_k(x) > 0 and u_k * q_k(x) < p_k(x)        float64 test (one-hot q: q(x) = 1)
  emitted  = inverse CDF of max(p_k - q_k, 0) at the first rejection k (one-hot q: p_k with x
             zeroed; an empty residual falls back to p_k), or of p at the last node

The same law as the reference; the bits differ only where the two softmaxes' summation orders
round a float differently, which moves a draw only when its uniform falls within that rounding of
a boundary (tests compare the two on random cases).

Deliberately not here: trees with siblings (the residual of one sibling feeds the next; the
reference walks them), non-x86 CPUs (the reference), GPUs (Triton: kernels/rejection.py).
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import Tensor

from drafttrain.decode.sampling import check_logits

__all__ = ["available", "load", "sampled_chain"]

SOURCE = r"""
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

// PyTorch's own vectorised exp (SLEEF, exported by libtorch_cpu; weak: scalar std::exp without it)
extern "C" __m256 Sleef_expf8_u10avx2(__m256) __attribute__((weak));

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) {
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

constexpr int64_t BLOCK = 1024;  // the inverse-CDF draw's first-level block (sampling.inverse_cdf's)
constexpr int64_t CHUNKS = 16;   // a row's fixed split across threads: sums do not depend on the thread count

// max of x / T over [lo, hi); sets *nan when a NaN is met
template <typename T>
static float range_max(const T* x, int64_t lo, int64_t hi, float temp, bool* nan) {
    const bool scale = temp != 1.0f;
    const __m256 t8 = _mm256_set1_ps(temp);
    __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 bad = _mm256_setzero_ps();
    int64_t v = lo;
    for (; v + 8 <= hi; v += 8) {
        __m256 a = load8(x + v);
        if (scale) a = _mm256_div_ps(a, t8);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, a);
    }
    float mx = hmax8(m);
    bool n = _mm256_movemask_ps(bad) != 0;
    for (; v < hi; ++v) {
        const float a = scale ? load1(x + v) / temp : load1(x + v);
        n |= std::isnan(a);
        mx = a > mx ? a : mx;
    }
    if (n) *nan = true;
    return mx;
}

// false when q[lo, hi) holds a NaN, an inf or a negative entry
template <typename Q>
static bool range_probs_ok(const Q* q, int64_t lo, int64_t hi) {
    const __m256 zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256 bad = _mm256_setzero_ps();
    int64_t v = lo;
    for (; v + 8 <= hi; v += 8) {
        const __m256 a = load8(q + v);  // NaN fails both ordered compares below
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, zero, _CMP_NGE_UQ));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
    }
    bool ok = _mm256_movemask_ps(bad) == 0;
    for (; v < hi; ++v) {
        const float a = load1(q + v);
        ok &= a >= 0.0f && a < std::numeric_limits<float>::infinity();
    }
    return ok;
}

// e[v] = exp(x[v] / T - m) for v in [lo, hi) (a whole number of blocks but the row's last);
// the fp32 sum of each block into bsum
template <typename T>
static void range_exp(const T* x, int64_t lo, int64_t hi, float temp, float m, float* e, float* bsum) {
    const bool scale = temp != 1.0f;
    const __m256 t8 = _mm256_set1_ps(temp), m8 = _mm256_set1_ps(m);
    for (int64_t b0 = lo; b0 < hi; b0 += BLOCK) {
        const int64_t b1 = std::min(hi, b0 + BLOCK);
        __m256 s = _mm256_setzero_ps();
        int64_t v = b0;
        for (; Sleef_expf8_u10avx2 && v + 8 <= b1; v += 8) {
            __m256 a = load8(x + v);
            if (scale) a = _mm256_div_ps(a, t8);
            const __m256 ev = Sleef_expf8_u10avx2(_mm256_sub_ps(a, m8));
            _mm256_storeu_ps(e + v, ev);
            s = _mm256_add_ps(s, ev);
        }
        float sum = hsum8(s);
        for (; v < b1; ++v) {
            const float a = scale ? load1(x + v) / temp : load1(x + v);
            e[v] = std::exp(a - m);
            sum += e[v];
        }
        bsum[b0 / BLOCK] = sum;
    }
}

// e[v] <- max(e[v] * inv - q[v], 0) over [lo, hi) (q null: e[v] * inv, with e[skip] = 0), block sums into bsum
template <typename Q>
static void range_residual(float* e, const Q* q, int64_t skip, int64_t lo, int64_t hi, float inv, float* bsum) {
    const __m256 i8 = _mm256_set1_ps(inv), zero = _mm256_setzero_ps();
    for (int64_t b0 = lo; b0 < hi; b0 += BLOCK) {
        const int64_t b1 = std::min(hi, b0 + BLOCK);
        __m256 s = zero;
        int64_t v = b0;
        for (; v + 8 <= b1; v += 8) {
            __m256 r = _mm256_mul_ps(_mm256_loadu_ps(e + v), i8);
            if (q) r = _mm256_max_ps(_mm256_sub_ps(r, load8(q + v)), zero);
            _mm256_storeu_ps(e + v, r);
            s = _mm256_add_ps(s, r);
        }
        float sum = hsum8(s);
        for (; v < b1; ++v) {
            float r = e[v] * inv;
            if (q) r = std::max(r - load1(q + v), 0.0f);
            e[v] = r;
            sum += r;
        }
        if (!q && skip >= b0 && skip < b1) {  // one-hot q: p with the rejected draft zeroed
            sum -= e[skip];
            e[skip] = 0.0f;
        }
        bsum[b0 / BLOCK] = sum;
    }
}

// index drawn from w[0..V) with weights w[v] * scale (non-negative, not all zero), given its block
// sums, by inverting the float64 CDF at u: the blocks' float64 running sum picks the block, the
// float64 running sum inside it the index; never an index of zero weight (a target rounded past the
// end takes the last positive block / index), as sampling.inverse_cdf does
static int64_t inverse_cdf(const float* w, float scale, int64_t V, const float* bsum, double u, std::vector<double>& csum) {
    const int64_t nb = (V + BLOCK - 1) / BLOCK;
    csum.resize(nb);
    double run = 0.0;
    for (int64_t b = 0; b < nb; ++b) csum[b] = run += static_cast<double>(bsum[b] * scale);
    const double target = u * csum[nb - 1];
    int64_t bi = std::upper_bound(csum.begin(), csum.end(), target) - csum.begin();
    if (bi >= nb) {
        bi = nb - 1;
        while (bi > 0 && !(bsum[bi] > 0)) --bi;
    }
    double acc = bi > 0 ? csum[bi - 1] : 0.0;
    const int64_t lo = bi * BLOCK, hi = std::min(V, lo + BLOCK);
    int64_t last = -1;
    for (int64_t v = lo; v < hi; ++v) {
        const float wv = w[v] * scale;
        if (wv > 0) last = v;
        acc += static_cast<double>(wv);
        if (acc > target) return v;
    }
    return last >= 0 ? last : lo;
}

// one row of the batch: (accepted drafts, emitted token); (-1, 0) on bad logits, (-2, 0) on bad q.
// `threads`: split each vocabulary pass across threads (batch 1) or not (rows already in parallel).
template <typename T, typename Q>
static std::pair<int64_t, int64_t> verify_row(const T* lg, int64_t K, int64_t V, const int64_t* x, const Q* q,
                                              int64_t q_rows, const int64_t* ids, int64_t Vq, float temp,
                                              const double* ua, double ue, bool threads) {
    const int64_t nb = (V + BLOCK - 1) / BLOCK, per = (nb + CHUNKS - 1) / CHUNKS, nch = (nb + per - 1) / per;
    auto chunk_lo = [&](int64_t c) { return std::min(V, c * per * BLOCK); };
    auto each = [&](int64_t n, const std::function<void(int64_t)>& f) {
        if (threads && n > 1) at::parallel_for(0, n, 1, [&](int64_t a, int64_t b) { for (int64_t i = a; i < b; ++i) f(i); });
        else for (int64_t i = 0; i < n; ++i) f(i);
    };
    for (int64_t k = 0; k + 1 < K; ++k)  // never read outside a row, whatever the caller checked
        if (x[k] < 0 || x[k] >= V) return {-3, 0};
    // pass 1, every node: the max of each row (NaN / inf check), and q's rows checked
    std::vector<float> cmax(K * nch);
    std::vector<char> cnan(K * nch, 0), qbad(K * nch, 0);
    const int64_t qk = q ? std::min(K - 1, q_rows) : 0;
    each(K * nch, [&](int64_t i) {
        const int64_t k = i / nch, c = i % nch, lo = chunk_lo(c), hi = chunk_lo(c + 1);
        bool nan = false;
        cmax[i] = range_max(lg + k * V, lo, hi, temp, &nan);
        cnan[i] = nan;
        if (k < qk && !ids) qbad[i] = !range_probs_ok(q + k * V, lo, hi);
    });
    for (int64_t k = 0; ids && k < qk; ++k)  // a reduced vocabulary's rows: short, checked here
        if (!range_probs_ok(q + k * Vq, 0, Vq)) qbad[k * nch] = 1;
    std::vector<float> m(K, -std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < K * nch; ++i) {
        if (cnan[i]) return {-1, 0};
        if (qbad[i]) return {-2, 0};
        m[i / nch] = std::max(m[i / nch], cmax[i]);
    }
    for (int64_t k = 0; k < K; ++k)
        if (!std::isfinite(m[k])) return {-1, 0};  // +inf, or every entry -inf
    thread_local std::vector<float> e, bsum;
    thread_local std::vector<double> csum;
    if (static_cast<int64_t>(e.size()) < V) e.resize(V);
    if (static_cast<int64_t>(bsum.size()) < nb) bsum.resize(nb);
    float* ep = e.data();
    float* bs = bsum.data();
    for (int64_t k = 0; k < K; ++k) {
        const T* row = lg + k * V;
        each(nch, [&](int64_t c) { range_exp(row, chunk_lo(c), chunk_lo(c + 1), temp, m[k], ep, bs); });
        float s = 0.0f;
        for (int64_t b = 0; b < nb; ++b) s += bs[b];
        const float inv = 1.0f / s;
        if (k == K - 1)  // every draft accepted: the bonus token from p
            return {k, inverse_cdf(ep, inv, V, bs, ue, csum)};
        const int64_t xv = x[k];
        const double px = static_cast<double>(ep[xv] * inv);
        const Q* qr = q ? q + k * Vq : nullptr;
        double qx = q ? 0.0 : 1.0;
        if (q && !ids) qx = static_cast<double>(load1(qr + xv));
        for (int64_t j = 0; q && ids && j < Vq; ++j)  // q's column of x in a reduced vocabulary (none: 0)
            if (ids[j] == xv) { qx = static_cast<double>(load1(qr + j)); break; }
        if (qx > 0 && ua[k] * qx < px) continue;
        // first rejection: the residual max(p - q, 0) (one-hot q: p with x zeroed)
        if (ids) {  // p, then q subtracted at its ids, then the block sums again
            each(nch, [&](int64_t c) { range_residual<Q>(ep, nullptr, -1, chunk_lo(c), chunk_lo(c + 1), inv, bs); });
            for (int64_t j = 0; j < Vq; ++j) {
                const float r = ep[ids[j]] - load1(qr + j);
                ep[ids[j]] = r > 0.0f ? r : 0.0f;
            }
            each(nch, [&](int64_t c) { range_residual<Q>(ep, nullptr, -1, chunk_lo(c), chunk_lo(c + 1), 1.0f, bs); });
        } else {
            each(nch, [&](int64_t c) { range_residual(ep, qr, xv, chunk_lo(c), chunk_lo(c + 1), inv, bs); });
        }
        bool any = false;
        for (int64_t b = 0; b < nb; ++b) any |= bs[b] > 0;
        if (!any) {  // p == q up to rounding: no mass left, draw from p
            each(nch, [&](int64_t c) { range_exp(row, chunk_lo(c), chunk_lo(c + 1), temp, m[k], ep, bs); });
            return {k, inverse_cdf(ep, inv, V, bs, ue, csum)};
        }
        return {k, inverse_cdf(ep, 1.0f, V, bs, ue, csum)};
    }
    return {-1, 0};  // unreachable: K >= 1
}

template <typename T, typename Q>
static void run_rows(const torch::Tensor& logits, const torch::Tensor& drafts, const torch::Tensor& q, bool has_q,
                     const torch::Tensor& ids, double temperature, const torch::Tensor& ua, const torch::Tensor& ue,
                     int64_t* n_acc, int64_t* tok) {
    const int64_t B = logits.size(0), K = logits.size(1), V = logits.size(2);
    const T* lg = reinterpret_cast<const T*>(logits.data_ptr());
    const Q* qp = has_q ? reinterpret_cast<const Q*>(q.data_ptr()) : nullptr;
    const int64_t q_rows = has_q ? q.size(1) : 0, Vq = has_q ? q.size(2) : 0;
    const int64_t* idp = ids.numel() ? ids.data_ptr<int64_t>() : nullptr;
    const int64_t* x = drafts.data_ptr<int64_t>();
    const double* u = ua.data_ptr<double>();
    const double* e = ue.data_ptr<double>();
    auto row = [&](int64_t b, bool threads) {
        auto r = verify_row<T, Q>(lg + b * K * V, K, V, x + b * (K - 1), has_q ? qp + b * q_rows * Vq : nullptr, q_rows,
                                  idp, Vq, static_cast<float>(temperature), u + b * (K - 1), e[b], threads);
        n_acc[b] = r.first;
        tok[b] = r.second;
    };
    if (B == 1) row(0, true);  // batch 1: the threads split each vocabulary pass
    else at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) { for (int64_t b = b0; b < b1; ++b) row(b, false); });
}

// logits [B, K, V] fp32 or bf16; drafts [B, K-1] int64 (the draft tested at node k is drafts[:, k]);
// q [B, >= K-1, V] fp32 / bf16 processed draft probabilities, or an empty tensor (deterministic
// drafts: one-hot q); ids [V'] int64: the target ids of q's columns when q covers a reduced draft
// vocabulary (q [B, >= K-1, V']; zero elsewhere), or an empty tensor; u_accept [B, K-1] float64;
// u_emit [B] float64.
// Returns [2, B] int64: accepted drafts per row (-1: that row's logits hold NaN / +inf or a fully
// masked row; -2: q holds a NaN, an inf or a negative entry; -3: a draft outside [0, V); the caller
// raises) and the emitted token.
torch::Tensor sampled_chain(torch::Tensor logits, torch::Tensor drafts, torch::Tensor q, torch::Tensor ids,
                            double temperature, torch::Tensor u_accept, torch::Tensor u_emit) {
    TORCH_CHECK(logits.dim() == 3 && logits.is_contiguous(), "logits must be a contiguous [B, K, V] tensor");
    const int64_t B = logits.size(0), K = logits.size(1), V = logits.size(2);
    TORCH_CHECK(K >= 1 && V >= 1, "empty logits");
    TORCH_CHECK(drafts.scalar_type() == torch::kLong && drafts.is_contiguous() && drafts.numel() == B * (K - 1), "drafts must be contiguous int64 [B, K-1]");
    TORCH_CHECK(u_accept.scalar_type() == torch::kDouble && u_accept.is_contiguous() && u_accept.numel() == B * (K - 1), "u_accept must be float64 [B, K-1]");
    TORCH_CHECK(u_emit.scalar_type() == torch::kDouble && u_emit.is_contiguous() && u_emit.numel() == B, "u_emit must be float64 [B]");
    const bool has_q = q.numel() > 0;
    const bool sparse = ids.numel() > 0;
    if (has_q)
        TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(0) == B && q.size(1) >= K - 1
                    && q.size(2) == (sparse ? ids.numel() : V), "q must be a contiguous [B, >= K-1, V or V'] tensor");
    if (sparse) {
        TORCH_CHECK(has_q && ids.scalar_type() == torch::kLong && ids.is_contiguous() && ids.dim() == 1, "ids must be contiguous int64 [V']");
        const int64_t* ip = ids.data_ptr<int64_t>();
        for (int64_t j = 0; j < ids.numel(); ++j) TORCH_CHECK(ip[j] >= 0 && ip[j] < V, "ids must lie in [0, V)");
    }
    auto out = torch::empty({2, B}, torch::kLong);
    int64_t* n = out.data_ptr<int64_t>();
    int64_t* t = n + B;
    const bool lf = logits.scalar_type() == torch::kFloat, qf = !has_q || q.scalar_type() == torch::kFloat;
    TORCH_CHECK(lf || logits.scalar_type() == torch::kBFloat16, "logits must be float32 or bfloat16");
    TORCH_CHECK(qf || q.scalar_type() == torch::kBFloat16, "q must be float32 or bfloat16");
    if (lf && qf) run_rows<float, float>(logits, drafts, q, has_q, ids, temperature, u_accept, u_emit, n, t);
    else if (lf) run_rows<float, uint16_t>(logits, drafts, q, has_q, ids, temperature, u_accept, u_emit, n, t);
    else if (qf) run_rows<uint16_t, float>(logits, drafts, q, has_q, ids, temperature, u_accept, u_emit, n, t);
    else run_rows<uint16_t, uint16_t>(logits, drafts, q, has_q, ids, temperature, u_accept, u_emit, n, t);
    return out;
}
"""

#: the bindings unit's declaration and `m.def` line (`build.load_kernels` compiles it apart)
BINDINGS = ("""
torch::Tensor sampled_chain(torch::Tensor logits, torch::Tensor drafts, torch::Tensor q, torch::Tensor ids,
                            double temperature, torch::Tensor u_accept, torch::Tensor u_emit);
""", """    m.def("sampled_chain", &sampled_chain, "sampled chain verification (drafttrain.decode.kernels.cpu_verify)");
""")

_lock = threading.Lock()
_ext = None
_NAME = "drafttrain_cpu_verify"


@functools.cache
def available() -> bool:
    """Whether this CPU runs the kernel: AVX2 + FMA (x86) and a C++ compiler (asked once)."""
    from drafttrain.decode.kernels import cpu_linear

    return cpu_linear.available("avx2")


def load():
    """The compiled extension (built on first use, cached in torch's extensions folder)."""
    global _ext
    with _lock:
        if _ext is None:
            from drafttrain.decode.kernels.build import load_kernels

            _ext = load_kernels(_NAME, SOURCE, *BINDINGS, ["-mavx2", "-mfma"])
        return _ext


def sampled_chain(logits: Tensor, drafts: Tensor, draft_probs: Tensor | None, temperature: float,
                  u_accept: Tensor, u_emit: Tensor, draft_vocab: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Runs the kernel on CPU tensors.

    Args:
        logits: [B, K, V] target logits (fp32 or bf16) at the chain's K nodes.
        drafts: [B, K-1] long, the draft tested at node k (node k+1's token).
        draft_probs: [B, >= K-1, V] processed draft probabilities (fp32 or bf16), or None.
        temperature: > 0.
        u_accept: [B, K-1] float64 uniforms of the accept tests.
        u_emit: [B] float64 uniforms of the emitted tokens' inverse-CDF draws.
        draft_vocab: [V'] long, the target ids of draft_probs' columns when it covers a reduced
            draft vocabulary ([B, >= K-1, V'], zero outside it), or None (draft_probs over V).

    Returns:
        ([B] accepted drafts, [B] emitted token).

    Raises:
        ValueError: logits with a NaN, a +inf or a row of -inf only; draft probabilities with a
            NaN, an inf or a negative entry in a row that tests a draft; a draft token outside
            [0, V) (checked even when the caller's checks are off).
    """
    q = draft_probs.contiguous() if draft_probs is not None else logits.new_empty(0)
    if q.dtype not in (torch.float32, torch.bfloat16):
        q = q.float()
    lg = logits if logits.dtype in (torch.float32, torch.bfloat16) else logits.float()
    ids = draft_vocab.long().contiguous() if draft_vocab is not None and draft_probs is not None else q.new_empty(0, dtype=torch.long)
    out = load().sampled_chain(lg.contiguous(), drafts.long().contiguous(), q, ids, float(temperature),
                               u_accept.double().contiguous(), u_emit.double().reshape(-1).contiguous())
    worst = int(out[0].min())
    if worst == -3:
        raise ValueError(f"draft tokens must lie in [0, {logits.shape[-1]})")
    if worst == -2:
        raise ValueError("draft_probs must be finite and non-negative (processed probabilities)")
    if worst == -1:
        check_logits(logits, "target_logits")  # says which; the kernel saw NaN / +inf / a masked row
        raise ValueError("target_logits contain NaN or +inf value(s); the target or drafter diverged")
    return out[0], out[1]
