"""What `adaptive:`'s own work costs per verification step, found by switching it off piece by piece.

Why: timing the scheduler's methods from inside the decode loop misleads. After a 20 ms forward
has flushed the caches, each small op costs 3-4× its microbenchmark time, and wrappers add their
own. Here every variant decodes the same prompts in one process, back to back in rotating order,
and the scheduler's cost is the difference in ms per verification step:

    target     target-only decoding
    fixed      the drafter at a fixed chain of --gamma
    adaptive   adaptive:<drafter> capped at --gamma, as users run it
    planned    adaptive making its plan every step, then dropping it and drafting as `forced`
    forced     adaptive with its plan forced to --gamma (not computed), so it drafts what the fixed
               chain drafts; planned - forced is what making the plan costs
    bare       forced, without the trim, the calibrator's update and the step record: it emits the
               fixed chain's tokens exactly (checked), so bare - fixed is the loop's skeleton and
               forced - fixed all of the scheduler's own work

    python bench/scheduler_overhead.py runs/eagle_long_s30/drafter --temperature 1 --gamma 3 \
        --prompts 8 --new-tokens 192 --rounds 2

Session 34 (Xeon, T=1, seed 0; the scratch script this replaces): forced - fixed was 0.65 ms a
step before the batch-1 Python paths for the trim and the chain count, 0.27 ms after.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch

from drafttrain.config import LINEAR_BACKEND_HELP, LINEAR_BACKENDS
from drafttrain.data import DataConfig
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.calibrator import AcceptanceCalibrator
from drafttrain.decode.kernels import cpu_linear
from drafttrain.decode.proposers.scheduler import Scheduler
from drafttrain.eval.benchmarks import load_benchmark
from drafttrain.eval.runner import eos_ids
from drafttrain.targets import load_target

VARIANTS = ("target", "fixed", "adaptive", "planned", "forced", "bare")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter", help="a drafter folder (or any proposer spec without adaptive:)")
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--bench", default="mtbench")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="prompt i decodes with seed + i")
    p.add_argument("--gamma", type=int, default=3, help="the fixed chain, the adaptive cap and the forced plan")
    p.add_argument("--rounds", type=int, default=1, help="decode every prompt this many times (noise)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS, help=LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


@contextmanager
def switched(variant: str, gamma: int):
    """The scheduler as `variant` needs it (see the module docstring); everything comes back after."""
    saved = Scheduler._plan, Scheduler._trim, Scheduler._record, AcceptanceCalibrator.update
    plan = Scheduler._plan
    if variant == "planned":  # the plan is made, then dropped: the same decisions as `forced`
        Scheduler._plan = lambda self, state, part, name: (plan(self, state, part, name) and
                                                           (min(gamma, self._cap(state, part)), 0.0, 0.0))
    if variant in ("forced", "bare"):
        Scheduler._plan = lambda self, state, part, name: (min(gamma, self._cap(state, part)), 0.0, 0.0)
    if variant == "bare":
        Scheduler._trim = lambda self, state, active, merged, *rest: (merged, None)
        Scheduler._record = lambda self, *a, **k: None
        AcceptanceCalibrator.update = lambda self, *a, **k: None
    try:
        yield
    finally:
        Scheduler._plan, Scheduler._trim, Scheduler._record, AcceptanceCalibrator.update = saved


def measure(target, fixed, adaptive, prompts: list[list[int]], *, new_tokens: int, temperature: float,
            seed: int, gamma: int, eos: list[int], rounds: int = 1) -> dict[str, dict]:
    """{variant: tokens, wall_s, steps, sequences}: each prompt decoded by every variant in turn,
    the order rotated from prompt to prompt and round to round (a round repeats every prompt with
    the same seeds, so its tokens repeat too; `sequences` holds each call's)."""
    out = {v: {"tokens": 0, "wall_s": 0.0, "steps": 0, "sequences": []} for v in VARIANTS}
    for k, (i, ids) in enumerate((i, ids) for _ in range(rounds) for i, ids in enumerate(prompts)):
        order = VARIANTS[k % len(VARIANTS):] + VARIANTS[: k % len(VARIANTS)]
        for v in order:
            prop = None if v == "target" else fixed if v == "fixed" else adaptive
            with switched(v, gamma):
                t0 = time.perf_counter()
                gen = speculative_generate(target, prop, torch.tensor([ids]), max_new_tokens=new_tokens,
                                           temperature=temperature, seed=seed + i if temperature > 0 else None,
                                           eos_token_id=eos, gamma=None if prop is None else gamma)
                wall = time.perf_counter() - t0
            rec = out[v]
            rec["tokens"] += len(gen.sequences[0])
            rec["wall_s"] += wall
            rec["steps"] += gen.stats.as_dict()["target_forwards"]
            rec["sequences"].append(gen.sequences[0])
    return out


def table(res: dict[str, dict]) -> list[str]:
    """Markdown rows per variant (tok/s, tau, ms a step, ms a step over the fixed chain), then
    whether `bare` emitted the fixed chain's tokens."""
    ms = {v: 1e3 * r["wall_s"] / max(r["steps"], 1) for v, r in res.items()}
    rows = ["| variant | tok/s | tau | ms / step | over fixed |", "|---|---|---|---|---|"]
    for v, r in res.items():
        over = f"{ms[v] - ms['fixed']:+.2f}" if v not in ("target", "fixed") else "-"
        rows.append(f"| {v} | {r['tokens'] / max(r['wall_s'], 1e-9):.1f} | {r['tokens'] / max(r['steps'], 1):.3f} "
                    f"| {ms[v]:.2f} | {over} |")
    same = res["bare"]["sequences"] == res["fixed"]["sequences"]
    rows.append(f"\nbare emitted the fixed chain's tokens: {'yes' if same else 'NO (the comparison is off)'}; "
                f"the scheduler's own work: planned - fixed = {ms['planned'] - ms['fixed']:+.2f} ms a step: "
                f"the plan (planned - forced) {ms['planned'] - ms['forced']:+.2f}, trim, update and record "
                f"(forced - bare) {ms['forced'] - ms['bare']:+.2f}, the loop's skeleton (bare - fixed) "
                f"{ms['bare'] - ms['fixed']:+.2f}")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok, _ = load_target(args.target, dtype="bfloat16")
    print(cpu_linear.setup(target, args.linear_backend, "auto"))
    fixed = load_proposer(args.drafter, target, tokenizer=tok)
    adaptive = load_proposer(f"adaptive:{args.drafter}", target, tokenizer=tok)
    prompts = [p.ids for p in load_benchmark(args.bench, tok, DataConfig(), args.prompts)]
    res = measure(target, fixed, adaptive, prompts, new_tokens=args.new_tokens, temperature=args.temperature,
                  seed=args.seed, gamma=args.gamma, eos=eos_ids(target, tok), rounds=args.rounds)
    print("\n".join(table(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
