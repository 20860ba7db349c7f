"""Adaptive and hybrid proposers in the generate loop: output equal to the target's own (greedy) or
following its law (sampling), choices that show up in the stats, and parts that keep drafting
correctly after steps whose verified tree was not theirs.

Tiny targets (hidden 64, 4 layers, vocab 257 or 16) stand in for e.g. Gemma 3 270M (640 / 18 /
262144). Drafters: a random tiny EAGLE-3 (weak: almost never accepted), n-gram lookup, and a draft
LM that is the target with 0.2 % weight noise (strong but imperfect); for the sampling tests a
random 1-layer draft LM. Losslessness must hold for any drafter.
"""

from __future__ import annotations

import functools

import pytest
import torch

from drafttrain.decode import (
    AcceptanceCalibrator,
    AdaptiveProposer,
    CostModel,
    HybridProposer,
    load_proposer,
    speculative_generate,
)
from drafttrain.decode.proposers import DraftLMProposer, EagleProposer, NGramProposer, Proposer
from drafttrain.decode.tree import chain_tree
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import record_proposals, strong_draft_lm, tiny_target

MAX_NEW = 32


@functools.cache
def target(family: str = "llama", vocab_size: int = 257):
    return tiny_target(family, vocab_size=vocab_size)


@functools.cache
def eagle_drafter(family: str = "llama") -> EagleDrafter:
    model = target(family)
    torch.manual_seed(0)
    return EagleDrafter(config_from_target(model.config, draft_vocab_size=None)).attach_target(model).eval()


@functools.cache
def draft_lm(family: str = "llama", vocab_size: int = 257):
    """A random 1-layer draft LM."""
    return tiny_target(family, vocab_size=vocab_size, seed=7, num_layers=1)


@functools.cache
def strong_lm():
    """The target with 0.2 % weight noise: accepted often, not always."""
    return strong_draft_lm()


def reference(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], do_sample=False,
                         max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def prompts(batch: int) -> list[torch.Tensor]:
    """Repetitive prompts (so n-gram lookup finds matches) of different lengths."""
    g = torch.Generator().manual_seed(5)
    out = []
    for n in (14, 5, 9)[:batch]:
        base = torch.randint(3, 257, (n,), generator=g)
        out.append(torch.cat([base, base[: n // 2 + 1]]))
    return out


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(rows):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    return ids, mask


def gpu_like() -> CostModel:
    """A flat-ish verification (10 ms + a little per token) and cheap draft steps: drafting pays."""
    verify = {(b, t): 10.0 + 0.2 * b * t for b in (1, 4) for t in (1, 2, 4, 8)}
    return CostModel(verify, {"eagle": {1: 0.8, 4: 1.0}, "draft-lm": {1: 0.8, 4: 1.0}}, {"note": "stub"})


def cpu_like() -> CostModel:
    """Verification linear in tokens, and a draft step as dear as verifying a token: never pays."""
    verify = {(b, t): 1.0 * b * t for b in (1, 4) for t in (1, 2, 4, 8)}
    return CostModel(verify, {"eagle": {1: 1.0, 4: 4.0}, "draft-lm": {1: 1.0, 4: 4.0}}, {"note": "stub"})


def make(kind: str, cost: CostModel):
    eagle, lm = EagleProposer(eagle_drafter()), DraftLMProposer(strong_lm())
    return {
        "adaptive-ngram": lambda: AdaptiveProposer(NGramProposer(), cost, max_gamma=6),
        "adaptive-eagle": lambda: AdaptiveProposer(eagle, cost, max_gamma=6),
        "adaptive-draft-lm": lambda: AdaptiveProposer(lm, cost, max_gamma=6),
        "hybrid": lambda: HybridProposer([NGramProposer(), eagle, lm], gamma=4),
        "adaptive-hybrid": lambda: HybridProposer([NGramProposer(), eagle, lm], cost_model=cost, max_gamma=6),
    }[kind]()


# ---- greedy: exactly the target's output -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["adaptive-ngram", "adaptive-eagle", "adaptive-draft-lm", "hybrid", "adaptive-hybrid"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_target(kind, batch):
    model = target()
    rows = prompts(batch)
    ids, mask = left_pad(rows)
    out = speculative_generate(model, make(kind, gpu_like()), ids, attention_mask=mask,
                               max_new_tokens=MAX_NEW, eos_token_id=[])
    assert out.sequences == [reference(model, p, MAX_NEW) for p in rows]
    s = out.stats
    assert sum(s.chosen_lengths) == s.row_forwards  # every (row, step) recorded once
    assert sum(s.chosen_lengths[2:]) > 0  # chains of 2+ drafts were verified
    if kind == "adaptive-eagle":  # a useless drafter: the scheduler learns to stop drafting
        assert s.chosen_lengths[0] > s.row_forwards // 2
    if "lm" in kind or "hybrid" in kind:  # the strong drafter makes it pay
        assert s.accept_counts[0] > 0 and s.tau > 1.5
    if "hybrid" in kind:
        assert len(s.chosen_parts) >= 2  # several parts won rows


@pytest.mark.parametrize("tree", ["dynamic", [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]], ids=["dynamic", "static"])
def test_greedy_trees_equal_target(tree):
    model = target("gemma3")  # sliding window: the tree attention crosses it
    rows = prompts(3)
    ids, mask = left_pad(rows)
    cost = CostModel({(b, t): 10.0 + 0.1 * b * t for b in (1, 4) for t in (1, 8, 32)}, {"eagle": {1: 0.5, 64: 1.0}})
    eagle = EagleProposer(EagleDrafter(config_from_target(model.config)).attach_target(model).eval())
    for proposer in (AdaptiveProposer(NGramProposer(), cost), HybridProposer([NGramProposer(), eagle], cost_model=cost)):
        out = speculative_generate(model, proposer, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[],
                                   tree=tree)
        assert out.sequences == [reference(model, p, 20) for p in rows]
        assert len(out.stats.chosen_lengths) > 2  # trees were verified, trimmed to varied sizes


def test_no_drafting_when_it_cannot_pay():
    """Cost model where a draft step costs as much as verifying a token: the adaptive proposer
    never runs its drafter and decodes like the target alone (tau = 1)."""
    model = target()
    calls = []

    class Spy(EagleProposer):
        def propose(self, state):
            calls.append(1)
            return super().propose(state)

    rows = prompts(3)
    ids, mask = left_pad(rows)
    out = speculative_generate(model, AdaptiveProposer(Spy(eagle_drafter()), cpu_like()), ids, attention_mask=mask,
                               max_new_tokens=12, eos_token_id=[])
    assert out.sequences == [reference(model, p, 12) for p in rows]
    assert calls == [] and out.stats.tau == 1.0 and out.stats.chosen_lengths == [out.stats.row_forwards]


def test_sampled_decodes_are_priced_at_sampled_costs():
    """Greedy costs where drafting pays, sampled costs where it never does: the same adaptive
    proposer drafts at T = 0 and never at T = 1 (a T = 1 decode priced greedily drafts too long)."""
    model = target()
    calls = []

    class Spy(EagleProposer):
        def propose(self, state):
            calls.append(state.temperature)
            return super().propose(state)

    fast, slow = gpu_like(), cpu_like()
    cost = CostModel(fast.verify_ms, fast.draft_ms, fast.meta, slow)
    ids, mask = left_pad(prompts(3))
    for temp in (0.0, 1.0):
        out = speculative_generate(model, AdaptiveProposer(Spy(eagle_drafter()), cost), ids, attention_mask=mask,
                                   max_new_tokens=12, eos_token_id=[], temperature=temp, seed=0)
        assert len(out.sequences) == 3 and all(len(s) == 12 for s in out.sequences)
    assert 0.0 in calls and 1.0 not in calls


def test_load_proposer_specs(tmp_path):
    model = target()
    path = gpu_like().save(tmp_path / "cost.json")
    a = load_proposer("adaptive:ngram:2", model, cost_model=str(path))
    assert isinstance(a, AdaptiveProposer) and a.inner.max_ngram == 2 and a.cost_model.meta == {"note": "stub"}
    h = load_proposer("hybrid:ngram+early-exit:2", model)
    assert isinstance(h, HybridProposer) and not h.adaptive and h.names == ["ngram", "early-exit:2"]
    for spec in ("adaptive:hybrid:ngram+early-exit:1", "adaptive-hybrid:ngram+early-exit:1"):
        ah = load_proposer(spec, model, cost_model=gpu_like(), max_gamma=5)
        assert isinstance(ah, HybridProposer) and ah.adaptive and ah.max_gamma == 5
    # a hybrid of adaptive parts is the adaptive hybrid, with their cost model and calibrators
    parts = [AdaptiveProposer(NGramProposer(), gpu_like()), AdaptiveProposer(EagleProposer(eagle_drafter()), gpu_like())]
    ah = HybridProposer(parts)
    assert ah.adaptive and ah.cost_model is parts[0].cost_model and ah.calibrators["eagle"] is parts[1].calibrators["eagle"]
    with pytest.raises(ValueError, match="needs a cost model"):
        HybridProposer([NGramProposer(), NGramProposer(2)], adaptive=True)
    with pytest.raises(ValueError, match="two or more parts"):
        load_proposer("hybrid:ngram", model)
    with pytest.raises(ValueError, match="no such file"):
        load_proposer("adaptive:ngram", model, cost_model=str(tmp_path / "missing.json"))


def test_step_log_has_every_parts_full_proposal():
    """log_steps=True: per active row per step, the root position, what was emitted and drafted,
    the chosen part and every part's untrimmed chain; the emitted counts add up to the output."""
    model = target()
    rows = prompts(3)
    ids, mask = left_pad(rows)
    out = speculative_generate(model, make("adaptive-hybrid", gpu_like()), ids, attention_mask=mask,
                               max_new_tokens=MAX_NEW, eos_token_id=[], log_steps=True)
    log = out.stats.step_log
    assert len(log) == out.stats.row_forwards
    for b, seq in enumerate(out.sequences):
        entries = [e for e in log if e["row"] == b]
        assert sum(e["emitted"] for e in entries) == len(seq)
        assert [e["pos"] for e in entries][0] == len(rows[b]) - 1
        for e in entries:
            assert set(e["proposals"]) == {"ngram", "eagle", "draft-lm"} and e["drafted"] <= 6
            assert all(len(c) <= 6 for c in e["proposals"].values())
            assert (e["part"] is None) == (e["drafted"] == 0)
            if e["part"] is not None:  # the verified drafts are a prefix of the chosen part's proposal
                assert len(e["proposals"][e["part"]]) >= e["drafted"]
    assert any(len(e["proposals"]["eagle"]) == 6 for e in log)  # full max_gamma chains, not the trimmed ones
    import json

    json.dumps(out.stats.as_dict())


# ---- foreign trees: a part that was not chosen keeps drafting correctly ------------------------------
class Alternating(HybridProposer):
    """Switches part every step, whatever the scores say."""

    def _pick(self, state, scores):
        return (torch.arange(scores.shape[1]) + self._step) % scores.shape[0]


class Oracle(Proposer):
    """Drafts the target's known greedy continuation (batch 1): always accepted."""

    name = "oracle"

    def __init__(self, full: list[int]):
        self.full = full

    def propose(self, state):
        g = state.gamma or 3
        cont = self.full[len(state.tokens[0]): len(state.tokens[0]) + g]
        drafts = torch.tensor([cont + [0] * (g - len(cont))])
        return chain_tree(state.root, drafts, confidence=torch.ones(1, g))


def _fresh_proposal(make_part, prefix: list[int], gamma: int) -> list[int]:
    """The first chain a brand-new proposer drafts for this prefix."""
    seen = []
    part = make_part()
    propose = part.propose

    def spy(state):
        tree = propose(state)
        seen.append(tree.tokens[0, 1:].tolist())
        return tree

    part.propose = spy
    speculative_generate(target(), part, torch.tensor([prefix]), max_new_tokens=1, gamma=gamma, eos_token_id=[])
    return seen[0]


@functools.cache
def medusa_heads():
    from drafttrain.models.medusa import MedusaHeads
    from drafttrain.models.medusa import config_from_target as medusa_config

    model = target()
    torch.manual_seed(0)
    heads = MedusaHeads(medusa_config(model.config, num_heads=3))
    heads.attach_target(model).init_from_target(model)
    with torch.no_grad():
        for b in heads.blocks:
            b.layers[0].weight.normal_(0, 0.05)
    return heads.eval()


@pytest.mark.parametrize("part", ["eagle", "draft-lm", "medusa"])
def test_part_not_chosen_drafts_as_if_fresh(part):
    """Every other step the verified tree is the oracle's (fully accepted, 4 tokens the part did
    not draft); the part's proposals still equal those of a fresh proposer on the same prefix."""
    from drafttrain.decode.proposers import MedusaProposer

    model = target()
    make_part = {"eagle": lambda: EagleProposer(eagle_drafter()), "draft-lm": lambda: DraftLMProposer(draft_lm()),
                 "medusa": lambda: MedusaProposer(medusa_heads(), model.config.num_hidden_layers)}[part]
    drafter = make_part()
    seen = record_proposals(drafter)
    ids = prompts(1)[0]
    ref = reference(model, ids, 40)
    out = speculative_generate(model, Alternating([Oracle(ids.tolist() + ref), drafter], gamma=3), ids[None],
                               max_new_tokens=40, eos_token_id=[])
    assert out.sequences[0] == ref
    assert out.stats.chosen_parts["oracle"] >= 4 and out.stats.chosen_parts[drafter.name] >= 4
    assert out.stats.accept_counts[2] >= 4  # the oracle's chains were accepted whole
    for prefix, chain in seen:
        assert chain == _fresh_proposal(make_part, prefix, 3)


def test_hybrid_ranks_sampled_trees_without_looking_below_the_first_draft():
    """Non-anticipation of the choice: a sampled tree's score ignores the confidences of drafts 2+
    (they depend on draft 1, already drawn); a deterministic tree's score uses them all."""
    hybrid = HybridProposer([NGramProposer(), NGramProposer(2)])
    root, drafts = torch.tensor([1, 1]), torch.tensor([[4, 5, 6], [4, 5, 6]])
    q = torch.full((2, 3, 8), 1 / 8)
    low, high = torch.tensor([[0.9, 0.1, 0.1]] * 2), torch.tensor([[0.9, 0.9, 0.9]] * 2)
    cal = hybrid.calibrators["ngram#0"]
    # evidence in which a higher confidence is accepted more often (seeded: the global RNG's state
    # depends on which tests ran before, e.g. under pytest-xdist; acceptance independent of the
    # confidence made the calibrated curve's slope a coin flip)
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(500, generator=g)
    cal.add(conf, torch.randint(1, 4, (500,), generator=g), torch.rand(500, generator=g) < conf)

    def score(conf, probs):
        tree = chain_tree(root, drafts, probs, conf)
        return hybrid._scores(None, [tree], [cal.prob(tree.confidence, tree.depths())])

    assert torch.equal(score(low, q), score(high, q))
    assert bool((score(low, None) < score(high, None)).all())


def test_parts_catch_up_after_steps_they_sat_out():
    """Adaptive L = 0 on some steps (the drafter does not run, then observes a root-only tree): later
    greedy output still equals the target's, and the drafter's later proposals equal fresh ones."""
    model = target()
    drafter = EagleProposer(eagle_drafter())
    seen = record_proposals(drafter)

    class SitsOut(AdaptiveProposer):
        def _plan(self, state, part, name):
            return (0, 1.0, 0.0) if self._step % 3 else (3, 1.0, 0.0)  # two steps off, one on

    ids = prompts(1)[0]
    out = speculative_generate(model, SitsOut(drafter, gpu_like(), free_extension=False), ids[None],
                               max_new_tokens=24, eos_token_id=[])
    assert out.sequences[0] == reference(model, ids, 24)
    assert out.stats.chosen_lengths[0] > 0 and len(seen) >= 4
    for prefix, chain in seen:
        assert chain == _fresh_proposal(lambda: EagleProposer(eagle_drafter()), prefix, len(chain))


# ---- sampling: the output law is the target's -----------------------------------------------------------
V, N_ROWS = 16, 2000
SAMPLE_PROMPT = torch.tensor([5, 9, 3, 12, 5, 9])


class PerRowCost:
    """verify(B, t) = 1 + 2e-5 B t ms, a draft step 0.01 ms: at B = 2000 chains of 1-3 pay."""

    def verify_time(self, batch: int, tokens: int) -> float:
        return 1.0 + 2e-5 * batch * tokens

    def draft_time(self, name: str, batch: int) -> float:
        return 0.0 if name == "ngram" else 0.01

    def at(self, temperature: float) -> PerRowCost:
        return self  # the same prices at every temperature


def trained_calibrator(law, seed: int = 0) -> AcceptanceCalibrator:
    """A calibrator that has seen 20k nodes whose acceptance follows `law(confidence)`."""
    cal = AcceptanceCalibrator(decay=1.0)
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(20_000, generator=g)
    cal.add(conf, torch.randint(1, 5, (20_000,), generator=g), torch.rand(20_000, generator=g) < law(conf))
    return cal


@functools.cache
def target_laws() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Marginal laws of the target's 1st, 2nd and 3rd sampled tokens after SAMPLE_PROMPT."""
    model = target("llama", V)
    ids = SAMPLE_PROMPT
    with torch.no_grad():
        p1 = torch.softmax(model(ids[None]).logits[0, -1].float(), -1)  # [V]
        one = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)  # [V, P + 1]
        p2_given = torch.softmax(model(one).logits[:, -1].float(), -1)  # [V, V]
        two = torch.cat([one.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)  # [V*V, P + 2]
        p3_given = torch.softmax(model(two).logits[:, -1].float(), -1).reshape(V, V, V)
    joint12 = p1[:, None] * p2_given  # [V, V]
    return p1, joint12.sum(0), torch.einsum("ab,abc->c", joint12, p3_given)


def within(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    """Per-bin |count - np| <= 6 sqrt(np(1-p)) + 5 (the TileOPs bound, as in tests/decode)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).float()
    np_ = probs * n
    return bool(((counts - np_).abs() <= 6 * (np_ * (1 - probs)).sqrt() + 5).all())


@pytest.mark.parametrize("kind", ["adaptive", "adaptive-free-extension", "hybrid", "adaptive-hybrid"])
def test_sampled_tokens_follow_the_target(kind):
    model, dlm = target("llama", V), draft_lm("llama", V)
    if kind.startswith("adaptive") and "hybrid" not in kind:
        # calibrated drafter (P(accept) = confidence): per-row trims of 1-3 drafts from sampled chains
        proposer = AdaptiveProposer(DraftLMProposer(dlm), PerRowCost(), max_gamma=3,
                                    calibrator=trained_calibrator(lambda c: c),
                                    free_extension=kind.endswith("free-extension"))
    else:
        # n-gram (deterministic, one-hot q) and sampled draft-LM chains share each batch
        cals = {"ngram": trained_calibrator(lambda c: 0.2 + 0.7 * c), "draft-lm": trained_calibrator(lambda c: c, 1)}
        proposer = HybridProposer([NGramProposer(), DraftLMProposer(dlm)], calibrator=cals, gamma=3, max_gamma=3,
                                  cost_model=PerRowCost() if kind == "adaptive-hybrid" else None,
                                  free_extension=False)
    out = speculative_generate(model, proposer, SAMPLE_PROMPT.expand(N_ROWS, -1), max_new_tokens=3,
                               temperature=1.0, generator=torch.Generator().manual_seed(123), eos_token_id=[])
    seqs = torch.tensor(out.sequences)  # [N_ROWS, 3]
    for k, law in enumerate(target_laws()):
        assert within(seqs[:, k], law), f"token {k + 1}"
    s = out.stats
    assert s.accept_counts[0] > N_ROWS // 4  # drafts really were verified and accepted
    used = [L for L, c in enumerate(s.chosen_lengths) if c]
    if kind.endswith("free-extension"):
        # padding is free: at the first step (every row may still emit 3 tokens) every row verifies
        # the longest kept chain; later steps never verify more than the row may still emit
        assert s.chosen_lengths[3] >= N_ROWS and len(used) >= 2
    else:
        assert len(used) >= 2  # rows verified different numbers of drafts
    if "hybrid" in kind:
        assert min(s.chosen_parts.values()) > N_ROWS // 10  # both parts verified often
    if kind == "adaptive-hybrid":  # the skip rule kept the draft LM out of a step: the law still holds
        assert s.parts_run["draft-lm"] < s.target_forwards


def pessimist_calibrator() -> AcceptanceCalibrator:
    """A calibrator that has seen 72 rejected drafts at depths 1-6 (a cold start's bad first steps)."""
    cal = AcceptanceCalibrator()
    depth = torch.arange(1, 7).repeat(12)
    cal.add(None, depth, torch.zeros_like(depth, dtype=torch.bool))
    return cal


def test_pessimistic_start_recovers_by_probing():
    """A cold start's early rejections must not stop drafting for good. The calibrator starts out
    convinced that nothing is accepted (as after a few rejected steps at high batch); the drafter
    is in fact always right (it knows the greedy continuation) but its whole chain is not free,
    and a draft pays only above 50 % acceptance. Without probes it never drafts again (no drafts,
    no evidence); with `explore_every=8` the probes' evidence brings drafting back, losslessly."""
    model = target()
    prompt = prompts(1)[0]
    n_new = 96
    full = prompt.tolist() + reference(model, prompt, n_new)
    cost = CostModel({(1, t): 10.0 + 5.0 * (t - 1) for t in (1, 2, 4, 8)}, {"oracle": {1: 1.0}})

    stats = {}
    for every in (0, 8):
        proposer = AdaptiveProposer(Oracle(full), cost, max_gamma=6, calibrator=pessimist_calibrator(), explore_every=every)
        for call in range(2):  # the calibrator carries over from call to call
            out = speculative_generate(model, proposer, prompt[None], max_new_tokens=n_new, eos_token_id=[])
            assert out.sequences == [full[len(prompt):]]
            stats[every, call] = out.stats
    for call in range(2):
        never = stats[0, call]
        assert never.tau == 1.0 and never.chosen_lengths == [never.row_forwards]  # stuck: no evidence, no drafts
    assert stats[8, 0].tau > 1.3  # drafting again within the first call (measured 1.6)
    assert stats[8, 1].tau > max(2.0, stats[8, 0].tau)  # and longer chains as probes go deeper (2.4)
    assert sum(stats[8, 1].chosen_lengths[2:]) > 0


def test_free_drafts_that_were_trimmed_still_teach_the_calibrator():
    """The batch-16 n-gram cold start: drafting is free (its whole chain is drafted every step) but
    the calibrator believes nothing is accepted, so the trim verifies none of it. Without shadow
    evidence (and without probes) no draft is ever verified again; with it, the unverified drafts
    are scored against the emitted tokens, the estimate recovers within the call, and the output
    is still the target's."""
    model = target()
    prompt = prompts(1)[0]
    n_new = 64
    full = prompt.tolist() + reference(model, prompt, n_new)
    cost = CostModel({(1, t): 10.0 + 5.0 * (t - 1) for t in (1, 2, 4, 8)}, {"oracle": {1: 0.0}})

    stats = {}
    for shadow in (False, True):
        proposer = AdaptiveProposer(Oracle(full), cost, max_gamma=6, calibrator=pessimist_calibrator(), explore_every=0,
                                    shadow=shadow)
        out = speculative_generate(model, proposer, prompt[None], max_new_tokens=n_new, eos_token_id=[])
        assert out.sequences == [full[len(prompt):]]
        stats[shadow] = out.stats
    assert stats[False].tau == 1.0  # stuck: drafted every step, verified nothing, learned nothing
    assert stats[True].tau > 2.0  # recovered (2.7): the oracle's drafts are right, and now verified
    assert stats[True].target_forwards < 0.5 * stats[False].target_forwards


class TargetArgmax(Proposer):
    """Drafts the target's own argmax after each row's prefix (deterministic: a function of the
    prefix). At T = 1 verification accepts it with probability p(argmax) < 1."""

    name = "argmax"

    def __init__(self, model):
        self.model = model

    def propose(self, state):
        with torch.no_grad():
            x = torch.stack([self.model(torch.tensor([seq])).logits[0, -1].argmax() for seq in state.tokens])
        g = state.gamma or 1
        return chain_tree(state.root, x[:, None].expand(-1, g), confidence=torch.full((len(x), g), 0.5))

    def select_rows(self, idx):
        return True


def test_shadow_evidence_estimates_acceptance_without_bias_when_sampling():
    """T = 1: the acceptance rate learned only from unverified drafts scored against the emitted
    tokens (the trim verifies nothing: a draft never pays under this cost model) equals the rate
    verification itself measures, within 4.5 sigma of the two binomial estimates."""
    model = target("llama", 16)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 16, (6,), generator=g) for _ in range(4)]
    ids, mask = left_pad(rows)
    never = CostModel({(b, t): 1.0 + 100.0 * (t - 1) for b in (1, 4) for t in (1, 2, 4, 8)}, {"argmax": {1: 0.0}})
    shadow = AdaptiveProposer(TargetArgmax(model), never, max_gamma=1, explore_every=0,
                              calibrator=AcceptanceCalibrator(decay=1.0))
    n_shadow = a_shadow = n_real = a_real = 0
    for seed in range(6):
        out = speculative_generate(model, shadow, ids, attention_mask=mask, max_new_tokens=40, eos_token_id=[],
                                   temperature=1.0, seed=seed)
        assert out.stats.tau == 1.0  # nothing was verified
        real = speculative_generate(model, TargetArgmax(model), ids, attention_mask=mask, max_new_tokens=40,
                                    eos_token_id=[], temperature=1.0, gamma=1, seed=100 + seed)
        n_real += real.stats.draft_counts[0]
        a_real += real.stats.accept_counts[0]
    cal = shadow.calibrators["argmax"]
    n_shadow, a_shadow = float(cal.depth_n[0]), float(cal.depth_a[0])
    assert n_shadow >= 900 and n_real >= 600
    p_s, p_r = a_shadow / n_shadow, a_real / n_real
    se = (p_s * (1 - p_s) / n_shadow + p_r * (1 - p_r) / n_real) ** 0.5
    assert 0.1 < p_r < 0.9  # a real test: acceptance is neither sure nor hopeless
    assert abs(p_s - p_r) < 4.5 * se, (p_s, p_r, se)


def test_no_draft_is_verified_beyond_what_the_row_may_still_emit():
    """max_new_tokens cuts a step's output; drafts deeper than a row's remaining room are never
    verified (they would widen the forward for nothing), and the output is still the target's."""
    model = target()
    prompt = prompts(1)[0]
    n_new = 11
    full = prompt.tolist() + reference(model, prompt, n_new + 8)
    cost = CostModel({(1, t): 10.0 + 0.1 * t for t in (1, 2, 4, 8)}, {"oracle": {1: 0.0}})
    proposer = AdaptiveProposer(Oracle(full), cost, max_gamma=6,
                                calibrator=AcceptanceCalibrator(prior_mean=0.95, prior_strength=50.0))
    seen = []
    propose = proposer.propose

    def spy(state):
        tree = propose(state)
        seen.append((int(tree.depths().max()), int(state.room[0])))
        return tree

    proposer.propose = spy
    out = speculative_generate(model, proposer, prompt[None], max_new_tokens=n_new, eos_token_id=[])
    assert out.sequences == [full[len(prompt): len(prompt) + n_new]]
    assert all(depth <= room for depth, room in seen), seen
    assert any(room < 6 and depth == room for depth, room in seen), seen  # the cut was needed, and exact
