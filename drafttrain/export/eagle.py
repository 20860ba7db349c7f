"""EAGLE drafters in each engine's layout: `EagleExport(fused_aux=True)` is EAGLE-3, False EAGLE-1.

Formats, each with the loader it was checked against:

- `hf`: the drafttrain drafter folder itself (config.json with the `drafttrain` block,
  model.safetensors, README.md), re-written from the loaded tensors with secrets scrubbed. Checked
  by loading it back with `drafttrain.models.eagle.load_drafter`.
- `sglang` (fused aux, EAGLE-3): `LlamaForCausalLMEagle3`, sgl-project/sglang
  python/sglang/srt/models/llama_eagle3.py. Keys `fc.weight` (3H -> H, no bias unless
  config.bias), `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H), `midlayer.mlp.{gate,up,down}_proj
  .weight`, `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (offsets; read as hot-token ids
  = d2t + arange), `t2d` (skipped by the loader). No embedding: the target's is shared. The
  loader skips unknown names silently, so the key set is checked here. Residual = the un-normed
  fused feature (hidden_norm after the residual is taken), which is what our drafter does.
  Aux layers: config `eagle_config.eagle_aux_hidden_state_layer_ids`, read by
  python/sglang/srt/model_executor/model_runner.py and passed to the target's
  `set_eagle3_layers_to_capture`, which captures before layer `id + 1` (python/sglang/srt/models/
  llama.py: "layers_to_capture = [val + 1 for val in layer_ids]"), i.e. SGLang ids count decoder
  layer OUTPUTS from 0: sglang_id = our_id - 1.
- `vllm` (fused aux, EAGLE-3): the speculators format, vllm-project/vllm
  vllm/transformers_utils/configs/speculators/{base,algos}.py: `speculators_model_type: eagle3`,
  `speculators_config` {`proposal_methods[0].speculative_tokens`, `verifier.name_or_path`},
  `transformer_layer_config` (a Llama config), `draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual` (defaults to TRUE when absent, so it is written as false here),
  `eagle_aux_hidden_state_layer_ids`. Weights load through
  vllm/model_executor/models/llama_eagle3.py (`Eagle3LlamaForCausalLM`): same key names as SGLang
  (`midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, `t2d` skipped, fc is 3 x
  target_hidden_size wide; with a full draft vocabulary vLLM has no `draft_id_to_target_id` and
  refuses one, so d2t / t2d are left out then). Aux ids: vllm/v1/worker/gpu_model_runner.py hands them to the target's
  `set_aux_hidden_state_layers`; vllm/model_executor/models/llama.py captures `hidden_states +
  residual` BEFORE layer idx, i.e. the output of layer idx - 1 = HF `hidden_states[idx]`: the
  same numbering as ours (vllm_id = our_id).
- `vllm` (no fused aux, EAGLE-1): `EagleLlamaForCausalLM`, vllm/model_executor/models/llama_eagle.py:
  Llama config with one layer, keys `fc.weight` (2H -> H, NO bias), `layers.0.self_attn.*`,
  `layers.0.post_attention_layernorm.weight`, `layers.0.mlp.*` (the first layer's input norm is an
  Identity, so no `input_layernorm`), no `norm`, no `lm_head` (the target's is used), embedding
  shared with the target. The engines look embeddings up WITHOUT Gemma's sqrt(H) scale, so the
  scale is folded into the embedding half of `fc.weight`; EAGLE-3 needs no fold (its
  input_layernorm is scale-invariant up to eps). SGLang is not exported for EAGLE-1.

Deliberately not here: writing and checking the folder (formats.py), the aux numbering rules and
the shared config pieces (layout.py), the drafter module itself (models/eagle.py).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaConfig

from drafttrain.errors import ExportError
from drafttrain.export.layout import (
    DEFAULT_SPECULATIVE_TOKENS,
    ExportPlan,
    KeySpec,
    check_format,
    llama_layer_config,
    meta_key_spec,
    native_decode_note,
    read_native_source,
    sglang_aux_layer_ids,
    verifier_block,
    vllm_aux_layer_ids,
)
from drafttrain.export.security import scrub_obj
from drafttrain.models.eagle import EagleConfig, EagleDrafter, load_drafter
from drafttrain.vocab import validate_vocab_mapping

__all__ = ["EagleExport"]

# The engines' own name for the EAGLE-3 algorithm: speculators' `speculators_model_type` and
# `algorithm` (vllm/transformers_utils/configs/speculators/algos.py) and vLLM's
# `--speculative-config` method. An engine identifier that happens to equal our method's name.
_ENGINE_EAGLE3 = "eagle3"


# ---- key sets as the engines define them --------------------------------------------------------
def _fused_engine_keys(c: EagleConfig, fdt: torch.dtype) -> KeySpec:
    """`LlamaForCausalLMEagle3` (SGLang) / `Eagle3LlamaForCausalLM` (vLLM): one midlayer, fc 3H -> H."""
    H, hd, F = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    m = "midlayer."
    keys = {
        "fc.weight": (H, 3 * H),
        m + "input_layernorm.weight": (H,), m + "hidden_norm.weight": (H,),
        m + "self_attn.q_proj.weight": (q, 2 * H), m + "self_attn.k_proj.weight": (kv, 2 * H),
        m + "self_attn.v_proj.weight": (kv, 2 * H), m + "self_attn.o_proj.weight": (H, q),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (F, H), m + "mlp.up_proj.weight": (F, H), m + "mlp.down_proj.weight": (H, F),
        "norm.weight": (H,), "lm_head.weight": (c.draft_vocab_size, H),
    }
    out = {k: (s, fdt) for k, s in keys.items()}
    out["d2t"] = ((c.draft_vocab_size,), torch.int64)
    out["t2d"] = ((c.vocab_size,), torch.bool)
    return out


def _eagle_llama_keys(c: EagleConfig, fdt: torch.dtype) -> KeySpec:
    """`EagleLlamaForCausalLM` (vLLM): fc 2H -> H without bias, `layers.0` without input_layernorm."""
    H, hd, F = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    m = "layers.0."
    keys = {
        "fc.weight": (H, 2 * H),
        m + "self_attn.q_proj.weight": (q, H), m + "self_attn.k_proj.weight": (kv, H),
        m + "self_attn.v_proj.weight": (kv, H), m + "self_attn.o_proj.weight": (H, q),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (F, H), m + "mlp.up_proj.weight": (F, H), m + "mlp.down_proj.weight": (H, F),
    }
    return {k: (s, fdt) for k, s in keys.items()}


# ---- plans, one per layout ----------------------------------------------------------------------
def _plan_native(meta: dict, sd: dict[str, Tensor], c: EagleConfig, fdt: torch.dtype) -> ExportPlan:
    """`hf`: our own folder, every tensor as saved; the key set read off an EagleDrafter on meta."""
    method = meta["method"]
    with torch.device("meta"):
        native = meta_key_spec(EagleDrafter(c), fdt)
    return ExportPlan("hf", method, tensors=dict(sd), sources={k: k for k in sd}, omitted={}, spec=native,
                      config=scrub_obj(meta),
                      required_config={"method": method, "aux_layer_ids": list(c.aux_layer_ids),
                                       "draft_vocab_size": c.draft_vocab_size, "drafttrain.format": 1})


def _need_three_aux(c: EagleConfig, engine: str) -> None:
    if len(c.aux_layer_ids) != 3:
        raise ExportError(
            f"{engine} EAGLE-3 drafters fuse exactly 3 target layers (fc is 3H -> H); this drafter fuses "
            f"{len(c.aux_layer_ids)} ({c.aux_layer_ids}). Retrain with drafter.aux_layer_ids=[a,b,c]."
        )


def _plan_sglang(meta: dict, sd: dict[str, Tensor], c: EagleConfig, fdt: torch.dtype) -> ExportPlan:
    """EAGLE-3 as SGLang's `LlamaForCausalLMEagle3` (aux ids in SGLang's numbering: ours - 1)."""
    _need_three_aux(c, "SGLang")
    spec = _fused_engine_keys(c, fdt)
    tensors = {k: sd[k] for k in spec}
    ids = sglang_aux_layer_ids(c.aux_layer_ids, int(meta.get("target", {}).get("num_hidden_layers", 0)))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], **llama_layer_config(c, vocab_size=c.vocab_size, dtype=fdt),
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size, "bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }
    req = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
           "hidden_size": c.hidden_size, "tie_word_embeddings": False,
           "eagle_config.eagle_aux_hidden_state_layer_ids": ids,
           "eagle_config.use_aux_hidden_state": True}
    return ExportPlan("sglang", meta["method"], tensors, {k: k for k in spec}, omitted={},
                      spec=spec, config=config, required_config=req, engine_aux=("SGLang", ids))


def _plan_speculators(meta: dict, sd: dict[str, Tensor], c: EagleConfig, fdt: torch.dtype, *,
                      verifier: str | None, speculative_tokens: int) -> ExportPlan:
    """EAGLE-3 in the speculators format vLLM reads (`vllm serve DIR` alone works; aux ids as ours)."""
    _need_three_aux(c, "vLLM")
    spec = _fused_engine_keys(c, fdt)
    omitted = {}
    if c.draft_vocab_size == c.vocab_size:  # vLLM has no draft_id_to_target_id then, and refuses one
        if bool(sd["d2t"].ne(0).any()):
            raise ExportError("this drafter's draft vocabulary is the full target vocabulary in another order; "
                              "vLLM reads a full draft vocabulary as the identity: retrain with drafter.draft_vocab_size "
                              "below the target's vocab size")
        omitted = {k: "full draft vocabulary: the identity mapping, which vLLM assumes (it refuses a d2t then)"
                   for k in ("d2t", "t2d")}
        spec = {k: v for k, v in spec.items() if k not in omitted}
    tensors = {k: sd[k] for k in spec}
    layer = llama_layer_config(c, vocab_size=c.vocab_size, dtype=fdt)
    ids = vllm_aux_layer_ids(c.aux_layer_ids, int(meta.get("target", {}).get("num_hidden_layers", 0)))
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": _ENGINE_EAGLE3,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "norm_before_residual": False,  # residual = un-normed feature; vLLM defaults to True
        "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": _ENGINE_EAGLE3,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": verifier_block(meta, verifier),
        },
        "torch_dtype": layer["torch_dtype"],
    }
    req = {"speculators_model_type": _ENGINE_EAGLE3, "architectures": ["Eagle3Speculator"],
           "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
           "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": ids,
           "transformer_layer_config.num_hidden_layers": 1,
           "transformer_layer_config.vocab_size": c.vocab_size,
           "transformer_layer_config.hidden_size": c.hidden_size,
           "speculators_config.proposal_methods.0.speculative_tokens": speculative_tokens,
           "speculators_config.verifier.name_or_path": config["speculators_config"]["verifier"]["name_or_path"]}
    return ExportPlan("vllm", meta["method"], tensors, {k: k for k in spec}, omitted=omitted,
                      spec=spec, config=config, required_config=req, engine_aux=("vLLM", ids))


def _plan_eagle_llama(meta: dict, sd: dict[str, Tensor], c: EagleConfig, fdt: torch.dtype) -> ExportPlan:
    """EAGLE-1 as vLLM's `EagleLlamaForCausalLM`: `midlayer.` -> `layers.0.`, the embed scale folded into fc."""
    bias = sd.get("fc.bias")  # drafters from before fc lost its bias may carry one
    if bias is not None and bool(bias.ne(0).any()):
        raise ExportError(
            "vLLM's EAGLE-1 drafter (EagleLlamaForCausalLM) has no fc bias, and this drafter's fc.bias is "
            f"non-zero (max |b| = {float(bias.abs().max()):.3g}); exporting would change its drafts"
        )
    if bool(sd["d2t"].ne(0).any()) or not bool(sd["t2d"].all()):
        raise ExportError("EAGLE-1 drafters use the full target vocabulary, but this one's d2t/t2d is not the identity")
    spec = _eagle_llama_keys(c, fdt)
    tensors, sources = {}, {}
    for k in spec:
        src = "fc.weight" if k == "fc.weight" else k.replace("layers.0.", "midlayer.", 1)
        tensors[k], sources[k] = sd[src], src
    if c.embed_scale != 1.0:
        # The engine looks embeddings up unscaled; fc(concat(s*e, f)) == fc'(concat(e, f)) with the
        # embedding half of fc's columns multiplied by s.
        w = sd["fc.weight"].float().clone()
        w[:, : c.hidden_size] *= c.embed_scale
        tensors["fc.weight"] = w.to(fdt)
        sources["fc.weight"] = f"fc.weight (embedding columns x {c.embed_scale:g}, the target's embed scale)"
    omitted = {**({"fc.bias": "all zeros; vLLM's EAGLE-1 fc has no bias"} if bias is not None else {}),
               "d2t": "identity mapping; EAGLE-1 drafts over the full target vocabulary",
               "t2d": "identity mapping; EAGLE-1 drafts over the full target vocabulary"}
    config = {"architectures": ["EagleLlamaForCausalLM"], **llama_layer_config(c, vocab_size=c.vocab_size, dtype=fdt)}
    req = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size}
    return ExportPlan("vllm", meta["method"], tensors, sources, omitted, spec, config, req)


# ---- serve commands (for the model card) --------------------------------------------------------
# Target families an engine refuses for the fused (EAGLE-3) layout, with the engine's reason as run.
VLLM_REFUSES_FUSED = {
    "gemma3_text": "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested",
    "gemma3": "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested",
}


# Target families whose SGLang model captures other aux states than HF `hidden_states` (read in its source).
_SGLANG_GEMMA3 = ("Its Gemma 3 model, as read in source, captures the MLP branch without the residual stream as "
                  "the aux hidden state (since sglang PR #32383; fix proposed in PR #39286), not the HF "
                  "`hidden_states` this drafter was trained on, so acceptance collapses.")
SGLANG_WRONG_FUSED = {"gemma3_text": _SGLANG_GEMMA3, "gemma3": _SGLANG_GEMMA3}


def _serve_fused(model_ref: str, verifier: str, fmt: str, trc: str, model_type: str) -> str:
    """The launch line of the engine this folder's format is for (each engine numbers aux layers
    its own way, so a folder serves only its own engine)."""
    v, m = shlex.quote(verifier), shlex.quote(model_ref)
    if fmt == "vllm":
        if model_type in VLLM_REFUSES_FUSED:
            return (f"vLLM: not served. vLLM 0.32 refuses EAGLE-3 drafters for {model_type} targets "
                    f"(\"{VLLM_REFUSES_FUSED[model_type]}\"). {native_decode_note(model_ref, verifier)}")
        spec = json.dumps({"method": _ENGINE_EAGLE3, "model": model_ref, "num_speculative_tokens": 3})
        return (f"vLLM:\n\n```bash\n# the speculators config names the verifier, so this alone works:\n"
                f"vllm serve {m}{trc}\n# or explicitly:\nvllm serve {v}{trc} --speculative-config {shlex.quote(spec)}\n```\n")
    if fmt == "sglang":
        if model_type in SGLANG_WRONG_FUSED:
            return (f"SGLang: not recommended for {model_type} targets. {SGLANG_WRONG_FUSED[model_type]} "
                    + native_decode_note(model_ref, verifier))
        return (f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {v}{trc} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {m} --speculative-num-steps 3 --speculative-eagle-topk 4 "
                "--speculative-num-draft-tokens 8\n```\n")
    return native_decode_note(model_ref, verifier)


def _serve_eagle_llama(model_ref: str, verifier: str, fmt: str, trc: str) -> str:
    """vLLM's EAGLE (EagleLlamaForCausalLM) launch line, for the vllm folder only."""
    if fmt != "vllm":
        return native_decode_note(model_ref, verifier)
    spec = json.dumps({"method": "eagle", "model": model_ref, "num_speculative_tokens": 3})
    return (f"vLLM (EAGLE-1 layout):\n\n```bash\nvllm serve {shlex.quote(verifier)}{trc} "
            f"--speculative-config {shlex.quote(spec)}\n```\n")


class EagleExport:
    """The engine layouts of an EAGLE drafter.

    Args:
        fused_aux: True for the EAGLE-3 layout (fc over 3 fused aux layers, own draft-vocab LM head,
            d2t / t2d; formats hf, vllm (speculators), sglang); False for EAGLE-1 (fc over
            [embedding, final feature], the target's LM head; formats hf, vllm (EagleLlamaForCausalLM)).
    """

    reads_target_features = True

    def __init__(self, *, fused_aux: bool) -> None:
        self.fused_aux = fused_aux

    def __repr__(self) -> str:
        return f"EagleExport(fused_aux={self.fused_aux})"

    def read_source(self, folder: Path) -> tuple[dict, dict[str, Tensor]]:
        """(config.json, tensors) of an EAGLE drafter folder."""
        return read_native_source(folder)

    def plan(self, meta: dict, sd: dict[str, Tensor], fmt: str, *, verifier: str | None = None,
             speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> ExportPlan:
        """Map the drafter into `fmt`; raises ExportError when the format cannot hold it (and
        ValueError for a broken folder: a bad `drafter` block or vocab mapping)."""
        check_format(fmt)
        c = EagleConfig.from_dict(meta["drafter"], fused=self.fused_aux)
        validate_vocab_mapping(sd["d2t"], sd["t2d"])
        fdt = sd["fc.weight"].dtype
        if fmt == "hf":
            return _plan_native(meta, sd, c, fdt)
        if self.fused_aux:
            if fmt == "sglang":
                return _plan_sglang(meta, sd, c, fdt)
            return _plan_speculators(meta, sd, c, fdt, verifier=verifier, speculative_tokens=speculative_tokens)
        if fmt == "sglang":
            raise ExportError("SGLang export is EAGLE-3 only here (LlamaForCausalLMEagle3); export EAGLE-1 with "
                              "--format vllm or --format hf")
        return _plan_eagle_llama(meta, sd, c, fdt)

    def check(self, out: Path, plan: ExportPlan, config: dict) -> list[str]:
        """Parse the written config as its consumer does: our loader (hf), transformers' LlamaConfig
        (the speculators layer config, SGLang's and vLLM EAGLE-1's config.json)."""
        if plan.fmt == "hf":
            load_drafter(out, fused=self.fused_aux)
        elif plan.fmt == "vllm" and self.fused_aux:  # speculators: the layer config is nested
            if LlamaConfig(**config["transformer_layer_config"]).num_hidden_layers != 1:
                return ["transformer_layer_config does not parse as a one-layer Llama config"]
        else:
            cfg = LlamaConfig.from_pretrained(str(out))
            if plan.fmt == "sglang" and (cfg.draft_vocab_size != config["draft_vocab_size"]
                                         or not isinstance(cfg.eagle_config, dict)):
                return ["draft_vocab_size / eagle_config do not survive transformers' config parsing"]
        return []

    def serve_command(self, meta: dict, *, model_ref: str, verifier: str, fmt: str, trust_remote_code: bool) -> str:
        """vLLM and SGLang launch lines for this drafter (`model_ref`: Hub repo id or folder)."""
        trc = " --trust-remote-code" if trust_remote_code else ""
        if self.fused_aux:
            return _serve_fused(model_ref, verifier, fmt, trc, (meta.get("target") or {}).get("model_type", ""))
        return _serve_eagle_llama(model_ref, verifier, fmt, trc)
