"""Distribution tests: speculative output must follow the target's sampling law exactly.

Many independent rows (200k) over a tiny vocabulary (5 tokens), with targets that depend only on
depth, so the law of every emitted token is known in closed form. Each bin must satisfy
|count - n p| <= 6 sqrt(n p (1 - p)) + 5 (a false alarm is a ~1e-9 event per bin). A real model
has V ~ 256k and context-dependent p; the verifier only ever sees p and q, so this is the test.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.decode.sampling import process_logits
from drafttrain.decode.verify import verify_chain, verify_tree

ROWS = 200_000
P = torch.tensor([[0.45, 0.25, 0.15, 0.10, 0.05],  # target after depth 0 (the root)
                  [0.05, 0.10, 0.50, 0.30, 0.05],  # depth 1
                  [0.20, 0.20, 0.20, 0.20, 0.20]])  # depth 2
Q = torch.tensor([[0.20, 0.40, 0.10, 0.10, 0.20],  # draft for depth-1 tokens
                  [0.10, 0.10, 0.30, 0.45, 0.05]])  # draft for depth-2 tokens




def assert_law(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Per-bin 6-sigma (+5) check of integer samples against a probability vector."""
    n = samples.numel()
    assert n > 1000, f"{what}: too few samples ({n})"
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    p = probs.double() / probs.sum()
    expected = n * p
    bound = 6 * torch.sqrt(n * p * (1 - p)) + 5
    bad = (counts - expected).abs() > bound
    assert not bad.any(), f"{what}: counts {counts.tolist()} vs expected {expected.tolist()}"


def alpha(p: torch.Tensor, q: torch.Tensor) -> float:
    """Acceptance probability of one draft: sum(min(p, q)) = 1 - TV(p, q)."""
    return float(torch.minimum(p, q).sum())


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    return r / r.sum()


def onehot(x: int, V: int = 5) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(x), V).float()


def output_token(res, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token at output position k for the rows that emitted one (num_accepted >= k)."""
    n = res.num_accepted
    has = n >= k
    tok = res.next_token.clone()
    if k < res.accepted.shape[1]:
        node = res.accepted[:, k].clamp_min(0)
        tok = torch.where(n > k, tokens.gather(1, node[:, None])[:, 0], tok)
    return tok[has], has


def logits_for(dists: list[torch.Tensor]) -> torch.Tensor:
    """[N, V] distributions per node -> [ROWS, N, V] logits."""
    return torch.log(torch.stack(dists)).expand(ROWS, -1, -1)


# ---------------------------------------------------------------------------------------------
# chain
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rng", ["generator", "seed"])
@pytest.mark.parametrize("sampled_drafts", [True, False])
def test_chain_output_law(rng, sampled_drafts):
    g = torch.Generator().manual_seed(11)
    logits = logits_for([P[0], P[1], P[2]])  # [ROWS, 3, 5]
    if sampled_drafts:
        q = Q.expand(ROWS, -1, -1)  # [ROWS, 2, 5]
        drafts = torch.multinomial(Q.repeat(ROWS, 1), 1, generator=g).reshape(ROWS, 2)
        qs = [Q[0], Q[1]]
    else:  # deterministic drafter: its argmax; q is one-hot
        q = None
        drafts = Q.argmax(-1).expand(ROWS, -1)
        qs = [onehot(int(Q[0].argmax())), onehot(int(Q[1].argmax()))]
    kw = dict(generator=g) if rng == "generator" else dict(seed=1234, positions=torch.arange(ROWS) * 7)
    res = verify_chain(logits, drafts, q, temperature=1.0, **kw)
    tokens = torch.cat([torch.zeros(ROWS, 1, dtype=torch.long), drafts], 1)

    a0, a1 = alpha(P[0], qs[0]), alpha(P[1], qs[1])
    assert_law(res.num_accepted, torch.tensor([1 - a0, a0 * (1 - a1), a0 * a1]), "accepted count")
    for k in range(3):  # the k-th output token follows the target at depth k
        tok, _ = output_token(res, tokens, k)
        assert_law(tok, P[k], f"output token {k}")
    for k in range(2):  # after a rejection at depth k: the residual norm(max(p - q, 0))
        stopped = res.num_accepted == k
        assert_law(res.next_token[stopped], residual(P[k], qs[k]), f"residual at stop {k}")
    assert_law(res.next_token[res.num_accepted == 2], P[2], "bonus token")


def test_chain_top_k_top_p_applied_identically():
    g = torch.Generator().manual_seed(5)
    target = torch.randn(3, 5, generator=g) * 1.5
    draft = target[:2] + 0.5 * torch.randn(2, 5, generator=g)  # a decent drafter: overlapping support
    settings = dict(temperature=0.8, top_k=4, top_p=0.85)
    p = process_logits(target, **settings)  # [3, 5] what the target itself would sample
    q = process_logits(draft, **settings)  # same processing for the draft
    assert (p == 0).any(), "settings should actually cut tokens"
    drafts = torch.multinomial(q.repeat(ROWS, 1), 1, replacement=True, generator=g).reshape(ROWS, 2)
    res = verify_chain(target.expand(ROWS, -1, -1), drafts, q.expand(ROWS, -1, -1), generator=g, **settings)
    tokens = torch.cat([torch.zeros(ROWS, 1, dtype=torch.long), drafts], 1)
    for k in range(3):
        tok, _ = output_token(res, tokens, k)
        assert_law(tok, p[k], f"output token {k}")
    a0, a1 = alpha(p[0], q[0]), alpha(p[1], q[1])
    assert_law(res.num_accepted, torch.tensor([1 - a0, a0 * (1 - a1), a0 * a1]), "accepted count")


# ---------------------------------------------------------------------------------------------
# tree with siblings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampled_drafts", [True, False])
def test_tree_with_siblings_output_law(sampled_drafts):
    """Root with two candidates, each with one child: parents [-1, 0, 0, 1, 2]."""
    g = torch.Generator().manual_seed(12)
    parents = torch.tensor([-1, 0, 0, 1, 2]).expand(ROWS, -1)
    logits = logits_for([P[0], P[1], P[1], P[2], P[2]])
    if sampled_drafts:  # siblings i.i.d. with replacement from q0, grandchildren from q1
        d1 = torch.multinomial(Q[0].expand(ROWS, -1), 2, replacement=True, generator=g)
        d2 = torch.multinomial(Q[1].expand(ROWS, -1), 2, replacement=True, generator=g)
        dp = torch.stack([Q[0], Q[1], Q[1], Q[0], Q[0]]).expand(ROWS, -1, -1)  # rows 3, 4 unused
        # both candidates rejected: first against p, second against the residual
        reject_root = (1 - alpha(P[0], Q[0])) * (1 - alpha(residual(P[0], Q[0]), Q[0]))
        a1 = alpha(P[1], Q[1])
    else:  # deterministic: the two most likely distinct tokens, then the argmax
        top2 = Q[0].topk(2).indices
        d1 = top2.expand(ROWS, -1)
        d2 = Q[1].argmax().expand(ROWS, 2)
        dp = None
        reject_root = 1 - float(P[0][top2].sum())  # (1 - p(x)) (1 - p(y) / (1 - p(x)))
        a1 = float(P[1][Q[1].argmax()])
    tokens = torch.cat([torch.zeros(ROWS, 1, dtype=torch.long), d1, d2], 1)
    res = verify_tree(logits, tokens, parents, dp, temperature=1.0, generator=g)

    law = torch.tensor([reject_root, (1 - reject_root) * (1 - a1), (1 - reject_root) * a1])
    assert_law(res.num_accepted, law, "accepted count")
    for k in range(3):
        tok, _ = output_token(res, tokens, k)
        assert_law(tok, P[k], f"output token {k}")
    # the path really goes through the second sibling sometimes
    assert (res.accepted[:, 0] == 2).float().mean() > 0.01


def test_deterministic_siblings_with_q_would_be_biased():
    """Why top-k candidates must come with draft_probs=None: passing q for them is not lossless."""
    g = torch.Generator().manual_seed(13)
    parents = torch.tensor([-1, 0, 0]).expand(ROWS, -1)
    logits = logits_for([P[0], P[1], P[1]])
    top2 = Q[0].topk(2).indices  # drawn WITHOUT replacement
    tokens = torch.cat([torch.zeros(ROWS, 1, dtype=torch.long), top2.expand(ROWS, -1)], 1)
    good = verify_tree(logits, tokens, parents, None, temperature=1.0, generator=g)
    tok, _ = output_token(good, tokens, 0)
    assert_law(tok, P[0], "deterministic siblings, q=None")
    bad = verify_tree(logits, tokens, parents, Q[0].expand(ROWS, 3, -1), temperature=1.0, generator=g)
    tok, _ = output_token(bad, tokens, 0)
    counts = torch.bincount(tok, minlength=5).double() / ROWS
    assert (counts - P[0]).abs().max() > 0.02  # clearly distorted


# ---------------------------------------------------------------------------------------------
# adaptive length must not anticipate (DSpark appendix A)
# ---------------------------------------------------------------------------------------------

P_AB = torch.tensor([0.7, 0.3])
Q_AB = torch.tensor([0.5, 0.5])


def simulate_retrospective(n: int, g: torch.Generator) -> torch.Tensor:
    """A scheduler that decides whether to verify a draft AFTER seeing the drafted token.

    It verifies drafts of A (always accepted, since p(A) > q(A)) and, for drafts of B, drops the
    speculation and samples the target directly. The decision uses token k itself, so the output
    becomes 0.5 * (1, 0) + 0.5 * (0.7, 0.3) = (0.85, 0.15) instead of p = (0.7, 0.3).
    """
    logits = torch.log(torch.stack([P_AB, P_AB])).expand(n, -1, -1)  # [n, 2, 2]
    drafts = torch.multinomial(Q_AB.expand(n, -1), 1, generator=g)  # [n, 1]
    spec = verify_chain(logits, drafts, Q_AB.expand(n, 1, -1), temperature=1.0, generator=g)
    first = torch.where(spec.num_accepted > 0, drafts[:, 0], spec.next_token)
    fresh = torch.multinomial(P_AB.expand(n, -1), 1, generator=g)[:, 0]  # plain target sample
    keep = drafts[:, 0] == 0  # decided after seeing the draft: anticipation
    return torch.where(keep, first, fresh)


def test_retrospective_scheduler_distorts_but_ours_does_not():
    g = torch.Generator().manual_seed(14)
    retro = simulate_retrospective(ROWS, g)
    assert_law(retro, torch.tensor([0.85, 0.15]), "retrospective scheduler")
    # ours: the same mix of 'verify' and 'plain sample', but decided before the draft is drawn
    logits = torch.log(torch.stack([P_AB, P_AB])).expand(ROWS, -1, -1)
    drafts = torch.multinomial(Q_AB.expand(ROWS, -1), 1, generator=g)
    spec = verify_chain(logits, drafts, Q_AB.expand(ROWS, 1, -1), temperature=1.0, generator=g)
    first = torch.where(spec.num_accepted > 0, drafts[:, 0], spec.next_token)
    fresh = torch.multinomial(P_AB.expand(ROWS, -1), 1, generator=g)[:, 0]
    keep = torch.rand(ROWS, generator=g) < 0.5  # independent of the draft
    assert_law(torch.where(keep, first, fresh), P_AB, "non-anticipating scheduler")
    assert_law(first, P_AB, "always verify")
