"""The CPU's C++ sampled-chain verification (decode/kernels/cpu_verify.py) against the PyTorch reference.

`verify_tree` takes this kernel for seeded, temperature-only chains on x86 CPUs with AVX2 (what
T > 0 decoding on this machine runs, target-only included), so its accept decisions and emitted
tokens must be the reference's: the seeded law tests (test_verify.py's keyed residual law,
test_verify_stats.py, test_sampling_law.py) run through it too.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.decode.kernels import cpu_verify
from drafttrain.decode.sampling import process_logits
from drafttrain.decode.verify import chain_parents, verify_chain, verify_tree

pytestmark = pytest.mark.skipif(not cpu_verify.available(), reason="needs an x86 CPU with AVX2 and a C++ compiler")


def _case(seed: int, B: int, K: int, V: int, dtype: torch.dtype, temperature: float, with_q: bool):
    """A chain whose drafts come from q (so some are accepted, some rejected), or random drafts."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K, V, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, V, (B, K), generator=g)
    q = None
    if with_q:
        q = process_logits(torch.randn(B, K, V, generator=g) * 2 + logits.float(), temperature)
        for k in range(K - 1):
            tokens[:, k + 1] = torch.multinomial(q[:, k], 1, generator=g)[:, 0]
    else:  # deterministic drafts: the target's own top tokens, accepted often
        tokens[:, 1:] = logits[:, :-1].float().argmax(-1)
    pos = torch.randint(0, 10_000, (B,), generator=g)
    return logits, tokens, chain_parents(B, K - 1), q, pos


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("accepted", "num_accepted", "next_token", "last_node"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_q", [True, False])
def test_cpu_chain_kernel_matches_the_reference(dtype, with_q):
    """Random chains (1-3 rows, 1-5 nodes, vocabularies from 7 to 5000 including the 8-lane and
    1024-block tails, T 0.6 / 1 / 1.4): the same accepted prefix and emitted token as the reference,
    with both full acceptances and rejections among them."""
    full = rejected = 0
    for i in range(48):
        B, K, V, T = 1 + i % 3, 1 + i % 5, (7, 64, 1031, 5000)[i % 4], (0.6, 1.0, 1.4)[i % 3]
        logits, tokens, par, q, pos = _case(i, B, K, V, dtype, T, with_q)
        kw = dict(temperature=T, seed=i, positions=pos)
        ref = verify_tree(logits, tokens, par, q, impl="ref", **kw)
        got = verify_tree(logits, tokens, par, q, impl="cpu", **kw)
        assert _same(ref, got), (i, ref, got)
        assert _same(got, verify_tree(logits, tokens, par, q, **kw))  # "auto" takes it
        full += int((ref.num_accepted == K - 1).sum()) if K > 1 else 0
        rejected += int((ref.num_accepted < K - 1).sum())
    assert full > 5 and rejected > 5, (full, rejected)


def test_cpu_chain_kernel_does_not_depend_on_the_thread_count():
    """A Gemma-sized vocabulary split across threads: one thread and two give the same draws."""
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            res = []
            for i in range(6):
                logits, tokens, par, q, pos = _case(100 + i, 1, 4, 262_144, torch.bfloat16, 1.0, True)
                r = verify_tree(logits, tokens, par, q, temperature=1.0, seed=i, positions=pos, impl="cpu")
                res.append((r.num_accepted.tolist(), r.next_token.tolist()))
            outs.append(res)
    finally:
        torch.set_num_threads(before)
    assert outs[0] == outs[1]


def test_cpu_chain_kernel_emits_from_the_residual_only():
    """q = p except on one token: after a rejection the residual max(p - q, 0) lives on that token
    alone, so every emitted token after a rejection is that token; a one-hot draft the target
    excludes (p = 0) is never accepted, and its replacement is never itself."""
    V, n = 300, 400
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 2, V, generator=g)
    logits[0, 0, 5] = 6.0  # p(5) ~ 0.5 at the root
    logits = logits.expand(n, 2, V).contiguous()
    p = process_logits(logits, 1.0)
    q = p[:, :1].clone()
    q[:, 0, 5] = 0.0  # the draft never proposes 5: p(5) is the residual's whole mass
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q[:, 0], 1, generator=g)
    res = verify_chain(logits, drafts, q, temperature=1.0, seed=3, positions=torch.arange(n) * 5, impl="cpu")
    rej = res.num_accepted == 0
    assert 0 < int(rej.sum()) < n
    assert (res.next_token[rej] == 5).all()
    masked = logits.clone()
    masked[:, 0, 7] = float("-inf")
    res = verify_chain(masked, torch.full((n, 1), 7), None, temperature=1.0, seed=4,
                       positions=torch.arange(n) * 5, impl="cpu")
    assert (res.num_accepted == 0).all() and (res.next_token != 7).all()


def test_cpu_chain_kernel_raises_what_the_reference_raises():
    logits = torch.randn(1, 3, 40)
    tok = torch.zeros(1, 2, dtype=torch.long)
    kw = dict(temperature=1.0, seed=0, positions=torch.tensor([3]), impl="cpu")
    bad = logits.clone()
    bad[0, 2, 9] = float("nan")  # a node the walk may never reach is still checked
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        verify_chain(bad, tok, **kw)
    bad = logits.clone()
    bad[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="every token is -inf"):
        verify_chain(bad, tok, **kw)
    with pytest.raises(ValueError, match="draft tokens must lie in"):  # the kernel's own bound, checks off
        verify_chain(logits, torch.tensor([[3, 40]]), check=False, **kw)
    for value in (float("nan"), float("inf"), -0.1):
        q = process_logits(torch.randn(1, 2, 40), 1.0)
        q[0, 1, 17] = value
        with pytest.raises(ValueError, match="draft_probs must be finite and non-negative"):
            verify_chain(logits, tok, q, **kw)


def test_impl_cpu_refuses_what_it_does_not_serve():
    logits = torch.randn(1, 3, 40)
    tok = torch.zeros(1, 2, dtype=torch.long)
    pos = torch.tensor([3])
    for kw in (dict(top_k=5, seed=0, positions=pos), dict(top_p=0.9, seed=0, positions=pos),
               dict(generator=torch.Generator().manual_seed(0))):
        with pytest.raises(ValueError, match="impl='cpu'"):
            verify_chain(logits, tok, temperature=1.0, impl="cpu", **kw)
    tree = torch.tensor([[-1, 0, 0]])  # siblings
    with pytest.raises(ValueError, match="impl='cpu'"):
        verify_tree(logits, torch.zeros(1, 3, dtype=torch.long), tree, temperature=1.0, seed=0, positions=pos,
                    impl="cpu")


@pytest.mark.parametrize("impl", ["cpu", "ref"])
def test_q_over_a_reduced_draft_vocabulary_verifies_as_its_dense_spread(impl):
    """Sampled drafts from a reduced vocabulary (EAGLE-3's 8k of Gemma's 262k): q kept as
    [B, N, V'] with its target ids verifies exactly as q scattered to [B, N, V] (drafts outside the
    vocabulary, q(x) = 0, always rejected), through the kernel and through the reference."""
    from drafttrain.decode.tree import dense_probs

    hits = 0
    for i in range(24):
        B, K, V = 1 + i % 2, 2 + i % 4, (300, 2100)[i % 2]
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randperm(V, generator=g)[: V // 3].sort().values
        logits = torch.randn(B, K, V, generator=g) * 3
        q_small = process_logits(logits[:, :, ids] + torch.randn(B, K, ids.numel(), generator=g), 1.0)
        tokens = torch.zeros(B, K, dtype=torch.long)
        for k in range(K - 1):
            j = torch.multinomial(q_small[:, k], 1, generator=g)[:, 0]
            tokens[:, k + 1] = torch.where(torch.rand(B, generator=g) < 0.2, torch.randint(0, V, (B,), generator=g), ids[j])
        kw = dict(temperature=1.0, seed=i, positions=torch.arange(B) * 11 + i, impl=impl)
        par = chain_parents(B, K - 1)
        dense = verify_tree(logits, tokens, par, dense_probs(q_small, ids, V), **kw)
        sparse = verify_tree(logits, tokens, par, q_small, draft_vocab=ids, **kw)
        assert _same(dense, sparse), (i, dense, sparse)
        hits += int((dense.num_accepted > 0).sum())
    assert hits > 5
    with pytest.raises(ValueError, match="draft vocabulary"):
        verify_tree(logits, tokens, par, q_small[..., :-1], draft_vocab=ids, **kw)
    with pytest.raises(ValueError, match="draft_vocab ids must lie"):
        verify_tree(logits, tokens, par, q_small, draft_vocab=torch.where(ids == ids[-1], V, ids), **kw)
