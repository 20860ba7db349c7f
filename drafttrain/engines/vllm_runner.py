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

Deliberately not here: anything about drafttrain's formats; sampling (temperature is 0).
"""

from __future__ import annotations

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
            "spec": _spec_counters(llm) if req.get("speculative_config") else None,
            "vllm_version": vllm.__version__, "draft_architectures": _draft_architectures(llm)}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        req = json.load(f)
    try:
        result = run(req)
    except Exception as e:  # the engine's refusal is the result: the caller quotes it
        msg = str(e).strip()
        result = {"ok": False, "error": (msg.splitlines() or [type(e).__name__])[0],
                  "error_type": type(e).__name__, "traceback": traceback.format_exc()}
    with open(argv[2], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # vLLM's engine spawns worker processes that re-import this file
    sys.exit(main(sys.argv))
