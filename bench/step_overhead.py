"""How much of a decode step is spent outside the C++ kernels: the engine's own per-step work.

Why: on this 2-core CPU a target step is ~25-30 ms of matmuls and attention in the AVX2 kernels
plus 2-6 ms of Python and small PyTorch ops around them (masks, verification, the proposer's
bookkeeping, the scheduler). That outside share is what speculation pays on every step in addition
to the target's, so at a first-position acceptance near 0.4 it decides whether a drafter pays at
all. The kernels' own time drifts with the machine's memory bandwidth (27-34 GB/s here, lower in
busy phases); the outside time barely does, so it is the figure to compare across code changes.

What: loads the target (and a proposer), routes it through the kernels as `drafttrain eval` does,
wraps every function of the kernel extension (AVX2, AVX-512 or AMX) and every linear's one-call path
with a timer, decodes one prompt three times and prints, for the median run by outside time: ms per
target step in all, inside the kernels, and outside.

    python bench/step_overhead.py                                  # target-only, greedy
    python bench/step_overhead.py --proposer runs/eagle/drafter --gamma 1 --temperature 1
    python bench/step_overhead.py --proposer adaptive:ngram --batch-size 4   # rows that accept unlike

Session 37 (EPYC, `--proposer ngram --gamma 4 --batch-size 4`, 59 steps): a step's commit
gathered every cached entry of every layer whenever rows kept paths of different lengths; it now
gathers only the step's pending tail: 72.45 -> 70.47 ms a step (outside the kernels 40.72 ->
38.62; 4 x 5 tokens are more rows than the kernels take, so PyTorch's matmuls count as outside).
The old gather's cost grew with the context; these prompts are short.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from drafttrain.config import LINEAR_BACKEND_HELP, LINEAR_BACKENDS
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kernels import cpu_layers, cpu_linear
from drafttrain.targets import load_target

PROMPTS = ["Explain how a hash map handles collisions, with a short example in Python.",
           "Write a haiku about autumn rain, then explain its imagery.",
           "List three differences between TCP and UDP.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--proposer", default="", help="a proposer spec load_proposer takes ('' = target-only)")
    p.add_argument("--gamma", type=int, default=1, help="chain length of a plain drafter")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, choices=range(1, len(PROMPTS) + 1),
                   help="rows, one different prompt each (left-padded)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="the target's linear layers (decode/kernels/cpu_linear.py): " + LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


def _timed(f, spent: list[float]):
    @functools.wraps(f)
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return call


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok, _ = load_target(args.target, dtype="bfloat16")
    print(cpu_linear.setup(target, args.linear_backend))
    layers = cpu_layers.fused(target)
    if layers is None:
        raise SystemExit("step_overhead: the target does not run through the fused CPU layers on this machine "
                         "(needs the AVX2 kernel and a Gemma 3 target); nothing to split")
    prop = load_proposer(args.proposer, target, tokenizer=tok, gamma=args.gamma) if args.proposer else None
    spent = [0.0]
    for name in dir(layers.ext):  # the extension module: every kernel any layer or head calls
        f = getattr(layers.ext, name)
        if callable(f) and not name.startswith("_"):
            setattr(layers.ext, name, _timed(f, spent))
    # a linear's one-call path was bound at install (`_Forward.direct`): on AVX-512 / AMX the 1-row
    # LM head and the drafter's linears call it, not the module attribute wrapped above
    models = [target, *([prop.drafter] if prop is not None and hasattr(prop, "drafter") else [])]
    for m in (mod for model in models for mod in model.modules()):
        fwd = vars(m).get("forward")
        if isinstance(fwd, cpu_linear._Forward) and fwd.direct is not None and fwd.backend != "avx2":
            fwd.direct = _timed(fwd.direct, spent)
    enc = [tok(p).input_ids for p in PROMPTS[: args.batch_size]]
    P = max(len(e) for e in enc)
    ids = torch.tensor([[0] * (P - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in enc])
    kw = dict(attention_mask=mask, max_new_tokens=args.new_tokens, temperature=args.temperature, seed=0, eos_token_id=[])
    speculative_generate(target, prop, ids, **dict(kw, max_new_tokens=16))  # warm-up
    rows = []
    for _ in range(args.runs):
        spent[0] = 0.0
        start = time.perf_counter()
        out = speculative_generate(target, prop, ids, **kw)
        wall = time.perf_counter() - start
        steps = out.stats.target_forwards
        rows.append((1e3 * wall / steps, 1e3 * spent[0] / steps, 1e3 * (wall - spent[0]) / steps, steps))
    total, kernels, outside, steps = sorted(rows, key=lambda r: r[2])[len(rows) // 2]
    what = args.proposer or "target-only"
    print(f"{what}, T={args.temperature:g}, gamma {args.gamma}, batch {args.batch_size}: {steps} target steps "
          f"for {args.new_tokens} tokens a row; "
          f"per step {total:.2f} ms = kernels {kernels:.2f} + outside {outside:.2f} (median of {args.runs} by outside)")


if __name__ == "__main__":
    main()
