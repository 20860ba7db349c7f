"""Verification: greedy and sampled tree walks against brute force, edge cases, RNG, logit processing.

Statistical (distribution-level) checks live in test_verify_stats.py; kernel parity in test_kernels.py.
Trees here are tiny (N <= 9, V <= 11); real trees are ~60 nodes over a 256k vocab.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafttrain.decode.sampling import (
    STREAM_ACCEPT,
    STREAM_EMIT,
    counter_exponential,
    counter_uniform,
    exponentials_from_generator,
    process_logits,
    row_seeds,
)
from drafttrain.decode.verify import (
    _verify_chain_kernel,
    chain_parents,
    verify_chain,
    verify_greedy_ref,
    verify_sampled_chain,
    verify_sampled_ref,
    verify_tree,
)

# ---------------------------------------------------------------------------------------------
# brute-force references (per row, plain Python)
# ---------------------------------------------------------------------------------------------




def brute_greedy(logits, tokens, parents):
    """Per row: walk from the root following the first child equal to the argmax."""
    out = []
    for b in range(tokens.shape[0]):
        cur, path = 0, []
        while True:
            t = int(logits[b, cur].argmax())
            kids = [c for c in range(1, tokens.shape[1]) if int(parents[b, c]) == cur and int(tokens[b, c]) == t]
            if not kids:
                out.append((path, t, cur))
                break
            cur = kids[0]
            path.append(cur)
    return out


def brute_sampled(probs, tokens, parents, q, u, e):
    """Per row: SpecInfer multi-candidate walk with the same draws (same float arithmetic)."""
    out = []
    for b in range(tokens.shape[0]):
        cur, path = 0, []
        r, s = probs[b, 0].clone(), 1.0
        while True:
            kids = [c for c in range(1, tokens.shape[1]) if int(parents[b, c]) == cur]
            moved = False
            for c in kids:
                x = int(tokens[b, c])
                q_vec = None if q is None else q[b, cur].float()
                q_x = 1.0 if q is None else float(q_vec[x])
                if q_x > 0 and float(u[b, c]) * q_x * s < float(r[x]):
                    cur, r, s, moved = c, probs[b, c].clone(), 1.0, True
                    path.append(c)
                    break
                if q is None:
                    r = r.clone()
                    r[x] = 0.0
                else:
                    r = (r - torch.tensor(s, dtype=torch.float32) * q_vec).clamp_min(0.0)
                s = float(r.sum(dtype=torch.float64))
                if s <= 0:
                    r, s = probs[b, cur].clone(), 1.0
            if not moved:
                out.append((path, int((r / e[b]).argmax()), cur))
                break
    return out


def as_rows(res):
    rows = []
    for b in range(res.num_accepted.shape[0]):
        n = int(res.num_accepted[b])
        assert (res.accepted[b, n:] == -1).all()
        rows.append((res.accepted[b, :n].tolist(), int(res.next_token[b]), int(res.last_node[b])))
    return rows


@st.composite
def trees(draw, max_nodes=9, vocab=6):
    """Random small trees (with padding nodes) and a seed for the tensors."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1]
    for i in range(1, n):
        parents.append(draw(st.one_of(st.integers(0, i - 1), st.just(-2))) if i > 1 else 0)
    batch_seed = draw(st.integers(0, 2**31 - 1))
    return torch.tensor(parents), batch_seed, vocab


def _tensors(parents, seed, vocab, batch=3, peaked=True):
    g = torch.Generator().manual_seed(seed)
    N = parents.shape[0]
    # a few strongly peaked rows make long accepted paths likely
    logits = torch.randn(batch, N, vocab, generator=g) * (4.0 if peaked else 1.0)
    tokens = torch.randint(0, vocab, (batch, N), generator=g)
    # bias drafts towards the target's argmax at the parent so paths get long
    tokens[:, 1:] = torch.where(torch.rand(batch, N - 1, generator=g) < 0.6,
                                logits[:, :, :].argmax(-1).gather(1, parents[1:].clamp_min(0).expand(batch, -1)),
                                tokens[:, 1:])
    return logits, tokens, parents.expand(batch, N).clone(), g


# ---------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------


def _onehot_logits(targets, V=8):
    """[B, N] target argmax ids -> [B, N, V] logits with that argmax."""
    return torch.nn.functional.one_hot(torch.tensor(targets), V).float() * 5.0


def test_greedy_chain_full_partial_none():
    # target argmax after root, d1, d2, d3: 3, 4, 5, 6
    logits = _onehot_logits([[3, 4, 5, 6]] * 3)
    drafts = torch.tensor([[3, 4, 5], [3, 0, 5], [1, 4, 5]])
    res = verify_chain(logits, drafts)
    assert res.num_accepted.tolist() == [3, 1, 0]
    assert res.next_token.tolist() == [6, 4, 3]  # bonus, recovered, recovered
    assert res.last_node.tolist() == [3, 1, 0]
    assert res.accepted.tolist() == [[1, 2, 3], [1, -1, -1], [-1, -1, -1]]


def test_greedy_tree_sibling_hit_and_padding():
    #        0
    #      / | \
    #     1  2  3(pad)
    #     |  |
    #     4  5
    parents = torch.tensor([[-1, 0, 0, -2, 1, 2]])
    tokens = torch.tensor([[9, 1, 2, 2, 7, 6]])
    # target: after root -> 2 (the second sibling), after node 2 -> 6, after node 5 -> 3
    top = [[2, 0, 6, 0, 0, 3]]
    res = verify_tree(_onehot_logits(top), tokens, parents)
    assert res.accepted[0].tolist() == [2, 5, -1, -1, -1]
    assert res.num_accepted.tolist() == [2]
    assert res.next_token.tolist() == [3]
    assert res.last_node.tolist() == [5]


def test_greedy_duplicate_siblings_take_first():
    parents = torch.tensor([[-1, 0, 0, 2]])
    tokens = torch.tensor([[0, 4, 4, 1]])
    res = verify_tree(_onehot_logits([[4, 5, 1, 2]]), tokens, parents)
    assert res.accepted[0].tolist() == [1, -1, -1]  # node 1 wins; node 3 under node 2 is unreachable
    assert res.next_token.tolist() == [5]


def test_greedy_ties_take_lowest_token():
    logits = torch.zeros(1, 2, 5)
    logits[0, 0, [1, 3]] = 2.0
    res = verify_chain(logits, torch.tensor([[3]]))
    assert res.num_accepted.tolist() == [0] and res.next_token.tolist() == [1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees())
def test_greedy_tree_matches_brute_force(tree):
    parents, seed, V = tree
    logits, tokens, parents, _ = _tensors(parents, seed, V)
    res = verify_greedy_ref(logits, tokens, parents)
    assert as_rows(res) == brute_greedy(logits, tokens, parents)


# ---------------------------------------------------------------------------------------------
# sampled
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.booleans())
def test_sampled_tree_matches_brute_force(tree, with_q):
    parents, seed, V = tree
    logits, tokens, parents, g = _tensors(parents, seed, V, peaked=False)
    B, N = tokens.shape
    probs = process_logits(logits, 0.9)
    q = process_logits(torch.randn(B, N, V, generator=g), 1.0) if with_q else None
    u = torch.rand(B, N, dtype=torch.float64, generator=g)
    e = exponentials_from_generator((B, V), torch.device("cpu"), g)
    res = verify_sampled_ref(probs, tokens, parents, q, u, e)
    assert as_rows(res) == brute_sampled(probs, tokens, parents, q, u, e)


@pytest.mark.parametrize("with_q", [True, False])
def test_sampled_wide_tree_matches_brute_force(with_q):
    """Five siblings under the root over 4 tokens: repeated rejections exercise the residual update."""
    parents = torch.tensor([-1, 0, 0, 0, 0, 0, 1, 3])
    logits, tokens, parents, g = _tensors(parents, 0, 4, batch=300, peaked=False)
    B, N = tokens.shape
    probs = process_logits(logits, 1.0)
    q = process_logits(torch.randn(B, N, 4, generator=g) * 2, 1.0) if with_q else None
    u = torch.rand(B, N, dtype=torch.float64, generator=g)
    e = exponentials_from_generator((B, 4), torch.device("cpu"), g)
    res = verify_sampled_ref(probs, tokens, parents, q, u, e)
    assert as_rows(res) == brute_sampled(probs, tokens, parents, q, u, e)
    assert (res.num_accepted == 0).any() and (res.num_accepted == 2).any()


@pytest.mark.parametrize("with_q", [True, False])
def test_chain_tree_walk_equals_parallel_chain_path(with_q):
    """The tree walk and the all-positions chain path (the Triton route) agree draw for draw."""
    g = torch.Generator().manual_seed(1)
    B, gamma, V = 64, 4, 11
    logits = torch.randn(B, gamma + 1, V, generator=g) * 2
    q = process_logits(torch.randn(B, gamma, V, generator=g), 1.0) if with_q else None
    drafts = torch.randint(0, V, (B, gamma), generator=g)
    positions = torch.arange(B) * 3
    # the draws verify_tree makes for the fused kernel: keyed by (seed, root position)
    u = counter_uniform(7, positions[:, None], torch.arange(gamma + 1)[None, :], STREAM_ACCEPT)
    e = counter_exponential(7, positions, V)
    tokens = torch.cat([drafts.new_zeros(B, 1), drafts], 1)
    qq = None if q is None else torch.cat([q, q[:, :1]], 1)  # node gamma is a leaf: its row is unused
    walk = verify_sampled_ref(process_logits(logits, 0.8), tokens, chain_parents(B, gamma), qq, u, e)
    par = _verify_chain_kernel(logits, drafts, q, 0.8, u, e, impl="ref")
    for f in ("accepted", "num_accepted", "next_token", "last_node"):
        assert torch.equal(getattr(walk, f), getattr(par, f)), f
    assert 0 < int(walk.num_accepted.sum()) < B * gamma  # both accepts and rejections happened


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_sampled_chain_path_equals_tree_walk_bit_for_bit(with_q, gamma):
    """verify_tree sends CPU chains through verify_sampled_chain (one vocabulary pass instead of
    seven per node); it must give the tree walk's outcome exactly, with both keyed emit draws,
    including residuals that are empty (p == q) and drafts q claims impossible."""
    g = torch.Generator().manual_seed(2 + gamma)
    B, V = 256, 7
    logits = torch.randn(B, gamma + 1, V, generator=g) * 2
    logits[B // 2 :, :, 0] += 6  # peaked rows: long accepted runs and bonus tokens
    probs = process_logits(logits, 0.8)
    q = process_logits(torch.randn(B, gamma + 1, V, generator=g), 1.0) if with_q else None
    drafts = torch.randint(0, V, (B, gamma), generator=g)
    if with_q and gamma:
        q[:8] = probs[:8]  # p == q: always accepted, and a rejection's residual would be empty
        q[8:16, 0] = 0.0
        q[8:16, 0, 3] = 1.0
        drafts[8:16, 0] = 1  # q(x) = 0 at the drafted token: rejected whatever u is
    tokens = torch.cat([drafts.new_zeros(B, 1), drafts], 1)
    positions = torch.arange(B) * 5
    u = counter_uniform(3, positions[:, None], torch.arange(gamma + 1)[None, :], STREAM_ACCEPT)
    parents = chain_parents(B, gamma)
    for e in (counter_exponential(3, positions, V), torch.rand(B, dtype=torch.float64, generator=g)):
        walk = verify_sampled_ref(probs, tokens, parents, q, u, e)
        fast = verify_sampled_chain(probs, tokens, q, u, e)
        for f in ("accepted", "num_accepted", "next_token", "last_node"):
            assert torch.equal(getattr(walk, f), getattr(fast, f)), f
    if gamma:
        assert 0 < int(walk.num_accepted.sum()) < B * gamma  # both accepts and rejections happened
        assert (walk.num_accepted == gamma).any()


def test_seeded_rows_do_not_depend_on_batch():
    g = torch.Generator().manual_seed(3)
    B, N, V = 6, 5, 9
    logits = torch.randn(B, N, V, generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2]).expand(B, N)
    tokens = torch.randint(0, V, (B, N), generator=g)
    q = process_logits(torch.randn(B, N, V, generator=g), 1.0)
    pos = torch.tensor([10, 20, 30, 40, 50, 60])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6])
    full = verify_tree(logits, tokens, parents, q, temperature=1.0, seed=seeds, positions=pos)
    for b in (0, 4):
        one = verify_tree(logits[b:b + 1], tokens[b:b + 1], parents[b:b + 1], q[b:b + 1], temperature=1.0,
                          seed=seeds[b:b + 1], positions=pos[b:b + 1])
        assert one.next_token.item() == full.next_token[b].item()
        assert torch.equal(one.accepted[0], full.accepted[b])
    # and the seed matters: different seeds change some outcome across many rows
    other = verify_tree(logits, tokens, parents, q, temperature=1.0, seed=seeds + 100, positions=pos)
    assert not torch.equal(other.next_token, full.next_token) or not torch.equal(other.accepted, full.accepted)


def test_generator_reproducible():
    logits = torch.randn(8, 4, 7)
    drafts = torch.randint(0, 7, (8, 3))
    a = verify_chain(logits, drafts, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = verify_chain(logits, drafts, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.next_token, b.next_token) and torch.equal(a.accepted, b.accepted)


# ---------------------------------------------------------------------------------------------
# edge cases
# ---------------------------------------------------------------------------------------------


def _probs(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_q_zero_at_drafted_token_rejects_even_with_u_zero():
    p = _probs([0.5, 0.5, 0.0], [0.2, 0.3, 0.5])[None]  # [1, 2, 3]
    q = _probs([1.0, 0.0, 0.0], [1 / 3] * 3)[None]  # the proposer claims q(x=1) = 0
    res = verify_sampled_ref(p, torch.tensor([[0, 1]]), chain_parents(1, 1), q,
                             torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 3))
    assert res.num_accepted.item() == 0
    assert res.next_token.item() == 1  # residual max(p - q, 0) = (0, 0.5, 0)


def test_u_zero_never_accepts_a_token_the_target_excludes():
    p = _probs([0.0, 1.0, 0.0], [1 / 3] * 3)[None]
    for q in (None, _probs([0.5, 0.5, 0.0], [1 / 3] * 3)[None]):
        res = verify_sampled_ref(p, torch.tensor([[0, 0]]), chain_parents(1, 1), q,
                                 torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 3))
        assert res.num_accepted.item() == 0 and res.next_token.item() == 1


def test_p_equal_q_always_accepts():
    g = torch.Generator().manual_seed(0)
    B, gamma, V = 2000, 3, 6
    logits = torch.randn(B, gamma + 1, V, generator=g)
    q = process_logits(logits[:, :gamma], 1.0)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
    res = verify_chain(logits, drafts, q, temperature=1.0, generator=g)
    assert (res.num_accepted == gamma).all()


def test_one_hot_target():
    # p is one-hot at 2 everywhere: drafts of 2 always pass, anything else always fails
    logits = torch.full((4, 3, 5), float("-inf"))
    logits[..., 2] = 0.0
    drafts = torch.tensor([[2, 2], [2, 1], [0, 2], [2, 2]])
    q = torch.full((4, 2, 5), 0.2)
    res = verify_chain(logits, drafts, q, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [2, 1, 0, 2]
    assert (res.next_token == 2).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_logits_raise(bad):
    logits = torch.randn(2, 3, 5)
    logits[1, 2, 3] = bad
    for t in (0.0, 1.0):
        with pytest.raises(ValueError, match="NaN or \\+inf"):
            verify_chain(logits, torch.zeros(2, 2, dtype=torch.long), temperature=t)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -0.1])
def test_bad_draft_probs_raise(bad):
    logits = torch.randn(2, 3, 5)
    q = process_logits(torch.randn(2, 2, 5), 1.0)
    verify_chain(logits, torch.zeros(2, 2, dtype=torch.long), q, temperature=1.0)
    q[1, 1, 4] = bad
    with pytest.raises(ValueError, match="draft_probs must be finite and non-negative"):
        verify_chain(logits, torch.zeros(2, 2, dtype=torch.long), q, temperature=1.0)


def test_all_masked_row_raises_but_masking_is_allowed():
    logits = torch.randn(1, 2, 5)
    logits[0, 0, :2] = float("-inf")  # masking part of the vocab is fine
    verify_chain(logits, torch.tensor([[3]]), temperature=1.0)
    logits[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="every token is -inf"):
        verify_chain(logits, torch.tensor([[3]]), temperature=1.0)


def test_malformed_inputs_raise():
    logits = torch.randn(1, 3, 5)
    with pytest.raises(ValueError, match="parents"):
        verify_tree(logits, torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0, 2]]))
    with pytest.raises(ValueError, match="draft tokens"):
        verify_tree(logits, torch.tensor([[0, 7, 0]]), torch.tensor([[-1, 0, 1]]))
    with pytest.raises(ValueError, match="positions"):
        verify_tree(logits, torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0, 1]]),
                    temperature=1.0, seed=1)
    with pytest.raises(ValueError, match="impl"):
        verify_chain(logits, torch.zeros(1, 2, dtype=torch.long), temperature=1.0, impl="cuda")


@pytest.mark.parametrize("p", [[0.9, 0.05, 0.05],  # low entropy: eps = 0.09 is the threshold
                               [0.4, 0.3, 0.2, 0.095, 0.005],  # delta e^-H = 0.0818 < eps
                               [0.05] * 19 + [0.05 - 1e-3, 1e-3]])  # near-uniform: 0.3 e^-H ~ 0.015
def test_typical_acceptance_is_a_threshold(p):
    """Typical acceptance keeps a draft x iff p(x) > min(eps, delta * exp(-H(p))), computed here by
    hand in float64 for every token of the vocabulary; each case has tokens on both sides."""
    eps, delta = 0.09, 0.3
    probs = torch.tensor(p, dtype=torch.float64)
    threshold = min(eps, delta * math.exp(-float(-(probs * probs.log()).sum())))
    want = [bool(x > threshold) for x in p]
    assert any(want) and not all(want)
    V = len(p)
    logits = torch.log(probs.float()).expand(V, 2, V)  # one row per drafted token
    res = verify_chain(logits, torch.arange(V)[:, None], temperature=1.0, typical=(eps, delta))
    assert res.num_accepted.bool().tolist() == want


def test_typical_acceptance_is_lossy():
    """What a user must know before turning it on: with p = (0.5, 0.3, 0.2) a deterministic draft
    of token 1 is kept every time (0.3 > 0.09), while lossless verification keeps it with
    probability p(1) = 0.3 -- typical acceptance changes the output law."""
    n, p = 2000, torch.tensor([0.5, 0.3, 0.2])
    logits = torch.log(p).expand(n, 2, 3)
    drafts = torch.ones(n, 1, dtype=torch.long)
    typical = verify_chain(logits, drafts, temperature=1.0, typical=(0.09, 0.3))
    exact = verify_chain(logits, drafts, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert int(typical.num_accepted.sum()) == n
    kept = int(exact.num_accepted.sum())
    assert abs(kept - 0.3 * n) <= 6 * math.sqrt(n * 0.3 * 0.7) + 5


# ---------------------------------------------------------------------------------------------
# logit processing and RNG
# ---------------------------------------------------------------------------------------------


def test_process_logits_rules():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]])
    assert process_logits(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0]]  # greedy, lowest tie
    k2 = process_logits(logits, 1.0, top_k=2)
    assert (k2[0, [0, 3, 4]] == 0).all() and torch.allclose(k2[0, 1], k2[0, 2])
    k3 = process_logits(logits, 1.0, top_k=3)  # keeps exactly the three largest
    assert (k3[0] > 0).tolist() == [False, True, True, False, True]
    full = process_logits(logits, 1.0)
    p = process_logits(logits, 1.0, top_p=0.6)  # the two tied 3.0 tokens hold ~0.61
    assert (p[0] > 0).tolist() == [False, True, True, False, False]
    assert torch.allclose(p.sum(-1), torch.ones(1))
    tiny = process_logits(logits, 1.0, top_p=1e-6)  # always keeps the top token
    assert tiny[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    hot = process_logits(logits, 0.5)
    assert hot[0, 1] > full[0, 1] and hot.dtype == torch.float32


def test_counter_uniform_is_a_pure_uniform_function():
    pos = torch.arange(200)[:, None]
    cnt = torch.arange(500)[None, :]
    u = counter_uniform(11, pos, cnt, STREAM_ACCEPT)
    assert u.dtype == torch.float64 and ((u >= 0) & (u < 1)).all()
    assert torch.equal(u, counter_uniform(11, pos, cnt, STREAM_ACCEPT))
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (hist - 1e4).abs().max() < 6 * 95  # 1e5 draws in 10 bins, sd ~ 95
    other = counter_uniform(11, pos, cnt, STREAM_EMIT)
    assert abs(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1].item()) < 0.02
    assert (u != counter_uniform(12, pos, cnt, STREAM_ACCEPT)).float().mean() > 0.99


def test_counter_uniform_numpy_path_gives_the_torch_paths_bits():
    """CPU keys are hashed in NumPy (cheap for the few keys a decode step needs), other devices in
    torch: the two must give the same draws, or a seeded decode would change with the device.
    Seeds over the whole signed int64 range, positions past 2^32, every stream, broadcast shapes."""
    from drafttrain.decode.sampling import (
        STREAM_DRAFT,
        _counter_uniform_np,
        _counter_uniform_py,
        _counter_uniform_torch,
    )

    g = torch.Generator().manual_seed(0)
    for B, N in ((1, 1), (3, 7), (16, 1), (5, 33)):
        seeds = torch.randint(-2**63, 2**63 - 1, (B,), generator=g)
        pos = torch.randint(0, 2**40, (B, 1), generator=g)
        cnt = torch.randint(0, 2**34, (1, N), generator=g)
        for seed in (seeds, int(seeds[0]), row_seeds(12345, B)):
            for stream in (STREAM_ACCEPT, STREAM_EMIT, STREAM_DRAFT):
                a = _counter_uniform_np(seed, pos, cnt, stream)
                b = _counter_uniform_torch(seed, pos, cnt, stream)
                c = _counter_uniform_py(seed, pos, cnt, stream)  # the few keys of a batch-1 step
                assert a.shape == b.shape == c.shape == (B, N) and a.dtype == b.dtype == c.dtype == torch.float64
                assert torch.equal(a, b) and torch.equal(c, b)
    zero_d = (torch.tensor(9), torch.tensor(3))
    assert torch.equal(_counter_uniform_np(5, *zero_d, STREAM_EMIT), _counter_uniform_torch(5, *zero_d, STREAM_EMIT))
    assert torch.equal(_counter_uniform_py(5, *zero_d, STREAM_EMIT), _counter_uniform_torch(5, *zero_d, STREAM_EMIT))
    assert _counter_uniform_np(5, *zero_d, STREAM_EMIT).shape == _counter_uniform_py(5, *zero_d, STREAM_EMIT).shape == ()


def test_counter_exponentials_are_keyed_per_row_and_exp1():
    """Each row's Exp(1) vector depends on (seed, position) only: the same in any batch, new at
    every position and seed, and distributed as Exp(1) (P(E > t) = e^-t within 6 sigma)."""
    V = 50_000
    e = counter_exponential(3, torch.tensor([7, 8, 9]), V)
    assert e.shape == (3, V) and e.dtype == torch.float32 and (e > 0).all()
    assert torch.equal(e[1], counter_exponential(3, torch.tensor([8]), V)[0])  # batch composition is irrelevant
    assert torch.equal(e, counter_exponential(torch.tensor([3, 3, 3]), torch.tensor([7, 8, 9]), V))
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[0], counter_exponential(4, torch.tensor([7]), V)[0])
    n = e.numel()
    for t in (0.1, 1.0, 3.0):
        p = math.exp(-t)
        assert abs((e > t).float().mean().item() - p) < 6 * math.sqrt(p * (1 - p) / n)
    assert abs(torch.corrcoef(torch.stack([e[0], e[1]]))[0, 1].item()) < 6 / math.sqrt(V)


def test_keyed_categorical_follows_the_distribution():
    """One draw per (seed, position): over 40k positions the frequencies match probs (6 sigma), a
    zero-probability entry is never drawn, and rows need not be normalised."""
    from drafttrain.decode.sampling import keyed_categorical

    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    n = 40_000
    x = keyed_categorical(3 * probs.expand(n, -1), 9, torch.arange(n) + 1000)
    freq = torch.bincount(x, minlength=5).double() / n
    sd = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert freq[1] == 0 and ((freq - probs.double()).abs() <= 6 * sd + 1e-12).all()
    again = keyed_categorical(probs.expand(3, -1), 9, torch.tensor([1000, 1001, 1002]))
    assert torch.equal(again, x[:3])  # a pure function of (seed, position)


def test_inverse_cdf_never_draws_a_zero_weight_token():
    """The last uniform below 1 times the total can round up to the total: the draw must still be
    a token of positive weight (here: not the zero-weight last tokens)."""
    from drafttrain.decode.sampling import inverse_cdf

    w = torch.tensor([[0.1, 0.0, 0.7, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 1e-30, 0.0, 0.0]])
    top = torch.tensor([1 - 2.0 ** -53, 1 - 2.0 ** -53], dtype=torch.float64)
    assert inverse_cdf(w, top).tolist() == [3, 3]
    assert inverse_cdf(w, torch.zeros(2, dtype=torch.float64)).tolist() == [0, 3]


def test_keyed_emit_draw_follows_the_residual_law():
    """Sampled verification of one-draft chains with the keyed emit uniform (what CPU decoding
    uses): over 30k rows, each with its own root position, the emitted-token frequencies after a
    rejection match the normalised residual max(p - q, 0), and after an acceptance the bonus
    token follows p at the draft (6 sigma per token)."""
    V, n = 6, 30_000
    p_root = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])
    p_leaf = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.20, 0.40])
    q = torch.tensor([0.10, 0.50, 0.10, 0.10, 0.10, 0.10])
    logits = torch.stack([p_root, p_leaf]).clamp_min(1e-30).log().expand(n, 2, V)
    drafts = torch.full((n, 1), 1)
    res = verify_chain(logits, drafts, q.expand(n, 1, V), temperature=1.0, seed=5, positions=torch.arange(n) * 7)
    acc = res.num_accepted == 1
    assert abs(acc.double().mean().item() - 0.5) < 6 * math.sqrt(0.25 / n)  # p(1) / q(1)
    resid = (p_root - q).clamp_min(0)
    for mask, law in ((~acc, resid / resid.sum()), (acc, p_leaf)):
        m = int(mask.sum())
        freq = torch.bincount(res.next_token[mask], minlength=V).double() / m
        sd = (law.double() * (1 - law.double()) / m).sqrt()
        assert ((freq - law.double()).abs() <= 6 * sd + 1e-12).all(), (freq, law)


@pytest.mark.parametrize("block", [1, 3, 1024])
def test_inverse_cdf_of_one_row_picks_what_the_batched_search_picks(block):
    """A single CPU row takes a Python search (batch-1 decoding's draws): it must give the
    batched path's index for every row, uniform and block size, edges included (u = 0, the
    largest u below 1, zero-weight blocks and tails, a vocabulary not a multiple of the block)."""
    from drafttrain.decode.sampling import inverse_cdf

    g = torch.Generator().manual_seed(block)
    w = torch.rand(64, 3001, generator=g) ** 8
    w[:, 2000:] = 0.0  # trailing zero blocks
    w[::3, :700] = 0.0  # leading ones
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2.0 ** -53, 0.5, 1e-300], dtype=torch.float64)
    batched = inverse_cdf(w, u, block=block)
    alone = torch.stack([inverse_cdf(w[i:i + 1], u[i:i + 1], block=block)[0] for i in range(64)])
    assert torch.equal(alone, batched)
    assert (w.gather(1, alone[:, None]) > 0).all()
    assert inverse_cdf(w[0], u[0], block=block).shape == ()  # an unbatched row gives a 0-d index


@pytest.mark.parametrize("block", [1, 3, 1024])
def test_inverse_cdf_blocks_follow_the_law(block):
    """The two-level search gives the same law for any block size: 60k keyed uniforms against
    weights with zero entries inside and at the ends of blocks (6 sigma per token)."""
    from drafttrain.decode.sampling import inverse_cdf

    w = torch.tensor([0.0, 0.2, 0.0, 0.05, 0.3, 0.0, 0.0, 0.25, 0.1, 0.1, 0.0])
    n = 60_000
    u = counter_uniform(2, torch.arange(n), torch.zeros(n, dtype=torch.long), STREAM_EMIT)
    x = inverse_cdf(w.expand(n, -1) * 7, u, block=block)
    freq = torch.bincount(x, minlength=len(w)).double() / n
    sd = (w.double() * (1 - w.double()) / n).sqrt()
    assert (freq[w == 0] == 0).all() and ((freq - w.double()).abs() <= 6 * sd + 1e-12).all(), freq
    top = torch.full((2,), 1 - 2.0 ** -53, dtype=torch.float64)
    assert inverse_cdf(w.expand(2, -1), top, block=block).tolist() == [9, 9]
