"""bench/adaptive_steps.py: every step of an adaptive decode counted by planned, drafted and kept depth."""

from __future__ import annotations

import collections

import torch

from drafttrain.decode import speculative_generate
from drafttrain.decode.costmodel import CostModel
from drafttrain.decode.proposers import EagleProposer
from drafttrain.decode.proposers.scheduler import AdaptiveProposer, Scheduler
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import tiny_target


def test_each_step_is_counted_once_and_the_scheduler_comes_back(bench_script):
    ab = bench_script("adaptive_steps")
    target = tiny_target("llama", seed=0).eval()
    torch.manual_seed(0)
    drafter = EagleDrafter(config_from_target(target.config, draft_vocab_size=None)).attach_target(target).eval()
    # verification nearly flat in tokens and cheap drafts: chains pay, so the plan drafts
    cost = CostModel({(1, t): 10.0 + 0.2 * t for t in (1, 2, 4, 8)}, {"eagle": {1: 0.5}}, {"note": "stub"})
    proposer = AdaptiveProposer(EagleProposer(drafter), cost, max_gamma=4)
    plan, trim = Scheduler._plan, Scheduler._trim
    counts = collections.Counter()
    with ab.recorded(counts):
        out = speculative_generate(target, proposer, torch.tensor([[5, 17, 42, 9, 33, 8]]), max_new_tokens=24,
                                   temperature=1.0, seed=3, eos_token_id=[], gamma=4)
    assert Scheduler._plan is plan and Scheduler._trim is trim
    steps = out.stats.as_dict()["target_forwards"]
    assert sum(counts.values()) == steps > 0  # one count per verification
    assert all(0 <= kept <= drafted and planned <= 4 for planned, drafted, kept in counts)
    assert any(drafted > 0 for _, drafted, _ in counts)  # it drafted
    lines = ab.table(counts)
    shares = [float(r.split("|")[5].strip().rstrip("%")) for r in lines[2:] if r.startswith("| ")]
    assert abs(sum(shares) - 100) < 0.5 and f"of {steps} steps" in lines[-1]
