"""Finished rows leave the batch (engine `compact=True`): later target forwards run on the active
rows only, and every row's output is exactly what it is without compaction.

Rows finish at different times: prompts of different lengths and an EOS set taken from the
target's own greedy outputs, so some rows stop after a few tokens and others run to
max_new_tokens. Tiny llama target (hidden 64, 4 layers, vocab 257) built in code.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

import drafttrain.decode.engine as engine
from drafttrain.decode import AdaptiveProposer, CostModel, HybridProposer, speculative_generate
from drafttrain.decode.proposers import (
    DraftLMProposer,
    EagleProposer,
    EarlyExitProposer,
    MedusaProposer,
    NGramProposer,
    Proposer,
)
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import strong_draft_lm, tiny_target

MAX_NEW = 24


@functools.cache
def target():
    return tiny_target("llama")


@functools.cache
def eagle_drafter() -> EagleDrafter:
    torch.manual_seed(0)
    return EagleDrafter(config_from_target(target().config, draft_vocab_size=None)).attach_target(target()).eval()


@functools.cache
def strong_lm():
    """The target with 0.2 % weight noise: accepted often, not always."""
    return strong_draft_lm()


@functools.cache
def medusa_heads():
    from drafttrain.models.medusa import MedusaHeads
    from drafttrain.models.medusa import config_from_target as medusa_config

    torch.manual_seed(0)
    heads = MedusaHeads(medusa_config(target().config, num_heads=3))
    heads.attach_target(target()).init_from_target(target())
    return heads.eval()


def cost() -> CostModel:
    verify = {(b, t): 10.0 + 0.2 * b * t for b in (1, 4) for t in (1, 2, 4, 8)}
    return CostModel(verify, {"eagle": {1: 0.8, 4: 1.0}, "draft-lm": {1: 0.8, 4: 1.0}})


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Five left-padded, repetitive prompts of lengths 21, 7, 13, 10 and 16."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for n in (14, 5, 9, 7, 11):
        base = torch.randint(3, 257, (n,), generator=g)
        rows.append(torch.cat([base, base[: n // 2 + 1]]))
    P = max(len(r) for r in rows)
    ids, mask = torch.zeros(len(rows), P, dtype=torch.long), torch.zeros(len(rows), P, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, P - len(r):], mask[b, P - len(r):] = r, 1
    return ids, mask


@functools.cache
def eos_ids() -> tuple[int, ...]:
    """Tokens of the greedy outputs of rows 1 and 3 at steps 3 and 10: rows end at different times."""
    ids, mask = batch()
    full = speculative_generate(target(), None, ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=[],
                                compact=False).sequences
    return (full[1][3], full[3][10])


class BatchSizes:
    """Records the batch size of every decode-step forward of the target's decoder (not the
    prefill's, which may run row by row: engine.PREFILL_PADDING_SHARE)."""

    def __init__(self, model):
        self.sizes: list[int] = []
        self.in_prefill = False
        body = model.get_decoder()
        self.handle = body.register_forward_pre_hook(self, with_kwargs=True)
        real = engine.prefill

        def prefill(*args, **kwargs):
            self.in_prefill = True
            try:
                return real(*args, **kwargs)
            finally:
                self.in_prefill = False

        self.patch = mock.patch.object(engine, "prefill", prefill)

    def __call__(self, module, args, kwargs):
        if not self.in_prefill:
            self.sizes.append(kwargs["input_ids"].shape[0])

    def __enter__(self):
        self.patch.start()
        return self

    def __exit__(self, *exc):
        self.patch.stop()
        self.handle.remove()


def make(kind: str) -> Proposer | None:
    return {
        "target-only": lambda: None,
        "ngram": lambda: NGramProposer(),
        "eagle": lambda: EagleProposer(eagle_drafter()),
        "draft-lm": lambda: DraftLMProposer(strong_lm()),
        "early-exit": lambda: EarlyExitProposer(target(), 2),
        "medusa": lambda: MedusaProposer(medusa_heads(), target().config.num_hidden_layers),
        "eagle-dynamic": lambda: EagleProposer(eagle_drafter()),
        "adaptive-draft-lm": lambda: AdaptiveProposer(DraftLMProposer(strong_lm()), cost(), max_gamma=6),
        "hybrid": lambda: HybridProposer([NGramProposer(), EagleProposer(eagle_drafter()), DraftLMProposer(strong_lm())],
                                         cost_model=cost(), max_gamma=6),
    }[kind]()


def run(kind: str, compact: bool, eos: tuple[int, ...] | None = None, **kw):
    ids, mask = batch()
    with BatchSizes(target()) as spy:
        out = speculative_generate(target(), make(kind), ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                   eos_token_id=list(eos_ids() if eos is None else eos), compact=compact, **kw)
    return out, spy.sizes


@pytest.mark.parametrize("kind", ["target-only", "ngram", "eagle", "eagle-dynamic", "draft-lm", "early-exit", "medusa",
                                  "adaptive-draft-lm", "hybrid"])
def test_greedy_output_unchanged_and_batch_shrinks(kind):
    ref, full_sizes = run("target-only", compact=False)
    lengths = [len(s) for s in ref.sequences]
    assert len(set(lengths)) >= 3 and max(lengths) == MAX_NEW  # rows finish at different times
    assert set(full_sizes) == {5}
    out, sizes = run(kind, compact=True, tree="dynamic" if kind == "eagle-dynamic" else None)
    assert out.sequences == ref.sequences
    assert out.stats.per_row_tokens == lengths
    assert min(sizes) < 5 and sizes == sorted(sizes, reverse=True)  # finished rows left the batch
    assert out.stats.row_forwards == sum(out.stats.per_row_forwards)


@pytest.mark.parametrize("kind", ["target-only", "ngram", "eagle", "draft-lm", "early-exit"])
def test_seeded_sampling_unchanged(kind):
    """T > 0 with a seed: verification draws are keyed by (seed, root position, node) and sampled
    drafts by (seed, draft position), so each row's tokens are the same whether finished rows are
    dropped or not. (Adaptive lengths depend on the batch size, so they are not in this list.)"""
    free = run(kind, compact=False, eos=(), temperature=1.0, seed=11)[0].sequences
    eos = (free[1][3], free[3][10])  # sampled tokens: rows end at different times
    plain, _ = run(kind, compact=False, eos=eos, temperature=1.0, seed=11)
    assert len({len(s) for s in plain.sequences}) >= 2
    out, sizes = run(kind, compact=True, eos=eos, temperature=1.0, seed=11)
    assert out.sequences == plain.sequences
    assert out.stats.per_row_tokens == plain.stats.per_row_tokens and min(sizes) < 5


def test_proposer_that_cannot_compact_keeps_the_batch():
    """A proposer without select_rows: the engine keeps every row (the old behaviour)."""

    class NoSelect(NGramProposer):
        select_rows = Proposer.select_rows

    ids, mask = batch()
    with BatchSizes(target()) as spy:
        out = speculative_generate(target(), NoSelect(), ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                   eos_token_id=list(eos_ids()))
    assert out.sequences == run("target-only", compact=False)[0].sequences
    assert set(spy.sizes) == {5}
