"""End-of-sequence ids: the one rule for when a row stops.

Rule (`eos_ids`):

1. An explicit id or list of ids wins, exactly as given: the caller said what stops a row. An
   empty list means "never stop early" (benchmarks and tests that need every row to run to
   ``max_new_tokens``).
2. Otherwise the UNION of every id the model and its tokenizer call end-of-sequence:
   ``generation_config.eos_token_id``, ``config.eos_token_id``, ``config.text_config.eos_token_id``
   (multimodal configs such as Gemma 3's keep the language model's ids there) and
   ``tokenizer.eos_token_id``.

Why the union: each source names a token after which the model has finished, and they disagree in
practice. Gemma 3's generation config lists ``<eos>`` and ``<end_of_turn>`` while its config names
``<eos>`` only; a folder without a generation config may know its end token only from the tokenizer;
a composite config keeps the ids under ``text_config``. Taking the first source
that has an id silently drops the others, and a row that misses its end runs on to
``max_new_tokens`` with text the model never meant to write: wrong outputs, wrong token counts,
wrong speedups. A stop id from any source is one the model really emits at its end, so counting it
costs nothing on answers that do not end there.

Ids come back sorted and without repeats, so equal inputs give equal lists (reports, cache keys).

Deliberately not here: the pad id, stop strings, per-request stop lists; this module imports
nothing of ours (a leaf).
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral
from typing import Any

__all__ = ["eos_ids"]


def _as_ids(value: Any) -> list[int]:
    """An eos_token_id field (None, an int, a list / tuple / set, a tensor) as a list of ints."""
    if value is None:
        return []
    if hasattr(value, "tolist"):  # a tensor or numpy value, 0-d or 1-d
        value = value.tolist()
    if isinstance(value, Integral):
        return [int(value)]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return [int(v) for v in value]
    raise TypeError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def eos_ids(model: Any = None, tokenizer: Any = None, *, explicit: Any = None) -> list[int]:
    """The ids that end a row: ``explicit`` when given, else the union of the model's and tokenizer's.

    Args:
        model: a causal LM (reads ``generation_config`` and ``config``, with ``config.text_config``)
            or None.
        tokenizer: its tokenizer (reads ``eos_token_id``) or None.
        explicit: an id or ids chosen by the caller; when not None they are the answer as given
            (``[]``: no id ends a row).

    Returns:
        Sorted, distinct ids; empty when no source names one.
    """
    if explicit is not None:
        return sorted(set(_as_ids(explicit)))
    config = getattr(model, "config", None)
    sources = (
        getattr(model, "generation_config", None),
        config,
        getattr(config, "text_config", None),
        tokenizer,
    )
    ids: set[int] = set()
    for src in sources:
        if src is not None:
            ids.update(_as_ids(getattr(src, "eos_token_id", None)))
    return sorted(ids)
