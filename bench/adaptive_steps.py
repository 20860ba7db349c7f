"""What `adaptive:` decides at each step: planned chain length, drafted depth, depth kept for verification.

Why: at T=1 `adaptive:` over `eagle_long`'s drafter ran 1.33x where a fixed chain of 3 ran 1.42x
(session 33, `runs/eval/s33-g3*`), and the eval's report cannot say whether the plan (the length
drafted, chosen from past steps before drafting) or the stopping rule (the drafts kept for
verification after drafting) made the difference. This wraps the scheduler's plan and trim for
one decode run and counts the steps by (planned length, drafted depth, kept depth) of the first
part; batch 1, so one row per step.

    python bench/adaptive_steps.py adaptive:runs/eagle_long_s30/drafter --temperature 1 --gamma 3 \
        --prompts 8 --new-tokens 128 --seeds 0,100

Session 33 (this command, 7-bit weights, 1,060 steps, `runs/adaptive-steps-s33.txt`): the plan
chose 2 in 65% of the steps and 3 in 32%; the stopping rule shortened 1.2% of them.
"""

from __future__ import annotations

import argparse
import collections
from contextlib import contextmanager

import torch

from drafttrain.config import LINEAR_BACKEND_HELP, LINEAR_BACKENDS
from drafttrain.data import DataConfig
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kernels import cpu_linear
from drafttrain.decode.proposers.scheduler import Scheduler
from drafttrain.eval.benchmarks import load_benchmark
from drafttrain.eval.runner import eos_ids
from drafttrain.targets import load_target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="an adaptive proposer spec, e.g. adaptive:runs/eagle_long_s30/drafter")
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--bench", default="mtbench")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seeds", default="0", help="comma-separated; prompt i decodes with seed + i")
    p.add_argument("--gamma", type=int, default=0, help="the longest chain adaptive may plan (0: its default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS, help=LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


@contextmanager
def recorded(counts: collections.Counter):
    """Counts each step of any Scheduler inside the block by (planned length, drafted depth, kept
    depth) of its first part; the scheduler's methods come back as they were."""
    plan, trim = Scheduler._plan, Scheduler._trim
    planned: list[int] = []

    def plan_(self, state, part, name):
        out = plan(self, state, part, name)
        if part is self.parts[0]:
            planned.append(out[0])
        return out

    def trim_(self, state, active, merged, *args):
        out = trim(self, state, active, merged, *args)
        counts[(planned[-1], int(merged.depths().max()), int(out[0].depths().max()))] += 1
        return out

    Scheduler._plan, Scheduler._trim = plan_, trim_
    try:
        yield counts
    finally:
        Scheduler._plan, Scheduler._trim = plan, trim


def table(counts: collections.Counter) -> list[str]:
    """Markdown rows: each (planned, drafted, kept) with its steps and share, then the shares of
    each planned length and of steps where trimming shortened the chain."""
    total = max(1, sum(counts.values()))
    rows = ["| planned length | drafted depth | kept depth | steps | share |", "|---|---|---|---|---|"]
    for (p, d, k), n in sorted(counts.items()):
        rows.append(f"| {p} | {d} | {k} | {n} | {100 * n / total:.1f}% |")
    by_plan = collections.Counter()
    for (p, _, _), n in counts.items():
        by_plan[p] += n
    trimmed = sum(n for (_, d, k), n in counts.items() if k < d)
    rows.append("\nplanned: " + ", ".join(f"{p}: {100 * n / total:.0f}%" for p, n in sorted(by_plan.items()))
                + f"; trimmed after drafting: {100 * trimmed / total:.1f}% of {total} steps")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok, _ = load_target(args.target, dtype="bfloat16")
    print(cpu_linear.setup(target, args.linear_backend, "auto"))
    proposer = load_proposer(args.spec, target, tokenizer=tok)
    if not isinstance(proposer, Scheduler):
        raise SystemExit(f"error: {args.spec} is not an adaptive proposer (use adaptive:<spec>)")
    prompts = load_benchmark(args.bench, tok, DataConfig(), args.prompts)
    eos, counts = eos_ids(target, tok), collections.Counter()
    with recorded(counts):
        for s in (int(x) for x in args.seeds.split(",")):
            for i, p in enumerate(prompts):
                speculative_generate(target, proposer, torch.tensor([p.ids]), max_new_tokens=args.new_tokens,
                                     temperature=args.temperature, seed=s + i if args.temperature > 0 else None,
                                     eos_token_id=eos, gamma=args.gamma or None)
    print("\n".join(table(counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
