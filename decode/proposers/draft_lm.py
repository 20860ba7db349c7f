"""A standalone draft LM (any HF causal LM sharing the target's tokenizer) as the proposer.

The draft model keeps its own KV cache (a `KVState`). Each step it first catches up on the
committed tokens it has not read yet (the bonus / recovered token, and the last draft of a
fully accepted chain), which also yields its logits at the root; then it grows the tree. After
verification it keeps the KV of accepted draft nodes it fed (the same tokens at the same
positions, so the entries are exactly what re-reading them would give) and drops the rest.
Sampled chains carry the processed draft distribution for lossless rejection sampling.

Deliberately not here: loading by name (proposers/__init__.py), vocab translation between
different tokenizers (the draft must share the target's ids).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from drafttrain.decode.kv import KVState, target_forward
from drafttrain.decode.proposers.base import NodeDrafter

__all__ = ["DraftLMProposer"]


class DraftLMProposer(NodeDrafter):
    """Drafts with a small causal LM.

    Args:
        model: the draft HF causal LM (eval mode, same vocabulary ids as the target).
        gamma: default drafts per step.
    """

    name = "draft-lm"

    def __init__(self, model: nn.Module, *, gamma: int = 4):
        self.model, self.default_gamma = model, gamma

    def prefill(self, state, hidden) -> None:
        B = state.root.shape[0]
        self.kv = KVState.for_model(self.model, B, state.root.device)
        self.read = [0] * B  # tokens of state.tokens[b] the draft cache holds

    def _begin(self, state, capacity: int) -> tuple[Tensor, int]:
        # catch up: feed tokens[b][read_b:] right-aligned (the root lands in the last column)
        todo = [seq[r:] for seq, r in zip(state.tokens, self.read)]
        B, m = len(todo), max(len(t) for t in todo)
        device = state.root.device
        ids = torch.zeros(B, m, dtype=torch.long)
        valid = torch.zeros(B, m, dtype=torch.bool)
        positions = torch.zeros(B, m, dtype=torch.long)
        for b, t in enumerate(todo):
            ids[b, m - len(t) :] = torch.tensor(t, dtype=torch.long)
            valid[b, m - len(t) :] = True
            positions[b, m - len(t) :] = torch.arange(self.read[b], self.read[b] + len(t))
        col = torch.arange(m).expand(B, m)
        parents = torch.where(valid & (col > 0) & valid.roll(1, 1), col - 1, -1)
        logits, _ = target_forward(self.model, self.kv, ids.to(device), positions.to(device),
                                   parents.to(device), valid=valid.to(device))
        self.kv.commit(torch.where(valid, col, -1).to(device))
        self.read = [len(seq) for seq in state.tokens]
        return logits[:, -1], -1

    def _feed(self, state, tokens, nodes, parents, parent_slots, positions) -> Tensor:
        logits, _ = target_forward(self.model, self.kv, tokens, positions, parent_slots)
        return logits

    def _end(self, state, accepted_slots: list[list[int]]) -> None:
        # accepted fed drafts are committed tokens: keep their KV, drop the rest of the tree
        m = max((len(s) for s in accepted_slots), default=0)
        keep = torch.full((len(accepted_slots), m), -1, dtype=torch.long)
        for b, s in enumerate(accepted_slots):
            keep[b, : len(s)] = torch.tensor(s, dtype=torch.long)
            self.read[b] += len(s)
        self.kv.commit(keep.to(state.root.device))
