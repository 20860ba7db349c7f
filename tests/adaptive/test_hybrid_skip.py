"""The hybrid's skip rule: a part that cannot pay is not run (its drafting cost is saved), the output
stays the target's, and a part that sat out steps drafts exactly like a fresh one afterwards.

Setup: a vocab-16 tiny target (its greedy text repeats, so n-gram lookup is accepted often) and a
random tiny EAGLE-3 drafter (accepted ~8 % at depth 1: useless next to n-gram), with a stub cost
model in which an EAGLE draft step costs 2 ms against ~10.6 ms per verification.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_adaptive_decode import Oracle, _fresh_proposal, eagle_drafter, left_pad, prompts, reference, target

from drafttrain.decode import AdaptiveProposer, CostModel, HybridProposer, speculative_generate
from drafttrain.decode.proposers import EagleProposer, NGramProposer
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import record_proposals

N_NEW = 48


@functools.cache
def small_vocab_eagle() -> EagleDrafter:
    model = target("llama", 16)
    torch.manual_seed(0)
    return EagleDrafter(config_from_target(model.config, draft_vocab_size=None)).attach_target(model).eval()


def small_vocab_prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 16, (n,), generator=g) for n in (14, 5, 9)]


def costly_eagle() -> CostModel:
    verify = {(b, t): 10.0 + 0.2 * b * t for b in (1, 4) for t in (1, 2, 4, 8)}
    return CostModel(verify, {"eagle": {1: 2.0, 4: 2.5}, "oracle": {1: 0.0, 4: 0.0}}, {"note": "stub"})


def ms_per_token(proposer, ids, mask, rows) -> tuple[float, object]:
    """Second call's modelled ms per emitted token (the first call warms the calibrators up)."""
    model = target("llama", 16)
    for _ in range(2):
        out = speculative_generate(model, proposer, ids, attention_mask=mask, max_new_tokens=N_NEW, eos_token_id=[])
        assert out.sequences == [reference(model, p, N_NEW) for p in rows]
    return out.stats.modelled_ms / out.stats.tokens_emitted, out.stats


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive-hybrid", "fixed-hybrid"])
def test_useless_part_is_skipped(adaptive):
    """After warm-up EAGLE drafts in few steps; the hybrid's modelled time per token is within
    exploration's cost of n-gram alone and clearly below a hybrid that runs EAGLE every step."""
    rows = small_vocab_prompts()
    ids, mask = left_pad(rows)
    cost = costly_eagle()

    def hybrid(**kw):
        return HybridProposer([NGramProposer(), EagleProposer(small_vocab_eagle())], cost_model=cost,
                              adaptive=adaptive, gamma=None if adaptive else 4, max_gamma=6, **kw)

    # shadow evidence off: it alone also teaches EAGLE's own plan that EAGLE does not pay, which
    # would hide what the skip rule saves
    skip, s = ms_per_token(hybrid(shadow=False), ids, mask, rows)
    always, s_always = ms_per_token(hybrid(explore_every=0, shadow=False), ids, mask, rows)
    assert s.parts_run["ngram"] == s.target_forwards
    assert s.parts_run.get("eagle", 0) <= 0.1 * s.target_forwards  # EAGLE sat out most steps
    # explore_every=0 turns the rule off: EAGLE drafts every step its own plan pays (every step when fixed)
    assert s_always.parts_run["eagle"] == s_always.target_forwards if not adaptive else \
        s_always.parts_run["eagle"] > 2 * s.parts_run.get("eagle", 0)
    assert skip < always
    if adaptive:
        alone, _ = ms_per_token(AdaptiveProposer(NGramProposer(), cost, max_gamma=6), ids, mask, rows)
        # only EAGLE's exploration runs cost anything: <= 10 % of steps (asserted above), each 2 ms of
        # drafting plus a wider verification, against ~10.6 ms per step
        assert skip <= 1.03 * alone
        default, s_default = ms_per_token(hybrid(), ids, mask, rows)  # shadow evidence on
        assert s_default.parts_run.get("eagle", 0) <= 0.1 * s_default.target_forwards
        assert default <= 1.03 * alone


def test_step_log_does_not_change_the_choice():
    """log_steps=True drafts every part in full, yet the same parts run and win as without it."""
    rows = small_vocab_prompts()
    ids, mask = left_pad(rows)
    model = target("llama", 16)
    outs = []
    for log in (False, True):
        hybrid = HybridProposer([NGramProposer(), EagleProposer(small_vocab_eagle())], cost_model=costly_eagle(),
                                max_gamma=6)
        outs.append(speculative_generate(model, hybrid, ids, attention_mask=mask, max_new_tokens=N_NEW,
                                         eos_token_id=[], log_steps=log))
    plain, logged = outs
    assert plain.sequences == logged.sequences
    assert plain.stats.parts_run == logged.stats.parts_run and plain.stats.chosen_parts == logged.stats.chosen_parts
    assert plain.stats.modelled_ms == logged.stats.modelled_ms
    log = logged.stats.step_log
    assert all(set(e["proposals"]) == {"ngram", "eagle"} for e in log)  # every part's full chain ...
    runs = {e["step"]: e["ran"] for e in log}  # ... but "ran" says which parts really drafted
    assert sum("eagle" in r for r in runs.values()) == logged.stats.parts_run.get("eagle", 0) < len(runs)


def test_skipped_eagle_drafts_as_if_fresh():
    """An always-accepted free oracle makes EAGLE worthless: it runs only every 3rd step
    (explore_every=2), and each of its proposals equals a fresh EAGLE proposer's on the same prefix."""
    model = target()
    drafter = EagleProposer(eagle_drafter())
    seen = record_proposals(drafter)
    ids = prompts(1)[0]
    ref = reference(model, ids, 60)
    hybrid = HybridProposer([Oracle(ids.tolist() + ref), drafter], cost_model=costly_eagle(), adaptive=False,
                            gamma=3, explore_every=2)
    out = speculative_generate(model, hybrid, ids[None], max_new_tokens=60, eos_token_id=[])
    assert out.sequences[0] == ref
    s = out.stats
    assert 3 <= s.parts_run["eagle"] <= s.target_forwards // 2 + 1  # skipped for runs of steps
    assert len(seen) == s.parts_run["eagle"]
    for prefix, chain in seen:
        assert chain == _fresh_proposal(lambda: EagleProposer(eagle_drafter()), prefix, 3)


def test_one_row_scores_in_python_equal_the_tensor_path():
    """At batch 1 the skip rule and the choice score deterministic trees in Python floats; the
    scores equal the tensor path's (a tree with a branch and padding, a chain, a root-only tree)."""
    from types import SimpleNamespace

    from drafttrain.decode.tree import DraftTree

    g = torch.Generator().manual_seed(2)
    parents = [[-1, 0, 1, 0, 3, -2], [-1, 0, 1, 2, -2, -2], [-1, -2, -2, -2, -2, -2]]
    trees = [DraftTree(torch.randint(3, 16, (1, 6), generator=g), torch.tensor([par]), None, None) for par in parents]
    p_nodes = [torch.rand(1, 6, generator=g) for _ in parents]
    trees[2] = DraftTree(trees[2].tokens[:, :1], trees[2].parents[:, :1], None, None)  # root only
    p_nodes[2] = p_nodes[2][:, :1]
    hybrid = SimpleNamespace(names=["a", "b", "c"], calibrators={})
    one = HybridProposer._scores(hybrid, None, trees, p_nodes)  # [3, 1], the Python path

    def two_rows(t: DraftTree) -> DraftTree:
        return DraftTree(t.tokens.expand(2, -1), t.parents.expand(2, -1), None, None)

    both = HybridProposer._scores(hybrid, None, [two_rows(t) for t in trees], [p.expand(2, -1) for p in p_nodes])
    assert one.shape == (3, 1) and torch.allclose(one[:, 0], both[:, 0]) and torch.equal(both[:, 0], both[:, 1])
    p = p_nodes[0][0]
    want = p[1] + p[1] * p[2] + p[3] + p[3] * p[4]  # paths 0-1, 0-1-2, 0-3, 0-3-4; padding counts 0
    assert abs(float(one[0, 0]) - float(want)) < 1e-6 and float(one[2, 0]) == 0.0
