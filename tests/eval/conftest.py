"""Fixtures for eval tests: one thread, tiny saved targets, a JSONL benchmark, isolated caches.

Tiny targets (hidden 64, 4 layers, vocab 263 byte-level tokenizer) stand in for Gemma 3 270M
(hidden 640, 18 layers, vocab 262144); nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from drafttrain.testing import tiny_target, tiny_tokenizer


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run much faster on one thread than on two contended ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bench_script():
    """Loads a script of bench/ (not a package) as a module: ``bench_script("pool_seeds")``."""
    root = Path(__file__).resolve().parents[2] / "bench"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, root / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """{"target": 4-layer Llama folder, "draft": 1-layer Llama folder}, same byte-level tokenizer."""
    root = tmp_path_factory.mktemp("models")
    tok = tiny_tokenizer(False)
    out = {}
    for name, layers, seed in (("target", 4, 0), ("draft", 1, 1)):
        m = tiny_target("llama", vocab_size=len(tok), num_layers=layers, seed=seed)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    """Four prompts: `prompt` and `messages` lines, two categories."""
    lines = [
        {"id": "a1", "category": "chat", "prompt": "Say hello hello hello to me."},
        {"id": "a2", "category": "code", "prompt": "def add(a, b):\n    return a + b\n"},
        {"category": "chat", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Count to five."}]},
        {"id": "a4", "category": "code", "prompt": "for i in range(3): print(i)"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path
