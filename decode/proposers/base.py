"""The Proposer interface, plus the tree-growing loop shared by every autoregressive drafter.

A proposer sees the decoding state and returns a `DraftTree`. The engine calls, per generate
call:

    proposer.prefill(state, hidden)        # once, after the target's prefill forward
    loop:
        tree = proposer.propose(state)     # draft
        ... target verifies the tree ...
        proposer.observe(state, tree, result, hidden)   # learn what was accepted
        proposer.select_rows(idx)          # when rows finished: keep the active ones (optional)

`observe(..., own=mask)`: wrappers (scheduler.py, hybrid.py) also call `observe` for steps whose
verified tree was not this proposer's last proposal, for some rows or all (`own` [B] bool: rows
whose verified tree came from this proposer's last `propose` in this step; None = all). A
proposer must then use only the accepted path and `hidden` of the verified tree for the other
rows (and read nothing of its own drafts there): it may even not have proposed this step.

`hidden` maps each index in `proposer.needs_hidden_states` (HF `hidden_states` numbering:
0 = embedding output, j = output of decoder layer j-1) to the target's hidden states at the
tokens just fed: the prompt minus its last token at prefill ([B, P-1, H]), the tree nodes at
verification ([B, N, H]).

`NodeDrafter` implements `propose` for any drafter that scores one tree level at a time given
its parents (early exit, a draft LM, EAGLE): chain (gamma drafts, sampled when temperature > 0
with their probabilities), static Medusa-style trees and EAGLE-2 dynamic trees (deterministic
top-k candidates: draft_probs None), each node with its confidence (the drafter's probability of
the node's token at its parent; for sampled chains the top probability of q, known before the
draw). A subclass provides three hooks:

    _begin(state) -> (root logits [B, V'], root slot)    # catch up on committed tokens
    _feed(state, tokens, parent_nodes, parent_slots, positions) -> logits [B, n, V']
    _end(state, tree, result)                            # commit or roll back its KV

V' may be a reduced draft vocabulary; `_draft_to_target` maps ids and `_draft_vocab` names the
target ids of its columns, which sampled trees carry beside q (`DraftTree.draft_vocab`) instead of
scattering q back to the target vocabulary every draft step.

Deliberately not here: model loading (proposers/__init__.py), verification, KV layout (kv.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from drafttrain.decode.sampling import keyed_categorical, process_logits
from drafttrain.decode.tree import DraftTree, DynamicTree, StaticTree, chain_tree, rerank_to_budget

if TYPE_CHECKING:
    from drafttrain.decode.engine import DecodeState
    from drafttrain.decode.verify import VerifyResult

__all__ = ["Proposer", "NodeDrafter", "accepted_paths", "proposer_key"]


class Proposer:
    """Base class of every proposer. Subclasses override `propose` (and usually the others)."""

    #: HF hidden_states indices the proposer wants from the target's forwards.
    needs_hidden_states: tuple[int, ...] = ()
    #: default chain length when the caller passes no gamma.
    default_gamma: int = 4
    name: str = "proposer"

    def prefill(self, state: DecodeState, hidden: dict[int, Tensor]) -> None:
        """Called once after the target's prefill (hidden: [B, P-1, H] per requested index)."""

    def propose(self, state: DecodeState) -> DraftTree:
        """Returns the draft tree for this step (node 0 = state.root)."""
        raise NotImplementedError

    def observe(self, state: DecodeState, tree: DraftTree, result: VerifyResult,
                hidden: dict[int, Tensor], *, own: Tensor | None = None) -> None:
        """Called after verification, once state.tokens holds the newly accepted tokens.

        Args:
            own: [B] bool, rows whose verified tree is this proposer's last proposal (None = all).
        """

    def select_rows(self, idx: Tensor) -> bool:
        """Keeps only batch rows `idx` ([B'] long) of the per-row state (finished rows leave the
        batch; called between steps, after `observe`). Returns False, changing nothing, if the
        proposer cannot: the engine then keeps every row in the batch (the default)."""
        return False


def proposer_key(proposer: Proposer) -> str:
    """The name a proposer's draft cost is filed under (costmodel.py): its `name`, plus K for early exit."""
    name = getattr(proposer, "name", None) or type(proposer).__name__
    if name == "early-exit":
        return f"early-exit:{proposer.num_layers}"
    return name


def accepted_paths(result: VerifyResult) -> list[list[int]]:
    """Per row, the accepted draft node ids in order (root excluded)."""
    acc = result.accepted.tolist()
    return [row[:n] for row, n in zip(acc, result.num_accepted.tolist())]


class NodeDrafter(Proposer):
    """Grows chains, static trees and dynamic trees from a per-level scoring hook.

    While drafting, nodes live in a per-row id space (0 = root; for chains and static trees
    these are the tree's node ids, for dynamic trees 1 + candidate index). `self._slot`
    [B, capacity] maps each id to its pending slot in the drafter's cache (-1: not fed), and
    `self._tree_ids` [B, N] maps the returned tree's nodes back to drafting ids.
    """

    #: commit the drafter's KV of accepted draft nodes (True) or roll all draft KV back (False).
    commit_accepted: bool = True

    # ---- hooks ----------------------------------------------------------------------------------
    def _begin(self, state: DecodeState, capacity: int) -> tuple[Tensor, int]:
        """Catches up on committed tokens; returns (root logits [B, V'], root's pending slot or -1)."""
        raise NotImplementedError

    def _feed(self, state: DecodeState, tokens: Tensor, nodes: Tensor, parents: Tensor,
              parent_slots: Tensor, positions: Tensor) -> Tensor:
        """Appends nodes (target ids [B, n]) as pending entries; returns their logits [B, n, V']."""
        raise NotImplementedError

    def _end(self, state: DecodeState, accepted_slots: list[list[int]]) -> None:
        """After verification: `accepted_slots[b]` are the pending slots of the accepted, fed
        draft nodes of row b, in path order (a prefix of the accepted path)."""
        raise NotImplementedError

    def _draft_to_target(self, ids: Tensor) -> Tensor:
        return ids

    def _draft_vocab(self) -> Tensor | None:
        """[V'] target ids of a reduced drafting vocabulary (sampled q stays [B, V'] in the tree's
        draft_probs, `DraftTree.draft_vocab`), or None when V' is the target's vocabulary."""
        return None

    # ---- propose ---------------------------------------------------------------------------------
    def propose(self, state: DecodeState) -> DraftTree:
        spec = state.tree
        if isinstance(spec, StaticTree):
            capacity = 1 + len(spec.choices)
        elif isinstance(spec, DynamicTree):
            capacity = 1 + spec.top_k + (spec.depth - 1) * spec.top_k**2
        else:
            capacity = 1 + (state.gamma or self.default_gamma)
        B, device = state.root.shape[0], state.root.device
        logits0, root_slot = self._begin(state, capacity)  # [B, V']
        self._slot = torch.full((B, capacity), -1, dtype=torch.long, device=device)
        self._slot[:, 0] = root_slot
        self._pending = root_slot + 1
        if isinstance(spec, StaticTree):
            tree = self._draft_static(state, logits0, spec)
        elif isinstance(spec, DynamicTree):
            tree = self._draft_dynamic(state, logits0, spec)
        else:
            tree = self._draft_chain(state, logits0, state.gamma or self.default_gamma)
        return tree

    def observe(self, state, tree, result, hidden, *, own: Tensor | None = None) -> None:
        paths = accepted_paths(result)
        mine = [True] * len(paths) if own is None else own.tolist()
        # [B, N] pending slot per tree node; read only for rows whose tree is this step's proposal
        slots = self._slot.gather(1, self._tree_ids).tolist() if any(mine) else []
        accepted = []
        for b, path in enumerate(paths):
            fed = []
            for node in path if mine[b] else ():  # other rows: keep nothing, _begin catches up
                if slots[b][node] < 0:
                    break
                fed.append(slots[b][node])
            accepted.append(fed)
        self._end(state, accepted)

    def _feed_nodes(self, state: DecodeState, tokens: Tensor, nodes: Tensor, parents: Tensor,
                    depth: int) -> Tensor:
        """Feeds nodes (target ids [B, n], drafting ids [B, n], parent ids [B, n]) at `depth`."""
        B, n = tokens.shape
        parent_slots = self._slot.gather(1, parents)  # [B, n]
        positions = (state.root_pos + depth)[:, None].expand(B, n)
        logits = self._feed(state, tokens, nodes, parents, parent_slots, positions)  # [B, n, V']
        new = torch.arange(self._pending, self._pending + n, device=tokens.device).expand(B, n)
        self._slot.scatter_(1, nodes, new)
        self._pending += n
        return logits

    def _draft_chain(self, state: DecodeState, logits: Tensor, gamma: int) -> DraftTree:
        """gamma drafts on one branch; sampled, with their probabilities, when temperature > 0."""
        B = logits.shape[0]
        drafts, probs, conf = [], [], []
        for t in range(gamma):
            if state.temperature == 0:
                x = logits.argmax(-1)  # process_logits' one-hot would pick the same first maximum
                conf.append(torch.softmax(logits.float(), -1).max(-1).values)  # p of the argmax
            else:
                q = process_logits(logits, state.temperature, state.top_k, state.top_p, check=False)  # [B, V']
                # q's top probability, NOT q(x): a confidence must be known before x is drawn
                conf.append(q.max(-1).values)
                if state.seed is not None:  # keyed per row: independent of the batch's composition
                    x = keyed_categorical(q, state.seed, state.root_pos + t + 1)
                else:
                    x = torch.multinomial(q, 1, generator=state.generator)[:, 0]
                probs.append(q)  # over the drafting vocabulary: the tree carries its ids
            drafts.append(self._draft_to_target(x))
            if t + 1 < gamma:  # draft t is node t + 1, child of node t
                node = torch.full((B, 1), t + 1, device=x.device)
                logits = self._feed_nodes(state, drafts[-1][:, None], node, node - 1, depth=t + 1)[:, 0]
        tree = chain_tree(state.root, torch.stack(drafts, 1), torch.stack(probs, 1) if probs else None,
                          torch.stack(conf, 1), self._draft_vocab())
        self._tree_ids = torch.arange(tree.size, device=logits.device).expand(B, -1)
        return tree

    def _draft_static(self, state: DecodeState, logits0: Tensor, spec: StaticTree) -> DraftTree:
        """Medusa-style fixed tree: the node of path (r1..rd) is the rank-rd child of (r1..rd-1).

        Candidates are top-k, i.e. drawn without replacement: deterministic, draft_probs None.
        """
        B, device = logits0.shape[0], logits0.device
        node_of: dict[tuple[int, ...], int] = {(): 0}
        tokens, parents = [state.root], [-1]
        conf = [torch.ones(B, device=device)]
        logits_of = {(): logits0}  # [B, V'] drafter logits at a node
        levels = spec.levels()
        for d, level in enumerate(levels, start=1):
            for path in level:
                top = torch.softmax(logits_of[path[:-1]].float(), -1).topk(path[-1] + 1, dim=-1)
                x = top.indices[:, path[-1]]  # [B]
                node_of[path] = len(tokens)
                tokens.append(self._draft_to_target(x))
                conf.append(top.values[:, path[-1]])
                parents.append(node_of[path[:-1]])
            if d == len(levels):
                break
            expand = sorted({q[:-1] for q in levels[d]})  # this level's nodes that have children
            ids = torch.stack([tokens[node_of[p]] for p in expand], 1)  # [B, n]
            nodes = torch.tensor([node_of[p] for p in expand], device=device).expand(B, -1)
            par = torch.tensor([node_of[p[:-1]] for p in expand], device=device).expand(B, -1)
            out = self._feed_nodes(state, ids, nodes, par, depth=d)  # [B, n, V']
            for j, p in enumerate(expand):
                logits_of[p] = out[:, j]
        tok = torch.stack(tokens, 1)
        self._tree_ids = torch.arange(tok.shape[1], device=device).expand(B, -1)
        return DraftTree(tok, torch.tensor(parents, device=device).expand(B, -1).clone(), None,
                         torch.stack(conf, 1))

    def _draft_dynamic(self, state: DecodeState, logits0: Tensor, spec: DynamicTree) -> DraftTree:
        """EAGLE-2: expand the top_k frontier nodes by cumulative draft log-prob, then rerank
        all candidates to the token budget. Deterministic candidates: draft_probs None."""
        B, device, k = logits0.shape[0], logits0.device, spec.top_k
        top = torch.log_softmax(logits0.float(), -1).topk(k, -1)  # [B, k]
        cand_tok = [self._draft_to_target(top.indices)]  # per level: [B, *] target ids
        cand_score = [top.values]  # cumulative log-probs
        cand_local = [top.values]  # each candidate's own log-prob at its parent (its confidence)
        cand_parent = [torch.full((B, k), -1, dtype=torch.long, device=device)]  # parent candidate
        frontier = torch.arange(k, device=device).expand(B, k)  # candidate indices [B, k]
        front_score = top.values
        offset = k
        for d in range(1, spec.depth):
            front_tok = torch.cat(cand_tok, 1).gather(1, frontier)  # [B, k]
            front_par = torch.cat(cand_parent, 1).gather(1, frontier)  # [B, k]
            logits = self._feed_nodes(state, front_tok, frontier + 1, front_par + 1, depth=d)  # [B, k, V']
            child = torch.log_softmax(logits.float(), -1).topk(k, -1)  # [B, k, k]
            scores = front_score[:, :, None] + child.values  # [B, k, k]
            cand_tok.append(self._draft_to_target(child.indices).reshape(B, k * k))
            cand_score.append(scores.reshape(B, k * k))
            cand_local.append(child.values.reshape(B, k * k))
            cand_parent.append(frontier[:, :, None].expand(B, k, k).reshape(B, k * k))
            best = scores.reshape(B, k * k).topk(k, -1)
            frontier = offset + best.indices
            front_score = best.values
            offset += k * k
        keep, parents = rerank_to_budget(torch.cat(cand_score, 1), torch.cat(cand_parent, 1), spec.budget)
        tokens = torch.cat([state.root[:, None], torch.cat(cand_tok, 1).gather(1, keep)], 1)
        self._tree_ids = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), keep + 1], 1)
        conf = torch.cat([torch.ones(B, 1, device=device), torch.cat(cand_local, 1).gather(1, keep).exp()], 1)
        return DraftTree(tokens, parents, None, conf)
