"""Fused kernels for verification, each beside its plain-PyTorch reference, and the switch between them.

What it does: ``resolve_impl`` turns ``impl="auto" | "ref" | "triton"`` into a concrete choice
(Triton only for CUDA tensors when triton imports), and ``KERNELS`` lists every operation with its
two implementations. Triton is imported lazily inside the Triton functions, never at import time,
so the CPU path never loads it.

What it deliberately does not do: autotuning, backward passes (these kernels are inference-only),
or any non-CUDA accelerator.
"""

from __future__ import annotations

import importlib.util

from torch import Tensor

__all__ = ["IMPLS", "KERNELS", "resolve_impl", "triton_available"]

IMPLS = ("auto", "ref", "triton")


def triton_available() -> bool:
    """Whether triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: str, tensor: Tensor) -> str:
    """Picks "ref" or "triton".

    Args:
        impl: "auto" (Triton when ``tensor`` is on CUDA and triton is installed), "ref" or "triton".
        tensor: a representative input.

    Returns:
        "ref" or "triton".

    Raises:
        ValueError: on an unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if tensor.is_cuda and triton_available() else "ref"
    return impl


def _registry() -> dict[str, dict[str, object]]:
    from drafttrain.decode.kernels.greedy import greedy_lm_head_argmax_ref, greedy_lm_head_argmax_triton
    from drafttrain.decode.kernels.rejection import rejection_sample_ref, rejection_sample_triton

    return {
        "greedy_lm_head_argmax": {"ref": greedy_lm_head_argmax_ref, "triton": greedy_lm_head_argmax_triton},
        "rejection_sample": {"ref": rejection_sample_ref, "triton": rejection_sample_triton},
    }


def __getattr__(name: str):
    # KERNELS is built on first access: the submodules import this module for resolve_impl.
    if name == "KERNELS":
        return _registry()
    raise AttributeError(name)
