"""A standalone draft LM (any HF causal LM sharing the target's tokenizer) as the proposer.

The draft model keeps its own KV cache (a `KVState`). Each step it first catches up on the
committed tokens it has not read yet (the bonus / recovered token, and the last draft of a
fully accepted chain), which also yields its logits at the root; then it grows the tree. After
verification it keeps the KV of accepted draft nodes it fed (the same tokens at the same
positions, so the entries are exactly what re-reading them would give) and drops the rest.
Sampled chains carry the processed draft distribution for lossless rejection sampling.

Decode vocabulary (FR-Spec-style): given `vocab` (ascending target ids; by default the drafter
folder's `decode_vocab.safetensors`, see drafttrain.models.draft_lm), drafts come from those
LM-head rows only. With Gemma's 262k x 640 head most of a 2-layer student's cost is the head,
so 16k rows make a draft step several times cheaper. Still lossless: drafts are proposals, and
sampled drafts carry the (restricted) distribution they were drawn from.

Deliberately not here: loading by name (proposers/__init__.py), vocab translation between
different tokenizers (the draft must share the target's ids).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from drafttrain.decode.kv import KVState, target_forward
from drafttrain.decode.proposers.base import NodeDrafter
from drafttrain.textconfig import text_config

__all__ = ["DraftLMProposer"]


class DraftLMProposer(NodeDrafter):
    """Drafts with a small causal LM.

    Args:
        model: the draft HF causal LM (eval mode, same vocabulary ids as the target).
        gamma: default drafts per step.
        vocab: [Vd] ascending target ids to draft from; "auto" = the decode vocabulary that
            `load_draft_lm` attached to the model (none: the full head); None = the full head.
    """

    name = "draft-lm"

    def __init__(self, model: nn.Module, *, gamma: int = 4, vocab: Tensor | str | None = "auto"):
        self.model, self.default_gamma = model, gamma
        if isinstance(vocab, str):
            if vocab != "auto":
                raise ValueError(f"vocab must be a tensor of token ids, 'auto' or None, got {vocab!r}")
            vocab = getattr(model, "drafttrain_decode_vocab", None)
        self.vocab = None
        if vocab is not None:
            head = model.get_output_embeddings()
            self.vocab = vocab.to(device=head.weight.device, dtype=torch.long)
            self.vocab_size = head.weight.shape[0]
            if self.vocab.numel() == 0 or int(self.vocab.max()) >= self.vocab_size or int(self.vocab.min()) < 0:
                raise ValueError(f"decode vocab ids must lie in 0..{self.vocab_size - 1}")
            self._w = head.weight.detach()[self.vocab]  # [Vd, H]
            bias = getattr(head, "bias", None)
            self._b = bias.detach()[self.vocab] if bias is not None else None
            self._cap = getattr(text_config(model.config), "final_logit_softcapping", None)

    def _forward(self, ids: Tensor, positions: Tensor, parents: Tensor, valid: Tensor | None = None) -> Tensor:
        """The draft model's logits over its drafting vocabulary ([B, n, V] or [B, n, Vd])."""
        if self.vocab is None:
            logits, _ = target_forward(self.model, self.kv, ids, positions, parents, valid=valid)
            return logits
        h, _ = target_forward(self.model, self.kv, ids, positions, parents, valid=valid, head="hidden")
        logits = nn.functional.linear(h.to(self._w.dtype), self._w, self._b)
        return self._cap * torch.tanh(logits / self._cap) if self._cap else logits

    def _draft_to_target(self, ids: Tensor) -> Tensor:
        return ids if self.vocab is None else self.vocab[ids]

    def _draft_vocab(self) -> Tensor | None:
        return self.vocab

    def prefill(self, state, hidden) -> None:
        B = state.root.shape[0]
        self.kv = KVState.for_model(self.model, B, state.root.device)
        self.read = [0] * B  # tokens of state.tokens[b] the draft cache holds

    def select_rows(self, idx: Tensor) -> bool:
        self.kv.select_rows(idx)
        self.read = [self.read[i] for i in idx.tolist()]
        return True

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
        logits = self._forward(ids.to(device), positions.to(device), parents.to(device), valid.to(device))
        self.kv.commit(torch.where(valid, col, -1).to(device))
        self.read = [len(seq) for seq in state.tokens]
        return logits[:, -1], -1

    def _feed(self, state, tokens, nodes, parents, parent_slots, positions) -> Tensor:
        return self._forward(tokens, positions, parent_slots)

    def _end(self, state, accepted_slots: list[list[int]]) -> None:
        # accepted fed drafts are committed tokens: keep their KV, drop the rest of the tree
        m = max((len(s) for s in accepted_slots), default=0)
        keep = torch.full((len(accepted_slots), m), -1, dtype=torch.long)
        for b, s in enumerate(accepted_slots):
            keep[b, : len(s)] = torch.tensor(s, dtype=torch.long)
            self.read[b] += len(s)
        self.kv.commit(keep.to(state.root.device))


def check_draft_vocab(model: nn.Module, target: nn.Module) -> None:
    """Raise ValueError unless the draft LM's output vocabulary is the target's (a shared tokenizer)."""
    dv = model.get_output_embeddings().weight.shape[0]
    tv = target.get_output_embeddings().weight.shape[0]
    if dv != tv:
        raise ValueError(f"draft LM vocabulary ({dv}) differs from the target's ({tv}): they must share a tokenizer")
