"""What Medusa-1 and Medusa-2 share: heads on the target's final hidden state, their folder and
the static tree learned from held-out head accuracies.

Head k at position t predicts token t+k+2 (arXiv 2401.10774); a reduced draft vocabulary works
as in EAGLE-3. The saved folder adds `rank_accuracy` [K][R] (held-out, teacher-forced) and
`tree_choices`, the static tree the decoder uses by default.

Deliberately not here: the losses (drafttrain.losses), the Medusa-2 adapter (medusa2.py), the
engine layouts (export/medusa.py), the drafting loop (decode/proposers/medusa.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from drafttrain.data import collate
from drafttrain.decode.kernels.greedy import greedy_lm_head_argmax_ref
from drafttrain.decode.proposers.medusa import MedusaProposer
from drafttrain.features import FeatureSpec, target_features
from drafttrain.losses import _shift
from drafttrain.methods.base import DrafterMethod
from drafttrain.models.medusa import MedusaHeads, config_from_target, learned_tree, load_medusa
from drafttrain.textconfig import text_config

__all__ = ["MedusaMethod", "medusa_rank_accuracy"]


class MedusaMethod(DrafterMethod):
    """Medusa heads; subclasses set `name` and `export` and implement `loss`."""

    acc_label = "per head"

    def build(self, cfg, target: nn.Module, train_ds, device) -> tuple[nn.Module, float]:
        tcfg, m = text_config(target.config), cfg.medusa
        mcfg = config_from_target(target.config, num_heads=m.num_heads, num_layers=m.num_layers,
                                  draft_vocab_size=cfg.drafter.draft_vocab_size or tcfg.vocab_size,
                                  share_lm_head=m.share_lm_head)
        heads = MedusaHeads(mcfg)
        return heads, self.wire(heads, cfg, target, train_ds, device)

    def feature_spec(self, cfg, drafter: nn.Module | None, num_layers: int) -> FeatureSpec:
        return FeatureSpec([], concat_aux=False)  # the final post-norm state only

    def decode_gamma(self, cfg) -> int:
        return min(cfg.train.decode_eval_gamma, cfg.medusa.num_heads)  # at most one draft per head

    def extras(self, cfg, drafter, target, train_ds, held_ds, tokenizer, pad: int) -> tuple[dict, object]:
        """`rank_accuracy` [K][R] on held-out data and `tree_choices`, the static tree learned from it."""
        m = cfg.medusa
        n = min(len(held_ds), m.tree_records)
        acc = medusa_rank_accuracy(drafter, target, [held_ds[i] for i in range(n)], pad, m.tree_max_rank) if n else []
        return {"rank_accuracy": acc, "tree_choices": learned_tree(acc, m.tree_budget) if acc else []}, None

    def summary_fields(self, fields: dict) -> dict:
        return {"tree_choices": fields["tree_choices"]}

    def load_proposer(self, folder: Path, target: nn.Module, *, tokenizer=None, **options):
        meta = json.loads((folder / "config.json").read_text())
        self.check_target(folder, meta, target)
        heads = load_medusa(folder, target)
        layers = meta["target"]["num_hidden_layers"]
        return MedusaProposer(heads, layers, tree=options.pop("tree", None) or meta.get("tree_choices"), **options)

    def check_target(self, folder: Path, meta: dict, target: nn.Module) -> None:
        """Raise ValueError when `target` is not the one these heads decode with (Medusa-2)."""

    def proposer_for_module(self, module: nn.Module, target: nn.Module, **options):
        if isinstance(module, MedusaHeads):
            return MedusaProposer(module, text_config(target.config).num_hidden_layers, **options)
        return None


@torch.no_grad()
def medusa_rank_accuracy(heads, target, records, pad: int, max_rank: int, batch_size: int = 4) -> list[list[float]]:
    """[K][R]: how often head k's rank-r candidate equals the target's greedy token at that place.

    Head k at position t is scored against the target's argmax at position t+k+1 (the token
    x_{t+k+2} greedy decoding would emit after the data prefix), over assistant positions: the
    per-depth acceptance a static tree sees (teacher-forced). Target = the adapted one for Medusa-2.
    """
    K = heads.cfg.num_heads
    hits = torch.zeros(K, max_rank, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    device = next(heads.parameters(), heads.d2t).device
    for start in range(0, len(records), batch_size):
        batch = collate([records[i] for i in range(start, min(len(records), start + batch_size))], pad)
        batch = {k: v.to(device) for k, v in batch.items()}
        h, c = _rank_hits(heads, target, batch, max_rank)
        hits += h
        counts += c
    return (hits / counts.clamp(min=1)[:, None]).tolist()


def _rank_hits(heads, target, batch: dict, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([K, R] hits, [K] counted positions) of one batch."""
    K = heads.cfg.num_heads
    hits = torch.zeros(K, max_rank, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    final = target_features(target, batch["input_ids"], batch["attention_mask"], FeatureSpec([]))["final"]
    w = target.get_output_embeddings().weight
    greedy = greedy_lm_head_argmax_ref(final.reshape(-1, final.shape[-1]).to(w.dtype), w).view(final.shape[:2])
    logits = heads(final)  # [K, B, T, Vd]
    attn, lmask = batch["attention_mask"].bool(), batch["loss_mask"].bool()
    for k in range(K):
        valid = attn & _shift(attn, k + 2, False) & _shift(lmask, k + 2, False)
        top = logits[k].topk(min(max_rank, logits.shape[-1]), -1).indices  # [B, T, R] draft ids
        top = top + heads.d2t[top]  # target ids
        want = _shift(greedy, k + 1, -1)
        hit = (top == want[..., None]) & valid[..., None]  # [B, T, R]
        hits[k, : hit.shape[-1]] += hit.sum((0, 1)).double().cpu()
        counts[k] += valid.sum().double().cpu()
    return hits, counts
