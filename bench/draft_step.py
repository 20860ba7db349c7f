"""What one draft step of a trained drafter costs, and where the time goes.

Why: speculation pays only when drafting is cheap next to a target step. On a 2-core CPU the
EAGLE-3 drafter of the default recipe (13M parameters, 26 MB in bf16: ~1 ms of memory traffic)
took 4.6-7.8 ms per draft step (session 14), a fifth of a target step per drafted token, so a
5-token chain cost more than the verification it saved. This prints the split.

What: decodes a few prompts with the drafter at a fixed γ (greedy, batch 1, the target's linear
kernel as `drafttrain eval` installs it, drafters through it too), timing every `propose` call
(the whole draft: the drafter's forwards plus the tree bookkeeping around them) and every forward
of the drafter's module; then replays one draft forward (its mask built, one node on the
committed context, rolled back) alone: median time and a `torch.profiler` op table.

    python bench/draft_step.py runs/eagle/drafter --gamma 5 --new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from drafttrain.config import LINEAR_BACKEND_HELP, LINEAR_BACKENDS
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kernels import cpu_linear
from drafttrain.targets import load_target

PROMPTS = ["Explain how a hash map handles collisions, with a short example in Python.",
           "Write a haiku about the sea, then explain its imagery.",
           "List three differences between TCP and UDP."]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("drafter", help="a drafter folder (or any proposer spec load_proposer takes)")
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--replays", type=int, default=50, help="replays of the last draft forward (median reported)")
    p.add_argument("--top-ops", type=int, default=15)
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="the target's linear layers (decode/kernels/cpu_linear.py): " + LINEAR_BACKEND_HELP)
    return p.parse_args(argv)


class Timed:
    """Wraps a callable, keeping each call's wall time (ms) and its last arguments."""

    def __init__(self, fn):
        self.fn, self.ms, self.last = fn, [], None

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.ms.append(1e3 * (time.perf_counter() - t))
        self.last = (args, kwargs)
        return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok, _ = load_target(args.target, dtype=args.dtype)
    target.eval()
    print(cpu_linear.setup(target, args.linear_backend))
    prop = load_proposer(args.drafter, target, tokenizer=tok, gamma=args.gamma)
    module = getattr(prop, "drafter", None)
    propose = prop.propose = Timed(prop.propose)
    forward = None
    if isinstance(module, torch.nn.Module):
        forward = module.forward = Timed(module.forward)
        params = sum(p.numel() for p in module.parameters())
        print(f"drafter: {type(module).__name__}, {params / 1e6:.1f}M parameters, "
              f"{next(module.parameters()).dtype}, linear kernel {cpu_linear.installed_backend(module)}")
    ids = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    with torch.inference_mode():
        speculative_generate(target, prop, torch.tensor([ids[0]]), max_new_tokens=16, eos_token_id=-1)  # warm up
        propose.ms.clear()
        if forward is not None:
            forward.ms.clear()
        t0, steps, tau = time.perf_counter(), 0, []
        for p in ids:
            out = speculative_generate(target, prop, torch.tensor([p]), max_new_tokens=args.new_tokens,
                                       gamma=args.gamma, eos_token_id=-1)
            tau.append(out.stats.as_dict()["tau"])
        total = time.perf_counter() - t0
    steps = len(propose.ms)
    print(f"\n{len(ids)} prompts x {args.new_tokens} tokens, gamma {args.gamma}: {total:.2f} s, tau "
          f"{statistics.mean(tau):.2f}, {steps} drafts")
    print(f"draft (propose) per cycle: median {statistics.median(propose.ms):.2f} ms "
          f"({sum(propose.ms) / 1e3:.2f} s in all, {100 * sum(propose.ms) / 1e3 / total:.0f}% of the run)")
    if forward is not None and forward.ms:
        per = len(forward.ms) / steps
        print(f"drafter forwards: {len(forward.ms)} ({per:.1f} per draft), median {statistics.median(forward.ms):.2f} ms; "
              f"outside them (tree bookkeeping, sampling, mapping ids): "
              f"{(sum(propose.ms) - sum(forward.ms)) / steps:.2f} ms per draft")
        fargs, fkw = forward.last
        run = getattr(prop, "_run", None)
        if run is None:
            return 0
        ids, hid = fargs[0][:, -1:], fargs[1][:, -1:]  # one node fed on the committed context
        pos = fkw["position_ids"][:, -1:]
        parents = torch.full_like(ids, -1)

        def replay():
            run(ids, hid, pos, parents)
            prop.kv.rollback()

        with torch.inference_mode():
            prop.kv.rollback()
            for _ in range(5):
                replay()
            times = []
            for _ in range(args.replays):
                t = time.perf_counter()
                replay()
                times.append(1e3 * (time.perf_counter() - t))
            print(f"one draft forward (mask + drafter, one node after {prop.kv.committed_len} cached) replayed: "
                  f"median {statistics.median(times):.2f} ms")
            from torch.profiler import profile

            with profile() as prof:
                for _ in range(10):
                    replay()
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top_ops]
        total_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / 10
        print(f"\nreplayed draft forward by op (self CPU ms per forward; all ops {total_ms:.2f} ms):")
        print("| op | calls | ms | share |\n|---|---|---|---|")
        for e in rows:
            ms = e.self_cpu_time_total / 1e3 / 10
            print(f"| {e.key} | {e.count // 10} | {ms:.3f} | {100 * ms / total_ms:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
