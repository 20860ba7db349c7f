"""drafttrain.eval: benchmarks, baselines, metrics, sweeps and reports for speculative decoding.

Public API:
    run_eval(EvalConfig) -> Results               the `drafttrain eval` command (harness.py)
    decode_eval(target, proposer, prompts, ...)   cheap in-process eval for the training loop
    EvalConfig, EvalError, load_benchmark, Results (the report's typed schema, results.py)

Layout: config.py (schema), benchmarks.py (MT-bench, HumanEval, mixed, held-out, JSONL),
runner.py (interleaved calls, HF baselines, greedy check), metrics.py, oracle.py (hindsight
bound of adaptive / hybrid speculation from greedy step logs), sweeps.py, vllm_baselines.py
(vLLM's rows, timed in its own process), results.py (the report's dataclasses and schema),
report.py (JSON, Markdown, plots, token ids), harness.py (top to bottom), quick.py (decode_eval).

Deliberately not here: decoding (drafttrain.decode), training (drafttrain).
"""

from drafttrain.eval.benchmarks import load_benchmark
from drafttrain.eval.config import EvalConfig, EvalError
from drafttrain.eval.harness import run_eval
from drafttrain.eval.quick import decode_eval
from drafttrain.eval.results import Results

__all__ = ["run_eval", "decode_eval", "EvalConfig", "EvalError", "load_benchmark", "Results"]
