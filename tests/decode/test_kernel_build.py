"""How drafttrain's C++ extensions build (`decode/kernels/build.py`): two units, and an edit rebuilds its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from drafttrain.decode.kernels import build

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

KERNELS = "int64_t probe(int64_t n) {{ return n + {}; }}\n"
BINDINGS = ("int64_t probe(int64_t n);\n", '    m.def("probe", &probe, "n + a constant");\n')


def test_an_edited_kernel_is_rebuilt_alone_and_its_new_code_is_what_loads(tmp_path, monkeypatch):
    # The mutation check and every user who upgrades rely on this: an edited kernels unit is
    # compiled again (never a stale build loaded) and the bindings unit, unchanged, is not.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "drafttrain_build_probe"
    assert build.load_kernels(name, KERNELS.format(1), *BINDINGS, []).probe(41) == 42
    folder = tmp_path / name
    built = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.o")}
    assert set(built) == {"kernels.o", "bindings.o"}, "one object per unit"
    assert "torch/extension.h" not in (folder / "kernels.cpp").read_text(), "the kernels unit must stay light"

    # a later process (torch names a rebuild within one process `<name>_v1`, which recompiles both)
    code = (f"from drafttrain.decode.kernels import build\n"
            f"print(build.load_kernels({name!r}, {KERNELS.format(2)!r}, *{BINDINGS!r}, []).probe(41))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path)))
    assert out.returncode == 0 and out.stdout.split()[-1] == "43", out.stderr[-2000:]
    rebuilt = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.o")}
    assert rebuilt["kernels.o"] != built["kernels.o"], "the edited kernels unit was not compiled again"
    assert rebuilt["bindings.o"] == built["bindings.o"], "the unchanged bindings unit was compiled again"
