"""Where one training step's time goes: data, target forward, teacher, each unroll step, loss,
backward, optimizer; and the tokens/s it adds up to.

    python bench/train_profile.py recipe=eagle [key=value ...] [--steps 8] [--warmup 2]

Takes the same keys as `drafttrain train` (recipe, method, data.*, drafter.*, answers.*, ...),
builds the run exactly as training does (`drafttrain.trainer.setup`: target, data, drafter,
optimizer), then times `--steps` micro-batches after `--warmup` under torch.profiler, with the
phases named by `record_function` (the trainer's own code labels "teacher" and "unroll_k").
Prints a table: ms per micro-batch and share of the step for every phase, then tokens/s.
Nothing is saved (the run folder only gets config.yaml). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ("data", "target_features", "loss_forward", "teacher", "backward", "optimizer")


def _steps(run, n: int):
    """Yields after each timed micro-batch: (tokens in it)."""
    from drafttrain.trainer import loss_step

    cfg, acc = run.cfg, run.accelerator
    it = iter(run.loader)
    run.drafter.train()
    for _ in range(n):
        with record_function("data"):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(run.loader)
                batch = next(it)
        with record_function("target_features"):
            feats = run.method.batch_features(cfg, run.target, batch, run.spec)
        with record_function("loss_forward"), acc.autocast():
            loss, _ = loss_step(cfg, run.drafter, run.target, batch, feats, step=0)
        with record_function("backward"):
            acc.backward(loss)
        with record_function("optimizer"):
            run.optimizer.step()
            run.optimizer.zero_grad()
        yield int(batch["attention_mask"].sum())


def _table(prof, steps: int, wall: float, tokens: int, unroll: int) -> str:
    cpu = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}  # ms over all timed steps
    names = [*PHASES[:4], *[f"unroll_{k}" for k in range(unroll)], *PHASES[4:]]
    step_ms = wall * 1e3 / steps
    lines = [f"{'phase':<18}{'ms / micro-batch':>18}{'share':>8}", "-" * 44]
    for name in names:
        if name in cpu:
            ms = cpu[name] / steps
            indent = "  " if name.startswith("unroll") or name == "teacher" else ""
            lines.append(f"{indent + name:<18}{ms:>18.1f}{ms / step_ms:>8.1%}")
    lines += ["-" * 44, f"{'whole micro-batch':<18}{step_ms:>18.1f}",
              f"tokens/s: {tokens / wall:.1f} ({tokens} tokens in {steps} micro-batches, {wall:.1f} s; "
              f"threads {torch.get_num_threads()})",
              "(teacher and unroll_k run inside loss_forward; backward runs every unroll step's backward)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="python bench/train_profile.py recipe=eagle [key=value ...] [--steps N]")
    ap.add_argument("--steps", type=int, default=8, help="timed micro-batches (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed micro-batches first (default 2)")
    args, keys = ap.parse_known_args(argv)
    from drafttrain.config import parse_args
    from drafttrain.schema import TrainConfig
    from drafttrain.trainer import setup

    cfg = parse_args([*keys, "tracking=none", "train.decode_eval_final=false"], TrainConfig)
    run = setup(cfg)
    for _ in _steps(run, args.warmup):
        pass
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        tokens = sum(_steps(run, args.steps))
        wall = time.perf_counter() - t0
    unroll = getattr(cfg.drafter, "ttt_steps", 0)
    print(f"\n{cfg.method} on {cfg.target}, batch {cfg.train.batch_size}, max_len {cfg.data.max_len}, "
          f"dtype {cfg.dtype}, mixed precision {run.accelerator.mixed_precision}")
    print(_table(prof, args.steps, wall, tokens, unroll))
    return 0


if __name__ == "__main__":
    sys.exit(main())
