"""Runs every method on the same prompts, interleaved batch by batch, and checks greedy outputs.

Methods:
    target        drafttrain's engine with no proposer (target-only decoding, the reference)
    <proposer>    drafttrain's engine with a proposer (n-gram, early exit, drafter, draft LM,
                  adaptive:<spec>, hybrid:<a>+<b>)
    hf            transformers `generate`, plain
    hf_lookup     transformers `generate(prompt_lookup_num_tokens=N)`          (batch 1 only)
    hf_assisted   transformers `generate(assistant_model=draft LM)`           (batch 1 only)
    vllm          vLLM's CPU engine, target only                    (eval/vllm_baselines.py)
    vllm_ngram    vLLM with its n-gram speculative decoding         (eval/vllm_baselines.py)

The vLLM rows are not run here: they run in vLLM's own process, before the methods here, at
every temperature and batch size in one go (start-up excluded), and their calls join each run's
calls, so summaries, speedups, the greedy check and tokens.jsonl treat them like any method.
They get the same prompt ids, max_new_tokens, EOS ids and sampling settings as below.

For each batch of prompts every method runs once, in an order rotated by one per batch, so
machine drift and warm caches fall on every method alike. Every method gets the same prompt
ids, max_new_tokens, EOS ids and sampling settings (temperature, top-k, top-p: HF's own
defaults such as top_k=50 are overridden). Sampled runs key prompt i's randomness with seed
`seed + i` in our engine (per row, so a prompt's output does not depend on its batch; HF
`generate` gets `torch.manual_seed(seed + first prompt of the batch)`).

Greedy check: every output is compared with target-only decoding token for token. At the first
divergence the target re-reads prompt + common prefix in one forward and the logit gap between
the two tokens is measured; a gap within the tolerance is a near-tie (bf16 numerics: a forward
over k+1 tokens and one over 1 token round differently), anything else is flagged.

Deliberately not here: aggregation (metrics.py), files (report.py), sweeps (sweeps.py).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from drafttrain.decode import Proposer, speculative_generate
from drafttrain.decode.kernels import cpu_linear
from drafttrain.eos import eos_ids as model_eos_ids
from drafttrain.eval.metrics import Call, first_divergence
from drafttrain.eval.results import Divergence, GreedyCheck

__all__ = ["Method", "left_pad", "eos_ids", "run_call", "run_benchmark", "log_pass", "greedy_check",
           "near_tie_tolerance"]


@dataclass
class Method:
    """One thing to time.

    Attributes:
        name: key in the report ("target", "ngram", "early-exit:6", "hf", ...).
        kind: "engine" (drafttrain's decoder) or "hf" (transformers generate).
        proposer: engine proposer (None = target-only).
        hf_kwargs: extra `generate` kwargs for HF methods (prompt lookup, assistant model).
        batch1_only: HF assisted / lookup generation accept a single row only.
        gamma / tree: per-method override of the run's gamma / tree (sweeps).
        adaptive: the proposer picks its draft length / part per step (adaptive:, hybrid: specs);
            sweeps do not force a gamma on it.
        log_steps: at T = 0, ask the engine for its step log (`DecodeStats.step_log`, for the
            oracle bound). Logging makes adaptive proposers draft every part to its cap, so the
            harness logs in a separate untimed pass (`log_pass`), never in a timed one.
    """

    name: str
    kind: str
    proposer: Proposer | None = None
    hf_kwargs: dict = field(default_factory=dict)
    batch1_only: bool = False
    gamma: int | None = None
    tree: object = None
    adaptive: bool = False
    log_steps: bool = False


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] left-padded ids and attention mask."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):] = 1
    return ids, mask


def eos_ids(target: nn.Module, tokenizer=None) -> list[int]:
    """EOS ids every method stops at: all the target and tokenizer name (`drafttrain.eos.eos_ids`)."""
    return model_eos_ids(target, tokenizer)


def _cut_at_eos(row: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def run_call(target: nn.Module, method: Method, prompts: list[list[int]], *, max_new_tokens: int,
             temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int | list[int] = 0, eos: list[int],
             pad_id: int = 0, gamma: int | None = None, tree=None) -> tuple[list[list[int]], float, dict | None]:
    """Runs one method on one batch; returns (new tokens per row, wall seconds, stats or None)."""
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(target.device), mask.to(target.device)
    gamma = method.gamma or gamma
    tree = method.tree if method.tree is not None else tree
    if method.kind == "engine":
        opts = {"log_steps": True} if method.log_steps and temperature == 0 else {}
        t0 = time.perf_counter()
        out = speculative_generate(target, method.proposer, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_k=top_k, top_p=top_p,
                                   seed=seed if temperature > 0 else None, eos_token_id=eos,
                                   gamma=gamma if method.proposer is not None else None,
                                   tree=tree if method.proposer is not None else None, **opts)
        return out.sequences, time.perf_counter() - t0, out.stats.as_dict()
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    if temperature > 0:
        torch.manual_seed(seed if isinstance(seed, int) else seed[0])
    t0 = time.perf_counter()
    assistant = method.hf_kwargs.get("assistant_model")
    with torch.inference_mode(), cpu_linear.paused(target), \
            (cpu_linear.paused(assistant) if assistant is not None else nullcontext()):  # transformers as users run it
        gen = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                              eos_token_id=eos or None, pad_token_id=pad_id, repetition_penalty=None, min_p=None,
                              **sampling, **method.hf_kwargs)
    wall = time.perf_counter() - t0
    seqs = [_cut_at_eos(row, eos) for row in gen[:, ids.shape[1]:].tolist()]
    return seqs, wall, None


def run_benchmark(target: nn.Module, methods: list[Method], prompts: list[list[int]], *, batch_size: int,
                  max_new_tokens: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  eos: list[int], pad_id: int = 0, gamma: int | None = None, tree=None,
                  on_call=None) -> dict[str, list[Call]]:
    """Runs every method on every batch, interleaved; returns method name -> its calls.

    Args:
        on_call: called with (method name, Call) after each call (progress bar, tracking).
    """
    calls: dict[str, list[Call]] = {m.name: [] for m in methods}
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    for step, idx in enumerate(batches):
        order = methods[step % len(methods):] + methods[: step % len(methods)]
        for m in order:
            if m.batch1_only and len(idx) > 1:
                continue
            seqs, wall, stats = run_call(target, m, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                                         temperature=temperature, top_k=top_k, top_p=top_p, seed=[seed + i for i in idx],
                                         eos=eos, pad_id=pad_id, gamma=gamma, tree=tree)
            call = Call(m.name, idx, seqs, wall, stats)
            calls[m.name].append(call)
            if on_call is not None:
                on_call(m.name, call)
    return {k: v for k, v in calls.items() if v}


def log_pass(target: nn.Module, methods: list[Method], prompts: list[list[int]], **run_kw) -> dict[str, list[Call]]:
    """An untimed greedy re-run of `methods` with step logging on (for the oracle bound); same
    batches and settings as the timed run (`run_kw` as for run_benchmark, without on_call)."""
    return run_benchmark(target, [replace(m, log_steps=True) for m in methods], prompts, **run_kw)


def near_tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    """Default near-tie gap: 2 % of the top logit's magnitude (at least 0.05) in 16-bit dtypes
    (bf16 keeps 8 significant bits, and 18 layers of rounding add up), 1e-3 in float32."""
    if dtype in (torch.bfloat16, torch.float16):
        return max(0.05, 0.02 * abs(top_logit))
    return 1e-3


@torch.inference_mode()
def _logit_gap(target: nn.Module, context: list[int], a: int, b: int) -> tuple[float, float]:
    """(|logit[a] - logit[b]|, top logit) after `context`, from one full forward."""
    ids = torch.tensor([context], dtype=torch.long, device=target.device)
    logits = target(input_ids=ids).logits[0, -1].float()
    return abs(float(logits[a] - logits[b])), float(logits.max())


def greedy_check(target: nn.Module, calls: dict[str, list[Call]], prompts: list[list[int]], *,
                 reference: str = "target", tolerance: float = 0.0) -> dict[str, GreedyCheck]:
    """Compares every method's greedy outputs with the reference method's, per prompt.

    Returns:
        method -> its GreedyCheck: prompts compared and identical, and the first divergence of
        each differing prompt with its logit gap and whether that is a near-tie.
    """
    if reference not in calls:
        return {}
    ref = {p: s for c in calls[reference] for p, s in zip(c.prompts, c.sequences)}
    dtype = next(target.parameters()).dtype
    report = {}
    for name, cs in calls.items():
        if name == reference:
            continue
        divs = []
        compared = 0
        for c in cs:
            for p, seq in zip(c.prompts, c.sequences):
                compared += 1
                d = first_divergence(ref[p], seq)
                if d is None:
                    continue
                div = Divergence(prompt=p, position=d, expected=ref[p][d] if d < len(ref[p]) else None,
                                 got=seq[d] if d < len(seq) else None, logit_gap=None, near_tie=False)
                if div.expected is not None and div.got is not None:
                    gap, top = _logit_gap(target, prompts[p] + ref[p][:d], div.expected, div.got)
                    div.tolerance = tolerance or near_tie_tolerance(dtype, top)
                    div.logit_gap, div.near_tie = gap, gap <= div.tolerance
                divs.append(div)
        report[name] = GreedyCheck(compared=compared, identical=compared - len(divs), all_match=not divs,
                                   divergences=divs, all_divergences_near_ties=all(d.near_tie for d in divs))
    return report
