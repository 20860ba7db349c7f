"""Fixtures for the scale-out and fault tests: a tiny target on disk and real subprocess launches.

Every run here is a real process (or several, joined by gloo) started the way a user starts
them: `python drafttrain/train.py ...` or `accelerate launch --config_file recipes/accelerate/...`.
Faults (slow steps, a planted NaN) come from `fault_driver.py`, a test-only wrapper around the CLI;
launch commands and other helpers live in `scale_helpers.py`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from scale_helpers import REPO, child_env

from drafttrain.testing import tiny_target, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama target (hidden 64, 6 layers, vocab 263; Gemma 3 270M: 640 / 18 / 262144)."""
    root = tmp_path_factory.mktemp("scale-target")
    tok = tiny_tokenizer(False)
    tiny_target("llama", vocab_size=len(tok), num_layers=6).save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="session")
def uniform_chat(tmp_path_factory) -> Path:
    """24 conversations of exactly the same token length and loss-mask count.

    Equal lengths make a mean over one batch of 4 equal the mean of two per-process means over
    batches of 2, so 1-process and 2-process runs can be compared weight for weight.
    """
    path = tmp_path_factory.mktemp("scale-data") / "chat.json"
    recs = [{"conversations": [
        {"from": "human", "value": f"Question {i:02d}: tell me about topic {i % 5}."},
        {"from": "gpt", "value": f"Topic {i % 5} is a fine topic; the answer is {i * 3:03d}. Thanks!"},
    ]} for i in range(24)]
    path.write_text(json.dumps(recs))
    return path


@pytest.fixture
def run(tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """run(cmd, timeout=...) -> CompletedProcess with text stdout / stderr, from the repository root."""

    def go(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True,
                              timeout=timeout)

    return go


@pytest.fixture
def start(tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    """start(cmd, name) -> Popen whose stdout / stderr go to tmp_path/<name>.out / .err; killed at teardown."""
    procs: list[subprocess.Popen] = []
    files = []

    def go(cmd: list[str], name: str) -> subprocess.Popen:
        files.extend([open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")])  # noqa: SIM115
        p = subprocess.Popen(cmd, cwd=REPO, env=child_env(tmp_path), stdout=files[-2], stderr=files[-1])
        procs.append(p)
        return p

    yield go
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for f in files:
        f.close()
