"""Pool several `drafttrain eval` runs of the same benchmark that differ only in their sampling seed.

Why: at T=1 one eval is one draw of every prompt's text, so its speedup interval says how much the
figure owes to which prompts were drawn, not to which samples; issue 17 asks for several seeds.
This reads each run's ``results.json`` (batch 1: one prompt per category, so the per-category
figures are per-prompt), pairs every method's (tokens, wall time) with target-only decoding's
within the same run, and reports, per method, each run's speedup, their mean, and one 95%
percentile-bootstrap interval over all (run, prompt) pairs (`eval.metrics.speedup_ci95`: tokens/s
ratios, paired calls resampled together).

Usage:
    python bench/pool_seeds.py runs/eval/s28-mtbench runs/eval/s28-mtbench-t1-seed100 \
        runs/eval/s28-mtbench-t1-seed200 --temperature 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _pairs(results: dict, temperature: float) -> dict[str, list[tuple[int, float, int, float]]]:
    """{method: [(tokens, wall, target tokens, target wall) per prompt]} of one run at `temperature`."""
    runs = [r for r in results["runs"] if float(r["temperature"]) == temperature and int(r["batch_size"]) == 1]
    if not runs:
        return {}
    methods = runs[0]["methods"]
    base = methods.get("target")
    if base is None:
        raise SystemExit("error: a run without target-only decoding cannot be pooled (add baselines=target)")
    out: dict[str, list[tuple[int, float, int, float]]] = {}
    for name, m in methods.items():
        if name == "target":
            continue
        rows = []
        for cat, c in m["per_category"].items():
            b = base["per_category"].get(cat)
            if b is None or c.get("num_prompts") != 1 or b.get("num_prompts") != 1:
                raise SystemExit("error: pooling needs one prompt per category (MT-bench num_prompts=8, batch 1)")
            rows.append((c["tokens"], c["wall_s"], b["tokens"], b["wall_s"]))
        out[name] = rows
    return out


def pool(results: list[dict], temperature: float) -> list[dict]:
    """Per method: {"method", "per_run" (speedup per run, None where it did not run), "mean", "pooled",
    "ci95"}, from the runs' parsed results.json at `temperature`."""
    from drafttrain.eval.metrics import speedup_ci95, throughput_ratio

    runs = [_pairs(r, temperature) for r in results]
    out = []
    for name in sorted({n for p in runs for n in p}):
        per_run, pooled = [], []
        for pairs in runs:
            rows = pairs.get(name)
            if rows:
                t, w, bt, bw = (sum(r[i] for r in rows) for i in range(4))
                per_run.append(throughput_ratio(t, w, bt, bw))
                pooled += rows
            else:
                per_run.append(None)
        t, w, bt, bw = ([r[i] for r in pooled] for i in range(4))
        ran = [x for x in per_run if x is not None]
        out.append({"method": name, "per_run": per_run, "mean": sum(ran) / len(ran),
                    "pooled": throughput_ratio(sum(t), sum(w), sum(bt), sum(bw)),
                    "ci95": speedup_ci95(bw, w, base_tokens=bt, tokens=t)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("evals", nargs="+", help="eval output folders (each holds results.json)")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)

    results = []
    for folder in args.evals:
        path = Path(folder) / "results.json"
        if not path.is_file():
            print(f"error: {path} not found (an eval's output_dir holds it)", file=sys.stderr)
            return 2
        results.append(json.loads(path.read_text()))
    rows = pool(results, args.temperature)
    labels = [f"seed {r['config'].get('seed')}" for r in results]
    print(f"T={args.temperature:g}, {len(results)} runs: speedup vs target-only decoding in the same run")
    print("| method | " + " | ".join(labels) + " | mean | pooled [95% CI] |")
    print("|---|" + "---|" * (len(labels) + 2))
    for r in rows:
        cells = " | ".join("–" if x is None else f"{x:.2f}" for x in r["per_run"])
        lo, hi = r["ci95"]
        print(f"| {r['method']} | {cells} | {r['mean']:.2f} | {r['pooled']:.2f} [{lo:.2f}, {hi:.2f}] |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
