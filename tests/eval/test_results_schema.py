"""results.json through the typed results (eval/results.py): a real run's report reads back into the
same dataclasses and writes back byte for byte, files written by earlier code (schema 1 and 2)
still read and render, and the version is checked.

data/results_v1.json was written by the code of commit a0178b4^ (schema 1: n-gram, target-only,
T = 0 and 1, a gamma sweep on a 2-layer tiny target); data/results_v2.json by the code just before
the typed results (schema 2: n-gram and adaptive n-gram, target and hf baselines, oracle bound,
batch sweep with fixed gammas 1, 2 at batch 2). Both are re-serialised compactly, with the temporary
folder renamed /tmp/tiny; nothing else was touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafttrain.eval.report import markdown
from drafttrain.eval.results import (
    SCHEMA_VERSION,
    FixedLength,
    GreedyCheck,
    MethodSummary,
    OracleBound,
    Results,
    SweepRow,
)

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def written(model_dirs, tmp_path_factory):
    """A real tiny `run_eval`: n-gram and target-only, T = 0 and 1, a two-point gamma sweep."""
    from drafttrain.config import parse_args
    from drafttrain.eval import EvalConfig, run_eval

    root = tmp_path_factory.mktemp("schema")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"abc abc abc {i} abc", "category": "ab"[i % 2]})
                                 for i in range(2)))
    cfg = parse_args([f"target={model_dirs['target']}", "dtype=float32", "proposers=ngram", "baselines=target",
                      f"bench={prompts}", "max_new_tokens=6", "temperatures=0,1", "sweeps=gamma", "sweep_gammas=1,2",
                      f"output_dir={root / 'out'}", "progress=false", "warmup=false"], EvalConfig)
    results = run_eval(cfg)
    return results, (root / "out" / "results.json").read_text()


def test_a_real_report_reads_back_into_the_same_dataclasses_and_bytes(written):
    results, text = written
    raw = json.loads(text)
    assert raw["schema_version"] == SCHEMA_VERSION == 4
    assert "engine_baselines" not in raw  # only with vLLM baselines
    back = Results.from_dict(raw)
    assert back == results  # every field, nested records included
    assert json.dumps(back.to_dict(), indent=1) == text  # same keys, values and order
    run0, run1 = back.runs
    assert isinstance(run0.methods["ngram"], MethodSummary) and isinstance(run0.greedy_check["ngram"], GreedyCheck)
    assert raw["runs"][1]["greedy_check"] is None and run1.greedy_check is None  # written as null, not left out
    assert "theory" not in raw["runs"][0]["methods"]["target"] and back.runs[0].methods["target"].theory is None
    assert all(isinstance(r, SweepRow) and r.gamma in (1, 2) and r.kind is None for r in back.sweeps["gamma"])
    assert results["runs"][0]["methods"]["ngram"]["tau"] == raw["runs"][0]["methods"]["ngram"]["tau"]  # dict view


def test_a_schema_1_report_from_the_earlier_code_still_reads_and_renders():
    text = (DATA / "results_v1.json").read_text()
    raw = json.loads(text)
    res = Results.from_dict(raw)
    assert res.schema_version == 1 and [r.temperature for r in res.runs] == [0.0, 1.0]
    ngram = res.runs[0].methods["ngram"]
    assert ngram.tau == raw["runs"][0]["methods"]["ngram"]["tau"] and ngram.oracle is None
    assert ngram.chosen_lengths is None and res.runs[0].greedy_check["ngram"].all_match
    assert [r.gamma for r in res.sweeps["gamma"]] == [1, 2, 1, 2]
    assert json.dumps(res.to_dict()) + "\n" == text  # nothing added, nothing lost
    md = markdown(res)
    assert "| ngram |" in md and "## sweep: gamma" in md and "oracle bound" not in md


def test_a_schema_2_report_from_the_code_before_the_dataclasses_reads_and_renders():
    text = (DATA / "results_v2.json").read_text()
    res = Results.from_dict(json.loads(text))
    assert json.dumps(res.to_dict()) + "\n" == text
    kinds = {r.kind for r in res.sweeps["batch_size"]}
    assert kinds == {"target", "fixed", "adaptive", "best_fixed", "oracle"}
    oracle = res.runs[0].methods["adaptive:ngram"].oracle
    assert isinstance(oracle, OracleBound) and oracle.applicable and isinstance(oracle.fixed["ngram"], FixedLength)
    assert oracle.tau_oracle >= oracle.tau_achieved and oracle.speedup_model.target is None
    best = next(r for r in res.sweeps["batch_size"] if r.kind == "best_fixed")
    assert best.method == "ngram@best" and best.gamma in (1, 2) and best.wall_s is not None
    md = markdown(res)
    assert "oracle bound" in md and "best fixed in hindsight" in md and "| adaptive:ngram |" in md


def test_versions_and_keys_the_reader_does_not_know_are_refused():
    raw = json.loads((DATA / "results_v1.json").read_text())
    with pytest.raises(ValueError, match="schema_version 5"):
        Results.from_dict({**raw, "schema_version": 5})
    raw["runs"][0]["methods"]["ngram"]["tau_typo"] = 1.0
    with pytest.raises(ValueError, match="'tau_typo' in MethodSummary"):
        Results.from_dict(raw)


def test_optional_fields_stay_out_only_while_none():
    na = OracleBound(applicable=False, reason="sampled")
    assert na.to_dict() == {"applicable": False, "reason": "sampled"}
    row = SweepRow(method="ngram", gamma=3, tokens_per_s=10.0, wall_s=1.0, speedup_vs_target=1.5, temperature=0.0)
    assert list(row.to_dict()) == ["temperature", "method", "gamma", "tokens_per_s", "wall_s", "speedup_vs_target"]
    assert "gamma" in row and "tau" not in row and row["speedup_vs_target"] == 1.5
