"""What one draft step of a trained EAGLE drafter costs, where the time goes, against its weight-read floor.

Why: speculation pays only when drafting is cheap next to a target step (session 14: the default
drafter took 4.6-7.8 ms per draft step, a fifth of a target step per drafted token). At T=1 on
the 2-core Xeon (session 31, `runs/eval/s31-remeasured`) `eagle_long`'s drafter spends 5.8 ms
drafting per verification step (about 2.1 drafts and one catch-up) against 28.9 ms verifying, for
1.82 tokens a step: each millisecond cut from drafting is worth about 3% of T=1 speed, and 2 ms
would carry it past issue 17's 1.4x. A draft step reads ~12M bf16 weights (the layer and the
8,192-row head), ~0.6 ms at this machine's bandwidth, yet the cost model prices one at ~1.5 ms.
This script says which part of a `propose` call holds the rest.

Session 32 rewrote this script: its earlier version timed the drafter module's `forward`, which the
fused C++ layer (session 24) no longer calls, and decoded greedily only.

What: loads the target and the drafter as `drafttrain eval` does, decodes three prompts with a
fixed chain length at each temperature, and times (wall clock, `time.perf_counter`) the sections of every
`propose` call: the catch-up over the accepted tokens (`_begin`), the draft steps after the first
(`_feed_nodes`), the drafter forwards inside both (`_run`: the fused C++ layer, the LM head, the KV
mask), the draws (`process_logits`, `keyed_categorical`) and the tree's assembly. Sections nest as
printed; "rest" is what the listed children leave of their parent (Python between the calls).
Only calls made inside `propose` count (the target's own KV calls do not). Times are per `propose`
call, summed over three prompts; `--ops` adds the aten ops per call from one more, profiled, pass.

    python bench/draft_step.py runs/eagle_long_s30/drafter --gamma 3 --temperatures 0,1 --new-tokens 64
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from drafttrain.config import DRAFT_WEIGHTS, DRAFT_WEIGHTS_HELP, LINEAR_BACKEND_HELP, LINEAR_BACKENDS
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.kernels import cpu_layers, cpu_linear
from drafttrain.decode.kv import KVState
from drafttrain.decode.proposers import base as proposer_base
from drafttrain.decode.proposers.eagle import EagleProposer
from drafttrain.targets import load_target

PROMPTS = ["Explain how a hash map handles collisions, with a short example in Python.",
           "Write a haiku about the sea, then explain its imagery.",
           "List three differences between TCP and UDP."]

DRAWS = "draws (process_logits + keyed_categorical)"
#: (section, parent) in print order
SECTIONS = [
    ("propose", None),
    ("catch-up (_begin)", "propose"),
    ("draft steps 2.. (_feed_nodes)", "propose"),
    (DRAWS, "propose"),
    ("tree assembly (chain_tree)", "propose"),
    ("drafter forward (_run)", None),
    ("fused layer (hidden_out)", "drafter forward (_run)"),
    ("LM head (logits)", "drafter forward (_run)"),
    ("KV mask (KVState.extend)", "drafter forward (_run)"),
    ("KV commit (KVState.commit)", None),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("drafter", help="an EAGLE drafter folder")
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--gamma", type=int, default=3, help="drafts per step (a fixed chain)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated")
    p.add_argument("--new-tokens", type=int, default=64, help="per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ops", type=int, default=0, help="also list this many aten ops by time per propose call")
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="the target's linear layers (decode/kernels/cpu_linear.py): " + LINEAR_BACKEND_HELP)
    p.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS, help=DRAFT_WEIGHTS_HELP)
    return p.parse_args(argv)


def _targets(drafter) -> list[tuple[object, str, str]]:
    """(owner, attribute, section) of every function timed; both draws count into one section."""
    return [(EagleProposer, "propose", "propose"), (EagleProposer, "_begin", "catch-up (_begin)"),
            (EagleProposer, "_feed_nodes", "draft steps 2.. (_feed_nodes)"),
            (proposer_base, "process_logits", DRAWS), (proposer_base, "keyed_categorical", DRAWS),
            (proposer_base, "chain_tree", "tree assembly (chain_tree)"),
            (EagleProposer, "_run", "drafter forward (_run)"), (type(drafter), "logits", "LM head (logits)"),
            (KVState, "extend", "KV mask (KVState.extend)"), (KVState, "commit", "KV commit (KVState.commit)"),
            (cpu_layers.FusedEagle3, "hidden_out", "fused layer (hidden_out)")]


@contextmanager
def timed_sections(drafter):
    """Wraps the functions of `_targets` while the block runs; yields {section: [calls, seconds]},
    counting only calls made inside `propose`. The originals are back when the block ends."""
    acc = {name: [0, 0.0] for name, _ in SECTIONS}
    inside = [0]
    saved = []

    def wrap(fn, name):
        @functools.wraps(fn)
        def timed(*a, **k):
            if name != "propose" and not inside[0]:
                return fn(*a, **k)
            inside[0] += name == "propose"
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name][0] += 1
                acc[name][1] += time.perf_counter() - t0
                inside[0] -= name == "propose"
        return timed

    for owner, attr, name in _targets(drafter):
        own = attr in vars(owner)
        saved.append((owner, attr, own, vars(owner).get(attr)))
        setattr(owner, attr, wrap(getattr(owner, attr), name))
    try:
        yield acc
    finally:
        for owner, attr, own, orig in reversed(saved):
            if own:
                setattr(owner, attr, orig)
            else:
                delattr(owner, attr)


def profile(target, proposer, prompts: list[torch.Tensor], *, temperature: float, gamma: int,
            new_tokens: int) -> tuple[dict[str, list], dict]:
    """Decodes each [1, P] prompt once untimed (warm-up: the first) and then all with the sections
    timed; returns ({section: [calls, seconds]}, {"target_forwards", "tokens", "time_draft",
    "time_verify"} summed over the timed calls)."""
    def run(ids, seed):
        return speculative_generate(target, proposer, ids, max_new_tokens=new_tokens, temperature=temperature,
                                    gamma=gamma, seed=seed if temperature > 0 else None, eos_token_id=[])

    run(prompts[0], 0)
    totals = {"target_forwards": 0, "tokens": 0, "time_draft": 0.0, "time_verify": 0.0}
    with timed_sections(proposer.drafter) as acc:
        for i, ids in enumerate(prompts):
            st = run(ids, i).stats
            totals["target_forwards"] += st.target_forwards
            totals["tokens"] += st.tokens_emitted
            totals["time_draft"] += st.time_draft
            totals["time_verify"] += st.time_verify
    return acc, totals


def table(acc: dict[str, list], totals: dict) -> list[str]:
    """Markdown rows: per propose call, each section's calls and ms, and what its children leave."""
    n = max(1, acc["propose"][0])
    total = max(acc["propose"][1], 1e-12)
    rows = ["| section | calls / propose | ms / propose | share of propose |", "|---|---|---|---|"]
    for name, parent in SECTIONS:
        calls, s = acc[name]
        if not calls:
            continue
        rows.append(f"| {'- ' if parent else ''}{name} | {calls / n:.2f} | {1e3 * s / n:.3f} | {s / total:.0%} |")
        kids = [acc[k][1] for k, p in SECTIONS if p == name and acc[k][0]]
        if kids:
            rest = s - sum(kids)
            rows.append(f"| - rest of {name.split(' (')[0]} | | {1e3 * rest / n:.3f} | {rest / total:.0%} |")
    steps = max(1, totals["target_forwards"])
    rows.append(f"\n{acc['propose'][0]} propose calls, {totals['target_forwards']} verifications, "
                f"{totals['tokens'] / steps:.2f} tokens a verification; the engine's split per verification: "
                f"drafting {1e3 * totals['time_draft'] / steps:.2f} ms, verifying {1e3 * totals['time_verify'] / steps:.2f} ms")
    return rows


def draft_weight_bytes(drafter) -> int:
    """Bytes one draft forward reads: the decoder layer and the LM head (the embedding is a gather; the
    feature fc runs on the target's features once per accepted token, not per draft); a linear moved
    to 7-bit weights (`cpu_linear.quantize`) counts its codes and scales."""
    total = 0
    for root in (drafter.midlayer, drafter.norm, drafter.lm_head):
        for mod in root.modules():
            fwd = vars(mod).get("forward")
            if hasattr(fwd, "u"):
                total += fwd.u.numel() * fwd.u.element_size() + fwd.s.numel() * fwd.s.element_size()
            else:
                total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
    return total


def op_table(target, proposer, prompts: list[torch.Tensor], *, temperature: float, gamma: int, new_tokens: int,
             top: int) -> list[str]:
    """The `top` aten ops by self CPU time inside `propose`, per propose call (one profiled pass)."""
    from torch.profiler import profile as torch_profile
    from torch.profiler import record_function

    orig, own = EagleProposer.propose, "propose" in vars(EagleProposer)

    def labelled(self, state):
        with record_function("DRAFT_STEP_PROPOSE"):
            return orig(self, state)

    EagleProposer.propose = labelled
    try:
        with torch_profile() as prof:
            for i, ids in enumerate(prompts):
                speculative_generate(target, proposer, ids, max_new_tokens=new_tokens, temperature=temperature,
                                     gamma=gamma, seed=i if temperature > 0 else None, eos_token_id=[])
    finally:
        if own:
            EagleProposer.propose = orig
        else:
            del EagleProposer.propose
    calls = [e for e in prof.events() if e.name == "DRAFT_STEP_PROPOSE"]
    count, self_us = {}, {}

    def walk(e):
        for c in e.cpu_children:
            if c.name.startswith("aten::"):
                count[c.name] = count.get(c.name, 0) + 1
                self_us[c.name] = self_us.get(c.name, 0.0) + c.self_cpu_time_total
            walk(c)

    for e in calls:
        walk(e)
    n = max(1, len(calls))
    rows = [f"aten ops inside propose (profiled pass, {sum(count.values()) / n:.0f} ops a call):",
            "| op | calls / propose | self us / propose |", "|---|---|---|"]
    for name in sorted(self_us, key=lambda k: -self_us[k])[:top]:
        rows.append(f"| {name} | {count[name] / n:.1f} | {self_us[name] / n:.1f} |")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_profile import read_bandwidth_gbs  # bench/ is not a package

    target, tok, _ = load_target(args.target, dtype="bfloat16")
    target.eval()
    print(cpu_linear.setup(target, args.linear_backend, args.draft_weights))
    prop = load_proposer(args.drafter, target, tokenizer=tok)
    if not isinstance(prop, EagleProposer):
        raise SystemExit(f"{args.drafter}: not an EAGLE drafter (this script times EagleProposer's sections)")
    bw = read_bandwidth_gbs()
    weights = draft_weight_bytes(prop.drafter)
    floor = weights / (bw * 1e9) * 1e3
    print(f"machine: {args.threads} torch threads, read bandwidth {bw:.1f} GB/s; one draft forward reads "
          f"{weights / 1e6:.1f} MB of weights: floor {floor:.2f} ms; fused layer: "
          f"{'yes' if cpu_layers.fused(prop.drafter) is not None else 'no'}")
    prompts = [tok(p, return_tensors="pt").input_ids for p in PROMPTS]
    for t in (float(x) for x in args.temperatures.split(",")):
        kw = dict(temperature=t, gamma=args.gamma, new_tokens=args.new_tokens)
        acc, totals = profile(target, prop, prompts, **kw)
        calls, s = acc["drafter forward (_run)"]
        each = 1e3 * s / max(1, calls)
        print(f"\nT={t:g}, gamma {args.gamma}, {len(prompts)} prompts x {args.new_tokens} tokens: one drafter forward "
              f"{each:.2f} ms ({each / floor:.1f}x the floor)")
        print("\n".join(table(acc, totals)))
        if args.ops:
            print("\n" + "\n".join(op_table(target, prop, prompts, top=args.ops, **kw)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
