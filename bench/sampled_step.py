"""Target-only sampled (T=1) decoding throughput with the two keyed emit draws, at several batch sizes.

    python bench/sampled_step.py                       # gemma-3-270m bf16, batch 1, 4, 16, 32 new tokens
    python bench/sampled_step.py --batches 1,16 --tokens 64

Verification draws the emitted token of each row from keys (seed, position), so a row's sample does
not depend on its batch. Two draws give the same law: the keyed Exp(1) race (V random numbers per
row and step, what the fused GPU kernel consumes) and the keyed inverse CDF (one uniform per row,
what the CPU path uses). This script times target-only decoding with each, the same prompts and
seed, so the figure is what the draw costs a whole step. Prefill is excluded.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import drafttrain.decode.verify as verify
from drafttrain.decode import speculative_generate
from drafttrain.targets import load_target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="gemma-3-270m", help="target spec (drafttrain.targets.load_target)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batches", default="1,4,16", help="comma list of batch sizes")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per row")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per row")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    return p.parse_args(argv)


def decode_tok_s(target, ids: torch.Tensor, tokens: int) -> float:
    """Decoding tokens/s of one target-only T=1 call (after an untimed short warm-up call)."""
    speculative_generate(target, None, ids[:, :16], max_new_tokens=4, temperature=1.0, seed=0, eos_token_id=[])
    t = time.perf_counter()
    out = speculative_generate(target, None, ids, max_new_tokens=tokens, temperature=1.0, seed=0, eos_token_id=[])
    return ids.shape[0] * tokens / (time.perf_counter() - t - out.stats.time_prefill)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _, _ = load_target(args.target, dtype=args.dtype)
    target.eval()
    keyed = verify._draw
    race = functools.partial(lambda *a, race, **k: keyed(*a, race=True, **k))
    print(f"{args.target} {args.dtype}, {args.threads} threads, {args.tokens} new tokens after {args.prompt_len}, T=1")
    print("| batch | keyed Exp(1) race tok/s | keyed inverse CDF tok/s | ratio |")
    print("|---|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        ids = torch.randint(100, 1000, (b, args.prompt_len), generator=torch.Generator().manual_seed(b))
        try:
            verify._draw = race
            old = decode_tok_s(target, ids, args.tokens)
        finally:
            verify._draw = keyed
        new = decode_tok_s(target, ids, args.tokens)
        print(f"| {b} | {old:.1f} | {new:.1f} | {new / old:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
