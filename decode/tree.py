"""Draft trees: the one data structure every proposer returns and verification consumes.

Layout per row (the verification contract): node 0 is the root, the last accepted token (not
a draft); nodes 1..N-1 are drafts; `parents[b, i] < i`, `parents[b, 0] = -1`, padding nodes
have parent -2. `draft_probs[b, i]` is the processed draft distribution the children of node i
were drawn from, or None for a deterministic drafter (argmax / top-k candidates).
`confidence[b, i]` (optional) is the drafter's raw confidence in node i, known BEFORE node i's
token was drawn (so adaptive schedulers may act on it without anticipating, see
proposers/scheduler.py): the drafter's probability of its top token at the parent (softmax at
T = 0, the processed q at T > 0), a top-k candidate's own probability, or a match-length score
(n-gram); node 0 = 1.

Three shapes:
  * chain: one branch of gamma drafts (`chain_tree`);
  * static (Medusa-style): a fixed set of rank paths, e.g. ((0,), (1,), (0, 0)) = top-1 and
    top-2 at depth 1, top-1 below the top-1 (`StaticTree`);
  * dynamic (EAGLE-2): grown by cumulative draft log-probability, top-k children per node,
    reranked to a token budget (`DynamicTree`, `rerank_to_budget`).

Surgery on drafted trees (adaptive speculation trims and cuts them): `compact_tree` keeps the
nodes of a mask, `chain_prefix` cuts a chain, `first_path` marks each row's first-child path.

Deliberately not here: running any model, attention masks (kv.py), acceptance (verify.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "DraftTree",
    "StaticTree",
    "DynamicTree",
    "chain_tree",
    "root_only",
    "pad_trees",
    "node_depths",
    "rerank_to_budget",
    "parse_tree",
    "compact_tree",
    "chain_prefix",
    "first_path",
    "dense_probs",
]


@dataclass
class DraftTree:
    """A batch of draft trees.

    Attributes:
        tokens: [B, N] token ids (node 0 = root).
        parents: [B, N] parent node ids (-1 root, -2 padding).
        draft_probs: [B, N, V] float32 or None (deterministic drafts); [B, N, V'] over a reduced
            draft vocabulary when `draft_vocab` is given.
        confidence: [B, N] float raw per-node confidence in [0, 1] (node 0 = 1), or None.
        draft_vocab: [V'] long, the target ids of draft_probs' columns (a drafter's reduced
            vocabulary: q is zero elsewhere), or None (draft_probs spans the target's vocabulary).
            Kept sparse, q costs a drafter no scatter into 262k columns a draft step, and
            verification reads V' columns.
    """

    tokens: Tensor
    parents: Tensor
    draft_probs: Tensor | None = None
    confidence: Tensor | None = None
    draft_vocab: Tensor | None = None
    # (parents, depths): a step asks for the depths five or six times (engine, scheduler, calibrator);
    # computed again when `parents` is replaced. Trees are built whole: nothing writes into a tree's
    # `parents` after construction (`without_rows` copies), and inference tensors carry no version
    # counter to tell.
    _depths: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def depths(self) -> Tensor:
        """[B, N] depth of each node (root 0; padding 0). Do not write into the result."""
        cached = self._depths
        if cached is None or cached[0] is not self.parents:
            cached = self._depths = (self.parents, node_depths(self.parents))
        return cached[1]

    def without_rows(self, drop: Tensor) -> DraftTree:
        """Turns every draft of the rows where `drop` [B] is True into padding."""
        if not bool(drop.any()):
            return self
        parents = self.parents.clone()
        parents[drop, 1:] = -2
        return DraftTree(self.tokens, parents, self.draft_probs, self.confidence, self.draft_vocab)

    def dense_probs(self, vocab_size: int) -> Tensor | None:
        """draft_probs over the target's whole vocabulary ([B, N, vocab_size]; zero outside a
        reduced draft vocabulary), or None for deterministic drafts."""
        return dense_probs(self.draft_probs, self.draft_vocab, vocab_size)


def dense_probs(probs: Tensor | None, vocab: Tensor | None, vocab_size: int) -> Tensor | None:
    """[..., V'] probabilities over the target ids `vocab` -> [..., vocab_size] (as is when `vocab` is None)."""
    if probs is None or vocab is None:
        return probs
    out = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return out.scatter_(-1, vocab.to(probs.device).expand_as(probs), probs)


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree of rank paths (Medusa 'choices'); each path names the rank of the child
    taken at each depth, e.g. (0, 1) = second-best child of the best first draft."""

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen = set()
        for path in sorted(self.choices, key=lambda p: (len(p), p)):
            if not path or any(r < 0 for r in path):
                raise ValueError(f"bad tree path {path!r}: need a non-empty tuple of ranks >= 0")
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree path {path!r} has no parent path {path[:-1]!r}")
            seen.add(path)

    @classmethod
    def of(cls, choices: Sequence[Sequence[int]]) -> StaticTree:
        return cls(tuple(sorted({tuple(int(r) for r in p) for p in choices}, key=lambda p: (len(p), p))))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.choices)

    def levels(self) -> list[list[tuple[int, ...]]]:
        """Paths grouped by depth (depth 1 first), each level sorted."""
        return [[p for p in self.choices if len(p) == d] for d in range(1, self.depth + 1)]


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree settings (CPU-friendly defaults; the paper's GPU ones are
    depth 7 / top_k 10 / budget 60)."""

    depth: int = 5
    top_k: int = 4
    budget: int = 16


def parse_tree(tree) -> StaticTree | DynamicTree | None:
    """Normalises the `tree=` argument: None (chain), "dynamic", a DynamicTree, a StaticTree, or
    a list of rank paths."""
    if tree is None or isinstance(tree, (StaticTree, DynamicTree)):
        return tree
    if isinstance(tree, str):
        if tree == "dynamic":
            return DynamicTree()
        raise ValueError(f"unknown tree {tree!r}; expected 'dynamic', a DynamicTree or a list of rank paths")
    if isinstance(tree, dict):
        return DynamicTree(**tree)
    return StaticTree.of(tree)


def node_depths(parents: Tensor) -> Tensor:
    """[B, N] parents -> [B, N] depths (parents precede children, so one pass suffices).

    In Python over the host copy of `parents`: trees are small (B x N up to ~1,000 nodes), and a
    loop of tensor ops costs four ops per node (~0.3 ms for a 6-node chain on the 2-core CPU)."""
    depth = []
    for row in parents.tolist():
        d = [0] * len(row)
        for i in range(1, len(row)):
            p = row[i]
            d[i] = d[p] + 1 if p >= 0 else 0
        depth.append(d)
    return torch.tensor(depth, dtype=torch.long, device=parents.device).reshape(parents.shape)


def chain_tree(root: Tensor, drafts: Tensor, draft_probs: Tensor | None = None,
               confidence: Tensor | None = None, draft_vocab: Tensor | None = None) -> DraftTree:
    """A chain: root -> drafts[:, 0] -> ... -> drafts[:, -1].

    Args:
        root: [B] last accepted tokens.
        drafts: [B, g] drafted tokens.
        draft_probs: [B, g, V] distribution each draft was drawn from ([B, g, V'] over
            `draft_vocab`), or None.
        confidence: [B, g] the drafter's confidence in each draft (see DraftTree), or None.
        draft_vocab: [V'] target ids of draft_probs' columns, or None (see DraftTree).
    """
    B, g = drafts.shape
    tokens = torch.cat([root[:, None], drafts], 1)  # [B, g + 1]
    parents = torch.arange(-1, g, device=root.device).expand(B, g + 1).clone()
    probs = None
    if draft_probs is not None:
        # node i's children were drawn from draft_probs[:, i]; the last draft has no children
        probs = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1)  # [B, g + 1, V]
    conf = None
    if confidence is not None:
        conf = torch.cat([torch.ones_like(confidence[:, :1]), confidence], 1).float()  # [B, g + 1]
    return DraftTree(tokens, parents, probs, conf, draft_vocab if probs is not None else None)


def root_only(root: Tensor) -> DraftTree:
    """A tree without drafts (target-only decoding)."""
    return DraftTree(root[:, None], torch.full_like(root[:, None], -1), None,
                     torch.ones(root.shape[0], 1, device=root.device))


def pad_trees(rows: list[tuple[list[int], list[int]]] | list[tuple[list[int], list[int], list[float]]],
              device: torch.device) -> DraftTree:
    """Stacks per-row (tokens, parents) or (tokens, parents, confidences) lists of different sizes,
    padding with parent -2 (and confidence 0)."""
    N = max(len(r[0]) for r in rows)
    tokens = torch.zeros(len(rows), N, dtype=torch.long)
    parents = torch.full((len(rows), N), -2, dtype=torch.long)
    conf = torch.zeros(len(rows), N) if any(len(r) > 2 for r in rows) else None
    for b, r in enumerate(rows):
        t, p = r[0], r[1]
        tokens[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        parents[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        if conf is not None:
            conf[b, 0] = 1.0
            if len(r) > 2:
                conf[b, : len(r[2])] = torch.tensor(r[2], dtype=torch.float32)
    return DraftTree(tokens.to(device), parents.to(device), None, None if conf is None else conf.to(device))


def rerank_to_budget(scores: Tensor, parents: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """EAGLE-2 rerank: keep the `budget` candidates with the highest cumulative log-probability.

    A child's cumulative log-prob never exceeds its parent's, so the top set is closed under
    ancestors once ties are broken towards shallower nodes (earlier index: candidates are
    stored level by level).

    Args:
        scores: [B, M] cumulative draft log-probs of the candidate nodes (-inf = not a node).
        parents: [B, M] parent candidate index (-1 = child of the root).
        budget: number of drafts to keep (excluding the root).

    Returns:
        (keep [B, K] candidate indices sorted ascending (so parents precede children),
         new_parents [B, K + 1] tree parents with node 0 = root, -2 for padding).
    """
    B, M = scores.shape
    K = min(budget, M)
    # stable tie-break towards the earlier (shallower) candidate
    tiebreak = torch.arange(M, device=scores.device, dtype=torch.float64) * 1e-9
    key = scores.double() - tiebreak
    keep = key.topk(K, dim=1).indices.sort(dim=1).values  # [B, K]
    kept_ok = torch.isfinite(scores.gather(1, keep))  # [B, K]
    # candidate index -> new node id (1 + slot), for remapping parents
    slot = torch.full((B, M), -1, dtype=torch.long, device=scores.device)
    slot.scatter_(1, keep, torch.arange(1, K + 1, device=scores.device).expand(B, K))
    old_parent = parents.gather(1, keep)  # [B, K]
    new_parent = torch.where(old_parent >= 0, slot.gather(1, old_parent.clamp(min=0)), 0)
    new_parent = torch.where(kept_ok & (new_parent >= 0), new_parent, -2)
    root = torch.full((B, 1), -1, dtype=torch.long, device=scores.device)
    return keep, torch.cat([root, new_parent], 1)


# ---- surgery ----------------------------------------------------------------------------------------
def compact_tree(tree: DraftTree, keep: Tensor) -> tuple[DraftTree, Tensor]:
    """Drops the nodes not in `keep` [B, N] bool, renumbering per row (kept nodes stay in order).

    Returns:
        (the tree, kept_ids [B, N'] the old id of each new node, -1 for padding).
    """
    B, N = tree.tokens.shape
    count = keep.sum(1)
    Np = int(count.max())
    order = torch.sort((~keep).long(), dim=1, stable=True).indices[:, :Np]  # kept ids first, in order
    slot_ok = torch.arange(Np, device=keep.device)[None] < count[:, None]
    kept_ids = torch.where(slot_ok, order, -1)
    new_of = torch.full((B, N), -1, dtype=torch.long, device=keep.device)
    new_of.scatter_(1, order, torch.where(slot_ok, torch.arange(Np, device=keep.device).expand(B, -1), -1))
    idx = kept_ids.clamp(min=0)
    old_par = tree.parents.gather(1, idx)
    parents = torch.where(old_par >= 0, new_of.gather(1, old_par.clamp(min=0)), old_par)
    parents = torch.where(slot_ok, parents, -2)
    parents[:, 0] = -1
    probs = None
    if tree.draft_probs is not None:
        probs = tree.draft_probs.gather(1, idx[:, :, None].expand(-1, -1, tree.draft_probs.shape[-1]))
        probs = probs * slot_ok[:, :, None]
    conf = tree.confidence.gather(1, idx) if tree.confidence is not None else None
    return DraftTree(tree.tokens.gather(1, idx), parents, probs, conf, tree.draft_vocab), kept_ids


def chain_prefix(tree: DraftTree, length: int) -> DraftTree:
    """A chain cut to its first `length` drafts (node ids unchanged)."""
    n = length + 1
    return DraftTree(tree.tokens[:, :n], tree.parents[:, :n],
                     None if tree.draft_probs is None else tree.draft_probs[:, :n],
                     None if tree.confidence is None else tree.confidence[:, :n], tree.draft_vocab)


def first_path(tree: DraftTree, depth: int) -> Tensor:
    """[B, N] bool: the nodes of each row's first-child path down to `depth` (root included)."""
    B, N = tree.tokens.shape
    on = torch.zeros(B, N, dtype=torch.bool, device=tree.parents.device)
    on[:, 0] = True
    cur = torch.zeros(B, dtype=torch.long, device=on.device)  # last node on the path
    level = torch.zeros(B, dtype=torch.long, device=on.device)
    for i in range(1, N):
        hit = (tree.parents[:, i] == cur) & (level < depth)
        on[:, i] = hit
        cur = torch.where(hit, i, cur)
        level = level + hit.long()
    return on
