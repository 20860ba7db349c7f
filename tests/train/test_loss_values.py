"""Values of the drafter losses against first-principles references on hand-sized tensors.

Every loss in `drafttrain.losses` (EAGLE-3, EAGLE-1, Medusa-1, Medusa-2 and its KL term) runs here
on stubs whose outputs are set by hand: a drafter or Medusa heads returning fixed logits, and a
target reduced to an LM head, a config with an optional soft cap and (Medusa-2) a body returning
fixed hidden states. Each result is compared, value and gradient, with a reference written below
as plain loops over (row, position, step): which positions count (padding, the loss mask, the
teacher's argmax outside the draft vocab), which teacher position scores which step or head, the
weights step_weight**k, the draft-vocab mapping, EAGLE-1's SmoothL1 + CE weights and Medusa-2's
KL term; and so are the metrics a user sees (per-step accuracy and counts, run lengths, tau).
Uniform drafters give closed forms (log Vd per counted position) checkable by hand.

Sizes: vocab 11 with a draft vocab of 7, hidden 5, batch 2, length 7 (real: Llama-3.1-8B has vocab
128256 with a 32k draft vocab, hidden 4096). Deliberately not here: the drafters' own forward
passes (tests/decode/test_eagle_ttt_parity.py) and training runs (tests/train/test_training.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from drafttrain.losses import (
    eagle1_loss,
    eagle3_loss,
    kl_to_original,
    medusa2_loss,
    medusa_loss,
    simulated_tau,
)

V, VD, H, B, T = 11, 7, 5, 2, 7
DRAFT_IDS = [0, 2, 3, 5, 7, 8, 10]  # target ids of the draft vocabulary, in draft order
DRAFT_OF = {tid: d for d, tid in enumerate(DRAFT_IDS)}  # target id -> draft id
# Row 1 is right-padded after 5 tokens; row 0's loss mask has a gap (a user turn). Tokens 4, 6 and 9
# lie outside the draft vocab, 4 and 6 at loss-masked positions.
INPUT_IDS = [[1, 3, 4, 8, 9, 10, 2], [1, 5, 6, 7, 3, 0, 0]]
ATTN = [[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]
LOSS_MASK = [[0, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 0, 0]]
STEPS = 3  # EAGLE-3 unroll steps, Medusa heads


def make_batch() -> dict[str, Tensor]:
    return {"input_ids": torch.tensor(INPUT_IDS), "attention_mask": torch.tensor(ATTN),
            "loss_mask": torch.tensor(LOSS_MASK)}


def draft_mask() -> Tensor:
    """t2d: [V] bool, True on the draft vocabulary's target ids."""
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    return t2d


def randn(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- stubs ------------------------------------------------------------------------------------------
class StubTarget(nn.Module):
    """What the losses read of a target: an LM head W [V, H] and a config with an optional soft cap;
    for Medusa-2 a body returning `adapted` hidden states, or `original` with the adapter disabled."""

    def __init__(self, weight: Tensor, softcap: float | None = None, *, original: Tensor | None = None,
                 adapted: Tensor | None = None) -> None:
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False).requires_grad_(False)
        self.lm_head.weight.copy_(weight)
        self.config = SimpleNamespace(final_logit_softcapping=softcap)
        self.original, self.adapted = original, adapted
        self.adapter_on = True
        self.body_calls: list[bool] = []  # adapter state at each body call

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_decoder(self) -> Callable[..., SimpleNamespace]:
        return self.body

    def body(self, input_ids: Tensor, attention_mask: Tensor, **_) -> SimpleNamespace:
        self.body_calls.append(self.adapter_on)
        h = self.adapted if self.adapter_on else self.original
        return SimpleNamespace(last_hidden_state=h, hidden_states=(h,))

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        self.adapter_on = False
        try:
            yield
        finally:
            self.adapter_on = True


class StubEagle3(nn.Module):
    """An EAGLE-3 drafter whose unroll returns fixed logits: step k -> logits[k] [B, T, Vd]."""

    def __init__(self, logits: list[Tensor]) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1, bias=False)  # the loss reads only its dtype
        self.register_buffer("t2d", draft_mask())
        self.draft_ids = torch.tensor(DRAFT_IDS)
        self.step_logits = logits
        self.calls: list[dict] = []

    def forward(self, input_ids: Tensor, hidden: Tensor, *, ttt_steps: int, valid: Tensor) -> list[tuple[Tensor, Tensor]]:
        self.calls.append({"input_ids": input_ids, "ttt_steps": ttt_steps, "valid": valid})
        return [(lg, lg) for lg in self.step_logits[:ttt_steps]]


class StubEagle1(nn.Module):
    """An EAGLE-1 drafter returning fixed (logits [B, T, V], predicted feature [B, T, H])."""

    def __init__(self, logits: Tensor, pred: Tensor, head: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1, bias=False)  # the loss reads only its dtype
        self._target_head = [head]
        self.out = (logits, pred)
        self.calls: list[dict] = []

    def forward(self, tokens: Tensor, hidden: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        self.calls.append({"tokens": tokens, "hidden": hidden.detach().clone(), "pos": position_ids})
        return self.out


class StubHeads(nn.Module):
    """Medusa heads as fixed affine maps: logits_i = hidden @ proj[i]^T + offset[i] -> [K, B, T, Vd]."""

    def __init__(self, proj: Tensor, offset: Tensor) -> None:
        super().__init__()
        self.register_buffer("t2d", draft_mask())
        self.draft_ids = torch.tensor(DRAFT_IDS)
        self.proj, self.offset = proj, offset

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.einsum("bth,kvh->kbtv", hidden, self.proj) + self.offset


# ---- references ---------------------------------------------------------------------------------------
def log_probs(z: Tensor) -> Tensor:
    return z - torch.logsumexp(z, -1, keepdim=True)


def teacher_full(weight: Tensor, final: Tensor, softcap: float | None) -> Tensor:
    """[B, T, V] float64 target logits, Gemma soft cap c * tanh(z / c) included."""
    z = final.double() @ weight.double().T
    return softcap * torch.tanh(z / softcap) if softcap else z


def run_lengths(agree: dict[tuple[int, int, int], bool], starts: list[tuple[int, int]]) -> list[int]:
    """Per counted position (b, t) of step 0: number of consecutive steps from 0 that agree."""
    runs = []
    for b, t in starts:
        r = 0
        while agree.get((b, t, r), False):
            r += 1
        runs.append(r)
    return runs


def eagle3_reference(full: Tensor, logits: list[Tensor], step_weight: float, mask_oov: bool, objective: str = "ce",
                     all_positions: bool = False, topk: int = 0, alignable_only: bool = False) -> tuple[Tensor, dict]:
    """Soft CE (or total variation 1/2 sum |p - q|, or both) of step k at position t against the
    teacher at t+1+k (draft-vocab softmax), which predicts x_{t+2+k}; counted when x_{t+2+k} is a
    real assistant token (any real token for the loss with all_positions) and (mask_oov) the
    teacher's full-vocab argmax is a draft token; loss = sum_k step_weight**k * mean_k. `topk` adds
    -sum over the teacher's top-k of p log q; `alignable_only` drops step k at base t unless every
    earlier step at t picked the teacher's argmax. Metrics count assistant tokens only."""

    def hit(k: int, b: int, t: int) -> bool:
        return t + 1 + k < T and int(logits[k][b, t].argmax()) == int(full[b, t + 1 + k, DRAFT_IDS].argmax())

    total = torch.zeros((), dtype=torch.float64)
    agree: dict[tuple[int, int, int], bool] = {}
    out: dict = {"acc": [], "count": [], "correct": [], "dropped_oov": 0, "trained": [], "overlap": []}
    starts = []
    for k, lg in enumerate(logits):
        loss_sum, n_loss, n, c, overlap = 0.0, 0, 0, 0, 0.0
        for b in range(B):
            for t in range(T):
                src, j = t + 1 + k, t + 2 + k  # teacher position, predicted token position
                if j >= T or not (ATTN[b][t] and ATTN[b][j]) or not (LOSS_MASK[b][j] or all_positions):
                    continue
                if mask_oov and int(full[b, src].argmax()) not in DRAFT_OF:
                    out["dropped_oov"] += 1
                    continue
                p = torch.softmax(full[b, src, DRAFT_IDS], -1)
                trains = not alignable_only or all(hit(i, b, t) for i in range(k))
                if trains and topk:
                    top = sorted(range(VD), key=lambda i: -float(p[i]))[:topk]
                    loss_sum = loss_sum - sum(p[i] * log_probs(lg[b, t])[i] for i in top)
                if trains and "ce" in objective:
                    loss_sum = loss_sum - (p * log_probs(lg[b, t])).sum()
                if trains and "tv" in objective:
                    loss_sum = loss_sum + 0.5 * (p - log_probs(lg[b, t]).exp()).abs().sum()
                n_loss += trains
                if not LOSS_MASK[b][j]:
                    continue
                n += 1
                overlap += float(torch.minimum(p, log_probs(lg[b, t].detach()).exp()).sum())
                agree[b, t, k] = int(lg[b, t].argmax()) == int(p.argmax())
                c += agree[b, t, k]
                if k == 0:
                    starts.append((b, t))
        total = total + step_weight**k * loss_sum / max(n_loss, 1)
        out["acc"].append(c / max(n, 1))
        out["count"].append(n)
        out["correct"].append(c)
        out["trained"].append(n_loss)
        out["overlap"].append(overlap)
    out["runs"] = run_lengths(agree, starts)
    return total, out


def eagle1_reference(full: Tensor, feat: Tensor, logits: Tensor, pred: Tensor, feature_weight: float,
                     ce_weight: float) -> tuple[Tensor, dict]:
    """Position t predicts f_{t+1} (SmoothL1, beta 1, mean over H) and x_{t+2} (soft CE against the
    target head on the true f_{t+1}); counted when x_{t+2} is a real assistant token."""
    reg_sum, ce_sum, n, c = 0.0, 0.0, 0, 0
    branches = set()
    for b in range(B):
        for t in range(T - 2):
            if not (ATTN[b][t + 1] and ATTN[b][t + 2] and LOSS_MASK[b][t + 2]):
                continue
            d = pred[b, t] - feat[b, t + 1].double()
            reg_sum = reg_sum + torch.where(d.abs() < 1, 0.5 * d**2, d.abs() - 0.5).mean()
            branches |= {bool(x) for x in d.abs() < 1}
            p = torch.softmax(full[b, t + 1], -1)
            ce_sum = ce_sum - (p * log_probs(logits[b, t])).sum()
            n += 1
            c += int(logits[b, t].argmax()) == int(p.argmax())
    loss = (feature_weight * reg_sum + ce_weight * ce_sum) / max(n, 1)
    return loss, {"feature_loss": reg_sum / max(n, 1), "ce_loss": ce_sum / max(n, 1), "count": n, "correct": c,
                  "both_smooth_l1_branches": branches == {True, False}}


def medusa_label(b: int, j: int, full: Tensor | None) -> int | None:
    """Draft id head label for predicted position j: the teacher's draft-vocab argmax at j-1
    (self-distillation), or the data token x_j (None when outside the draft vocab)."""
    if full is not None:
        return int(full[b, j - 1, DRAFT_IDS].argmax())
    return DRAFT_OF.get(INPUT_IDS[b][j])


def medusa_reference(logits: Tensor, step_weight: float, topk: int, full: Tensor | None = None) -> tuple[Tensor, dict]:
    """Head i at position t predicts x_{t+2+i}: CE against the data token (hard) or soft CE against
    the teacher's draft-vocab distribution at t+1+i (`full` given); counted when x_{t+2+i} is a real
    assistant token and, with hard labels, a draft token; loss = sum_i step_weight**i * mean_i."""
    total = torch.zeros((), dtype=torch.float64)
    agree: dict[tuple[int, int, int], bool] = {}
    out: dict = {"acc": [], "count": [], "correct": [], "topk_correct": []}
    starts = []
    for i in range(logits.shape[0]):
        ce_sum, n, c, ck = 0.0, 0, 0, 0
        for b in range(B):
            for t in range(T):
                j = t + 2 + i
                if j >= T or not (ATTN[b][t] and ATTN[b][j] and LOSS_MASK[b][j]):
                    continue
                label = medusa_label(b, j, full)
                if label is None:
                    continue
                logq = log_probs(logits[i, b, t])
                if full is None:
                    ce_sum = ce_sum - logq[label]
                else:
                    ce_sum = ce_sum - (torch.softmax(full[b, j - 1, DRAFT_IDS], -1) * logq).sum()
                scores = logits[i, b, t].tolist()
                ranked = sorted(range(VD), key=lambda v, z=scores: -z[v])  # draft ids, best first
                n += 1
                agree[b, t, i] = ranked[0] == label
                c += agree[b, t, i]
                ck += label in ranked[:topk]
                if i == 0:
                    starts.append((b, t))
        total = total + step_weight**i * ce_sum / max(n, 1)
        out["acc"].append(c / max(n, 1))
        out["count"].append(n)
        out["correct"].append(c)
        out["topk_correct"].append(ck)
    out["runs"] = run_lengths(agree, starts)
    return total, out


def kl_reference(full_adapted: Tensor, full_original: Tensor, valid: list[list[int]]) -> Tensor:
    """Mean over valid positions of KL(p_original || p_adapted) = sum_v p_o (log p_o - log p_a)."""
    kl_sum, n = 0.0, 0
    for b in range(B):
        for t in range(T):
            if valid[b][t]:
                p, q = torch.softmax(full_original[b, t], -1), torch.softmax(full_adapted[b, t], -1)
                kl_sum = kl_sum + (p * (p.log() - q.log())).sum()
                n += 1
    return kl_sum / max(n, 1)


def close(got: float | Tensor, want: float | Tensor) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5)


def assert_metrics(got: dict, want: dict) -> None:
    assert got["count"] == want["count"]
    assert got["correct"] == want["correct"]
    assert got["acc"] == pytest.approx(want["acc"])
    if "overlap" in want and "overlap" in got:  # EAGLE-3: sum min(p, q), the T=1 acceptance chance
        assert got["overlap"] == pytest.approx(want["overlap"], rel=1e-5)
    assert (got["run_len_sum"], got["run_len_n"]) == (sum(want["runs"]), len(want["runs"]))
    tau = 1 + sum(want["runs"]) / len(want["runs"])
    assert simulated_tau(got["run_len_sum"], got["run_len_n"]) == pytest.approx(tau)


# ---- EAGLE-3 ----------------------------------------------------------------------------------------------
def eagle3_case(softcap: float | None, seed: int = 1) -> SimpleNamespace:
    """Random target head (rows of non-draft tokens scaled by 0.6, so the teacher's argmax is a
    draft token at most positions but not all) and features; drafter logits random, but copying
    the teacher's (so agreeing with it) at about 60% of (step, row, position)."""
    weight, final = randn(V, H, seed=seed), randn(B, T, H, seed=seed + 1, scale=1.5)
    weight[[v for v in range(V) if v not in DRAFT_OF]] *= 0.6
    full = teacher_full(weight, final, softcap)
    coin = torch.rand(STEPS, B, T, generator=torch.Generator().manual_seed(seed + 2)) < 0.6
    logits = []
    for k in range(STEPS):
        lg = randn(B, T, VD, seed=seed + 10 + k, scale=2.0)
        for b in range(B):
            for t in range(T - 1 - k):
                if coin[k, b, t]:
                    lg[b, t] = 3 * full[b, t + 1 + k, DRAFT_IDS].float()
        logits.append(lg.requires_grad_())
    target = StubTarget(weight, softcap)
    return SimpleNamespace(target=target, drafter=StubEagle3(logits), logits=logits, full=full,
                           feats={"final": final, "aux": randn(B, T, 3 * H, seed=seed + 3)})


@pytest.mark.parametrize(("step_weight", "mask_oov", "softcap"), [(0.8, True, None), (0.5, True, 2.5), (0.8, False, None)])
def test_eagle3_loss_matches_reference(step_weight: float, mask_oov: bool, softcap: float | None) -> None:
    """Value and gradient of sum_k w**k * mean soft CE, with the loss-mask / padding / out-of-vocab
    masks shifted per step and the teacher restricted to the draft vocab (soft cap included)."""
    case = eagle3_case(softcap)
    loss, metrics = eagle3_loss(case.drafter, case.target, make_batch(), case.feats, steps=STEPS,
                                step_weight=step_weight, mask_out_of_vocab=mask_oov)
    ref_logits = [lg.detach().double().requires_grad_() for lg in case.logits]
    want, info = eagle3_reference(case.full, ref_logits, step_weight, mask_oov)
    assert (info["dropped_oov"] > 0) == mask_oov  # the out-of-vocab mask has something to drop
    assert all(n > 0 for n in info["count"])
    close(loss, want)
    close(metrics["loss"], want)
    loss.backward()
    want.backward()
    for got_lg, ref_lg in zip(case.logits, ref_logits):
        close(got_lg.grad, ref_lg.grad)
    call = case.drafter.calls[0]  # the unroll reads x_{t+1+k}: the ids, padded by steps + 1
    assert call["ttt_steps"] == STEPS
    assert call["input_ids"].shape == (B, T + STEPS + 1)
    assert torch.equal(call["input_ids"][:, :T], torch.tensor(INPUT_IDS))
    assert torch.equal(call["valid"], torch.tensor(ATTN, dtype=torch.bool))


@pytest.mark.parametrize(("objective", "all_positions", "topk", "alignable"), [
    ("tv", False, 0, False), ("ce+tv", False, 0, False), ("ce", True, 0, False), ("tv", True, 0, False),
    ("ce", False, 3, False), ("ce", False, 0, True), ("ce+tv", True, 2, True)])
def test_eagle3_objectives_and_positions_match_reference(objective: str, all_positions: bool, topk: int,
                                                         alignable: bool) -> None:
    """Total variation (the rejection probability of speculative sampling), CE + TV, HASS's top-K
    term, GRIFFIN's alignable-only mask and training on every real token: value and gradient
    against the reference; metrics still count assistant tokens on every chain."""
    case = eagle3_case(None, seed=5 if alignable else 1)  # seed 5: chains break before step 1
    loss, metrics = eagle3_loss(case.drafter, case.target, make_batch(), case.feats, steps=STEPS, step_weight=0.8,
                                mask_out_of_vocab=True, objective=objective, all_positions=all_positions, topk=topk,
                                alignable_only=alignable)
    ref_logits = [lg.detach().double().requires_grad_() for lg in case.logits]
    want, info = eagle3_reference(case.full, ref_logits, 0.8, True, objective, all_positions, topk, alignable)
    if not alignable:
        assert (sum(info["trained"]) > sum(info["count"])) == all_positions  # user-turn tokens join the loss
    else:  # later steps lose the chains that broke; step 0 keeps all
        _, every = eagle3_reference(case.full, ref_logits, 0.8, True, objective, all_positions, topk, False)
        assert info["trained"][0] == every["trained"][0] and 0 < sum(info["trained"][1:]) < sum(every["trained"][1:])
    close(loss, want)
    loss.backward()
    want.backward()
    for got_lg, ref_lg in zip(case.logits, ref_logits):
        close(got_lg.grad, ref_lg.grad)
    assert_metrics(metrics, info)


def test_eagle3_tv_is_the_rejection_probability() -> None:
    """By hand: a drafter that puts all its mass on one draft token q = e_j has TV = 1 - p_j, the
    probability that speculative sampling rejects its draft; a perfect copy of the teacher has 0."""
    case = eagle3_case(None)
    onehot = torch.full((B, T, VD), -1e4)
    onehot[..., 2] = 0.0
    drafter = StubEagle3([onehot.clone().requires_grad_() for _ in range(1)])
    loss, _ = eagle3_loss(drafter, case.target, make_batch(), case.feats, steps=1, step_weight=1.0,
                          mask_out_of_vocab=False, objective="tv")
    want, n = 0.0, 0
    for b in range(B):
        for t in range(T - 2):
            if ATTN[b][t] and ATTN[b][t + 2] and LOSS_MASK[b][t + 2]:
                want += 1 - float(torch.softmax(case.full[b, t + 1, DRAFT_IDS], -1)[2])
                n += 1
    assert float(loss.detach()) == pytest.approx(want / n, rel=1e-5)


def test_eagle3_metrics_match_reference() -> None:
    """Per-step accuracy / count / correct, run lengths of the teacher-forced chain and simulated tau."""
    case = eagle3_case(None)
    _, metrics = eagle3_loss(case.drafter, case.target, make_batch(), case.feats, steps=STEPS, step_weight=0.8)
    _, want = eagle3_reference(case.full, [lg.detach().double() for lg in case.logits], 0.8, True)
    assert 0 < sum(want["correct"]) < sum(want["count"])  # agreement is neither all nor nothing
    assert len(set(want["runs"])) >= 3  # run lengths differ between positions
    assert_metrics(metrics, want)


def test_eagle3_uniform_drafter_costs_log_vd_per_weighted_step() -> None:
    """By hand: uniform draft logits cost log(Vd) at every counted position of every step, so the
    loss is log(7) * (1 + 0.8 + 0.8**2) = 4.7305 whatever the teacher."""
    case = eagle3_case(None)
    drafter = StubEagle3([torch.zeros(B, T, VD, requires_grad=True) for _ in range(STEPS)])
    loss, _ = eagle3_loss(drafter, case.target, make_batch(), case.feats, steps=STEPS, step_weight=0.8,
                          mask_out_of_vocab=False)
    assert float(loss.detach()) == pytest.approx(math.log(VD) * (1 + 0.8 + 0.64), rel=1e-6)


# ---- EAGLE-1 ----------------------------------------------------------------------------------------------
def eagle1_case(seed: int = 0, softcap: float | None = None) -> SimpleNamespace:
    """Predicted features off the true next feature by N(0, 1.2) (both SmoothL1 branches); logits
    over the full vocab, copying the teacher's at about 60% of positions."""
    weight, feat = randn(V, H, seed=seed), randn(B, T, H, seed=seed + 1, scale=1.5)
    full = teacher_full(weight, feat, softcap)  # [B, T, V]: position t's row predicts x_{t+1}
    logits = randn(B, T, V, seed=seed + 2, scale=2.0)
    coin = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 3)) < 0.6
    for b in range(B):
        for t in range(T - 1):
            if coin[b, t]:
                logits[b, t] = 3 * full[b, t + 1].float()
    pred = torch.cat([feat[:, 1:], feat[:, :1]], 1) + randn(B, T, H, seed=seed + 4, scale=1.2)
    target = StubTarget(weight, softcap)
    logits, pred = logits.requires_grad_(), pred.requires_grad_()
    drafter = StubEagle1(logits, pred, target.lm_head)
    return SimpleNamespace(target=target, drafter=drafter, logits=logits, pred=pred, feat=feat, full=full)


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_eagle1_loss_matches_reference(softcap: float | None) -> None:
    """Value and gradient of (1.0 * SmoothL1 + 0.1 * soft CE) / n over counted positions, the two
    parts as logged, and the accuracy. The teacher is the target's real distribution: with Gemma's
    final logit soft cap applied (it was once left out for EAGLE-1 only)."""
    case = eagle1_case(softcap=softcap)
    case.drafter.eval()
    loss, metrics = eagle1_loss(case.drafter, case.target, make_batch(), {"final": case.feat}, feature_weight=1.0,
                                ce_weight=0.1, noise=0.0)
    ref_logits, ref_pred = case.logits.detach().double().requires_grad_(), case.pred.detach().double().requires_grad_()
    want, info = eagle1_reference(case.full, case.feat, ref_logits, ref_pred, 1.0, 0.1)
    assert info["both_smooth_l1_branches"]
    close(loss, want)
    close(metrics["loss"], want)
    close(metrics["feature_loss"], info["feature_loss"])
    close(metrics["ce_loss"], info["ce_loss"])
    assert (metrics["count"], metrics["correct"]) == ([info["count"]], [info["correct"]])
    assert 0 < info["correct"] < info["count"]
    assert metrics["acc"] == pytest.approx([info["correct"] / info["count"]])
    assert (metrics["run_len_sum"], metrics["run_len_n"]) == (info["correct"], info["count"])  # one step
    loss.backward()
    want.backward()
    close(case.logits.grad, ref_logits.grad)
    close(case.pred.grad, ref_pred.grad)


def test_eagle1_noise_perturbs_the_input_not_the_regression_target() -> None:
    """In training the drafter reads f_t + U(-noise, noise) with x_{t+1} at position t+1, but the
    loss still regresses the clean f_{t+1}; in eval mode the input is f_t exactly."""
    case = eagle1_case()
    batch = make_batch()
    case.drafter.train()
    loss, _ = eagle1_loss(case.drafter, case.target, batch, {"final": case.feat}, feature_weight=1.0,
                          ce_weight=0.1, noise=0.3)
    want, _ = eagle1_reference(case.full, case.feat, case.logits.detach().double(), case.pred.detach().double(),
                               1.0, 0.1)
    close(loss, want)
    call = case.drafter.calls[-1]
    delta = (call["hidden"] - case.feat).abs()
    assert 0 < float(delta.max()) <= 0.3
    assert torch.equal(call["tokens"][:, : T - 1], batch["input_ids"][:, 1:])
    assert torch.equal(call["pos"], torch.arange(1, T + 1).expand(B, T))
    case.drafter.eval()
    eagle1_loss(case.drafter, case.target, batch, {"final": case.feat}, feature_weight=1.0, ce_weight=0.1, noise=0.3)
    assert torch.equal(case.drafter.calls[-1]["hidden"], case.feat)


# ---- Medusa -----------------------------------------------------------------------------------------------
def medusa_case(softcap: float | None, self_distill: bool, seed: int = 0) -> SimpleNamespace:
    """Linear heads plus a per-position offset that boosts the right label at about 60% of
    (head, row, position), so agreement and run lengths vary."""
    weight, final = randn(V, H, seed=seed), randn(B, T, H, seed=seed + 1, scale=1.5)
    full = teacher_full(weight, final, softcap)
    proj, offset = randn(STEPS, VD, H, seed=seed + 2, scale=0.5), randn(STEPS, B, T, VD, seed=seed + 3)
    coin = torch.rand(STEPS, B, T, generator=torch.Generator().manual_seed(seed + 4)) < 0.6
    for i in range(STEPS):
        for b in range(B):
            for t in range(T - 2 - i):
                label = medusa_label(b, t + 2 + i, full if self_distill else None)
                if coin[i, b, t] and label is not None:
                    offset[i, b, t, label] += 6.0
    offset.requires_grad_()
    target = StubTarget(weight, softcap)
    return SimpleNamespace(target=target, heads=StubHeads(proj, offset), proj=proj, offset=offset, final=final,
                           full=full)


def heads_logits(proj: Tensor, offset: Tensor, hidden: Tensor) -> Tensor:
    """[K, B, T, Vd] float64: logits_i[b, t] = proj[i] @ hidden[b, t] + offset[i, b, t]."""
    out = torch.zeros(STEPS, B, T, VD, dtype=torch.float64)
    for i in range(STEPS):
        for b in range(B):
            for t in range(T):
                out[i, b, t] = proj[i].double() @ hidden[b, t].double() + offset[i, b, t]
    return out


@pytest.mark.parametrize(("self_distill", "softcap"), [(False, None), (True, 2.5)])
def test_medusa_loss_matches_reference(self_distill: bool, softcap: float | None) -> None:
    """Value and gradient of sum_i 0.8**i * mean CE_i with head i predicting x_{t+i+2} (data token
    mapped to its draft id, or the soft-capped teacher at t+i+1), and the per-head metrics."""
    case = medusa_case(softcap, self_distill)
    loss, metrics = medusa_loss(case.heads, case.target, make_batch(), case.final, step_weight=0.8,
                                self_distill=self_distill, topk=3)
    ref_offset = case.offset.detach().double().requires_grad_()
    want, info = medusa_reference(heads_logits(case.proj, ref_offset, case.final), 0.8, 3,
                                  case.full if self_distill else None)
    assert all(n > 0 for n in info["count"])
    assert 0 < sum(info["correct"]) < sum(info["topk_correct"]) < sum(info["count"])
    assert len(set(info["runs"])) >= 3
    close(loss, want)
    close(metrics["loss"], want)
    assert metrics["topk_correct"] == info["topk_correct"]
    assert_metrics(metrics, info)
    loss.backward()
    want.backward()
    close(case.offset.grad, ref_offset.grad)


def test_medusa_hard_labels_skip_tokens_outside_the_draft_vocab() -> None:
    """By hand: with uniform heads each counted position costs log(7); the loss is
    log(7) * (1 + 0.8 + 0.8**2), and head 0 counts the 5 loss-masked draft tokens at positions >= 2
    (x = 8, 10, 2 in row 0; 7, 3 in row 1), not the out-of-vocab 4 and 6."""
    case = medusa_case(None, False)
    heads = StubHeads(torch.zeros(STEPS, VD, H), torch.zeros(STEPS, B, T, VD, requires_grad=True))
    loss, metrics = medusa_loss(heads, case.target, make_batch(), case.final, step_weight=0.8, self_distill=False)
    assert float(loss.detach()) == pytest.approx(math.log(VD) * (1 + 0.8 + 0.64), rel=1e-6)
    assert metrics["count"][0] == 5


# ---- Medusa-2 ---------------------------------------------------------------------------------------------
def test_kl_to_original_matches_reference() -> None:
    """Value and gradient of the mean KL(original || adapted) over valid positions, full vocab,
    soft cap included; positions outside `valid` contribute nothing."""
    weight = randn(V, H, seed=0)
    original = randn(B, T, H, seed=1, scale=1.5)
    adapted = (original + randn(B, T, H, seed=2, scale=0.5)).requires_grad_()
    valid = [[0, 1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 0, 0, 0]]
    target = StubTarget(weight, softcap=2.5)
    kl = kl_to_original(target, adapted, original, torch.tensor(valid, dtype=torch.bool))
    ref_adapted = adapted.detach().double().requires_grad_()
    want = kl_reference(teacher_full(weight, ref_adapted, 2.5), teacher_full(weight, original, 2.5), valid)
    close(kl, want)
    kl.backward()
    want.backward()
    close(adapted.grad, ref_adapted.grad)


def medusa2_case(seed: int = 0) -> SimpleNamespace:
    case = medusa_case(None, False, seed)
    adapted = (case.final + randn(B, T, H, seed=seed + 20, scale=0.5)).requires_grad_()
    case.target = StubTarget(case.target.lm_head.weight, original=case.final, adapted=adapted)
    case.adapted = adapted
    return case


def test_medusa2_joint_loss_is_kl_plus_weighted_heads_on_the_adapted_target() -> None:
    """Joint stage: loss = 1.5 * KL(original || adapted) over positions whose next token is an
    assistant token + 0.2 * Medusa-1 loss of the heads on the adapted hidden states; value, the
    logged parts, and the gradient reaching the adapted hidden states."""
    case = medusa2_case()
    loss, metrics = medusa2_loss(case.heads, case.target, make_batch(), joint=True, step_weight=0.8,
                                 self_distill=False, heads_coefficient=0.2, kl_weight=1.5, topk=3)
    ref_adapted = case.adapted.detach().double().requires_grad_()
    head_loss, info = medusa_reference(heads_logits(case.proj, case.offset.detach(), ref_adapted), 0.8, 3)
    kl_valid = [[int(ATTN[b][t] and t + 1 < T and LOSS_MASK[b][t + 1]) for t in range(T)] for b in range(B)]
    kl = kl_reference(teacher_full(case.target.lm_head.weight, ref_adapted, None),
                      teacher_full(case.target.lm_head.weight, case.final, None), kl_valid)
    want = 1.5 * kl + 0.2 * head_loss
    assert case.target.body_calls == [False, True]  # original with the adapter off, then adapted
    close(loss, want)
    close(metrics["loss"], want)
    close(metrics["kl"], kl)
    close(metrics["head_loss"], head_loss)
    assert metrics["count"] == info["count"]
    loss.backward()
    want.backward()
    close(case.adapted.grad, ref_adapted.grad)


def test_medusa2_warmup_is_medusa1_on_the_original_target() -> None:
    """Warm-up stage: the Medusa-1 loss of the heads on the original (adapter off) hidden states, no KL."""
    case = medusa2_case()
    loss, metrics = medusa2_loss(case.heads, case.target, make_batch(), joint=False, step_weight=0.8,
                                 self_distill=False, heads_coefficient=0.2, kl_weight=1.5, topk=3)
    want, _ = medusa_reference(heads_logits(case.proj, case.offset.detach(), case.final), 0.8, 3)
    assert case.target.body_calls == [False]
    close(loss, want)
    assert "kl" not in metrics
