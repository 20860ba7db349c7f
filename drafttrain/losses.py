"""One small loss function per drafter method: (drafter, target, batch, features) -> loss, metrics.

EAGLE-3: training-time-test unroll; step k's logits at base position t predict x_{t+2+k} and are
scored by soft cross-entropy against the target's distribution at position t+1+k restricted to
the draft vocab (softmax over draft-vocab logits), weight step_weight**k. A position counts when
the predicted token is an assistant token (loss mask) and the target's full-vocab argmax lies in
the draft vocab.

EAGLE-1: one step; the drafter regresses the target's next post-norm feature (SmoothL1) and is
scored by soft cross-entropy of the target LM head on its prediction against the LM head on the
true feature; uniform noise on the input features.

Metrics: `acc_k` = top-1 agreement with the teacher at step k; `accept_t1_k` = mean sum min(p, q),
the probability that a draft sampled from the drafter at step k is accepted at T=1 (teacher-forced); `run_len` per position = number of
consecutive steps from 0 that agree, from which the simulated (teacher-forced) greedy
tau = 1 + mean(run_len) follows (bonus token included).

Draft LMs (DistillSpec-style): a token-level divergence (forward / reverse KL, JSD(beta), total
variation, or a weighted mix) between the teacher's and the student's next-token distributions at
assistant positions, over the full vocabulary or the teacher's top-k plus a rest bucket, computed
in position chunks so no [T, V] logits tensor is ever held.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from drafttrain.features import teacher_draft_logits, teacher_in_vocab


def _shift(x: Tensor, k: int, fill=0) -> Tensor:
    """x[:, k:] padded at the end to the same length along dim 1."""
    if k == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[1] = min(k, x.shape[1])
    pad = torch.full(pad_shape, fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, k:], pad], dim=1)


def eagle3_loss(drafter, target, batch: dict[str, Tensor], feats: dict[str, Tensor], *, steps: int,
                step_weight: float, mask_out_of_vocab: bool = True, objective: str = "ce",
                all_positions: bool = False, topk: int = 0, topk_weight: float = 1.0,
                alignable_only: bool = False) -> tuple[Tensor, dict]:
    """Returns (scalar loss, metrics with per-step acc / counts and run lengths).

    `objective`: "ce" (soft cross-entropy), "tv" (total variation 1/2 |p - q|_1, which is exactly
    the probability that speculative sampling rejects the draft) or "ce+tv". `topk` > 0 adds HASS's
    top-K distillation term -sum_{i in topK(p)} p_i log q_i (weight `topk_weight`). `all_positions`
    trains every real token instead of assistant tokens only. `alignable_only` (GRIFFIN) trains
    step k only where steps 0..k-1 of the same chain agreed with the teacher's argmax: positions
    decoding never reaches. Metrics always count assistant tokens, every chain.
    """
    if objective not in ("ce", "tv", "ce+tv"):
        raise ValueError(f"unknown EAGLE-3 objective {objective!r} (ce, tv or ce+tv)")
    input_ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    B, T = input_ids.shape
    raw = drafter.module if hasattr(drafter, "module") else drafter
    draft_ids = raw.draft_ids
    with torch.no_grad(), torch.profiler.record_function("teacher"):
        t_logits = teacher_draft_logits(target, feats["final"], draft_ids)  # [B, T, Vd]
        t_probs = torch.softmax(t_logits, dim=-1)
        t_top = t_logits.argmax(-1)  # [B, T] (draft ids)
        if mask_out_of_vocab:
            in_vocab = teacher_in_vocab(target, feats["final"], raw.t2d)  # [B, T]
        else:  # cheaper: train every position on the teacher renormalised over the draft vocab
            in_vocab = torch.ones_like(attn)
    ids_ext = torch.cat([input_ids, input_ids.new_zeros(B, steps + 1)], dim=1)
    outs = drafter(ids_ext, feats["aux"].to(raw.fc.weight.dtype), ttt_steps=steps, valid=attn)
    total = outs[0][0].new_zeros((), dtype=torch.float32)
    metrics: dict = {"acc": [], "count": [], "correct": [], "overlap": []}
    alive = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    aligned = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # chain agreed so far (any position)
    run_len = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)
    first_valid = None
    hits = []
    for k, (logits, _) in enumerate(outs):
        # teacher at position t+1+k predicts token t+2+k
        valid = _shift(attn, 1 + k, False) & _shift(loss_mask, 2 + k, False) & _shift(in_vocab, 1 + k, False)
        trained = (_shift(attn, 2 + k, False) & _shift(in_vocab, 1 + k, False)) if all_positions else valid
        if alignable_only:
            trained = trained & aligned
        p = _shift(t_probs, 1 + k, 0.0)
        logp = torch.log_softmax(logits.float(), dim=-1)
        per_pos = _eagle3_terms(p, logp, objective, topk, topk_weight)
        n = valid.sum()
        loss_k = (per_pos * trained).sum() / trained.sum().clamp(min=1)
        total = total + (step_weight**k) * loss_k
        with torch.no_grad():
            hit = logits.argmax(-1) == _shift(t_top, 1 + k, -1)
            aligned = aligned & hit
            agree = hit & valid
            hits.append(agree)
            metrics["acc"].append(float(agree.sum() / n.clamp(min=1)))
            metrics["count"].append(int(n))
            metrics["correct"].append(int(agree.sum()))
            # sum of min(p, q): the chance that a draft sampled from q is accepted at T=1 (1 - TV)
            metrics["overlap"].append(float((torch.minimum(p, logp.exp()).sum(-1) * valid).sum()))
            if first_valid is None:
                first_valid = valid
            alive = alive & agree
            run_len += alive.long()
    metrics["run_len_sum"] = int(run_len[first_valid].sum()) if first_valid is not None else 0
    metrics["run_len_n"] = int(first_valid.sum()) if first_valid is not None else 0
    if first_valid is not None:
        metrics["walk_tokens"], metrics["walk_cycles"] = walk_chain(torch.stack(hits), first_valid)
    metrics["loss"] = float(total.detach())
    return total, metrics


def walk_chain(hits: Tensor, scored: Tensor) -> tuple[int, int]:
    """(tokens, cycles) of a greedy chain walked over teacher-forced hits the way decoding visits
    roots: from base t it accepts the leading hits of steps 0.. (capped at the unroll depth) plus
    the bonus token, and the next base is t + accepted + 1.

    `hits` [K, B, T]: step k from base t agreed with the teacher; `scored` [B, T]: bases that
    count. tokens / cycles is the tau decoding reaches on this text; `simulated_tau` averages the
    run length over EVERY base instead, which overstates it (a decoder skips the easy stretches
    in few cycles and spends many on the hard ones: session 16 measured 1.81 vs 1.59 decoded).
    """
    K = hits.shape[0]
    # leading-hit run length per base, capped at K: first miss index, or K
    miss = torch.cat([~hits, hits.new_ones(1, *hits.shape[1:])], 0)
    run = miss.long().argmax(0)  # [B, T]
    tokens = cycles = 0
    for b in range(scored.shape[0]):
        idx = scored[b].nonzero().flatten().tolist()
        if not idx:
            continue
        ok, r, end = scored[b].tolist(), run[b].tolist(), idx[-1]
        t = idx[0]
        while t <= end:
            if ok[t]:
                a = min(r[t], K)
                cycles += 1
                tokens += min(a + 1, end + 1 - t)
                t += a + 1
            else:
                t += 1
    return tokens, cycles


def _eagle3_terms(p: Tensor, logp: Tensor, objective: str, topk: int, topk_weight: float) -> Tensor:
    """[B, T] per-position objective of one unroll step (teacher p, draft log-probs logp)."""
    per_pos = logp.new_zeros(logp.shape[:2])
    if objective in ("ce", "ce+tv"):
        per_pos = per_pos - (p * logp).sum(-1)
    if objective in ("tv", "ce+tv"):
        per_pos = per_pos + 0.5 * (p - logp.exp()).abs().sum(-1)
    if topk > 0:
        top_p, top_i = p.topk(min(topk, p.shape[-1]), dim=-1)
        per_pos = per_pos - topk_weight * (top_p * logp.gather(-1, top_i)).sum(-1)
    return per_pos


def eagle1_loss(drafter, target, batch: dict[str, Tensor], feats: dict[str, Tensor], *, feature_weight: float,
                ce_weight: float, noise: float) -> tuple[Tensor, dict]:
    input_ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    B, T = input_ids.shape
    raw = drafter.module if hasattr(drafter, "module") else drafter
    dtype = raw.fc.weight.dtype
    feat = feats["final"].to(dtype)  # [B, T, H]
    x = feat + (torch.rand_like(feat) * 2 - 1) * noise if (noise > 0 and raw.training) else feat
    tokens = _shift(input_ids, 1, 0)  # x_{t+1}
    pos = torch.arange(1, T + 1, device=input_ids.device)[None].expand(B, T)
    logits, pred = drafter(tokens, x, pos)
    target_feat = _shift(feat, 1, 0.0)  # f_{t+1}
    valid = _shift(attn, 1, False) & _shift(loss_mask, 2, False)
    n = valid.sum().clamp(min=1)
    reg = F.smooth_l1_loss(pred.float(), target_feat.float(), reduction="none").mean(-1)
    with torch.no_grad():  # the teacher is the target's own distribution, soft cap included
        t_logits = full_logits(target, target_feat)
        t_probs = torch.softmax(t_logits, -1)
    ce = -(t_probs * torch.log_softmax(logits.float(), -1)).sum(-1)
    loss = (feature_weight * (reg * valid).sum() + ce_weight * (ce * valid).sum()) / n
    with torch.no_grad():
        agree = (logits.argmax(-1) == t_logits.argmax(-1)) & valid
    metrics = {
        "acc": [float(agree.sum() / n)], "count": [int(valid.sum())], "correct": [int(agree.sum())],
        "run_len_sum": int(agree.sum()), "run_len_n": int(valid.sum()), "loss": float(loss.detach()),
        "feature_loss": float((reg.detach() * valid).sum() / n), "ce_loss": float((ce.detach() * valid).sum() / n),
    }
    return loss, metrics


def simulated_tau(run_len_sum: int, run_len_n: int) -> float:
    """Teacher-forced greedy chain tau: 1 (bonus) + mean accepted run length."""
    return 1.0 + run_len_sum / max(run_len_n, 1)


# ---- Medusa ---------------------------------------------------------------------------------------
def full_logits(target, hidden: Tensor) -> Tensor:
    """[N, H] final hidden -> [N, V] float32 logits of the target's own head (softcap included)."""
    from drafttrain.features import _softcap

    head = target.get_output_embeddings()
    logits = head(hidden.to(head.weight.dtype)).float()
    cap = _softcap(target)
    return cap * torch.tanh(logits / cap) if cap else logits


def medusa_loss(heads, target, batch: dict[str, Tensor], final: Tensor, *, step_weight: float,
                self_distill: bool, topk: int = 5) -> tuple[Tensor, dict]:
    """Medusa-1 loss: sum_i step_weight**i * CE_i, head i at position t predicting x_{t+i+2}.

    Labels are the data tokens, or with `self_distill` the target's own distribution at position
    t+i+1 restricted to the draft vocab (soft CE, as EAGLE-3's teacher). A position counts when
    the predicted token is an assistant token (loss mask) and, with hard labels, lies in the
    draft vocab.

    Args:
        heads: MedusaHeads (possibly wrapped by Accelerate).
        target: the target (only its LM head is read, for the self-distillation teacher).
        batch: input_ids, attention_mask, loss_mask [B, T].
        final: [B, T, H] the target's final post-norm hidden states (with grad in Medusa-2).
        topk: k of the logged top-k accuracy.

    Returns:
        (scalar loss, metrics: per-head top-1 correct / count (`acc_i`), top-k correct, run
        lengths of the teacher-forced greedy chain).
    """
    input_ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    raw = heads.module if hasattr(heads, "module") else heads
    logits = heads(final)  # [K, B, T, Vd]
    t2d = raw.t2d.to(input_ids.device)
    tgt_to_draft = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    if self_distill:
        with torch.no_grad():
            t_logits = teacher_draft_logits(target, final.detach(), raw.draft_ids)  # [B, T, Vd]
            t_probs, t_top = torch.softmax(t_logits, -1), t_logits.argmax(-1)
    total = logits.new_zeros((), dtype=torch.float32)
    metrics: dict = {"acc": [], "count": [], "correct": [], "topk_correct": [], "topk": topk}
    alive = torch.ones_like(attn)
    run_len = torch.zeros(attn.shape, dtype=torch.long, device=attn.device)
    first_valid = None
    for i in range(logits.shape[0]):
        valid = attn & _shift(attn, 2 + i, False) & _shift(loss_mask, 2 + i, False)
        logp = torch.log_softmax(logits[i].float(), -1)  # [B, T, Vd]
        if self_distill:
            ce = -(_shift(t_probs, 1 + i, 0.0) * logp).sum(-1)  # [B, T]
            label = _shift(t_top, 1 + i, 0)
        else:
            tok = _shift(input_ids, 2 + i, 0)
            valid = valid & t2d[tok]
            label = tgt_to_draft[tok].clamp(min=0)
            ce = -logp.gather(-1, label[..., None])[..., 0]
        n = valid.sum()
        total = total + (step_weight**i) * (ce * valid).sum() / n.clamp(min=1)
        with torch.no_grad():
            top = logits[i].topk(min(topk, logits.shape[-1]), -1).indices  # [B, T, k]
            agree = (top[..., 0] == label) & valid
            in_k = (top == label[..., None]).any(-1) & valid
            metrics["acc"].append(float(agree.sum() / n.clamp(min=1)))
            metrics["count"].append(int(n))
            metrics["correct"].append(int(agree.sum()))
            metrics["topk_correct"].append(int(in_k.sum()))
            if first_valid is None:
                first_valid = valid
            alive = alive & agree
            run_len += alive.long()
    metrics["run_len_sum"] = int(run_len[first_valid].sum())
    metrics["run_len_n"] = int(first_valid.sum())
    metrics["loss"] = float(total.detach())
    return total, metrics


def kl_to_original(target, adapted: Tensor, original: Tensor, valid: Tensor) -> Tensor:
    """Mean over valid positions of KL(p_original || p_adapted) of the next-token distribution.

    Args:
        adapted: [B, T, H] final hidden states with the adapter on (with grad).
        original: [B, T, H] the same with the adapter disabled (no grad).
        valid: [B, T] bool; only these rows go through the full-vocab LM head.
    """
    a = full_logits(target, adapted[valid])  # [N, V]
    with torch.no_grad():
        logp_o = torch.log_softmax(full_logits(target, original[valid]), -1)
    kl = (logp_o.exp() * (logp_o - torch.log_softmax(a, -1))).sum(-1)  # [N]
    return kl.sum() / valid.sum().clamp(min=1)


def medusa2_loss(heads, target, batch: dict[str, Tensor], *, joint: bool, step_weight: float,
                 self_distill: bool, heads_coefficient: float, kl_weight: float,
                 topk: int = 5) -> tuple[Tensor, dict]:
    """Medusa-2: heads warm-up (joint=False: Medusa-1 loss on the un-adapted target), then joint
    training: kl_weight * KL(original || adapted) + heads_coefficient * Medusa-1 loss on the
    adapted target's hidden states. `target` is the PEFT-wrapped target; the original
    distribution is the same model with the adapter disabled."""
    from drafttrain.features import FeatureSpec, target_features

    ids, attn = batch["input_ids"], batch["attention_mask"]
    spec = FeatureSpec([])
    with torch.no_grad(), target.disable_adapter():
        original = target_features(target, ids, attn, spec)["final"]  # [B, T, H]
    if not joint:
        return medusa_loss(heads, target, batch, original, step_weight=step_weight, self_distill=self_distill,
                           topk=topk)
    body = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    adapted = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # [B, T, H]
    head_loss, metrics = medusa_loss(heads, target, batch, adapted, step_weight=step_weight,
                                     self_distill=self_distill, topk=topk)
    valid = attn.bool() & _shift(batch["loss_mask"].bool(), 1, False)  # position t predicts x_{t+1}
    kl = kl_to_original(target, adapted, original, valid)
    loss = kl_weight * kl + heads_coefficient * head_loss
    metrics.update(loss=float(loss.detach()), head_loss=float(head_loss.detach()), kl=float(kl.detach()))
    return loss, metrics


# ---- draft LM (DistillSpec-style) ----------------------------------------------------------------
# Divergences between the teacher's next-token distribution p and the student's q, per position,
# given log-probabilities over the same support [N, K] (the full vocabulary, or the teacher's
# top-k tokens plus one bucket holding the rest of the mass). 0 * log 0 counts as 0.
DIVERGENCES = ("fkl", "rkl", "jsd", "tvd", "mix")


def _plogp_diff(logp: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """sum_i exp(logp_i) * (a_i - b_i), with terms where exp(logp_i) = 0 set to 0."""
    p = logp.exp()
    return torch.where(p > 0, p * (a - b), torch.zeros_like(p)).sum(-1)


def forward_kl(s_logp: Tensor, t_logp: Tensor) -> Tensor:
    """KL(p || q) = sum p (log p - log q): mass-covering; the usual distillation loss. [N, K] -> [N]."""
    return _plogp_diff(t_logp, t_logp, s_logp)


def reverse_kl(s_logp: Tensor, t_logp: Tensor) -> Tensor:
    """KL(q || p) = sum q (log q - log p): mode-seeking. [N, K] -> [N]."""
    return _plogp_diff(s_logp, s_logp, t_logp)


def jsd(s_logp: Tensor, t_logp: Tensor, beta: float = 0.5) -> Tensor:
    """JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q. [N, K] -> [N]."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"draft_lm.jsd_beta must lie strictly between 0 and 1, got {beta}")
    log_m = torch.logsumexp(torch.stack([t_logp + math.log(beta), s_logp + math.log(1 - beta)]), dim=0)
    return beta * _plogp_diff(t_logp, t_logp, log_m) + (1 - beta) * _plogp_diff(s_logp, s_logp, log_m)


def total_variation(s_logp: Tensor, t_logp: Tensor) -> Tensor:
    """TVD = 1/2 sum |p - q|; 1 - TVD is the acceptance probability of one draft token. [N, K] -> [N]."""
    return 0.5 * (t_logp.exp() - s_logp.exp()).abs().sum(-1)


def divergence(s_logp: Tensor, t_logp: Tensor, kind: str, *, beta: float = 0.5,
               mix_weights: tuple[float, ...] = (0.5, 0.0, 0.0, 0.5)) -> Tensor:
    """The divergence `kind` (one of DIVERGENCES); `mix` = weights . (fkl, rkl, jsd, tvd). [N, K] -> [N]."""
    parts = {"fkl": lambda: forward_kl(s_logp, t_logp), "rkl": lambda: reverse_kl(s_logp, t_logp),
             "jsd": lambda: jsd(s_logp, t_logp, beta), "tvd": lambda: total_variation(s_logp, t_logp)}
    if kind in parts:
        return parts[kind]()
    if kind != "mix":
        raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")
    if len(mix_weights) != 4:
        raise ValueError(f"draft_lm.mix_weights needs 4 weights (fkl, rkl, jsd, tvd), got {list(mix_weights)}")
    out = s_logp.new_zeros(s_logp.shape[:-1])
    for w, name in zip(mix_weights, ("fkl", "rkl", "jsd", "tvd")):
        if w:
            out = out + w * parts[name]()
    return out


def topk_buckets(s_logits: Tensor, t_logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Both distributions collapsed onto the teacher's top-k tokens plus one `rest` bucket.

    Args:
        s_logits / t_logits: [N, V] float32 logits of student / teacher.
        k: kept teacher tokens (k >= V means the full distribution).

    Returns:
        (s_logp [N, k+1], t_logp [N, k+1], teacher top-k ids [N, k]); the last column is the log
        of the mass outside the top-k, computed by logsumexp over the remaining logits (no 1 - x
        cancellation). With k >= V: the full log-softmaxes and ids of the teacher's argmax.
    """
    s_logp = torch.log_softmax(s_logits, -1)
    t_logp = torch.log_softmax(t_logits, -1)
    if k <= 0 or k >= t_logits.shape[-1]:
        return s_logp, t_logp, t_logits.argmax(-1, keepdim=True)
    idx = t_logits.topk(k, -1).indices  # [N, k]
    rest = torch.ones_like(t_logits, dtype=torch.bool).scatter(-1, idx, False)  # [N, V] outside top-k
    s_rest = torch.logsumexp(s_logp.masked_fill(~rest, -math.inf), -1, keepdim=True)  # [N, 1]
    t_rest = torch.logsumexp(t_logp.masked_fill(~rest, -math.inf), -1, keepdim=True)
    return (torch.cat([s_logp.gather(-1, idx), s_rest], -1), torch.cat([t_logp.gather(-1, idx), t_rest], -1), idx)


def token_divergence(s_logits: Tensor, t_logits: Tensor, kind: str, *, topk: int = 0, beta: float = 0.5,
                     mix_weights: tuple[float, ...] = (0.5, 0.0, 0.0, 0.5)) -> Tensor:
    """Per-position divergence from logits [N, V] (the direct, unchunked form): [N]."""
    s_logp, t_logp, _ = topk_buckets(s_logits.float(), t_logits.float(), topk)
    return divergence(s_logp, t_logp, kind, beta=beta, mix_weights=mix_weights)


def chunked_divergence(s_hidden: Tensor, s_head, t_hidden: Tensor, t_head, kind: str, *, topk: int = 0,
                       beta: float = 0.5, mix_weights: tuple[float, ...] = (0.5, 0.0, 0.0, 0.5),
                       chunk: int = 256) -> tuple[Tensor, Tensor, Tensor]:
    """`token_divergence` over position chunks, so no [N, V] logits tensor ever exists.

    Each chunk runs both LM heads on `chunk` positions ([chunk, V] float32), takes the divergence
    and drops the logits; under autograd the chunk is checkpointed (its logits are recomputed in
    backward), so memory is O(chunk * V) rather than O(N * V).

    Args:
        s_hidden: [N, h] student final hidden states (with grad); s_head: [n, h] -> [n, V] logits.
        t_hidden: [N, H] teacher final hidden states; t_head: [n, H] -> [n, V] logits (run without grad).

    Returns:
        (divergence [N], student argmax [N], teacher argmax [N]).
    """
    from torch.utils.checkpoint import checkpoint

    def one(s_h: Tensor, t_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        with torch.no_grad():
            t_logits = t_head(t_h).float()
        s_logits = s_head(s_h).float()
        s_logp, t_logp, idx = topk_buckets(s_logits, t_logits, topk)
        return (divergence(s_logp, t_logp, kind, beta=beta, mix_weights=mix_weights),
                s_logits.detach().argmax(-1), idx[:, 0])

    if s_hidden.shape[0] == 0:
        empty = s_hidden.new_zeros(0, dtype=torch.long)
        return s_hidden.sum(-1).float() * 0, empty, empty
    divs, s_args, t_args = [], [], []
    for lo in range(0, s_hidden.shape[0], chunk):
        s_h, t_h = s_hidden[lo: lo + chunk], t_hidden[lo: lo + chunk]
        d, sa, ta = checkpoint(one, s_h, t_h, use_reentrant=False) if s_h.requires_grad else one(s_h, t_h)
        divs.append(d)
        s_args.append(sa)
        t_args.append(ta)
    return torch.cat(divs), torch.cat(s_args), torch.cat(t_args)


def draft_lm_loss(drafter, target, batch: dict[str, Tensor], feats: dict[str, Tensor], *, kind: str,
                  topk: int = 0, beta: float = 0.5, mix_weights: tuple[float, ...] = (0.5, 0.0, 0.0, 0.5),
                  chunk: int = 256, chain: int = 5) -> tuple[Tensor, dict]:
    """Mean token-level divergence between teacher and student over assistant positions.

    Position t (student and teacher both reading x_0..x_t) predicts x_{t+1}; it counts when
    x_{t+1} is an assistant token (loss mask). The teacher's distribution comes from its final
    hidden state (`feats["final"]`) through its own LM head, chunk by chunk.

    Args:
        drafter: a `DraftLM` (possibly wrapped by Accelerate).
        target: the frozen target.
        batch: input_ids, attention_mask, loss_mask [B, T].
        feats: {"final": [B, T, H]} the target's final post-norm hidden states.
        kind / topk / beta / mix_weights / chunk: see `chunked_divergence`.
        chain: cap of the teacher-forced run length behind the simulated tau.

    Returns:
        (scalar loss, metrics: top-1 agreement with the teacher, run lengths, loss).
    """
    attn = batch["attention_mask"].bool()
    valid = attn & _shift(batch["loss_mask"].bool(), 1, False)  # [B, T]
    t_final = feats["final"][valid]  # [N, H]

    def head_fn(hidden: Tensor, model) -> tuple[Tensor, Tensor, Tensor]:
        return chunked_divergence(hidden[valid], lambda h: full_logits(model, h), t_final,
                                  lambda h: full_logits(target, h), kind, topk=topk, beta=beta,
                                  mix_weights=mix_weights, chunk=chunk)

    div, s_arg, t_arg = drafter(batch["input_ids"], batch["attention_mask"], head_fn=head_fn)
    n = valid.sum()
    loss = div.sum() / n.clamp(min=1)
    with torch.no_grad():
        agree = torch.zeros_like(valid)
        agree[valid] = s_arg == t_arg
        alive, run_len = valid.clone(), torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
        for k in range(chain):  # position t's teacher-forced chain: agreements at t, t+1, ...
            alive = alive & _shift(agree, k, False)
            run_len += alive.long()
    correct = int(agree.sum())
    metrics = {"acc": [correct / max(int(n), 1)], "count": [int(n)], "correct": [correct],
               "run_len_sum": int(run_len[valid].sum()), "run_len_n": int(n), "loss": float(loss.detach())}
    return loss, metrics
