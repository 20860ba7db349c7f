"""Early-exit self-drafting: the target's first K layers + its final norm + its LM head.

The drafter is the target itself, truncated (LayerSkip-style, without training). It shares the
target's KV cache: layers 0..K-1 of the committed tokens are exactly what the truncated model
needs, so drafting appends its tree nodes as pending entries to those layers of the target's
cache and rolls them back before verification. Nothing is copied and nothing is recomputed
for committed tokens.

Deliberately not here: reusing the drafts' layer<K KV during verification (the verify forward
recomputes all layers), trained exit heads, per-token dynamic exits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from drafttrain.decode.kv import target_forward, truncated_layers
from drafttrain.decode.proposers.base import NodeDrafter
from drafttrain.textconfig import text_config

__all__ = ["EarlyExitProposer"]


class EarlyExitProposer(NodeDrafter):
    """Drafts with the target's first `num_layers` decoder layers.

    Args:
        target: the target HF causal LM.
        num_layers: K, the number of decoder layers the drafter runs (1 <= K < N).
        gamma: default drafts per step.
    """

    name = "early-exit"
    commit_accepted = False

    def __init__(self, target: nn.Module, num_layers: int, *, gamma: int = 3):
        total = text_config(target.config).num_hidden_layers
        if not 1 <= num_layers < total:
            raise ValueError(f"early-exit:K needs 1 <= K < {total} (the target's layers), got {num_layers}")
        self.target, self.num_layers, self.default_gamma = target, num_layers, gamma
        self.softcap = getattr(text_config(target.config), "final_logit_softcapping", None)

    def _run(self, state, tokens: Tensor, positions: Tensor, parent_slots: Tensor) -> Tensor:
        with truncated_layers(self.target, self.num_layers):
            logits, _ = target_forward(self.target, state.kv, tokens, positions, parent_slots)
        return logits  # [B, n, V]: the wrapper already applies Gemma's final soft-capping

    def _begin(self, state, capacity: int) -> tuple[Tensor, int]:
        # the root is not in the target's cache yet: feed it as pending slot 0
        B = state.root.shape[0]
        parents = torch.full((B, 1), -1, dtype=torch.long, device=state.root.device)
        logits = self._run(state, state.root[:, None], state.root_pos[:, None], parents)
        return logits[:, 0], 0

    def _feed(self, state, tokens, nodes, parents, parent_slots, positions) -> Tensor:
        return self._run(state, tokens, positions, parent_slots)

    def propose(self, state):
        try:
            return super().propose(state)
        finally:
            state.kv.rollback()  # layers < K hold the drafts as pending: drop them before verifying

    def observe(self, state, tree, result, hidden, *, own=None) -> None:
        pass  # nothing of its own to keep: the target's commit covers layers < K

    def select_rows(self, idx: Tensor) -> bool:
        return True  # no per-row state: the engine compacts the target's cache
