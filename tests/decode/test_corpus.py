"""Corpus lookup drafts: they follow the target's habits from its own earlier answers, the output is
exactly the target's whether the drafts are right or wrong, the adaptive hybrid with prompt lookup
uses it where prompt lookup has nothing, and a bad corpus file is one clear error.

Tiny target (vocab 257); the corpus is built from the target's own greedy answers, as
`drafttrain regenerate temperature=0` would write them for a real target.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from drafttrain.decode import CostModel, HybridProposer, load_proposer, speculative_generate
from drafttrain.decode.proposers import CorpusProposer, NGramProposer
from drafttrain.testing import tiny_target, tiny_tokenizer

N_NEW = 40


@functools.cache
def target():
    return tiny_target("llama", vocab_size=257)


def greedy(ids: torch.Tensor, n: int = N_NEW) -> list[int]:
    out = target().generate(ids[None], attention_mask=torch.ones_like(ids)[None], do_sample=False,
                            max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def random_prompts(n: int, seed: int) -> list[torch.Tensor]:
    """Non-repeating prompts: prompt lookup finds little to copy."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(250, generator=g)[:12] + 3 for _ in range(n)]


def answers_corpus(prompts: list[torch.Tensor]) -> CorpusProposer:
    """The target's greedy answers to `prompts`, answers masked in (prompts are context only)."""
    seqs = []
    for p in prompts:
        ans = greedy(p)
        seqs.append((p.tolist() + ans, [0] * len(p) + [1] * len(ans)))
    return CorpusProposer(seqs)


def test_corpus_index_counts_answers_under_their_context():
    corpus = CorpusProposer([([5, 6, 7, 8, 7, 8, 9], [0, 0, 1, 1, 1, 1, 1])], max_order=2)
    assert corpus.next_token([5, 6]) == (7, 0.5)  # seen once: 1 / (1 + 1)
    assert corpus.next_token([1, 7]) == (8, 2 / 3)  # order-2 context unseen: backs off to "7" (8 twice)
    assert corpus.next_token([8]) == (7, 1 / 3)  # "8" -> 7 once, 9 once: the first seen wins the tie
    assert corpus.next_token([3, 4]) is None
    assert corpus.next_token([4, 5]) is None  # the prompt token 6 is never a prediction (mask 0)


def test_greedy_output_is_the_targets_and_habits_are_drafted():
    """Re-asked questions are drafted from the corpus (tau well above 1); new questions get wrong
    drafts; both decode to exactly the target's greedy output."""
    seen, new = random_prompts(3, seed=1), random_prompts(3, seed=2)
    corpus = answers_corpus(seen)
    for rows, min_tau in ((seen, 3.0), (new, 1.0)):
        for p in rows:
            out = speculative_generate(target(), corpus, p[None], max_new_tokens=N_NEW, gamma=4, eos_token_id=[])
            assert out.sequences == [greedy(p)]
            assert out.stats.tau >= min_tau
    # prompt lookup alone has little to copy in these prompts
    p = seen[0]
    plain = speculative_generate(target(), NGramProposer(), p[None], max_new_tokens=N_NEW, gamma=4, eos_token_id=[])
    assert plain.stats.tau < speculative_generate(target(), corpus, p[None], max_new_tokens=N_NEW, gamma=4,
                                                  eos_token_id=[]).stats.tau


def test_adaptive_hybrid_uses_the_corpus_where_it_knows_more():
    """Batch of a seen and an unseen question: exact greedy output; the corpus wins rows."""
    seen, new = random_prompts(2, seed=1), random_prompts(1, seed=2)
    corpus = answers_corpus(seen)
    rows = [seen[0], new[0], seen[1]]
    P = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(rows):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    cost = CostModel({(b, t): 10.0 + 0.2 * b * t for b in (1, 4) for t in (1, 2, 4, 8)}, {}, {"note": "stub"})
    hybrid = HybridProposer([NGramProposer(), corpus], cost_model=cost, max_gamma=6)
    out = speculative_generate(target(), hybrid, ids, attention_mask=mask, max_new_tokens=N_NEW, eos_token_id=[])
    assert out.sequences == [greedy(p) for p in rows]
    assert out.stats.chosen_parts.get("corpus", 0) > 5
    assert out.stats.tau > 2.0


def test_corpus_spec_reads_a_regenerated_file(tmp_path):
    tok = tiny_tokenizer(True)
    path = tmp_path / "answers.jsonl"
    lines = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"},
                                        {"role": "assistant", "content": "Sure thing: xyz"}]} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    corpus = load_proposer(f"corpus:{path}", target(), tokenizer=tok)
    assert isinstance(corpus, CorpusProposer)
    ids = tok.encode("Sure thing: x", add_special_tokens=False)
    assert corpus.next_token(ids)[0] == tok.encode("y", add_special_tokens=False)[0]
    assert corpus.next_token(ids)[1] == pytest.approx(3 / 4)  # seen 3 times in 3


@pytest.mark.parametrize("setup, message", [
    ("missing", "does not exist"),
    ("no-answers", "no conversation with an assistant turn"),
    ("not-json", "not JSON"),
    ("no-tokenizer", "needs the target's tokenizer"),
    ("no-file", "needs the corpus file"),
])
def test_bad_corpus_is_one_clear_error(tmp_path, setup, message):
    path = tmp_path / "c.jsonl"
    if setup == "no-answers":
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    elif setup in ("not-json", "no-tokenizer"):
        path.write_text("{oops\n" if setup == "not-json" else json.dumps({"messages": []}) + "\n")
    spec = "corpus:" if setup == "no-file" else f"corpus:{path}"
    tok = None if setup == "no-tokenizer" else tiny_tokenizer(True)
    with pytest.raises(ValueError, match=message):
        load_proposer(spec, target(), tokenizer=tok)
