"""Medusa-1: heads trained on a frozen target, sum_i step_weight^i * CE_i (hard labels, or the
target's distribution with medusa.self_distill). Engines: hf, vllm (MedusaModel), export/medusa.py.
"""

from __future__ import annotations

from drafttrain.export.medusa import MedusaExport
from drafttrain.losses import medusa_loss
from drafttrain.methods.medusa import MedusaMethod
from drafttrain.methods.registry import register


class Medusa1(MedusaMethod):
    name = "medusa1"
    export = MedusaExport(adapter=False)

    def loss(self, cfg, drafter, target, batch, feats, step):
        return medusa_loss(drafter, target, batch, feats["final"], step_weight=cfg.drafter.step_weight,
                           self_distill=cfg.medusa.self_distill, topk=cfg.medusa.topk)


register(Medusa1())
