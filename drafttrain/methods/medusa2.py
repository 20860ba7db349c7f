"""Medusa-2: heads trained jointly with a LoRA adapter on the target (PEFT, applied here and
nowhere else), after `medusa.warmup_steps` of heads only. Joint loss: kl_weight * KL(original ||
adapted) + heads_coefficient * the Medusa-1 loss on the adapted states; heads at lr *
head_lr_mult, the adapter at lr. The folder adds `adapter/` (and `merged_target/` with
medusa.save_merged); its heads decode only with that adapted target.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path

from torch import nn

from drafttrain.errors import TrainingError
from drafttrain.export.medusa import MedusaExport
from drafttrain.losses import medusa2_loss
from drafttrain.methods.medusa import MedusaMethod
from drafttrain.methods.registry import register
from drafttrain.models.medusa import adapter_id


class Medusa2(MedusaMethod):
    name = "medusa2"
    offline_features = False  # the loss runs the adapted target itself, with gradients
    export = MedusaExport(adapter=True)

    def check_config(self, cfg, num_processes: int) -> None:
        if cfg.features.mode == "offline":
            raise TrainingError("method=medusa2 trains the target's adapter, so it needs features.mode=online")
        if num_processes > 1:
            raise TrainingError("method=medusa2 runs on one process for now (the LoRA adapter is not synchronised "
                                "across processes); launch without accelerate's multi-process mode")

    def wrap_target(self, cfg, target: nn.Module) -> nn.Module:
        """A LoRA adapter on the target: base weights stay frozen, only the adapter's A/B train."""
        from peft import LoraConfig, get_peft_model

        m = cfg.medusa
        lora = LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=0.0,
                          target_modules=list(m.lora_target_modules))
        return get_peft_model(target, lora)

    def batch_features(self, cfg, target, batch, spec) -> dict:
        return {}  # the loss runs the (adapted) target itself

    def loss(self, cfg, drafter, target, batch, feats, step):
        m = cfg.medusa
        joint = step is None or step >= m.warmup_steps
        return medusa2_loss(drafter, target, batch, joint=joint, step_weight=cfg.drafter.step_weight,
                            self_distill=m.self_distill, heads_coefficient=m.heads_coefficient,
                            kl_weight=m.kl_weight, topk=m.topk)

    def param_groups(self, cfg, drafter, target) -> list[dict]:
        heads = [p for p in drafter.parameters() if p.requires_grad]
        adapter = [p for p in target.parameters() if p.requires_grad]
        return [{"params": heads, "lr": cfg.train.lr * cfg.medusa.head_lr_mult},
                {"params": adapter, "lr": cfg.train.lr}]

    def extras(self, cfg, drafter, target, train_ds, held_ds, tokenizer, pad: int) -> tuple[dict, object]:
        """Medusa-1's fields plus `adapter_id`; the writer saves adapter/ (and merged_target/)."""
        fields, _ = super().extras(cfg, drafter, target, train_ds, held_ds, tokenizer, pad)
        fields["adapter_id"] = uuid.uuid4().hex

        def write(folder: Path) -> None:
            target.save_pretrained(str(folder / "adapter"), safe_serialization=True)
            if cfg.medusa.save_merged:
                merged = copy.deepcopy(target).merge_and_unload()
                merged.config.drafttrain_adapter_id = fields["adapter_id"]
                merged.save_pretrained(str(folder / "merged_target"), safe_serialization=True)
                tokenizer.save_pretrained(str(folder / "merged_target"))

        return fields, write

    def check_target(self, folder: Path, meta: dict, target: nn.Module) -> None:
        """The heads predict the ADAPTED model's continuation: refuse any other target."""
        if adapter_id(target) != meta.get("adapter_id"):
            raise ValueError(f"{folder} is a Medusa-2 drafter: decode with its adapted target "
                             f"(target={folder}/merged_target, or drafttrain.models.medusa.load_medusa_target)")


register(Medusa2())
