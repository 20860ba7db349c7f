"""EAGLE-3 (arXiv 2503.01840): three fused target layers, training-time test, reduced draft vocab.

Loss: sum_k step_weight^k * soft cross-entropy (or total variation, `drafter.objective`) against
the target over the draft vocabulary, unrolled `drafter.ttt_steps` steps on the drafter's own
outputs (drafttrain.losses.eagle3_loss), on assistant tokens or all (`drafter.positions`).
Engines: hf, vllm (speculators format), sglang (LlamaForCausalLMEagle3), see export/eagle.py.
"""

from __future__ import annotations

from drafttrain.export.eagle import EagleExport
from drafttrain.losses import eagle3_loss
from drafttrain.methods.eagle import EagleMethod
from drafttrain.methods.registry import register


class Eagle3(EagleMethod):
    name = "eagle3"
    fused = True
    export = EagleExport(fused_aux=True)

    def loss(self, cfg, drafter, target, batch, feats, step):
        d = cfg.drafter
        return eagle3_loss(drafter, target, batch, feats, steps=d.ttt_steps, step_weight=d.step_weight,
                           mask_out_of_vocab=d.mask_out_of_vocab, objective=d.objective,
                           all_positions=d.positions == "all" and step is not None, topk=d.topk,
                           topk_weight=d.topk_weight, alignable_only=d.alignable_only and step is not None)


register(Eagle3())
