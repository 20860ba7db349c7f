"""EAGLE-1 (arXiv 2401.15077): the final target feature and the token embedding through one
decoder layer; the target's LM head reads the predicted feature.

Loss: feature_weight * SmoothL1(feature) + ce_weight * soft CE, with uniform noise on the input
feature (drafttrain.losses.eagle1_loss). Engines: hf, vllm (EagleLlamaForCausalLM), export/eagle.py.
"""

from __future__ import annotations

from drafttrain.export.eagle import EagleExport
from drafttrain.losses import eagle1_loss
from drafttrain.methods.eagle import EagleMethod
from drafttrain.methods.registry import register


class Eagle1(EagleMethod):
    name = "eagle1"
    fused = False
    export = EagleExport(fused_aux=False)

    def loss(self, cfg, drafter, target, batch, feats, step):
        d = cfg.drafter
        return eagle1_loss(drafter, target, batch, feats, feature_weight=d.feature_weight, ce_weight=d.ce_weight,
                           noise=d.noise)


register(Eagle1())
