"""Paired end-to-end timing of one EAGLE drafter with bf16 and with 7-bit weights (`draft_weights`).

Why: `drafttrain eval` takes one `draft_weights` for every proposer of a run, so bf16 and 7-bit
drafters land in different runs, and this VM's speed drifts between runs by more than the few
percent 7 bits can give (session 33: `eagle_long` at T=1 read 1.36x and 1.37x pooled in two runs
minutes apart). Here one process loads the target once and the drafter twice (as loaded, and moved
to 7 bits by `cpu_linear.quantize`, as `draft_weights=int7` does), then decodes every (seed,
prompt) with target-only decoding, the bf16 drafter and the 7-bit drafter back to back, rotating
their order, at a fixed chain length. It prints each method's tokens/s, its speedup over
target-only decoding and 7-bit over bf16, each with a 95% bootstrap interval over the (seed,
prompt) pairs (`eval.metrics.speedup_ci95`).

    python bench/draft_weights.py runs/eagle_long_s30/drafter --prompts 8 --new-tokens 256 \
        --temperatures 0,1 --seeds 0,100,200 --gamma 3

Needs the AVX-512 bf16 or AMX kernel (the 7-bit path's); time it on an idle machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from drafttrain.config import LINEAR_BACKEND_HELP, LINEAR_BACKENDS
from drafttrain.data import DataConfig
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kernels import cpu_linear
from drafttrain.eval.benchmarks import load_benchmark
from drafttrain.eval.metrics import speedup_ci95
from drafttrain.eval.runner import eos_ids
from drafttrain.targets import load_target

METHODS = ("target", "bf16", "int7")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter", help="an EAGLE drafter folder")
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--bench", default="mtbench", help="mtbench | humaneval | mixed | a .jsonl of prompts")
    p.add_argument("--prompts", type=int, default=8, help="first N prompts (MT-bench: one per category for 8)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,1", help="comma-separated")
    p.add_argument("--seeds", default="0,100,200", help="comma-separated; prompt i decodes with seed + i (T > 0)")
    p.add_argument("--gamma", type=int, default=3, help="drafts per step (a fixed chain, for both drafters)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="the target's linear layers: " + LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


def decode(target, proposer, ids: torch.Tensor, *, temperature: float, seed: int, new_tokens: int, gamma: int,
           eos: list[int]) -> tuple[int, float]:
    """(new tokens, wall seconds) of one prompt."""
    t0 = time.perf_counter()
    out = speculative_generate(target, proposer, ids, max_new_tokens=new_tokens, temperature=temperature,
                               seed=seed if temperature > 0 else None, eos_token_id=eos,
                               gamma=gamma if proposer is not None else None)
    return len(out.sequences[0]), time.perf_counter() - t0


def report(calls: dict[str, list[tuple[int, float]]]) -> list[str]:
    """Lines: each method's tokens/s and speedup over target-only decoding, and 7-bit over bf16."""
    def walls(m):
        return [w for _, w in calls[m]]

    def toks(m):
        return [t for t, _ in calls[m]]

    def rate(m):
        return sum(toks(m)) / sum(walls(m))

    rows = ["| method | tok/s | speedup vs target [95% CI] |", "|---|---|---|"]
    for m in METHODS:
        if m == "target":
            rows.append(f"| target | {rate(m):.1f} | 1.00 |")
            continue
        lo, hi = speedup_ci95(walls("target"), walls(m), base_tokens=toks("target"), tokens=toks(m))
        rows.append(f"| {m} drafter | {rate(m):.1f} | {rate(m) / rate('target'):.3f} [{lo:.3f}, {hi:.3f}] |")
    lo, hi = speedup_ci95(walls("bf16"), walls("int7"), base_tokens=toks("bf16"), tokens=toks("int7"))
    rows.append(f"\n7-bit over bf16: {rate('int7') / rate('bf16'):.3f}x [{lo:.3f}, {hi:.3f}] "
                f"over {len(calls['target'])} (seed, prompt) pairs")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok, _ = load_target(args.target, dtype="bfloat16")
    target.eval()
    print(cpu_linear.setup(target, args.linear_backend, "bf16"))
    if cpu_linear.installed_backend(target) not in cpu_linear.Q7_BACKENDS:
        raise SystemExit("error: the 7-bit path needs the AVX-512 bf16 or AMX kernel; this CPU / backend has neither")
    bf16 = load_proposer(args.drafter, target, tokenizer=tok)
    seven = load_proposer(args.drafter, target, tokenizer=tok)
    moved = cpu_linear.quantize(seven.drafter, exclude=target)
    print(f"{args.drafter}: {moved} linears of the second copy in 7-bit weights")
    prompts = load_benchmark(args.bench, tok, DataConfig(), args.prompts)
    eos = eos_ids(target, tok)
    proposers = {"target": None, "bf16": bf16, "int7": seven}
    seeds = [int(s) for s in args.seeds.split(",")]
    for t in (float(x) for x in args.temperatures.split(",")):
        calls: dict[str, list[tuple[int, float]]] = {m: [] for m in METHODS}
        turn = 0
        for s in seeds if t > 0 else seeds[:1]:  # greedy decoding does not depend on the seed
            for i, p in enumerate(prompts):
                ids = torch.tensor([p.ids])
                order = METHODS[turn % 3:] + METHODS[:turn % 3]  # rotate: no method always runs first
                turn += 1
                for m in order:
                    calls[m].append(decode(target, proposers[m], ids, temperature=t, seed=s + i,
                                           new_tokens=args.new_tokens, gamma=args.gamma, eos=eos))
        print(f"\nT={t:g}, gamma {args.gamma}, {len(calls['target'])} (seed, prompt) pairs x {args.new_tokens} tokens:")
        print("\n".join(report(calls)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
