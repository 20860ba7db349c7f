"""Serve token-id prompts with vLLM and write what happened as JSON; run by the vLLM environment.

    <vllm env>/bin/python vllm_runner.py REQUEST.json RESULT.json

This script runs under vLLM's own Python (`drafttrain.engines.vllm.ensure_vllm_env`), whose
transformers and numpy are older than drafttrain's, so it imports vLLM and the standard library
only, never drafttrain. `drafttrain.engines.vllm.run_vllm` writes the request and reads the result.

Request (JSON object):
    model               the target folder (an HF model folder)
    prompts             list of prompts, each a list of token ids
    max_new_tokens      tokens generated per prompt (EOS does not stop a prompt: ignore_eos)
    speculative_config  null, or the dict vLLM takes as ``LLM(speculative_config=...)``
    dtype               "float32" (default) or "bfloat16"
    max_model_len       default 512
    kv_cache_bytes      KV cache size in bytes (default 256 MiB; vLLM's CPU default is 4 GiB)
    seed                default 0

Result (JSON object):
    ok                  true, or false with ``error`` (the engine's own message, first line) and
                        ``error_type`` / ``traceback``
    outputs             generated token ids per prompt
    num_tokens, seconds, tokens_per_s
                        generated tokens, wall seconds of ``generate`` (start-up excluded), ratio
    startup_seconds     seconds to build the ``LLM`` (load, KV cache, worker start)
    spec                null without speculation; else vLLM's counters from ``llm.get_metrics()``
                        (Prometheus): ``num_drafts`` (vllm:spec_decode_num_drafts),
                        ``num_draft_tokens`` (vllm:spec_decode_num_draft_tokens),
                        ``num_accepted_tokens`` (vllm:spec_decode_num_accepted_tokens),
                        ``accepted_per_pos`` (vllm:spec_decode_num_accepted_tokens_per_pos), and
                        ``mean_acceptance_length`` = 1 + accepted / drafts, the figure vLLM logs
                        (bonus token included; v1/spec_decode/metrics.py)
    vllm_version, draft_architectures (the drafter classes vLLM resolved, when it exposes them)

The scheduler counts a draft's accepted tokens before a request's max_tokens cut
(v1/core/sched/scheduler.py, ``make_spec_decoding_stats``), so the last step of each prompt may
count drafts beyond ``max_new_tokens``.

A request with ``configs`` is an eval schedule instead (`drafttrain eval baselines=vllm,...`;
``drafttrain.eval.vllm_baselines`` writes it): one ``LLM`` per config, built in turn in this one
process, each warmed up with one short untimed generate and then timed on every run:

    configs             [{name, speculative_config}], built in this order
    runs                [{temperature, batch_size, prompts: [prompt indices]}]: each batch of
                        ``batch_size`` prompts is one ``generate`` call, batches in turn
    stop_token_ids      the ids a row stops at (EOS; the stop token is kept in the output);
                        the model's generation_config is not read (``generation_config="vllm"``)
    top_k, top_p, seed  sampling at temperature > 0; prompt i is seeded ``seed + i``
    warmup              one untimed 4-token generate of the first prompt per config (default true)
    enforce_eager       default true (no torch.compile: start-up in seconds, not minutes)
                        (prefix caching is off: the same prompts are timed several times, and
                        drafttrain's rows re-read every prompt too)
    progress_file       a line is appended to it after every timed call

    result: ok, vllm_version, configs {name: {startup_seconds, runs: [{temperature, batch_size,
            calls: [{prompts, outputs, seconds}], spec: counters of this run or null}]}};
            a failure names its config in ``config``

Deliberately not here: anything about drafttrain's formats; sampling in the single-generate form
(temperature is 0 there).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

# Run as a script, this file's folder (drafttrain/engines/) comes first on sys.path, and its
# sibling vllm.py would shadow the real vLLM package: drop it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

PREFIX = "vllm:spec_decode_"


def _spec_counters(llm) -> dict | None:
    """vLLM's speculative-decoding counters, summed over engines (labels)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith(PREFIX):
            continue
        key = m.name[len(PREFIX):]
        if isinstance(m, Vector):
            prev = out.get(key, [0] * len(m.values))
            out[key] = [a + b for a, b in zip(prev, m.values)]
        elif isinstance(m, Counter):
            out[key] = out.get(key, 0) + m.value
    if not out:
        return None
    drafts = int(out.get("num_drafts", 0))
    accepted = int(out.get("num_accepted_tokens", 0))
    return {"num_drafts": drafts, "num_draft_tokens": int(out.get("num_draft_tokens", 0)),
            "num_accepted_tokens": accepted, "accepted_per_pos": out.get("num_accepted_tokens_per_pos", []),
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None}


def _draft_architectures(llm) -> list[str] | None:
    spec = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    spec = getattr(spec, "speculative_config", None)
    hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    return list(getattr(hf, "architectures", None) or []) or None


def run(req: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=req["model"],
        tokenizer=req["model"],
        skip_tokenizer_init=True,  # prompts are token ids; the target's tokenizer may be newer than this env
        dtype=req.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=int(req.get("max_model_len", 512)),
        max_num_seqs=max(len(req["prompts"]), 1),
        kv_cache_memory_bytes=int(req.get("kv_cache_bytes", 256 << 20)),
        speculative_config=req.get("speculative_config"),
        seed=int(req.get("seed", 0)),
        disable_log_stats=False,  # the spec-decode counters are only collected with stats on
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_new_tokens"]), ignore_eos=True,
                            detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in req["prompts"]]
    t1 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    outputs = [list(r.outputs[0].token_ids) for r in results]
    n = sum(len(o) for o in outputs)
    return {"ok": True, "outputs": outputs, "num_tokens": n, "seconds": seconds,
            "tokens_per_s": n / seconds if seconds > 0 else None, "startup_seconds": startup,
            "spec": _spec_counters(llm),  # None without speculation (also when a speculators folder is the model)
            "vllm_version": vllm.__version__, "draft_architectures": _draft_architectures(llm)}


# ---- eval schedule ----------------------------------------------------------------------------
def _counter_delta(before: dict | None, after: dict | None) -> dict | None:
    """Spec-decode counters accumulated between two `_spec_counters` readings."""
    if after is None:
        return None
    before = before or {}
    out = {}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        out[key] = after[key] - before.get(key, 0)
    prev = before.get("accepted_per_pos") or []
    out["accepted_per_pos"] = [a - (prev[i] if i < len(prev) else 0) for i, a in enumerate(after["accepted_per_pos"])]
    drafts = out["num_drafts"]
    out["mean_acceptance_length"] = 1.0 + out["num_accepted_tokens"] / drafts if drafts else None
    return out


def _params(req: dict, temperature: float, prompt: int, max_tokens: int | None = None):
    from vllm import SamplingParams

    sampled = dict(temperature=temperature, top_k=int(req.get("top_k", 0)), top_p=float(req.get("top_p", 1.0)),
                   seed=int(req.get("seed", 0)) + prompt) if temperature > 0 else dict(temperature=0.0)
    return SamplingParams(max_tokens=int(max_tokens or req["max_new_tokens"]), ignore_eos=False,
                          stop_token_ids=[int(t) for t in req.get("stop_token_ids", [])], min_tokens=0,
                          detokenize=False, **sampled)


def _build_llm(req: dict, config: dict):
    from vllm import LLM

    return LLM(model=req["model"], tokenizer=req["model"], skip_tokenizer_init=True, dtype=req.get("dtype", "float32"),
               enforce_eager=bool(req.get("enforce_eager", True)), max_model_len=int(req.get("max_model_len", 512)),
               max_num_seqs=max([r["batch_size"] for r in req["runs"]] + [1]),
               kv_cache_memory_bytes=int(req.get("kv_cache_bytes", 256 << 20)),
               speculative_config=config.get("speculative_config"), seed=int(req.get("seed", 0)),
               generation_config="vllm",  # stop ids come from the request only, as in drafttrain's rows
               enable_prefix_caching=False,  # every run re-reads its prompts, as drafttrain's rows do
               disable_log_stats=False)


def _timed_runs(llm, req: dict, prompts: list, spec: bool) -> list[dict]:
    """Every run of the schedule on a built engine: one timed ``generate`` per batch."""
    runs = []
    for run in req["runs"]:
        before = _spec_counters(llm) if spec else None
        idx, b, calls = run["prompts"], int(run["batch_size"]), []
        for i in range(0, len(idx), b):
            batch = idx[i:i + b]
            params = [_params(req, float(run["temperature"]), p) for p in batch]
            t = time.perf_counter()
            results = llm.generate([prompts[p] for p in batch], params, use_tqdm=False)
            seconds = time.perf_counter() - t
            calls.append({"prompts": batch, "outputs": [list(r.outputs[0].token_ids) for r in results],
                          "seconds": seconds})
            if req.get("progress_file"):
                with open(req["progress_file"], "a") as f:
                    f.write("1\n")
        runs.append({**run, "calls": calls,
                     "spec": _counter_delta(before, _spec_counters(llm)) if spec else None})
    return runs


def run_schedule(req: dict, where: dict) -> dict:
    """Each config's engine built in turn, warmed up, then timed on every run; `where` names the
    config being worked on (for the error)."""
    import vllm
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in req["prompts"]]
    out: dict = {}
    for config in req["configs"]:
        where["config"] = config["name"]
        t0 = time.perf_counter()
        llm = _build_llm(req, config)
        startup = time.perf_counter() - t0
        if req.get("warmup", True):  # untimed: first-call allocations, lazy imports
            llm.generate(prompts[:1], [_params(req, 0.0, 0, max_tokens=4)], use_tqdm=False)
        spec = config.get("speculative_config") is not None
        out[config["name"]] = {"startup_seconds": startup, "runs": _timed_runs(llm, req, prompts, spec)}
        llm.llm_engine.engine_core.shutdown()  # the next config's engine gets the cores and memory
        del llm
        gc.collect()
    where.pop("config", None)
    return {"ok": True, "vllm_version": vllm.__version__, "configs": out}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        req = json.load(f)
    where: dict = {}
    try:
        result = run_schedule(req, where) if "configs" in req else run(req)
    except Exception as e:  # the engine's refusal is the result: the caller quotes it
        msg = str(e).strip()
        result = {"ok": False, "error": (msg.splitlines() or [type(e).__name__])[0],
                  "error_type": type(e).__name__, "traceback": traceback.format_exc(), **where}
    with open(argv[2], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # vLLM's engine spawns worker processes that re-import this file
    sys.exit(main(sys.argv))
