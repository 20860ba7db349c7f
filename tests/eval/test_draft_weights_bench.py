"""bench/draft_weights.py: the paired report of one drafter in bf16 and in 7-bit weights."""

from __future__ import annotations


def test_the_report_pairs_each_prompt_and_says_which_weights_win(bench_script):
    dw = bench_script("draft_weights")
    # 4 (seed, prompt) pairs of 100 tokens: target-only 2 s each, bf16 1 s, 7-bit 0.8 s
    calls = {"target": [(100, 2.0)] * 4, "bf16": [(100, 1.0)] * 4, "int7": [(100, 0.8)] * 4}
    lines = "\n".join(dw.report(calls))
    assert "| target | 50.0 | 1.00 |" in lines
    assert "| bf16 drafter | 100.0 | 2.000 [2.000, 2.000] |" in lines
    assert "| int7 drafter | 125.0 | 2.500 [2.500, 2.500] |" in lines
    assert "7-bit over bf16: 1.250x [1.250, 1.250] over 4 (seed, prompt) pairs" in lines
    # a slower 7-bit drafter on one prompt widens the interval and lowers the ratio below 1.25
    calls["int7"][0] = (100, 2.0)
    lines = "\n".join(dw.report(calls))
    ratio = float(lines.split("7-bit over bf16: ")[1].split("x")[0])
    assert 0.9 < ratio < 1.25
