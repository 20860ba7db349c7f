"""Where one decode step's time goes, against this machine's memory-bandwidth limit.

    python bench/decode_profile.py                          # gemma-3-270m, bf16, context 256, 2 threads
    python bench/decode_profile.py --context 512 --verify 5 --steps 30
    python bench/decode_profile.py --widths 1,4,6,8,12,16     # + whole steps per width and kernel

A single-stream decode step reads every weight once, so it cannot take less than
weight bytes / read bandwidth. This script measures both on the machine it runs on (bandwidth:
a bf16 sum over a 256 MiB tensor, the figure the issue quotes), then times drafttrain's own target
step, exactly as the engine calls it (`target_forward` over a `KVState`, the pending tokens rolled
back so the context stays fixed), and splits it:

- per module (forward hooks): embedding, each decoder layer, final norm, LM head;
- per op (torch.profiler, self CPU time, the top ops), so framework work (masks, cats, copies,
  Python) shows beside the matmuls;
- a "matmuls alone" replay: every weight matrix of the step multiplied back to back by a random
  input of the step's shape, no Python in between. step - replay is what the framework costs;
  replay - limit is what the kernels lose to the memory limit;
- the LM head alone (F.linear and the fused greedy argmax), which is most of the bytes here.

Shapes: root-only (1 token, what target-only decoding runs) and a chain of --verify tokens
(what verifying gamma drafts runs), each with the full logits head and the greedy argmax head.
Also the engine end to end: target-only `speculative_generate` tokens/s at the same context.

Deliberately not here: speeding anything up (this is the measuring stick), batch > 1 (the
eval's batch sweep), GPUs (CUDA timings need synchronisation this script does not do).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from drafttrain.config import LINEAR_BACKEND_HELP
from drafttrain.decode import speculative_generate
from drafttrain.decode.allocator import keep_freed_memory
from drafttrain.decode.kernels import cpu_layers, cpu_linear
from drafttrain.decode.kernels.greedy import greedy_lm_head_argmax
from drafttrain.decode.kv import KVState, target_forward
from drafttrain.targets import load_target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="gemma-3-270m", help="target spec (drafttrain.targets.load_target)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=256, help="tokens already in the KV cache at each timed step")
    p.add_argument("--verify", type=int, default=5, help="tokens fed by the chain-verify shape (gamma + 1)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per shape (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--top-ops", type=int, default=14, help="ops listed in the profiler table")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens of the end-to-end engine run")
    p.add_argument("--widths", default="",
                   help="also time whole steps feeding each of these token counts (e.g. 1,4,6,8,12,16) under "
                        "every linear kernel this CPU runs and PyTorch's matmul, interleaved, and print the table")
    p.add_argument("--linear-backend", default="auto", choices=cpu_linear.BACKENDS,
                   help="the target's linear layers (decode/kernels/cpu_linear.py): " + LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


def median_ms(fn, n: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def read_bandwidth_gbs(n: int = 10) -> float:
    """GB/s of the faster of an fp32 and a bf16 sum over 256 MiB (larger than any cache here).

    Both: on session 10's Xeon the bf16 sum is bound by its conversions (6.9 GB/s) where the fp32
    sum reads 13 GB/s, and a limit from the slower one would flatter every step.
    """
    best = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones((256 << 20) // torch.finfo(dtype).bits * 8, dtype=dtype)
        ms = median_ms(lambda x=x: x.sum(), n)
        best = max(best, x.numel() * x.element_size() / (ms * 1e-3) / 1e9)
        del x
    return best


def weight_bytes(model) -> int:
    """Bytes a step reads: every distinct parameter once (a tied LM head / embedding counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


class Step:
    """One target forward at a fixed context: n tokens fed as pending, then rolled back."""

    def __init__(self, model, kv: KVState, context: int, n: int, head: str):
        self.model, self.kv, self.head = model, kv, head
        self.ids = torch.randint(100, 1000, (1, n))
        self.pos = torch.arange(context, context + n)[None]
        self.parents = torch.arange(-1, n - 1)[None] + kv.pending_len * (torch.arange(n)[None] > 0)

    def __call__(self):
        out, _ = target_forward(self.model, self.kv, self.ids, self.pos, self.parents, head=self.head)
        self.kv.rollback()
        return out


def width_table(model, kv: KVState, context: int, widths: list[int], steps: int, backend: str) -> None:
    """Whole greedy steps (argmax head) per tokens fed, under each kernel and PyTorch's matmul.

    The variants run interleaved step by step (the kernel swapped in between), so a drift in the
    machine's speed hits them alike; medians. Leaves `backend`'s kernel installed as it was.
    """
    names = ["aten", *(k for k in cpu_linear.KERNELS if cpu_linear.available(k))]
    print(f"\nwhole steps (argmax head) at context {context}, interleaved, median of {steps} (ms):")
    print("| tokens fed | " + " | ".join(names) + " | fastest, x its step at the first width |")
    print("|---|" + "---|" * (len(names) + 1))
    one = None
    for n in widths:
        step = Step(model, kv, context, n, "argmax")
        times: dict[str, list[float]] = {k: [] for k in names}
        for rep in range(steps + 1):  # the first round warms up
            for k in names:
                cpu_linear.uninstall(model)
                if k != "aten":
                    cpu_linear.install(model, k)
                t = time.perf_counter()
                step()
                if rep:
                    times[k].append(1e3 * (time.perf_counter() - t))
        med = {k: statistics.median(v) for k, v in times.items()}
        best = min(med, key=med.get)
        one = one or med
        print(f"| {n} | " + " | ".join(f"{med[k]:.1f}" for k in names) + f" | {best} {med[best] / one[best]:.2f}x |",
              flush=True)
    cpu_linear.uninstall(model)
    if backend != "aten":
        cpu_linear.install(model, backend)


def module_split(model, step: Step, n: int) -> dict[str, float]:
    """ms per step by module, from forward pre/post hooks (CPU ops are synchronous)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    parts = [("embedding", body.embed_tokens), *[(f"layer {i}", m) for i, m in enumerate(body.layers)],
             ("final norm", body.norm), ("LM head", model.get_output_embeddings())]
    acc: dict[str, list[float]] = defaultdict(list)
    start: dict[str, float] = {}
    handles = []
    for name, mod in parts:
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: start.__setitem__(name, time.perf_counter())))
        handles.append(mod.register_forward_hook(
            lambda m, a, o, name=name: acc[name].append(time.perf_counter() - start[name])))
    try:
        for _ in range(2):
            step()
        acc.clear()
        for _ in range(n):
            step()
    finally:
        for h in handles:
            h.remove()
    return {name: 1e3 * statistics.median(v) for name, v in acc.items()}


def matmul_replay_ms(model, n_tokens: int, steps: int, with_head: bool) -> float:
    """Every weight matrix of one step, multiplied back to back by an input of the step's shape."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    dtype = next(model.parameters()).dtype
    mods = [m for m in body.layers.modules() if isinstance(m, torch.nn.Linear)]
    if with_head:
        mods.append(model.get_output_embeddings())
    inputs = [torch.randn(n_tokens, m.weight.shape[1], dtype=dtype) for m in mods]

    def run():  # each module's own forward: through the installed kernel where it routes
        for x, m in zip(inputs, mods):
            m(x)

    return median_ms(run, steps)


def op_table(step: Step, steps: int, top: int) -> tuple[list[tuple[str, float, float]], float]:
    """((op, calls per step, self CPU ms per step) of the top ops, all ops ms per step) under torch.profiler."""
    for _ in range(2):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = [(e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    return rows[:top], sum(r[2] for r in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"allocator keeps freed memory (decode/allocator.py, as the engine does): {keep_freed_memory()}")
    model, tok, _ = load_target(args.target, dtype=args.dtype)
    model.eval()
    print(cpu_linear.setup(model, args.linear_backend))
    torch.manual_seed(0)
    bw = read_bandwidth_gbs()
    wbytes = weight_bytes(model)
    limit = wbytes / (bw * 1e9) * 1e3
    head_w = model.get_output_embeddings().weight
    print(f"machine: {torch.get_num_threads()} torch threads, read bandwidth {bw:.1f} GB/s (fp32 / bf16 sum, 256 MiB)")
    print(f"target: {args.target} {args.dtype}, weights {wbytes / 1e6:.0f} MB (LM head {head_w.numel() * head_w.element_size() / 1e6:.0f} MB)"
          f" -> bandwidth limit {limit:.1f} ms per single-stream step ({1e3 / limit:.0f} tok/s)")

    with torch.inference_mode():
        kv = KVState.for_model(model, 1, torch.device("cpu"))
        ctx = torch.randint(100, 1000, (1, args.context))
        target_forward(model, kv, ctx, torch.arange(args.context)[None], torch.arange(-1, args.context - 1)[None],
                       head="none")
        kv.commit(torch.arange(args.context)[None])

        print(f"\nstep time at context {args.context}, median of {args.steps} (ms):")
        print("| shape | head | step | matmuls alone | framework (step - matmuls) | x limit |")
        print("|---|---|---|---|---|---|")
        shapes = {}
        for n in (1, args.verify):
            for head in ("logits", "argmax"):
                step = Step(model, kv, args.context, n, head)
                ms = median_ms(step, args.steps)
                rep = matmul_replay_ms(model, n, args.steps, with_head=True)
                shapes[(n, head)] = (step, ms)
                print(f"| {n} token{'s' if n > 1 else ''} | {head} | {ms:.1f} | {rep:.1f} | {ms - rep:.1f} | {ms / limit:.2f} |")
        fused = cpu_layers.fused(model)
        for n in (1, args.verify) if fused is not None else ():
            with cpu_layers.detached(model):  # the same kernels under transformers' own layer code
                ms = median_ms(Step(model, kv, args.context, n, "argmax"), args.steps)
            rep = matmul_replay_ms(model, n, args.steps, with_head=True)
            print(f"| {n} token{'s' if n > 1 else ''} | argmax, transformers' layers | {ms:.1f} | {rep:.1f} | "
                  f"{ms - rep:.1f} | {ms / limit:.2f} |")

        if args.widths:
            width_table(model, kv, args.context, [int(w) for w in args.widths.split(",")], args.steps,
                        cpu_linear.resolve_backend(args.linear_backend, model))
        h = torch.randn(1, head_w.shape[1], dtype=head_w.dtype)
        lin = median_ms(lambda: F.linear(h, head_w), args.steps)
        kernels = [k for k in cpu_linear.KERNELS if head_w.dtype == torch.bfloat16 and cpu_linear.available(k)]
        for rows in (1, args.verify) if kernels else ():
            hr = torch.randn(rows, head_w.shape[1], dtype=head_w.dtype)
            times = ", ".join(f"{k.upper()} kernel {median_ms(lambda hr=hr, k=k: cpu_linear.bf16_linear(hr, head_w, backend=k), args.steps):.1f} ms"
                              for k in kernels)
            print(f"LM head, {rows} row{'s' if rows > 1 else ''}: F.linear {median_ms(lambda hr=hr: F.linear(hr, head_w), args.steps):.1f} ms, {times}")
        arg = median_ms(lambda: greedy_lm_head_argmax(h, head_w), args.steps)
        head_limit = head_w.numel() * head_w.element_size() / (bw * 1e9) * 1e3
        print(f"\nLM head alone, 1 row: F.linear {lin:.1f} ms, fused greedy argmax {arg:.1f} ms, "
              f"its bandwidth limit {head_limit:.1f} ms ({head_w.numel() * head_w.element_size() / (lin * 1e-3) / 1e9:.1f} GB/s for F.linear)")

        step, ms = shapes[(1, "logits")]
        split = module_split(model, step, args.steps)
        layers = [v for k, v in split.items() if k.startswith("layer")]
        print(f"\nroot-only step by module (ms, hooks; step {ms:.1f}):")
        if layers:
            print(f"  embedding {split['embedding']:.2f} | {len(layers)} layers {sum(layers):.1f} "
                  f"(each {min(layers):.2f}-{max(layers):.2f}) | final norm {split['final norm']:.2f} | "
                  f"LM head {split['LM head']:.1f} | outside the model (mask, KV bookkeeping, Python) "
                  f"{ms - sum(split.values()):.1f}")
        else:  # fused layers: one C++ call each, no module hooks inside
            print(f"  embedding {split['embedding']:.2f} | fused layers + outside the model (mask, rotary tables, KV "
                  f"bookkeeping, Python) {ms - sum(split.values()):.1f} | final norm {split['final norm']:.2f} | "
                  f"LM head {split['LM head']:.1f}")

        top, total = op_table(step, args.steps, args.top_ops)
        print(f"\nroot-only step by op (torch.profiler, self CPU ms per step; all ops {total:.1f} ms):")
        print("| op | calls/step | ms/step | share |")
        print("|---|---|---|---|")
        for name, calls, t in top:
            print(f"| {name} | {calls:.0f} | {t:.2f} | {100 * t / total:.1f}% |")

        prompt = torch.randint(100, 1000, (1, args.context))
        t = time.perf_counter()
        out = speculative_generate(model, None, prompt, max_new_tokens=args.new_tokens, eos_token_id=[])
        wall = time.perf_counter() - t
        prefill = out.stats.time_prefill
        dec = wall - prefill
        print(f"\nengine, target only, greedy, batch 1: {args.new_tokens} tokens after a {args.context}-token prompt "
              f"in {wall:.2f} s (prefill {prefill:.2f} s): {args.new_tokens / dec:.1f} tok/s decoding, "
              f"{1e3 * dec / args.new_tokens:.1f} ms/token = {dec / args.new_tokens * 1e3 / limit:.2f}x the limit")
        t = time.perf_counter()
        out = speculative_generate(model, None, prompt, max_new_tokens=args.new_tokens, eos_token_id=[],
                                   temperature=1.0, seed=0)
        dec1 = time.perf_counter() - t - out.stats.time_prefill
        print(f"engine, target only, T=1 (keyed draws), batch 1: {args.new_tokens / dec1:.1f} tok/s decoding, "
              f"{1e3 * dec1 / args.new_tokens:.1f} ms/token")
        emit_draw_table(head_w.shape[0], args.steps)
    return 0


def emit_draw_table(vocab: int, steps: int) -> None:
    """What one sampled step's emitted-token draw costs per row: the keyed Exp(1) race (what the
    fused GPU kernel consumes) against the keyed inverse CDF the CPU path uses."""
    from drafttrain.decode.sampling import (
        STREAM_EMIT,
        counter_exponential,
        counter_uniform,
        exponential_race,
        inverse_cdf,
    )

    for rows in (1, 4, 16):
        w = torch.softmax(torch.randn(rows, vocab), -1)
        pos = torch.arange(rows) * 7 + 100
        race = median_ms(lambda w=w, pos=pos: exponential_race(w, counter_exponential(0, pos, vocab)), steps)
        inv = median_ms(lambda w=w, pos=pos: inverse_cdf(w, counter_uniform(0, pos, torch.zeros_like(pos), STREAM_EMIT)),
                        steps)
        print(f"emit draw, {rows} row{'s' if rows > 1 else ''} x {vocab} vocab: keyed Exp(1) race {race:.1f} ms, "
              f"keyed inverse CDF {inv:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
