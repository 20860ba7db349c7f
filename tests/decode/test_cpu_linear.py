"""The bf16 linear kernels (decode/kernels/cpu_linear.py, AVX2 and AVX-512 bf16): exact sums, bf16
rounding, row ranges, and decoding through them stays lossless.

Each kernel is compiled once per machine (~1 min, cached by torch's extension cache); a test runs
for every kernel this CPU can run (AVX2 + FMA and g++ on every CI machine; AVX-512 bf16 on most;
AMX on Intel Xeons from Sapphire Rapids on).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kernels import cpu_linear
from drafttrain.testing import OracleProposer, tiny_target
from eval.metrics import first_divergence
from eval.runner import near_tie_tolerance

pytestmark = pytest.mark.skipif(not cpu_linear.available("avx2"), reason="needs an x86 CPU with AVX2/FMA and g++")

RUNNABLE = [k for k in cpu_linear.KERNELS if cpu_linear.available(k)]
#: (backend, path): every kernel as installed, and the AVX-512 / AMX kernels with their one-weight-row
#: stream switched off (their four- / two-weight-row tiles for 1-8 rows, as `bench/linear_kernels.py`
#: times them against it)
PATHS = [(k, "default") for k in RUNNABLE] + [(k, "tiles") for k in RUNNABLE if k in ("avx512", "amx")]
#: the backends that pack weights in 64-output panels (`cpu_linear.pack`) where a shape allows
PACKING = [k for k in RUNNABLE if k in cpu_linear.PACKED_BACKENDS]


@contextmanager
def _path(backend: str, path: str):
    if path == "stream":  # installs made inside leave the weights unpacked (the row-streaming kernel)
        old = cpu_linear.PACKED_BACKENDS
        cpu_linear.PACKED_BACKENDS = ()
        try:
            yield
        finally:
            cpu_linear.PACKED_BACKENDS = old
        return
    if path != "tiles":
        yield
        return
    ext = cpu_linear.KERNELS[backend].load()
    old = ext.set_stream_rows(0)
    try:
        yield
    finally:
        ext.set_stream_rows(old)


@pytest.mark.parametrize("backend, path", PATHS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 70, 129])
@pytest.mark.parametrize("k", [43, 70])
def test_kernel_sums_exactly_what_a_float64_matmul_sums(backend, path, rows, k):
    # Integer-valued inputs: every product and partial sum is exact in fp32, so the kernel must
    # equal the float64 matmul bit for bit, whatever its summation order. O = 37 (not a multiple
    # of 2 or 4: lone last weight rows) and K = 43, 70 (the scalar / masked tails after 8- and
    # 32-wide chunks) cover the edges.
    g = torch.Generator().manual_seed(rows * k)
    w = torch.randint(-3, 4, (37, k), generator=g).to(torch.bfloat16)
    x = torch.randint(-3, 4, (rows, k), generator=g).float()
    with _path(backend, path):
        y = cpu_linear.bf16_linear(x, w, backend=backend)
    assert y.dtype == torch.float32 and y.shape == (rows, 37)
    assert torch.equal(y.double(), x.double() @ w.double().T)


@pytest.mark.skipif("avx512" not in RUNNABLE, reason="needs a CPU with AVX-512 bf16")
def test_avx512_gives_a_row_the_same_bits_however_many_rows_share_the_call():
    # A verification feeds 2-16 rows where a target-only step feeds 1: every row must be summed in
    # the same order either way, or bf16 near-ties flip and greedy speculative output stops being
    # the target's own token for token. Random inputs (inexact sums), rows 1-20 (two passes past 16).
    ext = cpu_linear.KERNELS["avx512"].load()
    g = torch.Generator().manual_seed(0)
    for k, o in [(640, 300), (2048, 70), (70, 33), (43, 9)]:
        w = torch.randn(o, k, generator=g).to(torch.bfloat16)
        x = torch.randn(20, k, generator=g).to(torch.bfloat16)
        alone = torch.cat([ext.bf16_linear_bf16x(x[i:i + 1].contiguous(), w) for i in range(20)])
        ids = torch.cat([ext.bf16_linear_argmax(x[i:i + 1].contiguous(), w) for i in range(20)])
        for rows in range(2, 21):
            assert torch.equal(ext.bf16_linear_bf16x(x[:rows].contiguous(), w), alone[:rows]), (k, o, rows)
            assert torch.equal(ext.bf16_linear_argmax(x[:rows].contiguous(), w), ids[:rows]), (k, o, rows)
        u, sc, _ = cpu_linear.q7_weights(w)  # the 7-bit drafter kernel (1-8 rows) too
        q7_alone = torch.cat([ext.q7_linear_bf16(x[i:i + 1].contiguous(), u, sc) for i in range(8)])
        for rows in range(2, 9):
            assert torch.equal(ext.q7_linear_bf16(x[:rows].contiguous(), u, sc), q7_alone[:rows]), (k, o, rows)


@pytest.mark.parametrize("backend", PACKING)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 40, 70])
@pytest.mark.parametrize("k", [2, 44, 70, 640])
def test_packed_kernel_sums_exactly_and_rounds_once(backend, rows, k):
    # Exact integer sums: the packed kernel's bf16 output is the float64 matmul rounded once, for
    # one group of rows (1-6), groups of 4 over chunks of 64 pairs (7-16; K = 640: 5 chunks) and
    # passes of 16 (17+); two panels of 64 outputs.
    g = torch.Generator().manual_seed(rows * k)
    w = torch.randint(-3, 4, (128, k), generator=g).to(torch.bfloat16)
    x = torch.randint(-3, 4, (rows, k), generator=g).to(torch.bfloat16)
    y = cpu_linear.KERNELS[backend].load().packed_linear_bf16(x, cpu_linear.pack(w))
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 128)
    assert torch.equal(y, (x.double() @ w.double().T).to(torch.bfloat16))


@pytest.mark.parametrize("backend", PACKING)
def test_packed_kernel_gives_a_row_the_same_bits_however_many_rows_share_the_call(backend):
    # As the row-streaming kernel below: random inputs (inexact sums), 1-20 rows, bits and argmax ids
    ext = cpu_linear.KERNELS[backend].load()
    g = torch.Generator().manual_seed(1)
    for k, o in [(640, 320), (2048, 64), (70, 128), (2, 4096 + 128)]:
        pk = cpu_linear.pack(torch.randn(o, k, generator=g).to(torch.bfloat16))
        x = torch.randn(20, k, generator=g).to(torch.bfloat16)
        alone = torch.cat([ext.packed_linear_bf16(x[i:i + 1], pk) for i in range(20)])
        ids = torch.cat([ext.packed_linear_argmax(x[i:i + 1].contiguous(), pk) for i in range(20)])
        assert torch.equal(ids, alone.float().argmax(-1))
        for rows in range(2, 21):
            assert torch.equal(ext.packed_linear_bf16(x[:rows], pk), alone[:rows]), (k, o, rows)
            assert torch.equal(ext.packed_linear_argmax(x[:rows].contiguous(), pk), ids[:rows]), (k, o, rows)


@pytest.mark.parametrize("backend", PACKING)
def test_install_packs_what_fits_its_panels_and_follows_changes_to_the_weight(backend):
    # A head of 320 outputs packs (5 panels); one of 300 does not (the row-streaming kernel). The
    # packed head serves decode steps up to PACKED_MAX_ROWS rows, PyTorch's matmul beyond (the chunked
    # AVX2 kernel on avx2); an in-place
    # change of the weight is what the next call computes with (packed again), and uninstall restores.
    ext = cpu_linear.KERNELS[backend].load()
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=320)
    head = target.lm_head
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, n, 64, generator=g).to(torch.bfloat16) for n in (1, 16, cpu_linear.PACKED_MAX_ROWS,
                                                                           cpu_linear.PACKED_MAX_ROWS + 1)]
    with torch.inference_mode():
        before = [head(x) for x in xs]
        cpu_linear.install(target, backend)
        got = [head(x) for x in xs]
        for x, y in zip(xs[:3], got[:3]):
            assert torch.equal(y, ext.packed_linear_bf16(x, cpu_linear.pack(head.weight)))
        if cpu_linear.KERNELS[backend].chunked:  # more rows: the AVX2 kernel in chunks (prefill), unpacked
            assert torch.equal(got[3], cpu_linear.bf16_linear(xs[3], head.weight, backend=backend))
        else:  # more rows: PyTorch's matmul
            assert torch.equal(got[3], before[3]) and not cpu_linear.routes(head, 1000)
        assert cpu_linear.routes(head, cpu_linear.PACKED_MAX_ROWS)
        ids = cpu_linear.head_argmax(head, xs[1][0])
        assert torch.equal(ids, got[1][0].float().argmax(-1))
        head.weight.mul_(-1)  # in place: the version counter moves
        assert torch.equal(head(xs[1]), -got[1])
        cpu_linear.uninstall(target)
        assert torch.equal(head(xs[1]), -before[1])
    odd = tiny_target("llama", dtype=torch.bfloat16, vocab_size=300)
    cpu_linear.install(odd, backend)
    try:
        x = torch.randn(1, 4, 64, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(odd.lm_head(x), cpu_linear.bf16_linear(x, odd.lm_head.weight, backend=backend))
    finally:
        cpu_linear.uninstall(odd)


@pytest.mark.parametrize("backend", PACKING)
def test_weights_are_packed_only_within_the_memory_budget_and_setup_says_which(backend, monkeypatch):
    # The packed copy sits beside the module's weight: a model whose copy would pass a quarter of
    # the machine's memory keeps the row-streaming kernel (no copy), and setup's line says so.
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=320)
    need = cpu_linear.packed_bytes(target)
    assert need == sum(m.weight.numel() * 2 for m in target.modules()
                       if isinstance(m, torch.nn.Linear) and m.weight.shape[0] % 64 == 0)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for budget, packed in ((need - 1, False), (need, True)):
        monkeypatch.setattr(cpu_linear, "pack_budget", lambda b=budget: b)
        line = cpu_linear.setup(target, backend)
        try:
            assert ("not packed" in line) != packed and ("64-output panels" in line) == packed
            # the packed kernel serves up to 64 rows (the chunked AVX2 kernel serves any, packed or not)
            assert cpu_linear.routes(target.lm_head, 40) == (packed or cpu_linear.KERNELS[backend].chunked)
            with torch.inference_mode():
                want = (cpu_linear.KERNELS[backend].load().packed_linear_bf16(x, cpu_linear.pack(target.lm_head.weight))
                        if packed else cpu_linear.bf16_linear(x, target.lm_head.weight, backend=backend))
                assert torch.equal(target.lm_head(x), want)
        finally:
            cpu_linear.uninstall(target)


@pytest.mark.parametrize("backend", RUNNABLE)
def test_kernel_rounds_once_to_bf16_and_adds_the_bias(backend):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(300, generator=g).to(torch.bfloat16)
    y = cpu_linear.bf16_linear(x, w, bias, backend=backend)
    exact = (x.double() @ w.double().T + bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 300)
    # one rounding of a (nearly exact) fp32 sum: within half a bf16 ulp plus fp32 noise
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-3)
    assert ((y.double() - exact).abs() <= 0.5 * ulp + 1e-4).all()
    # and as close to PyTorch's own bf16 linear as two roundings allow
    assert ((y.float() - F.linear(x, w, bias).float()).abs() <= ulp.float() + 1e-3).all()


@pytest.mark.parametrize("backend", RUNNABLE)
def test_install_routes_its_row_range_only_and_uninstall_restores_pytorch(backend):
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=300)
    kern = cpu_linear.KERNELS[backend]
    x_in = torch.randn(1, kern.max_rows, 64).to(torch.bfloat16)
    x_low = torch.randn(1, kern.min_rows - 1, 64).to(torch.bfloat16)  # no rows (every kernel serves 1)
    x_big = torch.randn(1, 2 * kern.max_rows + 3, 64).to(torch.bfloat16)  # avx2: three chunks
    head = target.lm_head
    with torch.inference_mode():
        before_in, before_low, before_big = head(x_in), head(x_low), head(x_big)
        n = cpu_linear.install(target, backend)
        assert n == sum(isinstance(m, torch.nn.Linear) for m in target.modules())
        assert cpu_linear.routes(head, kern.max_rows) and cpu_linear.routes(head, kern.max_rows + 1) == kern.chunked
        got_in, low, big = head(x_in), head(x_low), head(x_big)
        with cpu_linear.paused(target):
            paused = head(x_in)
        again = head(x_in)
        cpu_linear.uninstall(target)
        after = head(x_in)
    if kern.chunked:  # avx2: PyTorch's bf16 matmul is slower at every width, prefill runs in chunks
        assert torch.equal(big, cpu_linear.bf16_linear(x_big, head.weight, backend=backend))
    else:
        assert torch.equal(big, before_big)  # prefill-sized inputs keep PyTorch's matmul
    assert torch.equal(low, before_low)
    assert torch.equal(got_in, cpu_linear.bf16_linear(x_in, head.weight, backend=backend))
    for shape in ((1, 1, 64), (2, 3, 64), (7, 64)):  # the one-call bf16 path gives the cast path's bits
        x = torch.randn(*shape).to(torch.bfloat16)
        cpu_linear.install(head, backend)
        with torch.inference_mode():
            routed = head(x)
        cpu_linear.uninstall(head)
        assert routed.dtype == torch.bfloat16 and routed.shape == (*shape[:-1], 300)
        assert torch.equal(routed, cpu_linear.bf16_linear(x, head.weight, backend=backend))
    assert torch.equal(paused, before_in) and torch.equal(again, got_in)  # paused() restores the kernel
    assert torch.equal(after, before_in)
    assert not cpu_linear.routes(head, kern.max_rows)


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("fam, mode", [("gemma3", "offset"), ("llama", "round-first"), ("qwen3", "round-first")])
def test_every_rms_norm_is_routed_and_computes_its_modules_formula(fam, mode, backend):
    # Gemma scales by 1 + w in fp32 and rounds once; Llama / Qwen round to bf16, then scale by w.
    # Each norm must give its module's own output to within a bf16 step, nearly all bit for bit
    # (the sum of squares runs in another order), for decode rows; prefill rows keep the module's.
    target = tiny_target(fam, dtype=torch.bfloat16, vocab_size=300)
    norms = [m for m in target.modules() if type(m).__name__.endswith("RMSNorm")]
    torch.manual_seed(1)
    for m in norms:  # trained-looking weights, so w and 1 + w differ
        m.weight.data = (torch.randn_like(m.weight, dtype=torch.float32) * 0.5).bfloat16()
    kern = cpu_linear.KERNELS[backend]
    with torch.inference_mode():
        cpu_linear.install(target, backend)
        try:
            assert cpu_linear.routed_norms(target) == len(norms) > 0
            for m in norms:
                assert vars(m)["forward"].mode == mode
                d = m.weight.shape[0]
                for shape in [(1, 1, d), (2, kern.max_rows // 2, d), (1, 3, 2, d)]:
                    x = (torch.randn(shape) * 4).bfloat16()
                    ref, got = type(m).forward(m, x).float(), m(x).float()
                    assert got.shape == ref.shape
                    assert ((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-30).all()
                    assert (got == ref).float().mean() >= 0.97
                big = torch.randn(1, kern.max_rows + 1, d).bfloat16()
                if not kern.chunked:  # prefill rows keep the module's own forward
                    assert torch.equal(m(big), type(m).forward(m, big))
            m = norms[0]
            x = torch.randn(1, 1, m.weight.shape[0]).bfloat16()
            m.weight.add_(1.0)  # a weight changed in place after install: the cached scale follows it
            assert ((m(x).float() - type(m).forward(m, x).float()).abs() <= 0.02 * (1 + x.float().abs())).all()
        finally:
            cpu_linear.uninstall(target)
    assert cpu_linear.routed_norms(target) == 0


def test_float32_models_are_never_touched():
    target = tiny_target("llama")
    assert cpu_linear.install(target) == 0
    assert cpu_linear.resolve_backend("auto", target) == "aten"


def test_backend_names_are_checked():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        cpu_linear.resolve_backend("fast", target)


def test_auto_picks_amx_then_avx512_where_the_cpu_has_them():
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=300)
    want = next((k for k in ("amx", "avx512") if cpu_linear.available(k)), None)
    want = want or ("avx2" if cpu_linear.wants_avx2_linear() else "aten")
    assert cpu_linear.resolve_backend("auto", target) == want
    for k in ("amx", "avx512"):
        if not cpu_linear.available(k):
            with pytest.raises(ValueError, match=f"linear_backend={k} needs"):
                cpu_linear.resolve_backend(k, target)


def assert_same_up_to_near_ties(target, prompts, got: list[list[int]], ref: list[int]) -> None:
    """Every output equals the reference, or first differs where the target's top two are a near-tie."""
    for prompt, g, r in zip(prompts, got, ref):
        i = first_divergence(r, g)
        if i is None:
            continue
        ctx = torch.tensor([prompt.tolist() + r[:i]])
        with torch.inference_mode():
            logits = target(input_ids=ctx).logits[0, -1].float()  # a prefill: PyTorch's matmul
        gap = abs(float(logits[r[i]] - logits[g[i]]))
        tol = near_tie_tolerance(torch.bfloat16, float(logits.max()))
        assert gap <= tol, f"token {i}: {g[i]} instead of {r[i]}, logit gap {gap:.3f} > near-tie {tol:.3f}"


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("fam", ["llama", "gemma3"])
def test_decoding_through_the_kernel_gives_what_pytorchs_matmul_gives(fam, backend):
    # bf16 target: two rows verifying chains of 5 feed 12 rows per step (the AVX2 kernel's range),
    # target-only decoding 2 (both kernels'), one row alone 1 (the AVX-512 kernel's). Each must
    # decode what it decodes with PyTorch's matmul, up to bf16 near-ties: the kernels sum in
    # another order than PyTorch's, whose own order differs by CPU (oneDNN's AMX path on Intel
    # flips a near-tie of this tiny model that AMD's path does not), so a bit-exact comparison
    # would test the machine, not the kernel. A wrong sum flips tokens with wide margins. Each must decode exactly what it decodes with PyTorch's matmul.
    # (In bf16, speculative and target-only decoding may differ from each other at near-ties
    # whatever the matmul, since other ops round differently for other shapes; float32 models,
    # where greedy equality is exact, are never routed through the kernel.)
    target = tiny_target(fam, dtype=torch.bfloat16, vocab_size=1031)
    torch.manual_seed(3)
    ids = torch.randint(3, 1031, (2, 9))
    plain = speculative_generate(target, None, ids, max_new_tokens=24, eos_token_id=-1)
    prop = OracleProposer(list(ids), plain.sequences, gamma=5, wrong_at=3, vocab_size=1031)
    spec_aten = speculative_generate(target, prop, ids, max_new_tokens=24, eos_token_id=-1)
    single = speculative_generate(target, None, ids[:1], max_new_tokens=24, eos_token_id=-1)
    prop1 = OracleProposer(list(ids[:1]), single.sequences, gamma=2, wrong_at=2, vocab_size=1031)
    spec1_aten = speculative_generate(target, prop1, ids[:1], max_new_tokens=24, eos_token_id=-1)
    assert cpu_linear.install(target, backend) > 0
    try:
        alone = speculative_generate(target, None, ids, max_new_tokens=24, eos_token_id=-1)
        one = speculative_generate(target, None, ids[:1], max_new_tokens=24, eos_token_id=-1)
        # the oracles draft what the kernel's own target-only decode wrote: where a near-tie makes
        # it differ from PyTorch's (Zen 2, AVX2), drafts copied from PyTorch's text would be
        # rejected from there on and the tau checks below would test the tie, not the kernel
        prop = OracleProposer(list(ids), alone.sequences, gamma=5, wrong_at=3, vocab_size=1031)
        prop1 = OracleProposer(list(ids[:1]), one.sequences, gamma=2, wrong_at=2, vocab_size=1031)
        spec = speculative_generate(target, prop, ids, max_new_tokens=24, eos_token_id=-1)
        spec1 = speculative_generate(target, prop1, ids[:1], max_new_tokens=24, eos_token_id=-1)
    finally:
        cpu_linear.uninstall(target)
    assert spec.stats.as_dict()["tau"] > 1.5  # drafts were verified (and accepted) through the kernel
    # one row: target-only (1 row) and verification (3 rows) both run the kernel, but in tiles of
    # other widths, so the two can still part at a bf16 near-tie and the oracle's drafts miss after
    # it; any tau well above 1 means drafts were accepted through the kernel
    assert spec1.stats.as_dict()["tau"] > 1.15
    assert_same_up_to_near_ties(target, ids, spec.sequences, spec_aten.sequences)
    assert_same_up_to_near_ties(target, ids, alone.sequences, plain.sequences)
    assert_same_up_to_near_ties(target, ids[:1], one.sequences, single.sequences)
    assert_same_up_to_near_ties(target, ids[:1], spec1.sequences, spec1_aten.sequences)


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 16])
def test_kernel_sums_exactly_on_tile_shaped_matrices(backend, rows):
    # K and O multiples of 32: the AMX kernel's shapes (16 x 32 weight tiles, x packed in pairs,
    # two accumulator tiles per 32 weight rows); the other kernels take them like any shape.
    g = torch.Generator().manual_seed(rows)
    w = torch.randint(-3, 4, (160, 96), generator=g).to(torch.bfloat16)
    x = torch.randint(-3, 4, (rows, 96), generator=g).to(torch.bfloat16)
    y = cpu_linear.bf16_linear(x.float(), w, backend=backend)
    assert torch.equal(y.double(), x.double() @ w.double().T)


@pytest.mark.parametrize("backend, path", PATHS + [(k, "stream") for k in PACKING])
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 9, 12, 16])
@pytest.mark.parametrize("vocab", [9001, 8992, 8960])
def test_fused_head_argmax_gives_the_ids_of_the_heads_own_bf16_logits(backend, path, rows, vocab):
    # Greedy verification reads argmax ids straight from the kernel (no [rows, V] logits). They
    # must be the ids of the head's own bf16 logits, lowest id on ties: integer weights make many
    # exact ties, and wide random values tie after bf16 rounding. V spans several of the kernels'
    # 4,096-row blocks (8,992 = 281 x 32 fits the AMX tiles, 8,960 = 140 x 64 the packed panels,
    # 9,001 neither), the maximum sits in a later block for some rows and in several for others.
    g = torch.Generator().manual_seed(rows)
    head = torch.nn.Linear(64, vocab, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randint(-2, 3, (vocab, 64), generator=g).to(torch.bfloat16))
        head.weight[8500] = 3  # a strict winner in the last block for positive inputs
    x = torch.randint(-2, 3, (rows, 64), generator=g).to(torch.bfloat16)
    x[0] = 1
    wide = torch.randn(rows, 64, generator=g).mul(40).to(torch.bfloat16)
    try:
        with _path(backend, path):
            cpu_linear.install(head, backend)
        with torch.inference_mode(), _path(backend, path):
            got = {}
            for name, inp in (("ties", x), ("wide", wide)):
                got[name] = cpu_linear.head_argmax(head, inp)
                assert torch.equal(got[name], head(inp).argmax(-1))  # the routed bf16 logits, first maximum
    finally:
        cpu_linear.uninstall(head)
    assert got["ties"][0].item() == 8500  # row 0 (all ones): the strict winner, late in the last block
    with torch.inference_mode():  # exact integer sums: PyTorch's own bf16 head (uninstalled) picks the same ids
        assert torch.equal(got["ties"], head(x).argmax(-1))


@pytest.mark.skipif("avx2" not in RUNNABLE, reason="needs a CPU with AVX2 and FMA")
@pytest.mark.parametrize("rows", [1, 4])
def test_avx2_argmax_epilogue_picks_what_rounding_to_bf16_then_argmax_picks(rows):
    # The AVX2 head computes fp32 logits and takes the argmax of their bf16 rounding in one pass,
    # in blocks of 16,384 columns merged in order. Over 40,000 columns (three blocks): values that
    # differ in fp32 but tie once rounded (the first must win), the maximum in a later block,
    # the same maximum in two blocks (the earlier must win), and rounding to nearest even.
    g = torch.Generator().manual_seed(rows)
    y = torch.randn(rows, 40000, generator=g)
    y[0, 20000], y[0, 39999] = 7.0, 7.0  # tie across blocks 1 and 2: 20000
    y[0, 5] = 6.9  # below both
    if rows > 1:
        y[1, 30000], y[1, 30001] = 9.0, 9.0 + 2**-12  # equal in bf16: 30000, though 30001 is larger in fp32
        y[2, 39000] = 12.0  # strict winner late in the last block
        y[3] = float("-inf")  # all equal: index 0
        y[3, 17000] = 1.0 + 2**-8  # halfway between two bf16 values: rounds to even (1.0), ties with...
        y[3, 17001] = 1.0  # ...this one, and the first of them wins
    ext = cpu_linear.KERNELS["avx2"].load()
    assert torch.equal(ext.argmax_bf16_rounded(y), y.to(torch.bfloat16).argmax(-1))
    assert ext.argmax_bf16_rounded(y)[0].item() == 20000
    if rows > 1:
        assert ext.argmax_bf16_rounded(y)[1:].tolist() == [30000, 39000, 17000]


def eagle3_folder(tmp_path, target, *, random_norms: bool = False):
    """An EAGLE-3 drafter folder for `target` (seed 0), saved as `drafttrain train` saves one; with
    `random_norms` its norm weights are drawn around 1 (so a norm that ignored them would show)."""
    from drafttrain.drafter_io import save_drafter_folder
    from drafttrain.models.eagle import EagleDrafter, config_from_target
    from drafttrain.testing import TinyTokenizer

    class Tok(TinyTokenizer):
        def get_vocab(self):
            return {str(i): i for i in range(self.vocab_size)}

    torch.manual_seed(0)
    drafter = EagleDrafter(config_from_target(target.config, fused=True)).attach_target(target).eval()
    if random_norms:
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.5 * torch.randn_like(p))
    return save_drafter_folder(tmp_path / "d", drafter=drafter, target=target, tokenizer=Tok(),
                               method="eagle3", extra={}, card="test")


@pytest.mark.parametrize("backend", RUNNABLE)
def test_a_loaded_drafter_runs_through_the_targets_kernel(tmp_path, backend):
    # A draft step feeds as few rows as a target step: a drafter loaded from its folder for a
    # target whose layers run through a kernel gets the same kernel; for a target on PyTorch's
    # matmul it stays on PyTorch's. Decoding through it stays lossless.
    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=257)
    folder = eagle3_folder(tmp_path, target)
    plain = load_proposer(str(folder), target)
    assert not any(cpu_linear.is_installed(m) for m in plain.drafter.modules())
    ids = torch.randint(3, 257, (1, 7), generator=torch.Generator().manual_seed(1))
    cpu_linear.install(target, backend)
    try:
        proposer = load_proposer(str(folder), target)
        linears = [m for m in proposer.drafter.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(cpu_linear.is_installed(m) for m in linears)
        alone = speculative_generate(target, None, ids, max_new_tokens=16, eos_token_id=-1)
        spec = speculative_generate(target, proposer, ids, max_new_tokens=16, eos_token_id=-1, gamma=3)
    finally:
        cpu_linear.uninstall(target)
    assert_same_up_to_near_ties(target, ids, spec.sequences, alone.sequences)


def test_a_killed_builds_lock_file_is_removed_instead_of_hanging_every_later_load(tmp_path, monkeypatch, capsys):
    # torch waits forever on `<build dir>/lock` while it exists; a build killed midway leaves it.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "drafttrain_probe"
    folder.mkdir()
    (folder / "lock").touch()
    with cpu_linear.build_lock("drafttrain_probe"):
        assert not (folder / "lock").exists()
    assert "removed" in capsys.readouterr().err
    with cpu_linear.build_lock("drafttrain_probe"):  # nothing stale: nothing said
        pass
    assert capsys.readouterr().err == ""
