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
