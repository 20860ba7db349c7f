"""What EAGLE-3 and EAGLE-1 share: the drafter built from the target, its features, its folder.

Both are one decoder layer on top of target features, reading the target's embedding (and
EAGLE-1 its LM head); `fused` picks the layout (models/eagle.py): EAGLE-3 fuses three aux layers
and owns a reduced-vocabulary LM head, EAGLE-1 reads the final hidden state and the full vocab.

Deliberately not here: the losses (drafttrain.losses), the layouts engines load (export/eagle.py),
the drafting loop (decode/proposers/eagle.py).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from drafttrain.decode.proposers.eagle import EagleProposer
from drafttrain.errors import TrainingError
from drafttrain.features import FeatureSpec
from drafttrain.methods.base import DrafterMethod
from drafttrain.models.eagle import (
    EagleDrafter,
    config_from_target,
    default_aux_layer_ids,
)
from drafttrain.textconfig import text_config

__all__ = ["EagleMethod"]


class EagleMethod(DrafterMethod):
    """EAGLE drafters; subclasses set `name`, `fused` and `export` and implement `loss`."""

    fused: bool = True

    def build(self, cfg, target: nn.Module, train_ds, device) -> tuple[nn.Module, float]:
        tcfg = text_config(target.config)
        ecfg = config_from_target(target.config, fused=self.fused,
                                  draft_vocab_size=cfg.drafter.draft_vocab_size or tcfg.vocab_size,
                                  aux_layer_ids=cfg.drafter.aux_layer_ids or None)
        bad = [i for i in ecfg.aux_layer_ids if not 0 <= i <= tcfg.num_hidden_layers]
        if bad:
            raise TrainingError(f"drafter.aux_layer_ids {bad} out of range: the target has hidden_states "
                                f"0..{tcfg.num_hidden_layers}")
        drafter = EagleDrafter(ecfg)
        coverage = self.wire(drafter, cfg, target, train_ds, device)
        if self.fused and cfg.drafter.feature_scale and len(train_ds):
            from drafttrain.features import feature_scale

            drafter.set_feature_scale(feature_scale(target, train_ds, self.feature_spec(cfg, drafter, 0)))
        return drafter, coverage

    def feature_spec(self, cfg, drafter: nn.Module | None, num_layers: int) -> FeatureSpec:
        if drafter is not None:
            ids = list(drafter.cfg.aux_layer_ids)
        else:
            ids = list(cfg.drafter.aux_layer_ids) or (default_aux_layer_ids(num_layers) if self.fused else [num_layers])
        return FeatureSpec(ids, concat_aux=self.fused)

    def load_proposer(self, folder: Path, target: nn.Module, *, tokenizer=None, **options):
        from drafttrain.models.eagle import load_drafter

        return EagleProposer(load_drafter(folder, target, fused=self.fused), **options)

    def proposer_for_module(self, module: nn.Module, target: nn.Module, **options):
        if isinstance(module, EagleDrafter) and module.cfg.fused == self.fused:
            return EagleProposer(module, **options)
        return None
