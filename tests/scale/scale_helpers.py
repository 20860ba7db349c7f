"""Helpers for the scale-out and fault tests: launch commands, child environment, polling, weights.

Kept out of conftest.py so test modules import them by a unique name (`scale_helpers`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("fault_driver.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
FAST = ["dtype=float32", "train.mixed_precision=no", "data.heldout=4", "data.max_len=96", "train.warmup_steps=0",
        "train.log_every=1", "drafter.ttt_steps=3", "drafter.draft_vocab_size=120", "train.decode_eval_final=false",
        "train.lr=3e-3", "seed=3"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for --main_process_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(tmp: Path) -> dict[str, str]:
    """Environment for a child run: offline, no tracker, one thread, caches under `tmp`, no inherited launcher state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "DRAFTTRAIN_DEBUG"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               DRAFTTRAIN_CACHE=str(tmp / "cache"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MASTER_ADDR="127.0.0.1", TOKENIZERS_PARALLELISM="false")
    return env


def cli_cmd(command: str, args: list[str], faults: list[str] = ()) -> list[str]:
    """`drafttrain COMMAND ARGS` in a fresh interpreter, through fault_driver.py when faults are planted."""
    head = [sys.executable, str(DRIVER), *faults] if faults else [sys.executable, "-m", "drafttrain.cli"]
    return [*head, command, *args]


def train_cmd(args: list[str], *, config: str | None = None, nproc: int = 1) -> list[str]:
    """`python drafttrain/train.py ARGS`, or under `accelerate launch --config_file recipes/accelerate/CONFIG`."""
    if config is None:
        return [sys.executable, "drafttrain/train.py", *args]
    return [str(ACCELERATE), "launch", "--config_file", f"recipes/accelerate/{config}", "--num_processes",
            str(nproc), "--main_process_port", str(free_port()), "drafttrain/train.py", *args]


def wait_for(cond: Callable[[], bool], proc: subprocess.Popen, timeout: float = 120, what: str = "") -> None:
    """Poll until cond() holds; fail if the process exits first or time runs out."""
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def drafter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final drafter's tensors of a finished run."""
    return load_file(str(run_dir / "drafter" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    """Same keys and every tensor close; the failure names the tensor."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
