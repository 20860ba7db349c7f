"""The hindsight oracle on hand-built step logs whose answers are worked out by hand: accepted
lengths, oracle τ and tokens/s, the achieved figure, fixed-length baselines, the batch trade-off."""

from __future__ import annotations

import random

import pytest

from drafttrain.eval.oracle import hindsight_accepted, not_applicable, oracle_figures, visited_steps


class Cost:
    """verify(B, t) = 10 + slope * (t - 1) ms; drafting a step costs `draft[part]` ms."""

    def __init__(self, slope: float = 2.0, draft: dict | None = None):
        self.slope, self.draft = slope, draft or {"a": 2.0, "b": 5.0}

    def verify_time(self, batch: int, tokens_per_row: int) -> float:
        return 10.0 + self.slope * (tokens_per_row - 1)

    def draft_time(self, name: str, batch: int) -> float:
        return self.draft[name]


PROMPT = [1, 2, 3]
OUT = [10, 11, 12, 13, 14, 15, 16, 17]
# Three steps of one row. Root positions count the prompt: the first root is prompt[-1] (pos 2).
LOG = [
    {"row": 0, "pos": 2, "emitted": 3, "drafted": 3, "part": "a",
     "proposals": {"a": [10, 11, 99], "b": [10, 11, 12, 13]}},      # a accepts 2, b accepts 4
    {"row": 0, "pos": 5, "emitted": 1, "drafted": 1, "part": "b",
     "proposals": {"a": [13, 14, 15], "b": [99]}},                  # a accepts 3, b accepts 0
    {"row": 0, "pos": 6, "emitted": 4, "drafted": 4, "part": "b",
     "proposals": {"a": [], "b": [14, 15, 16, 17]}},               # b accepts all 4 left
]


def test_hindsight_accepted_is_the_common_prefix():
    assert hindsight_accepted([5, 6, 7], [5, 6, 8, 9]) == 2
    assert hindsight_accepted([], [1]) == 0 and hindsight_accepted([1, 2], [1]) == 1


def test_visited_steps_score_each_part_against_the_final_output():
    call = visited_steps(LOG, [OUT], [len(PROMPT)], ["code"])
    rows = [s.rows[0] for s in call.steps]
    assert [r.accepted for r in rows] == [{"a": 2, "b": 4}, {"a": 3, "b": 0}, {"a": 0, "b": 4}]
    assert [r.remaining for r in rows] == [8, 5, 4]
    assert [r.proposed["b"] for r in rows] == [4, 1, 4] and rows[0].category == "code"


def test_oracle_bound_achieved_and_fixed_figures_by_hand():
    res = oracle_figures([visited_steps(LOG, [OUT], [len(PROMPT)])], Cost(), measured_tokens_per_s=50.0)
    assert res["applicable"] and res["parts"] == ["a", "b"] and res["steps"] == 3
    assert res["tau_achieved"] == pytest.approx(8 / 3)
    assert res["tau_oracle"] == pytest.approx((5 + 4 + 4) / 3)  # best part, capped by what is left
    tps = res["tokens_per_s_model"]
    # achieved: (16 + 3*2) + (12 + 1*5) + (18 + 4*5) = 77 ms for 8 tokens; target: 8 steps of 10 ms
    assert tps["achieved"] == pytest.approx(8000 / 77) and tps["target"] == pytest.approx(100.0)
    # oracle: a with 2 drafts (3 tokens, 18 ms), a with 3 (4 tokens, 22 ms), then no draft (1, 10):
    # b's 4-token win at step 1 costs 38 ms, so it does not pay
    assert tps["oracle"] == pytest.approx(8000 / 50)
    assert res["oracle_choice"] == {"lengths": [1, 0, 1, 1], "parts": {"a": 2, "none": 1}}
    assert res["oracle_over_achieved"] == pytest.approx((8 / 50) / (8 / 77))
    assert res["tokens_per_s_oracle"] == pytest.approx(50.0 * (8 / 50) / (8 / 77))
    assert res["speedup_model"]["oracle"] == pytest.approx(1.6)
    # always-b: g=3 gives (4 + 1 + 4) tokens in 31 + 17 + 31 ms, better than g = 1, 2, 4
    assert res["fixed"]["b"]["best_gamma"] == 3 and res["fixed"]["b"]["tokens_per_s_model"] == pytest.approx(9000 / 79)
    assert res["fixed"]["b"]["by_gamma"]["4"] == pytest.approx(10000 / 93)
    assert res["fixed"]["a"]["best_gamma"] == 2 and res["fixed"]["a"]["tokens_per_s_model"] == pytest.approx(7000 / 46)
    assert res["per_category"]["all"]["tau_oracle"] == pytest.approx(13 / 3)


def test_at_batch_two_the_bound_caps_the_length_where_the_long_row_stops_paying():
    # one step, two rows: a accepts 2 on row 0 and 6 on row 1; verify(2, t) = 10 + 4 (t - 1), free drafts
    out = [list(range(100, 110)), list(range(200, 210))]
    log = [{"row": 0, "pos": 0, "emitted": 1, "drafted": 0, "part": None, "proposals": {"a": [100, 101, 7]}},
           {"row": 1, "pos": 0, "emitted": 1, "drafted": 0, "part": None, "proposals": {"a": list(range(200, 206))}}]
    res = oracle_figures([visited_steps(log, out, [1, 1], ["chat", "code"])], Cost(4.0, {"a": 0.0}))
    assert res["tau_oracle"] == pytest.approx((3 + 7) / 2)  # what each row could accept
    assert res["tokens_per_s_model"]["oracle"] == pytest.approx(6000 / 18)  # both capped at 2: 6 tokens, 18 ms
    assert res["oracle_choice"]["lengths"] == [0, 0, 2]
    assert set(res["per_category"]) == {"chat", "code"}


def test_steps_group_by_step_key_or_by_row_order():
    entry = {"pos": 0, "emitted": 1, "drafted": 0, "part": None, "proposals": {}}
    outs, lens = [[1, 2, 3]] * 2, [1, 1]
    by_order = visited_steps([{**entry, "row": 0}, {**entry, "row": 1}, {**entry, "row": 1, "pos": 1}], outs, lens)
    assert [len(s.rows) for s in by_order.steps] == [2, 1]
    keyed = [{**entry, "row": 1, "step": 0}, {**entry, "row": 0, "step": 0}, {**entry, "row": 0, "step": 1}]
    assert [len(s.rows) for s in visited_steps(keyed, outs, lens).steps] == [2, 1]


def test_the_bound_dominates_what_was_run_and_every_fixed_length():
    rng = random.Random(0)
    for trial in range(20):
        B = rng.choice([1, 2, 4])
        outs = [[rng.randrange(4) for _ in range(30)] for _ in range(B)]
        log, pos = [], [0] * B
        while any(p < 30 for p in pos):
            for b in range(B):
                if pos[b] >= 30:
                    continue
                cont = outs[b][pos[b]:]
                props = {p: cont[: rng.randrange(5)] + [9] * rng.randrange(3) for p in ("a", "b")}
                part = rng.choice(["a", "b"])
                drafted = len(props[part])
                emitted = min(1 + hindsight_accepted(props[part], cont), len(cont))
                log.append({"row": b, "pos": pos[b], "emitted": emitted, "drafted": drafted, "part": part,
                            "proposals": props})
                pos[b] += emitted
        res = oracle_figures([visited_steps(log, outs, [1] * B)], Cost(3.0, {"a": 1.0, "b": 4.0}))
        tps = res["tokens_per_s_model"]
        assert tps["oracle"] >= tps["achieved"] - 1e-9, trial
        assert all(tps["oracle"] >= f["tokens_per_s_model"] - 1e-9 for f in res["fixed"].values()), trial
        assert res["tau_oracle"] >= res["tau_achieved"]


def test_sampled_runs_say_the_bound_does_not_apply():
    na = not_applicable()
    assert na["applicable"] is False and "T = 0" in na["reason"]
