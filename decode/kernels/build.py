"""Compiling drafttrain's C++ kernels: two translation units each, under an OS lock.

Why two units: `torch/extension.h` (torch's whole C++ API, its Python bindings and pybind11) costs
~22 s of a 2-core CPU's compile whatever follows it; the kernels need only ATen's tensor, parallel
and a few op headers (~1.5 s) and the bindings only pybind11 with torch's tensor casters (~4 s).
So `load_kernels` writes each extension as a kernels unit (`KERNEL_PRELUDE` + the C++ kernels) and
a bindings unit (`BINDINGS_PRELUDE`, the bound functions' declarations, the PYBIND11 module) into
torch's build folder; torch's ninja build compiles the two at once and, in a later process,
recompiles only a unit whose text changed (an unchanged unit is not rewritten, so it keeps its
time stamp). Session 41, the 2-core Zen 4 VM, a whole process loading into an empty folder: the
AVX-512 extension 48.3 -> 21.0 s, AVX2 35.6 -> 12.7 s, `cpu_verify` 31.9 -> 9.5 s; an edited
kernels unit 21.0 s (AVX-512) and 13.8 s (AVX2) to rebuild. The mutation check's 21 C++ mutants
took 246 s against 554 s as one unit each (73 s of it building the unmutated kernels into an empty
folder; `python tests/mutation_check.py --no-baseline <the 21>`).

Why the lock: torch marks an extension build in progress with a plain `lock` file in its build
folder and every later load waits while it exists; a build killed midway leaves it behind and every
later process hangs without a word. `build_lock` holds an `fcntl` lock the OS drops when its holder
dies, so a `lock` file found under it is stale and goes.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

__all__ = ["BINDINGS_PRELUDE", "KERNEL_PRELUDE", "build_lock", "load_kernels"]

#: the kernels unit's headers: ATen's tensor, parallel_for and the few ops the kernels call, with
#: the `torch::` names they use (`torch/types.h` is not included here: it is what costs)
KERNEL_PRELUDE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <tuple>
namespace torch {
using namespace at;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}
"""

#: the bindings unit's headers: pybind11 with torch's tensor casters, the header `torch/python.h`
#: includes (~4 s; `torch/extension.h` ~22 s), or `torch/extension.h` where a torch lacks it
BINDINGS_PRELUDE = r"""
#if __has_include(<torch/csrc/utils/pybind.h>)
#include <torch/csrc/utils/pybind.h>
namespace torch { using namespace at; }
#else
#include <torch/extension.h>
#endif
#include <tuple>
#include <vector>
"""


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


def _write_if_changed(path: Path, text: str) -> None:
    # an unchanged unit keeps its time stamp, so ninja does not compile it again
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def load_kernels(name: str, kernels: str, declarations: str, definitions: str, cflags: list[str]):
    """Builds (or loads) extension `name` from two units and returns the module.

    Args:
        name: the extension's name (its folder under torch's extensions folder).
        kernels: the C++ kernels, compiled after `KERNEL_PRELUDE` (no torch / pybind11 headers).
        declarations: C++ prototypes of the bound functions (their definitions are in `kernels`).
        definitions: the body of the PYBIND11 module (`m.def(...)` lines).
        cflags: compiler flags beyond -O3 and OpenMP (the ISA's).
    """
    from torch.utils import cpp_extension

    flags = dict(extra_cflags=["-O3", *cflags, "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    bindings = (BINDINGS_PRELUDE + declarations + "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
                + definitions + "}\n")
    folder = _build_dir(name)
    with build_lock(name):
        if folder is None:  # a torch without the private folder helper: one unit, as load_inline builds it
            return cpp_extension.load_inline(name=name, cpp_sources=["#include <torch/extension.h>\n" + kernels
                                                                     + bindings], functions=None, **flags)
        folder.mkdir(parents=True, exist_ok=True)
        units = [folder / "kernels.cpp", folder / "bindings.cpp"]
        for path, text in zip(units, (KERNEL_PRELUDE + kernels, bindings)):
            _write_if_changed(path, text)
        return cpp_extension.load(name=name, sources=[str(u) for u in units], build_directory=str(folder), **flags)
