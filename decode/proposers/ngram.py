"""N-gram prompt lookup (training-free): propose what followed the last n tokens earlier on.

Match the last n tokens (n from `max_ngram` down to `min_ngram`) against prompt + generated
text; the most recent earlier occurrence wins and the gamma tokens that followed it become a
chain. With a tree setting (static or dynamic), up to `branches` distinct continuations from
different occurrences are merged into a trie instead. Drafts are deterministic: draft_probs None.

Confidence (for adaptive / hybrid scheduling): every draft node gets n / max_ngram, n = the
length of the matched suffix (a 3-token match is more trustworthy than a 1-token one); the
calibrator (calibrator.py) turns it, with the node's depth, into an acceptance estimate.

Deliberately not here: suffix automata / suffix trees over a corpus, frequency-weighted
continuations. A row without a match gets an empty tree (the target still emits one token).
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafttrain.decode.proposers.base import Proposer
from drafttrain.decode.tree import DraftTree, DynamicTree, StaticTree, pad_trees

__all__ = ["NGramProposer", "lookup_continuations", "lookup_match"]


def lookup_continuations(seq: Tensor, max_ngram: int, min_ngram: int, length: int, limit: int) -> list[list[int]]:
    """Continuations of the longest suffix n-gram that occurs earlier in `seq` (see `lookup_match`)."""
    return lookup_match(seq, max_ngram, min_ngram, length, limit)[1]


def lookup_match(seq: Tensor, max_ngram: int, min_ngram: int, length: int, limit: int) -> tuple[int, list[list[int]]]:
    """(n, continuations) of the longest suffix n-gram that occurs earlier in `seq` (n = 0: none).

    Args:
        seq: [T] token ids (prompt + generated, the root last).
        max_ngram / min_ngram: n-gram sizes tried, longest first.
        length: tokens to propose per continuation.
        limit: most distinct continuations to return (most recent occurrence first).

    Returns:
        (matched suffix length, up to `limit` non-empty continuations).
    """
    T = seq.shape[0]
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        suffix = seq[T - n :]
        windows = seq[: T - 1].unfold(0, n, 1)  # [T - n, n]: every earlier n-gram (not the suffix)
        starts = (windows == suffix).all(1).nonzero()[:, 0].flip(0)  # most recent first
        found: list[list[int]] = []
        for s in starts.tolist():
            cont = seq[s + n : s + n + length].tolist()
            if cont and cont not in found:
                found.append(cont)
                if len(found) == limit:
                    break
        if found:
            return n, found
    return 0, []


class NGramProposer(Proposer):
    """Prompt-lookup drafts.

    Args:
        max_ngram: longest suffix to match (default 3).
        min_ngram: shortest suffix to match (default 1).
        gamma: default drafts per step (the caller's gamma wins).
        branches: continuations merged into a trie when a tree is requested.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, *, min_ngram: int = 1, gamma: int = 4, branches: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.default_gamma, self.branches = max_ngram, min_ngram, gamma, branches

    def propose(self, state) -> DraftTree:
        spec = state.tree
        if isinstance(spec, StaticTree):
            length, limit = spec.depth, max(len(spec.levels()[0]), 1)
        elif isinstance(spec, DynamicTree):
            length, limit = spec.depth, spec.top_k
        else:
            length, limit = state.gamma or self.default_gamma, 1
        if spec is not None:
            limit = max(limit, self.branches) if isinstance(spec, DynamicTree) else limit
        rows = []
        for b, seq in enumerate(state.tokens):
            n, conts = 0, []
            if bool(state.active[b]):
                n, conts = lookup_match(torch.tensor(seq), self.max_ngram, self.min_ngram, length, limit)
            tokens, parents = _trie(seq[-1], conts)
            rows.append((tokens, parents, [1.0] + [n / self.max_ngram] * (len(tokens) - 1)))
        return pad_trees(rows, state.root.device)

    def select_rows(self, idx: Tensor) -> bool:
        return True  # no per-row state: it reads state.tokens


def _trie(root: int, continuations: list[list[int]]) -> tuple[list[int], list[int]]:
    """Merges continuations into a trie: (tokens, parents), node 0 = root."""
    tokens, parents = [root], [-1]
    child: dict[tuple[int, int], int] = {}
    for cont in continuations:
        node = 0
        for tok in cont:
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                child[(node, tok)] = nxt
            node = nxt
    return tokens, parents
