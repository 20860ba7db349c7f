"""Draft trees and tree attention: layouts, EAGLE-2 reranking, and a tree forward that gives each
node exactly the logits a plain forward of its own path gives (Llama, Qwen3, Gemma 3 with a
sliding window of 8 crossed by the prompt).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kv import KVState, target_forward
from drafttrain.decode.tree import (
    StaticTree,
    chain_tree,
    node_depths,
    pad_trees,
    parse_tree,
    rerank_to_budget,
)
from drafttrain.testing import tiny_target


@functools.cache
def target(family: str):
    return tiny_target(family)


def test_chain_tree_layout():
    tree = chain_tree(torch.tensor([7, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.rand(2, 3, 11))
    assert tree.tokens.tolist() == [[7, 1, 2, 3], [8, 4, 5, 6]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert tree.draft_probs.shape == (2, 4, 11) and bool((tree.draft_probs[:, -1] == 0).all())
    assert tree.depths().tolist() == [[0, 1, 2, 3]] * 2


def test_pad_trees_and_depths():
    tree = pad_trees([([5, 1, 2], [-1, 0, 0]), ([6], [-1])], torch.device("cpu"))
    assert tree.parents.tolist() == [[-1, 0, 0], [-1, -2, -2]]
    assert node_depths(torch.tensor([[-1, 0, 1, 0, 3]])).tolist() == [[0, 1, 2, 1, 2]]


def test_static_tree_rejects_orphan_paths():
    with pytest.raises(ValueError, match="no parent path"):
        StaticTree.of([(0,), (1, 0)])
    spec = parse_tree([(0, 0), (0,), (1,)])
    assert spec.levels() == [[(0,), (1,)], [(0, 0)]]
    with pytest.raises(ValueError, match="unknown tree"):
        parse_tree("bushy")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 12))
def test_rerank_keeps_a_closed_topological_tree(seed, budget):
    g = torch.Generator().manual_seed(seed)
    M = 20
    parents = torch.tensor([-1] * 4 + [int(torch.randint(0, i, (1,), generator=g)) for i in range(4, M)])
    step = -torch.rand(M, generator=g).double()  # log-probs <= 0
    scores = torch.zeros(M, dtype=torch.float64)
    for i in range(M):
        scores[i] = step[i] + (scores[parents[i]] if parents[i] >= 0 else 0)
    keep, new_parents = rerank_to_budget(scores[None], parents[None], budget)
    kept = keep[0].tolist()
    assert len(kept) == min(budget, M)
    # the kept set is the top-budget by score, and every kept node's parent is kept
    assert sorted(kept) == sorted(scores.topk(len(kept)).indices.tolist())
    for slot, c in enumerate(kept, start=1):
        p = int(parents[c])
        assert (p == -1 and new_parents[0, slot] == 0) or (new_parents[0, slot] == 1 + kept.index(p))
        assert int(new_parents[0, slot]) < slot


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_tree_forward_matches_path_forwards(family):
    model = target(family)
    prefix = torch.randint(3, 257, (1, 13), generator=torch.Generator().manual_seed(0))  # > window 8
    # tree: root 0 -> 1 -> 3 -> 5, root -> 2 -> 4, 1 -> 6
    toks = torch.tensor([[40, 41, 42, 43, 44, 45, 46]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, 1]])
    kv = KVState.for_model(model, 1, torch.device("cpu"))
    L = prefix.shape[1]
    col = torch.arange(L)[None]
    target_forward(model, kv, prefix, col, col - 1)
    kv.commit(col)
    depth = node_depths(parents)
    logits, _ = target_forward(model, kv, toks, L + depth, parents)
    for node in range(toks.shape[1]):
        path = [node]
        while parents[0, path[-1]] > 0:
            path.append(int(parents[0, path[-1]]))
        path = [0] + path[::-1] if node else [0]
        seq = torch.cat([prefix, toks[:, path]], 1)
        want = model(seq).logits[0, -1]
        torch.testing.assert_close(logits[0, node], want, atol=1e-4, rtol=1e-4)


def test_commit_keeps_only_the_accepted_path(family="gemma3"):
    model = target(family)
    prefix = torch.randint(3, 257, (2, 10), generator=torch.Generator().manual_seed(1))
    kv = KVState.for_model(model, 2, torch.device("cpu"))
    col = torch.arange(9).expand(2, -1)
    target_forward(model, kv, prefix[:, :9], col, col - 1)
    kv.commit(col)
    # a 3-node chain after the root; row 0 keeps root + 2 drafts, row 1 keeps only the root
    toks = torch.cat([prefix[:, 9:], torch.tensor([[50, 51, 52], [60, 61, 62]])], 1)
    parents = torch.tensor([[-1, 0, 1, 2]] * 2)
    target_forward(model, kv, toks, 9 + node_depths(parents), parents)
    kv.commit(torch.tensor([[0, 1, 2], [0, -1, -1]]))
    assert kv.seq_lengths().tolist() == [12, 10]
    assert all(layer.keys.shape[2] == 12 for layer in kv.cache.layers)
    # next token for each row sees exactly its own history
    nxt = torch.tensor([[53], [63]])
    logits, _ = target_forward(model, kv, nxt, torch.tensor([[12], [10]]), torch.tensor([[-1], [-1]]))
    want0 = model(torch.cat([prefix[:1], toks[:1, 1:3], nxt[:1]], 1)).logits[0, -1]
    want1 = model(torch.cat([prefix[1:], nxt[1:]], 1)).logits[0, -1]
    torch.testing.assert_close(logits[0, 0], want0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, 0], want1, atol=1e-4, rtol=1e-4)


def test_cache_steps_write_in_place_and_growth_keeps_history(family="gemma3"):
    """Target-only steps append into the layer buffers without copying the cache (the storage
    stays put between growths, so a step costs O(new tokens), not O(context)); crossing the
    capacity reallocates and the logits still match a plain forward of the whole sequence."""
    model = target(family)
    seq = torch.randint(3, 257, (1, 80), generator=torch.Generator().manual_seed(2))
    kv = KVState.for_model(model, 1, torch.device("cpu"))
    target_forward(model, kv, seq[:, :10], torch.arange(10)[None], torch.arange(-1, 9)[None])
    kv.commit(torch.arange(10)[None])
    layer = kv.cache.layers[0]
    ptrs, lengths = set(), []
    for t in range(10, 79):
        logits, _ = target_forward(model, kv, seq[:, t:t + 1], torch.tensor([[t]]), torch.tensor([[-1]]))
        kv.commit(torch.tensor([[0]]))
        ptrs.add(layer.keys.data_ptr())
        lengths.append(layer.keys.shape[2])
    assert lengths == list(range(11, 80))
    assert len(ptrs) <= 3  # 69 steps from 10 to 79 entries: at most two doublings (64, 128)
    want = model(seq[:, :79]).logits[0, -1]
    torch.testing.assert_close(logits[0, 0], want, atol=1e-4, rtol=1e-4)
    # a rolled-back draft leaves nothing behind: the next step sees only committed entries
    target_forward(model, kv, torch.tensor([[5, 6]]), torch.tensor([[79, 80]]), torch.tensor([[-1, 0]]))
    kv.rollback()
    assert layer.keys.shape[2] == 79
    logits, _ = target_forward(model, kv, seq[:, 79:80], torch.tensor([[79]]), torch.tensor([[-1]]))
    torch.testing.assert_close(logits[0, 0], model(seq).logits[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree,tau", [([(0,), (1,), (0, 0), (0, 0, 0), (0, 1)], 4.0), ([(0,)], 2.0)])
def test_self_drafting_static_tree_accepts_the_top1_branch(tree, tau):
    """Draft LM = the target itself: the top-1 branch of any static tree is always accepted."""
    model = target("gemma3")
    ids = torch.randint(3, 257, (1, 12), generator=torch.Generator().manual_seed(2))
    out = speculative_generate(model, load_proposer(model, model), ids, max_new_tokens=16, tree=tree,
                               eos_token_id=[])
    assert out.stats.tau == pytest.approx(tau)



def test_chain_masks_built_without_the_per_token_loop_equal_the_python_path():
    """A prefill or catch-up feeds chains (each token extends the one before, or starts a chain:
    -1, or is padding: -2, left-padded rows as the EAGLE catch-up pads them). Its tensor path skips
    the per-token loop; masks and commit equal the Python bitmask path's."""
    import drafttrain.decode.kv as kv_module

    small = kv_module._SMALL
    valid = torch.tensor([[False, False, True, True, True, True], [True] * 6, [False, True, True, False, True, True]])
    col = torch.arange(6).expand(3, 6)
    parents = torch.where(valid & (col > 0) & valid.roll(1, 1), col - 1, -1)
    parents[2, 3] = -2  # a padding entry inside a row: the next token starts after it

    def run(python_path: bool) -> list[torch.Tensor]:
        kv_module._SMALL = small if python_path else 0
        kv = KVState(3, torch.device("cpu"))
        kv.valid, kv.pos = torch.tensor([[True, True]] * 3), torch.tensor([[0, 1]] * 3)
        mask = kv.extend(2 + col, parents, valid, dtype=torch.float32)
        nxt = kv.extend(torch.full((3, 1), 8), torch.tensor([[5]] * 3), dtype=torch.float32)
        kv.commit(torch.where(valid, col, -1))
        return [mask, nxt, kv.valid, kv.pos]

    try:
        fast, python = run(False), run(True)
    finally:
        kv_module._SMALL = small
    for a, b in zip(fast, python, strict=True):
        assert torch.equal(a, b)
    assert bool((fast[0][1, 0, 5] == 0).all())  # an unpadded row's last token sees everything


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_mask_bookkeeping_in_python_equals_the_tensor_path(B, sizes, data):
    """`KVState.extend` builds a decode step's ancestry in Python (bitmasks) and larger inputs'
    with tensor ops; both give the same masks for any tree fed in pieces (padding, several
    levels before a commit, switching between the two paths mid-tree) and the same commit."""
    import drafttrain.decode.kv as kv_module

    small, total = kv_module._SMALL, sum(sizes)
    # per row, each node's parent: -1 (the committed sequence), an earlier node or -2 (padding)
    parents = torch.tensor([[-1] + [data.draw(st.integers(-2, i - 1)) for i in range(1, total)] for _ in range(B)])
    tensor_path = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    keep = torch.tensor([[0] + [data.draw(st.sampled_from([-1, i])) for i in range(1, total)] for _ in range(B)])

    def run(python_ok: bool) -> list[torch.Tensor]:
        kv = KVState(B, torch.device("cpu"), layer_types=["sliding_attention", "full_attention"], sliding_window=4)
        kv.valid, kv.pos = torch.tensor([[False, True, True]] * B), torch.tensor([[0, 0, 1]] * B)
        out, fed = [], 0
        for n, force in zip(sizes, tensor_path):
            kv_module._SMALL = 0 if (force or not python_ok) else small
            pos = 2 + torch.arange(fed, fed + n).expand(B, n)  # far enough apart to cross the window
            masks = kv.extend(pos * 2, parents[:, fed:fed + n], dtype=torch.float32)
            out += [masks["sliding_attention"], masks["full_attention"]]
            fed += n
        kv.commit(keep)
        return out + [kv.valid, kv.pos]

    try:
        for a, b in zip(run(True), run(False), strict=True):
            assert torch.equal(a, b)
    finally:
        kv_module._SMALL = small
