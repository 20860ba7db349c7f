"""Fixtures for export tests: two tiny trained drafters (trained once per session) and a results.json.

- `eagle3_run`: EAGLE-3 on a tiny Llama with 8 layers (default aux layers {2, 4, 5}), 2 steps,
  tracked by W&B in offline mode inside the session's tmp folder (the W&B test reads that run).
- `eagle1_run`: EAGLE-1 on a tiny Gemma 3 (scaled embeddings), 2 steps, no tracking.
Real sizes for comparison: Gemma 3 270M is hidden 640 / 18 layers / vocab 262144.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from drafttrain.testing import tiny_target, tiny_tokenizer

FAST = ["dtype=float32", "train.mixed_precision=no", "data.heldout=4", "data.max_len=64", "train.warmup_steps=0",
        "train.log_every=1", "drafter.ttt_steps=2", "drafter.draft_vocab_size=120", "train.max_steps=2",
        "train.batch_size=4", "train.lr=1e-2", "train.save_every=0"]


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _chat_file(path: Path, n: int = 16) -> Path:
    recs = [{"conversations": [
        {"from": "human", "value": f"Question {i}: tell me about topic {i % 5}."},
        {"from": "gpt", "value": f"Topic {i % 5} is a fine topic; the answer is {i * 3}. Thanks!"},
    ]} for i in range(n)]
    path.write_text(json.dumps(recs))
    return path


def _train(root: Path, family: str, layers: int, method: str, *extra: str) -> Path:
    from drafttrain.config import parse_args
    from drafttrain.schema import TrainConfig
    from drafttrain.trainer import train

    tok = tiny_tokenizer(False)
    target = root / f"{family}-target"
    tiny_target(family, vocab_size=len(tok), num_layers=layers).save_pretrained(target)
    tok.save_pretrained(target)
    data = _chat_file(root / "chat.json")
    out = root / f"run-{method}"
    _reset_accelerate()
    train(parse_args([f"target={target}", f"data.path={data}", f"output_dir={out}", f"method={method}",
                      *FAST, *extra], TrainConfig))
    _reset_accelerate()
    return out


@pytest.fixture(scope="session")
def eagle3_run(tmp_path_factory) -> Path:
    """Run folder of a 2-step EAGLE-3 training with W&B offline; the drafter is <run>/drafter."""
    root = tmp_path_factory.mktemp("eagle3")
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR",
                                             "WANDB_CONFIG_DIR", "DRAFTTRAIN_CACHE", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_DATA_DIR=str(root / "wandb-data"),
                      WANDB_CACHE_DIR=str(root / "wandb-cache"), WANDB_CONFIG_DIR=str(root / "wandb-config"),
                      DRAFTTRAIN_CACHE=str(root / "cache"), WANDB_SILENT="true")
    try:
        return _train(root, "llama", 8, "eagle3", "tracking=wandb", "wandb.mode=offline", "wandb.project=export-test")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="session")
def eagle1_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eagle1")
    old = os.environ.get("DRAFTTRAIN_CACHE")
    os.environ["DRAFTTRAIN_CACHE"] = str(root / "cache")
    try:
        return _train(root, "gemma3", 6, "eagle1", "drafter.noise=0")
    finally:
        os.environ.pop("DRAFTTRAIN_CACHE") if old is None else os.environ.__setitem__("DRAFTTRAIN_CACHE", old)


def write_results(path: Path, proposer: str = "eagle3", tau: float = 2.71, speedup: float = 1.83) -> Path:
    """A `drafttrain eval` results.json (schema_version 1, eval/report.py) with one engine method."""
    path.write_text(json.dumps({
        "schema_version": 1,
        "machine": {"cpu": "test-cpu", "threads": 1, "torch": "2.x"},
        "config": {"max_new_tokens": 64, "batch_size": 1},
        "target": {"spec": "tiny", "dtype": "float32"},
        "benchmark": {"name": "mtbench", "num_prompts": 8},
        "runs": [{"temperature": 0.0, "batch_size": 1, "methods": {
            "target": {"kind": "engine", "tokens": 512, "speedup": {"vs_target": 1.0}},
            proposer: {"kind": "engine", "tau": tau, "speedup": {"vs_target": speedup}},
        }}],
    }))
    return path
