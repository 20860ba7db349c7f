"""The interface every drafter method implements, with the defaults most methods share.

A method is a small object (one per module in drafttrain/methods/, registered by name in
registry.py) that answers, for its kind of drafter, every question on which methods differ:

    training   build (drafter from the target), wrap_target (e.g. a LoRA adapter), check_config,
               feature_spec / batch_features (which target states it reads), loss (loss and
               metrics of one batch), param_groups, decode_gamma
    saving     extras (fields and extra files of the drafter folder), summary_fields, save
    decoding   load_proposer (a saved folder -> Proposer), proposer_for_module (a live module ->
               Proposer, or None when the module is not this method's), check_folder
    exporting  read_source, plan_export (one ExportPlan per engine format), check_export (parse
               the written config like the engine does), serve_command (for the model card)

The training loop, the proposer loader and the exporter call these hooks and never branch on a
method's name. Defaults: the drafter reads the target's final hidden state (online, or from the
offline cache), trains all its parameters at train.lr, saves a drafttrain folder and exports to
nothing.

Deliberately not here: any particular method (eagle3.py, eagle1.py, medusa1.py, medusa2.py,
draft_lm.py), the registry (registry.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from drafttrain import features
from drafttrain.features import FeatureSpec
from drafttrain.vocab import build_vocab_mapping, token_counts

__all__ = ["DrafterMethod"]


class DrafterMethod:
    """Base class of drafter methods; subclasses set `name` and implement build, loss and
    load_proposer (and the export hooks when engines can serve them)."""

    name: str = ""
    #: False when the drafter reads no target hidden states (a standalone draft LM)
    reads_target_features: bool = True
    #: False when training needs the target's forward with gradients (no offline feature cache)
    offline_features: bool = True
    #: what the per-position held-out accuracies (eval/acc_k) are, for the run summary
    acc_label: str = "per unroll step"

    # ---- training -------------------------------------------------------------------------------
    def build(self, cfg, target: nn.Module, train_ds, device) -> tuple[nn.Module, float]:
        """(drafter on `device`, share of training assistant tokens its draft vocab covers)."""
        raise NotImplementedError

    @staticmethod
    def wire(drafter: nn.Module, cfg, target: nn.Module, train_ds, device) -> float:
        """The steps every drafter with a `DraftVocab` shares after construction: pick the reduced
        draft vocabulary from the training tokens (when it is smaller than the target's), attach
        and initialise from the target, move to `device` in drafter.dtype. Returns the share of
        training assistant tokens the draft vocabulary covers."""
        coverage = 1.0
        if drafter.cfg.draft_vocab_size < drafter.cfg.vocab_size:
            counts = token_counts(train_ds, drafter.cfg.vocab_size)
            prompts = token_counts(train_ds, drafter.cfg.vocab_size, context=True)
            d2t, t2d, coverage = build_vocab_mapping(counts, drafter.cfg.draft_vocab_size, tie_break=prompts)
            drafter.set_vocab_mapping(d2t, t2d)
        drafter.attach_target(target)
        drafter.init_from_target(target)
        drafter.to(device=device, dtype=getattr(torch, cfg.drafter.dtype))
        return coverage

    def check_config(self, cfg, num_processes: int) -> None:
        """Raise TrainingError when `cfg` asks for something this method cannot do."""

    def wrap_target(self, cfg, target: nn.Module) -> nn.Module:
        """The target as training uses it (Medusa-2: with its LoRA adapter); default unchanged."""
        return target

    def feature_spec(self, cfg, drafter: nn.Module | None, num_layers: int) -> FeatureSpec:
        """Which target states a batch needs (`drafter` is None before it is built, e.g. in
        `drafttrain prepare`); default: the final post-norm state only."""
        return FeatureSpec([], concat_aux=False)

    def batch_features(self, cfg, target: nn.Module, batch: dict[str, Tensor], spec: FeatureSpec) -> dict:
        """Target features of a batch: read from the offline cache when the batch carries them."""
        if "aux" in batch:
            return {"aux": batch["aux"], "final": batch["final"].to(next(target.parameters()).dtype)}
        return features.target_features(target, batch["input_ids"], batch["attention_mask"], spec)

    def loss(self, cfg, drafter: nn.Module, target: nn.Module, batch: dict[str, Tensor], feats: dict,
             step: int | None) -> tuple[Tensor, dict]:
        """(loss, metrics) of one batch; `step` is None when evaluating."""
        raise NotImplementedError

    def param_groups(self, cfg, drafter: nn.Module, target: nn.Module) -> list[dict]:
        """Optimizer parameter groups (default: every trainable drafter parameter at train.lr)."""
        return [{"params": [p for p in drafter.parameters() if p.requires_grad]}]

    def decode_gamma(self, cfg) -> int:
        """Chain length of the decoding eval during training."""
        return cfg.train.decode_eval_gamma

    # ---- saving ---------------------------------------------------------------------------------
    def extras(self, cfg, drafter: nn.Module, target: nn.Module, train_ds, held_ds, tokenizer,
               pad: int) -> tuple[dict, Any]:
        """(extra config.json fields, a writer of extra files inside the atomic write, or None)."""
        return {}, None

    def summary_fields(self, fields: dict) -> dict:
        """What of `extras`' fields the run summary repeats."""
        return {}

    def save(self, folder: str | Path, *, drafter: nn.Module, target: nn.Module, tokenizer, card: str,
             extra: dict, write_extra=None) -> Path:
        """Write the drafter folder atomically (config.json with `method`, weights, card)."""
        from drafttrain.drafter_io import save_drafter_folder

        return save_drafter_folder(folder, drafter=drafter, target=target, tokenizer=tokenizer, method=self.name,
                                   extra=extra, card=card, write_extra=write_extra)

    # ---- decoding -------------------------------------------------------------------------------
    def load_proposer(self, folder: Path, target: nn.Module, *, tokenizer=None, **options):
        """The decoder's Proposer for a saved folder of this method."""
        raise NotImplementedError(f"method {self.name!r} has no proposer")

    def proposer_for_module(self, module: nn.Module, target: nn.Module, **options):
        """A Proposer around a live drafter module of this method, or None if it is not one."""
        return None

    def check_folder(self, folder: Path, meta: dict) -> str:
        """Why `folder` cannot be loaded (checked before any model loads), or "" when it can."""
        if "drafttrain" not in meta or not isinstance(meta.get("drafter"), dict):
            return f"{folder / 'config.json'} was not written by drafttrain (no 'drafttrain' and 'drafter' blocks)"
        if not (folder / "model.safetensors").is_file():
            return f"{self.name} drafter folder {folder} has no model.safetensors"
        return ""

    # ---- exporting (delegated to the method's engine layouts, drafttrain/export/) --------------
    #: an object with plan / check / serve_command / read_source (drafttrain.export), or None
    export: Any = None

    def _layouts(self):
        from drafttrain.export import ExportError

        if self.export is None:
            raise ExportError(f"cannot export method {self.name!r} (no engine layout for it yet)")
        return self.export

    def read_source(self, folder: Path) -> tuple[dict, dict[str, Tensor]]:
        """(metadata, tensors) of a drafter folder for export."""
        return self._layouts().read_source(folder)

    def plan_export(self, meta: dict, sd: dict[str, Tensor], fmt: str, *, verifier: str | None = None,
                    speculative_tokens: int = 3):
        """The ExportPlan of this drafter in engine format `fmt` (hf, vllm, sglang)."""
        return self._layouts().plan(meta, sd, fmt, verifier=verifier, speculative_tokens=speculative_tokens)

    def check_export(self, out: Path, plan, config: dict) -> list[str]:
        """Problems found parsing the written config the way its consumer does ([] = none)."""
        return self._layouts().check(out, plan, config)

    def serve_command(self, meta: dict, *, model_ref: str, verifier: str, fmt: str,
                      trust_remote_code: bool) -> str:
        """Shell lines that serve this export (for the model card); "" when no engine serves it."""
        if self.export is None:
            return ""
        return self.export.serve_command(meta, model_ref=model_ref, verifier=verifier, fmt=fmt,
                                         trust_remote_code=trust_remote_code)
