"""The vLLM environment's build: a pip failure is one clear line, and nothing half-built survives.

Fast (a few seconds, no network): pip is pointed at an empty local wheel folder with the index off,
so the first install (torch) fails at once, as it would without a registry.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from drafttrain.engines.vllm import MARKER, EngineError, ensure_vllm_env, vllm_env_dir


@pytest.fixture
def no_registry(tmp_path, monkeypatch) -> Path:
    """An engines dir under tmp_path and a pip that can reach no package at all."""
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("DRAFTTRAIN_ENGINES_DIR", str(tmp_path / "engines"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore this machine's pip.conf (indexes, wheel dirs)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    return tmp_path / "engines"


def test_pip_failure_is_one_line_and_leaves_nothing(no_registry):
    final = vllm_env_dir()
    assert final.parent == no_registry
    # a killed earlier build: a temporary folder, and a final folder without the marker
    (no_registry / f".{final.name}.tmp-1-dead").mkdir(parents=True)
    (final / "bin").mkdir(parents=True)
    lines: list[str] = []
    with pytest.raises(EngineError) as err:
        ensure_vllm_env(log=lines.append)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("installing torch==2.13.0 for the vLLM engine failed: ERROR: ")
    assert "torch==2.13.0" in msg.split("failed: ", 1)[1]  # pip's own last error line names it
    assert "retry" in msg and "DRAFTTRAIN_SKIP_ENGINES=1" in msg
    assert any("[2/5] installing torch==2.13.0" in ln for ln in lines)  # progress was shown
    assert not final.exists()  # the unfinished folder is gone, never taken for a finished one
    assert [p.name for p in no_registry.iterdir() if ".tmp-" in p.name] == []
    assert (no_registry / f"{final.name}.install.log").is_file()


def test_a_marked_env_is_reused_without_pip(no_registry):
    final = vllm_env_dir()
    (final / "bin").mkdir(parents=True)
    (final / MARKER).write_text("{}")
    lines: list[str] = []
    assert ensure_vllm_env(log=lines.append) == final / "bin" / "python"
    assert lines == []
