"""Timing for the cost model (costmodel.py): one verification forward, one proposer's drafting.

    time_verify    median ms of a target forward over t new tokens per row, for each t of a grid,
                   called round-robin (every t once per round) so a slow spell hits every point,
                   and read after each round's shared offset is removed (`centred_medians`)
    rounds_for     how many timed rounds a batch size gets: more for the cheap small batches
    warm_up        untimed forwards before the first timed point
    time_draft     (ms per call, ms per draft step) of a proposer: the line through its median
                   propose + observe call at chains of 1 and 4 (`time_calls`)
    Timed          wraps a proposer and times each propose + observe pair
    NoBar          a progress bar that shows nothing

Deliberately not here: the CostModel itself, its cache and what it is used for (costmodel.py,
planning.py).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from torch import nn

from drafttrain.decode.proposers.base import Proposer

__all__ = ["time_verify", "centred_medians", "rounds_for", "SMALL_BATCH_ROUNDS", "warm_up", "time_draft", "time_calls", "Timed", "NoBar", "sync"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_verify(target: nn.Module, batch: int, tokens: list[int], context: int, repeats: int,
                 bar, temperature: float = 0.0) -> dict[tuple[int, int], float]:
    """Median ms of one verification of t new tokens per row after a `context`-token prefill:
    greedy (T = 0) the forward with the fused argmax head; sampled (T > 0) the forward's full
    logits and `verify_tree`'s rejection sampling of a chain against random draft probabilities."""
    from drafttrain.decode.kv import KVState, target_forward
    from drafttrain.decode.verify import verify_tree

    device = next(target.parameters()).device
    vocab = target.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    kv = KVState.for_model(target, batch, device)
    ids = torch.randint(0, vocab, (batch, context), generator=g).to(device)
    col = torch.arange(context, device=device).expand(batch, -1)
    target_forward(target, kv, ids, col, col - 1, head="none")  # col - 1: a causal chain, -1 for the first
    kv.commit(col)
    t_max = max(tokens)
    new_all = torch.randint(0, vocab, (batch, t_max), generator=g).to(device)
    q_all = torch.rand(batch, t_max, vocab, generator=g).to(device).softmax(-1) if temperature > 0 else None
    times: dict[int, list[float]] = {t: [] for t in tokens}
    inputs = {t: (new_all[:, :t], context + torch.arange(t, device=device).expand(batch, -1),
                  torch.arange(-1, t - 1, device=device).expand(batch, -1)) for t in tokens}  # ids, positions, parents
    # Round-robin: round 0 warms every point up untimed, then each round times every point once, so
    # a slow spell of a shared machine lands on several points a little, not on one point's calls.
    for r in range(repeats + 1):
        for t in tokens:
            new, pos, parents = inputs[t]
            sync(device)
            t0 = time.perf_counter()
            if temperature > 0:
                logits, _ = target_forward(target, kv, new, pos, parents)
                verify_tree(logits, new, parents, q_all[:, :t], temperature=temperature, seed=r, positions=pos)
            else:
                target_forward(target, kv, new, pos, parents, head="argmax")
            sync(device)
            if r:
                times[t].append((time.perf_counter() - t0) * 1e3)
            kv.rollback()
            bar.update(1)
    return {(batch, t): ms for t, ms in zip(tokens, centred_medians([times[t] for t in tokens]))}


#: extra timed rounds of the cheap small batch sizes, as a multiple of `repeats` ({batch: factor})
SMALL_BATCH_ROUNDS = {1: 4, 2: 2}


def rounds_for(batch: int, repeats: int) -> int:
    """Timed rounds for one batch size: `repeats`, times SMALL_BATCH_ROUNDS for batch 1 and 2.

    Why: plans at batch 1 weigh one more draft by the step between neighbouring token counts, and
    those steps are small (0.2-2.5 ms of ~30 on a 2-core EPYC, session 35). With 9 rounds a step
    read 0.5-1.5 ms off (sd over blocks of a 200-round run); with 36, 0.1-1.0. A batch-1 round
    costs ~0.35 s, so the extra rounds add ~20 s to a profile whose large batches take minutes."""
    return repeats * SMALL_BATCH_ROUNDS.get(batch, 1)


def centred_medians(rounds: list[list[float]]) -> list[float]:
    """Per point, the median of its times after each round's shared offset is removed.

    Args:
        rounds: per point, its times in round order (round r of every point timed in one pass).

    A slow spell of a shared machine moves every point timed in its round; the offset of round r
    is the median over points of (time - that point's median), and the point's value the median of
    its offset-free times. Plain medians keep the spells as noise between the points, which is
    what plans read (session 35, 200 greedy batch-1 rounds on a 2-core EPYC, in blocks of 27: the
    sd of a step between neighbouring token counts 0.8-1.3 ms with plain medians, 0.5-1.1 centred).
    """
    if len({len(r) for r in rounds}) > 1:
        raise ValueError("centred_medians needs one equally long list of times per point")
    times = np.asarray(rounds, dtype=np.float64)
    if times.shape[1] < 3:  # too few rounds to tell a spell from a point
        return np.median(times, axis=1).tolist()
    offset = np.median(times - np.median(times, axis=1, keepdims=True), axis=0, keepdims=True)
    return np.median(times - offset, axis=1).tolist()


class NoBar:
    def update(self, n: int = 1) -> None:
        pass


def warm_up(target: nn.Module, batch_sizes: list[int], tokens: list[int], context: int, seconds: float) -> None:
    """Untimed verification forwards at the first batch size (a prefill, then the fewest and the
    most tokens) for `seconds`, or 20 rounds on a model so small that they take no time: caches,
    allocator and clocks reach their steady state before the first point is timed."""
    t0, rounds = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds and rounds < 20:
        time_verify(target, batch_sizes[0], sorted({tokens[0], tokens[-1]}), context, 1, NoBar())
        rounds += 1


class Timed(Proposer):
    """Wraps a proposer and times each propose + observe pair (ms)."""

    def __init__(self, inner, device: torch.device):
        self.inner, self.device, self.times = inner, device, []
        self.needs_hidden_states = inner.needs_hidden_states
        self.default_gamma = inner.default_gamma

    def prefill(self, state, hidden) -> None:
        self.inner.prefill(state, hidden)

    def propose(self, state):
        sync(self.device)
        self._t0 = time.perf_counter()
        tree = self.inner.propose(state)
        sync(self.device)
        self._ms = (time.perf_counter() - self._t0) * 1e3
        return tree

    def observe(self, state, tree, result, hidden, *, own=None) -> None:
        sync(self.device)
        t0 = time.perf_counter()
        self.inner.observe(state, tree, result, hidden, own=own)
        sync(self.device)
        self.times.append(self._ms + (time.perf_counter() - t0) * 1e3)


def time_draft(target: nn.Module, proposer, batch: int, context: int, repeats: int,
                temperature: float = 0.0) -> tuple[float, float]:
    """(ms per call, ms per draft step) of `proposer` (see the module docstring), at `temperature`:
    the line through the median call at chain lengths 1 and 4. When noise puts the call at 4
    below the call at 1, the call part is 0 and a step a quarter of the call at 4."""
    t1, t4 = (time_calls(target, proposer, batch, context, repeats, gamma, temperature) for gamma in (1, 4))
    if t4 <= t1:
        return 0.0, t4 / 4
    step = (t4 - t1) / 3
    return max(0.0, t1 - step), step


def time_calls(target: nn.Module, proposer, batch: int, context: int, repeats: int, gamma: int,
                temperature: float) -> float:
    """Median ms of a propose + observe call of `proposer` drafting chains of `gamma`."""
    from drafttrain.decode.engine import speculative_generate

    device = next(target.parameters()).device
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(1)).to(device)
    timed = Timed(proposer, device)
    steps = max(repeats, 1) + 1
    speculative_generate(target, timed, ids, max_new_tokens=steps * (gamma + 1), gamma=gamma, eos_token_id=[],
                         temperature=temperature, seed=0 if temperature > 0 else None)
    later = timed.times[1:] or timed.times  # the first call reads the whole prompt
    return statistics.median(later)
