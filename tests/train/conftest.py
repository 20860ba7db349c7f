"""Fixtures for training tests: tiny target folders of three families and a small chat dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafttrain.testing import tiny_target, tiny_tokenizer


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    yield


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> folder with a saved tiny target and a byte-level tokenizer (vocab 263).

    Real sizes for comparison: Gemma 3 270M is hidden 640 / 18 layers / vocab 262144.
    """
    root = tmp_path_factory.mktemp("targets")
    tok = tiny_tokenizer(False)
    out = {}
    for fam in ("llama", "qwen3", "gemma3"):
        m = tiny_target(fam, vocab_size=len(tok), num_layers=6)
        m.save_pretrained(root / fam)
        tok.save_pretrained(root / fam)
        out[fam] = root / fam
    return out


def make_chat_file(path: Path, n: int = 24) -> Path:
    recs = [
        {"conversations": [
            {"from": "human", "value": f"Question {i}: tell me about topic {i % 5}."},
            {"from": "gpt", "value": f"Topic {i % 5} is a fine topic; the answer is {i * 3}. Thanks!"},
        ]}
        for i in range(n)
    ]
    path.write_text(json.dumps(recs))
    return path


@pytest.fixture
def chat_file(tmp_path) -> Path:
    return make_chat_file(tmp_path / "chat.json")
