"""bf16 linear layers for decode steps on CPUs where PyTorch's bf16 matmul is slow for few rows.

Why: a decode step multiplies a few rows (batch × tokens fed: 1 for target-only decoding, γ + 1
for verifying a chain) by every weight matrix, so it should run at the speed memory delivers the
weights. PyTorch's bf16 kernels fall short of that in two ways. On x86 CPUs with AVX2 but no
AVX-512 bf16 (AMD EPYC before Zen 4, many VMs) its bf16 matmul for more than one row is
compute-bound: session 8 measured the Gemma 3 LM head (262,144 × 640) at 19.8 ms for one row, 70 ms
for four, 88 ms for five and 282 ms for sixteen on such a 2-core VM (2 threads). On an Intel Xeon
with AVX-512 bf16 and AMX (session 10, 2 threads, 13 GB/s fp32 read bandwidth) it reads memory at
half speed for few rows, and each small matmul pays ~0.1 ms of fixed cost: the LM head takes 45-60
ms for one row where 26 ms is the bandwidth's limit, and the 126 matmuls of Gemma 3 270M's 18
layers (200 MB) 35 ms where the AVX-512 kernel here takes 19 ms (`bench/decode_profile.py`).

What: `bf16_linear(x, w, bias)` computes ``x @ w.T (+ bias)`` for bf16 ``w`` and a few rows of
``x``, reading each weight row once for all rows and summing in fp32. Three small C++ extensions
(sources in `cpu_linear_src`; `at::parallel_for` over weight rows, so `torch.set_num_threads`
holds), each compiled once per machine by `torch.utils.cpp_extension` into its cache
(`TORCH_EXTENSIONS_DIR`) as a kernels unit and a bindings unit (`build.load_kernels`; ~25 s):

- ``avx2``: bf16 → fp32 in registers (a 16-bit shift), fp32 FMAs; up to 6 rows in one tile, so
  each weight is widened once per step for verification widths up to 6 (session 20, Zen 2, Gemma 3
  270M whole verify steps at batch 1: 3 tokens 83.5 → 71.5 ms, 6 tokens 106.9 → 84.8). It serves
  every row count: more than 64 rows (prefill, big batches) in chunks of 64. Session 21 (same Zen 2,
  2 threads, `bench/linear_kernels.py --rows 1,2,16 --reps 5`, 18 layers of distinct weights, so
  memory is read): 1 row 16.7 + 23.4 ms (layers + LM head) vs PyTorch's 15.7 + 24.2 through the
  two-row tiles, then 13.2 + 16.9 (PyTorch 16.6 + 24.7) with a one-row path of four weight rows per
  tile and a prefetch 16 rows ahead, 2 rows 18.6 + 26.7 vs
  28.5 + 45.1, 16 rows 44.0 + 62.1 vs 211.8 + 356.8; a 16 × 30-token prefill took 7.1 s through
  PyTorch's bf16 matmul, which is compute-bound on AVX2 at every width. Session 24: up to 5 rows against one weight row at
  a time (`row_tile`: the row four ahead prefetched) keeps each thread's read one sequential
  stream: 1 row's LM head 15.9 → 12.6 ms (cold weights, interleaved); `bench/linear_kernels.py`
  layers + LM head, 2 rows 30.8 → 23.2 ms, 3: 30.6 → 22.7, 4: 30.4 → 24.4, 5: 31.5 → 28.5 (6 and
  more stay on weight pairs). On the AVX-512
  bf16 AMD EPYC of session 9 it was slower than PyTorch's native kernels (22.7 vs 22.2 ms for 1
  row, 24.9 vs 18.2 for 5), so `auto` uses it only on CPUs without AVX-512 bf16 / AMX. Since
  session 40 its bias-free layers with O a multiple of 64 read packed weights too, for 1-64 rows
  (`cpu_linear_packed_src.PACKED_AVX2_SOURCE`): each output summed over k in one order whatever the
  rows, which the row kernel above does not (1 row and 2-5 rows sum in different orders), so a
  verification gives each token a one-token step's bits here as well. Session 40, the Zen 4 with the
  AVX2 kernels forced (`bench/linear_kernels.py --rows 1,2,3,4,6,8,16 --reps 9 --backends
  avx2,avx2-packed`, layers + LM head, ms): 1 row 16.1 vs 25.4, 2: 33.1 vs 28.6, 4: 36.4 vs 36.2,
  8: 50.0 vs 55.9, 16: 83.2 vs 99.1; 2-6 rows of the LM head are what the packed kernel loses.
- ``avx512``: ``vdpbf16ps`` (pairs of bf16 products summed into fp32 lanes, 32 weights per
  instruction); `auto` picks it on CPUs with AVX-512 bf16. Since session 39 bias-free layers whose
  O is a multiple of 64 read a copy of their weight packed in panels of 64 outputs (`pack`,
  `cpu_linear_packed_src`: x broadcast a pair at a time, no horizontal sums, up to 6 rows of x per
  weight register), 1-64 rows; it keeps a second copy of those weights in memory (536 MB more for
  Gemma 3 270M). On session 39's Zen 4 (2 threads, `bench/linear_kernels.py --backends
  avx512,avx512-packed --rows 2,1,4,1,8 --reps 9`) layers + LM head took 5.6-6.1 + 7.5-8.8 ms for 1
  row against the row stream's 9.7-10.5 + 9.4-9.9, 5.5 + 7.6 for 4 rows (11.9 + 11.9), 9.9 + 14.0
  for 8 (19.5 + 20.8): 4 rows cost what 1 costs, at ~41 GB/s.
  Other shapes: ONE weight row at a time for 1-16 rows of x (`stream_row`, session 38: each thread
  reads one sequential stream, two sums per row of x in a fixed order, 9-16 rows as two groups
  against the same weight row); the session-14 tiles of four weight rows (Intel Xeon, with a
  software prefetch eight rows ahead) stay behind `set_stream_rows(0)`. Both fuse the greedy head
  (`head_argmax`: argmax ids of the bf16 logits without writing [rows, 262144] logits), and every
  path sums a row in an order that does not depend on how many rows share the call, so a
  verification gives each token the bits a one-token step gives it. The 7-bit drafter kernel
  (`q7_linear_bf16`) streams weight rows the same way. README's session 10-39 blocks give the
  history and figures of each version.
- ``amx``: AMX bf16 tiles (``tdpbf16ps``, 16 rows × 16 outputs × 32 weights per instruction) for
  2 … 16 rows where K and O are multiples of 32 (3 … 16 before session 27); 1 row and other shapes use the AVX-512 path
  above. Linux grants tile state per process (``arch_prctl``), asked for once. `auto` prefers it
  where granted: session 14 (same machine, 15.5 GB/s) measured the layers / LM head at 23.7 / 24.3
  ms for 8 rows and 24.9 / 30.5 for 16 (AVX-512 35.8 / 42.9 and 59.7 / 87.9; PyTorch 36.2 / 45.6).

`install(model, backend)` routes every bf16 `nn.Linear` of an inference model through a kernel for
inputs in its row range (larger inputs, prefill included, keep PyTorch's matmul), and every RMS
norm whose formula the norm kernel reproduces (one C++ call instead of ~8 ops and 3 casts; the 109
norms of a Gemma 3 270M step cost 2.7 ms through PyTorch on session 15's Zen 4); on the avx2
kernel it also attaches one-C++-call-per-layer decode steps to Gemma 3 models (`cpu_layers`; its q/k/v
and gate/up weights become views of stacked tensors). `uninstall(model)` undoes the routing. The decoder's callers (`drafttrain eval`, the bench scripts) install
it for bf16 targets on CPU as `linear_backend=auto` resolves, or when asked.

Numerics: fp32 accumulation of exact products (a bf16 × bf16 product is exact in fp32), in another
order than PyTorch's kernel, then one rounding to ``x``'s dtype, so outputs differ from PyTorch's
by bf16 rounding at most (``vdpbf16ps`` also treats bf16 subnormal inputs as zero); the tests check
exact sums and that decoding a bf16 target through each kernel gives what PyTorch's matmul gives.
Float32 models are never touched (greedy output in float32 equals the target's own exactly).

Deliberately not here: backward (inference only), more than 16 rows under avx512 / amx except the
packed weights' 17-64 (PyTorch's AMX / AVX-512 matmul, compute-bound there), GPUs.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafttrain.config import DRAFT_WEIGHTS, LINEAR_BACKENDS
from drafttrain.decode.kernels import cpu_layer_src as _layer_src
from drafttrain.decode.kernels import cpu_layers
from drafttrain.decode.kernels import cpu_linear_amx_src as _amx_src
from drafttrain.decode.kernels import cpu_linear_avx2_src as _avx2_src
from drafttrain.decode.kernels import cpu_linear_packed_src as _packed_src
from drafttrain.decode.kernels import cpu_linear_src as _src
from drafttrain.decode.kernels.build import build_lock, load_kernels
from drafttrain.decode.kernels.packing import pack, pack_budget, packable, packed_bytes

__all__ = ["KERNELS", "build_lock", "head_argmax", "routes", "BACKENDS", "available", "bf16_linear", "install", "installed_backend", "setup", "is_installed", "paused", "routed_norms",
           "uninstall", "resolve_backend", "DRAFT_WEIGHTS", "Q7_BACKENDS", "draft_weights_of", "KEEP_BF16", "quantize", "quantizes", "q7_weights", "wants_amx_linear", "wants_avx2_linear", "wants_avx512_linear", "PACKED_BACKENDS", "pack", "packable", "packed_bytes", "pack_budget"]

BACKENDS = LINEAR_BACKENDS
#: the kernels with the 7-bit weight path (`cpu_linear_src.Q7_SOURCE`)
Q7_BACKENDS = ("avx512", "amx")
#: rows of input the 7-bit kernel serves in one call (`kQ7Rows`); more take the dequantized bf16 weights
Q7_MAX_ROWS = 8
_DRAFT_ATTR = "_drafttrain_draft_weights"


class _Kernel:
    """One compiled kernel: its C++ (kernels; bindings: declarations, `m.def` lines), the CPU flags it needs and the rows it serves."""

    def __init__(self, name: str, kernels: str, bindings: tuple[str, str], flags: set[str], cflags: list[str],
                 rows: tuple[int, int], chunked: bool = False):
        self.name, self.kernels, self.bindings, self.flags, self.cflags = name, kernels, bindings, flags, cflags
        self.source = kernels + "".join(bindings)  # what the build depends on (the cost profile's key)
        self.min_rows, self.max_rows = rows
        self.chunked = chunked  # inputs of more than max_rows rows run in chunks of max_rows (prefill)
        self._ext = None

    def serves(self, rows: int) -> bool:
        """Whether an input of `rows` rows runs through this kernel once installed."""
        return self.min_rows <= rows and (self.chunked or rows <= self.max_rows)

    def load(self):
        with _lock:
            if self._ext is None:
                self._ext = load_kernels(f"drafttrain_bf16_linear_{self.name}", self.kernels, *self.bindings, self.cflags)
            return self._ext

    def _amx_fits(self, flat: Tensor, w: Tensor) -> bool:
        # 1 row: the AVX-512 tiles (layers ~0.7 ms faster per step). 2 rows moved to AMX in session 27
        # once its prefetch went to L2: 8.1 / 11.7 ms (layers / head) against the tiles' 8.5 / 13.6
        return (self.name == "amx" and 2 <= flat.shape[0] <= 16 and flat.shape[1] % 32 == 0
                and w.shape[0] % 32 == 0)

    def __call__(self, flat: Tensor, w: Tensor) -> Tensor:
        """[M, K] rows (any float dtype) @ bf16 w [O, K]^T -> fp32 [M, O]."""
        if self.name == "avx2":
            ext, x, w = self.load(), flat.float(), w.contiguous()
            if x.shape[0] <= self.max_rows:
                return ext.bf16_linear_f32(x.contiguous(), w)
            # each chunk's rows of x stay in L2 while the weights stream past them once
            return torch.cat([ext.bf16_linear_f32(c.contiguous(), w) for c in x.split(self.max_rows)])
        x = flat.to(torch.bfloat16).contiguous()
        if self._amx_fits(x, w):
            return self.load().amx_linear(x, w.contiguous())
        return self.load().bf16_linear_bf16x(x, w.contiguous())  # other shapes: the AVX-512 tiles

    def argmax(self, flat: Tensor, w: Tensor) -> Tensor:
        """argmax over the O outputs of bf16 ``flat`` [M, K] @ w^T, rounded to bf16, lowest index on ties -> [M] long."""
        if self.name == "avx2":
            return self.load().argmax_bf16_rounded(self(flat, w))
        if self._amx_fits(flat, w):
            return self.load().amx_linear_argmax(flat.contiguous(), w.contiguous())
        return self.load().bf16_linear_argmax(flat.contiguous(), w.contiguous())


_lock = threading.Lock()


#: backends whose bias-free linears run through a copy of their weight packed in 64-output panels
#: (`pack`, `cpu_linear_packed_src`) for decode steps; () before `install`: the row-streaming kernel
PACKED_BACKENDS: tuple[str, ...] = ("avx512", "avx2")
#: rows the packed kernel serves in `_Forward` (a fused decode step's most, `cpu_layers.MAX_ROWS`);
#: it beat PyTorch's matmul up to there on the Zen 4 (layers of 64 rows 35 vs 44 ms), not much beyond
PACKED_MAX_ROWS = cpu_layers.MAX_ROWS


#: the kernels by backend name; `min_rows` / `max_rows`: the inputs each serves in one call (beyond
#: `max_rows`, PyTorch's matmul, whose AMX / AVX-512 paths win on compute-bound work, except for
#: the chunked avx2 kernel: PyTorch's bf16 matmul on AVX2 is slower than it at every row count)
KERNELS = {
    "avx2": _Kernel("avx2", _src.NORM_SOURCE + _src.COMMON_SOURCE + _avx2_src.AVX2_SOURCE + _packed_src.PACKED_AVX2_SOURCE
                    + _avx2_src.AVX2_LAYER_LINEAR + _layer_src.LAYER_SOURCE,
                    (_avx2_src.AVX2_DECLS + _packed_src.PACKED_DECLS + _layer_src.LAYER_DECLS,
                     _avx2_src.AVX2_BINDINGS + _packed_src.PACKED_BINDINGS + _layer_src.LAYER_BINDINGS),
                    {"avx2", "fma"}, ["-mavx2", "-mfma"], (1, 64), chunked=True),
    # the AVX-512 extensions also hold the fused layers (cpu_layer_src), over their own `layer_linear`
    "avx512": _Kernel("avx512", _src.NORM_SOURCE + _src.COMMON_SOURCE + _src.AVX512_SOURCE + _src.Q7_SOURCE + _packed_src.PACKED_SOURCE
                      + _avx2_src.AVX2_HELPERS + _src.avx512_layer_linear(False) + _layer_src.LAYER_SOURCE,
                      (_src.AVX512_DECLS + _packed_src.PACKED_DECLS + _layer_src.LAYER_DECLS,
                       _src.AVX512_BINDINGS + _packed_src.PACKED_BINDINGS + _layer_src.LAYER_BINDINGS),
                      {"avx512f", "avx512bw", "avx512_bf16", "avx2", "fma"},
                      ["-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx2", "-mfma"], (1, 16)),
    "amx": _Kernel("amx", _src.NORM_SOURCE + _src.COMMON_SOURCE + _src.AVX512_SOURCE + _src.Q7_SOURCE + _packed_src.PACKED_SOURCE + _amx_src.AMX_SOURCE
                   + _avx2_src.AVX2_HELPERS + _src.avx512_layer_linear(True) + _layer_src.LAYER_SOURCE,
                   (_src.AVX512_DECLS + _packed_src.PACKED_DECLS + _amx_src.AMX_DECLS + _layer_src.LAYER_DECLS,
                    _src.AVX512_BINDINGS + _packed_src.PACKED_BINDINGS + _amx_src.AMX_BINDINGS + _layer_src.LAYER_BINDINGS),
                   {"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16", "avx2", "fma"},
                   ["-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mavx2", "-mfma"], (1, 16)),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def available(backend: str = "avx2") -> bool:
    """Whether this CPU can run `backend`'s kernel (its x86 flags; for AMX, Linux granting the
    process tile state) and a C++ compiler is found."""
    if not KERNELS[backend].flags <= _cpu_flags():
        return False
    if backend == "amx" and not _amx_permitted():
        return False
    from shutil import which

    return which(os.environ.get("CXX", "c++")) is not None or which("g++") is not None


def _amx_permitted() -> bool:
    """Asks Linux (x86-64 arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) for AMX tile state:
    granted once per process, refused by kernels before 5.16 or where a hypervisor hides it."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


def wants_amx_linear() -> bool:
    """`auto`'s first choice: the AMX kernel wherever the CPU and Linux allow AMX bf16 tiles."""
    return available("amx")


def wants_avx512_linear() -> bool:
    """`auto`'s choice where AMX is not: the AVX-512 bf16 kernel wherever the CPU has AVX-512 bf16."""
    return available("avx512")


def wants_avx2_linear() -> bool:
    """`auto`'s rule for the AVX2 kernel: where PyTorch's bf16 matmul is slow (AVX2, no AVX-512 bf16 / AMX)."""
    return available("avx2") and not ({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def resolve_backend(backend: str, model: nn.Module) -> str:
    """"aten", "avx2", "avx512" or "amx" for decoding with `model`.

    Raises:
        ValueError: an unknown backend, or a kernel the CPU or compiler cannot run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"linear_backend must be one of {BACKENDS}, got {backend!r}")
    param = next(model.parameters())
    if backend == "aten":
        return "aten"
    if backend in KERNELS:
        if not available(backend):
            need = "/".join(sorted(KERNELS[backend].flags))
            raise ValueError(f"linear_backend={backend} needs an x86 CPU with {need} and a C++ compiler "
                             "(g++); use linear_backend=aten or auto")
        return backend
    if not (param.device.type == "cpu" and param.dtype == torch.bfloat16):
        return "aten"
    if wants_amx_linear():
        return "amx"
    if wants_avx512_linear():
        return "avx512"
    return "avx2" if wants_avx2_linear() else "aten"


def bf16_linear(x: Tensor, w: Tensor, bias: Tensor | None = None, backend: str = "avx2") -> Tensor:
    """``F.linear(x, w, bias)`` for bf16 ``w`` [O, K] and a few rows of ``x`` [..., K] (the
    kernel's row range; more rows work, slowly).

    Returns a tensor of ``x``'s dtype and shape [..., O]. The first call compiles the extension
    (about a minute, once per machine).
    """
    lead = x.shape[:-1]
    y = KERNELS[backend](x.reshape(-1, x.shape[-1]), w)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, w.shape[0])


class _Forward:
    """The replacement `forward` of one nn.Linear: the kernel for small inputs, PyTorch's otherwise.

    bf16 inputs to a bias-free layer take one call into the kernel that returns bf16
    (`bf16_linear_bf16`: no PyTorch cast before or after it; 127 such calls per Gemma 3 270M step):
    the AVX-512 tiles (except where the AMX tiles serve the shape), or the AVX2 kernel, which widens
    and rounds inside, in chunks of its `max_rows`."""

    def __init__(self, module: nn.Linear, backend: str, pack: bool = True):
        self.module, self.backend = module, backend
        k = KERNELS[backend]
        self.kernel = k
        w = module.weight
        self.direct = None
        if module.bias is None and backend in ("avx512", "amx"):
            self.direct = k.load().bf16_linear_bf16
        elif module.bias is None and backend == "avx2":
            ext, chunk = k.load(), k.max_rows
            self.direct = lambda x, w: ext.bf16_linear_bf16(x, w, chunk)
        # AMX serves 2+ rows where K and O sit on its 32 grid; 1 row the AVX-512 tiles do
        self.direct_max = 1 if backend == "amx" and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0 else k.max_rows
        if backend == "avx2":
            self.direct_max = sys.maxsize  # chunked inside the call
        # the packed kernel (`pack`): bias-free layers whose O and K sit on its panels
        self.packs = pack and backend in PACKED_BACKENDS and module.bias is None and packable(w)
        self._packed, self._key = None, None

    def packed(self) -> Tensor:
        """The weight packed in panels (`pack`), packed again when the weight changed since (its
        version counter or its storage moved)."""
        w = self.module.weight
        key = (w.data_ptr(), w._version)
        if self._key != key:
            self._packed, self._key = pack(w), key
        return self._packed

    def serves(self, rows: int) -> bool:
        """Whether an input of `rows` rows runs through a kernel (the packed one: up to `PACKED_MAX_ROWS`)."""
        return self.kernel.serves(rows) or (self.packs and 0 < rows <= PACKED_MAX_ROWS)

    def __call__(self, x: Tensor) -> Tensor:
        mod = self.module
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if self.serves(rows) and not torch.is_grad_enabled() and x.device.type == "cpu":
            if self.packs and x.dtype == torch.bfloat16 and rows <= PACKED_MAX_ROWS:  # (avx2 serves prefill too)
                return self.kernel.load().packed_linear_bf16(x, self.packed())
            if self.direct is not None and rows <= self.direct_max and x.dtype == torch.bfloat16:
                return self.direct(x, mod.weight)
            return bf16_linear(x, mod.weight, mod.bias, self.backend)
        return F.linear(x, mod.weight, mod.bias)


def q7_weights(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row 7-bit codes of a weight [O, K]: (u uint8 [O, K] in [1, 127], fp32 scales [O], and the
    dequantized bf16 weight ``(u - 64) * s``). q = u - 64 = round(w / s) with s = max |w_row| / 63."""
    wf = w.detach().float()
    scale = wf.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 63.0
    q = torch.round(wf / scale[:, None]).clamp_(-63, 63)
    return (q + 64).to(torch.uint8).contiguous(), scale.contiguous(), (q * scale[:, None]).to(w.dtype)


class _Q7Forward(_Forward):
    """`_Forward` over 7-bit codes of the weight (`q7_weights`): the 7-bit kernel for inputs of up to
    `Q7_MAX_ROWS` rows, the dequantized bf16 weight (now the module's own) through `_Forward` beyond,
    so every path computes the same function up to bf16 rounding. Half the bytes per decode step: a
    drafter's small steps are bound by reading its weights (`bench/draft_step.py`)."""

    def __init__(self, module: nn.Linear, backend: str, pack: bool = True):
        super().__init__(module, backend, pack)
        with torch.no_grad():
            self.u, self.s, deq = q7_weights(module.weight)
            module.weight.copy_(deq)  # in place: a fused layer's stacked copy (a view's base) follows
        self.q7 = self.kernel.load().q7_linear_bf16

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if (0 < rows <= Q7_MAX_ROWS and x.dtype == torch.bfloat16 and not torch.is_grad_enabled()
                and x.device.type == "cpu"):
            return self.q7(x, self.u, self.s)
        return super().__call__(x)


def head_argmax(module: nn.Linear, x: Tensor) -> Tensor:
    """``module(x).argmax(-1)`` for an installed, bias-free bf16 head and bf16 ``x`` [M, K] in its row range,
    without the [M, O] logits where the kernel fuses it (AVX-512: each thread keeps its best per row).

    Same ids as the head's own bf16 logits give: the fp32 sums rounded to bf16, first maximum on ties.
    """
    if x.dtype != torch.bfloat16 or module.bias is not None or not routes(module, x.shape[0]):
        return module(x).argmax(-1)
    fwd = vars(module)["forward"]
    if fwd.packs and x.shape[0] <= PACKED_MAX_ROWS:
        return fwd.kernel.load().packed_linear_argmax(x.contiguous(), fwd.packed())
    return KERNELS[fwd.backend].argmax(x, module.weight)


def routes(module: nn.Module, rows: int) -> bool:
    """Whether an input of `rows` rows to `module` runs through a kernel (installed, in range)."""
    fwd = vars(module).get("forward")
    return isinstance(fwd, _Forward) and fwd.serves(rows)


def install(model: nn.Module, backend: str = "avx2") -> int:
    """Routes each bf16 nn.Linear of `model` through `backend`'s kernel for small inputs, and each RMS
    norm whose formula the norm kernel reproduces (`_norm_mode`) through it; returns how many linears.

    Compiles the extension now (not at the first step), so its one-time cost is paid up front.
    """
    KERNELS[backend].load()
    packing = backend in PACKED_BACKENDS and packed_bytes(model) <= pack_budget()
    n = 0
    for mod in model.modules():
        if "forward" in vars(mod):
            continue
        if isinstance(mod, nn.Linear) and mod.weight.dtype == torch.bfloat16:
            mod.forward = _Forward(mod, backend, packing)
            n += 1
        elif (mode := _norm_mode(mod, backend)) is not None:
            mod.forward = _Norm(mod, backend, mode)
    cpu_layers.install(model, backend, KERNELS[backend].load(), pack if packing else None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(fwd := vars(head).get("forward") if head is not None else None, _Forward) and fwd.packs:
        fwd.packed()  # the LM head now, not in the first step (other layers pack on first use)
    return n


#: linears `quantize` leaves in bf16: EAGLE's `fc`, which reads the target's features. In 7 bits it
#: cost `eagle_long` tau 3.00 -> 2.93 at T = 0 and 1.88 -> 1.65 at T = 1 (session 33, fake-quantised
#: weights, MT-bench 8 x 256, gamma 3; the layer and head in 7 bits: 3.00 / 1.88 against bf16's
#: 3.01 / 1.90). It is read once per step, not per draft.
KEEP_BF16 = ("fc",)


def quantize(model: nn.Module, exclude: nn.Module | None = None, keep: tuple[str, ...] = KEEP_BF16) -> int:
    """Moves each bias-free linear of `model` that `install` routed through an AVX-512 bf16 / AMX kernel
    to 7-bit weights (`_Q7Forward`: its weight becomes the dequantized one, for good), except those
    named in `keep` (the last part of the module's name) and those that are also modules of `exclude`
    (a head the drafter shares with the target: the target's weights are never touched).
    Re-attaches the fused EAGLE-3 layer so it reads the 7-bit codes too. Returns how many linears moved."""
    skip = {id(m) for m in exclude.modules()} if exclude is not None else set()
    skip |= {id(m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in keep}
    n, backend = 0, None
    for mod in model.modules():
        fwd = vars(mod).get("forward")
        if (type(fwd) is _Forward and fwd.backend in Q7_BACKENDS and mod.bias is None and id(mod) not in skip
                and mod.weight.dim() == 2):
            mod.forward = _Q7Forward(mod, fwd.backend, fwd.packs)
            n, backend = n + 1, fwd.backend
    if n and cpu_layers.fused(model) is not None:
        cpu_layers.install(model, backend, KERNELS[backend].load(), pack if backend in PACKED_BACKENDS else None)
    return n


def draft_weights_of(target: nn.Module) -> str:
    """The precision `setup` chose for drafters loaded beside `target`: "int7" or "bf16"."""
    return vars(target).get(_DRAFT_ATTR, ("bf16", "bf16"))[1]


def quantizes(target: nn.Module, drafter: nn.Module) -> bool:
    """Whether `setup`'s choice for `target` moves `drafter` (a loaded proposer's module) to 7-bit
    weights: always under draft_weights=int7; under auto only EAGLE drafters, whose acceptance was
    measured unchanged in 7 bits (session 33); draft LMs and Medusa heads are not measured yet."""
    asked, resolved = vars(target).get(_DRAFT_ATTR, ("bf16", "bf16"))
    return resolved == "int7" and (asked == "int7" or type(drafter).__name__ == "EagleDrafter")


def _resolve_draft_weights(draft: str, backend: str) -> str:
    if draft not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {draft!r}")
    if draft == "int7" and backend not in Q7_BACKENDS:
        raise ValueError(f"draft_weights=int7 needs the AVX-512 bf16 or AMX kernel (linear_backend={backend} "
                         "resolved here); use draft_weights=bf16 or auto")
    if draft == "auto":
        return "int7" if backend in Q7_BACKENDS else "bf16"
    return draft


class _Norm:
    """The replacement `forward` of one RMS norm: the norm kernel for decode-step inputs, the
    module's own forward otherwise. The fp32 scale is cast once and again only when the weight
    changes (its version counter moves: in-place ops and `load_state_dict` move it, writes through
    `.data` do not; install again after those)."""

    def __init__(self, module: nn.Module, backend: str, mode: str):
        self.module, self.mode, self.round_first = module, mode, mode == "round-first"
        self.kernel = KERNELS[backend]
        self.norm = self.kernel.load().rms_norm
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        self.eps = float(torch.finfo(torch.bfloat16).eps if eps is None else eps)  # None: nn.RMSNorm's default
        self._scale, self._version = None, None

    def scale(self) -> Tensor:
        w = self.module.weight
        if self._scale is None or self._version != w._version:
            with torch.inference_mode(False), torch.no_grad():
                s = w.detach().float()
                self._scale = (1.0 + s) if self.mode == "offset" else s.clone()
            self._version = w._version
        return self._scale

    def __call__(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        rows = x.numel() // d if d else 0
        if (self.kernel.serves(rows) and x.dtype == torch.bfloat16 and not torch.is_grad_enabled()
                and x.device.type == "cpu"):
            return self.norm(x.reshape(rows, d).contiguous(), self.scale(), self.eps, self.round_first).view(x.shape)
        return type(self.module).forward(self.module, x)


def _norm_mode(mod: nn.Module, backend: str) -> str | None:
    """"offset" (Gemma: x r (1 + w), rounded once), "round-first" (Llama, Qwen: bf16(x r) w) or None:
    which formula the module's own forward computes on a probe of bf16 rows, or None if it is no
    RMS norm the kernel reproduces (every element within a bf16 step, 99% exactly)."""
    w = getattr(mod, "weight", None)
    if (not type(mod).__name__.endswith("RMSNorm") or not isinstance(w, Tensor) or w.dim() != 1
            or w.dtype != torch.bfloat16 or w.device.type != "cpu" or getattr(mod, "bias", None) is not None):
        return None
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, w.shape[0], generator=gen) * 3).bfloat16()
    with torch.inference_mode():
        ref = type(mod).forward(mod, x).float()
        for mode in ("offset", "round-first"):
            got = _Norm(mod, backend, mode)(x).float()
            step = ref.abs().clamp_min(torch.finfo(torch.float32).tiny) * 2 ** -7
            if ((got - ref).abs() <= step).all() and (got == ref).float().mean() >= 0.99:
                return mode
    return None


def setup(model: nn.Module, backend: str = "auto", draft_weights: str = "bf16") -> str:
    """Resolves `backend` for `model` and installs its kernel; returns one line saying what runs.
    `draft_weights` ("auto", "bf16", "int7"; auto: int7 for EAGLE drafters on the AVX-512 bf16 / AMX
    kernels, `quantizes`) is recorded for the drafters loaded beside `model`
    (`decode.proposers._share_linear_kernel`).

    Raises:
        ValueError: as `resolve_backend`; int7 without an AVX-512 bf16 / AMX kernel; an unknown precision.
    """
    import time

    name = resolve_backend(backend, model)
    model.__dict__[_DRAFT_ATTR] = (draft_weights, _resolve_draft_weights(draft_weights, name))
    if name == "aten":
        return f"linear_backend={backend}: PyTorch's matmul for every linear layer of the target"
    t0 = time.perf_counter()
    n = install(model, name)
    k = KERNELS[name]
    what = (f"every input (prefill in chunks of {k.max_rows} rows)" if k.chunked
            else f"decode steps of {k.min_rows}-{k.max_rows} rows")
    line = (f"linear_backend={backend}: {n} bf16 linear layers and {routed_norms(model)} RMS norms of the target run "
            f"through the {name.upper()} kernels for {what} (ready in "
            f"{time.perf_counter() - t0:.1f} s; linear_backend=aten: PyTorch's)")
    if name in PACKED_BACKENDS and packed_bytes(model):
        mb = packed_bytes(model) / 1e6
        line += (f"; weights packed in 64-output panels for 1-{PACKED_MAX_ROWS} rows (+{mb:.0f} MB)"
                 if any(getattr(vars(m).get("forward"), "packs", False) for m in model.modules()) else
                 f"; weights not packed (+{mb:.0f} MB would pass a quarter of this machine's memory)")
    if draft_weights_of(model) == "int7":
        which = "EAGLE drafters'" if draft_weights == "auto" else "drafters'"
        line += f"; {which} linears in 7-bit weights (draft_weights=bf16: as trained)"
    return line


def installed_backend(model: nn.Module) -> str:
    """The kernel `install` routed `model`'s linear layers through ("avx2", "avx512"), or "aten"."""
    for mod in model.modules():
        fwd = vars(mod).get("forward")
        if isinstance(fwd, _Forward):
            return fwd.backend
    return "aten"


def is_installed(module: nn.Module) -> bool:
    """Whether `install` routed this module (a linear layer or an RMS norm) through a kernel."""
    return isinstance(vars(module).get("forward"), (_Forward, _Norm))


def routed_norms(model: nn.Module) -> int:
    """How many RMS norms of `model` `install` routed through the norm kernel."""
    return sum(isinstance(vars(m).get("forward"), _Norm) for m in model.modules())


@contextmanager
def paused(model: nn.Module):
    """PyTorch's forward on every module `install` changed, for the duration of the block."""
    saved = [(m, vars(m)["forward"]) for m in model.modules() if is_installed(m)]
    for m, _ in saved:
        del m.forward
    try:
        with cpu_layers.detached(model):
            yield
    finally:
        for m, fwd in saved:
            m.forward = fwd


def uninstall(model: nn.Module) -> None:
    """Restores PyTorch's forward on every module `install` changed."""
    cpu_layers.uninstall(model)
    for mod in model.modules():
        if is_installed(mod):
            del mod.forward
