"""Fixtures for Medusa tests: one tiny saved target (Llama, hidden 64, 4 layers, vocab 263 byte
tokenizer; real Gemma 3 270M: 640 / 18 / 262144), a small chat file, and trained runs shared by
the tests (Medusa-1 and Medusa-2, 2 steps each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafttrain.testing import reset_accelerate, save_tiny_run_root

FAST = ["dtype=float32", "train.mixed_precision=no", "data.heldout=4", "data.max_len=64", "train.warmup_steps=0",
        "train.log_every=1", "drafter.draft_vocab_size=120", "train.save_every=0", "train.decode_eval_final=false",
        "medusa.num_heads=3", "medusa.tree_budget=6", "medusa.tree_max_rank=3"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    reset_accelerate()
    yield


@pytest.fixture(scope="session")
def medusa_root(tmp_path_factory) -> Path:
    """A folder with `target/` (tiny Llama + tokenizer) and `chat.json` (24 conversations)."""
    return save_tiny_run_root(tmp_path_factory.mktemp("medusa"))


def medusa_cfg(root: Path, out: Path, *extra: str):
    from drafttrain.config import parse_args
    from drafttrain.schema import TrainConfig

    return parse_args([f"target={root / 'target'}", f"data.path={root / 'chat.json'}", f"output_dir={out}", *FAST,
                       *extra], TrainConfig)


@pytest.fixture
def make_cfg():
    """medusa_cfg, as a fixture (test modules do not import conftest)."""
    return medusa_cfg


def _run(root: Path, name: str, *extra: str) -> Path:
    from drafttrain.trainer import train

    reset_accelerate()
    train(medusa_cfg(root, root / name, *extra))
    reset_accelerate()
    return root / name


M1 = ("method=medusa1", "train.max_steps=2", "train.batch_size=4")
M2 = ("method=medusa2", "train.max_steps=2", "train.batch_size=4", "medusa.warmup_steps=1", "medusa.save_merged=true")


@pytest.fixture(scope="session")
def medusa1_runs(medusa_root) -> tuple[Path, Path]:
    """(lr 0 run, lr 1e-2 run) of Medusa-1."""
    return _run(medusa_root, "m1-lr0", *M1, "train.lr=0"), _run(medusa_root, "m1", *M1, "train.lr=1e-2")


@pytest.fixture(scope="session")
def medusa2_runs(medusa_root) -> tuple[Path, Path]:
    """(lr 0 run, lr 1e-2 run) of Medusa-2: step 1 heads warm-up, step 2 joint with the adapter."""
    return _run(medusa_root, "m2-lr0", *M2, "train.lr=0"), _run(medusa_root, "m2", *M2, "train.lr=1e-2")
