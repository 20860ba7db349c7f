"""Medusa heads in the decoder (greedy output equals the target's own, tree and chain) and the
learned tree's shape.

Tiny targets: hidden 64, 4 layers, vocab 257 (real: Gemma 3 270M, 640 / 18 / 262144).
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.decode import speculative_generate
from drafttrain.decode.proposers import MedusaProposer
from drafttrain.models.medusa import MedusaHeads, config_from_target, learned_tree
from drafttrain.testing import tiny_target


def heads_for(model, draft_vocab: int | None = None, seed: int = 0) -> MedusaHeads:
    """Heads initialised from the target, with random residual blocks (so drafts are imperfect)
    and, with `draft_vocab`, a random reduced vocabulary."""
    torch.manual_seed(seed)
    heads = MedusaHeads(config_from_target(model.config, num_heads=3, draft_vocab_size=draft_vocab))
    V = heads.cfg.vocab_size
    if heads.cfg.draft_vocab_size < V:
        ids = torch.randperm(V)[: heads.cfg.draft_vocab_size].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        heads.set_vocab_mapping(ids - torch.arange(len(ids)), t2d)
    heads.attach_target(model).init_from_target(model)
    with torch.no_grad():
        for b in heads.blocks:
            b.layers[0].weight.normal_(0, 0.05)
    return heads.eval()


@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]], ids=["chain", "tree"])
@pytest.mark.parametrize("family,draft_vocab", [("llama", None), ("gemma3", 150)])
def test_greedy_output_equals_target(family, draft_vocab, tree):
    model = tiny_target(family)
    ids = torch.randint(3, 257, (2, 10), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)[:, 10:]
    proposer = MedusaProposer(heads_for(model, draft_vocab), model.config.num_hidden_layers)
    out = speculative_generate(model, proposer, ids, max_new_tokens=20, eos_token_id=[], tree=tree,
                               gamma=None if tree else 3)
    assert out.sequences == ref.tolist()
    assert out.stats.tokens_emitted == 40


def test_oracle_heads_are_always_accepted():
    """Alignment check: heads that know the target's greedy continuation (looked up from the
    hidden state they are given) must be accepted in full, tau = 1 + K. An off-by-one in which
    hidden state feeds the heads, or in which token head i predicts, breaks this."""
    model = tiny_target("llama")
    ids = torch.randint(3, 257, (1, 6), generator=torch.Generator().manual_seed(0))
    full = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0)[0]
    states = model.model(input_ids=full[None]).last_hidden_state[0]  # [T, H]
    heads = heads_for(model)

    def oracle(h):  # [B, H] -> [K, B, V]: head i at token t says full[t + i + 2]
        t = torch.cdist(h.float(), states).argmin(-1)  # [B]
        out = torch.zeros(heads.cfg.num_heads, h.shape[0], heads.cfg.vocab_size)
        for i in range(heads.cfg.num_heads):
            out[i, torch.arange(h.shape[0]), full[(t + i + 2).clamp(max=len(full) - 1)]] = 1.0
        return out

    heads.forward = oracle
    out = speculative_generate(model, MedusaProposer(heads, 4), ids, max_new_tokens=16, eos_token_id=[], gamma=3)
    assert out.sequences[0] == full[6:22].tolist()
    assert out.stats.tokens_emitted / out.stats.target_forwards == pytest.approx(4.0)


def test_learned_tree_follows_the_measured_accuracies():
    # head 0 is sharp (rank 0 right 90%), head 1 spread over ranks, head 2 almost useless
    acc = [[0.9, 0.05, 0.02], [0.4, 0.3, 0.2], [0.05, 0.01, 0.0]]
    tree = [tuple(p) for p in learned_tree(acc, budget=5)]
    assert tree == [(0,), (1,), (0, 0), (0, 1), (0, 2)]  # values .9, .05, .36, .27, .18
    bigger = learned_tree(acc, budget=8)
    assert len(bigger) == 8 and set(tree) <= {tuple(p) for p in bigger}
    # paths are closed under ancestors (a valid StaticTree) and ordered by value within the budget
    from drafttrain.decode.tree import StaticTree

    StaticTree.of(bigger)
    # a sharper second head moves budget from siblings at depth 1 to depth 2
    deep = learned_tree([[0.9, 0.05, 0.02], [0.95, 0.01, 0.0], [0.9, 0.0, 0.0]], budget=3)
    assert [tuple(p) for p in deep] == [(0,), (0, 0), (0, 0, 0)]
