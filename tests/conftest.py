"""Shared pytest fixtures: tiny targets built in code, a scratch run folder, no network."""

from __future__ import annotations

import os

import pytest

# Tests never touch the network or a real tracker.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(params=["llama", "qwen3", "gemma3"])
def family(request) -> str:
    """Three target families: Llama, Qwen3 (q/k norms) and Gemma 3 (sliding window, scaled embeddings)."""
    return request.param


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models run 10-30x faster on one thread than with two threads fighting on a 2-core box."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _seeded_rng():
    """Every test starts from the same global RNG state, so a test that draws without its own
    generator gets the same numbers whether it runs alone, under `-k` or after the whole suite."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)
