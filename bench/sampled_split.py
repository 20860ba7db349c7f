"""What sampling (T=1) adds to a decode step, piece by piece, against the greedy step.

    python bench/sampled_split.py                      # gemma-3-270m bf16, context 256, 2 threads
    python bench/sampled_split.py --verify 4 --steps 30

The cost model prices a T=1 step several milliseconds above a greedy one (README, "The cost
model"). This script says where they go, for the shapes decoding runs at batch 1:

- the target step with the fused greedy argmax head (what T=0 runs) and with full logits (T=1);
- turning [1, n, V] logits into probabilities (`process_logits`: cast, temperature, softmax);
- the keyed draws and the acceptance rule (`verify_tree` with seed and positions, dense draft
  probabilities as drafters hand them over), root-only and for a chain of --verify tokens;
- the draft side of one sampled draft step over a reduced vocabulary of --draft-vocab ids: the
  draft's `process_logits`, the keyed draw (`keyed_categorical`) and the scatter of its
  probabilities back to the target's vocabulary (what verification reads);
- the keyed uniforms behind every draw, through the NumPy path CPU tensors take and through the
  torch path other devices take (the same bits).

Each figure is the median of --steps calls after two warm-up calls. Deliberately not here: making
any of it faster (this is the measuring stick), batch > 1, GPUs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import Step, median_ms  # noqa: E402

from drafttrain.config import LINEAR_BACKEND_HELP  # noqa: E402
from drafttrain.decode.kernels import cpu_linear  # noqa: E402
from drafttrain.decode.kv import KVState, target_forward  # noqa: E402
from drafttrain.decode.sampling import (  # noqa: E402
    STREAM_ACCEPT,
    _counter_uniform_np,
    _counter_uniform_torch,
    keyed_categorical,
    process_logits,
)
from drafttrain.decode.verify import chain_parents, verify_tree  # noqa: E402
from drafttrain.targets import load_target  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="gemma-3-270m", help="target spec (drafttrain.targets.load_target)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    p.add_argument("--verify", type=int, default=4, help="tokens of the verified chain (root + drafts)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (EAGLE-3's default)")
    p.add_argument("--steps", type=int, default=20, help="timed calls per figure (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--linear-backend", default="auto", help=LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _, _ = load_target(args.target, dtype=args.dtype)
    model.eval()
    print(cpu_linear.setup(model, args.linear_backend))
    V = model.get_output_embeddings().weight.shape[0]
    n = args.verify
    rows = []
    with torch.inference_mode():
        kv = KVState.for_model(model, 1, torch.device("cpu"))
        ctx = torch.randint(100, 1000, (1, args.context))
        target_forward(model, kv, ctx, torch.arange(args.context)[None], torch.arange(-1, args.context - 1)[None],
                       head="none")
        kv.commit(torch.arange(args.context)[None])
        for width in (1, n):
            greedy = median_ms(Step(model, kv, args.context, width, "argmax"), args.steps)
            full = Step(model, kv, args.context, width, "logits")
            logits_ms = median_ms(full, args.steps)
            logits = full()
            probs_ms = median_ms(lambda lg=logits: process_logits(lg, 1.0, check=False), args.steps)
            tokens = torch.randint(100, 1000, (1, width))
            pos = torch.arange(args.context, args.context + width)[None]
            g = torch.Generator().manual_seed(0)
            q = torch.softmax(torch.randn(1, width, V, generator=g), -1) if width > 1 else None
            par = chain_parents(1, width - 1)
            verify_ms = median_ms(lambda lg=logits, t=tokens, par=par, p=pos, q=q: verify_tree(
                lg, t, par, q, temperature=1.0, seed=0, positions=p), args.steps)
            name = "root only" if width == 1 else f"chain of {width}"
            rows.append((name, greedy, logits_ms, probs_ms, verify_ms))

        print(f"\n{args.target} {args.dtype}, context {args.context}, {torch.get_num_threads()} threads, "
              f"batch 1, median of {args.steps} calls (ms):")
        print("| shape | greedy step (argmax head) | step with full logits | process_logits | verify_tree T=1 (keyed) "
              "| T=1 total | T=1 - greedy |")
        print("|---|---|---|---|---|---|---|")
        for name, greedy, logits_ms, probs_ms, verify_ms in rows:
            total = logits_ms + verify_ms  # verify_tree calls process_logits itself
            print(f"| {name} | {greedy:.1f} | {logits_ms:.1f} | {probs_ms:.2f} | {verify_ms:.2f} | {total:.1f} "
                  f"| {total - greedy:+.1f} |")

        d = args.draft_vocab
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:d].sort().values[None]
        lg = torch.randn(1, d)
        q = process_logits(lg, 1.0, check=False)
        pos = torch.tensor([args.context])
        proc = median_ms(lambda: process_logits(lg, 1.0, check=False), args.steps)
        greedy_conf = median_ms(lambda: (lg.argmax(-1), torch.softmax(lg.float(), -1).max(-1).values), args.steps)
        draw = median_ms(lambda: keyed_categorical(q, 0, pos), args.steps)
        scatter = median_ms(lambda: q.new_zeros(1, V).scatter_(-1, ids, q), args.steps)
        print(f"\none sampled draft step's bookkeeping over a {d}-id draft vocabulary (ms): process_logits {proc:.3f}, "
              f"keyed_categorical {draw:.3f}, scatter to the {V}-id vocabulary {scatter:.3f}; "
              f"the greedy step's argmax + confidence {greedy_conf:.3f}")
        # the keyed uniforms behind each draw: NumPy on CPU tensors, torch elsewhere (same bits)
        cnt = torch.arange(n)[None]
        hashes = [median_ms(lambda f=f: f(0, pos[:, None], cnt, STREAM_ACCEPT), args.steps)
                  for f in (_counter_uniform_np, _counter_uniform_torch)]
        print(f"keyed uniforms for a {n}-node verification (ms): NumPy path {hashes[0]:.3f}, torch path {hashes[1]:.3f} "
              f"(one per verification for the accept tests, one for the emitted token, one per sampled draft)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
