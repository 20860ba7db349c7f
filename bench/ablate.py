"""The EAGLE-3 ablation: one training run per lever at an equal step budget, one table.

    python bench/ablate.py [--steps 500] [--rows ce,tv,...] [--out runs/ablate] [key=value ...]

Every row trains `recipe=eagle` (plus the key=value arguments given here, e.g.
data.num_samples=900) for the same number of optimizer steps on the same records, with the
target's features read from one shared offline cache (computed by the first row that needs it),
and is scored on the same held-out records: top-1 agreement per unroll step, the chance that a
sampled draft is accepted at T=1 (sum min(p, q)), the teacher-forced greedy tau averaged over
every position and walked root to root as decoding visits them (tau_walk: what decoding reaches). Throughput
rows (online features, fewer unroll steps) also report tokens/s. A row whose run folder already
holds a summary.json is read, not rerun, so a killed ablation resumes; two ablate processes on
the same --out share the rows (one waits for a row the other is training). Prints a markdown table
and writes it to <out>/ablation.md. A benchmark, not a test: time it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# name -> (what it changes against today's recipe, overrides). Offline features (computed once)
# unless a row says otherwise. Each row moves one lever away from recipes/eagle.yaml, so the
# base row is whatever that file says today (TV, every position since session 7).
ROWS: dict[str, tuple[str, list[str]]] = {
    "recipe": ("today's recipe (recipes/eagle.yaml)", []),
    "online": ("target forward every step (throughput only; same updates)", ["features.mode=online"]),
    "ce": ("soft cross-entropy instead of the recipe's objective", ["drafter.objective=ce"]),
    "ce+tv": ("cross-entropy + total variation", ["drafter.objective=ce+tv"]),
    "topk": ("+ HASS top-10 distillation term", ["drafter.topk=10"]),
    "griffin": ("GRIFFIN: train step k only where steps < k agreed", ["drafter.alignable_only=true"]),
    "assistant": ("assistant tokens only instead of every token", ["drafter.positions=assistant"]),
    "ttt3": ("3 unroll steps instead of 7", ["drafter.ttt_steps=3"]),
    "rawfeat": ("fc over the raw target features (no per-dimension scale; the recipe before session 13)",
                ["drafter.feature_scale=false"]),
}
METRICS = ("eval/acc_0", "eval/acc_1", "eval/acc_2", "eval/accept_t1_0", "eval/accept_t1_1", "eval/tau_sim",
           "eval/tau_walk")


def run_row(name: str, overrides: list[str], common: list[str], out: Path, steps: int) -> dict:
    run_dir = out / name
    summary = run_dir / "summary.json"
    owner = out / f"{name}.pid"  # another ablate process training this row: wait for it
    while not summary.exists() and owner.exists() and _alive(int(owner.read_text() or 0)):
        time.sleep(10)
    if summary.exists():
        return json.loads(summary.read_text())
    owner.write_text(str(os.getpid()))
    mode = [] if any(o.startswith("features.mode=") for o in overrides) else ["features.mode=offline"]
    cmd = [sys.executable, "-m", "drafttrain.cli", "train", "recipe=eagle", f"output_dir={run_dir}",
           f"train.max_steps={steps}", "train.max_minutes=0", "train.save_every=0", "train.decode_eval_final=false",
           f"features.cache_dir={out / 'features'}", *mode, *common, *overrides]
    print(f"ablate: {name}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0 or not summary.exists():
        raise SystemExit(f"ablate: row {name} failed (exit {rc}); see {out / f'{name}.log'}")
    print(f"ablate: {name} done in {time.time() - t0:.0f} s", flush=True)
    return json.loads(summary.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return pid > 0


def table(results: dict[str, dict], steps: int) -> str:
    head = ["row", "what changes", "tok/s", "acc_0", "acc_1", "acc_2", "T=1 acc_0", "T=1 acc_1", "tau_sim", "tau_walk"]
    lines = [f"Equal budget: {steps} optimizer steps each, same records, same held-out set.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in results.items():
        vals = [f"{s.get(k, float('nan')):.3f}" if name != "online" else "same as recipe" for k in METRICS]
        lines.append(f"| {name} | {ROWS[name][0]} | {s.get('train_tokens_per_s', 0):.0f} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="optimizer steps per row (equal budget)")
    ap.add_argument("--online-steps", type=int, default=60, help="steps of the online row (it only measures tokens/s: "
                    "online and offline features give the same updates)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    ap.add_argument("--out", default="runs/ablate", help="folder of the row runs and the table")
    args, common = ap.parse_known_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        raise SystemExit(f"ablate: unknown rows {unknown}; choose from {', '.join(ROWS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.rows.split(","):
        steps = args.online_steps if name == "online" else args.steps
        results[name] = run_row(name, ROWS[name][1], common, out, steps)
        text = table(results, args.steps)
        (out / "ablation.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
