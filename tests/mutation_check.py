"""Mutation check: plant small, meaningful bugs in a scratch copy and prove the suite catches each.

A test suite is only worth what it fails on. Each mutant below is a one-line bug a person could
plausibly write (a dropped step weight, T^2 instead of T, a residual without its mass factor, a
resume that replays the epoch from the start, one random stream shared by every row...), with
the tests that must catch it. For every mutant the script copies the working tree to a temporary
folder, applies the edit there (never to your checkout), runs the listed tests against the copy
and reports KILLED (a test failed: good) or SURVIVED (every test passed: the suite is blind to
that bug). It first runs all listed tests on the unmutated copy, which must pass.

    python tests/mutation_check.py              # every mutant, two at a time, ~8 min on a 2-core CPU
    python tests/mutation_check.py --list       # names only
    python tests/mutation_check.py eagle3-step-weight temperature-squared

Exit code 0 when every mutant is killed; 1 when one survives or cannot be applied (its `find`
text is gone: the code moved, update the mutant). `.ci/run` runs it after pytest.

How the copy is imported: the package is installed editable from your checkout, so the copy is
put first on PYTHONPATH, with decode/ and eval/ linked inside its drafttrain/ as pyproject.toml
maps them; a check before the baseline run makes sure the copy, not the checkout, is imported.

Not a pytest module (its name does not start with test_): it runs pytest itself, many times.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """One planted bug: replace `find` (which must occur exactly once) by `replace` in `file`."""

    name: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    why: str = ""
    #: pytest `-k` expression narrowing `tests` (a kernel source both CPU backends compile: test one, build one)
    only: str = ""


MUTANTS: list[Mutant] = [
    # ---- losses: values checked against hand computations ---------------------------------------
    Mutant('eagle3-no-step-weight', 'drafttrain/losses.py',
           'total = total + (step_weight**k) * loss_k',
           'total = total + loss_k',
           ('tests/train/test_loss_values.py',), 'EAGLE-3 steps weighted 0.8^k'),
    Mutant('eagle3-step-weight-k-plus-1', 'drafttrain/losses.py',
           '(step_weight**k) * loss_k',
           '(step_weight**(k + 1)) * loss_k',
           ('tests/train/test_loss_values.py',), 'the first unroll step has weight 1'),
    Mutant('eagle3-loss-mask-shift', 'drafttrain/losses.py',
           '_shift(loss_mask, 2 + k, False)',
           '_shift(loss_mask, 1 + k, False)',
           ('tests/train/test_loss_values.py',), 'step k predicts x_{t+2+k}: its mask shifts with it'),
    Mutant('eagle3-ignore-loss-mask', 'drafttrain/losses.py',
           'valid = _shift(attn, 1 + k, False) & _shift(loss_mask, 2 + k, False) & ',
           'valid = _shift(attn, 1 + k, False) & ',
           ('tests/train/test_loss_values.py',), 'prompt tokens must not be trained on'),
    Mutant('eagle3-teacher-shift', 'drafttrain/losses.py',
           'p = _shift(t_probs, 1 + k, 0.0)',
           'p = _shift(t_probs, 2 + k, 0.0)',
           ('tests/train/test_loss_values.py',), 'teacher distribution one position off'),
    Mutant('eagle3-no-oov-mask', 'drafttrain/losses.py',
           'in_vocab = teacher_in_vocab(target, feats["final"], raw.t2d)  # [B, T]',
           'in_vocab = torch.ones_like(attn)',
           ('tests/train/test_loss_values.py',), 'positions whose target argmax is outside the draft vocab are masked'),
    Mutant('eagle3-oov-mask-shift', 'drafttrain/losses.py',
           '_shift(loss_mask, 2 + k, False) & _shift(in_vocab, 1 + k, False)',
           '_shift(loss_mask, 2 + k, False) & _shift(in_vocab, 2 + k, False)',
           ('tests/train/test_loss_values.py',), 'out-of-vocab mask one position off'),
    Mutant('eagle3-mean-over-all-positions', 'drafttrain/losses.py',
           'loss_k = (per_pos * trained).sum() / trained.sum().clamp(min=1)',
           'loss_k = (per_pos * trained).sum() / per_pos.numel()',
           ('tests/train/test_loss_values.py',), 'mean over valid positions, not padding'),
    Mutant('eagle3-acc-teacher-shift', 'drafttrain/losses.py',
           'hit = logits.argmax(-1) == _shift(t_top, 1 + k, -1)',
           'hit = logits.argmax(-1) == _shift(t_top, k, -1)',
           ('tests/train/test_loss_values.py',), 'reported accuracy against the wrong teacher position'),
    Mutant('eagle3-run-len-not-consecutive', 'drafttrain/losses.py',
           '            run_len += alive.long()\n    metrics["run_len_sum"] = int(run_len[first_valid].sum()) if',
           '            run_len += agree.long()\n    metrics["run_len_sum"] = int(run_len[first_valid].sum()) if',
           ('tests/train/test_loss_values.py',), 'simulated tau counts only consecutive agreements'),
    Mutant('eagle1-swap-weights', 'drafttrain/losses.py',
           'loss = (feature_weight * (reg * valid).sum() + ce_weight * (ce * valid).sum()) / n',
           'loss = (ce_weight * (reg * valid).sum() + feature_weight * (ce * valid).sum()) / n',
           ('tests/train/test_loss_values.py',), 'EAGLE-1: 1.0 feature SmoothL1 + 0.1 CE'),
    Mutant('eagle1-loss-mask-shift', 'drafttrain/losses.py',
           '_shift(loss_mask, 2, False)',
           '_shift(loss_mask, 1, False)',
           ('tests/train/test_loss_values.py',), 'EAGLE-1 mask one position off'),
    Mutant('eagle1-noisy-regression-target', 'drafttrain/losses.py',
           'target_feat = _shift(feat, 1, 0.0)',
           'target_feat = _shift(x, 1, 0.0)',
           ('tests/train/test_loss_values.py',), 'noise belongs on the input, not the regression target'),
    Mutant('eagle1-mse-not-smooth-l1', 'drafttrain/losses.py',
           'F.smooth_l1_loss(pred.float(), target_feat.float(), reduction="none")',
           'F.mse_loss(pred.float(), target_feat.float(), reduction="none")',
           ('tests/train/test_loss_values.py',), 'EAGLE-1 regresses features with SmoothL1'),
    Mutant('eagle1-noise-in-eval', 'drafttrain/losses.py',
           'if (noise > 0 and raw.training)',
           'if noise > 0',
           ('tests/train/test_loss_values.py',), 'held-out loss must be noise-free'),
    Mutant('medusa-no-step-weight', 'drafttrain/losses.py',
           'total = total + (step_weight**i) * (ce * valid).sum()',
           'total = total + (ce * valid).sum()',
           ('tests/train/test_loss_values.py',), 'Medusa heads weighted 0.8^i'),
    Mutant('medusa-head-offset', 'drafttrain/losses.py',
           'tok = _shift(input_ids, 2 + i, 0)',
           'tok = _shift(input_ids, 1 + i, 0)',
           ('tests/train/test_loss_values.py',), 'head i predicts token t+i+2'),
    Mutant('medusa-keep-oov-labels', 'drafttrain/losses.py',
           'valid = valid & t2d[tok]',
           'valid = valid',
           ('tests/train/test_loss_values.py',), 'labels outside the draft vocab are skipped'),
    Mutant('medusa2-drop-kl', 'drafttrain/losses.py',
           'loss = kl_weight * kl + heads_coefficient * head_loss',
           'loss = heads_coefficient * head_loss',
           ('tests/train/test_loss_values.py',), 'Medusa-2 keeps the backbone near the original with a KL term'),
    Mutant('medusa2-original-with-adapter', 'drafttrain/losses.py',
           'with torch.no_grad(), target.disable_adapter():',
           'with torch.no_grad():',
           ('tests/train/test_loss_values.py',), 'the KL reference is the original model, adapter off'),
    Mutant('kl-reverse-direction', 'drafttrain/losses.py',
           'kl = (logp_o.exp() * (logp_o - torch.log_softmax(a, -1))).sum(-1)',
           'kl = (torch.softmax(a, -1) * (torch.log_softmax(a, -1) - logp_o)).sum(-1)',
           ('tests/train/test_loss_values.py',), 'KL(original || adapted), not the reverse'),
    Mutant('kl-no-softcap', 'drafttrain/losses.py',
           'return cap * torch.tanh(logits / cap) if cap else logits',
           'return logits',
           ('tests/train/test_loss_values.py',), "Gemma's final logit soft cap"),
    # ---- sampling and verification ---------------------------------------------------------------
    Mutant('temperature-squared', 'decode/sampling.py',
           'x = x / temperature',
           'x = x / (temperature * temperature)',
           ('tests/decode/test_sampling_law.py',), 'logits divided by T^2 instead of T'),
    Mutant('temperature-x1.2', 'decode/sampling.py',
           'x = x / temperature',
           'x = x / (temperature * 1.2)',
           ('tests/decode/test_sampling_law.py',), 'a 20% temperature error'),
    Mutant('temperature-div1.2', 'decode/sampling.py',
           'x = x / temperature',
           'x = x / (temperature / 1.2)',
           ('tests/decode/test_sampling_law.py',), 'a 20% temperature error the other way'),
    Mutant('residual-no-mass-factor', 'decode/verify.py',
           'r_rej = (r - s[:, None].float() * q).clamp_min(0.0)',
           'r_rej = (r - q).clamp_min(0.0)',
           ('tests/decode/test_sampling_law.py',), 'tree siblings: the residual subtracts q scaled by the remaining mass'),
    Mutant('accept-test-no-mass', 'decode/verify.py',
           'ok = active & (q_x > 0) & (uniforms[:, c] * q_x * s < r_x)',
           'ok = active & (q_x > 0) & (uniforms[:, c] * q_x < r_x)',
           ('tests/decode/test_sampling_law.py',), 'sibling accept test against the renormalised residual'),
    Mutant('residual-is-p', 'decode/verify.py',
           'r_rej = (r - s[:, None].float() * q).clamp_min(0.0)',
           'r_rej = r.clone()',
           ('tests/decode/test_sampling_law.py',), 'after a rejection sample max(p - q, 0), not p'),
    Mutant('one-hot-residual-keeps-x', 'decode/verify.py',
           'r_rej = r.scatter(1, x[:, None], 0.0)',
           'r_rej = r.clone()',
           ('tests/decode/test_sampling_law.py',), 'a rejected deterministic draft is removed from the residual'),
    Mutant('top-p-boundary-strict', 'decode/sampling.py',
           'drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p',
           'drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p',
           ('tests/decode/test_sampling_law.py',), 'top-p keeps the smallest set reaching the mass'),
    Mutant('top-k-drops-ties', 'decode/sampling.py',
           'x = x.masked_fill(x < kth, float("-inf"))',
           'x = torch.full_like(x, float("-inf")).scatter(-1, x.topk(top_k, dim=-1).indices, x.topk(top_k, dim=-1).values)',
           ('tests/decode/test_sampling_law.py',), 'top-k keeps every token tied with the k-th'),
    Mutant("typical-threshold-min", "decode/verify.py",
           "threshold = torch.clamp(delta * torch.exp(-entropy), max=eps)",
           "threshold = torch.clamp(delta * torch.exp(-entropy), min=eps)",
           ("tests/decode/test_verify.py::test_typical_acceptance_is_a_threshold",),
           "Medusa's typical threshold is min(eps, delta e^-H), not max"),
    Mutant("greedy-verify-root-only", "decode/verify.py",
           "match = (parents >= 0) & (tokens == top.gather(1, par))",
           "match = (parents >= 0) & (tokens == top.gather(1, par * 0))",
           ("tests/decode/test_engine.py::test_greedy_matches_generate",),
           "every draft compared with the root's argmax instead of its parent's"),
    Mutant("keyed-hash-numpy-drops-seed-high-bits", "decode/sampling.py",
           "k = _hash32_np(k ^ s_hi)",
           "k = _hash32_np(k)",
           ("tests/decode/test_verify.py::test_counter_uniform_numpy_path_gives_the_torch_paths_bits",),
           "the CPU hash of the keyed draws ignores a seed's upper 32 bits (CPU and GPU draws part ways)"),
    Mutant("keyed-hash-python-drops-seed-high-bits", "decode/sampling.py",
           "k = _hash32_py(k ^ ((sv >> 32) & _M32))",
           "k = _hash32_py(k)",
           ("tests/decode/test_verify.py::test_counter_uniform_numpy_path_gives_the_torch_paths_bits",),
           "the batch-1 hash of the keyed draws ignores a seed's upper 32 bits (its draws part from the batched ones)"),
    Mutant("int-seed-shared-stream", "decode/engine.py",
           "seed = row_seeds(int(seed), B, device)",
           "seed = torch.full((B,), int(seed), dtype=torch.long, device=device)",
           ("tests/decode/test_engine.py::test_one_int_seed_gives_each_row_its_own_reproducible_stream",
            "tests/decode/test_engine.py::test_sampled_first_and_second_token_follow_the_target"),
           "one int seed gives every row the same random stream (64 copies = one sample 64 times)"),
    Mutant("scheduler-prices-sampled-decodes-greedily", "decode/proposers/scheduler.py",
           "return None if cm is None else cm.at(state.temperature)",
           "return cm",
           ("tests/adaptive/test_adaptive_decode.py::test_sampled_decodes_are_priced_at_sampled_costs",),
           "a T > 0 decode must be planned with the sampled costs (dearer verification, dearer drafts)"),
    # ---- kernels ---------------------------------------------------------------------------------
    Mutant("greedy-ref-last-chunk-wins-tie", "decode/kernels/greedy.py",
           "better = val > best_val", "better = val >= best_val",
           ("tests/decode/test_kernels.py::test_greedy_ref_ties_go_to_lowest_id_across_chunks",),
           "ties must go to the lowest token id, as torch.argmax does"),
    Mutant("greedy-triton-last-block-wins-tie", "decode/kernels/greedy.py",
           "blk = part_val.argmax(dim=1, keepdim=True)",
           "blk = part_val.shape[1] - 1 - part_val.flip(1).argmax(dim=1, keepdim=True)",
           ("tests/decode/test_kernels.py::test_greedy_triton_matches_ref",),
           "the Triton path breaks ties toward the highest vocab block"),
    Mutant("avx2-prefill-chunks-drop-the-last", "decode/kernels/cpu_linear.py",
           "for c in x.split(self.max_rows)]",
           "for c in x.split(self.max_rows)[:-1]]",
           ("tests/decode/test_cpu_linear.py::test_kernel_sums_exactly_what_a_float64_matmul_sums",),
           "inputs beyond 64 rows (prefill, big batches) run through the AVX2 kernel in chunks; every chunk counts"),
    Mutant("argmax-later-block-wins-ties", "decode/kernels/cpu_linear_src.py",
           "if (bval[b * rows + m] > best)",
           "if (bval[b * rows + m] >= best)",
           ("tests/decode/test_cpu_linear.py::test_avx2_argmax_epilogue_picks_what_rounding_to_bf16_then_argmax_picks",),
           "greedy ids are the first maximum of the bf16 logits across vocab blocks too (every kernel's block merge)"),
    Mutant("avx2-bf16-path-chunks-overwrite-each-other", "decode/kernels/cpu_linear_avx2_src.py",
           "uint16_t* out = yp + m0 * O;",
           "uint16_t* out = yp + m0;",
           ("tests/decode/test_cpu_linear.py::test_install_routes_its_row_range_only_and_uninstall_restores_pytorch",),
           "the AVX2 one-call bf16 path runs prefill in chunks of 64 rows; each chunk lands in its own rows"),
    Mutant("fused-layer-ignores-the-tree-mask", "decode/kernels/cpu_layer_src.py",
           "mx = std::max(mx, si[t] = si[t] * scaling + mrow[t]);",
           "mx = std::max(mx, si[t] = si[t] * scaling);",
           ("tests/decode/test_cpu_layers.py::test_a_fused_step_gives_transformers_logits_and_hidden_states",),
           "a fused Gemma 3 step attends only where the tree / sliding-window / padding mask allows"),
    Mutant("fused-attention-drops-the-odd-key", "decode/kernels/cpu_layer_src.py",
           "    if (t < T) qk_tile<NQ, 1>(q, k + t * hd, s + t, hd, T);\n",
           "",
           ("tests/decode/test_cpu_layers.py::test_a_fused_step_gives_transformers_logits_and_hidden_states",),
           "the fused attention scores every key, an odd context length's last one included"),
    Mutant("fused-attention-drops-the-8-lane-tail", "decode/kernels/cpu_layer_src.py",
           "            if (d0 < hd) pv_rows<1>(score.data(), vb, acc.data(), hd, T, d0, Q);\n",
           "",
           ("tests/decode/test_cpu_layers.py::test_a_fused_step_gives_transformers_logits_and_hidden_states",),
           "the fused attention sums every value lane when head_dim is not a multiple of 16"),
    Mutant("fused-layer-groups-query-heads-wrongly", "decode/kernels/cpu_layer_src.py",
           "auto head_of = [&](int64_t qi) { return g * groups + qi / n; };",
           "auto head_of = [&](int64_t qi) { return (qi / n) * Hkv + g; };",
           ("tests/decode/test_cpu_layers.py::test_a_fused_step_gives_transformers_logits_and_hidden_states",),
           "each query head of a fused step reads its own KV head (grouped-query attention)"),
    Mutant("fused-drafter-drops-the-feature-residual", "decode/kernels/cpu_layer_src.py",
           "auto h1 = add_bf16(f2, project(att, w, q, 1, chunk));",
           "auto h1 = project(att, w, q, 1, chunk);",
           ("tests/decode/test_cpu_layers.py::test_a_fused_eagle3_draft_step_gives_the_drafters_own_logits_and_features",),
           "a fused EAGLE-3 draft step adds the attention output to the features it was fed"),
    Mutant("avx512-stream-drops-a-partial-sum", "decode/kernels/cpu_linear_src.py",
           "for (int a = 1; a < A; ++a) v = _mm512_add_ps(v, acc[m][a]);",
           "for (int a = 2; a < A; ++a) v = _mm512_add_ps(v, acc[m][a]);",
           ("tests/decode/test_cpu_linear.py::test_kernel_sums_exactly_what_a_float64_matmul_sums",),
           "the one-weight-row stream keeps A partial sums per row of x; all of them are the dot product"),
    Mutant("avx512-stream-sums-one-row-in-another-order", "decode/kernels/cpu_linear_src.py",
           "        stream_row<MT, 2>(x, w, y, K, ys, o, prefetch);",
           "        stream_row<MT, MT == 1 ? 4 : 2>(x, w, y, K, ys, o, prefetch);",
           ("tests/decode/test_cpu_linear.py::test_avx512_gives_a_row_the_same_bits_however_many_rows_share_the_call",),
           "a one-token step and a verification must sum a row in the same order (bf16 near-ties)"),
    Mutant("avx512-stream-tail-skips-the-last-chunk", "decode/kernels/cpu_linear_src.py",
           "    for (; k < K; k += 32) {  // the rest, 32 at a time, the last masked",
           "    for (; k + 32 < K; k += 32) {  // the rest, 32 at a time, the last masked",
           ("tests/decode/test_cpu_linear.py::test_kernel_sums_exactly_what_a_float64_matmul_sums",),
           "K not a multiple of the stream's 32 x A step: the masked last chunk must be summed"),
    Mutant("packed-drops-the-last-chunk", "decode/kernels/cpu_linear_packed_src.py",
           "for (int64_t p0 = 0; p0 < Kp; p0 += kPairChunk) {",
           "for (int64_t p0 = 0; p0 + kPairChunk < Kp; p0 += kPairChunk) {",
           ("tests/decode/test_cpu_linear.py::test_packed_kernel_sums_exactly_and_rounds_once",),
           "7-16 rows run over chunks of 64 pairs of K: every chunk is part of the sum",
           only="avx2"),
    Mutant("packed-restarts-the-sums-each-chunk", "decode/kernels/cpu_linear_packed_src.py",
           "acc[g * R + c] = first ? pacc_zero() : pacc_load(b);",
           "acc[g * R + c] = pacc_zero();",
           ("tests/decode/test_cpu_linear.py::test_packed_kernel_sums_exactly_and_rounds_once",),
           "a group's sums carry from one chunk of K to the next through the fp32 buffer",
           only="avx2"),
    Mutant("packed-skips-a-lone-last-row", "decode/kernels/cpu_linear_packed_src.py",
           "if constexpr (MT % kGroup != 0)", "if constexpr (MT % kGroup > 1)",
           ("tests/decode/test_cpu_linear.py::test_packed_kernel_sums_exactly_and_rounds_once",),
           "a row left after the full groups (9 rows on AVX-512's groups of 4, 4 on AVX2's of 3) gets its own group",
           only="avx2"),
    Mutant("packed-avx2-second-slice-reads-the-first", "decode/kernels/cpu_linear_packed_src.py",
           "const uint16_t* wp = panel + p * 128 + s * 16 * R;", "const uint16_t* wp = panel + p * 128;",
           ("tests/decode/test_cpu_linear.py::test_packed_kernel_sums_exactly_and_rounds_once",),
           "AVX2 reads a 64-output panel as two slices of 32 for 2+ rows: outputs 32-63 come from the second",
           only="avx2"),
    Mutant("packed-argmax-ties-pick-the-later-id", "decode/kernels/cpu_linear_packed_src.py",
           "if (v > best[m]) best[m] = v, arg[m] = n * kPanel + j;",
           "if (v >= best[m]) best[m] = v, arg[m] = n * kPanel + j;",
           ("tests/decode/test_cpu_linear.py::test_fused_head_argmax_gives_the_ids_of_the_heads_own_bf16_logits",),
           "greedy ids are the first maximum of the bf16 logits, as argmax over the head's own logits",
           only="avx2"),
    Mutant("packed-copy-never-refreshed", "decode/kernels/cpu_layers.py",
           "        if key != self._key:\n            self._packed = None",
           "        if self._packed is None:\n            self._packed = None",
           ("tests/decode/test_cpu_layers.py::test_the_fused_layers_compute_with_a_weight_changed_in_place",),
           "the fused layers' packed copies follow in-place changes of the weights"),
    Mutant("packed-forward-never-refreshed", "decode/kernels/cpu_linear.py",
           "        if self._key != key:", "        if self._packed is None:",
           ("tests/decode/test_cpu_linear.py::test_install_packs_what_fits_its_panels_and_follows_changes_to_the_weight",),
           "a routed linear's packed copy follows in-place changes of its weight"),
    Mutant("softmax-scalar-tail", "decode/kernels/cpu_layer_src.py",
           "    if (t < T) {\n        alignas(32) float tail[8];",
           "    float total = hsum(acc);\n    for (; t < T; ++t) total += (s[t] = std::exp(s[t] - mx));\n"
           "    return total;\n    if (t < T) {\n        alignas(32) float tail[8];",
           ("tests/decode/test_cpu_layers.py::test_the_attentions_softmax_does_not_depend_on_masked_keys_past_the_row",),
           "a query's probabilities must not depend on how many masked keys a verification adds"),
    Mutant("q7-kernel-offset-off-by-one", "decode/kernels/cpu_linear_src.py",
           "(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - 192.0f * xsum[m]) * s[o]",
           "(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - 191.0f * xsum[m]) * s[o]",
           ("tests/decode/test_q7_weights.py::test_the_7bit_kernel_sums_what_the_codes_say_and_rounds_once",),
           "a 7-bit weight u stands for q = u - 64 through the bf16 of 128 + u: 192 sum(x) comes off"),
    Mutant("kernel-build-rewrites-every-unit", "decode/kernels/build.py",
           "    if not path.exists() or path.read_text() != text:",
           "    if True:",
           ("tests/decode/test_kernel_build.py",),
           "an unchanged unit keeps its time stamp, so a kernel edit recompiles the kernels unit alone"),
    Mutant("kernel-build-keeps-a-stale-unit", "decode/kernels/build.py",
           "    if not path.exists() or path.read_text() != text:",
           "    if not path.exists():",
           ("tests/decode/test_kernel_build.py",),
           "an edited kernel must be compiled again, never an earlier build loaded"),
    Mutant("q7-quantizes-the-feature-fc", "decode/kernels/cpu_linear.py",
           'KEEP_BF16 = ("fc",)', "KEEP_BF16 = ()",
           ("tests/decode/test_q7_weights.py::test_a_quantised_drafter_moves_every_own_linear_and_never_the_targets",),
           "EAGLE's fc over the target's features stays bf16 (7 bits there cost T=1 tau 1.88 -> 1.65)"),
    Mutant("q7-quantizes-a-module-shared-with-the-target", "decode/kernels/cpu_linear.py",
           "and id(mod) not in skip", "",
           ("tests/decode/test_q7_weights.py::test_quantize_never_touches_a_module_the_drafter_shares_with_the_target",),
           "a drafter holding the target's head must not rewrite the target's weights"),
    Mutant("chain-cost-drops-the-call-part", "decode/planning.py",
           "return (call(name, batch) if call is not None else 0.0) + length * cost_model.draft_time(name, batch)",
           "return length * cost_model.draft_time(name, batch)",
           ("tests/adaptive/test_costmodel.py::test_the_plan_prices_a_longer_chain_by_its_steps_not_its_average",),
           "a chain costs its call once plus its steps (session 34: averaging stopped T=1 plans at 2 drafts)"),
    Mutant("calibrator-bins-nan-confidence-high", "decode/calibrator.py",
           "np.fmin(np.fmax(c, 0), self.bins - 1)", "np.fmax(np.fmin(c, self.bins - 1), 0)",
           ("tests/adaptive/test_chooser.py",),
           "a NaN confidence (no signal) reads the lowest bin, never the most confident one"),
    Mutant("row-trim-threshold-one-token-off", "decode/planning.py",
           "pi[kept + 1] >= rate * (verify(batch, kept + 2) - verify(batch, kept + 1))",
           "pi[kept + 1] >= rate * (verify(batch, kept + 1) - verify(batch, max(kept, 1)))",
           ("tests/adaptive/test_chooser.py::test_a_single_row_trims_as_the_batched_path_does",),
           "batch 1's Python trim prices draft k by the k-th extra verified token, as the array path does"),
    Mutant("row-plan-prices-one-draft-too-many", "decode/planning.py",
           "return [exp[m] / (cost_model.verify_time(1, 1 + m) + chain_ms(cost_model, draft_name, 1, m))",
           "return [exp[m] / (cost_model.verify_time(1, 1 + m) + chain_ms(cost_model, draft_name, 1, m + 1))",
           ("tests/adaptive/test_chooser.py::test_a_single_row_plans_as_the_batched_path_does",),
           "batch 1's Python plan prices a chain of m drafts as the array path does"),
    Mutant("verify-points-keep-the-round-spells", "decode/costtiming.py",
           "return np.median(times - offset, axis=1).tolist()", "return np.median(times, axis=1).tolist()",
           ("tests/adaptive/test_costmodel.py::test_a_slow_spell_shared_by_a_round_does_not_move_the_steps",),
           "a slow spell moves every point of its round: it is removed before the points' medians (session 35)"),
    Mutant("small-batches-get-no-extra-rounds", "decode/costtiming.py",
           "return repeats * SMALL_BATCH_ROUNDS.get(batch, 1)", "return repeats",
           ("tests/adaptive/test_costmodel.py::test_small_batches_get_more_timed_rounds",),
           "batch 1 and 2, where plans weigh the smallest steps, are timed over more rounds (session 35)"),
    Mutant("chain-count-misses-the-last-accepted-depth", "decode/calibrator.py",
           "d, hit = min(k - 1, D - 1), float(k <= n)", "d, hit = min(k - 1, D - 1), float(k < n)",
           ("tests/adaptive/test_chooser.py::test_a_single_chain_is_counted_as_the_batched_path_counts_it",),
           "batch 1's chain counting credits every accepted depth, as the array path does"),
    Mutant("cpu-verify-residual-keeps-negative-mass", "decode/kernels/cpu_verify.py",
           "if (q) r = _mm256_max_ps(_mm256_sub_ps(r, load8(q + v)), zero);",
           "if (q) r = _mm256_sub_ps(r, load8(q + v));",
           ("tests/decode/test_cpu_verify.py::test_cpu_chain_kernel_emits_from_the_residual_only",
            "tests/decode/test_cpu_verify.py::test_cpu_chain_kernel_matches_the_reference"),
           "after a rejection the CPU chain kernel draws from max(p - q, 0), not p - q"),
    Mutant("cpu-verify-accept-ignores-q", "decode/kernels/cpu_verify.py",
           "if (qx > 0 && ua[k] * qx < px) continue;",
           "if (ua[k] < px) continue;",
           ("tests/decode/test_cpu_verify.py::test_cpu_chain_kernel_matches_the_reference",
            "tests/decode/test_verify.py::test_keyed_emit_draw_follows_the_residual_law"),
           "the CPU chain kernel accepts a sampled draft with probability p(x) / q(x)"),
    Mutant("cpu-verify-one-hot-keeps-the-rejected-draft", "decode/kernels/cpu_verify.py",
           "        if (!q && skip >= b0 && skip < b1) {",
           "        if (false) {",
           ("tests/decode/test_cpu_verify.py::test_cpu_chain_kernel_matches_the_reference",),
           "a rejected deterministic draft is removed from the distribution the replacement comes from"),
    Mutant("cpu-verify-sparse-residual-keeps-negative-mass", "decode/kernels/cpu_verify.py",
           "                ep[ids[j]] = r > 0.0f ? r : 0.0f;",
           "                ep[ids[j]] = r;",
           ("tests/decode/test_cpu_verify.py::test_q_over_a_reduced_draft_vocabulary_verifies_as_its_dense_spread",),
           "q over a reduced draft vocabulary leaves the residual max(p - q, 0), never negative weights"),
    Mutant("growing-cache-commit-keeps-the-old-tail", "decode/kv.py",
           "        self._len = start + idx.shape[1]\n",
           "        self._len = max(self._len, start + idx.shape[1])\n",
           ("tests/decode/test_trees.py::test_commit_keeps_only_the_accepted_path",),
           "a commit that gathers the accepted path leaves only those entries in the cache"),
    Mutant("row-prefill-left-aligns-the-cache", "decode/engine.py",
           "                keys[b, :, n - m:], values[b, :, n - m:] = layers[li]",
           "                keys[b, :, :m], values[b, :, :m] = layers[li]",
           ("tests/decode/test_engine.py::test_prompts_of_very_different_lengths_prefill_row_by_row_and_stay_lossless",),
           "a row prefilled alone lands right-aligned in the left-padded cache, where its positions are"),
    Mutant("last-only-catch-up-keeps-the-first-residual", "drafttrain/models/eagle.py",
           "            attention_mask, residual = attention_mask[..., -1:, :], residual[:, -1:]",
           "            attention_mask, residual = attention_mask[..., -1:, :], residual[:, :1]",
           ("tests/decode/test_proposers.py::test_a_catch_up_computing_only_the_last_position_writes_the_same_cache",),
           "a catch-up that computes only its last position adds that position's own residual"),
    Mutant("python-tree-mask-sees-padding", "decode/kv.py",
           "(anc[Lp + j] & seen if val[b][j]",
           "(anc[Lp + j] if val[b][j]",
           ("tests/decode/test_trees.py::test_mask_bookkeeping_in_python_equals_the_tensor_path",),
           "a decode step's tree mask, built in Python, hides padding entries as the tensor path does"),
    Mutant("jsonl-reader-splits-at-unicode-separators", "drafttrain/records.py",
           '    return text.split("\\n")',
           "    return text.splitlines()",
           ("tests/draft_lm/test_regenerate.py::test_resume_reads_answers_that_hold_unicode_line_separators",),
           "an answer cache whose texts hold U+2028 resumes (JSON Lines split at newlines only)"),
    Mutant("norm-kernel-gemma-scale-without-offset", "decode/kernels/cpu_linear.py",
           'self._scale = (1.0 + s) if self.mode == "offset" else s.clone()',
           'self._scale = s.clone()',
           ("tests/decode/test_cpu_linear.py::test_every_rms_norm_is_routed_and_computes_its_modules_formula",),
           "Gemma's RMS norm scales by 1 + w; the kernel must not drop the offset (or silently route nothing)"),
    Mutant("sampled-chain-emits-from-p-after-rejection", "decode/verify.py",
           "            r_rej = (p_cur - q).clamp_min(0.0)\n",
           "            r_rej = p_cur.clone()\n",
           ("tests/decode/test_verify.py::test_sampled_chain_path_equals_tree_walk_bit_for_bit",),
           "after a rejected sampled draft the emitted token must come from the residual max(p - q, 0), not p"),
    Mutant("walked-tau-skips-the-bonus", "drafttrain/losses.py",
           "                t += a + 1\n",
           "                t += a + 2\n",
           ("tests/decode/test_walked_tau.py::test_walked_tau_equals_decoded_tau_and_the_position_average_does_not",),
           "the held-out walked tau must step root to root as decoding does (accepted + bonus), or it stops predicting decoded tau"),
    Mutant("cost-grid-running-max", "decode/costmodel.py",
           "        grid = [_monotone([float(self.verify_ms[b, t]) for t in self._tokens]) for b in self._batches]\n",
           "        grid = [_cummax([float(self.verify_ms[b, t]) for t in self._tokens]) for b in self._batches]\n",
           ("tests/adaptive/test_costmodel.py::test_one_slow_point_is_averaged_with_its_neighbours_not_carried_to_longer_chains",),
           "one slow verification reading must not price every longer chain at its time (adaptive: then stops drafting)"),
    Mutant("cost-points-timed-in-a-row", "decode/costtiming.py",
           "    for r in range(repeats + 1):\n        for t in tokens:\n",
           "    for t in tokens:\n        for r in range(repeats + 1):\n",
           ("tests/adaptive/test_costmodel.py::test_the_points_of_a_batch_size_are_timed_round_robin",),
           "a slow spell must spread over a batch size's points, not fall on one point's calls"),
    # ---- training loop ---------------------------------------------------------------------------
    Mutant("resume-replays-epoch", "drafttrain/trainer.py",
           'it = acc.skip_first_batches(run.loader, state["micro_in_epoch"]) if state["micro_in_epoch"] else run.loader',
           "it = run.loader",
           ("tests/train/test_training.py::test_stop_and_resume_equals_uninterrupted",),
           "a resumed run restarts its epoch instead of skipping the batches already trained on"),
    Mutant("best-drafter-keeps-worst", "drafttrain/trainer.py",
           'dec["eval/decode_tau"] > state["best_decode_tau"]',
           'dec["eval/decode_tau"] < state["best_decode_tau"]',
           ("tests/train/test_training.py::test_decoding_eval_in_training_keeps_the_best_drafter",),
           "best_drafter must hold the step with the highest decoding tau"),
    # ---- user errors -----------------------------------------------------------------------------
    Mutant("spec-check-skipped", "eval/harness.py",
           "    check_inputs(cfg)  # seconds", "    pass  # seconds",
           ("tests/eval/test_spec_check.py::test_eval_checks_before_loading_the_target",),
           "bad proposer specs found only after the target has loaded"),
]


def _files(root: Path) -> list[str]:
    """Tracked files plus untracked ones git does not ignore (so uncommitted work is checked)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (root / f).is_file()]


def make_copy(root: Path, dest: Path) -> Path:
    """Copies the tree to dest/src and links src/decode and src/eval into src/drafttrain, as
    pyproject.toml maps them, so src/drafttrain is the whole package."""
    src = dest / "src"
    for f in _files(root):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, src / f)
    for sub in ("decode", "eval"):
        (src / "drafttrain" / sub).symlink_to(src / sub, target_is_directory=True)
    return src


#: files whose mutants change C++ that torch compiles (`load_inline` sources), not Python
COMPILED = ("_src.py", "decode/kernels/cpu_verify.py")


def run_tests(src: Path, tests: tuple[str, ...], timeout: float, extensions: Path | None = None,
              only: str = "") -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The C++ kernels load from `extensions`, else from torch's own extension folder (the unmutated
    # builds the fast tier just made and loaded: a mutant that loads a kernel compiles nothing). A
    # mutant of C++ builds in its copy's folder: two jobs compiling different (mutated) sources under
    # one extension name in one folder can load each other's build (session 22: a kernel-source
    # mutant "survived" that way beside another kernel mutant); a copy runs one mutant at a time.
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]
    if only:
        cmd += ["-k", only]
    try:
        out = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    lines = (out.stdout + out.stderr).strip().splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]  # pytest's short summary
    return out.returncode, (failed or lines or [""])[0 if failed else -1][:160]


def check_imports_copy(src: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(src))
    code = "import drafttrain.decode.engine as e, drafttrain.trainer as t; print(e.__file__); print(t.__file__)"
    files = subprocess.run([sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    if not all(f.startswith(str(src)) for f in files):
        sys.exit(f"mutation check: the copy is not what Python imports ({files}); is drafttrain installed "
                 "as a regular (non-editable) package? Use `pip install -e .`")


def prebuild(src: Path) -> None:
    """Builds every C++ kernel this CPU runs from the unmutated copy at src into torch's extension
    folder, two at a time, before any mutant runs (after the fast tier they are built already: seconds)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    code = ("from drafttrain.decode.kernels import cpu_linear, cpu_verify\n"
            "names = [k for k in cpu_linear.KERNELS if cpu_linear.available(k)]\n"
            "for k in names[{part}::2]:\n    cpu_linear.KERNELS[k].load()\n"
            "if {part} == 1 and cpu_verify.available():\n    cpu_verify.load()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code.format(part=i)], cwd=src, env=env) for i in (0, 1)]
    if any(p.wait() != 0 for p in procs):
        sys.exit("mutation check: building the unmutated kernels failed (see above)")


def _run_mutant(src: Path, m: Mutant, timeout: float) -> tuple[str, str]:
    """Applies one mutant to the copy at src, runs its tests, restores the file: (verdict, detail)."""
    path = src / m.file
    text = path.read_text()
    n = text.count(m.find)
    if n != 1:
        return "NOT APPLIED", f"find text occurs {n} times in {m.file}; update the mutant"
    path.write_text(text.replace(m.find, m.replace))
    # A mutant of compiled C++ builds in its copy's own folder: torch's folder keeps the unmutated
    # builds (`prebuild`), which every other mutant loads without compiling. Each extension is two
    # units (`build.load_kernels`) that ninja recompiles only when their text changed, so a kernel
    # mutant recompiles the kernels unit (~15-20 s on a 2-core CPU) and reuses the copy's bindings
    # unit from its earlier mutants; any kernel it loads whose text differs from the folder's last
    # build (the restored source after another mutant) is rebuilt the same way. Before session 40
    # each kernel mutant cost two whole builds (~45-60 s each) in its copy.
    scratch = src.parent / "torch_extensions_mutant" if m.file.endswith(COMPILED) else None
    try:
        rc, last = run_tests(src, m.tests, timeout, scratch, m.only)
    finally:
        path.write_text(text)
    return ("KILLED" if rc == 1 else "SURVIVED" if rc == 0 else "ERROR"), last


def _baseline(copies: list[Path], tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    """Runs every listed test on the unmutated copies, the selections split between them."""
    parts = [tests[i::len(copies)] for i in range(len(copies))]
    with ThreadPoolExecutor(len(copies)) as pool:
        outs = list(pool.map(lambda a: run_tests(a[0], a[1], timeout) if a[1] else (0, ""), zip(copies, parts)))
    bad = [o for o in outs if o[0] != 0]
    return (bad or outs)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plant each listed bug in a scratch copy; check a test catches it.")
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip running every selection on the unmutated copy first (tests/run_suite.py: the "
                    "fast tier has just passed on the same files)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="mutants tested at once, each in its own copy of the tree with one torch thread "
                    "(default: 2, or 1 on a 1-core machine)")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:36s} {m.file}: {m.why}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        sys.exit(f"mutation check: unknown mutant(s) {sorted(unknown)}; see --list")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    jobs = max(1, min(args.jobs, len(chosen)))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="drafttrain-mutants-") as tmp:
        copies = [make_copy(ROOT, Path(tmp) / f"copy{i}") for i in range(jobs)]
        for src in copies:
            check_imports_copy(src)
        t1 = time.monotonic()
        prebuild(copies[0])
        print(f"unmutated kernels built (or found built) for every copy in {time.monotonic() - t1:.0f} s", flush=True)
        every = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, last = (0, "skipped (--no-baseline)") if args.no_baseline else _baseline(copies, every, args.timeout)
        print(f"baseline (unmutated copies, {len(every)} test selections): {'passed' if rc == 0 else 'FAILED'}"
              f" [{last}]", flush=True)
        if rc != 0:
            print("mutation check: the unmutated copy fails its tests; fix the suite first")
            return 1
        free: Queue[Path] = Queue()
        for src in copies:
            free.put(src)

        def one(m: Mutant) -> tuple[Mutant, str, str]:
            src = free.get()  # a copy no other mutant is using now
            t1 = time.monotonic()
            try:
                verdict, last = _run_mutant(src, m, args.timeout)
            finally:
                free.put(src)
            took = f"{time.monotonic() - t1:5.0f} s" if verdict != "NOT APPLIED" else ""
            print(f"  {m.name:36s} {verdict:8s} {took}  [{last}]", flush=True)
            return m, verdict, last

        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(one, chosen))
    bad = [(m, v, why) for m, v, why in results if v != "KILLED"]
    print(f"mutation check: {len(results) - len(bad)}/{len(results)} mutants killed in "
          f"{time.monotonic() - t0:.0f} s ({jobs} at a time)")
    for m, v, why in bad:
        print(f"  {v}: {m.name} ({m.file}: {m.why}) [{why}]")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
