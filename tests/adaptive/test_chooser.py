"""The math of adaptive speculation: expected tokens, the length chooser on stub cost models whose
answers are worked out by hand, per-row trimming, the calibrator, and the non-anticipation rule
(DSpark appendix A) applied to our own trimming rule.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from drafttrain.decode.calibrator import AcceptanceCalibrator
from drafttrain.decode.planning import choose_length, expected_tokens, stopping_lengths, trim_tree
from drafttrain.decode.tree import DraftTree, chain_tree, compact_tree
from drafttrain.decode.verify import verify_tree


class LinearCost:
    """verify(B, t) = base + per_token * B * t ms; a draft step costs `draft` ms."""

    def __init__(self, base: float, per_token: float, draft: float):
        self.base, self.per_token, self.draft = base, per_token, draft

    def verify_time(self, batch: int, tokens: int) -> float:
        return self.base + self.per_token * batch * tokens

    def draft_time(self, name: str, batch: int) -> float:
        return self.draft


# ---- expected tokens and the length chooser ------------------------------------------------------
def test_expected_tokens_by_hand():
    p = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]])
    # row 0: 1, 1 + .5, 1 + .5 + .25, 1 + .5 + .25 + .25; row 1: a certain first draft, then nothing
    torch.testing.assert_close(expected_tokens(p), torch.tensor([[1.0, 1.5, 1.75, 2.0], [1.0, 2.0, 2.0, 2.0]]))


@pytest.mark.parametrize("alpha", [0.3, 0.9, 1.0])
def test_chooser_picks_zero_when_drafting_cannot_pay(alpha):
    # verification linear in tokens, and a draft token costs as much as verifying one: even drafts
    # that are always accepted give (L + 1) tokens for (2L + 1) units of time, worse than 1 for 1
    cost = LinearCost(base=0.0, per_token=1.0, draft=1.0)
    exp = expected_tokens(torch.full((3, 8), alpha))
    lengths = choose_length(exp, 3, cost, "eagle", torch.ones(3, dtype=torch.bool))
    assert lengths.tolist() == [0, 0, 0]


def test_chooser_picks_the_analytic_best_length():
    # flat-ish verification (a GPU at low load): speedup theory (1 - a^(L+1)) / (1 - a) / cost(L)
    alpha, cost = 0.8, LinearCost(base=10.0, per_token=1.0, draft=0.5)
    best = max(range(9), key=lambda L: (1 - alpha ** (L + 1)) / (1 - alpha) / (10 + (1 + L) + 0.5 * L))
    active = torch.tensor([True, False])  # the finished row neither counts nor changes the answer
    exp = expected_tokens(torch.tensor([[alpha] * 8, [0.0] * 8]))
    lengths = choose_length(exp, 1, cost, "eagle", active)
    assert 0 < best < 8 and lengths.tolist() == [best, 0]


def test_chooser_drafts_less_under_load():
    # compute-bound verification grows with batch x tokens: what pays at batch 1 does not at 16
    cost = LinearCost(base=5.0, per_token=1.0, draft=2.0)
    small = choose_length(expected_tokens(torch.full((1, 8), 0.8)), 1, cost, "eagle", torch.ones(1, dtype=torch.bool))
    big = choose_length(expected_tokens(torch.full((16, 8), 0.8)), 16, cost, "eagle", torch.ones(16, dtype=torch.bool))
    assert int(small[0]) >= 2 and big.tolist() == [0] * 16


# ---- trimming ---------------------------------------------------------------------------------------
def test_stopping_rule_is_a_stopping_time():
    """Whether draft k is kept never depends on estimates of deeper drafts (drawn after it)."""
    g = torch.Generator().manual_seed(0)
    tau = torch.tensor([0.0, 0.5, 0.3, 0.2, 0.1, 0.05])
    for _ in range(50):
        pi = torch.rand(64, 6, generator=g).sort(1, descending=True).values
        pi[:, 0] = 1
        base = stopping_lengths(pi, tau, torch.full((64,), 5))
        for k in range(1, 5):
            changed = pi.clone()
            changed[:, k + 1:] = torch.rand(64, 5 - k, generator=g) * changed[:, k:k + 1]  # any deeper values
            again = stopping_lengths(changed, tau, torch.full((64,), 5))
            assert torch.equal(base >= k, again >= k)


def test_trim_of_deterministic_tree_keeps_the_best_nodes_closed_under_ancestors():
    # root -> a (1), b (2); a -> c (3); with estimates a .9, b .5, c .8 -> cumulative .9, .5, .72
    tree = DraftTree(torch.tensor([[7, 1, 2, 3]]), torch.tensor([[-1, 0, 0, 1]]))
    p = torch.tensor([[1.0, 0.9, 0.5, 0.8]])
    # verify(1, t) = 10 + t: the whole tree pays (3.12 tokens / 14 ms beats 2.62 / 13, 1.9 / 12, 1 / 11)
    keep = trim_tree(tree, p, batch=1, active=torch.tensor([True]), cost_model=LinearCost(10, 1, 0),
                     sunk_ms=0.0, rate=0.0)
    assert keep.tolist() == [[True, True, True, True]]
    # verify(1, t) = 2 + t: the best two nodes, a and its child c (2.62 / 5 beats 3.12 / 6 and 1.9 / 4)
    keep = trim_tree(tree, p, batch=1, active=torch.tensor([True]), cost_model=LinearCost(2, 1, 0),
                     sunk_ms=0.0, rate=0.0)
    assert keep.tolist() == [[True, True, False, True]]
    # with 3 ms of drafting already spent, verifying the whole tree is relatively cheaper
    keep = trim_tree(tree, p, batch=1, active=torch.tensor([True]), cost_model=LinearCost(2, 1, 0),
                     sunk_ms=3.0, rate=0.0)
    assert keep.tolist() == [[True, True, True, True]]  # 3.12 / 9 beats 2.62 / 8
    small, ids = compact_tree(tree, torch.tensor([[True, True, False, True]]))
    assert small.tokens.tolist() == [[7, 1, 3]] and small.parents.tolist() == [[-1, 0, 1]]
    assert ids.tolist() == [[0, 1, 3]]


# ---- calibrator -------------------------------------------------------------------------------------
def test_calibrator_converges_on_a_synthetic_stream():
    g = torch.Generator().manual_seed(1)
    cal = AcceptanceCalibrator(decay=1.0, bins=10)
    for _ in range(20):  # 20 verification steps of 2000 nodes; true law P(accept) = conf^2
        conf = torch.rand(2000, generator=g)
        depth = torch.randint(1, 4, (2000,), generator=g)
        cal.add(conf, depth, torch.rand(2000, generator=g) < conf ** 2)
    centers = torch.arange(10) / 10 + 0.05
    est = cal.prob(centers[None].expand(3, -1), torch.arange(1, 4)[:, None].expand(-1, 10))
    # bin average of c^2 over [i/10, (i+1)/10) is center^2 + 1/1200
    torch.testing.assert_close(est, (centers ** 2 + 1 / 1200)[None].expand(3, -1), atol=0.04, rtol=0)
    torch.testing.assert_close(cal.prior(3), torch.full((3,), 1 / 3), atol=0.02, rtol=0)


def test_calibrator_forgets_and_follows_the_text():
    """With decay, a drafter that stops working is noticed within a few dozen steps."""
    cal = AcceptanceCalibrator(decay=0.95)
    ones, conf = torch.ones(40, dtype=torch.long), torch.full((40,), 0.75)
    for _ in range(100):
        cal.step()
        cal.add(conf, ones, torch.ones(40, dtype=torch.bool))
    assert float(cal.prior(1)[0]) > 0.95
    for _ in range(40):
        cal.step()
        cal.add(conf, ones, torch.zeros(40, dtype=torch.bool))
    assert float(cal.prior(1)[0]) < 0.2
    for _ in range(300):  # no evidence at all (nothing drafted): back towards the prior, so it tries again
        cal.step()
    assert float(cal.prior(1)[0]) > 0.5


def test_untried_depths_follow_the_depth_above():
    """Depth 1 accepted 90 % of the time, deeper depths never tried: they are expected to behave
    like depth 1 (not like the 0.6 prior), so a chooser tries them; their own evidence wins."""
    cal = AcceptanceCalibrator(decay=1.0)
    ones = torch.ones(100, dtype=torch.long)
    cal.add(None, ones, torch.arange(100) < 90)
    prior = cal.prior(4)
    assert float(prior[0]) == pytest.approx(90 / 100, abs=0.02) and (prior[1:] - prior[0]).abs().max() < 1e-6
    cal.add(None, 2 * ones, torch.arange(100) < 30)  # depth 2 disappoints: learned from its trials
    prior = cal.prior(3)
    assert float(prior[1]) == pytest.approx(0.3, abs=0.03) and float(prior[2]) == pytest.approx(float(prior[1]))


def test_calibrator_learns_from_a_verified_tree():
    cal = AcceptanceCalibrator(decay=1.0, prior_strength=1e-6)
    from drafttrain.decode.verify import VerifyResult

    tree = chain_tree(torch.tensor([1, 1]), torch.tensor([[4, 5, 6], [4, 5, 6]]), confidence=torch.full((2, 3), 0.55))
    # row 0 accepts 2 (tests depths 1, 2, 3: 1 miss at depth 3), row 1 accepts none (tests depth 1 only)
    res = VerifyResult(torch.tensor([[1, 2, -1], [-1, -1, -1]]), torch.tensor([2, 0]), torch.tensor([9, 9]),
                       torch.tensor([2, 0]))
    cal.update(tree, res)
    assert cal.depth_n[:3].tolist() == [2, 1, 1] and cal.depth_a[:3].tolist() == [1, 1, 0]
    assert cal.prob(torch.tensor([[1.0, 0.55]]), torch.tensor([[0, 1]]))[0].tolist() == pytest.approx([1.0, 0.5], abs=1e-4)


def test_confidences_outside_0_1_read_the_edge_bins():
    """A drafter's confidence can be NaN (a 0/0 softmax row), 1.0 exactly or above it (rounding):
    NaN and negatives read the lowest bin, 1.0 and above the highest, never an index error."""
    cal = AcceptanceCalibrator(decay=1.0, prior_strength=1e-3)
    depth = torch.ones(40, dtype=torch.long)
    cal.add(torch.full((20,), 0.05), depth[:20], torch.zeros(20, dtype=torch.bool))  # bin 0: rejected
    cal.add(torch.full((20,), 0.95), depth[20:], torch.ones(20, dtype=torch.bool))  # bin 9: accepted
    conf = torch.tensor([[1.0, float("nan"), -0.5, 0.0, 1.0, 7.0, float("inf")]])
    est = cal.prob(conf, torch.tensor([[0, 1, 1, 1, 1, 1, 1]]))[0].tolist()
    assert est[0] == 1.0  # the root
    assert est[1:4] == pytest.approx([0.0] * 3, abs=1e-3) and est[4:] == pytest.approx([1.0] * 3, abs=1e-3)


def _random_tree(gen: torch.Generator, chain: bool, sampled: bool) -> tuple[DraftTree, Tensor]:
    """A random one-row draft tree (chain or tree, trailing padding) and calibrated estimates."""
    n = int(torch.randint(1, 7, (1,), generator=gen))
    parents = [-1] + [j - 1 if chain else int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n + 1)]
    parents += [-2] * int(torch.randint(0, 3, (1,), generator=gen))
    N = len(parents)
    probs = torch.rand(1, N, 5, generator=gen) if sampled else None
    conf = torch.rand(1, N, generator=gen)
    tree = DraftTree(torch.randint(0, 5, (1, N), generator=gen), torch.tensor([parents]), probs, conf)
    p = torch.rand(1, N, generator=gen) ** 0.5  # mostly likely drafts, so trims keep a few
    return tree, torch.where(torch.tensor([parents]) == -2, 0.0, p)


@pytest.mark.parametrize("sampled", [True, False])
def test_a_single_row_trims_as_the_batched_path_does(sampled):
    """Batch 1 trims in Python floats (`planning._trim_row`); a second, finished row sends the
    same row through the array path, whose decisions it must repeat exactly."""
    gen = torch.Generator().manual_seed(7)
    cost = LinearCost(base=10.0, per_token=0.4, draft=0.5)
    cost.verify_time = lambda batch, tokens: 10.0 + 0.1 * batch * tokens ** 2  # each extra token dearer
    for trial in range(300):
        tree, p = _random_tree(gen, chain=sampled or trial % 2 == 0, sampled=sampled)
        rate = float(torch.rand(1, generator=gen)) * 0.3
        for active in (True, False):
            one = trim_tree(tree, p, batch=1, active=torch.tensor([active]), cost_model=cost, sunk_ms=1.5, rate=rate)
            two = DraftTree(tree.tokens.repeat(2, 1), tree.parents.repeat(2, 1),
                            None if tree.draft_probs is None else tree.draft_probs.repeat(2, 1, 1),
                            tree.confidence.repeat(2, 1))
            both = trim_tree(two, p.repeat(2, 1), batch=1, active=torch.tensor([active, False]), cost_model=cost,
                             sunk_ms=1.5, rate=rate)
            assert one.tolist() == both[:1].tolist(), (trial, active, tree.parents.tolist(), p.tolist())


def test_a_single_row_plans_as_the_batched_path_does():
    """Batch 1 plans in Python floats (`planning.row_length_rates`, `AcceptanceCalibrator.row_prior`):
    the same rates, to the last bit, as the array path, over calibrators with random evidence."""
    from drafttrain.decode.costmodel import CostModel
    from drafttrain.decode.planning import length_rates, row_length_rates

    gen = torch.Generator().manual_seed(5)
    cm = CostModel({(1, t): 17.0 + 0.6 * t + 0.05 * t * t for t in (1, 2, 3, 4, 6, 9)}, {"eagle": {1: 0.86}}, {},
                   None, {"eagle": {1: 0.74}})
    for trial in range(100):
        cal = AcceptanceCalibrator(decay=0.9 + 0.1 * float(torch.rand(1, generator=gen)))
        cal.reset_rows(1)
        for _ in range(int(torch.randint(0, 30, (1,), generator=gen))):
            n = int(torch.randint(1, 9, (1,), generator=gen))
            cal.add(torch.rand(n, generator=gen), torch.randint(1, 9, (n,), generator=gen),
                    torch.rand(n, generator=gen) < 0.6, torch.zeros(n, dtype=torch.long))
            cal.step()
        L = int(torch.randint(1, 9, (1,), generator=gen))
        batched = length_rates(expected_tokens(cal.batch_prior(L, 1)), 1, cm, "eagle", torch.tensor([True]))
        assert row_length_rates(cal.row_prior(L), cm, "eagle") == batched, trial
    assert AcceptanceCalibrator().row_prior(3) == AcceptanceCalibrator().batch_prior(3, 1)[0].tolist()  # no rows yet


def test_a_single_chain_is_counted_as_the_batched_path_counts_it():
    """Batch 1 chains are counted in Python scalars (`AcceptanceCalibrator._update_chain`); the same
    chain as row 0 of two (row 1 not counted) goes through the array path: equal counts."""
    from drafttrain.decode.verify import VerifyResult

    gen = torch.Generator().manual_seed(3)
    fast, slow = AcceptanceCalibrator(decay=0.97), AcceptanceCalibrator(decay=0.97)
    for _ in range(200):
        tree, _ = _random_tree(gen, chain=True, sampled=bool(torch.rand(1, generator=gen) < 0.5))
        real = int((tree.parents[0, 1:] != -2).sum())
        n = int(torch.randint(0, real + 1, (1,), generator=gen))
        acc = torch.full((1, tree.size - 1), -1)
        acc[0, :n] = torch.arange(1, n + 1)
        res = VerifyResult(acc, torch.tensor([n]), torch.tensor([0]), torch.tensor([n]))
        fast.update(tree, res)
        two = DraftTree(tree.tokens.repeat(2, 1), tree.parents.repeat(2, 1), None, tree.confidence.repeat(2, 1))
        slow.update(two, VerifyResult(acc.repeat(2, 1), torch.tensor([n, n]), torch.tensor([0, 0]), torch.tensor([n, n])),
                    torch.tensor([True, False]))
    for name in ("depth_n", "depth_a", "cell_n", "cell_a"):
        assert getattr(fast, name).tolist() == getattr(slow, name).tolist(), name
    assert fast.row_n[0].tolist() == slow.row_n[0].tolist() and fast.row_a[0].tolist() == slow.row_a[0].tolist()
    assert fast.depth_n[0] > 1 and fast.depth_a[1] > 0  # evidence at several depths was counted


# ---- non-anticipation: the DSpark example against our trimming rule ----------------------------------
ROWS = 200_000
P_AB = torch.tensor([0.7, 0.3])


def assert_law(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Per-bin |count - n p| <= 6 sqrt(n p (1 - p)) + 5 (as in tests/decode/test_verify_stats.py)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    p = probs.double() / probs.sum()
    bad = (counts - n * p).abs() > 6 * torch.sqrt(n * p * (1 - p)) + 5
    assert not bad.any(), f"{what}: counts {counts.tolist()} vs expected {(n * p).tolist()}"


def _first_token_after_trim(confidence: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                            g: torch.Generator) -> torch.Tensor:
    """One-draft chains, trimmed by our rule (calibrated p = conf, keep iff p >= 0.5), verified."""
    tree = chain_tree(torch.zeros(ROWS, dtype=torch.long), drafts[:, None], q[:, None], confidence[:, None])
    cal = AcceptanceCalibrator(decay=1.0, prior_strength=1e-6)
    cal.add(torch.tensor([0.25, 0.55, 0.85]), torch.ones(3, dtype=torch.long), torch.tensor([False, False, True]))
    p = cal.prob(tree.confidence, tree.depths())  # conf in bin .5 -> 0, bin .8 -> 1
    # verify(B, t) = B t: tau_1 = rate * B / B = rate
    keep = trim_tree(tree, p, batch=ROWS, active=torch.ones(ROWS, dtype=torch.bool), cost_model=LinearCost(0, 1, 0),
                     sunk_ms=0.0, rate=0.5, free_extension=False)
    small, _ = compact_tree(tree, keep)
    logits = torch.log(P_AB).expand(ROWS, small.size, -1)
    res = verify_tree(logits, small.tokens, small.parents, small.draft_probs, temperature=1.0, generator=g)
    return torch.where(res.num_accepted > 0, small.tokens[:, 1], res.next_token)


def test_trimming_on_confidence_known_before_the_draw_is_lossless():
    """Half the rows draft from q1 = (.8, .2), half from q2 = (.5, .5). Our confidence is q's top
    probability (known before the draw): q1 rows are verified, q2 rows are not. The output law
    stays p. Trimming on q(x) of the DRAWN token instead (what 'the sampled token's q' would do)
    keeps q1 drafts of A and drops drafts of B: the DSpark bias, here (0.77, 0.23)."""
    g = torch.Generator().manual_seed(2)
    q = torch.where((torch.arange(ROWS) % 2 == 0)[:, None], torch.tensor([0.8, 0.2]), torch.tensor([0.5, 0.5]))
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    ours = _first_token_after_trim(q.max(-1).values, q, drafts, g)
    assert_law(ours, P_AB, "trim on the top probability of q")
    drawn = _first_token_after_trim(q.gather(1, drafts[:, None])[:, 0], q, drafts, g)
    # q1 rows: A kept -> accept .875 else the residual (B); B dropped -> p.  q2 rows: dropped -> p
    q1 = 0.8 * torch.tensor([0.875, 0.125]) + 0.2 * P_AB
    assert_law(drawn, 0.5 * q1 + 0.5 * P_AB, "trim on q(x) of the drawn token")
