"""EAGLE-1 / EAGLE-3 feature drafter as a proposer: chains and EAGLE-2 dynamic trees.

Alignment (see drafttrain/models/eagle.py): the drafter's input at position t+1 is
(feature f_t of token x_t, embedding of x_{t+1}); it predicts x_{t+2} and returns its own
guess of the next feature, which feeds the next level of the tree. Target features come from
the target's verification forward (`needs_hidden_states` = the drafter's aux layer ids,
fused by `drafter.fuse`).

Per row the proposer remembers which token it last read as an input (`read`) and the target
features it has not used yet, as the target gave them (the aux layers' states, concatenated):
they go through the drafter's `fc` only when it drafts, in one call for all of them, so a step
the drafter sits out (a hybrid's n-gram step, or the prompt of a generation it never drafts in)
costs an index and no matmul. Each step it drafts it catches up on the newly accepted tokens
with their TARGET features (the KV of the drafted nodes, computed from the drafter's own
features, is rolled back, as in the official implementation), which yields the root's logits;
then the base class grows the tree. A reduced draft vocabulary is mapped back with `d2t` (target id =
draft id + d2t[draft id]).

Deliberately not here: training, loading weights (drafttrain.models.eagle), Medusa.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafttrain.decode.kernels.cpu_layers import MAX_ROWS, fused
from drafttrain.decode.kv import KVState
from drafttrain.decode.proposers.base import NodeDrafter, accepted_paths

__all__ = ["EagleProposer", "CATCH_UP_FUSED_ROWS"]

#: A catch-up (the tokens accepted since the drafter last read, or a prompt) of more rows than
#: this (batch rows x tokens) runs through PyTorch computing only the earlier columns' keys and
#: values and the last column in full; the fused layer computes every column in full. Session 37,
#: EPYC, `bench/catch_up.py` (ms, fused vs keys-and-values PyTorch): 4 rows 0.80 / 0.83, 6 rows
#: 1.12 / 0.87, 16 rows 1.85 / 1.23, 64 rows 4.53 / 2.33; batch 4 x 3 tokens 1.70 / 1.48.
CATCH_UP_FUSED_ROWS = 4


class EagleProposer(NodeDrafter):
    """Proposer around an `EagleDrafter` attached to the target.

    Args:
        drafter: a `drafttrain.models.eagle.EagleDrafter` (attach_target already called).
        gamma: default chain length.
    """

    name = "eagle"
    commit_accepted = False

    def __init__(self, drafter, *, gamma: int = 5):
        self.drafter, self.default_gamma = drafter, gamma
        self.needs_hidden_states = tuple(drafter.cfg.aux_layer_ids)
        self.vocab_size = drafter.cfg.vocab_size

    # ---- features -------------------------------------------------------------------------------
    def _aux(self, hidden: dict[int, Tensor]) -> Tensor:
        """[B, T, A*H] the aux layers' states, concatenated: what `fuse` reads."""
        return torch.cat([hidden[i] for i in self.needs_hidden_states], -1)

    def _fused(self, aux: Tensor) -> Tensor:
        """[..., A*H] concatenated aux states -> [..., H] the drafter's input features."""
        p = next(self.drafter.parameters())
        return self.drafter.fuse(aux.to(p.dtype))

    def prefill(self, state, hidden) -> None:
        B = state.root.shape[0]
        self.kv = KVState(B, state.root.device)
        self.read = [0] * B  # index of the last token read as an input (x_0 never is)
        self.feats: list[list[Tensor]] = [[] for _ in range(B)]  # unread aux states [k, A*H], in order
        if hidden:
            aux = self._aux(hidden)  # [B, P-1, A*H]; row b's real tokens are its last len-1 columns
            for b, seq in enumerate(state.tokens):
                n = len(seq) - 1
                if n > 0:
                    self.feats[b].append(aux[b, aux.shape[1] - n :])

    def observe(self, state, tree, result, hidden, *, own=None) -> None:
        # Only the verified tree's accepted path and hidden states are read, so this works for any
        # tree (`own` does not matter): a foreign tree, or a step this proposer did not draft.
        self.kv.rollback()  # drafted nodes were built from the drafter's own features
        aux = self._aux(hidden)  # [B, N, A*H] target states at the tree nodes
        for b, path in enumerate(accepted_paths(result)):
            if bool(state.active[b]) or len(state.tokens[b]) - 1 > self.read[b]:
                nodes = torch.tensor([0] + path, device=aux.device)
                self.feats[b].append(aux[b, nodes])

    def select_rows(self, idx: Tensor) -> bool:
        self.kv.select_rows(idx)
        rows = idx.tolist()
        self.read = [self.read[i] for i in rows]
        self.feats = [self.feats[i] for i in rows]
        return True

    # ---- NodeDrafter hooks ----------------------------------------------------------------------
    def _run(self, ids: Tensor, hidden: Tensor, positions: Tensor, parent_slots: Tensor,
             valid: Tensor | None = None, *, last: bool = False) -> tuple[Tensor, Tensor]:
        """The drafter over [B, n] new tokens: (logits [B, n, Vd], or [B, 1, Vd] of the last column
        with `last`; hidden_out [B, n, H], of which a caller with `last` reads the last column only).
        Up to MAX_ROWS rows in all go through the fused layer in one call; more (a catch-up over a
        prompt, or over the steps a hybrid did not draft) through PyTorch's forward, whose GEMMs
        beat the fused layer in 64-row chunks there (Xeon, session 31, `bench/catch_up.py`: 85
        tokens 5.0 vs 6.4 ms at batch 1, 10.1 vs 19.9 ms at batch 4). A catch-up (`last`) of more
        than CATCH_UP_FUSED_ROWS rows goes through PyTorch, which then computes only the keys and
        values of the earlier columns (`EagleDrafter.forward(last_only=True)`)."""
        layer = fused(self.drafter)  # one C++ call for the drafter's layer (decode/kernels/cpu_layers.py)
        B, n = ids.shape
        rows_fused = CATCH_UP_FUSED_ROWS if last else MAX_ROWS
        if layer is not None and B * n <= rows_fused and not torch.is_grad_enabled():
            mask = self.kv.extend(positions, parent_slots, valid)  # fp32, what the fused layer adds
            h = layer.hidden_out(ids, hidden, positions, mask, self.kv.cache)
            return self.drafter.logits(h[:, -1:] if last else h), h
        mask = self.kv.extend(positions, parent_slots, valid, dtype=hidden.dtype)
        return self.drafter(ids, hidden, position_ids=positions, past_key_values=self.kv.cache,
                            attention_mask=mask, last_logits=last, last_only=last)

    def _begin(self, state, capacity: int) -> tuple[Tensor, int]:
        B, device = len(state.tokens), state.root.device
        dtype = next(self.drafter.parameters()).dtype
        todo = [seq[r + 1 :] for seq, r in zip(state.tokens, self.read)]
        feats = [torch.cat(f, 0)[-len(t):] if t else None for f, t in zip(self.feats, todo)]  # aux states
        m = max(1, max(len(t) for t in todo))
        if all(len(t) == m for t in todo):  # no padding (batch 1, or rows that accepted alike): fewer ops
            pos = torch.tensor([list(range(r + 1, r + 1 + m)) for r in self.read], device=device)
            parents = torch.tensor([[-1, *range(m - 1)]] * B, device=device)
            hid = self._fused(torch.stack(feats))  # every row's features through fc in one call
            logits, h_out = self._run(torch.tensor(todo, device=device), hid, pos, parents, last=True)
            self.kv.commit(torch.arange(m, device=device).expand(B, m), prefix=True)
            return self._caught_up(state, capacity, logits, h_out, dtype)
        ids = torch.zeros(B, m, dtype=torch.long, device=device)
        A = next(f for f in feats if f is not None).shape[-1]
        aux = torch.zeros(B, m, A, dtype=dtype, device=device)
        valid = torch.zeros(B, m, dtype=torch.bool, device=device)
        pos = torch.zeros(B, m, dtype=torch.long, device=device)
        for b, t in enumerate(todo):
            if not t:
                continue
            n = len(t)
            ids[b, m - n :] = torch.tensor(t, device=device)
            aux[b, m - n :] = feats[b]
            valid[b, m - n :] = True
            pos[b, m - n :] = torch.arange(self.read[b] + 1, self.read[b] + 1 + n, device=device)
        col = torch.arange(m, device=device).expand(B, m)
        parents = torch.where(valid & (col > 0) & valid.roll(1, 1), col - 1, -1)
        logits, h_out = self._run(ids, self._fused(aux), pos, parents, valid, last=True)  # padding: fc(0) = 0
        self.kv.commit(torch.where(valid, col, -1))
        return self._caught_up(state, capacity, logits, h_out, dtype)

    def _caught_up(self, state, capacity: int, logits: Tensor, h_out: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        """After the catch-up forward: every token read, features used; the root's logits and
        feature start the tree."""
        B, H = h_out.shape[0], h_out.shape[-1]
        self.read = [len(seq) - 1 for seq in state.tokens]
        self.feats = [[] for _ in range(B)]
        self._node_hidden = torch.zeros(B, capacity, H, dtype=dtype, device=h_out.device)
        self._node_hidden[:, 0] = h_out[:, -1]
        return logits[:, -1], -1

    def _feed(self, state, tokens, nodes, parents, parent_slots, positions) -> Tensor:
        H = self._node_hidden.shape[-1]
        hid = self._node_hidden.gather(1, parents[:, :, None].expand(-1, -1, H))  # parents' features
        logits, h_out = self._run(tokens, hid, positions, parent_slots)
        self._node_hidden.scatter_(1, nodes[:, :, None].expand(-1, -1, H), h_out)
        return logits

    def _end(self, state, accepted_slots) -> None:  # observe() handles everything
        pass

    def _draft_to_target(self, ids: Tensor) -> Tensor:
        return ids + self.drafter.d2t[ids]

    def _draft_vocab(self) -> Tensor:
        return self.drafter.draft_ids
