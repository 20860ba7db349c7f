"""Compiling drafttrain's C++ kernels safely: an OS lock around torch's extension build folder.

Why: torch marks an extension build in progress with a plain `lock` file in its build folder and
every later load waits while it exists; a build killed midway leaves it behind and every later
process hangs without a word. `build_lock` (used by `cpu_linear` and `cpu_verify`) holds an
`fcntl` lock the OS drops when its holder dies, so a `lock` file found under it is stale and goes.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

__all__ = ["build_lock"]


def _build_dir(name: str) -> Path | None:
    try:  # private, but the one place that knows torch's folder layout (TORCH_EXTENSIONS_DIR, pyXY_cpu)
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001 - a torch without it: no stale-lock cleanup, torch's own wait
        return None


@contextmanager
def build_lock(name: str):
    """Hold an OS lock beside torch's build folder of extension `name` while it is loaded or built.

    torch marks a build in progress with a plain file (`<build dir>/lock`) that every later load
    waits on while it exists; a build killed midway (Ctrl-C, a timeout) leaves it behind, and
    then every process that loads the kernel waits forever without a word. Every drafttrain
    process builds under this lock (an `fcntl` lock the OS drops when its holder dies), so a torch
    `lock` file found while holding it is stale: it is removed, with a line saying so.
    """
    folder = _build_dir(name)
    if folder is None or sys.platform == "win32":
        yield
        return
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{name}.drafttrain-lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"drafttrain: waiting for another process building the {name} kernel in {folder}", file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = [folder / f for f in ("lock", ".ninja_lock") if (folder / f).exists()]
            for f in stale:
                f.unlink(missing_ok=True)
            if stale:
                print(f"drafttrain: removed {stale[0]} left by a killed kernel build (it would have made this "
                      "load wait forever); building again", file=sys.stderr, flush=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
