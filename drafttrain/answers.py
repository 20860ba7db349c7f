"""Where the training answers come from: the dataset's own, or the target's (regenerated, cached).

With `answers.source=target` the target answers the training prompts before training starts
(`drafttrain regenerate`'s machinery: drafttrain's speculative decoder, a `greedy_share` at T=0
and the rest at `temperature`, benchmark prompts skipped) and training reads those answers. The
file is cached under the data cache, keyed by the target, the prompts' source files, the data
and answer settings (not how many prompts: a run that wants more extends the file), so a second
run reuses it and a killed run resumes it where it stopped.
Held-out records come from the same file (the target's answers to held-out prompts), so
held-out accuracy measures what decoding needs: predicting the target.

Deliberately not here: the answering itself (regenerate.py), tokenisation (data.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from drafttrain.config import field_
from drafttrain.data import DataConfig, cache_root, source_fingerprint
from drafttrain.regenerate import ANSWER_DTYPE_HELP, ANSWER_DTYPES

__all__ = ["AnswersConfig", "training_data", "answers_path", "prompts_needed"]


@dataclass
class AnswersConfig:
    source: str = field_("dataset", help="training answers: the dataset's own, or the target's (regenerated once, cached)",
                         choices=("dataset", "target"))
    max_new_tokens: int = field_(256, help="target answers: max tokens per answer")
    greedy_share: float = field_(0.5, help="target answers: share answered greedily (T=0); the rest at temperature")
    temperature: float = field_(1.0, help="target answers: sampling temperature of the sampled share")
    batch_size: int = field_(16, help="target answers: prompts answered together")
    proposer: str = field_("auto", help="target answers: drafter that speeds the greedy ones up (a proposer spec; none = off; auto: n-gram, none where the target answers through the AVX2 kernel)")
    sampled_proposer: str = field_("none", help="target answers: drafter for the sampled ones (none: at T=1 n-gram drafts are mostly rejected, and a batch pays to verify them)")
    dtype: str = field_("auto", help="target answers: " + ANSWER_DTYPE_HELP, choices=ANSWER_DTYPES)
    prompts: int = field_(0, help="target answers: prompts to answer; 0 = enough for data.num_samples + data.heldout (all if num_samples=0)")
    seed: int = field_(0, help="target answers: sampling seed")


# How many prompts and how fast they are answered (batch, lossless drafters, bf16 or float32 as the
# target's own dtype is not in the key either) do not change the answers' law.
_NOT_IN_KEY = ("prompts", "batch_size", "proposer", "sampled_proposer", "dtype")


def prompts_needed(data: DataConfig, answers: AnswersConfig) -> int:
    """How many prompts to answer: enough for the train and held-out records (a few answers come
    back empty and are skipped), or all (0) when data.num_samples is 0."""
    if answers.prompts:
        return answers.prompts
    if not data.num_samples:
        return 0
    return math.ceil((data.num_samples + data.heldout) * 1.05) + 4


def answers_path(data: DataConfig, answers: AnswersConfig, target_spec: str, target_id: dict) -> Path:
    """The cache file for these prompts answered by this target with these settings."""
    # Neither the number of prompts nor num_samples is in the key: prompts are answered in file
    # order, so a run that wants more prompts extends the same file (resuming) instead of starting over.
    skip = ("cache_dir", "heldout", "seed", "num_samples")
    key = {"target": target_spec, "target_id": target_id, "source": source_fingerprint(data),
           "data": {k: v for k, v in asdict(data).items() if k not in skip},
           "answers": {k: v for k, v in asdict(answers).items() if k not in _NOT_IN_KEY}, "version": 2}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root(data) / "answers" / f"{digest}.jsonl"


def training_data(data: DataConfig, answers: AnswersConfig, target_spec: str, target, tokenizer, *,
                  progress: bool = True) -> DataConfig:
    """The data config training reads: `data` itself, or the target's answers to its prompts
    (answered now where the cache lacks them; a rerun of a finished file only reads it)."""
    if answers.source == "dataset":
        return data
    from drafttrain.drafter_io import target_signature
    from drafttrain.regenerate import RegenerateConfig, regenerate

    out = answers_path(data, answers, target_spec, target_signature(target))
    if progress:
        print(f"drafttrain: training on the target's own answers to the training prompts ({out})", flush=True)
    rcfg = RegenerateConfig(target=target_spec, data=data, out=str(out), num_prompts=prompts_needed(data, answers),
                            batch_size=answers.batch_size, max_new_tokens=answers.max_new_tokens,
                            temperature=answers.temperature, greedy_share=answers.greedy_share,
                            seed=answers.seed, proposer=answers.proposer, sampled_proposer=answers.sampled_proposer,
                            answer_dtype=answers.dtype)
    regenerate(rcfg, progress=progress, target=target, tokenizer=tokenizer)
    return replace(data, path=str(out), format="openai")
