"""The bf16 linear kernels against PyTorch's matmul, on one decode step's weight shapes.

    python bench/linear_kernels.py                      # Gemma 3 270M shapes, rows 1 2 4 6 8 12 16
    python bench/linear_kernels.py --rows 1,6 --reps 15 --backends avx512
    python bench/linear_kernels.py --rows 1,2,4,8 --backends avx512,avx512-tiles   # session 38
    python bench/linear_kernels.py --rows 1,4,8,16,32 --backends avx512,avx512-packed   # session 39
    python bench/linear_kernels.py --rows 1,2,4,8 --backends avx2,avx2-packed           # session 40

For each row count (tokens fed to one decode step: 1 for target-only decoding, γ + 1 for a chain
verify) it times every layer matmul of the model's shapes back to back (random bf16 weights, 18
layers by default: 200 MB, larger than the caches, so each pass reads memory) and the LM head alone,
through each kernel this CPU runs and through `F.linear`. The variants are interleaved rep by rep,
so a change in the machine's speed (shared VMs drift by 2× within minutes) hits them all alike;
medians are printed, with the bandwidth limit the weights' bytes give at the measured read speed.

`avx512-tiles` / `amx-tiles` are those kernels with their one-weight-row stream switched off
(`set_stream_rows(0)`): 1-8 rows on the four- / two-weight-row tiles, as before session 38 (9-16
rows stay on the stream). Session 38's run on the AMD EPYC (`--rows 1,2,4,8,12,16 --reps 7
--backends avx512,avx512-tiles`) is in README's session-38 block. `<backend>-packed`: the
weights packed in 64-output panels (`cpu_linear.pack`, done in the untimed first rep), what
`install` routes bias-free layers through on the avx512 backend since session 39 and on avx2 since
session 40; plain `avx512` / `avx2` is the kernel those layers used before (and other shapes still use).

Deliberately not here: the framework around the matmuls (`bench/decode_profile.py` times whole
steps), correctness (tests/decode/test_cpu_linear.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import read_bandwidth_gbs  # noqa: E402

from drafttrain.decode.kernels import cpu_linear  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", default="1,2,4,6,8,12,16", help="comma-separated row counts")
    p.add_argument("--reps", type=int, default=9, help="interleaved repetitions per row count (median reported)")
    p.add_argument("--hidden", type=int, default=640, help="model width (Gemma 3 270M: 640)")
    p.add_argument("--intermediate", type=int, default=2048, help="MLP width")
    p.add_argument("--q-dim", type=int, default=1024, help="query projection width (heads x head dim)")
    p.add_argument("--kv-dim", type=int, default=256, help="key / value projection width")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--vocab", type=int, default=262144, help="LM head rows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backends", default="", help="kernels to time (default: every one this CPU runs)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = [b for b in args.backends.split(",") if b] or [k for k in cpu_linear.KERNELS if cpu_linear.available(k)]
    runnable = [k for k in cpu_linear.KERNELS if cpu_linear.available(k)]
    choices = (runnable + [f"{k}-tiles" for k in runnable if k in ("avx512", "amx")]
               + [f"{k}-packed" for k in runnable])
    for b in backends:
        if b not in choices:
            raise SystemExit(f"linear_kernels: backend {b!r} cannot run on this CPU; choose from {choices}")
        cpu_linear.KERNELS[b.removesuffix("-tiles").removesuffix("-packed")].load()
    h, shapes = args.hidden, [(args.q_dim, args.hidden), (args.kv_dim, args.hidden), (args.kv_dim, args.hidden),
                              (args.hidden, args.q_dim), (args.intermediate, args.hidden),
                              (args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    layers = [torch.randn(o, k, dtype=torch.bfloat16) for _ in range(args.layers) for o, k in shapes]
    head = torch.randn(args.vocab, h, dtype=torch.bfloat16)
    bw = read_bandwidth_gbs()
    lb = sum(w.numel() * 2 for w in layers)
    print(f"{torch.get_num_threads()} threads, read bandwidth {bw:.1f} GB/s: limit {lb / bw / 1e6:.1f} ms for the "
          f"{len(layers)} layer matmuls ({lb / 1e6:.0f} MB), {head.numel() * 2 / bw / 1e6:.1f} ms for the LM head")
    names = ["aten", *backends]
    print("| rows | " + " | ".join(f"{n} layers ms | {n} head ms" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, w.shape[1], dtype=torch.bfloat16) for w in layers]
        xh = torch.randn(m, h, dtype=torch.bfloat16)
        fns = {"aten": F.linear, **{b: _kernel_fn(b) for b in backends}}
        times = {n: ([], []) for n in names}
        for _ in range(args.reps + 1):  # the first rep warms up and is dropped
            for n in names:
                t = time.perf_counter()
                for x, w in zip(xs, layers):
                    fns[n](x, w)
                t1 = time.perf_counter()
                fns[n](xh, head)
                t2 = time.perf_counter()
                times[n][0].append(t1 - t)
                times[n][1].append(t2 - t1)
        cells = [f"{1e3 * statistics.median(a[1:]):.1f} | {1e3 * statistics.median(b[1:]):.1f}" for a, b in times.values()]
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
    return 0


def _kernel_fn(name: str):
    """x, w -> the kernel's product; `<backend>-tiles`: with the weight-row stream switched off;
    `<backend>-packed`: through w packed in panels (packed once per weight, on its first call)."""
    if name.endswith("-packed"):
        ext, packed = cpu_linear.KERNELS[name.removesuffix("-packed")].load(), {}

        def through_panels(x, w):
            if id(w) not in packed:
                packed[id(w)] = cpu_linear.pack(w)
            return ext.packed_linear_bf16(x, packed[id(w)])
        return through_panels
    if not name.endswith("-tiles"):
        return lambda x, w: cpu_linear.bf16_linear(x, w, backend=name)
    backend = name.removesuffix("-tiles")
    ext = cpu_linear.KERNELS[backend].load()

    def tiles(x, w):
        old = ext.set_stream_rows(0)
        try:
            return cpu_linear.bf16_linear(x, w, backend=backend)
        finally:
            ext.set_stream_rows(old)
    return tiles


if __name__ == "__main__":
    raise SystemExit(main())
