"""Fixtures for draft-LM tests: a tiny saved target (Llama, hidden 64, 4 layers, vocab 263 byte
tokenizer; real Gemma 3 270M: 640 / 18 / 262144), a small chat file, and two 2-step runs shared
by the tests (learning rate 0 and 1e-2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafttrain.testing import reset_accelerate, save_tiny_run_root

FAST = ["method=draft_lm", "dtype=float32", "train.mixed_precision=no", "data.heldout=4", "data.max_len=64",
        "train.warmup_steps=0", "train.log_every=1", "train.save_every=0", "train.decode_eval_final=false",
        "train.max_steps=2", "train.batch_size=4", "draft_lm.num_layers=2", "draft_lm.chunk_size=16"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    reset_accelerate()
    yield


@pytest.fixture(scope="session")
def dl_root(tmp_path_factory) -> Path:
    """A folder with `target/` (tiny Llama + tokenizer) and `chat.json` (24 conversations)."""
    return save_tiny_run_root(tmp_path_factory.mktemp("draft_lm"))


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
    """(lr 0 run, lr 1e-2 run), top-64 teacher, half the batches on-policy, a 48-token decode vocab."""
    extra = ("draft_lm.teacher_topk=64", "draft_lm.on_policy_rate=0.5", "draft_lm.on_policy_max_new_tokens=12",
             "draft_lm.decode_vocab=48")
    return _run(dl_root, "lr0", *extra, "train.lr=0"), _run(dl_root, "run", *extra, "train.lr=1e-2")
