"""`decode_eval`: a cheap, in-process decoding eval the training loop can call every N steps.

It decodes held-out prompts with the real engine (not a simulated tau) and returns tau,
per-position acceptance and tokens/s; with `baseline=True` it also runs target-only decoding
interleaved with it and adds the speedup and the greedy match count. No files, no HF baselines.

Deliberately not here: the full harness (harness.py), model mode switching: the caller puts the
drafter in eval mode (and back) around the call.
"""

from __future__ import annotations

from torch import nn

from drafttrain.eval.metrics import add_speedups, first_divergence, summarize
from drafttrain.eval.runner import Method, eos_ids, run_benchmark

__all__ = ["decode_eval"]


def decode_eval(target: nn.Module, proposer, prompts: list[list[int]], *, max_new_tokens: int = 64,
                temperature: float = 0.0, gamma: int | None = None, tree=None, baseline: bool = False,
                seed: int = 0, batch_size: int = 1, pad_id: int = 0) -> dict:
    """Decodes `prompts` with `proposer` and reports acceptance and speed.

    Args:
        target: the target causal LM (eval mode).
        proposer: a Proposer, a spec string or a drafter module (anything `load_proposer` takes).
        prompts: token ids per prompt (already rendered with the chat template).
        max_new_tokens / temperature / gamma / tree: as in `speculative_generate`.
        baseline: also time target-only decoding (interleaved) for `speedup_vs_target`, and at
            temperature 0 count prompts whose output equals the target's (`greedy_match`).
        seed: sampling seed (prompt i uses seed + i).
        batch_size: prompts per generate call.
        pad_id: left-padding id when batch_size > 1.

    Returns:
        {tau, tau_std, acceptance: [per position], tokens_per_s, tokens, wall_s,
        time_split, speedup_vs_target?, greedy_match?}. tau counts the bonus token.
    """
    from drafttrain.decode import load_proposer

    methods = [Method("drafter", "engine", proposer=load_proposer(proposer, target))]
    if baseline:
        methods.insert(0, Method("target", "engine"))
    calls = run_benchmark(target, methods, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed, eos=eos_ids(target), pad_id=pad_id, gamma=gamma,
                          tree=tree)
    cats = ["all"] * len(prompts)
    sums = {k: summarize(v, prompts, cats) for k, v in calls.items()}
    s = sums["drafter"]
    view = s.to_dict()
    out = {k: view[k] for k in ("tau", "tau_std", "acceptance", "tokens_per_s", "tokens", "wall_s", "time_split")}
    if baseline:
        add_speedups(sums, ["target"])
        out["speedup_vs_target"] = s.speedup["vs_target"]
        if temperature == 0:
            ref = {p: q for c in calls["target"] for p, q in zip(c.prompts, c.sequences)}
            out["greedy_match"] = sum(first_divergence(ref[p], q) is None
                                      for c in calls["drafter"] for p, q in zip(c.prompts, c.sequences))
    return out
