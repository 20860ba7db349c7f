"""Fused kernels for verification, each beside its plain-PyTorch reference, and the switch between them.

What it does: ``resolve_impl`` turns ``impl="auto" | "ref" | "triton"`` into a concrete choice
(Triton only for CUDA tensors when triton imports), and ``KERNELS`` lists every operation with its
two implementations. Triton is imported lazily inside the Triton functions, never at import time,
so the CPU path never loads it.

What it deliberately does not do: autotuning, backward passes (these kernels are inference-only),
or any non-CUDA accelerator.
"""

from __future__ import annotations

from drafttrain.decode.kernels.dispatch import IMPLS, resolve_impl, triton_available
from drafttrain.decode.kernels.greedy import greedy_lm_head_argmax_ref, greedy_lm_head_argmax_triton
from drafttrain.decode.kernels.rejection import rejection_sample_ref, rejection_sample_triton

__all__ = ["IMPLS", "KERNELS", "resolve_impl", "triton_available"]

#: operation -> {"ref": reference, "triton": fused kernel}
KERNELS: dict[str, dict[str, object]] = {
    "greedy_lm_head_argmax": {"ref": greedy_lm_head_argmax_ref, "triton": greedy_lm_head_argmax_triton},
    "rejection_sample": {"ref": rejection_sample_ref, "triton": rejection_sample_triton},
}
