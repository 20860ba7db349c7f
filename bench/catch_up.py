"""What an EAGLE drafter's catch-up over many tokens costs: the path it takes now vs the others.

Why: before its first draft of a generation the drafter reads the whole prompt (and, in a hybrid,
every token the other part's drafts emitted since it last ran) with the target's features. Until
session 30 a catch-up of more than the fused layer's MAX_ROWS tokens went through the drafter's
PyTorch forward and computed the LM head (8,192 draft-vocabulary rows) at every position, though
only the last position's logits start the tree. Session 30 sent it through the fused layer in
64-row chunks with the last position's logits; this script, run in session 31 on the Xeon, found
the chunks slower than PyTorch's forward (85 tokens: 6.4 vs 5.0 ms at batch 1, 19.9 vs 10.1 ms at
batch 4), so now up to MAX_ROWS rows run fused in one call and more through PyTorch, with the last
position's logits either way.

What: loads the target and the drafter as `drafttrain eval` does (the target's linear kernel, the
drafter fused through it), then times `EagleProposer._run` over a catch-up of N tokens per row at
each batch size, three ways: today's path with the last position's logits, PyTorch's forward with
the last position's logits, and the path before session 30 (the same routing, every position's
logits). Median of `--repeats` calls after one warm-up call.

    python bench/catch_up.py runs/eagle/drafter --tokens 16,85,256 --batch-sizes 1,4

Session 37 (EPYC, `eagle_long`'s drafter): a catch-up only needs the last position's output, the
earlier positions' keys and values being all that later steps read, so PyTorch's path now skips
their query, attention, o_proj and MLP, and catch-ups of more than 4 rows take it (`--tokens
1,4,8,9,16,32,64 --batch-sizes 1,4` before, `--tokens 2,3,4,6,8,12,16` and `9,32,64,128` after):
batch 1 x 16 tokens 1.88 -> 1.23 ms, x 64 5.94 -> 2.33; batch 4 x 3 1.70 -> 1.48, x 16 4.08 ->
2.17, x 64 13.62 -> 3.98.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch

from drafttrain.config import LINEAR_BACKEND_HELP, LINEAR_BACKENDS
from drafttrain.decode import load_proposer
from drafttrain.decode.kernels import cpu_layers, cpu_linear
from drafttrain.decode.kv import KVState
from drafttrain.targets import load_target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("drafter", help="an EAGLE-3 drafter folder")
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--tokens", default="16,85,256", help="catch-up lengths per row, comma-separated")
    p.add_argument("--batch-sizes", default="1,4", help="rows, comma-separated")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="the target's linear layers (decode/kernels/cpu_linear.py): " + LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


def _time(prop, B: int, n: int, repeats: int, *, fused: bool, last: bool) -> float:
    """Median ms of one catch-up of n tokens per row at batch B (a fresh KV each call)."""
    H, V = prop.drafter.cfg.hidden_size, prop.drafter.cfg.vocab_size
    dtype = next(prop.drafter.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, n), generator=g)
    feats = torch.randn(B, n, H, generator=g).to(dtype)
    pos = torch.arange(n).expand(B, n)
    parents = torch.arange(-1, n - 1).expand(B, n)
    times = []
    ctx = nullcontext() if fused else cpu_layers.detached(prop.drafter)
    with ctx, torch.inference_mode():
        for r in range(repeats + 1):
            prop.kv = KVState(B, torch.device("cpu"))
            t0 = time.perf_counter()
            prop._run(ids, feats, pos, parents, last=last)
            if r:
                times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok, _ = load_target(args.target, dtype="bfloat16")
    target.eval()
    print(cpu_linear.setup(target, args.linear_backend))
    prop = load_proposer(args.drafter, target, tokenizer=tok)
    if cpu_layers.fused(getattr(prop, "drafter", None)) is None:
        raise SystemExit(f"{args.drafter}: not an EAGLE-3 drafter running through a fused layer on this CPU")
    print(f"catch-up of N tokens per row, median of {args.repeats} calls, ms ({args.threads} threads)")
    print("| batch | N | now (fused up to MAX_ROWS rows, else PyTorch), last logits | PyTorch, last logits | before session 30: every position's logits | before / now |")
    print("|---|---|---|---|---|---|")
    for B in (int(b) for b in args.batch_sizes.split(",")):
        for n in (int(t) for t in args.tokens.split(",")):
            now = _time(prop, B, n, args.repeats, fused=True, last=True)
            torch_last = _time(prop, B, n, args.repeats, fused=False, last=True)
            before = _time(prop, B, n, args.repeats, fused=B * n <= cpu_layers.MAX_ROWS, last=False)
            print(f"| {B} | {n} | {now:.2f} | {torch_last:.2f} | {before:.2f} | {before / now:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
