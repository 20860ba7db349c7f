"""The EAGLE proposer drafts exactly what the training-time-test unroll computes.

Training (forward_ttt) and inference (the proposer's chain) must agree step by step: step k at
base position t reads the drafter's own feature from step k-1 and token x_{t+1+k} at position
t+1+k. If they disagree, a drafter that trains well drafts badly after its first token.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.models.eagle import EagleDrafter, build_vocab_mapping, config_from_target
from drafttrain.testing import tiny_target


@pytest.mark.parametrize("fam", ["llama", "gemma3"])
def test_chain_drafts_equal_ttt_unroll(fam, monkeypatch):
    target = tiny_target(fam, vocab_size=257, num_layers=6)
    torch.manual_seed(0)
    cfg = config_from_target(target.config, draft_vocab_size=200)
    drafter = EagleDrafter(cfg).attach_target(target).eval()
    d2t, t2d, _ = build_vocab_mapping(torch.rand(257), 200)
    drafter.set_vocab_mapping(d2t, t2d)
    for p in drafter.parameters():  # a drafter with opinions (random init is near-uniform)
        p.data.mul_(3.0)
    gamma = 4
    ids = torch.randint(3, 257, (1, 12))
    proposer = load_proposer(drafter, target)
    captured = {}
    original = proposer.propose

    def spy(state):
        tree = original(state)
        captured.setdefault("tree", tree)
        captured.setdefault("tokens", list(state.tokens[0]))
        return tree

    monkeypatch.setattr(proposer, "propose", spy)
    speculative_generate(target, proposer, ids, max_new_tokens=1, gamma=gamma, eos_token_id=-1)
    drafted = captured["tree"].tokens[0, 1:].tolist()  # the first chain, drafted right after prefill
    seq = captured["tokens"]  # prompt; its last token is the root

    # The unroll on the same tokens: base position t = P-2 reads (f_{P-2}, x_{P-1}); step k then
    # reads draft k (the drafter's own tokens stand in for the ground truth).
    P = len(seq)
    full = torch.tensor([seq + drafted])
    with torch.no_grad():
        hs = target(full[:, :P], output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in cfg.aux_layer_ids], -1)
        outs = drafter(full, aux, ttt_steps=gamma, valid=torch.ones(1, P, dtype=torch.bool))
    t = P - 2
    ttt = [int(drafter.draft_ids[o[0][0, t].argmax()]) for o in outs]
    assert drafted == ttt
