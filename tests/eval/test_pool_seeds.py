"""bench/pool_seeds.py: several evals' T=1 speedups pooled over (seed, prompt) pairs."""

from __future__ import annotations

import json

import pytest


def _results(seed: int, target_walls: list[float], drafter_walls: list[float] | None) -> dict:
    def method(walls):
        return {"per_category": {f"c{i}": {"tokens": 100, "wall_s": w, "num_prompts": 1} for i, w in enumerate(walls)}}

    methods = {"target": method(target_walls)}
    if drafter_walls is not None:
        methods["drafter"] = method(drafter_walls)
    return {"config": {"seed": seed}, "runs": [{"temperature": 1.0, "batch_size": 1, "methods": methods}]}


def test_each_runs_speedup_their_mean_and_one_pooled_interval(tmp_path, capsys, bench_script):
    ps = bench_script("pool_seeds")
    a = _results(0, [4.0, 4.0], [2.0, 2.0])  # 2.0x
    b = _results(100, [4.0, 4.0], [4.0, 4.0])  # 1.0x
    c = _results(200, [4.0, 4.0], None)  # the drafter did not run
    rows = ps.pool([a, b, c], 1.0)
    assert [r["method"] for r in rows] == ["drafter"]
    r = rows[0]
    assert r["per_run"] == [2.0, 1.0, None]
    assert r["mean"] == pytest.approx(1.5)
    assert r["pooled"] == pytest.approx((400 / 12) / (400 / 16))  # all tokens / all walls, over the target's
    lo, hi = r["ci95"]
    assert 1.0 <= lo < r["pooled"] < hi <= 2.0
    for i, res in enumerate((a, b)):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "results.json").write_text(json.dumps(res))
    assert ps.main([str(tmp_path / "0"), str(tmp_path / "1")]) == 0
    out = capsys.readouterr().out
    assert "| drafter | 2.00 | 1.00 | 1.50 |" in out


def test_a_missing_results_file_is_one_clear_error(tmp_path, capsys, bench_script):
    assert bench_script("pool_seeds").main([str(tmp_path)]) == 2
    assert "results.json not found" in capsys.readouterr().err
