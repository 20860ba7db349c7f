"""Weights packed for the AVX-512 packed kernel (`cpu_linear_packed_src`), and how much memory that takes.

`pack` lays a bf16 weight [O, K] out as panels of 64 outputs, [O / 64, K / 2, 64, 2]; `packable` says
which weights it takes; `packed_bytes` / `pack_budget` are what `cpu_linear.install` weighs before
packing a model (the packed copy sits beside the module's own weight, which prefill, training and
export keep reading).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

__all__ = ["pack", "pack_budget", "packable", "packed_bytes"]


def packable(w: Tensor) -> bool:
    """Whether `pack` takes `w`: a bf16 matrix [O, K] with O a multiple of 64 and K even."""
    return w.dtype == torch.bfloat16 and w.dim() == 2 and w.shape[0] > 0 and w.shape[0] % 64 == 0 and w.shape[1] % 2 == 0


def pack(w: Tensor) -> Tensor:
    """bf16 w [O, K] -> [O / 64, K / 2, 64, 2], the packed kernel's panels: for each panel of 64
    outputs and each pair of inputs, the 64 outputs' two weights side by side (a copy: the packed
    kernel reads only it, the module's own weight stays for everything else)."""
    out, k = w.shape
    with torch.no_grad():
        return w.detach().reshape(out // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of `model`'s packable bias-free bf16 linears take (`pack`)."""
    return sum(m.weight.numel() * 2 for m in model.modules()
               if isinstance(m, nn.Linear) and m.bias is None and packable(m.weight))


def pack_budget() -> int:
    """Bytes of packed weight copies `install` allows one model: a quarter of the machine's memory
    (beyond it, the row-streaming kernel, which reads the module's own weights: no second copy)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):  # no sysconf: do not pack
        return 0
