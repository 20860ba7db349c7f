"""Reduced draft vocabulary: d2t / t2d invariants and the errors a corrupted mapping gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drafttrain.models.eagle import build_vocab_mapping, validate_vocab_mapping


@settings(max_examples=30, deadline=None)
@given(V=st.integers(2, 300), frac=st.floats(0.01, 1.0), seed=st.integers(0, 10_000))
def test_mapping_invariants(V, frac, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (V,), generator=g).double() * (torch.rand(V, generator=g) < 0.7)
    Vd = max(1, int(V * frac))
    d2t, t2d, coverage = build_vocab_mapping(counts, Vd)
    target_ids = torch.arange(Vd) + d2t
    assert d2t.shape == (Vd,) and t2d.shape == (V,) and t2d.dtype == torch.bool
    assert int(t2d.sum()) == Vd
    assert target_ids.min() >= 0 and target_ids.max() < V
    assert torch.all(target_ids[1:] > target_ids[:-1])  # draft ids follow target-id order
    # round trip: target -> draft -> target
    draft_of = torch.full((V,), -1, dtype=torch.long)
    draft_of[target_ids] = torch.arange(Vd)
    assert torch.equal(torch.nonzero(t2d).squeeze(1), target_ids)
    assert torch.equal(arange_back := target_ids[draft_of[target_ids]], target_ids), arange_back
    # the kept tokens are the most frequent ones
    kept = counts[t2d]
    dropped = counts[~t2d]
    if dropped.numel():
        assert kept.min() >= dropped.max()
    total = counts.sum()
    expected = float(kept.sum() / total) if total > 0 else 0.0
    assert coverage == pytest.approx(expected)


def test_full_vocab_covers_everything():
    counts = torch.tensor([5.0, 0, 3, 1])
    d2t, t2d, cov = build_vocab_mapping(counts, 4)
    assert torch.equal(d2t, torch.zeros(4, dtype=torch.long)) and bool(t2d.all()) and cov == 1.0


@pytest.mark.parametrize("Vd", [0, 11])
def test_bad_size(Vd):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(torch.ones(10), Vd)


def test_corrupted_mappings_are_named():
    d2t, t2d, _ = build_vocab_mapping(torch.arange(10.0), 4)
    bad = d2t.clone()
    bad[0] = 100
    with pytest.raises(ValueError, match="outside the target vocab"):
        validate_vocab_mapping(bad, t2d)
    dup = d2t.clone()
    dup[1] = dup[0] - 1  # draft 1 -> same target as draft 0
    with pytest.raises(ValueError, match="same target id"):
        validate_vocab_mapping(dup, t2d)
    t = t2d.clone()
    t[0] = not t[0]
    with pytest.raises(ValueError):
        validate_vocab_mapping(d2t, t)


def test_free_slots_go_to_prompt_tokens_before_never_seen_ones():
    # 3 answer tokens for a vocabulary of 5: the two free slots take the prompts' most frequent
    # tokens (ids 7, then 2), not the lowest never-seen ids; answer tokens still come first
    counts = torch.zeros(10)
    counts[[4, 5, 9]] = torch.tensor([3.0, 1.0, 2.0])
    prompts = torch.zeros(10)
    prompts[[2, 7, 8, 4]] = torch.tensor([2.0, 5.0, 1.0, 9.0])
    d2t, t2d, cov = build_vocab_mapping(counts, 5, tie_break=prompts)
    assert torch.nonzero(t2d).flatten().tolist() == [2, 4, 5, 7, 9]
    assert cov == 1.0
    _, t2d_plain, _ = build_vocab_mapping(counts, 5)
    assert torch.nonzero(t2d_plain).flatten().tolist() == [0, 1, 4, 5, 9]
