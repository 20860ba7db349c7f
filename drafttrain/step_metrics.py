"""Training metrics summed over micro-steps and batches (`StepMetrics`), turned into the means the
progress bar, the tracker and the held-out evaluation report.

Deliberately not here: computing the metrics (the methods' losses), logging them (trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepMetrics"]


@dataclass
class StepMetrics:
    """Sums over micro-steps / batches, turned into means by `summary`."""

    loss_sum: float = 0.0
    n: int = 0
    correct: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    run_len_sum: int = 0
    run_len_n: int = 0
    walk_tokens: int = 0
    walk_cycles: int = 0
    tokens: int = 0
    topk_correct: list[int] = field(default_factory=list)  # per-head top-k hits (Medusa)
    topk: int = 0
    overlap: list[float] = field(default_factory=list)  # per-step sum of min(p, q) (EAGLE-3)

    def add(self, m: dict, tokens: int) -> None:
        self.loss_sum += m["loss"]
        self.n += 1
        if not self.correct:
            self.correct = [0] * len(m["correct"])
            self.count = [0] * len(m["count"])
        for k, (c, n) in enumerate(zip(m["correct"], m["count"])):
            self.correct[k] += c
            self.count[k] += n
        if "topk_correct" in m:
            self.topk = m["topk"]
            self.topk_correct = [a + b for a, b in zip(self.topk_correct or [0] * len(m["topk_correct"]),
                                                      m["topk_correct"])]
        if "overlap" in m:
            self.overlap = [a + b for a, b in zip(self.overlap or [0.0] * len(m["overlap"]), m["overlap"])]
        self.run_len_sum += m["run_len_sum"]
        self.run_len_n += m["run_len_n"]
        self.walk_tokens += m.get("walk_tokens", 0)
        self.walk_cycles += m.get("walk_cycles", 0)
        self.tokens += tokens

    def summary(self, prefix: str) -> dict:
        from drafttrain.losses import simulated_tau

        out = {f"{prefix}/loss": self.loss_sum / max(self.n, 1)}
        for k, (c, n) in enumerate(zip(self.correct, self.count)):
            out[f"{prefix}/acc_{k}"] = c / max(n, 1)
        for k, (c, n) in enumerate(zip(self.topk_correct, self.count)):  # per-head top-k
            out[f"{prefix}/head{k}_top1"] = self.correct[k] / max(n, 1)
            out[f"{prefix}/head{k}_top{self.topk}"] = c / max(n, 1)
        for k, (o, n) in enumerate(zip(self.overlap, self.count)):  # sampled drafts' acceptance at T=1
            out[f"{prefix}/accept_t1_{k}"] = o / max(n, 1)
        out[f"{prefix}/tau_sim"] = simulated_tau(self.run_len_sum, self.run_len_n)
        if self.walk_cycles:  # what a greedy chain decoding this text would reach (losses.walk_chain)
            out[f"{prefix}/tau_walk"] = self.walk_tokens / self.walk_cycles
        return out
