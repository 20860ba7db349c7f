"""The reduced draft vocabulary: which target tokens a drafter can propose, and the mapping.

A drafter with a reduced vocabulary (EAGLE-3's draft LM head, Medusa heads) keeps the Vd most
frequent loss-masked training tokens; slots the answers leave free go to the prompts' most frequent
tokens (a target echoes its prompt), then to the lowest never-seen ids. `d2t[i] = target_id - draft_id` (an offset, as engines
store it), `t2d` a bool mask over the target vocabulary. `token_counts` counts the tokens a
drafter must predict, `build_vocab_mapping` picks the vocabulary, `validate_vocab_mapping`
checks the invariants, and `DraftVocab` gives a drafter module `set_vocab_mapping` / `draft_ids`
over its `d2t` / `t2d` buffers.

This module is a leaf (torch only). Deliberately not here: who uses a reduced vocabulary and how
its loss masks out-of-vocabulary positions (the methods and losses).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_counts", "build_vocab_mapping", "validate_vocab_mapping", "DraftVocab"]


def token_counts(ds, vocab_size: int, *, context: bool = False) -> Tensor:
    """[V] counts of loss-masked tokens (the tokens the drafter must predict) over records with
    `input_ids` and `loss_mask`; `context=True` counts the other tokens (prompts, templates)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in ds:
        ids = torch.tensor(r["input_ids"], dtype=torch.long)
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[~mask if context else mask], minlength=vocab_size)[:vocab_size].double()
    return counts


def build_vocab_mapping(token_counts: Tensor, draft_vocab_size: int,
                        tie_break: Tensor | None = None) -> tuple[Tensor, Tensor, float]:
    """Reduced draft vocab from loss-masked token frequencies.

    Args:
        token_counts: [V] counts of each target token among loss-masked (assistant) tokens.
        draft_vocab_size: Vd <= V.
        tie_break: [V] optional second key among tokens of equal count (chiefly the never-seen
            ones): the training prompts' counts, since a target echoes its prompt and a small
            training set's answers leave many slots of the vocabulary free (the default recipe's
            420 answers use 5,793 distinct tokens of its 8,192).

    Returns:
        d2t [Vd] long offsets (target_id = draft_id + d2t[draft_id]), t2d [V] bool mask,
        coverage: fraction of counted tokens inside the draft vocab.
    """
    V = token_counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V} (the target vocab), got {draft_vocab_size}")
    # Most frequent first; ties (incl. never-seen tokens) broken by `tie_break`, then the lowest id.
    order = torch.arange(V)
    if tie_break is not None:
        order = torch.sort(tie_break.double(), descending=True, stable=True).indices
    order = order[torch.sort(token_counts.double()[order], descending=True, stable=True).indices][:draft_vocab_size]
    draft_to_target = torch.sort(order).values  # draft ids follow target-id order, as engines expect
    d2t = draft_to_target - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_to_target] = True
    total = token_counts.sum().item()
    coverage = float(token_counts[draft_to_target].sum().item() / total) if total > 0 else 0.0
    validate_vocab_mapping(d2t, t2d)
    return d2t, t2d, coverage


def validate_vocab_mapping(d2t: Tensor, t2d: Tensor) -> None:
    """Check the d2t / t2d invariants; raises ValueError naming the broken one."""
    Vd, V = d2t.numel(), t2d.numel()
    target_ids = torch.arange(Vd, device=d2t.device) + d2t
    if d2t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"d2t must be an integer tensor, got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise ValueError(f"t2d must be a bool tensor, got {t2d.dtype}")
    if Vd > V:
        raise ValueError(f"draft vocab ({Vd}) is larger than the target vocab ({V})")
    if target_ids.min() < 0 or target_ids.max() >= V:
        raise ValueError(f"d2t maps draft ids outside the target vocab [0, {V})")
    if target_ids.unique().numel() != Vd:
        raise ValueError("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != Vd:
        raise ValueError(f"t2d marks {int(t2d.sum())} target ids but the draft vocab has {Vd}")
    if not bool(t2d[target_ids].all()):
        raise ValueError("d2t and t2d disagree: a draft id's target id is not marked in t2d")


class DraftVocab:
    """Mixin for drafter modules with `d2t` [Vd] / `t2d` [V] buffers and `cfg.draft_vocab_size`."""

    d2t: Tensor
    t2d: Tensor

    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> Tensor:
        """[Vd] target ids of the draft vocabulary, in draft order."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
