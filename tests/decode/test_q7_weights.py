"""7-bit drafter weights (decode/kernels/cpu_linear.py `quantize`, `cpu_linear_src.Q7_SOURCE`): the
kernel sums what the codes say, every path of a quantised drafter computes one function, the
target is never touched, and decoding with a quantised drafter stays lossless.

Runs for the kernels with the 7-bit path this CPU can run (AVX-512 bf16, AMX); the choice itself
(auto, bf16, int7 and the refusals) is checked on every CPU.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from test_cpu_linear import assert_same_up_to_near_ties, eagle3_folder  # tests/decode is on sys.path

from drafttrain.decode import costmodel as costmodel_module
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kernels import cpu_layers, cpu_linear
from drafttrain.decode.kv import KVState
from drafttrain.testing import tiny_target

Q7 = [b for b in cpu_linear.Q7_BACKENDS if cpu_linear.available(b)]
needs_q7 = pytest.mark.skipif(not Q7, reason="needs a CPU with AVX-512 bf16 (or AMX) and g++")


def _exact(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What the codes say, in float64: x @ ((u - 64) * s)^T."""
    return (x.double() @ (u.double() - 64).T) * s.double()


@needs_q7
@pytest.mark.parametrize("backend", Q7)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k, o", [(640, 1031), (43, 70), (96, 37)])  # aligned; K and O with tails
def test_the_7bit_kernel_sums_what_the_codes_say_and_rounds_once(backend, rows, k, o):
    gen = torch.Generator().manual_seed(rows * 100 + k)
    w = (torch.randn(o, k, generator=gen) * 0.05).bfloat16()
    u, s, deq = cpu_linear.q7_weights(w)
    x = (torch.randn(2, rows, k, generator=gen) * 3).bfloat16()[0]  # a [rows, K] view of a bigger tensor
    got = cpu_linear.KERNELS[backend].load().q7_linear_bf16(x, u, s)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, o)
    want = _exact(x, u, s)
    # one rounding to bf16 of a float32 sum: within half a bf16 step of the exact value, plus the
    # float32 error of a sum that carries 192 times the inputs before the offset comes off
    slack = (x.double().abs() @ (u.double() - 64).abs().T + 192 * x.double().abs().sum(1, keepdim=True)) * s.double()
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2 ** -8 + slack * 2 ** -20).all(), float(err.max())
    # the dequantized bf16 weight computes the same function (the fallback for more rows)
    assert torch.allclose(got.float(), (x.float() @ deq.float().T), rtol=2 ** -6, atol=float(slack.max()) * 2 ** -12)


def test_codes_are_seven_bits_per_row_scaled_and_round_to_the_nearest_level():
    w = torch.randn(5, 33).bfloat16()
    w[2] = 0  # an all-zero row keeps a finite scale
    u, s, deq = cpu_linear.q7_weights(w)
    assert u.dtype == torch.uint8 and int(u.min()) >= 1 and int(u.max()) <= 127
    q = u.long() - 64
    assert (q[[0, 1, 3, 4]].abs().amax(1) == 63).all() and torch.isfinite(s).all()
    assert (deq.float() - w.float()).abs().le(s[:, None] / 2 + w.float().abs() * 2 ** -8).all()
    assert (deq[2] == 0).all()


def test_draft_weights_resolve_per_kernel_and_refuse_what_cannot_run():
    assert cpu_linear._resolve_draft_weights("auto", "amx") == "int7"
    assert cpu_linear._resolve_draft_weights("auto", "avx512") == "int7"
    assert cpu_linear._resolve_draft_weights("auto", "avx2") == "bf16"
    assert cpu_linear._resolve_draft_weights("auto", "aten") == "bf16"
    assert cpu_linear._resolve_draft_weights("bf16", "amx") == "bf16"
    with pytest.raises(ValueError, match="draft_weights=int7 needs the AVX-512 bf16 or AMX kernel"):
        cpu_linear._resolve_draft_weights("int7", "aten")
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        cpu_linear._resolve_draft_weights("int4", "amx")
    target = tiny_target("llama", dtype=torch.float32, vocab_size=257)
    cpu_linear.setup(target, "auto", "auto")  # float32: PyTorch's matmul, drafters as trained
    assert cpu_linear.draft_weights_of(target) == "bf16"


def _loaded(tmp_path, backend: str, draft: str):
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=257)
    folder = eagle3_folder(tmp_path, target, random_norms=True)
    cpu_linear.setup(target, backend, draft)
    return target, load_proposer(str(folder), target)


@needs_q7
@pytest.mark.parametrize("backend", Q7)
def test_a_quantised_drafter_moves_every_own_linear_and_never_the_targets(tmp_path, backend):
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=257)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    folder = eagle3_folder(tmp_path, target, random_norms=True)
    cpu_linear.setup(target, backend, "int7")
    try:
        proposer = load_proposer(str(folder), target)
        drafter = proposer.drafter
        linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear) and m is not drafter.fc]
        assert len(linears) == 8 and all(hasattr(vars(m)["forward"], "u") for m in linears)  # 7 + the head
        # the fc over the target's features stays bf16 (7 bits there cost tau), routed as before
        assert cpu_linear.is_installed(drafter.fc) and not hasattr(vars(drafter.fc)["forward"], "u")
        assert not any(hasattr(vars(m).get("forward"), "u") for m in target.modules())
        layer = cpu_layers.fused(drafter)
        assert isinstance(layer, cpu_layers.FusedEagle3) and len(layer.q) == 8
        # the fused layer's stacked weights are the dequantized ones the modules hold
        assert torch.equal(layer.weights[1], drafter.midlayer.self_attn.o_proj.weight)
        for k, v in target.state_dict().items():
            assert torch.equal(v, before[k]), k
        assert "7-bit" in cpu_linear.setup(target, backend, "int7")
    finally:
        cpu_linear.uninstall(target)


@needs_q7
@pytest.mark.parametrize("backend", Q7)
def test_a_quantised_draft_step_fused_or_not_gives_the_same_logits(tmp_path, backend):
    """The fused layer over the 7-bit codes and the drafter's PyTorch forward over the dequantized
    weights (what a catch-up beyond the kernel's rows runs) agree within a few bf16 steps."""
    target, proposer = _loaded(tmp_path, backend, "int7")
    try:
        H = proposer.drafter.cfg.hidden_size

        def run(fused: bool):
            with cpu_layers.detached(proposer.drafter) if not fused else nullcontext(), torch.inference_mode():
                gen = torch.Generator().manual_seed(3)
                proposer.kv = KVState(1, torch.device("cpu"))
                ids = torch.randint(3, 257, (1, 5), generator=gen)
                feats = (torch.randn(1, 5, H, generator=gen) * 2).bfloat16()
                pos = torch.arange(5)[None]
                logits, hid = proposer._run(ids, feats, pos, torch.arange(-1, 4)[None])
                return logits, hid

        got, want = run(True), run(False)
        for g, w in zip(got, want):
            scale = float(w.float().abs().max())
            assert float((g.float() - w.float()).abs().max()) <= 4 * scale * 2 ** -8
    finally:
        cpu_linear.uninstall(target)


@needs_q7
@pytest.mark.parametrize("backend", Q7)
def test_decoding_with_a_quantised_drafter_stays_lossless(tmp_path, backend):
    target, proposer = _loaded(tmp_path, backend, "int7")
    try:
        ids = torch.randint(3, 257, (2, 7), generator=torch.Generator().manual_seed(1))
        alone = speculative_generate(target, None, ids, max_new_tokens=20, eos_token_id=-1)
        spec = speculative_generate(target, proposer, ids, max_new_tokens=20, eos_token_id=-1, gamma=3)
    finally:
        cpu_linear.uninstall(target)
    assert_same_up_to_near_ties(target, ids, spec.sequences, alone.sequences)


def test_a_7bit_drafter_gets_its_own_cost_model_cache_file():
    # a 7-bit drafter steps faster: costs measured with bf16 drafters must not price it
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=300)
    plain = costmodel_module._identity(target)
    assert plain["draft_weights"] == "bf16"
    seven = dict(plain, draft_weights="int7")
    assert costmodel_module._cache_file(seven, "c") != costmodel_module._cache_file(plain, "c")


def test_auto_moves_eagle_drafters_only_and_int7_moves_every_drafter():
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=257)
    eagle = type("EagleDrafter", (torch.nn.Module,), {})()
    draft_lm = type("LlamaForCausalLM", (torch.nn.Module,), {})()
    target.__dict__[cpu_linear._DRAFT_ATTR] = ("auto", "int7")
    assert cpu_linear.quantizes(target, eagle) and not cpu_linear.quantizes(target, draft_lm)
    target.__dict__[cpu_linear._DRAFT_ATTR] = ("int7", "int7")
    assert cpu_linear.quantizes(target, eagle) and cpu_linear.quantizes(target, draft_lm)
    target.__dict__[cpu_linear._DRAFT_ATTR] = ("auto", "bf16")  # avx2 / PyTorch's matmul
    assert not cpu_linear.quantizes(target, eagle)


@needs_q7
@pytest.mark.parametrize("backend", Q7)
def test_quantize_never_touches_a_module_the_drafter_shares_with_the_target(backend):
    # a drafter may hold the target's own head as a submodule (shared, not copied): quantising it
    # would change the target's weights and so what decoding emits
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=257)
    own = torch.nn.Linear(target.config.hidden_size, 64, bias=False).bfloat16()
    drafter = torch.nn.ModuleDict({"own": own, "head": target.lm_head})
    head_before = target.lm_head.weight.clone()
    cpu_linear.install(target, backend)
    try:
        cpu_linear.install(drafter, backend)  # the shared head is routed already: kept as it is
        assert cpu_linear.quantize(drafter, exclude=target) == 1
        assert hasattr(vars(own)["forward"], "u") and not hasattr(vars(target.lm_head)["forward"], "u")
        assert torch.equal(target.lm_head.weight, head_before)
    finally:
        cpu_linear.uninstall(target)
