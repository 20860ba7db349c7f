"""Metrics from known acceptance patterns: exact tau, acceptance, theory and repetition numbers.

A stub proposer drafts the target's own greedy continuation with wrong tokens from a chosen
depth on, so acceptance per position is known exactly; hand-built call records pin the
aggregation arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.decode import DraftTree, Proposer
from drafttrain.decode.tree import chain_tree
from drafttrain.eval import decode_eval
from drafttrain.eval.metrics import Call, iid_speedup, iid_tau, repetition, summarize, theory
from drafttrain.eval.runner import Method, greedy_check, run_benchmark
from drafttrain.testing import tiny_target

V = 257


@pytest.fixture(scope="module")
def target():
    model = tiny_target("llama", vocab_size=V)
    model.config.eos_token_id = None  # no early stop: every prompt emits exactly max_new_tokens
    model.generation_config.eos_token_id = None
    return model


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, V, (5 + i,), generator=g).tolist() for i in range(n)]


class Oracle(Proposer):
    """Drafts `gamma` tokens of the target's greedy continuation; depths >= `good` are wrong."""

    def __init__(self, prompt_ids: list[list[int]], continuations: list[list[int]], gamma: int, good: int):
        self.refs = {tuple(p): c for p, c in zip(prompt_ids, continuations)}
        self.gamma, self.good = gamma, good

    def propose(self, state) -> DraftTree:
        drafts = []
        for seq in state.tokens:
            for p, cont in self.refs.items():
                if tuple(seq[: len(p)]) == p:
                    n = len(seq) - len(p)
                    row = cont[n : n + self.gamma]
                    drafts.append([t if k < self.good else (t + 1) % V for k, t in enumerate(row)])
        return chain_tree(state.root, torch.tensor(drafts))


def greedy_refs(target, ps: list[list[int]], n: int) -> list[list[int]]:
    calls = run_benchmark(target, [Method("target", "engine")], ps, batch_size=1, max_new_tokens=n,
                          temperature=0.0, eos=[])
    return [c.sequences[0] for c in calls["target"]]


@pytest.mark.parametrize("good, tau, acceptance", [(2, 3.0, [1.0, 1.0, 0.0, 0.0]), (0, 1.0, [0.0] * 4),
                                                   (4, 5.0, [1.0] * 4)])
def test_decode_eval_reports_exact_tau_and_acceptance(target, good, tau, acceptance):
    ps = prompts(3)
    refs = greedy_refs(target, ps, 40)
    # 20 new tokens: (good + 1) tokens per forward divides 20 for good = 0 and 4; for good = 2
    # use 18 so the last step is not cut by max_new_tokens.
    n = 18 if good == 2 else 20
    out = decode_eval(target, Oracle(ps, refs, 4, good), ps, max_new_tokens=n, gamma=4, baseline=True)
    assert out["tau"] == pytest.approx(tau)
    assert out["tau_std"] == pytest.approx(0.0)
    assert out["acceptance"] == pytest.approx(acceptance)
    assert out["tokens"] == 3 * n
    assert out["greedy_match"] == 3
    assert out["speedup_vs_target"] > 0


def test_summarize_and_theory_from_known_counts():
    stats = dict(accept_counts=[3, 1], draft_counts=[4, 4], row_forwards=4, target_forwards=4,
                 per_row_tokens=[8], per_row_forwards=[4], time_draft=0.4, time_verify=0.8, time_prefill=0.1,
                 time_other=0.0)
    calls = [Call("m", [0], [[5, 6, 7, 8, 5, 6, 7, 8]], 1.3, stats)]
    s = summarize(calls, [[1, 5, 6, 7, 8]], ["chat"])
    assert s["tau"] == 2.0 and s["acceptance"] == [0.75, 0.25] and s["drafted_per_cycle"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(8 / 1.3)
    assert s["per_category"]["chat"]["tau"] == 2.0
    # output 4-grams: 5678 6785 7856 8567 5678 -> 1 repeat of 5; 2 of 5 are in the prompt
    assert s["repetition"] == {"repeated_4gram_frac": 0.2, "prompt_4gram_overlap": 0.4}
    tgt = summarize([Call("target", [0], [[0] * 8], 1.0, dict(
        stats, accept_counts=[], draft_counts=[], row_forwards=8, target_forwards=8, per_row_forwards=[8],
        time_draft=0.0, time_verify=0.8, time_other=0.0))], [[1]], ["chat"])
    th = theory(s, tgt)
    # t_step = 0.8 / 8 = 0.1 s; draft 0.1 s per cycle over 2 drafted tokens -> c = 0.5
    assert th["t_step_s"] == pytest.approx(0.1) and th["c"] == pytest.approx(0.5)
    assert th["alpha"] == 0.75 and th["verify_ratio"] == pytest.approx(2.0)
    assert th["speedup_iid"] == pytest.approx(iid_speedup(0.75, 2.0, 0.5))
    assert th["speedup_formula_measured_tau"] == pytest.approx(2.0 / 2.0)
    assert th["speedup_cost_model"] == pytest.approx(2.0 * 0.1 / 0.3)


def test_iid_formulas():
    assert iid_tau(0.5, 2) == pytest.approx(1.75)
    assert iid_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert iid_tau(1.0, 4) == 5.0


def test_repetition_counts_repeats_and_prompt_overlap():
    rep, overlap = repetition([1, 2, 3, 4, 1, 2, 3, 4, 1], [1, 2, 3, 4])
    assert rep == pytest.approx(2 / 6) and overlap == pytest.approx(2 / 6)
    assert repetition([1, 2], [1, 2]) == (0.0, 0.0)


def test_greedy_check_flags_a_real_divergence_and_accepts_a_near_tie(target):
    ps = prompts(2)
    ref = greedy_refs(target, ps, 6)
    bad = [list(r) for r in ref]
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([ps[1] + ref[1][:3]])).logits[0, -1]
    bad[1][3] = int(logits.argmin())  # the least likely token: a huge logit gap, a real bug
    calls = {"target": [Call("target", [i], [r], 1.0) for i, r in enumerate(ref)],
             "buggy": [Call("buggy", [i], [r], 1.0) for i, r in enumerate(bad)]}
    rep = greedy_check(target, calls, ps)["buggy"]
    assert rep["compared"] == 2 and rep["identical"] == 1 and not rep["all_match"]
    (d,) = rep["divergences"]
    assert (d["prompt"], d["position"], d["got"]) == (1, 3, bad[1][3])
    assert d["logit_gap"] > 1.0 and not d["near_tie"] and not rep["all_divergences_near_ties"]
    loose = greedy_check(target, calls, ps, tolerance=1e6)["buggy"]
    assert loose["all_divergences_near_ties"]


def test_text_bars_are_proportional_on_one_scale():
    from drafttrain.eval.report import text_bars

    lines = text_bars([("fast", 2.0), ("half", 1.0), ("none", 0.0)], width=16, top=4.0)
    bars = [line.split("  ")[1].rstrip() if "█" in line else "" for line in lines]
    assert [len(b) for b in bars] == [8, 4, 0]  # 2/4 and 1/4 of 16 characters
    assert lines[0].endswith("2.00x") and lines[2].endswith("0.00x")
    assert text_bars([("a", 1.0), ("b", 0.25)], width=2)[1].split("  ")[1] == "▌"  # a half character: 4 eighths


def test_speedup_interval_is_a_bootstrap_over_prompts():
    """The 95% interval of sum(target walls) / sum(method walls): equal per-prompt speedups give a
    point, spread ones an interval around the overall figure that narrows with more prompts."""
    from drafttrain.eval.metrics import speedup_ci95

    assert speedup_ci95([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == [2.0, 2.0]
    base = [1.0, 1.0, 1.0, 1.0] * 4
    walls = [0.5, 1.0, 0.8, 0.4] * 4
    lo, hi = speedup_ci95(base, walls)
    assert lo < sum(base) / sum(walls) < hi
    lo8, hi8 = speedup_ci95(base[:8], walls[:8])
    assert hi8 - lo8 > hi - lo  # fewer prompts, a wider interval


def test_sampled_speedups_are_tokens_per_second_ratios():
    """At T > 0 a method's samples may end earlier than the target's: 4 tokens in 0.8 s against
    8 tokens in 1.0 s is a slowdown (5 vs 8 tok/s), though its wall time is shorter."""
    from drafttrain.eval.metrics import add_prompt_speedups, add_speedups, speedup_ci95

    stats = dict(accept_counts=[], draft_counts=[], row_forwards=8, target_forwards=8, per_row_tokens=[8],
                 per_row_forwards=[8], time_draft=0.0, time_verify=0.8, time_prefill=0.1, time_other=0.0)
    tgt = [Call("target", [0], [[1] * 8], 1.0, stats), Call("target", [1], [[1] * 8], 1.0, stats)]
    fast = [Call("m", [0], [[1] * 4], 0.8, stats), Call("m", [1], [[1] * 8], 1.0, stats)]
    ids, cats = [[1], [1]], ["chat", "chat"]
    methods = {"target": summarize(tgt, ids, cats), "m": summarize(fast, ids, cats)}
    add_speedups(methods, ["target"])
    assert methods["m"].speedup["vs_target"] == pytest.approx((12 / 1.8) / (16 / 2.0))
    assert methods["m"].per_category["chat"].speedup["vs_target"] == pytest.approx((12 / 1.8) / (16 / 2.0))
    add_prompt_speedups(methods, {"target": [1.0, 1.0], "m": [0.8, 1.0]}, {"target": [8, 8], "m": [4, 8]})
    assert methods["m"].speedup_per_prompt_vs_target.mean == pytest.approx((0.625 + 1.0) / 2)
    lo, hi = methods["m"].speedup_ci95_vs_target
    assert lo < (12 / 1.8) / 8 < hi <= 1.0  # resamples of prompt 1 alone give 1.0
    # equal tokens: the tokens/s ratio is the wall-time ratio
    assert speedup_ci95([2.0, 4.0], [1.0, 2.0], base_tokens=[5, 7], tokens=[5, 7]) == [2.0, 2.0]
