"""Corpus lookup: draft what the target said before in the same context (training-free, CPU-cheap).

Prompt lookup (ngram.py) can only copy the row's own text, so it has nothing to offer where an
answer starts or wherever the answer says something the prompt does not. The target has habits
there ("from typing import List" before a Python function, "I'm not sure." in chat), and its own
answers to other prompts show them. This proposer indexes a corpus of such answers, typically the
target's greedy answers to training prompts:

    drafttrain regenerate target=gemma-3-270m temperature=0 max_new_tokens=64 out=corpus.jsonl
    drafttrain eval proposers=adaptive:hybrid:ngram+corpus:corpus.jsonl ...

Index: each conversation is tokenized exactly as in training (drafttrain.chat); every assistant
token is counted under each of the 1..max_order tokens before it (the template's
"...Assistant:" included, so the corpus knows how answers begin). A draft step takes the longest
context of the row's last tokens (at least `min_order`) seen in the corpus and proposes its most
frequent next token, then continues from the drafted token: a chain. Drafts are functions of
the prefix (draft_probs None), so verification keeps them exactly lossless at any temperature.

Confidence (for adaptive / hybrid scheduling): top count / (context count + 1) of the context
used; a context seen once gives 0.5, a habit seen 40 times in 40 gives ~0.98. The calibrator
(calibrator.py) turns it, with the node's depth, into an acceptance estimate.

Deliberately not here: suffix trees over the whole corpus (contexts longer than max_order),
learning from the answers decoded so far (the corpus is fixed for a run, so results do not depend
on request order), trees (every tree setting gets the chain of the tree's depth).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from torch import Tensor

from drafttrain.chat import tokenize_conversation
from drafttrain.decode.proposers.base import Proposer
from drafttrain.decode.tree import DraftTree, DynamicTree, StaticTree, pad_trees
from drafttrain.records import jsonl_lines, normalize_record

__all__ = ["CorpusProposer", "corpus_sequences"]


def corpus_sequences(path: str | Path, tokenizer, template: str = "auto") -> list[tuple[list[int], list[int]]]:
    """(token ids, assistant mask) of every conversation in a JSON / JSONL file of chat records
    (OpenAI `messages`, ShareGPT `conversations`; what `drafttrain regenerate` writes).

    Raises:
        ValueError: no such file, or no usable conversation in it (the message names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus file {path} does not exist; write one with "
                         "`drafttrain regenerate temperature=0 out=FILE.jsonl`")
    text = path.read_text(encoding="utf-8")
    try:
        records = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in jsonl_lines(text)
                                                                   if line.strip()]
    except json.JSONDecodeError as err:
        raise ValueError(f"corpus file {path}: not JSON / JSONL ({err})") from None
    out = []
    for record in records if isinstance(records, list) else [records]:
        messages, _ = normalize_record(record)
        if not messages or not any(m["role"] == "assistant" for m in messages):
            continue
        ids, mask = tokenize_conversation(tokenizer, messages, template)
        out.append((ids, mask))
    if not out:
        raise ValueError(f"corpus file {path} holds no conversation with an assistant turn")
    return out


class CorpusProposer(Proposer):
    """Drafts the corpus's most frequent continuation of the row's last tokens.

    Args:
        sequences: (token ids, mask) pairs; tokens where mask is 1 are indexed (the answers),
            every token may serve as context. Plain id lists index every token.
        max_order / min_order: longest / shortest context tried (longest first).
        gamma: default chain length (the caller's gamma wins).
    """

    name = "corpus"

    def __init__(self, sequences, *, max_order: int = 4, min_order: int = 1, gamma: int = 4):
        if not 1 <= min_order <= max_order:
            raise ValueError(f"need 1 <= min_order <= max_order, got {min_order}, {max_order}")
        self.max_order, self.min_order, self.default_gamma = max_order, min_order, gamma
        counts: dict[tuple[int, ...], Counter] = {}
        self.indexed = 0
        for seq in sequences:
            ids, mask = seq if isinstance(seq, tuple) else (seq, [1] * len(seq))
            ids = list(map(int, ids))
            for i in range(1, len(ids)):
                if not mask[i]:
                    continue
                self.indexed += 1
                for k in range(min_order, min(max_order, i) + 1):
                    counts.setdefault(tuple(ids[i - k : i]), Counter())[ids[i]] += 1
        # context -> (next token, confidence); only the top continuation is ever drafted
        self.table: dict[tuple[int, ...], tuple[int, float]] = {}
        for ctx, c in counts.items():
            tok, n = c.most_common(1)[0]
            self.table[ctx] = (tok, n / (sum(c.values()) + 1))

    @classmethod
    def from_file(cls, path: str | Path, tokenizer, *, template: str = "auto", **options) -> CorpusProposer:
        """A proposer over a JSON / JSONL chat file, tokenized with the target's tokenizer."""
        if tokenizer is None:
            raise ValueError("corpus:FILE needs the target's tokenizer to read the corpus")
        return cls(corpus_sequences(path, tokenizer, template), **options)

    def next_token(self, context: list[int]) -> tuple[int, float] | None:
        """(token, confidence) after `context` from its longest indexed suffix, or None."""
        for k in range(min(self.max_order, len(context)), self.min_order - 1, -1):
            hit = self.table.get(tuple(context[len(context) - k :]))
            if hit is not None:
                return hit
        return None

    def propose(self, state) -> DraftTree:
        spec = state.tree
        length = spec.depth if isinstance(spec, (StaticTree, DynamicTree)) else state.gamma or self.default_gamma
        rows = []
        for b, seq in enumerate(state.tokens):
            tokens, conf = [seq[-1]], [1.0]
            if bool(state.active[b]):
                ctx = list(seq[-self.max_order :])
                for _ in range(length):
                    hit = self.next_token(ctx)
                    if hit is None:
                        break
                    tokens.append(hit[0])
                    conf.append(hit[1])
                    ctx = ctx[1:] + [hit[0]] if len(ctx) == self.max_order else ctx + [hit[0]]
            rows.append((tokens, list(range(-1, len(tokens) - 1)), conf))
        return pad_trees(rows, state.root.device)

    def select_rows(self, idx: Tensor) -> bool:
        return True  # no per-row state: it reads state.tokens
