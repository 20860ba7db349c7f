"""Where decoded acceptance and held-out agreement part: the drafter teacher-forced on decoded text.

Held-out agreement (the training summary's acc_k) is measured on the target's answers to
training-like prompts; decoded acceptance (eval's accept@k) on benchmark prompts. This script
scores the same drafter teacher-forced on the benchmark's own greedy trajectories (the target
rows of an eval's tokens.jsonl, T = 0), so the two can be compared on one text:

    teacher-forced acc_0 on the decoded text ~ decoded accept@1  -> the gap is the text, not the decoder
    teacher-forced acc_0 >> decoded accept@1                      -> the decoder feeds the drafter
                                                                     differently from training

It also prints how many of the target's tokens fall outside the draft vocabulary (a draft can
never match those) and the teacher-forced chain tau, next to the same figures on held-out records.

`--temperature 1` scores the eval's sampled target rows instead and adds what sampled drafting
meets at the first step: the target's probability mass inside the draft vocabulary (full 262k
softmax; a draft sampled from the reduced vocabulary is accepted with probability at most this),
and sum over the draft vocabulary of min(p, q) with p the FULL softmax, against the training
summary's `held-out T=1` figure, whose p is renormalised over the draft vocabulary (session 27:
that figure read 0.60 while decoding accepted 0.44 at position 1).

    python bench/acceptance_gap.py runs/eagle/drafter runs/eval/s15-mtbench/tokens.jsonl
    python bench/acceptance_gap.py runs/eagle/drafter runs/eval/s27-mtbench-final/tokens.jsonl --temperature 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _score(method, drafter, target, seqs: list[tuple[list[int], list[int]]], spec, steps: int) -> dict:
    """Teacher-forced metrics over [(ids, loss mask)] with the method's eval loss."""
    from drafttrain.losses import eagle3_loss, simulated_tau

    correct = [0] * steps
    count = [0] * steps
    run_sum = run_n = 0
    oov = tot = 0
    t2d = drafter.t2d
    strict = {"hit": [0] * steps, "n": [0] * steps, "run": 0, "roots": 0, "walk_cycles": 0, "walk_tokens": 0,
              "walk_accept": [0] * steps, "mass": 0.0, "accept_full": 0.0, "accept_renorm": 0.0, "mass_n": 0}
    for ids, scored in seqs:
        x = torch.tensor([ids])
        attn = torch.ones_like(x)
        mask = torch.tensor([scored])
        feats = method.batch_features(None, target, {"input_ids": x, "attention_mask": attn}, spec)
        _, m = eagle3_loss(drafter, target, {"input_ids": x, "attention_mask": attn, "loss_mask": mask}, feats,
                           steps=steps, step_weight=1.0, mask_out_of_vocab=False, objective="tv")
        for k in range(steps):
            correct[k] += m["correct"][k]
            count[k] += m["count"][k]
        run_sum += m["run_len_sum"]
        run_n += m["run_len_n"]
        _strict(drafter, x, feats, mask, steps, strict)
        _mass(drafter, target, x, feats, mask, strict)
        out = x[0][mask[0].bool()]
        oov += int((~t2d[out]).sum())
        tot += len(out)
    return {"acc": [c / max(n, 1) for c, n in zip(correct, count)], "tau_sim": simulated_tau(run_sum, run_n),
            "strict": [h / max(n, 1) for h, n in zip(strict["hit"], strict["n"])],
            "strict_tau": 1 + strict["run"] / max(strict["roots"], 1),
            "walk_tau": strict["walk_tokens"] / max(strict["walk_cycles"], 1),
            "walk_accept": [a / max(strict["walk_cycles"], 1) for a in strict["walk_accept"]],
            "out_of_vocab": oov / max(tot, 1), "tokens": tot,
            "mass_in_vocab": strict["mass"] / max(strict["mass_n"], 1),
            "accept_t1_full": strict["accept_full"] / max(strict["mass_n"], 1),
            "accept_t1_renorm": strict["accept_renorm"] / max(strict["mass_n"], 1)}


def _mass(drafter, target, x, feats, mask, acc: dict) -> None:
    """At T=1, first draft step: per scored position, the target's full-vocabulary mass inside the
    draft vocabulary, and sum min(p, q) with p the full softmax and with p renormalised over it."""
    from drafttrain.features import _softcap, lm_head_weight, teacher_draft_logits

    T = x.shape[1]
    ids_ext = torch.cat([x, x.new_zeros(1, 2)], dim=1)
    logits0 = drafter(ids_ext, feats["aux"].to(drafter.fc.weight.dtype), ttt_steps=1,
                      valid=torch.ones_like(x).bool())[0][0][0, :T].float()  # base t predicts x_{t+2}
    q = torch.softmax(logits0, -1)
    final = feats["final"][0]  # [T, H]; the teacher of base t is the target at t + 1
    ok = torch.cat([mask[0, 2:].bool(), torch.zeros(2, dtype=torch.bool)])[:T]
    for t in ok.nonzero()[:, 0].tolist():
        full = (final[t + 1: t + 2].to(lm_head_weight(target).dtype) @ lm_head_weight(target).t()).float()[0]
        if cap := _softcap(target):
            full = cap * torch.tanh(full / cap)
        p = torch.softmax(full, -1)
        pd = p[drafter.draft_ids]
        renorm = torch.softmax(teacher_draft_logits(target, final[None, t + 1: t + 2], drafter.draft_ids)[0, 0], -1)
        acc["mass"] += float(pd.sum())
        acc["accept_full"] += float(torch.minimum(pd, q[t]).sum())
        acc["accept_renorm"] += float(torch.minimum(renorm, q[t]).sum())
        acc["mass_n"] += 1


def _strict(drafter, x, feats, mask, steps: int, acc: dict) -> None:
    """What decoding sees: the drafter's step-k argmax, mapped to a target id, equals the token
    the target actually wrote (out-of-vocabulary tokens count as misses)."""
    from drafttrain.losses import walk_chain

    T = x.shape[1]
    ids_ext = torch.cat([x, x.new_zeros(1, steps + 1)], dim=1)
    outs = drafter(ids_ext, feats["aux"].to(drafter.fc.weight.dtype), ttt_steps=steps, valid=torch.ones_like(x).bool())
    alive = torch.ones(T, dtype=torch.bool)
    run = torch.zeros(T, dtype=torch.long)
    scored = None
    hits = []
    for k, (logits, _) in enumerate(outs):
        guess = logits[0, :T].argmax(-1)
        guess = guess + drafter.d2t[guess]
        nxt = torch.cat([x[0, 2 + k:], x.new_full((2 + k,), -1)])[:T]  # token t + 2 + k
        ok = torch.cat([mask[0, 2 + k:].bool(), torch.zeros(2 + k, dtype=torch.bool)])[:T]
        scored = ok if scored is None else scored
        hit = (guess == nxt) & ok
        hits.append(hit)
        acc["hit"][k] += int(hit.sum())
        acc["n"][k] += int(ok.sum())
        alive = alive & hit
        run += alive.long()
    acc["run"] += int(run[scored].sum())
    acc["roots"] += int(scored.sum())
    tokens, cycles = walk_chain(torch.stack(hits)[:, None], scored[None])  # decoding's roots, not every base
    acc["walk_tokens"] += tokens
    acc["walk_cycles"] += cycles
    H = torch.stack(hits)
    run_at = torch.cat([~H, H.new_ones(1, T)]).long().argmax(0)
    t, end = (int(scored.nonzero()[0]), int(scored.nonzero()[-1])) if scored.any() else (T, -1)
    while t <= end:  # accept@k over the walked roots
        for k in range(int(run_at[t])):
            acc["walk_accept"][k] += 1
        t += int(run_at[t]) + 1

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("drafter", help="an EAGLE-3 drafter folder")
    ap.add_argument("tokens", help="an eval's tokens.jsonl (its target rows at --temperature are scored)")
    ap.add_argument("--temperature", type=float, default=0.0, choices=[0.0, 1.0], help="which target rows to score")
    ap.add_argument("--bench", default="mtbench", help="the benchmark the eval ran (to rebuild its prompts)")
    ap.add_argument("--target", default="gemma-3-270m")
    ap.add_argument("--steps", type=int, default=4, help="unroll steps scored")
    ap.add_argument("--heldout", type=int, default=16, help="held-out records scored alongside (0 = none)")
    ap.add_argument("--recipe", default="eagle", help="the recipe whose held-out records are scored")
    args = ap.parse_args(argv)

    from drafttrain.data import DataConfig
    from drafttrain.eval.benchmarks import load_benchmark
    from drafttrain.methods import get_method
    from drafttrain.models.eagle import load_drafter
    from drafttrain.targets import load_target

    torch.manual_seed(0)
    target, tok, _ = load_target(args.target, dtype="auto")
    drafter = load_drafter(args.drafter, target).eval()
    method = get_method("eagle3")
    spec = method.feature_spec(None, drafter, 0)
    data = DataConfig()
    prompts = load_benchmark(args.bench, tok, data)
    by_id = {p.id: p for p in prompts}
    rows = [json.loads(line) for line in open(args.tokens)]
    seqs = [(list(by_id[r["id"]].ids) + r["tokens"], [0] * len(by_id[r["id"]].ids) + [1] * len(r["tokens"]))
            for r in rows if r["method"] == "target" and r["temperature"] == args.temperature and r["id"] in by_id]
    if not seqs:
        print(f"error: {args.tokens} holds no target rows at temperature {args.temperature:g} for bench={args.bench}", file=sys.stderr)
        return 2
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        res = {"decoded": _score(method, drafter, target, seqs, spec, args.steps)}
        if args.heldout:
            from drafttrain.answers import training_data
            from drafttrain.config import parse_args
            from drafttrain.data import build_datasets
            from drafttrain.schema import TrainConfig

            cfg = parse_args([f"recipe={args.recipe}"], TrainConfig)
            tdata = training_data(cfg.data, cfg.answers, cfg.target, target, tok, progress=False)
            held_ds = build_datasets(tdata, tok)[1]
            held = [(list(r["input_ids"]), list(r["loss_mask"])) for r in held_ds.select(range(min(args.heldout, len(held_ds))))]
            res["heldout"] = _score(method, drafter, target, held, spec, args.steps)
    for name, r in res.items():
        accs = " ".join(f"{a:.3f}" for a in r["acc"])
        strict = " ".join(f"{a:.3f}" for a in r["strict"])
        print(f"{name:8s} {r['tokens']:6d} tokens  acc_0.. {accs}  tau_sim {r['tau_sim']:.3f}  "
              f"out of draft vocab {r['out_of_vocab']:.3f}")
        print(f"{'':8s} strict (mapped argmax == the target's token): {strict}  tau {r['strict_tau']:.3f}")
        walk = " ".join(f"{a:.3f}" for a in r["walk_accept"])
        print(f"{'':8s} walked like a gamma-{args.steps} chain: accept@1.. {walk}  tau {r['walk_tau']:.3f}")
        print(f"{'':8s} T=1, step 0: target mass inside the draft vocab {r['mass_in_vocab']:.3f}; sum min(p, q) "
              f"{r['accept_t1_full']:.3f} with the full p, {r['accept_t1_renorm']:.3f} with p renormalised over it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
