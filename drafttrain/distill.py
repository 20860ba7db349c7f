"""The draft-LM method's training pieces: build the student, and the per-step loss with on-policy mixing.

`build_draft_lm` turns the `draft_lm.*` settings into a `DraftLM` (from the target's config or
from `draft_lm.init_from`); `draft_lm_step` is what `trainer.loss_step` calls for
`method=draft_lm`: with probability `draft_lm.on_policy_rate` (a coin drawn from (seed, step),
so a resumed run flips the same coins) the batch's responses are replaced by the student's own
samples of its prompts, scored by the teacher on them (DistillSpec: on-policy data matters
most), then the chosen divergence is taken over the assistant positions.

What it does not do: the divergences themselves (drafttrain.losses), the sampler
(drafttrain.rollouts), or anything when evaluating (step None: always the fixed data).
"""

from __future__ import annotations

import random

import torch
from torch import Tensor


def build_draft_lm(cfg, target, accelerator):
    """(DraftLM on the accelerator's device, vocab coverage 1.0) for `cfg.method == "draft_lm"`."""
    from drafttrain.models.draft_lm import DraftLMError, build_student
    from drafttrain.targets import load_tokenizer
    from drafttrain.trainer import TrainingError

    d = cfg.draft_lm
    try:
        student = build_student(target, load_tokenizer(cfg.target), num_layers=d.num_layers,
                                hidden_size=d.hidden_size, init_layers=d.init_layers or None,
                                init_from=d.init_from, dtype=getattr(torch, cfg.drafter.dtype))
    except DraftLMError as e:
        raise TrainingError(str(e)) from None
    if d.freeze_embeddings:
        student.model.get_input_embeddings().weight.requires_grad_(False)
        student.model.get_output_embeddings().weight.requires_grad_(False)
    student.to(accelerator.device)
    return student, 1.0


def on_policy_batch(student, batch: dict[str, Tensor], *, max_new_tokens: int, max_len: int, temperature: float,
                    seed: int) -> dict[str, Tensor]:
    """The batch with each row's response replaced by the student's sample of its prompt.

    A row's prompt is everything before its first assistant token (loss mask); rows without
    one are kept as they are. The new loss mask covers the sampled tokens.
    """
    from drafttrain.data import collate
    from drafttrain.rollouts import eos_ids, sample_responses

    ids, attn, lmask = batch["input_ids"].cpu(), batch["attention_mask"].cpu(), batch["loss_mask"].cpu()
    rows, prompts, slots = [], [], []
    for b in range(ids.shape[0]):
        n = int(attn[b].sum())
        hits = lmask[b, :n].nonzero()
        row = {"input_ids": ids[b, :n].tolist(), "loss_mask": lmask[b, :n].tolist()}
        if len(hits) and int(hits[0]) > 0:
            slots.append(b)
            prompts.append(row["input_ids"][: int(hits[0])])
        rows.append(row)
    if prompts:
        was = student.training
        student.eval()
        try:
            caps = [max(1, min(max_new_tokens, max_len - len(p))) for p in prompts]
            samples = sample_responses(student, prompts, max_new_tokens=caps, eos=eos_ids(student),
                                       seeds=[seed * 1_000_003 + b for b in slots], temperature=temperature)
        finally:
            student.train(was)
        for b, p, s in zip(slots, prompts, samples):
            rows[b] = {"input_ids": p + s, "loss_mask": [0] * len(p) + [1] * len(s)}
    out = collate(rows, 0)
    return {k: v.to(batch["input_ids"].device) for k, v in out.items()}


def draft_lm_step(cfg, drafter, target, batch: dict[str, Tensor], feats: dict, step: int | None):
    """(loss, metrics) of one draft-LM batch; `step` None = evaluation (never on-policy)."""
    from drafttrain.features import FeatureSpec, target_features
    from drafttrain.losses import draft_lm_loss

    d = cfg.draft_lm
    on_policy = step is not None and d.on_policy_rate > 0 and random.Random(cfg.seed * 1_000_003 + step).random() \
        < d.on_policy_rate
    if on_policy:
        raw = drafter.module if hasattr(drafter, "module") else drafter
        batch = on_policy_batch(raw.model, batch, max_new_tokens=d.on_policy_max_new_tokens, max_len=cfg.data.max_len,
                                temperature=d.on_policy_temperature, seed=cfg.seed * 7919 + step)
    if on_policy or "final" not in feats:
        feats = target_features(target, batch["input_ids"], batch["attention_mask"], FeatureSpec("draft_lm", []))
    loss, metrics = draft_lm_loss(drafter, target, batch, feats, kind=d.divergence, topk=d.teacher_topk,
                                  beta=d.jsd_beta, mix_weights=tuple(d.mix_weights), chunk=d.chunk_size,
                                  chain=cfg.train.decode_eval_gamma)
    metrics["on_policy"] = int(on_policy)
    return loss, metrics
