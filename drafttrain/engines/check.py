"""`drafttrain engine-check`: serve a vLLM export with vLLM and compare it with the target's own.

    drafttrain engine-check exports/vllm target=path/to/target [drafter=runs/eagle/drafter]

vLLM (its CPU build, `drafttrain.engines.vllm`) loads the target folder and the export as its
drafter, decodes a few prompts greedily with ``gamma`` speculative tokens, and the command checks
that the output equals the target's own greedy output (drafttrain's target-only decoding, float32)
and prints vLLM's mean acceptance length, per-position acceptance and tokens/s. With ``drafter=``
(the drafttrain folder the export came from), drafttrain's decoder runs the same prompts with the
same chains and its acceptance is printed beside vLLM's.

A greedy output that differs is an error (one line, exit 2): the export or the engine is wrong.
Acceptance is reported, not judged: what counts as close depends on the prompts (the round-trip
test, tests/engines/test_vllm_roundtrip.py, states and checks a tolerance).

Deliberately not here: the environment and the engine run (vllm.py), SGLang, sampled decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafttrain.config import field_, format_help
from drafttrain.decode.engine import speculative_generate
from drafttrain.decode.proposers import load_proposer
from drafttrain.engines.vllm import EngineError, run_vllm, vllm_speculative_config
from drafttrain.targets import load_target

__all__ = ["EngineCheckConfig", "engine_check", "format_check", "help_text"]

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Speculative decoding speeds up generation by",
    "1, 2, 3, 4, 5,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "import numpy as np\n",
)


@dataclass
class EngineCheckConfig:
    export: str = field_("", help="the `drafttrain export --format vllm` folder (also the first bare argument)")
    target: str = field_("", help="the target as a local HF folder (vLLM loads it; it must be the export's verifier)")
    drafter: str = field_("", help="optional: the drafttrain drafter folder the export came from; drafttrain's decoder then runs too")
    gamma: int = field_(3, help="speculative tokens per step (vLLM's num_speculative_tokens, drafttrain's chain length)")
    max_new_tokens: int = field_(64, help="new tokens per prompt (EOS does not stop a prompt)")
    prompts: int = field_(4, help=f"how many of the {len(PROMPTS)} built-in prompts to decode")
    dtype: str = field_("float32", help="dtype in both engines", choices=("float32", "bfloat16"))
    threads: int = field_(0, help="CPU threads for vLLM (OMP_NUM_THREADS); 0 = vLLM's choice")
    timeout: int = field_(900, help="seconds for the vLLM run, start-up included")


def help_text() -> str:
    return format_help(EngineCheckConfig, "usage: drafttrain engine-check EXPORT target=DIR [key=value ...]\n\n"
                       "Serves the vLLM export with vLLM's CPU build (installed once into a cached environment,\n"
                       "~2 minutes) and checks its greedy output against the target's own.\n\nkeys (default, meaning):")


def engine_check(cfg: EngineCheckConfig) -> dict[str, Any]:
    """Runs the check; returns vLLM's and (with a drafter) drafttrain's figures.

    Raises:
        EngineError: a bad argument, vLLM refused the export, or its greedy output differs from the
            target's (the message names the first prompt that differs).
    """
    if not cfg.export or not (Path(cfg.export) / "config.json").is_file():
        raise EngineError(f"engine-check needs a vLLM export folder, got {cfg.export!r}; "
                          "make one with `drafttrain export DRAFTER --format vllm --out DIR`")
    if not cfg.target or not Path(cfg.target).is_dir():
        raise EngineError(f"engine-check needs target=<local HF folder> (vLLM loads it), got {cfg.target!r}")
    if not 1 <= cfg.prompts <= len(PROMPTS):
        raise EngineError(f"prompts must be 1..{len(PROMPTS)}, got {cfg.prompts}")
    spec = vllm_speculative_config(cfg.export, cfg.gamma)
    target, tok, _ = load_target(cfg.target, dtype=cfg.dtype)
    prompts = [tok.encode(p) for p in PROMPTS[: cfg.prompts]]  # with <bos> where the tokenizer adds one
    # the target's own greedy output, one prompt at a time (no padding)
    expected = [speculative_generate(target, None, torch.tensor([p]), max_new_tokens=cfg.max_new_tokens,
                                     eos_token_id=[]).sequences[0] for p in prompts]
    res = run_vllm(cfg.target, prompts, speculative=spec, max_new_tokens=cfg.max_new_tokens, dtype=cfg.dtype,
                   threads=cfg.threads or None, timeout=cfg.timeout)
    for i, (got, want) in enumerate(zip(res["outputs"], expected)):
        if got != want:
            j = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise EngineError(f"vLLM's greedy output with the {spec['method']} drafter differs from the target's on "
                              f"prompt {i} ({PROMPTS[i]!r}) at new token {j}: the export does not match the target")
    report = {"method": spec["method"], "prompts": len(prompts), "greedy_equal": True,
              "vllm": {**res["spec"], "tokens_per_s": res["tokens_per_s"], "drafter_class": res["draft_architectures"]}}
    if cfg.drafter:
        proposer = load_proposer(cfg.drafter, target)
        stats_drafts, stats_acc = 0, [0] * cfg.gamma
        for p in prompts:
            s = speculative_generate(target, proposer, torch.tensor([p]), max_new_tokens=cfg.max_new_tokens,
                                     eos_token_id=[], gamma=cfg.gamma).stats
            stats_drafts += s.draft_counts[0] if s.draft_counts else 0
            stats_acc = [a + b for a, b in zip(stats_acc, s.accept_counts + [0] * cfg.gamma)]
        report["drafttrain"] = {"num_drafts": stats_drafts, "accepted_per_pos": stats_acc,
                                "mean_acceptance_length": 1 + sum(stats_acc) / stats_drafts if stats_drafts else None}
    return report


def format_check(report: dict[str, Any]) -> str:
    """The report as a few lines for the terminal."""
    v = report["vllm"]
    lines = [f"vLLM loaded the export as {', '.join(v['drafter_class'] or ['?'])} ({report['method']}); greedy output "
             f"equal to the target's on {report['prompts']}/{report['prompts']} prompts",
             f"  vLLM        mean acceptance length {v['mean_acceptance_length']:.3f}  drafts {v['num_drafts']}  "
             f"accepted per position {v['accepted_per_pos']}  {v['tokens_per_s']:.0f} tok/s"]
    d = report.get("drafttrain")
    if d:
        mal = d["mean_acceptance_length"]
        lines.append(f"  drafttrain  mean acceptance length {mal:.3f}  drafts {d['num_drafts']}  "
                     f"accepted per position {d['accepted_per_pos']}" if mal is not None else "  drafttrain  no drafts")
    return "\n".join(lines)
