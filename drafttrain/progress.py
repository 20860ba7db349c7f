"""Progress for phases that report none themselves: a bar that keeps moving while they run.

Some phases are one opaque call (a GGUF tokenizer parse, writing a large folder, a held-out pass
over a few batches) that can take tens of seconds and print nothing. ``heartbeat`` shows a
progress line with the phase's name and the seconds elapsed, redrawn every second by a daemon
thread, and a closing line with the time taken, so a user never stares at a still terminal.
Phases that have a natural count (records, batches, prompts) use tqdm with that count instead.

Deliberately not here: logging of metrics (tracking.py), rank-0 selection (the caller passes
``enabled``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["heartbeat", "keep_alive"]


@contextmanager
def keep_alive(bar, *, every: float = 1.0) -> Iterator[None]:
    """Redraws a tqdm ``bar`` every ``every`` seconds while the block runs, so its clock moves
    even while one item takes long (the first training step, an evaluation between steps).
    Into a file or pipe (a log) it redraws every 30 s at most: each redraw stays in the log.
    tqdm's own lock serialises these redraws with the main thread's updates."""
    if getattr(bar, "disable", True):
        yield
        return
    done = threading.Event()
    fp = getattr(bar, "fp", None)
    if not (fp is not None and hasattr(fp, "isatty") and fp.isatty()):
        every = max(every, 30.0)  # a log file keeps every redraw: one line per half minute, not per second

    def tick() -> None:
        while not done.wait(every):
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def heartbeat(desc: str, *, enabled: bool = True, every: float = 1.0) -> Iterator[None]:
    """Shows ``desc`` with a running clock until the block ends, then one line with the time.

    Args:
        desc: what the phase does, e.g. "reading the GGUF tokenizer".
        enabled: False (other ranks, tests) shows nothing.
        every: seconds between redraws.
    """
    if not enabled:
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=f"drafttrain: {desc}", bar_format="{desc} [{elapsed}]", file=sys.stderr,
               dynamic_ncols=True, leave=False)
    t0 = time.monotonic()
    try:
        with keep_alive(bar, every=every):
            yield
    finally:
        bar.close()
        print(f"drafttrain: {desc} took {time.monotonic() - t0:.0f} s", flush=True)
