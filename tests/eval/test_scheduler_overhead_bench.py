"""bench/scheduler_overhead.py: adaptive's own work found by switching it off; `bare` must emit
exactly the fixed chain's tokens, or the difference it reports is not the scheduler's."""

from __future__ import annotations

import torch

from drafttrain.decode.calibrator import AcceptanceCalibrator
from drafttrain.decode.costmodel import CostModel
from drafttrain.decode.proposers import EagleProposer
from drafttrain.decode.proposers.scheduler import AdaptiveProposer, Scheduler
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import tiny_target


def test_bare_adaptive_is_the_fixed_chain_and_the_scheduler_comes_back(bench_script):
    sb = bench_script("scheduler_overhead")
    target = tiny_target("llama", seed=0).eval()
    torch.manual_seed(0)
    drafter = EagleDrafter(config_from_target(target.config, draft_vocab_size=None)).attach_target(target).eval()
    # verification steep in tokens: left to itself the plan drafts short chains, forced it drafts 3
    cost = CostModel({(1, t): 10.0 + 3.0 * t for t in (1, 2, 4, 8)}, {"eagle": {1: 2.0}}, {"note": "stub"})
    fixed, adaptive = EagleProposer(drafter), AdaptiveProposer(EagleProposer(drafter), cost, max_gamma=4)
    saved = Scheduler._plan, Scheduler._trim, Scheduler._record, AcceptanceCalibrator.update
    prompts = [[5, 17, 42, 9, 33, 8], [7, 7, 12, 40]]
    for temperature in (0.0, 1.0):
        res = sb.measure(target, fixed, adaptive, prompts, new_tokens=16, temperature=temperature, seed=3,
                         gamma=3, eos=[])
        assert (Scheduler._plan, Scheduler._trim, Scheduler._record, AcceptanceCalibrator.update) == saved
        assert res["bare"]["sequences"] == res["fixed"]["sequences"]  # the comparison is like for like
        if temperature == 0:  # one text: forced to 3, each step reaches at least as far
            assert res["forced"]["steps"] <= res["adaptive"]["steps"]
        assert all(r["tokens"] == 32 and r["wall_s"] > 0 for r in res.values())
        lines = sb.table(res)
        assert [r.split("|")[1].strip() for r in lines[2:8]] == list(sb.VARIANTS)
        assert res["planned"]["sequences"] == res["forced"]["sequences"]  # a plan computed, then overridden
        assert "bare emitted the fixed chain's tokens: yes" in lines[-1]
    res["bare"]["sequences"][0] = res["bare"]["sequences"][0][:-1] + [0]
    assert "NO (the comparison is off)" in sb.table(res)[-1]
