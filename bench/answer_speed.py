"""How fast the target answers its training prompts, per drafter, at one temperature.

    python bench/answer_speed.py [--temperature 1] [--tokens 64] [--batch 16] [--rounds 2] \
        [--proposers none,ngram,adaptive:ngram] [recipe key=value ...]

Takes the last `--batch` usable training prompts of the recipe (default `recipe=eagle`), answers
them as `answers.source=target` does (drafttrain.regenerate.answer_batch: one batch, per-row
keyed sampling), once per proposer per round, interleaved, and prints seconds per batch. This is
what chose `answers.sampled_proposer=none`. A benchmark, not a test: time it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    from drafttrain.config import parse_args
    from drafttrain.decode import load_proposer
    from drafttrain.eos import eos_ids
    from drafttrain.regenerate import RegenerateConfig, answer_batch, prompts_of
    from drafttrain.schema import TrainConfig
    from drafttrain.targets import load_target

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per answer")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--proposers", default="none,ngram,adaptive:ngram")
    args, rest = ap.parse_known_args(argv)
    cfg = parse_args(["recipe=eagle", *rest], TrainConfig)
    target, tok, _ = load_target(cfg.target, dtype=cfg.dtype)
    rcfg = RegenerateConfig(data=cfg.data, num_prompts=0, max_new_tokens=args.tokens, out="unused.jsonl")
    prompts = prompts_of(rcfg, tok)[-args.batch:]
    eos = eos_ids(target, tok)
    specs = args.proposers.split(",")
    proposers = {s: None if s == "none" else load_proposer(s, target, tokenizer=tok) for s in specs}
    times: dict[str, list[float]] = {s: [] for s in specs}
    for _ in range(args.rounds):
        for s in specs:
            t0 = time.perf_counter()
            answer_batch(rcfg, target, tok, proposers[s], prompts, args.temperature, eos)
            times[s].append(time.perf_counter() - t0)
    print(f"{args.batch} prompts x {args.tokens} tokens at T={args.temperature:g}, {args.rounds} rounds (median s):")
    for s in specs:
        print(f"  {s:<20} {statistics.median(times[s]):6.1f} s   ({' '.join(f'{t:.1f}' for t in times[s])})")


if __name__ == "__main__":
    main()
