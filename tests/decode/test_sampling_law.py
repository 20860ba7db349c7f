"""The whole decoder's sampling law at T != 1 with top-k / top-p, against laws written by hand.

Every test runs `speculative_generate` end to end on a stub target, `BigramLM`, whose logits are a
fixed table row of the last token fed (an order-one model; a real target has V ~ 256k and a
context-dependent p, but the decoder only ever sees p and q, so this is the law test). The law
of the first two emitted tokens is then p1 = law(row ROOT) and J[x1, x2] = p1[x1] law(row x1)[x2],
where `law` is temperature / top-k / top-p written again in float64 numpy from the
`process_logits` docstring: the expectation never calls the code under test. The joint law
crosses a verify step (tokens 1 and 2 come from different steps in rows that rejected early).
Proposers: a draft LM sampling chains, a sampled tree with sibling candidates (the residual
update), n-gram lookup and a draft LM's static tree (deterministic drafts, one-hot q), and the
adaptive proposer trimming sampled chains per row.

Design: 12 tokens, 10k rows per run (one batch, one seed per row), T in {0.6, 1.5}. The target's
logits are T * BASE, so the processed law at the right temperature is BASE's at T = 1 for both
temperatures and a relative temperature error moves it alike; T^2 in place of T moves it in
opposite directions (sharper at 0.6, flatter at 1.5). Each bin must satisfy
|count - n p| <= 6 sqrt(n p (1 - p)) + 5 (REFERENCES.md, "Measuring"; a false alarm is a ~1e-9
event per bin) and a token of probability 0 must never appear (exact, not statistical). The
`test_power_*` tests prove the bounds can fail: at the n used, the law under each bug (T^2, 1.2 T,
T / 1.2, the residual update without its mass factor, top-k dropping ties, top-p's boundary off
by one) puts the expected count of some checked bin at least 4 of its own standard deviations
outside the bound (the weakest, 1.2 T with top-k, is 8.4).

Deliberately not here: greedy equality (test_engine.py), verification on hand-made tensors
(test_verify_stats.py), real model families, the Triton chain kernel (GPU only).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from drafttrain.decode import (
    AcceptanceCalibrator,
    AdaptiveProposer,
    DecodeState,
    DecodeStats,
    DraftTree,
    Proposer,
    speculative_generate,
)
from drafttrain.decode.proposers import DraftLMProposer, NGramProposer
from drafttrain.decode.verify import VerifyResult

V = 12  # vocabulary
ROOT = 0  # last prompt token of every row
N_ROWS = 10_000  # rows per run (test_power_temperature_errors / test_power_mass_factor size it)
MIN_SIGMAS = 4.0  # a bug's expected count must lie this many of its own SDs beyond the bound


# ---- the stub target ----------------------------------------------------------------------------
class BigramLM(nn.Module):
    """A stub causal LM: the logits after token t are `table[t]`, whatever came before.

    It ignores the KV cache, the attention mask and the positions, so its law is known by hand,
    and implements only what the engine touches: `config` (no layer types: plain causal masks),
    `get_output_embeddings`, `get_decoder` (prefill's body-only forward) and `forward(...).logits`.
    """

    def __init__(self, table: Tensor):
        super().__init__()
        self.table = nn.Parameter(table.float(), requires_grad=False)  # [V, V], row = previous token
        self.config = SimpleNamespace()

    def get_output_embeddings(self) -> None:
        return None

    def get_decoder(self) -> Callable[..., SimpleNamespace]:
        return lambda **kwargs: SimpleNamespace(last_hidden_state=None, hidden_states=())

    def forward(self, input_ids: Tensor, **kwargs) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])  # [B, n, V]


def _tables() -> tuple[Tensor, Tensor]:
    """BASE: each row a permutation of one logit profile (distinct values: no accidental ties);
    DRAFT: BASE plus unit Gaussian noise (its drafts are accepted 40-85 % of the time, by row)."""
    profile = torch.tensor([3.0, 2.0, 1.2, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5])
    g = torch.Generator().manual_seed(7)
    base = torch.stack([profile[torch.randperm(V, generator=g)] for _ in range(V)])
    return base, base + torch.randn(V, V, generator=g)


BASE, DRAFT = _tables()

# (temperature, top_k, top_p): each sampling filter at a low and a high temperature
CASES = [(0.6, 4, 1.0), (0.6, 0, 0.9), (1.5, 4, 1.0), (1.5, 0, 0.9)]
CASE_IDS = ["T0.6-topk4", "T0.6-topp0.9", "T1.5-topk4", "T1.5-topp0.9"]
# sampled trees: SIBLINGS candidates under the root, each with one child
SIBLINGS = 3
FLAT = 0.5  # the sibling drafter: the target's own logits halved (the target at twice the temperature)
SIBLING_CASES, SIBLING_IDS = [CASES[0], CASES[3]], [CASE_IDS[0], CASE_IDS[3]]


# ---- the expected law, written independently of decode/sampling.py -------------------------------
def law(logits: Tensor | np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, *,
        keep_ties: bool = True, strict_top_p: bool = False) -> np.ndarray:
    """The sampling law of logit rows ([..., V] -> [..., V] float64), per the process_logits docstring.

    Temperature, then top-k (tokens tied with the k-th largest logit are all kept), then top-p (most
    probable first, equal probabilities in index order; a token is dropped when the mass strictly
    before it reaches top_p; the most probable is always kept). `keep_ties=False` (exactly k kept,
    lowest index first) and `strict_top_p=True` (dropped only when the mass before it exceeds top_p)
    are two classic bugs, for the power tests.
    """
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim > 1:
        return np.stack([law(r, temperature, top_k, top_p, keep_ties=keep_ties, strict_top_p=strict_top_p)
                         for r in x])
    x = x / temperature
    if 0 < top_k < x.size:
        order = np.argsort(-x, kind="stable")
        kth = x[order[top_k - 1]]
        assert not 0 < kth - x[order[top_k]] < 1e-4, "design: near-tie at the k-th logit (float32 may differ)"
        keep = x >= kth if keep_ties else np.isin(np.arange(x.size), order[:top_k])
        x = np.where(keep, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass strictly before each token
        assert not ((np.abs(before - top_p) < 1e-5) & (before != top_p)).any(), "design: mass near top_p"
        drop = before > top_p if strict_top_p else before >= top_p
        drop[0] = False
        p[order[drop]] = 0.0
        p /= p.sum()
    return p


def joint_law(logits: Tensor, root: int, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """[V, V] law of the first two tokens after `root` under a bigram logit table [V, V]."""
    rows = law(logits, temperature, top_k, top_p)  # [V, V] law after each token
    return rows[root][:, None] * rows


def alpha(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Acceptance probability of a draft drawn from q against p: sum(min(p, q)) over the last axis."""
    return np.minimum(p, q).sum(-1)


def sibling_law(p: np.ndarray, q: np.ndarray, k: int, *, mass_factor: bool = True
                ) -> tuple[np.ndarray, np.ndarray, float]:
    """k candidates drawn i.i.d. from q, tried in turn against the residual (SpecInfer).

    Returns (law of the token emitted at this node, P(the accepted candidate is x) [V], P(all
    rejected)). `mass_factor=False` is the bug that updates the unnormalised residual r (mass s) to
    max(r - q, 0) instead of max(r - s q, 0); an empty residual falls back to p, as in verify.py.
    """
    r, s, reach = p.copy(), 1.0, 1.0
    accepted = np.zeros_like(p)
    for _ in range(k):
        hit = np.minimum(q, r / s)  # P(candidate = x and accepted | this candidate is reached)
        accepted += reach * hit
        reach *= 1.0 - hit.sum()
        r = np.maximum(r - (s if mass_factor else 1.0) * q, 0.0)
        s = r.sum()
        if s <= 0:
            r, s = p.copy(), 1.0
    return accepted + reach * r / s, accepted, reach


# ---- the bound ----------------------------------------------------------------------------------
def bound(probs: np.ndarray, n: int) -> np.ndarray:
    return 6 * np.sqrt(n * probs * (1 - probs)) + 5


def assert_law(samples: Tensor, probs: np.ndarray, what: str, *, sort: bool = False) -> None:
    """Per-bin 6-sigma (+5) check of integer samples against `probs` (flattened), and no sample
    where `probs` is 0. `sort=True` compares sorted counts with sorted probabilities (a law known
    only up to which of several tied tokens carry it)."""
    p = probs.ravel()
    n = samples.numel()
    counts = np.bincount(samples.reshape(-1).numpy(), minlength=p.size).astype(np.float64)
    assert counts.size == p.size, f"{what}: a sample outside 0..{p.size - 1}"
    if sort:
        counts, p = np.sort(counts)[::-1], np.sort(p)[::-1]
    else:
        excluded = np.flatnonzero((p == 0) & (counts > 0))
        assert excluded.size == 0, f"{what}: emitted bins {excluded.tolist()}, which the law excludes"
    excess = np.abs(counts - n * p) - bound(p, n)
    worst = np.argsort(-excess)[:4]
    assert (excess <= 0).all(), (f"{what}: bins {worst.tolist()} counts {counts[worst].tolist()} vs "
                                 f"expected {np.round(n * p[worst], 1).tolist()} (n = {n})")


def sigmas_beyond_bound(probs: np.ndarray, wrong: np.ndarray, n: int) -> float:
    """How far outside the bound around `probs` the expected counts of `wrong` lie, at the best bin,
    in `wrong`'s own binomial SDs (>= 4: a bug with law `wrong` fails the check w.p. >= 1 - 3e-5)."""
    p, w = probs.ravel(), wrong.ravel()
    sd = np.sqrt(np.maximum(n * w * (1 - w), 1.0))
    return float(((np.abs(n * (w - p)) - bound(p, n)) / sd).max())


# ---- running the decoder ------------------------------------------------------------------------
def generate(proposer: Proposer, temperature: float, top_k: int, top_p: float, *, seed0: int,
             n: int = N_ROWS, table: Tensor = BASE, prompt: list[int] | None = None,
             max_new_tokens: int = 2, **kwargs) -> tuple[Tensor, VerifyResult, DecodeStats]:
    """n copies of `prompt` (default [ROOT]) through the engine on BigramLM(T * table), one seed
    per row (seed0 + row).

    Returns (tokens [n, max_new_tokens], the first step's VerifyResult, stats). The first step's
    result is read by wrapping `proposer.observe`; no row has left the batch by then, so its rows
    are the caller's rows.
    """
    first: list[VerifyResult] = []
    observe = proposer.observe

    def spy(state: DecodeState, tree: DraftTree, result: VerifyResult, hidden: dict, **kw) -> None:
        if not first:
            first.append(result)
        observe(state, tree, result, hidden, **kw)

    proposer.observe = spy
    ids = torch.tensor(prompt or [ROOT]).expand(n, -1)
    out = speculative_generate(BigramLM(temperature * table), proposer, ids, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=list(range(seed0, seed0 + n)), eos_token_id=[], **kwargs)
    tokens = torch.tensor(out.sequences)
    assert tokens.shape == (n, max_new_tokens)
    return tokens, first[0], out.stats


def assert_first_two(tokens: Tensor, temperature: float, top_k: int, top_p: float) -> None:
    """The first token follows p1 and the first two follow J (see the module docstring)."""
    logits = temperature * BASE  # what the target returns
    assert_law(tokens[:, 0], law(logits[ROOT], temperature, top_k, top_p), "first token")
    joint = joint_law(logits, ROOT, temperature, top_k, top_p)
    assert_law(tokens[:, 0] * V + tokens[:, 1], joint, "first two tokens")


# ---- power: the bounds at N_ROWS see each bug ----------------------------------------------------
@pytest.mark.parametrize("temperature, top_k, top_p", CASES, ids=CASE_IDS)
def test_power_temperature_errors(temperature: float, top_k: int, top_p: float):
    """T^2, 1.2 T and T / 1.2 in place of T break the first-token or joint check at N_ROWS rows
    (every test below checks these two laws at one of CASES with N_ROWS rows)."""
    logits = temperature * BASE
    p1 = law(logits[ROOT], temperature, top_k, top_p)
    joint = joint_law(logits, ROOT, temperature, top_k, top_p)
    for wrong_t in (temperature**2, temperature * 1.2, temperature / 1.2):
        p1_bad = law(logits[ROOT], wrong_t, top_k, top_p)
        joint_bad = joint_law(logits, ROOT, wrong_t, top_k, top_p)
        power = max(sigmas_beyond_bound(p1, p1_bad, N_ROWS), sigmas_beyond_bound(joint, joint_bad, N_ROWS))
        assert power >= MIN_SIGMAS, f"T' = {wrong_t:.3f}: only {power:.1f} sigmas beyond the bound"


@pytest.mark.parametrize("temperature, top_k, top_p", SIBLING_CASES, ids=SIBLING_IDS)
def test_power_mass_factor(temperature: float, top_k: int, top_p: float):
    """Dropping the residual's mass factor breaks the first-token or the accepted-count check of
    test_sampled_sibling_tree_follows_target (and the hand-written walk itself is lossless)."""
    p = law(temperature * BASE[ROOT], temperature, top_k, top_p)
    q = law(temperature * FLAT * BASE[ROOT], temperature, top_k, top_p)
    good, _, none_good = sibling_law(p, q, SIBLINGS)
    np.testing.assert_allclose(good, p, atol=1e-12)
    bad, _, none_bad = sibling_law(p, q, SIBLINGS, mass_factor=False)
    power = max(sigmas_beyond_bound(p, bad, N_ROWS),
                sigmas_beyond_bound(np.array([none_good]), np.array([none_bad]), N_ROWS))
    assert power >= MIN_SIGMAS, f"only {power:.1f} sigmas beyond the bound"


def test_power_top_k_ties_and_top_p_boundary():
    """Keeping exactly k of tied logits, or a token whose preceding mass equals top_p, breaks
    test_top_k_ties_and_top_p_boundary at TIE_ROWS rows."""
    for kind, (temperature, top_k, top_p, row) in TIE_CASES.items():
        good = law(temperature * row, temperature, top_k, top_p)
        bad = law(temperature * row, temperature, top_k, top_p, keep_ties=False, strict_top_p=True)
        if kind == "top-p-boundary":  # checked up to a permutation of the tied tokens
            good, bad = np.sort(good), np.sort(bad)
        power = sigmas_beyond_bound(good, bad, TIE_ROWS)
        assert power >= MIN_SIGMAS, f"{kind}: only {power:.1f} sigmas beyond the bound"


# ---- sampled chains -----------------------------------------------------------------------------
@pytest.mark.parametrize("temperature, top_k, top_p", CASES, ids=CASE_IDS)
def test_sampled_chain_follows_target(temperature: float, top_k: int, top_p: float):
    """A draft LM (a stub bigram near the target) samples chains of 2: the first two tokens follow
    the target's law, and the first step's accepted count follows (1 - a0, a0 - P2, P2) with
    a0 = alpha(p1, q1) and P2 = sum_x min(p1, q1)(x) alpha(p(.|x), q(.|x))."""
    proposer = DraftLMProposer(BigramLM(temperature * DRAFT))
    tokens, first, _ = generate(proposer, temperature, top_k, top_p, seed0=0, gamma=2)
    assert_first_two(tokens, temperature, top_k, top_p)

    p = law(temperature * BASE, temperature, top_k, top_p)  # [V, V]: p after each token
    q = law(temperature * DRAFT, temperature, top_k, top_p)  # [V, V]: q after each token
    a0 = alpha(p[ROOT], q[ROOT])
    both = float((np.minimum(p[ROOT], q[ROOT]) * alpha(p, q)).sum())
    assert_law(first.num_accepted, np.array([1 - a0, a0 - both, both]), "accepted drafts, first step")


# ---- sampled trees with siblings (the residual update) ----------------------------------------------
class SampledSiblingsProposer(Proposer):
    """Draws SIBLINGS candidates i.i.d. (with replacement) from q at the root and one child from q
    under each: a sampled tree, so verification tries each sibling against the residual left by
    the previous one. q is a law table [V, V] given by the test (any q is lossless)."""

    name = "sampled-siblings"

    def __init__(self, q: np.ndarray, seed: int):
        self.q = torch.tensor(q, dtype=torch.float32)  # [V, V]: q after each token
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, state: DecodeState) -> DraftTree:
        B, k = state.root.shape[0], SIBLINGS
        sib = torch.multinomial(self.q[state.root], k, replacement=True, generator=self.generator)  # [B, k]
        child = torch.multinomial(self.q[sib.reshape(-1)], 1, generator=self.generator).reshape(B, k)
        tokens = torch.cat([state.root[:, None], sib, child], 1)  # [B, 1 + 2k]
        parents = torch.tensor([-1] + [0] * k + list(range(1, k + 1))).expand(B, -1)
        probs = torch.zeros(B, 1 + 2 * k, V)  # node i: the q its children were drawn from (leaves: unused)
        probs[:, 0] = self.q[state.root]
        probs[:, 1 : 1 + k] = self.q[sib]
        return DraftTree(tokens, parents, probs)

    def select_rows(self, idx: Tensor) -> bool:
        return True  # no per-row state


@pytest.mark.parametrize("temperature, top_k, top_p", SIBLING_CASES, ids=SIBLING_IDS)
def test_sampled_sibling_tree_follows_target(temperature: float, top_k: int, top_p: float):
    """Three sibling drafts from a flat drafter (all three rejected in 6-12 % of rows): the first two
    tokens follow the target, and the first step's accepted count follows the SpecInfer walk."""
    q = law(temperature * FLAT * BASE, temperature, top_k, top_p)  # [V, V]: q after each token
    tokens, first, _ = generate(SampledSiblingsProposer(q, seed=1), temperature, top_k, top_p, seed0=100_000)
    assert_first_two(tokens, temperature, top_k, top_p)

    p = law(temperature * BASE, temperature, top_k, top_p)
    _, hit, none = sibling_law(p[ROOT], q[ROOT], SIBLINGS)
    both = float((hit * alpha(p, q)).sum())  # a sibling accepted, then its child
    assert_law(first.num_accepted, np.array([none, 1 - none - both, both]), "accepted drafts, first step")
    assert (first.accepted[:, 0] > 1).sum() > N_ROWS // 50  # a later sibling accepted after a rejection


# ---- deterministic drafts (one-hot q) -----------------------------------------------------------------
def test_ngram_chain_follows_target():
    """Prompt lookup drafts (b, c) deterministically after [ROOT, b, c, ROOT]: b is accepted with
    p1(b), then c with p(c|b); the emitted law is still the target's."""
    temperature, top_k, top_p = CASES[3]
    p = law(temperature * BASE, temperature, top_k, top_p)
    b = int(np.argsort(-p[ROOT])[1])  # the second most likely first token: often rejected
    c = int(np.argmax(p[b]))
    assert ROOT not in (b, c) and b != c  # so the lookup finds exactly [ROOT] -> (b, c)
    tokens, first, _ = generate(NGramProposer(), temperature, top_k, top_p, seed0=200_000,
                                prompt=[ROOT, b, c, ROOT], gamma=2)
    assert_first_two(tokens, temperature, top_k, top_p)
    a0, a1 = p[ROOT, b], p[b, c]
    assert_law(first.num_accepted, np.array([1 - a0, a0 * (1 - a1), a0 * a1]), "accepted drafts, first step")


def test_draft_lm_static_tree_follows_target():
    """A draft LM's top-2 candidates x, y under the root, its top-1 c below x: deterministic siblings
    (draft_probs None), so a rejection zeroes the rejected token in the residual; accepted counts
    follow (1 - p(x) - p(y), p(x) (1 - p(c|x)) + p(y), p(x) p(c|x))."""
    temperature, top_k, top_p = CASES[0]
    proposer = DraftLMProposer(BigramLM(temperature * DRAFT))
    tokens, first, _ = generate(proposer, temperature, top_k, top_p, seed0=300_000, tree=[(0,), (1,), (0, 0)])
    assert_first_two(tokens, temperature, top_k, top_p)
    p = law(temperature * BASE, temperature, top_k, top_p)
    x, y = DRAFT[ROOT].topk(2).indices.tolist()
    c = int(DRAFT[x].argmax())
    deep = p[ROOT, x] * p[x, c]
    law_n = np.array([1 - p[ROOT, x] - p[ROOT, y], p[ROOT, x] + p[ROOT, y] - deep, deep])
    assert_law(first.num_accepted, law_n, "accepted drafts, first step")


# ---- adaptive length --------------------------------------------------------------------------------
class PerRowCost:
    """verify(B, t) = 1 + 4e-6 B t ms and 0.01 ms per draft step: at B = 10k chains of 1-3 pay."""

    def verify_time(self, batch: int, tokens: int) -> float:
        return 1.0 + 4e-6 * batch * tokens

    def draft_time(self, name: str, batch: int) -> float:
        return 0.01

    def at(self, temperature: float) -> PerRowCost:
        return self  # the same prices at every temperature


def calibrated() -> AcceptanceCalibrator:
    """A calibrator that has seen 20k draft nodes accepted with probability = their confidence."""
    cal = AcceptanceCalibrator(decay=1.0)
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(20_000, generator=g)
    cal.add(conf, torch.randint(1, 5, (20_000,), generator=g), torch.rand(20_000, generator=g) < conf)
    return cal


def test_adaptive_chain_follows_target():
    """Sampled chains trimmed per row by the adaptive proposer's stopping rule (decided before each
    draft is drawn): the first two tokens still follow the target."""
    temperature, top_k, top_p = CASES[2]
    proposer = AdaptiveProposer(DraftLMProposer(BigramLM(temperature * DRAFT)), PerRowCost(), max_gamma=3,
                                calibrator=calibrated(), free_extension=False)
    tokens, _, stats = generate(proposer, temperature, top_k, top_p, seed0=400_000)
    assert_first_two(tokens, temperature, top_k, top_p)
    used = [length for length, count in enumerate(stats.chosen_lengths) if count > N_ROWS // 100]
    assert len(used) >= 2, f"chosen lengths {stats.chosen_lengths}: rows should verify different lengths"
    assert stats.accept_counts[0] > N_ROWS // 4


# ---- tie and boundary rules ---------------------------------------------------------------------------
TIE_ROWS = 3000
_X = float("-inf")  # masked
TIE_CASES = {  # kind: (temperature, top_k, top_p, logits after ROOT, divided by T)
    # top_k = 2 and three logits tie with the 2nd: all four are kept
    "top-k-ties": (1.5, 2, 1.0, torch.tensor([-1.0, 0, -1, 2, -1, 1, -1, 1, 1, -1, -1, -1])),
    # four equal logits, the rest masked: exactly 0.25 each, so the 3rd one's preceding mass is
    # exactly top_p = 0.5 and two are kept (which two of the tied four, the docstring leaves open)
    "top-p-boundary": (0.6, 0, 0.5, torch.tensor([_X, _X, 0, _X, 0, _X, 0, _X, _X, 0, _X, _X])),
}


@pytest.mark.parametrize("kind", list(TIE_CASES))
def test_top_k_ties_and_top_p_boundary(kind: str):
    """The first token after a root whose logits tie at the top-k / top-p cut. A uniform draft LM
    proposes chains of 2, so drafts are both accepted and rejected (the residual emits)."""
    temperature, top_k, top_p, row = TIE_CASES[kind]
    tokens, first, _ = generate(DraftLMProposer(BigramLM(torch.zeros(V, V))), temperature, top_k, top_p,
                                seed0=500_000, n=TIE_ROWS, table=row.expand(V, -1), max_new_tokens=1, gamma=2)
    probs = law(temperature * row, temperature, top_k, top_p)
    assert_law(tokens[:, 0], probs, kind, sort=kind == "top-p-boundary")
    if kind == "top-p-boundary":
        assert set(tokens[:, 0].tolist()) <= set(torch.nonzero(row == 0)[:, 0].tolist())
    assert 0 < int((first.num_accepted > 0).sum()) < TIE_ROWS
