"""Medusa heads as a proposer: a static tree (default: the one learned at training) or a chain.

All K heads read ONE hidden state: the target's final post-norm state at the last accepted
token before the root (the state from which the target itself predicted the root). Head d-1
proposes the tree's depth-d tokens (its top-k, ranked), whatever their parents are, so
`_feed` needs no model call: it returns head d-1's logits for every node at depth d. The
candidates are top-k (deterministic): draft_probs None, and a chain is the heads' top-1s.

Where the state comes from: at prefill, the last real column of the prompt's hidden states
(the prompt minus the root); after verification, the hidden state at the last accepted tree
node (the root itself when nothing was accepted). HF `hidden_states[N]` (N = the target's
layer count) is that post-norm state in transformers v5.

Medusa-2 heads were trained with a LoRA-adapted target: the `target` given to the decoder must
be that adapted model (`drafttrain.models.medusa.load_medusa_target`); `load_proposer` checks it.

Deliberately not here: training, weights (drafttrain.models.medusa), typical acceptance
(lossy; not offered).
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafttrain.decode.proposers.base import NodeDrafter, accepted_paths
from drafttrain.decode.tree import StaticTree

__all__ = ["MedusaProposer"]


class MedusaProposer(NodeDrafter):
    """Proposer around `MedusaHeads` (drafttrain.models.medusa).

    Args:
        heads: the heads, on the target's device.
        num_target_layers: N, so the proposer asks the engine for `hidden_states[N]`.
        tree: default static tree (rank paths, e.g. the drafter folder's `tree_choices`), used
            when the caller passes no tree; None = chain.
        gamma: default chain length (at most one draft per head).
    """

    name = "medusa"

    def __init__(self, heads, num_target_layers: int, *, tree=None, gamma: int | None = None):
        self.heads = heads
        self.K = heads.cfg.num_heads
        self.default_gamma = min(gamma or self.K, self.K)
        self.default_tree = StaticTree.of(tree) if tree else None
        self.needs_hidden_states = (num_target_layers,)

    def _check(self, state) -> None:
        if state.tree is None and state.gamma is None and self.default_tree is not None:
            state.tree = self.default_tree  # the learned tree unless the caller asked otherwise
        depth = state.tree.depth if isinstance(state.tree, StaticTree) else state.gamma or self.default_gamma
        if state.tree is not None and not isinstance(state.tree, StaticTree):
            raise ValueError("Medusa heads draft static trees or chains, not dynamic trees")
        if depth > self.K:
            raise ValueError(f"a Medusa tree/chain of depth {depth} needs {depth} heads; this drafter has {self.K}")

    # ---- engine hooks -----------------------------------------------------------------------------
    def prefill(self, state, hidden) -> None:
        B = state.root.shape[0]
        h = hidden.get(self.needs_hidden_states[0])  # [B, P-1, H] left-padded (None: 1-token prompt)
        # A one-token prompt has no state before the root: zeros (the drafts are then guesses,
        # which verification rejects or accepts as usual).
        self.state_h = torch.zeros(B, self.heads.cfg.hidden_size, device=state.root.device)
        if h is not None:
            self.state_h = h[:, -1].float()  # the last real prompt token before the root

    def propose(self, state):
        self._check(state)
        return super().propose(state)

    def observe(self, state, tree, result, hidden, *, own=None) -> None:
        # any verified tree will do (`own` does not matter): only its accepted path and hidden are read
        h = hidden[self.needs_hidden_states[0]]  # [B, N, H] at the tree nodes
        last = torch.tensor([p[-1] if p else 0 for p in accepted_paths(result)], device=h.device)
        self.state_h = h[torch.arange(h.shape[0], device=h.device), last].float()  # [B, H]

    # ---- NodeDrafter hooks --------------------------------------------------------------------------
    def select_rows(self, idx: Tensor) -> bool:
        self.state_h = self.state_h[idx.to(self.state_h.device)]
        return True

    def _begin(self, state, capacity: int) -> tuple[Tensor, int]:
        self._logits = self.heads(self.state_h)  # [K, B, Vd]
        self._root_pos = state.root_pos
        return self._logits[0], -1

    def _feed(self, state, tokens, nodes, parents, parent_slots, positions) -> Tensor:
        depth = int((positions[0, 0] - self._root_pos[0]).item())  # the same for every fed node
        return self._logits[depth][:, None].expand(-1, tokens.shape[1], -1)  # [B, n, Vd]

    def _end(self, state, accepted_slots) -> None:  # no drafter cache to keep
        pass

    def _draft_to_target(self, ids: Tensor) -> Tensor:
        return ids + self.heads.d2t[ids]

    def _draft_vocab(self) -> Tensor:
        return self.heads.draft_ids
