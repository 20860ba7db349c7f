"""What every engine layout is built from: the plan of one export and the helpers layouts share.

An engine layout is an object that knows, for one family of drafters, how each engine format holds
it (`EngineLayout`; the families are in eagle.py, medusa.py and draft_lm.py, and each drafter
method names its layout in `drafttrain.methods`). A layout's `plan` returns an `ExportPlan`: the
tensors to write, where each came from, what was left out and why, the format's full key set and
the config fields the consumer reads. `formats.write_export` writes a plan and
`formats.verify_export` loads the folder back and checks it against the plan.

Also here, because more than one layout needs them: the engines' aux-layer numbering
(`vllm_aux_layer_ids`, `sglang_aux_layer_ids`), a one-layer Llama config, the verifier block of
the speculators config, a key set read off a module built on the meta device, and the reader of a
drafttrain-native folder (`read_native_source`: config.json with its `drafttrain` block + one
model.safetensors).

Deliberately not here: any family's key names or config fields (eagle.py, medusa.py, draft_lm.py),
choosing a layout by method (the method registry does), writing and checking (formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from drafttrain.drafter_io import read_drafter_config
from drafttrain.errors import ExportError
from drafttrain.export.security import check_folder, load_tensors

__all__ = [
    "DEFAULT_SPECULATIVE_TOKENS", "FORMATS", "EngineLayout", "ExportPlan", "KeySpec", "check_format",
    "llama_layer_config", "meta_key_spec", "read_native_source", "sglang_aux_layer_ids", "verifier_block",
    "vllm_aux_layer_ids",
]

FORMATS = ("hf", "vllm", "sglang")
DEFAULT_SPECULATIVE_TOKENS = 3

#: export key -> (shape, dtype), as the consumer's loader expects it
KeySpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

# Verifier architectures for the speculators config, by the target's model_type.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral": "MistralForCausalLM",
}


@dataclass
class ExportPlan:
    """What one export writes and how each tensor got there."""

    fmt: str
    method: str  # the drafter's method name (for messages; nothing branches on it)
    tensors: dict[str, Tensor]  # name in the export -> tensor written
    sources: dict[str, str]  # name in the export -> source key (and transform, if any)
    omitted: dict[str, str]  # source key -> why it is deliberately not written
    spec: KeySpec  # the format's full key set
    config: dict
    required_config: dict[str, object] = field(default_factory=dict)  # dotted path -> value
    extra_files: dict[str, str] = field(default_factory=dict)  # name in the export -> source file (copied)
    # (engine name, aux layer ids in that engine's numbering) when they differ from ours, for the card
    engine_aux: tuple[str, list[int]] | None = None


class EngineLayout(Protocol):
    """How one family of drafters is held by each engine format (a method's `export` attribute)."""

    #: False when the drafter reads no target hidden states (the card says so)
    reads_target_features: bool

    def read_source(self, folder: Path) -> tuple[dict, dict[str, Tensor]]:
        """(metadata, tensors) of a drafter folder of this family (after the pickle check)."""
        ...

    def plan(self, meta: dict, sd: dict[str, Tensor], fmt: str, *, verifier: str | None = None,
             speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> ExportPlan:
        """Map the drafter into `fmt`; raises ExportError when the format cannot hold it."""
        ...

    def check(self, out: Path, plan: ExportPlan, config: dict) -> list[str]:
        """Parse the written config the way its consumer does; problems found ([] = none). May raise
        when the config does not parse at all; `verify_export` reports that as one line."""
        ...

    def serve_command(self, meta: dict, *, model_ref: str, verifier: str, fmt: str, trust_remote_code: bool) -> str:
        """Markdown with the shell lines that serve this export (for the model card)."""
        ...


def native_decode_note(model_ref: str, verifier: str) -> str:
    """What a card says where no engine serves its folder: drafttrain's own decoder does."""
    return (f"drafttrain's decoder runs this folder (`drafttrain eval target={verifier} proposers={model_ref}`); "
            "for an engine, export with `drafttrain export DRAFTER --format vllm|sglang` and use that folder's card.\n")


def check_format(fmt: str) -> None:
    """Raise ExportError for a format name that is not one of `FORMATS`."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r} (formats: {', '.join(FORMATS)})")


# ---- aux layer numbering ------------------------------------------------------------------------
def vllm_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """Our HF `hidden_states` indices -> vLLM `eagle_aux_hidden_state_layer_ids` (the same numbers).

    vLLM captures the residual stream entering layer idx, for idx in 0..N-1; HF index N (the
    final, post-norm state) has no vLLM equivalent.
    """
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ExportError(f"aux layer ids {bad} cannot be captured by vLLM (valid: 0..{num_layers - 1}, "
                          "HF hidden_states numbering)")
    return list(ids)


def sglang_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """Our HF `hidden_states` indices -> SGLang `eagle_aux_hidden_state_layer_ids` (minus one).

    SGLang captures before layer `id + 1`, so its id names the decoder layer whose output is used.
    """
    bad = [i for i in ids if not 1 <= i < num_layers]
    if bad:
        raise ExportError(f"aux layer ids {bad} cannot be named in SGLang's config (valid: 1..{num_layers - 1}, "
                          "HF hidden_states numbering)")
    return [i - 1 for i in ids]


# ---- pieces of key sets and configs -------------------------------------------------------------
def meta_key_spec(module: nn.Module, fdt: torch.dtype) -> KeySpec:
    """A module's own key set (float tensors in `fdt`); build the module under torch.device("meta")."""
    return {k: (tuple(v.shape), fdt if v.is_floating_point() else v.dtype) for k, v in module.state_dict().items()}


def llama_layer_config(c, *, vocab_size: int, dtype: torch.dtype) -> dict:
    """A one-layer Llama config describing the drafter's decoder layer (`c`: an EagleConfig)."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def verifier_block(meta: dict, verifier: str | None) -> dict:
    """The speculators config's `verifier`: the target as engines load it (+ its architecture)."""
    from drafttrain.targets import ALIAS_HUB

    t = meta.get("target", {})
    spec = t.get("spec", "")
    out = {"name_or_path": verifier or ALIAS_HUB.get(spec, (spec,))[0]}  # a packaged alias -> its Hub model
    arch = _ARCHITECTURES.get(t.get("model_type", ""))
    if arch:
        out["architectures"] = [arch]
    return out


# ---- reading ------------------------------------------------------------------------------------
def read_native_source(folder: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """A drafttrain-native folder's config.json and tensors, after the pickle check (safetensors only)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"drafter folder {folder} does not exist")
    check_folder(folder)
    try:
        meta = read_drafter_config(folder)
    except ValueError as e:
        raise ExportError(str(e)) from e
    return meta, load_tensors(folder / "model.safetensors")
