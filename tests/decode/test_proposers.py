"""Proposers: n-gram lookup, load_proposer specs and errors, EAGLE-3 / EAGLE-1 drafters (random
weights: losslessness holds for any drafter), sampled drafts over a reduced draft vocabulary.

Tiny target: hidden 64, 4 layers, vocab 257 (real: Gemma 3 270M, 640 / 18 / 262144, with an
EAGLE-3 draft vocab of 32k).
"""

from __future__ import annotations

import functools

import pytest
import torch

from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.proposers import DraftLMProposer, EagleProposer, EarlyExitProposer, NGramProposer
from drafttrain.decode.proposers.ngram import lookup_continuations
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import TinyTokenizer, tiny_target


@functools.cache
def target(family: str, vocab_size: int = 257):
    return tiny_target(family, vocab_size=vocab_size)


def reference(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids[None], do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def eagle(model, method: str, draft_vocab: int | None = None, seed: int = 0) -> EagleDrafter:
    """A random EAGLE drafter; EAGLE-3 with a reduced vocabulary of `draft_vocab` random ids."""
    torch.manual_seed(seed)
    cfg = config_from_target(model.config, fused=method == "eagle3", draft_vocab_size=draft_vocab)
    drafter = EagleDrafter(cfg).attach_target(model).eval()
    V = cfg.vocab_size
    if method == "eagle3" and cfg.draft_vocab_size < V:
        ids = torch.randperm(V)[: cfg.draft_vocab_size].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        drafter.set_vocab_mapping(ids - torch.arange(len(ids)), t2d)
    return drafter


# ---- n-gram ------------------------------------------------------------------------------------
def test_ngram_prefers_longest_then_most_recent_match():
    seq = torch.tensor([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3])
    # suffix (2, 3) occurs at 1 and 5: most recent first
    assert lookup_continuations(seq, 2, 1, 3, 4) == [[7, 8, 5], [9, 9, 2]]
    # a longer suffix (5, 2, 3) has no earlier match, so n = 2 is used
    assert lookup_continuations(seq, 3, 1, 2, 1) == [[7, 8]]
    assert lookup_continuations(torch.tensor([4, 5, 6]), 3, 1, 2, 1) == []


def test_ngram_copies_a_repeated_prompt():
    model = target("llama")
    ids = torch.randint(3, 257, (12,), generator=torch.Generator().manual_seed(0))
    ref = reference(model, ids, 8)
    text = torch.cat([ids, torch.tensor(ref), ids, torch.tensor(ref[:2])])  # the continuation repeats
    out = speculative_generate(model, load_proposer("ngram:3", model), text[None], max_new_tokens=6,
                               eos_token_id=[], gamma=4)
    assert out.sequences[0] == reference(model, text, 6)
    assert out.stats.accept_counts[0] > 0  # the repeat was found and accepted


# ---- load_proposer -----------------------------------------------------------------------------
def test_load_proposer_specs():
    model = target("llama")
    assert isinstance(load_proposer("ngram", model), NGramProposer)
    assert load_proposer("ngram:5", model).max_ngram == 5
    ee = load_proposer("early-exit:2", model, gamma=6)
    assert isinstance(ee, EarlyExitProposer) and ee.num_layers == 2 and ee.default_gamma == 6
    assert isinstance(load_proposer(tiny_target("llama", seed=1, num_layers=1), model), DraftLMProposer)
    assert isinstance(load_proposer(eagle(model, "eagle3"), model), EagleProposer)
    same = NGramProposer()
    assert load_proposer(same, model) is same


@pytest.mark.parametrize("spec,message", [
    ("early-exit:9", "1 <= K < 4"),
    ("early-exit:x", "integer K"),
    ("/no/such/drafter", "cannot load proposer"),
])
def test_load_proposer_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        load_proposer(spec, target("llama"))


def test_draft_lm_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="share a tokenizer"):
        load_proposer(tiny_target("llama", vocab_size=300, num_layers=1), target("llama"))


def test_eagle_drafter_folder_loads(tmp_path):
    from drafttrain.drafter_io import save_drafter_folder

    model = target("qwen3")
    drafter = eagle(model, "eagle3", draft_vocab=120)
    class Tok(TinyTokenizer):
        def get_vocab(self):
            return {str(i): i for i in range(self.vocab_size)}

    folder = save_drafter_folder(tmp_path / "d", drafter=drafter, target=model, tokenizer=Tok(),
                                 method="eagle3", extra={}, card="test")
    proposer = load_proposer(str(folder), model)
    assert isinstance(proposer, EagleProposer)
    assert torch.equal(proposer.drafter.d2t, drafter.d2t)


# ---- EAGLE: lossless for any weights -------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle3", "eagle1"])
def test_a_catch_up_computing_only_the_last_position_writes_the_same_cache(method):
    """`last_only` (what a catch-up over many tokens runs): the earlier positions only write keys
    and values, yet the last position's logits and feature, the cache, and the next draft step over
    it equal the full forward's."""
    from drafttrain.decode.kv import KVState

    model = target("llama")
    drafter = eagle(model, method)
    H, B, T = drafter.cfg.hidden_size, 2, 11
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 257, (B, T), generator=gen)
    feats = torch.randn(B, T, H, generator=gen)
    pos = torch.arange(T).expand(B, T)
    parents = torch.arange(-1, T - 1).expand(B, T)
    runs = []
    with torch.inference_mode():
        for last_only in (False, True):
            kv = KVState(B, torch.device("cpu"))
            mask = kv.extend(pos, parents, dtype=feats.dtype)
            logits, h = drafter(ids, feats, position_ids=pos, past_key_values=kv.cache, attention_mask=mask,
                                last_logits=True, last_only=last_only)
            kv.commit(torch.arange(T).expand(B, T))
            keys = kv.cache.layers[0].keys.clone()
            nxt = torch.randint(3, 257, (B, 1), generator=torch.Generator().manual_seed(5))
            mask = kv.extend(pos[:, -1:] + 1, torch.full((B, 1), -1), dtype=feats.dtype)
            l2, _ = drafter(nxt, h[:, -1:], position_ids=pos[:, -1:] + 1, past_key_values=kv.cache, attention_mask=mask)
            runs.append((logits, h[:, -1], keys, l2))
    full, last = runs
    assert last[1].shape == (B, H) and full[0].shape == last[0].shape == (B, 1, drafter.cfg.draft_vocab_size)
    for f, g in zip(full, last):
        torch.testing.assert_close(g, f, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("method,vocab", [("eagle3", 100), ("eagle1", None)])
@pytest.mark.parametrize("tree", [None, "dynamic", [(0,), (1,), (0, 0), (0, 1)]], ids=["chain", "dyn", "static"])
def test_eagle_greedy_matches_generate_batched(family, method, vocab, tree):
    model = target(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 257, (n,), generator=g) for n in (11, 4, 1)]
    P = max(len(p) for p in prompts)
    ids = torch.zeros(3, P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    out = speculative_generate(model, EagleProposer(eagle(model, method, vocab)), ids, attention_mask=mask,
                               max_new_tokens=14, eos_token_id=[], tree=tree, gamma=3)
    assert out.sequences == [reference(model, p, 14) for p in prompts]


def test_eagle_reads_target_feature_of_the_token_before_each_input():
    """Alignment: the drafter's input token x_{t+1} is paired with the target's feature of x_t,
    on the prompt and on every catch-up after verification."""
    model = target("gemma3")
    seen = []

    class Spy(EagleProposer):
        def _begin(self, state, capacity):
            for b, seq in enumerate(state.tokens):
                if self.feats[b]:
                    seen.append((list(seq), self.read[b], torch.cat(self.feats[b]).clone()))
            return super()._begin(state, capacity)

    drafter = eagle(model, "eagle1")
    ids = torch.randint(3, 257, (10,), generator=torch.Generator().manual_seed(4))
    out = speculative_generate(model, Spy(drafter, gamma=2), ids[None], max_new_tokens=9, eos_token_id=[])
    assert out.sequences[0] == reference(model, ids, 9) and len(seen) >= 3
    for seq, read, feats in seen:
        full = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]  # [T, H]
        # features f_read .. f_{T-2} go with input tokens x_{read+1} .. x_{T-1}
        torch.testing.assert_close(feats, full[read: len(seq) - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,vocab", [("eagle3", 8), ("eagle1", None)])
def test_eagle_sampled_chain_first_token_follows_the_target(method, vocab):
    V, n = 16, 1500
    model = tiny_target("llama", vocab_size=V)
    ids = torch.tensor([5, 9, 3, 12])
    with torch.no_grad():
        p1 = torch.softmax(model(ids[None]).logits[0, -1].float(), -1)
    out = speculative_generate(model, EagleProposer(eagle(model, method, vocab)), ids.expand(n, -1),
                               max_new_tokens=1, temperature=1.0, gamma=2, eos_token_id=[],
                               generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor(out.sequences)[:, 0], minlength=V).float()
    np_ = p1 * n
    assert bool(((counts - np_).abs() <= 6 * (np_ * (1 - p1)).sqrt() + 5).all())
