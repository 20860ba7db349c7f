"""bench/draft_step.py: the sections of an EAGLE drafter's `propose` calls, counted and timed."""

from __future__ import annotations

import pytest
import torch

from drafttrain.decode.kv import KVState
from drafttrain.decode.proposers.base import NodeDrafter
from drafttrain.decode.proposers.eagle import EagleProposer
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import tiny_target


def _setup():
    target = tiny_target("llama", seed=0).eval()
    torch.manual_seed(0)
    drafter = EagleDrafter(config_from_target(target.config, draft_vocab_size=None)).attach_target(target).eval()
    prompts = [torch.tensor([[5, 17, 42, 9, 33, 8]]), torch.tensor([[7, 7, 21, 60, 2]])]
    return target, EagleProposer(drafter), prompts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_propose_is_split_into_its_catch_up_draft_steps_and_draws(bench_script, temperature):
    ds = bench_script("draft_step")
    target, prop, prompts = _setup()
    extend, propose = KVState.extend, EagleProposer.propose
    acc, totals = ds.profile(target, prop, prompts, temperature=temperature, gamma=3, new_tokens=12)
    calls = {k: v[0] for k, v in acc.items()}
    assert calls["propose"] == totals["target_forwards"] > 0  # batch 1: one draft per verification
    assert totals["tokens"] == 2 * 12
    assert calls["catch-up (_begin)"] == calls["propose"]
    assert calls["draft steps 2.. (_feed_nodes)"] > 0
    # every drafter forward is the catch-up or a later draft step, and builds one KV mask; the
    # target's own KV calls (verification) are not counted
    assert calls["drafter forward (_run)"] == calls["catch-up (_begin)"] + calls["draft steps 2.. (_feed_nodes)"]
    assert calls["KV mask (KVState.extend)"] == calls["drafter forward (_run)"]
    assert calls["drafter forward (_run)"] <= 3 * calls["propose"]  # gamma 3: at most 3 forwards a chain
    drafts = calls["propose"] + calls["draft steps 2.. (_feed_nodes)"]  # a chain of g drafts feeds g - 1
    assert calls[ds.DRAWS] == (2 * drafts if temperature > 0 else 0)  # q, then a keyed draw, per draft
    for name, parent in ds.SECTIONS:  # a section's time fits in its parent's
        if parent is not None:
            assert acc[name][1] <= acc[parent][1] + 1e-6
    rows = ds.table(acc, totals)
    assert rows[2].startswith("| propose | 1.00 |")
    assert any(r.startswith("| - rest of propose |") for r in rows)
    # the wrappers are gone afterwards
    assert KVState.extend is extend and EagleProposer.propose is propose is NodeDrafter.propose
    assert "_feed_nodes" not in vars(EagleProposer)


def test_the_op_table_counts_aten_ops_inside_propose(bench_script):
    ds = bench_script("draft_step")
    target, prop, prompts = _setup()
    rows = ds.op_table(target, prop, prompts[:1], temperature=0.0, gamma=2, new_tokens=6, top=5)
    assert rows[0].startswith("aten ops inside propose")
    assert len(rows) == 3 + 5 and all(r.startswith("| aten::") for r in rows[3:])
    assert EagleProposer.propose is NodeDrafter.propose and "propose" not in vars(EagleProposer)
