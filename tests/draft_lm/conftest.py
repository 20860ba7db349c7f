"""Fixtures for draft-LM tests: a tiny saved target (Llama, hidden 64, 4 layers, vocab 263 byte
tokenizer; real Gemma 3 270M: 640 / 18 / 262144), a small chat file, and two 2-step runs shared
by the tests (learning rate 0 and 1e-2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafttrain.testing import tiny_target, tiny_tokenizer

FAST = ["method=draft_lm", "dtype=float32", "train.mixed_precision=no", "data.heldout=4", "data.max_len=64",
        "train.warmup_steps=0", "train.log_every=1", "train.save_every=0", "train.decode_eval_final=false",
        "train.max_steps=2", "train.batch_size=4", "draft_lm.num_layers=2", "draft_lm.chunk_size=16"]


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    reset_accelerate()
    yield


@pytest.fixture(scope="session")
def dl_root(tmp_path_factory) -> Path:
    """A folder with `target/` (tiny Llama + tokenizer) and `chat.json` (24 conversations)."""
    root = tmp_path_factory.mktemp("draft_lm")
    tok = tiny_tokenizer(False)
    tiny_target("llama", vocab_size=len(tok), num_layers=4).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    recs = [{"conversations": [
        {"from": "human", "value": f"Question {i}: tell me about topic {i % 5}."},
        {"from": "gpt", "value": f"Topic {i % 5} is a fine topic; the answer is {i * 3}. Thanks!"},
    ]} for i in range(24)]
    (root / "chat.json").write_text(json.dumps(recs))
    return root


def dl_cfg(root: Path, out: Path, *extra: str):
    from drafttrain.config import parse_args
    from drafttrain.schema import TrainConfig

    return parse_args([f"target={root / 'target'}", f"data.path={root / 'chat.json'}", f"output_dir={out}", *FAST,
                       *extra], TrainConfig)


@pytest.fixture
def make_cfg():
    """dl_cfg as a fixture (test modules do not import conftest)."""
    return dl_cfg


def _run(root: Path, name: str, *extra: str) -> Path:
    from drafttrain.trainer import train

    reset_accelerate()
    train(dl_cfg(root, root / name, *extra))
    reset_accelerate()
    return root / name


@pytest.fixture(scope="session")
def dl_runs(dl_root) -> tuple[Path, Path]:
    """(lr 0 run, lr 1e-2 run), top-64 teacher, half the batches on-policy."""
    extra = ("draft_lm.teacher_topk=64", "draft_lm.on_policy_rate=0.5", "draft_lm.on_policy_max_new_tokens=12")
    return _run(dl_root, "lr0", *extra, "train.lr=0"), _run(dl_root, "run", *extra, "train.lr=1e-2")
