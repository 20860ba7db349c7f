"""Keeps glibc's malloc from returning large freed blocks to the kernel between decode steps.

Why: a CPU decode step allocates a few large temporaries — the LM head's [rows, 262,144] fp32
output, a sampled step's logits, their float32 copy, the probabilities, the residual — 1-2 MB each
for Gemma 3. glibc serves blocks that size with `mmap` and unmaps them on free (or trims the heap
top back to the kernel), so the next step faults every page in again. Measured on the 2-core Zen 2
(session 24): sampled verification of a 2-token chain (`verify_tree`, 262k vocabulary) 4.4 ms ->
2.0 ms, `process_logits` on the same logits 1.6 -> 0.4 ms, with both settings below; either alone
gained little (4.5 / 5.9 ms).

What: `keep_freed_memory()` sets M_MMAP_THRESHOLD to 32 MiB (blocks below it come from the heap)
and M_TRIM_THRESHOLD to 1 GiB (freed heap stays mapped), once per process; the decoder calls it.
The price: the process keeps the memory of its largest step mapped instead of returning it (a few
tens of MB for a decode step). A no-op, returning False, off Linux / glibc or with
DRAFTTRAIN_KEEP_FREED_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_state: bool | None = None


def keep_freed_memory() -> bool:
    """Applies the settings (once per process); returns whether they are in effect."""
    global _state
    if _state is None:
        _state = False
        if sys.platform.startswith("linux") and os.environ.get("DRAFTTRAIN_KEEP_FREED_MEMORY", "1") != "0":
            try:
                mallopt = ctypes.CDLL("libc.so.6").mallopt
            except (OSError, AttributeError):  # not glibc (musl has no mallopt)
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _state = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _state
