"""Decoded tau and speedup against training minutes, from one run's snapshots and one eval.

A training run with `train.snapshot_minutes` (recipe=eagle_long sets 10 / 30 / 60 / 90) leaves a
drafter folder per mark under <run>/snapshots/ and its final drafter in <run>/drafter. Decode them
all in one `drafttrain eval` run (same prompts, same machine phase, paired against the same
target-only baseline), then this script matches each evaluated drafter to its training minutes
and prints a markdown table (tau, speedup vs target-only with its 95% interval, per temperature)
and a text chart (bars of tau and speedup per training minutes, for README and logs), and draws
the curve as a PNG.

    drafttrain eval proposers=adaptive:RUN/snapshots/train-10min,...,adaptive:RUN/drafter \\
        baselines=target bench=mtbench num_prompts=8 max_new_tokens=256 temperatures=0,1 output_dir=EVAL
    python bench/minutes_curve.py --run RUN --eval EVAL [--png EVAL/minutes_curve.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", required=True, help="the training run folder (snapshots/ and drafter/ inside)")
    p.add_argument("--eval", required=True, help="the `drafttrain eval` output folder (results.json)")
    p.add_argument("--png", default="", help="where to draw the curve (default: <eval>/minutes_curve.png)")
    return p.parse_args(argv)


def _minutes(folder: Path) -> tuple[float, int] | None:
    """(training minutes, step) a drafter folder was written at, from its config's metrics."""
    cfg = folder / "config.json"
    if not cfg.is_file():
        return None
    metrics = json.loads(cfg.read_text()).get("metrics", {})
    if "train_time_s" not in metrics:
        return None
    return metrics["train_time_s"] / 60.0, int(metrics.get("step", metrics.get("steps", 0)))


def _drafter_folder(method: str, run: Path) -> Path | None:
    """The drafter folder a method name of the eval points to, if it lies in `run`."""
    path = Path(method.split(":")[-1])
    try:
        path.resolve().relative_to(run.resolve())
    except ValueError:
        return None
    return path


def curve_rows(run: Path, results: dict) -> list[dict]:
    """One row per (drafter of `run`, temperature) in the eval results, by training minutes."""
    rows = []
    for r in results["runs"]:
        if r.get("batch_size", 1) != 1:
            continue
        for name, m in r["methods"].items():
            folder = _drafter_folder(name, run)
            when = _minutes(folder) if folder is not None else None
            if when is None or "speedup" not in m:
                continue
            lo, hi = m.get("speedup_ci95_vs_target") or (float("nan"), float("nan"))
            rows.append({"minutes": when[0], "step": when[1], "temperature": r["temperature"], "method": name,
                         "tau": m.get("tau", float("nan")), "speedup": m["speedup"]["vs_target"], "lo": lo, "hi": hi,
                         "accept1": (m.get("acceptance") or [float("nan")])[0]})
    return sorted(rows, key=lambda x: (x["temperature"], x["minutes"]))


def markdown(rows: list[dict]) -> str:
    temps = sorted({r["temperature"] for r in rows})
    by = {(r["minutes"], r["temperature"]): r for r in rows}
    head = "| training minutes | step | " + " | ".join(
        f"T={t:g} tau | T={t:g} accept@1 | T={t:g} speedup [95% CI]" for t in temps) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(temps))]
    for minutes in sorted({r["minutes"] for r in rows}):
        cells = []
        step = next(r["step"] for r in rows if r["minutes"] == minutes)
        for t in temps:
            r = by.get((minutes, t))
            cells += ["-"] * 3 if r is None else [f"{r['tau']:.2f}", f"{r['accept1']:.2f}",
                                                 f"{r['speedup']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]"]
        lines.append(f"| {minutes:.0f} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text_chart(rows: list[dict]) -> str:
    """The curve as text bars, per temperature: decoded tau and speedup (with its 95% interval)
    against training minutes; bars share one scale per quantity so the temperatures compare."""
    from drafttrain.eval.report import text_bars

    out = []
    for key, fmt in (("tau", "tau {:.2f}"), ("speedup", "{:.2f}x")):
        top = max(r[key] for r in rows)
        for t in sorted({r["temperature"] for r in rows}):
            rs = [r for r in rows if r["temperature"] == t]
            title = "decoded tau" if key == "tau" else "speedup vs target-only [95% CI]"
            out.append(f"T={t:g}, {title}, by training minutes")
            bars = text_bars([(f"{r['minutes']:.0f} min", r[key]) for r in rs], width=36, fmt=fmt, top=top)
            if key == "speedup":
                bars = [f"{b}  [{r['lo']:.2f}, {r['hi']:.2f}]" for b, r in zip(bars, rs)]
            out += bars + [""]
    return "\n".join(out).rstrip()


def plot(rows: list[dict], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_sp) = plt.subplots(1, 2, figsize=(10, 4))
    for t in sorted({r["temperature"] for r in rows}):
        rs = [r for r in rows if r["temperature"] == t]
        x = [r["minutes"] for r in rs]
        ax_tau.plot(x, [r["tau"] for r in rs], marker="o", label=f"T={t:g}")
        sp = [r["speedup"] for r in rs]
        err = [[s - r["lo"] for s, r in zip(sp, rs)], [r["hi"] - s for s, r in zip(sp, rs)]]
        ax_sp.errorbar(x, sp, yerr=err, marker="o", capsize=3, label=f"T={t:g}")
    ax_sp.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_tau.set(xlabel="training minutes", ylabel="decoded tau (tokens per target step)", title="acceptance length")
    ax_sp.set(xlabel="training minutes", ylabel="speedup vs target-only (95% CI)", title="wall-clock speedup")
    for ax in (ax_tau, ax_sp):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    run, ev = Path(args.run), Path(args.eval)
    results_file = ev / "results.json"
    if not results_file.is_file():
        raise SystemExit(f"minutes_curve: no results.json in {ev}; run `drafttrain eval ... output_dir={ev}` first")
    results = json.loads(results_file.read_text())
    rows = curve_rows(run, results)
    if not rows:
        raise SystemExit(f"minutes_curve: no drafter of {run} (snapshots/ or drafter/) in {results_file}; "
                         "evaluate them with proposers=adaptive:<folder>,...")
    print(markdown(rows))
    print("\n```text\n" + text_chart(rows) + "\n```")
    png = Path(args.png) if args.png else ev / "minutes_curve.png"
    bench = results.get("benchmark", {})
    plot(rows, png, f"{run.name} on {bench.get('name', 'the benchmark') if isinstance(bench, dict) else bench}")
    print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
