"""Does a trained EAGLE drafter copy? Its first-step agreement with the target where the context
repeats itself (a 2-gram lookup would guess right) and where it does not.

    python bench/copy_probe.py DRAFTER_DIR recipe=eagle [key=value ...]

Takes the training keys of the run that made the drafter (they fix the records and the held-out
split), builds the run as training does, loads DRAFTER_DIR's weights and scores every held-out
position: the teacher's argmax for the token after next, the drafter's step-0 argmax, and the
guess of the most recent earlier occurrence of the last two tokens. Greedy answers of a small base
model loop, n-gram lookup lives on those loops, and a drafter that agrees with the target there
as rarely as elsewhere has not learned to copy (an induction circuit). A diagnostic, not a test.
"""

from __future__ import annotations

import sys

import torch


def ngram_guess(ids: list[int], n: int = 2) -> list[int]:
    """guess[t] = the token that followed the latest earlier occurrence of ids[t-n+1 .. t] (-1: none)."""
    last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence with a known follower
    out = [-1] * len(ids)
    for t in range(len(ids)):
        if t >= n:  # the occurrence ending at t-1 has its follower ids[t] now
            last[tuple(ids[t - n : t])] = t - 1
        if t + 1 >= n:
            j = last.get(tuple(ids[t - n + 1 : t + 1]))
            out[t] = ids[j + 1] if j is not None else -1
    return out


@torch.no_grad()
def probe(run, raw) -> dict:
    from drafttrain.features import teacher_draft_logits

    d2t = raw.d2t
    counts = {"copy": [0, 0], "other": [0, 0]}  # [agree, total]
    for batch in run.held_loader:
        feats = run.method.batch_features(run.cfg, run.target, batch, run.spec)
        ids, attn = batch["input_ids"], batch["attention_mask"].bool()
        B, T = ids.shape
        ids_ext = torch.cat([ids, ids.new_zeros(B, 2)], dim=1)
        with run.accelerator.autocast():
            logits, _ = raw(ids_ext, feats["aux"].to(raw.fc.weight.dtype), ttt_steps=1, valid=attn)[0]
        t_top = teacher_draft_logits(run.target, feats["final"], raw.draft_ids).argmax(-1)  # [B, T] draft ids
        d_top = logits.argmax(-1)
        for b in range(B):
            n = int(attn[b].sum())
            row = ids[b, :n].tolist()
            guess = ngram_guess(row)
            for t in range(n - 2):
                teach = int(t_top[b, t + 1])  # teacher at t+1 predicts x_{t+2}
                teach_id = teach + int(d2t[teach])
                kind = "copy" if guess[t + 1] == teach_id else "other"
                counts[kind][0] += int(d_top[b, t]) == teach
                counts[kind][1] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "=" in argv[0]:
        print(__doc__)
        return 2
    from safetensors.torch import load_file

    from drafttrain.config import parse_args
    from drafttrain.schema import TrainConfig
    from drafttrain.trainer import setup

    folder, keys = argv[0], argv[1:]
    cfg = parse_args([*keys, "tracking=none", "train.decode_eval_final=false"], TrainConfig)
    run = setup(cfg)
    raw = run.accelerator.unwrap_model(run.drafter)
    _, unexpected = raw.load_state_dict(load_file(f"{folder}/model.safetensors"), strict=False)
    if unexpected:
        raise SystemExit(f"copy_probe: {folder} does not match the run's drafter (unexpected {unexpected[:3]})")
    if getattr(raw, "feature_scaled", False):  # a saved folder has the feature scale folded into fc
        raw.set_feature_scale(torch.ones_like(raw.aux_scale))
    raw.eval()
    c = probe(run, raw)
    total = c["copy"][1] + c["other"][1]
    print(f"\n{folder}: {total} held-out positions")
    for kind, (agree, n) in c.items():
        print(f"  {kind:5s} ({'2-gram lookup guesses the target' if kind == 'copy' else 'it does not'}): "
              f"{n} positions ({n / max(total, 1):.1%}), drafter step-0 agreement {agree / max(n, 1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
