"""The vLLM environment's build: a pip failure is one clear line, and nothing half-built survives;
and `serve_vllm`'s side of the runner's contract (a refusal's one line, progress while it runs).

Fast (a few seconds, no network): pip is pointed at an empty local wheel folder with the index off,
so the first install (torch) fails at once, as it would without a registry. The serving tests put
a shell script where the finished environment's Python would be, answering as vllm_runner.py does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from drafttrain.engines.vllm import MARKER, EngineError, ensure_vllm_env, serve_vllm, vllm_env_dir


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


def _fake_engine_python(engines: Path, script: str) -> None:
    """A finished environment whose ``bin/python`` is a shell script: $1 runner, $2 request, $3 result."""
    final = vllm_env_dir()
    assert final.parent == engines
    (final / "bin").mkdir(parents=True)
    (final / MARKER).write_text("{}")
    python = final / "bin" / "python"
    python.write_text("#!/bin/sh\n" + script)
    python.chmod(0o755)


def test_a_refusal_quotes_the_root_cause_and_names_the_baseline(no_registry):
    """The runner's wrapper message is replaced by the first real exception of the engine's log, and
    an eval schedule's failing config is named."""
    _fake_engine_python(no_registry, 'echo "(EngineCore pid=7) ERROR 12-01 10:44:24 [core.py:9] ValueError: '
                        'Head size 16 is not supported by the CPU attention backend"\n'
                        'printf \'{"ok": false, "error": "Engine core initialization failed. See root cause above.",'
                        ' "config": "vllm_ngram"}\' > "$3"\nexit 1\n')
    with pytest.raises(EngineError) as err:
        serve_vllm({"model": "/m", "configs": [], "runs": []}, what="the target /m")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("vLLM 0.32.0 refused the target /m (baseline vllm_ngram): ValueError: Head size 16 is "
                          "not supported by the CPU attention backend (engine log: ")


def test_a_schedule_reports_progress_while_it_runs(no_registry):
    """One tick per timed call reaches on_progress while the engine still runs; the result comes back."""
    _fake_engine_python(no_registry, 'd=$(dirname "$2")\nprintf "1\\n1\\n1\\n" > "$d/progress"\nsleep 1.5\n'
                        'printf \'{"ok": true, "vllm_version": "0.32.0", "configs": {}}\' > "$3"\n')
    seen: list[int] = []
    res = serve_vllm({"model": "/m", "configs": [], "runs": []}, what="the target /m", on_progress=seen.append)
    assert res["ok"] and res["configs"] == {} and Path(res["engine_log"]).is_file()
    assert seen and seen[-1] == 3
