"""CPU decoding benchmark: target-only vs speculative decoding (n-gram, early exit), one table.

    python bench/decode_cpu.py --max-new-tokens 48 --prompts 3

Loads the target through `drafttrain.targets.load_target` (default `gemma-3-270m`, bf16), runs
each prompt at batch 1, greedy, with every method in one process on the same prompts, and prints
tokens/s, speedup over target-only, τ (tokens per target forward, bonus included), per-position
acceptance and the draft / verify / other time split. Greedy outputs are compared with the
target-only ones (in bf16 a divergence at a near-tie of the top two logits is numerics).

Deliberately not here: trained drafters, sampling, batch > 1, GPU timing, reports (eval/ does
those); this is a quick sanity benchmark, not a test.
"""

from __future__ import annotations

import argparse
import time

import torch

from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.decode.proposers import check_specs

PROMPTS = [
    "Rewrite this Python function with type hints and a docstring, keeping the logic the same:\n\n"
    "def moving_average(values, window):\n    out = []\n    for i in range(len(values) - window + 1):\n"
    "        out.append(sum(values[i:i + window]) / window)\n    return out\n",
    "Summarise in two sentences: The city council met on Tuesday to discuss the new bus routes. "
    "The new bus routes will connect the north district to the central station, and the council "
    "expects the new bus routes to cut travel times by a third.",
    "List the first ten prime numbers, one per line, each followed by its square.",
    "Explain what a hash table is to a new programmer, with a short example in Python.",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="gemma-3-270m", help="target spec for drafttrain.targets.load_target")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--methods", default="none,ngram,early-exit:6",
                   help="comma-separated: none (target only), ngram[:N], early-exit:K, or a drafter path")
    p.add_argument("--gamma", type=int, default=4, help="drafts per step (chains)")
    p.add_argument("--tree", default=None, choices=[None, "dynamic"], help="draft tree shape (default: chain)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=3, help=f"how many built-in prompts (max {len(PROMPTS)})")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    return p.parse_args(argv)


def encode(tokenizer, text: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=False)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def run(model, proposer, prompts, args) -> dict:
    """Decodes every prompt; returns totals and outputs."""
    totals = dict(tokens=0, wall=0.0, forwards=0, row_forwards=0, draft=0.0, verify=0.0, other=0.0)
    accept, drafted, outputs = [], [], []
    for ids in prompts:
        t0 = time.perf_counter()
        out = speculative_generate(model, proposer, ids, max_new_tokens=args.max_new_tokens,
                                   gamma=args.gamma, tree=args.tree)
        totals["wall"] += time.perf_counter() - t0
        s = out.stats
        totals["tokens"] += s.tokens_emitted
        totals["forwards"] += s.target_forwards
        totals["row_forwards"] += s.row_forwards
        totals["draft"] += s.time_draft
        totals["verify"] += s.time_verify + s.time_prefill
        totals["other"] += s.time_other
        for lst, new in ((accept, s.accept_counts), (drafted, s.draft_counts)):
            lst.extend([0] * (len(new) - len(lst)))
            for i, v in enumerate(new):
                lst[i] += v
        outputs.append(out.sequences[0])
    totals["rates"] = [a / d if d else 0.0 for a, d in zip(accept, drafted)]
    totals["outputs"] = outputs
    return totals


def main(argv=None) -> None:
    args = parse_args(argv)
    try:  # before the target loads: a bad spec costs a second, not a load
        check_specs([m for m in args.methods.split(",") if m != "none"])
    except ValueError as e:
        raise SystemExit(f"decode_cpu: {e}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    from drafttrain.targets import load_target

    t0 = time.perf_counter()
    model, tokenizer, _ = load_target(args.target, dtype=args.dtype)
    print(f"target {args.target} ({args.dtype}) loaded in {time.perf_counter() - t0:.1f}s; "
          f"{torch.get_num_threads()} threads; max_new_tokens={args.max_new_tokens}, gamma={args.gamma}, "
          f"tree={args.tree or 'chain'}")
    prompts = [encode(tokenizer, p) for p in PROMPTS[: args.prompts]]
    speculative_generate(model, None, prompts[0], max_new_tokens=4)  # warm-up

    rows, baseline = [], None
    for method in args.methods.split(","):
        proposer = None if method == "none" else load_proposer(method, model, tokenizer=tokenizer)
        r = run(model, proposer, prompts, args)
        if baseline is None:
            baseline = r
        same = sum(a == b for a, b in zip(r["outputs"], baseline["outputs"]))
        rows.append((method, r["tokens"] / r["wall"], baseline["wall"] / r["wall"] if method != "none" else 1.0,
                     r["tokens"] / max(r["row_forwards"], 1), r["forwards"],
                     " ".join(f"{x:.2f}" for x in r["rates"][:6]) or "-",
                     f"{r['draft']:.1f}/{r['verify']:.1f}/{r['other']:.1f}", f"{same}/{len(prompts)}"))
    head = ("method", "tok/s", "speedup", "tau", "target fwd", "accept by position", "draft/verify/other s",
            "same as target")
    widths = [max(len(head[i]), *(len(_fmt(r[i])) for r in rows)) for i in range(len(head))]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(_fmt(v).ljust(w) for v, w in zip(r, widths)))


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
