"""Test-only wrapper around the `drafttrain` CLI that plants faults, for the subprocess tests.

    python tests/scale/fault_driver.py [--sleep-per-record S] [--sleep-per-step S] [--nan-at-step N] \
        COMMAND key=value ...

--sleep-per-record slows `prepare` (so a test can kill it mid-way), --sleep-per-step slows each
training micro-step, --nan-at-step N makes the loss of optimizer step N (1-based) NaN. Everything
else is the real CLI; nothing here is importable by the package.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--sleep-per-record", type=float, default=0.0)
    ap.add_argument("--sleep-per-step", type=float, default=0.0)
    ap.add_argument("--nan-at-step", type=int, default=0)
    args, rest = ap.parse_known_args()

    import drafttrain.features as features
    import drafttrain.trainer as trainer
    from drafttrain.cli import main as cli_main

    if args.sleep_per_record:
        real_features = features.target_features

        def slow_features(*a, **kw):
            time.sleep(args.sleep_per_record)
            return real_features(*a, **kw)

        features.target_features = slow_features

    if args.sleep_per_step or args.nan_at_step:
        real_loss_step = trainer.loss_step

        def faulty_loss_step(cfg, drafter, target, batch, feats, step=None):
            loss, metrics = real_loss_step(cfg, drafter, target, batch, feats, step)
            if step is not None:  # training, not evaluation
                time.sleep(args.sleep_per_step)
                if args.nan_at_step and step + 1 == args.nan_at_step:
                    loss = loss * float("nan")
            return loss, metrics

        trainer.loss_step = faulty_loss_step
    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
