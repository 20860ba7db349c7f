"""The AVX2 bf16 linear kernel (decode/kernels/cpu_linear.py): exact sums, bf16 rounding, and
decoding through it stays lossless.

The kernel is compiled once per machine (~1 min, cached by torch's extension cache); every test
here needs an x86 CPU with AVX2 + FMA and g++, which every CI machine has.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafttrain.decode import speculative_generate
from drafttrain.decode.kernels import cpu_linear
from drafttrain.testing import OracleProposer, tiny_target

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="needs an x86 CPU with AVX2/FMA and g++")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
def test_kernel_sums_exactly_what_a_float64_matmul_sums(rows):
    # Integer-valued inputs: every product and partial sum is exact in fp32, so the kernel must
    # equal the float64 matmul bit for bit, whatever its summation order. Odd O (a lone last weight
    # row) and K = 8 * 5 + 3 (the scalar tail) cover the edges.
    g = torch.Generator().manual_seed(rows)
    w = torch.randint(-3, 4, (37, 43), generator=g).to(torch.bfloat16)
    x = torch.randint(-3, 4, (rows, 43), generator=g).float()
    y = cpu_linear.bf16_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (rows, 37)
    assert torch.equal(y.double(), x.double() @ w.double().T)


def test_kernel_rounds_once_to_bf16_and_adds_the_bias():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(300, generator=g).to(torch.bfloat16)
    y = cpu_linear.bf16_linear(x, w, bias)
    exact = (x.double() @ w.double().T + bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 300)
    # one rounding of a (nearly exact) fp32 sum: within half a bf16 ulp plus fp32 noise
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-3)
    assert ((y.double() - exact).abs() <= 0.5 * ulp + 1e-4).all()
    # and as close to PyTorch's own bf16 linear as two roundings allow
    assert ((y.float() - F.linear(x, w, bias).float()).abs() <= ulp.float() + 1e-3).all()


def test_install_routes_small_inputs_only_and_uninstall_restores_pytorch():
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=300)
    x_small = torch.randn(1, 5, 64).to(torch.bfloat16)
    x_one = torch.randn(1, 1, 64).to(torch.bfloat16)
    x_big = torch.randn(1, cpu_linear.MAX_ROWS + 1, 64).to(torch.bfloat16)
    head = target.lm_head
    with torch.inference_mode():
        before_small, before_one, before_big = head(x_small), head(x_one), head(x_big)
        n = cpu_linear.install(target)
        assert n == sum(isinstance(m, torch.nn.Linear) for m in target.modules())
        small, one, big = head(x_small), head(x_one), head(x_big)
        cpu_linear.uninstall(target)
        after = head(x_small)
    assert torch.equal(big, before_big)  # prefill-sized inputs keep PyTorch's matmul
    assert torch.equal(one, before_one)  # and one row its matrix-vector kernel
    assert torch.equal(small, cpu_linear.bf16_linear(x_small, head.weight))
    assert torch.equal(after, before_small)


def test_float32_models_are_never_touched():
    target = tiny_target("llama")
    assert cpu_linear.install(target) == 0
    assert cpu_linear.resolve_backend("auto", target) == "aten"


def test_backend_names_are_checked():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        cpu_linear.resolve_backend("fast", target)


@pytest.mark.parametrize("fam", ["llama", "gemma3"])
def test_decoding_through_the_kernel_gives_what_pytorchs_matmul_gives(fam):
    # bf16 target: two rows verifying chains of 5 feed 12 rows per step through the kernel,
    # target-only decoding 2. Each must decode exactly what it decodes with PyTorch's matmul.
    # (In bf16, speculative and target-only decoding may differ from each other at near-ties
    # whatever the matmul, since other ops round differently for other shapes; float32 models,
    # where greedy equality is exact, are never routed through the kernel.)
    target = tiny_target(fam, dtype=torch.bfloat16, vocab_size=1031)
    torch.manual_seed(3)
    ids = torch.randint(3, 1031, (2, 9))
    plain = speculative_generate(target, None, ids, max_new_tokens=24, eos_token_id=-1)
    prop = OracleProposer(list(ids), plain.sequences, gamma=5, wrong_at=3, vocab_size=1031)
    spec_aten = speculative_generate(target, prop, ids, max_new_tokens=24, eos_token_id=-1)
    assert cpu_linear.install(target) > 0
    try:
        spec = speculative_generate(target, prop, ids, max_new_tokens=24, eos_token_id=-1)
        alone = speculative_generate(target, None, ids, max_new_tokens=24, eos_token_id=-1)
    finally:
        cpu_linear.uninstall(target)
    assert spec.stats.as_dict()["tau"] > 1.5  # drafts were verified (and accepted) through the kernel
    assert spec.sequences == spec_aten.sequences
    assert alone.sequences == plain.sequences
