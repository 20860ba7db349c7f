"""bench/minutes_curve.py: the drafters of one run's snapshots matched to their training minutes."""

from __future__ import annotations

import json
from pathlib import Path


def _drafter(folder: Path, metrics: dict) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"metrics": metrics}))
    return f"adaptive:{folder}"


def _method(tau: float, speedup: float) -> dict:
    return {"tau": tau, "speedup": {"vs_target": speedup}, "speedup_ci95_vs_target": [speedup - 0.1, speedup + 0.1],
            "acceptance": [tau - 1.0]}


def test_rows_follow_training_minutes_and_skip_what_the_run_did_not_train(tmp_path, bench_script):
    mc = bench_script("minutes_curve")
    run = tmp_path / "run"
    late = _drafter(run / "snapshots" / "train-30min", {"step": 900, "train_time_s": 1801.0})
    early = _drafter(run / "snapshots" / "train-10min", {"step": 300, "train_time_s": 600.5})
    final = _drafter(run / "drafter", {"steps": 2400, "train_time_s": 4800.0})
    other = _drafter(tmp_path / "elsewhere" / "drafter", {"steps": 5, "train_time_s": 60.0})
    results = {"benchmark": {"name": "mtbench"}, "runs": [
        {"temperature": t, "batch_size": 1, "methods": {
            "target": {"speedup": {"vs_target": 1.0}},
            late: _method(1.5 + t, 1.2), final: _method(1.7 + t, 1.3), early: _method(1.3 + t, 1.1),
            other: _method(9.0, 9.0), "ngram": _method(4.0, 3.0)}} for t in (0.0, 1.0)]}
    rows = mc.curve_rows(run, results)
    assert [(r["temperature"], round(r["minutes"]), r["step"]) for r in rows] == [
        (0.0, 10, 300), (0.0, 30, 900), (0.0, 80, 2400), (1.0, 10, 300), (1.0, 30, 900), (1.0, 80, 2400)]
    table = mc.markdown(rows).splitlines()
    assert len(table) == 2 + 3 and table[2].startswith("| 10 | 300 | 1.30 | 0.30 | 1.10 [1.00, 1.20] | 2.30")
    png = tmp_path / "curve.png"
    mc.plot(rows, png, "run")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_chart_draws_longer_bars_for_later_drafters_and_keeps_the_intervals(tmp_path, bench_script):
    mc = bench_script("minutes_curve")
    run = tmp_path / "run"
    early, late = (_drafter(run / "snapshots" / f"train-{m}min", {"step": m, "train_time_s": 60.0 * m}) for m in (10, 60))
    results = {"runs": [{"temperature": 1.0, "batch_size": 1, "methods": {
        early: _method(1.5, 1.1), late: _method(2.0, 1.4)}}]}
    chart = mc.text_chart(mc.curve_rows(run, results)).splitlines()
    tau = [line for line in chart if line.startswith(("10 min", "60 min")) and "tau" in line]
    speed = [line for line in chart if line.startswith(("10 min", "60 min")) and "x  [" in line]
    assert len(tau) == 2 and len(speed) == 2
    assert tau[0].count("█") < tau[1].count("█") and speed[0].count("█") < speed[1].count("█")
    assert speed[0].endswith("1.10x  [1.00, 1.20]") and speed[1].endswith("1.40x  [1.30, 1.50]")
