"""Draft LMs: a small causal LM distilled from the target (DistillSpec, arXiv 2310.08461).

The student is built from the target's config or from `draft_lm.init_from` (copying chosen target
layers); its loss is the chosen divergence (`draft_lm.divergence`: fkl, rkl, jsd, tvd, ...) over
the assistant positions. With probability `draft_lm.on_policy_rate` (a coin drawn from (seed,
step), so a resumed run flips the same coins) a batch's responses are replaced by the student's
own samples of its prompts, scored by the teacher on them: on-policy data matters most. The
folder is a plain HF causal-LM folder plus drafttrain.json (and, with draft_lm.decode_vocab, the
head rows drafttrain's decoder drafts from); engines take it as their draft model.

Deliberately not here: the divergences (drafttrain.losses), the sampler (drafttrain.rollouts),
the model code (models/draft_lm.py), the drafting loop (decode/proposers/draft_lm.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import Tensor, nn

from drafttrain.data import collate
from drafttrain.decode.proposers.draft_lm import DraftLMProposer, check_draft_vocab
from drafttrain.errors import TrainingError
from drafttrain.export.draft_lm import DraftLMExport
from drafttrain.features import FeatureSpec, target_features
from drafttrain.losses import draft_lm_loss
from drafttrain.methods.base import DrafterMethod
from drafttrain.methods.registry import register
from drafttrain.models.draft_lm import (
    DraftLM,
    DraftLMError,
    build_student,
    decode_vocab,
    load_draft_lm,
    save_draft_lm,
    write_decode_vocab,
)
from drafttrain.rollouts import eos_ids, sample_responses
from drafttrain.targets import load_tokenizer
from drafttrain.vocab import token_counts

__all__ = ["DraftLMMethod", "on_policy_batch"]


class DraftLMMethod(DrafterMethod):
    name = "draft_lm"
    reads_target_features = False
    export = DraftLMExport()

    def build(self, cfg, target: nn.Module, train_ds, device) -> tuple[nn.Module, float]:
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
        if d.decode_vocab:  # decoding evals in training draft from the same head rows as the saved folder
            student.model.drafttrain_decode_vocab = decode_vocab(
                token_counts(train_ds, student.cfg.vocab_size), d.decode_vocab)[0]
        student.to(device)
        return student, 1.0

    def feature_spec(self, cfg, drafter, num_layers: int) -> FeatureSpec:
        return FeatureSpec([], concat_aux=False)  # the teacher's final state, for its logits

    def loss(self, cfg, drafter, target, batch: dict[str, Tensor], feats: dict, step: int | None):
        """(loss, metrics) of one batch; `step` None = evaluation (never on-policy)."""
        d = cfg.draft_lm
        on_policy = (step is not None and d.on_policy_rate > 0
                     and random.Random(cfg.seed * 1_000_003 + step).random() < d.on_policy_rate)
        if on_policy:
            raw = drafter.module if hasattr(drafter, "module") else drafter
            batch = on_policy_batch(raw.model, batch, max_new_tokens=d.on_policy_max_new_tokens,
                                    max_len=cfg.data.max_len, temperature=d.on_policy_temperature,
                                    seed=cfg.seed * 7919 + step)
        if on_policy or "final" not in feats:
            feats = target_features(target, batch["input_ids"], batch["attention_mask"], FeatureSpec([]))
        loss, metrics = draft_lm_loss(drafter, target, batch, feats, kind=d.divergence, topk=d.teacher_topk,
                                      beta=d.jsd_beta, mix_weights=tuple(d.mix_weights), chunk=d.chunk_size,
                                      chain=cfg.train.decode_eval_gamma)
        metrics["on_policy"] = int(on_policy)
        return loss, metrics

    def extras(self, cfg, drafter, target, train_ds, held_ds, tokenizer, pad: int) -> tuple[dict, object]:
        """With draft_lm.decode_vocab: the head rows the decoder drafts from, and their coverage."""
        if not cfg.draft_lm.decode_vocab:
            return {}, None
        ids, coverage = decode_vocab(token_counts(train_ds, drafter.cfg.vocab_size), cfg.draft_lm.decode_vocab)
        fields = {"decode_vocab_size": int(ids.numel()), "decode_vocab_coverage": round(coverage, 4)}
        return fields, lambda folder: write_decode_vocab(folder, ids)

    def save(self, folder, *, drafter, target, tokenizer, card: str, extra: dict, write_extra=None) -> Path:
        """A plain HF causal-LM folder; drafttrain's metadata goes to drafttrain.json beside it."""
        from drafttrain.drafter_io import drafter_meta

        meta = drafter_meta(self.name, target, tokenizer, aux_layer_ids=[],
                            draft_vocab_size=drafter.cfg.draft_vocab_size, extra=extra)
        return save_draft_lm(folder, drafter=drafter, tokenizer=tokenizer, meta=meta, card=card,
                             write_extra=write_extra)

    def load_proposer(self, folder: Path, target: nn.Module, *, tokenizer=None, **options):
        model = load_draft_lm(folder, target, tokenizer)
        check_draft_vocab(model, target)
        return DraftLMProposer(model, **options)

    def proposer_for_module(self, module: nn.Module, target: nn.Module, **options):
        if isinstance(module, DraftLM):  # the trainer's wrapper around an HF causal LM
            check_draft_vocab(module.model, target)
            return DraftLMProposer(module.model, **options)
        return None

    def check_folder(self, folder: Path, meta: dict) -> str:
        from drafttrain.decode.proposers.specs import weights_problem

        return weights_problem(folder, "draft-LM") or ""


def on_policy_batch(student, batch: dict[str, Tensor], *, max_new_tokens: int, max_len: int, temperature: float,
                    seed: int) -> dict[str, Tensor]:
    """The batch with each row's response replaced by the student's sample of its prompt.

    A row's prompt is everything before its first assistant token (loss mask); rows without
    one are kept as they are. The new loss mask covers the sampled tokens.
    """
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


register(DraftLMMethod())
