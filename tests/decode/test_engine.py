"""The generate loop end to end: speculative output equals the target's own, on tiny targets.

Tiny targets (hidden 64, 4 layers, vocab 257; Gemma 3 with a sliding window of 8) stand in for
e.g. Llama-3.1-8B (4096 / 32 layers / 128256) and Gemma 3 270M (640 / 18 / 262144). An oracle
proposer that drafts the target's own greedy continuation (optionally with a wrong token at a
chosen depth) pins acceptance, EOS and max_new_tokens edge cases.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.testing import OracleProposer, strong_draft_lm, tiny_target

MAX_NEW = 24
# prompt seeds whose greedy continuation (tiny targets of each family) n-gram lookup partly predicts
NGRAM_PROMPT_SEED = {"llama": 27, "qwen3": 21, "gemma3": 1}




@functools.cache
def target(family: str, vocab_size: int = 257):
    return tiny_target(family, vocab_size=vocab_size)


def prompt(seed: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 257, (length,), generator=g)


def reference(model, ids: torch.Tensor, n: int) -> list[int]:
    """The target's own greedy continuation (no EOS stop)."""
    out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], do_sample=False,
                         max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = p
        mask[b, P - len(p):] = 1
    return ids, mask


def test_target_only_matches_generate(family):
    model, ids = target(family), prompt(0, 13)
    out = speculative_generate(model, None, ids[None], max_new_tokens=MAX_NEW, eos_token_id=[])
    assert out.sequences[0] == reference(model, ids, MAX_NEW)
    assert out.stats.target_forwards == MAX_NEW and out.stats.tau == 1.0


@pytest.mark.parametrize("spec", ["ngram", "early-exit:2", "draft-lm"])
@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], "dynamic"],
                         ids=["chain", "static", "dynamic"])
def test_greedy_matches_generate(family, spec, tree):
    """Every case speculates (drafts are accepted), so it tests verification, not plain decoding:
    the prompt seed per family is one whose greedy continuation repeats what n-gram lookup finds,
    and the draft LM is a noisy copy of the target (a random one would never be accepted)."""
    model = target(family)
    base = prompt(NGRAM_PROMPT_SEED[family], 14)
    ids = torch.cat([base, base[:9]])  # repeated text so n-gram lookup finds matches; > sliding window
    proposer = (load_proposer(strong_draft_lm(family=family), model) if spec == "draft-lm"
                else load_proposer(spec, model))
    out = speculative_generate(model, proposer, ids[None], max_new_tokens=MAX_NEW, eos_token_id=[], tree=tree)
    assert out.sequences[0] == reference(model, ids, MAX_NEW)
    assert sum(out.stats.accept_counts) >= 2, out.stats.accept_counts


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5])
def test_oracle_chain_accepts_everything(gamma):
    model, ids = target("gemma3"), prompt(2, 11)
    ref = reference(model, ids, MAX_NEW)
    out = speculative_generate(model, OracleProposer([ids], [ref], gamma), ids[None],
                               max_new_tokens=MAX_NEW, eos_token_id=[])
    assert out.sequences[0] == ref
    steps = -(-MAX_NEW // (gamma + 1))
    assert out.stats.target_forwards == steps
    assert out.stats.tau == pytest.approx(MAX_NEW / steps)


def test_partial_accept_counts_per_position(family):
    model, ids = target(family), prompt(3, 9)
    ref = reference(model, ids, MAX_NEW)
    out = speculative_generate(model, OracleProposer([ids], [ref], 4, wrong_at=3), ids[None],
                               max_new_tokens=MAX_NEW, eos_token_id=[])
    assert out.sequences[0] == ref
    s = out.stats
    # every step accepts exactly two drafts then emits the corrected third token
    assert s.accept_counts[:2] == [s.target_forwards] * 2 and s.accept_counts[2:] in ([], [0], [0, 0])
    assert s.tau == pytest.approx(3.0)


def test_eos_inside_accepted_draft_ends_the_row_there():
    model, ids = target("llama"), prompt(4, 10)
    ref = reference(model, ids, MAX_NEW)
    j = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])  # first fresh token, index >= 2
    gamma = j + 2  # the EOS sits strictly inside the first step's drafts
    out = speculative_generate(model, OracleProposer([ids], [ref], gamma), ids[None],
                               max_new_tokens=MAX_NEW, eos_token_id=ref[j])
    assert out.sequences[0] == ref[: j + 1]
    assert out.stats.target_forwards == 1


def test_max_new_tokens_mid_draft_truncates_exactly():
    model, ids = target("qwen3"), prompt(5, 10)
    ref = reference(model, ids, MAX_NEW)
    out = speculative_generate(model, OracleProposer([ids], [ref], 4), ids[None], max_new_tokens=7,
                               eos_token_id=[])
    assert out.sequences[0] == ref[:7]
    assert out.stats.target_forwards == 2 and out.stats.tokens_emitted == 7


def test_batch_rows_with_different_lengths_and_stops(family):
    model = target(family)
    prompts = [prompt(6, 3), prompt(7, 13), prompt(8, 1), prompt(9, 6)]
    refs = [reference(model, p, MAX_NEW) for p in prompts]
    eos = refs[1][5]  # row 1 stops early (other rows stop there too if they emit it)
    ids, mask = left_pad(prompts)
    # rows accept 0, 1, 3 and 2 drafts per step
    proposer = OracleProposer(prompts, refs, 3, wrong_at=[1, 2, None, 3])
    for prop in (proposer, load_proposer("early-exit:2", model)):
        out = speculative_generate(model, prop, ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                   eos_token_id=eos)
        for got, ref in zip(out.sequences, refs):
            expect = ref[: ref.index(eos) + 1] if eos in ref else ref
            assert got == expect
        assert out.stats.per_row_tokens == [len(s) for s in out.sequences]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prompts_of_very_different_lengths_prefill_row_by_row_and_stay_lossless(family, monkeypatch):
    """A batch whose padding would be most of its prefill is prefilled one row at a time into the
    left-padded cache: the same greedy text as each prompt alone, and the same cache bookkeeping,
    hidden states and next-step output as the batched prefill (an EAGLE drafter reads the hidden
    states; ngram drafts so rows accept different lengths)."""
    import drafttrain.decode.engine as engine

    model = target(family)
    prompts = [prompt(40, 70), prompt(41, 180), prompt(42, 95)]  # ~36% of the padded batch is padding
    refs = [reference(model, p, MAX_NEW) for p in prompts]
    ids, mask = left_pad(prompts)
    calls = []
    real = engine._prefill_rows
    monkeypatch.setattr(engine, "_prefill_rows", lambda *a: calls.append(1) or real(*a))
    out = speculative_generate(model, load_proposer("ngram", model), ids, attention_mask=mask,
                               max_new_tokens=MAX_NEW, eos_token_id=[], gamma=3)
    assert calls and out.sequences == refs

    seen = {}

    def prefill_of(share: float):
        monkeypatch.setattr(engine, "PREFILL_PADDING_SHARE", share)
        state = engine.DecodeState(target=model, kv=engine.KVState.for_model(model, 3, ids.device),
                                   tokens=[p.tolist() for p in prompts], root=ids[:, -1].clone(),
                                   root_pos=torch.tensor([len(p) - 1 for p in prompts]),
                                   active=torch.ones(3, dtype=torch.bool), temperature=0.0)
        probe = type("Probe", (), {"needs_hidden_states": (1, 2), "prefill": lambda self, st, h: seen.update({share: h})})()
        engine.prefill(state, ids, mask, probe, engine.DecodeStats(per_row_tokens=[0] * 3, per_row_forwards=[0] * 3))
        nxt, _ = engine.target_forward(model, state.kv, ids[:, -1:], state.root_pos[:, None], torch.tensor([[-1]] * 3))
        return state.kv, nxt

    rows_kv, rows_next = prefill_of(0.0)  # padding share > 0: row by row
    batch_kv, batch_next = prefill_of(1.0)  # never row by row
    assert torch.equal(rows_kv.valid, batch_kv.valid) and torch.equal(rows_kv.pos, batch_kv.pos)
    valid = mask[:, :-1].bool()
    for i in (1, 2):
        torch.testing.assert_close(seen[0.0][i][valid], seen[1.0][i][valid], atol=1e-4, rtol=1e-4)
        assert not seen[0.0][i][~valid].any()
    torch.testing.assert_close(rows_next, batch_next, atol=1e-4, rtol=1e-4)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), gamma=st.integers(1, 5), length=st.integers(1, 20),
       family=st.sampled_from(["llama", "qwen3", "gemma3"]),
       spec=st.sampled_from(["ngram", "early-exit:1", "early-exit:3"]),
       tree=st.sampled_from([None, "dynamic", ((0,), (1,), (0, 0)), ((0,), (0, 0), (0, 1), (0, 0, 0))]))
def test_property_greedy_is_lossless(seed, gamma, length, family, spec, tree):
    model = target(family)
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 257, (length,), generator=g)
    ids = torch.cat([base, base[: length // 2]])
    out = speculative_generate(model, load_proposer(spec, model), ids[None], max_new_tokens=12,
                               eos_token_id=[], gamma=gamma, tree=tree)
    assert out.sequences[0] == reference(model, ids, 12)


def test_rejects_right_padded_prompts():
    model = target("llama")
    ids, mask = left_pad([prompt(0, 3), prompt(1, 5)])
    with pytest.raises(ValueError, match="left-padded"):
        speculative_generate(model, None, ids, attention_mask=mask.flip(1), max_new_tokens=2)
    with pytest.raises(ValueError, match="seed has 3 values for 2 rows"):
        speculative_generate(model, None, ids, attention_mask=mask, max_new_tokens=2, temperature=1.0, seed=[1, 2, 3])


# ---- sampling: the output law is the target's ---------------------------------------------------
def _within(counts: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    """Per-bin |count - np| <= 6 sqrt(np(1-p)) + 5 (the TileOPs bound)."""
    np_ = probs * n
    return bool(((counts - np_).abs() <= 6 * (np_ * (1 - probs)).sqrt() + 5).all())


@pytest.mark.parametrize("rng", ["generator", "per-row seeds", "one int seed"])
@pytest.mark.parametrize("kind", ["draft-lm-chain", "early-exit-dynamic"])
def test_sampled_first_and_second_token_follow_the_target(kind, rng):
    V, n = 16, 1500
    model = tiny_target("llama", vocab_size=V)
    ids = torch.tensor([5, 9, 3, 12])
    with torch.no_grad():
        p1 = torch.softmax(model(ids[None]).logits[0, -1].float(), -1)  # [V]
        nxt = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)  # every first token
        p2_given = torch.softmax(model(nxt).logits[:, -1].float(), -1)  # [V, V]
    p2 = p1 @ p2_given
    if kind == "draft-lm-chain":
        proposer, tree = load_proposer(tiny_target("llama", vocab_size=V, seed=3, num_layers=1), model), None
    else:
        proposer, tree = load_proposer("early-exit:2", model), "dynamic"
    # n copies of one prompt: a shared generator, one seed per row, or one int seed (which must
    # give every row its own stream: rows keyed by the seed and the caller's row index)
    rand = {"generator": dict(generator=torch.Generator().manual_seed(123)),
            "per-row seeds": dict(seed=torch.arange(n) + 10_000), "one int seed": dict(seed=7)}[rng]
    out = speculative_generate(model, proposer, ids.expand(n, -1), max_new_tokens=2, temperature=1.0,
                               gamma=2, tree=tree, eos_token_id=[], **rand)
    seqs = torch.tensor(out.sequences)  # [n, 2]
    assert _within(torch.bincount(seqs[:, 0], minlength=V).float(), p1, n)
    assert _within(torch.bincount(seqs[:, 1], minlength=V).float(), p2, n)
    joint = (p1[:, None] * p2_given).reshape(-1)  # [V * V] law of (first, second)
    assert _within(torch.bincount(seqs[:, 0] * V + seqs[:, 1], minlength=V * V).float(), joint, n)
    assert out.stats.accept_counts and out.stats.accept_counts[0] > 0  # drafts were actually used


def test_one_int_seed_gives_each_row_its_own_reproducible_stream():
    """64 copies of a prompt with seed=7 are 64 samples (best-of-N, pass@k), not one sample 64
    times; the same call gives the same rows, and a row does not depend on the other rows."""
    V, n = 16, 64
    model = tiny_target("llama", vocab_size=V)
    proposer = load_proposer(tiny_target("llama", vocab_size=V, seed=3, num_layers=1), model)
    ids = torch.tensor([5, 9, 3, 12]).repeat(n, 1)

    def run(prompts):
        return speculative_generate(model, proposer, prompts, max_new_tokens=8, temperature=1.0, gamma=2,
                                    eos_token_id=[], seed=7).sequences

    first = run(ids)
    assert len({tuple(r) for r in first}) >= n - 2  # 16^8 outcomes: repeats would be a shared stream
    assert run(ids) == first
    other = ids.clone()
    other[1::2] = torch.tensor([1, 2, 3, 4])  # change every odd row's prompt
    again = run(other)
    assert again[0::2] == first[0::2] and again[1::2] != first[1::2]
    # a list of per-row seeds keeps its meaning: equal seeds, equal streams
    same = speculative_generate(model, proposer, ids[:4], max_new_tokens=8, temperature=1.0, gamma=2,
                                eos_token_id=[], seed=[7, 7, 7, 7]).sequences
    assert same[0] == same[1] == same[2] == same[3] == first[0]
