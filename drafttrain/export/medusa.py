"""Medusa heads in each engine's layout: `MedusaExport(adapter=False)` is Medusa-1, True Medusa-2.

Formats, each with the loader it was checked against:

- `vllm`: `MedusaModel`, vllm/model_executor/models/medusa.py + vllm/transformers_utils/configs/
  medusa.py. `medusa_vllm_keys` records the layout (`blocks.{i}.layers.{j}.weight` [H, H] (+ bias
  when `medusa_fc_bias`), `lm_heads.{i}.weight` [V, H], optional `token_map`; config
  `architectures: [MedusaModel]`, `model_type: medusa`, `hidden_size`, `vocab_size`, `num_heads`,
  `num_hidden_layers`, `truncated_vocab_size`). Its ResidualBlock is x <- x + SiLU(layer(x)) per
  layer, like ours, so blocks map 1:1 (our Linear has a bias: `medusa_fc_bias: true`); a reduced
  draft vocabulary becomes `token_map` (target ids of the draft vocab, = arange + d2t) with
  `truncated_vocab_size` = its size. Heads that share the target's LM head are refused (the folder
  does not hold it). With an adapter (Medusa-2) the export carries the heads only: serve the
  adapted target (`<drafter>/merged_target`) as the model. Checked by parsing the config as a
  transformers `PretrainedConfig` (vLLM's MedusaConfig is one).
- `hf`: without an adapter (Medusa-1), the heads' own drafter folder re-written, checked with
  `drafttrain.models.medusa.load_medusa`; with one (Medusa-2: heads + adapter/) the drafter folder
  is its own hf format and is refused here.
- `sglang`: SGLang has no Medusa drafter; refused.

Deliberately not here: writing and checking the folder (formats.py), the heads themselves
(models/medusa.py), building the adapted target (models/medusa.py `load_medusa_target`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch
from torch import Tensor
from transformers import PretrainedConfig

from drafttrain.errors import ExportError
from drafttrain.export.layout import (
    DEFAULT_SPECULATIVE_TOKENS,
    ExportPlan,
    KeySpec,
    check_format,
    meta_key_spec,
    native_decode_note,
    read_native_source,
)
from drafttrain.export.security import scrub_obj
from drafttrain.models.medusa import MedusaConfig, MedusaHeads, load_medusa
from drafttrain.vocab import validate_vocab_mapping

__all__ = ["MedusaExport", "medusa_vllm_keys"]


def medusa_vllm_keys(num_heads: int, num_layers: int, hidden: int, vocab: int, dtype: torch.dtype,
                     fc_bias: bool = False) -> KeySpec:
    """vLLM `MedusaModel`'s key set: per head, `num_layers` residual blocks and an LM head."""
    keys: KeySpec = {}
    for i in range(num_heads):
        for j in range(num_layers):
            keys[f"blocks.{i}.layers.{j}.weight"] = ((hidden, hidden), dtype)
            if fc_bias:
                keys[f"blocks.{i}.layers.{j}.bias"] = ((hidden,), dtype)
        keys[f"lm_heads.{i}.weight"] = ((vocab, hidden), dtype)
    return keys


def _plan_native(meta: dict, sd: dict[str, Tensor], c: MedusaConfig, fdt: torch.dtype) -> ExportPlan:
    """`hf`: the heads' own folder, every tensor as saved; the key set read off MedusaHeads on meta."""
    method = meta["method"]
    with torch.device("meta"):
        spec = meta_key_spec(MedusaHeads(c), fdt)
    return ExportPlan("hf", method, tensors=dict(sd), sources={k: k for k in sd}, omitted={}, spec=spec,
                      config=scrub_obj(meta), required_config={"method": method, "drafttrain.format": 1})


def _plan_vllm(meta: dict, sd: dict[str, Tensor], c: MedusaConfig, fdt: torch.dtype, *, adapter: bool) -> ExportPlan:
    """vLLM `MedusaModel`: blocks and heads 1:1, a reduced draft vocab as `token_map`."""
    if c.share_lm_head:
        raise ExportError("these Medusa heads share the target's LM head, which the drafter folder does not hold; "
                          "retrain with medusa.share_lm_head=false to export for vLLM")
    spec = medusa_vllm_keys(c.num_heads, c.num_layers, c.hidden_size, c.draft_vocab_size, fdt, fc_bias=True)
    tensors = {k: sd[k] for k in spec}
    sources = {k: k for k in spec}
    truncated = c.draft_vocab_size < c.vocab_size
    omitted = {"t2d": "implied by token_map" if truncated else "identity mapping (full vocabulary)"}
    if truncated:
        spec["token_map"] = ((c.draft_vocab_size,), torch.int64)
        tensors["token_map"] = torch.arange(c.draft_vocab_size) + sd["d2t"]
        sources["token_map"] = "d2t (+ arange: target id of each draft id)"
    else:
        omitted["d2t"] = "identity mapping (full vocabulary)"
    if adapter:
        omitted["adapter/"] = "Medusa-2: serve the adapted target (<drafter>/merged_target) as the vLLM model"
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
              "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": True, "max_paths": 64, "topk": 10,
              "torch_dtype": str(fdt).removeprefix("torch.")}
    req = {k: config[k] for k in ("architectures", "model_type", "hidden_size", "vocab_size", "num_heads",
                                  "num_hidden_layers", "truncated_vocab_size", "medusa_fc_bias")}
    return ExportPlan("vllm", meta["method"], tensors, sources, omitted, spec, config, req)


class MedusaExport:
    """The engine layouts of a set of Medusa heads.

    Args:
        adapter: True when the heads were trained with a LoRA adapter on the target (Medusa-2): the
            vLLM export carries the heads only (the adapted target is served as the model), and the
            drafter folder (heads + adapter/) is its own hf format, so `hf` is refused.
    """

    reads_target_features = True

    def __init__(self, *, adapter: bool) -> None:
        self.adapter = adapter

    def __repr__(self) -> str:
        return f"MedusaExport(adapter={self.adapter})"

    def read_source(self, folder: Path) -> tuple[dict, dict[str, Tensor]]:
        """(config.json, tensors) of a Medusa drafter folder."""
        return read_native_source(folder)

    def plan(self, meta: dict, sd: dict[str, Tensor], fmt: str, *, verifier: str | None = None,
             speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> ExportPlan:
        """Medusa heads -> vLLM `MedusaModel` (or our own folder for `hf`, without an adapter only)."""
        check_format(fmt)
        c = MedusaConfig.from_dict(meta["drafter"])
        validate_vocab_mapping(sd["d2t"], sd["t2d"])
        fdt = sd["blocks.0.layers.0.weight"].dtype if c.num_layers else torch.float32
        if fmt == "sglang":
            raise ExportError("SGLang has no Medusa drafter; export Medusa heads with --format vllm")
        if fmt == "hf":
            if self.adapter:
                raise ExportError("a Medusa-2 drafter folder (heads + adapter/) is already the hf format; copy it, "
                                  "or export the heads for vLLM with --format vllm")
            return _plan_native(meta, sd, c, fdt)
        return _plan_vllm(meta, sd, c, fdt, adapter=self.adapter)

    def check(self, out: Path, plan: ExportPlan, config: dict) -> list[str]:
        """Parse the written folder as its consumer does: our loader (hf), a PretrainedConfig (vLLM)."""
        if plan.fmt == "hf":
            load_medusa(out)
            return []
        cfg = PretrainedConfig.from_pretrained(str(out))  # vLLM's MedusaConfig is a PretrainedConfig
        if (cfg.num_heads, cfg.num_hidden_layers, cfg.truncated_vocab_size) != (
                config["num_heads"], config["num_hidden_layers"], config["truncated_vocab_size"]):
            return ["num_heads / num_hidden_layers / truncated_vocab_size do not survive config parsing"]
        return []

    def serve_command(self, meta: dict, *, model_ref: str, verifier: str, fmt: str, trust_remote_code: bool) -> str:
        """vLLM's Medusa launch line (SGLang has none)."""
        if fmt != "vllm":
            return native_decode_note(model_ref, verifier)
        dv = meta.get("draft_vocab_size") or (meta.get("drafter") or {}).get("draft_vocab_size")
        tv = (meta.get("target") or {}).get("vocab_size")
        if dv and tv and dv < tv:
            return ("vLLM: not served. vLLM 0.32 cannot load Medusa heads over a reduced vocabulary (its loader slices "
                    "them by token_map, then asserts the full width); train with drafter.draft_vocab_size=0 for vLLM. "
                    + native_decode_note(model_ref, verifier))
        trc = " --trust-remote-code" if trust_remote_code else ""
        k = (meta.get("drafter") or {}).get("num_heads", 3)
        spec = json.dumps({"method": "medusa", "model": model_ref, "num_speculative_tokens": k})
        note = ("# Medusa-2: the verifier must be the ADAPTED target (<drafter>/merged_target, saved with\n"
                "# medusa.save_merged=true); the heads were trained on it.\n" if self.adapter else "")
        return (f"vLLM (MedusaModel layout from `--format vllm`):\n\n```bash\n{note}vllm serve {shlex.quote(verifier)}"
                f"{trc} --speculative-config {shlex.quote(spec)}\n```\n")
