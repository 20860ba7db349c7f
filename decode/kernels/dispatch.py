"""The switch between a kernel's reference and its Triton version: ``resolve_impl``.

``impl="auto" | "ref" | "triton"`` becomes a concrete choice: Triton only for CUDA tensors when
triton is installed (checked without importing it). A leaf: the kernel modules import it, and the
package's ``KERNELS`` table imports them.
"""

from __future__ import annotations

import importlib.util

from torch import Tensor

__all__ = ["IMPLS", "resolve_impl", "triton_available"]

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
