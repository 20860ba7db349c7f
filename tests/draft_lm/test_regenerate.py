"""`drafttrain regenerate` on a tiny target (Llama, hidden 64, 4 layers, vocab 263): a JSONL in
OpenAI `messages` form that `data.path` accepts, resumable after a kill (same file, no
duplicates); and on-policy batches built from the student's own samples."""

from __future__ import annotations

import json

import torch

from drafttrain.cli import main
from drafttrain.config import parse_args
from drafttrain.regenerate import RegenerateConfig, regenerate


def regen_cfg(dl_root, out, *extra):
    return parse_args([f"target={dl_root / 'target'}", f"data.path={dl_root / 'chat.json'}", f"out={out}",
                       "dtype=float32", "num_prompts=10", "batch_size=4", "max_new_tokens=12", *extra],
                      RegenerateConfig)


def test_regenerate_writes_resumable_jsonl_that_trains(dl_root, tmp_path):
    from drafttrain.data import DataConfig, build_datasets
    from drafttrain.targets import load_tokenizer

    full = tmp_path / "full.jsonl"
    res = regenerate(regen_cfg(dl_root, full), progress=False)
    lines = full.read_text().splitlines()
    assert res["written"] == 10 and len(lines) == 10
    recs = [json.loads(ln) for ln in lines]
    assert len({r["id"] for r in recs}) == 10
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in recs)

    # a kill mid-write: three complete lines and half of the fourth
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    res = regenerate(regen_cfg(dl_root, cut), progress=False)
    assert res == {"written": 7, "skipped": 3, "out": str(cut)}
    assert cut.read_text() == full.read_text()  # same responses, nothing twice
    assert regenerate(regen_cfg(dl_root, cut), progress=False)["written"] == 0

    tok = load_tokenizer(str(dl_root / "target"))
    train, held, report = build_datasets(DataConfig(path=str(full), heldout=2, cache_dir=str(tmp_path / "c")), tok)
    assert report.skipped.get("unknown_format", 0) == 0 and len(train) + len(held) >= 8
    assert all(sum(r["loss_mask"]) > 0 for r in train)


def test_prompts_longer_than_max_len_are_skipped(dl_root, tmp_path):
    """Their answers would be truncated away in training, and one of them pads the whole batch."""
    from drafttrain.regenerate import prompts_of
    from drafttrain.targets import load_tokenizer

    tok = load_tokenizer(str(dl_root / "target"))
    every = prompts_of(regen_cfg(dl_root, tmp_path / "x.jsonl", "num_prompts=0"), tok)
    cut = max(len(ids) for _, _, ids in every)  # "Question 10: ..." and up are one token longer
    kept = prompts_of(regen_cfg(dl_root, tmp_path / "x.jsonl", "num_prompts=0", f"data.max_len={cut}"), tok)
    assert 0 < len(kept) < len(every)
    assert all(len(ids) < cut for _, _, ids in kept)


def test_regenerate_help_and_missing_out(dl_root, capsys):
    assert main(["regenerate", "--help"]) == 0
    assert "resumable" in capsys.readouterr().out.lower()
    assert main(["regenerate", f"target={dl_root / 'target'}"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("drafttrain: error:")]
    assert len(err) == 1 and "out=" in err[0]


def test_on_policy_batch_replaces_responses_with_student_samples(dl_root):
    from transformers import AutoModelForCausalLM

    from drafttrain.methods.draft_lm import on_policy_batch

    student = AutoModelForCausalLM.from_pretrained(dl_root / "target", dtype=torch.float32)
    ids = torch.tensor([[1, 10, 11, 12, 20, 21, 22, 0], [1, 13, 14, 30, 31, 32, 33, 34]])
    attn = torch.tensor([[1] * 7 + [0], [1] * 8])
    lmask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1]])
    out = on_policy_batch(student, {"input_ids": ids, "attention_mask": attn, "loss_mask": lmask},
                          max_new_tokens=6, max_len=64, temperature=1.0, seed=3)
    for b, plen in ((0, 4), (1, 3)):
        n = int(out["attention_mask"][b].sum())
        assert out["input_ids"][b, :plen].tolist() == ids[b, :plen].tolist()  # the prompt stays
        assert out["loss_mask"][b, :plen].sum() == 0 and out["loss_mask"][b, plen:n].all()
        assert 1 <= n - plen <= 6
    again = on_policy_batch(student, {"input_ids": ids, "attention_mask": attn, "loss_mask": lmask},
                            max_new_tokens=6, max_len=64, temperature=1.0, seed=3)
    assert torch.equal(out["input_ids"], again["input_ids"])  # seeded: a resumed run samples the same


def test_greedy_answers_are_the_targets_own_and_the_mix_follows_greedy_share(dl_root, tmp_path):
    """Answers come from drafttrain's speculative decoder (n-gram drafts): at T=0 they equal the
    target's own greedy continuation (lossless); greedy_share picks which records are greedy, by
    a hash of their id (so a resumed run agrees)."""
    from drafttrain.eos import eos_ids
    from drafttrain.targets import load_target

    out = tmp_path / "mix.jsonl"
    regenerate(regen_cfg(dl_root, out, "num_prompts=16", "greedy_share=0.5", "proposer=ngram",
                                 "answer_dtype=target"), progress=False)  # float32: greedy is exact
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    temps = [r["temperature"] for r in recs]
    assert 3 <= temps.count(0.0) <= 13 and set(temps) == {0.0, 1.0}
    target, tok, _ = load_target(str(dl_root / "target"), dtype="float32")
    from drafttrain.chat import render_prompt

    for r in [r for r in recs if r["temperature"] == 0.0][:3]:
        ids = torch.tensor([render_prompt(tok, r["messages"][:-1], "auto", "")])
        want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        eos = eos_ids(target, tok)
        cut = next((i for i, t in enumerate(want) if t in eos), len(want))  # answers stop at EOS
        assert r["messages"][-1]["content"] == tok.decode(want[:cut], skip_special_tokens=True)


def test_benchmark_prompts_never_enter_regenerated_data(dl_root, tmp_path):
    """A training file holding an MT-bench question (verbatim, or inside a longer turn) and a
    HumanEval stub: neither is answered."""
    from drafttrain.eval.benchmarks import humaneval_problems, mtbench_questions
    from drafttrain.regenerate import prompts_of
    from drafttrain.targets import load_tokenizer

    mt = mtbench_questions()[0][2][0]["content"]
    he = humaneval_problems()[0][2][0]["content"]
    convs = json.loads((dl_root / "chat.json").read_text())[:4] + [
        {"conversations": [{"from": "human", "value": mt}, {"from": "gpt", "value": "ok"}]},
        {"conversations": [{"from": "human", "value": "Please help: " + he.upper()}, {"from": "gpt", "value": "ok"}]},
    ]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(convs))
    cfg = parse_args([f"target={dl_root / 'target'}", f"data.path={path}", f"out={tmp_path / 'o.jsonl'}",
                      "data.max_len=100000", "num_prompts=0"], RegenerateConfig)
    tok = load_tokenizer(str(dl_root / "target"))
    assert len(prompts_of(cfg, tok)) == 4
    cfg.skip_benchmarks = False
    assert len(prompts_of(cfg, tok)) == 6


def test_default_training_prompts_hold_no_benchmark_prompt():
    """The embedded default (packaged ShareGPT, the eagle recipe's 900 + 32 records, eagle_long's 2,000 + 32): no MT-bench
    or HumanEval prompt among its training or held-out prompts."""
    from drafttrain.data import DataConfig, load_conversations
    from drafttrain.eval.benchmarks import benchmark_texts, contains_benchmark

    bench = benchmark_texts()
    assert len(bench) > 200  # both benchmarks installed (80 x 2 MT-bench turns, 164 HumanEval stubs)
    users = []
    for rec in load_conversations(DataConfig(path="sharegpt")):
        turns = [m["content"] for m in rec["messages"] if m["role"] == "user"]
        if turns:
            users.append(turns[0])
        if len(users) >= 3000:  # more than any recipe reads (eagle_long: 2,000 + 32 and skips), in file order
            break
    assert not [u[:80] for u in users if contains_benchmark(u, bench)]


def test_a_float32_target_answers_in_bf16_through_the_kernel_and_comes_back_untouched(dl_root, tmp_path):
    """answer_dtype=auto on a CPU with a bf16 decode kernel: a bf16 copy answers through it (2.5x
    faster on AVX2-only CPUs than float32); the caller's float32 target keeps its dtype and PyTorch's
    matmul, so training and its features are unchanged. answer_dtype=target answers in float32."""
    import pytest

    from drafttrain.decode.kernels import cpu_linear
    from drafttrain.regenerate import answer_dtype_of, answering_model, answering_proposer
    from drafttrain.targets import load_target

    if not any(cpu_linear.available(k) for k in cpu_linear.KERNELS):
        pytest.skip("needs an x86 CPU with a bf16 decode kernel and g++")
    target, _, _ = load_target(str(dl_root / "target"), dtype="float32")
    assert answer_dtype_of("auto", target) == torch.bfloat16 and answer_dtype_of("target", target) == torch.float32
    with answering_model(target, "auto", "auto", progress=False) as model:
        assert model is not target and next(model.parameters()).dtype == torch.bfloat16
        assert cpu_linear.installed_backend(model) != "aten"
        assert answering_proposer("auto", model) == ("none" if cpu_linear.installed_backend(model) == "avx2" else "ngram")
    with answering_model(target, "target", "auto", progress=False) as model:
        assert model is target and cpu_linear.installed_backend(model) == "aten"
    assert next(target.parameters()).dtype == torch.float32 and cpu_linear.installed_backend(target) == "aten"
    assert answering_proposer("ngram", target) == "ngram" and answering_proposer("auto", target) == "ngram"

    # both dtypes write answers a training run reads; the bf16 ones resume like the float32 ones
    for dt in ("auto", "target"):
        out = tmp_path / f"{dt}.jsonl"
        res = regenerate(regen_cfg(dl_root, out, f"answer_dtype={dt}", "dtype=float32"), progress=False)
        assert res["written"] == 10 and len({json.loads(ln)["id"] for ln in out.read_text().splitlines()}) == 10


def test_resume_reads_answers_that_hold_unicode_line_separators(tmp_path):
    """A finished answer file whose texts hold U+2028 (the target writes one now and then) resumes:
    every id is read back and nothing is cut (the reader split at U+2028 and crashed on the halves)."""
    from drafttrain.regenerate import read_done

    path = tmp_path / "answers.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "assistant", "content": f"a\u2028b\u2029c {i}"}]} for i in range(4)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(text + '{"id": "p4", "mess', encoding="utf-8")  # plus a write cut by a kill
    assert read_done(path) == {f"p{i}" for i in range(4)}
    assert path.read_text(encoding="utf-8") == text
