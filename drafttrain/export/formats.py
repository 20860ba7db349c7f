"""Engine layouts for a drafter folder: plan the mapping, write it, load it back and check it.

Formats (`FORMATS`), each with the loader it was checked against:

- `hf`: the drafttrain drafter folder itself (config.json with the `drafttrain` block,
  model.safetensors, README.md), re-written from the loaded tensors with secrets scrubbed. Checked
  by loading it back with `drafttrain.models.eagle.load_drafter`. A draft LM (`draft_lm`) exports
  as a plain HF causal LM (HF's config.json, weights, tokenizer, generation config; drafttrain.json
  left out), checked with `AutoModelForCausalLM.from_pretrained`; engines take that folder as
  their draft model, so it has no vllm / sglang layout.
- `sglang` (EAGLE-3): `LlamaForCausalLMEagle3`, sgl-project/sglang
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
- `vllm` (EAGLE-3): the speculators format, vllm-project/vllm
  vllm/transformers_utils/configs/speculators/{base,algos}.py: `speculators_model_type: eagle3`,
  `speculators_config` {`proposal_methods[0].speculative_tokens`, `verifier.name_or_path`},
  `transformer_layer_config` (a Llama config), `draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual` (defaults to TRUE when absent, so it is written as false here),
  `eagle_aux_hidden_state_layer_ids`. Weights load through
  vllm/model_executor/models/llama_eagle3.py (`Eagle3LlamaForCausalLM`): same key names as SGLang
  (`midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, `t2d` skipped, fc is 3 x
  target_hidden_size wide). Aux ids: vllm/v1/worker/gpu_model_runner.py hands them to the target's
  `set_aux_hidden_state_layers`; vllm/model_executor/models/llama.py captures `hidden_states +
  residual` BEFORE layer idx, i.e. the output of layer idx - 1 = HF `hidden_states[idx]`: the
  same numbering as ours (vllm_id = our_id).
- `vllm` (EAGLE-1): `EagleLlamaForCausalLM`, vllm/model_executor/models/llama_eagle.py: Llama
  config with one layer, keys `fc.weight` (2H -> H, NO bias), `layers.0.self_attn.*`,
  `layers.0.post_attention_layernorm.weight`, `layers.0.mlp.*` (the first layer's input norm is an
  Identity, so no `input_layernorm`), no `norm`, no `lm_head` (the target's is used), embedding
  shared with the target. The engines look embeddings up WITHOUT Gemma's sqrt(H) scale, so the
  scale is folded into the embedding half of `fc.weight`; EAGLE-3 needs no fold (its
  input_layernorm is scale-invariant up to eps).
- Medusa (`MedusaModel`, vllm/model_executor/models/medusa.py + vllm/transformers_utils/configs/
  medusa.py): `medusa_vllm_keys` records the layout (`blocks.{i}.layers.{j}.weight` [H, H] (+ bias
  when `medusa_fc_bias`), `lm_heads.{i}.weight` [V, H], optional `token_map`; config
  `architectures: [MedusaModel]`, `model_type: medusa`, `hidden_size`, `vocab_size`, `num_heads`,
  `num_hidden_layers`, `truncated_vocab_size`). Its ResidualBlock is x <- x + SiLU(layer(x)) per
  layer, like ours, so blocks map 1:1 (our Linear has a bias: `medusa_fc_bias: true`); a reduced
  draft vocabulary becomes `token_map` (target ids of the draft vocab, = arange + d2t) with
  `truncated_vocab_size` = its size. Heads that share the target's LM head are refused (the folder
  does not hold it). A Medusa-2 export carries the heads only: serve the adapted target
  (`<drafter>/merged_target`) as the model. `hf` for Medusa-1 re-writes the heads' folder (checked
  with `drafttrain.models.medusa.load_medusa`); a Medusa-2 folder (heads + adapter/) is its own hf
  format and is refused there.

Every source tensor is either mapped (`plan.sources`) or listed in `plan.omitted` with a reason;
`verify_export` fails on anything else, on a missing or unknown key, a wrong shape or dtype, a
tensor that differs from the plan, or a missing or wrong config field.

What this module does not do: run vLLM or SGLang (neither is a dependency), convert between dtypes
(the export keeps the drafter's saved dtype), or upload (see `hub`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from drafttrain.export import ExportError
from drafttrain.export.security import check_folder, load_tensors, scrub_obj

FORMATS = ("hf", "vllm", "sglang")
DEFAULT_SPECULATIVE_TOKENS = 3

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
    method: str
    tensors: dict[str, Tensor]  # name in the export -> tensor written
    sources: dict[str, str]  # name in the export -> source key (and transform, if any)
    omitted: dict[str, str]  # source key -> why it is deliberately not written
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]]  # the format's full key set
    config: dict
    required_config: dict[str, object] = field(default_factory=dict)  # dotted path -> value
    extra_files: dict[str, str] = field(default_factory=dict)  # name in the export -> source file (copied)


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


# ---- key sets as the engines define them --------------------------------------------------------
def _eagle3_engine_keys(c, fdt: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
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


def _eagle1_vllm_keys(c, fdt: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
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


def medusa_vllm_keys(num_heads: int, num_layers: int, hidden: int, vocab: int, dtype: torch.dtype,
                     fc_bias: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """vLLM `MedusaModel`'s key set (for the Medusa exporter when Medusa drafters land)."""
    keys: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            keys[f"blocks.{i}.layers.{j}.weight"] = ((hidden, hidden), dtype)
            if fc_bias:
                keys[f"blocks.{i}.layers.{j}.bias"] = ((hidden,), dtype)
        keys[f"lm_heads.{i}.weight"] = ((vocab, hidden), dtype)
    return keys


def _native_keys(c, fdt: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Our own folder's key set, read off an EagleDrafter built on the meta device."""
    from drafttrain.models.eagle import EagleDrafter

    with torch.device("meta"):
        d = EagleDrafter(c)
    return {k: (tuple(v.shape), fdt if v.is_floating_point() else v.dtype) for k, v in d.state_dict().items()}


# ---- configs ---------------------------------------------------------------------------------------
def _llama_layer_config(c, *, vocab_size: int, dtype: torch.dtype) -> dict:
    """A one-layer Llama config describing the drafter's decoder layer."""
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


def _verifier(meta: dict, verifier: str | None) -> dict:
    t = meta.get("target", {})
    out = {"name_or_path": verifier or t.get("spec", "")}
    arch = _ARCHITECTURES.get(t.get("model_type", ""))
    if arch:
        out["architectures"] = [arch]
    return out


# ---- planning --------------------------------------------------------------------------------------
def _float_dtype(sd: dict[str, Tensor]) -> torch.dtype:
    return sd["fc.weight"].dtype


def _need_three_aux(c, engine: str) -> None:
    if c.method == "eagle3" and len(c.aux_layer_ids) != 3:
        raise ExportError(
            f"{engine} EAGLE-3 drafters fuse exactly 3 target layers (fc is 3H -> H); this drafter fuses "
            f"{len(c.aux_layer_ids)} ({c.aux_layer_ids}). Retrain with drafter.aux_layer_ids=[a,b,c]."
        )


def plan_export(meta: dict, sd: dict[str, Tensor], fmt: str, *, verifier: str | None = None,
                speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> ExportPlan:
    """Map a drafter's tensors and config into `fmt`; raises ExportError when the format cannot hold it."""
    from drafttrain.models.eagle import EagleConfig, validate_vocab_mapping

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r} (formats: {', '.join(FORMATS)})")
    method = meta.get("method", "")
    if method in ("medusa1", "medusa2"):
        return _plan_medusa(meta, sd, fmt)
    if method == "draft_lm":
        return _plan_draft_lm(meta, sd, fmt)
    if method not in ("eagle3", "eagle1"):
        raise ExportError(f"cannot export method {method!r} yet (exportable: eagle3, eagle1, medusa1, medusa2, "
                          "draft_lm)")
    c = EagleConfig(**meta["drafter"])
    validate_vocab_mapping(sd["d2t"], sd["t2d"])
    fdt = _float_dtype(sd)
    n_layers = int(meta.get("target", {}).get("num_hidden_layers", 0))

    if fmt == "hf":
        native = _native_keys(c, fdt)
        return ExportPlan(fmt, method, tensors=dict(sd), sources={k: k for k in sd}, omitted={}, spec=native,
                          config=scrub_obj(meta),
                          required_config={"method": method, "aux_layer_ids": list(c.aux_layer_ids),
                                           "draft_vocab_size": c.draft_vocab_size, "drafttrain.format": 1})

    if method == "eagle3":
        engine = "vLLM" if fmt == "vllm" else "SGLang"
        _need_three_aux(c, engine)
        spec = _eagle3_engine_keys(c, fdt)
        tensors = {k: sd[k] for k in spec}
        sources = {k: k for k in spec}
        layer = _llama_layer_config(c, vocab_size=c.vocab_size, dtype=fdt)
        if fmt == "sglang":
            ids = sglang_aux_layer_ids(c.aux_layer_ids, n_layers)
            config = {
                "architectures": ["LlamaForCausalLMEagle3"], **layer,
                "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size, "bias": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            }
            req = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                   "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
                   "hidden_size": c.hidden_size, "tie_word_embeddings": False,
                   "eagle_config.eagle_aux_hidden_state_layer_ids": ids,
                   "eagle_config.use_aux_hidden_state": True}
        else:
            ids = vllm_aux_layer_ids(c.aux_layer_ids, n_layers)
            config = {
                "architectures": ["Eagle3Speculator"],
                "speculators_model_type": "eagle3",
                "transformer_layer_config": layer,
                "draft_vocab_size": c.draft_vocab_size,
                "target_hidden_size": c.hidden_size,
                "norm_before_residual": False,  # residual = un-normed feature; vLLM defaults to True
                "eagle_aux_hidden_state_layer_ids": ids,
                "speculators_config": {
                    "algorithm": "eagle3",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                    "default_proposal_method": "greedy",
                    "verifier": _verifier(meta, verifier),
                },
                "torch_dtype": layer["torch_dtype"],
            }
            req = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                   "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
                   "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": ids,
                   "transformer_layer_config.num_hidden_layers": 1,
                   "transformer_layer_config.vocab_size": c.vocab_size,
                   "transformer_layer_config.hidden_size": c.hidden_size,
                   "speculators_config.proposal_methods.0.speculative_tokens": speculative_tokens,
                   "speculators_config.verifier.name_or_path": config["speculators_config"]["verifier"]["name_or_path"]}
        return ExportPlan(fmt, method, tensors, sources, omitted={}, spec=spec, config=config, required_config=req)

    # EAGLE-1
    if fmt == "sglang":
        raise ExportError("SGLang export is EAGLE-3 only here (LlamaForCausalLMEagle3); export EAGLE-1 with "
                          "--format vllm or --format hf")
    bias = sd.get("fc.bias")  # drafters from before fc lost its bias may carry one
    if bias is not None and bool(bias.ne(0).any()):
        raise ExportError(
            "vLLM's EAGLE-1 drafter (EagleLlamaForCausalLM) has no fc bias, and this drafter's fc.bias is "
            f"non-zero (max |b| = {float(bias.abs().max()):.3g}); exporting would change its drafts"
        )
    if bool(sd["d2t"].ne(0).any()) or not bool(sd["t2d"].all()):
        raise ExportError("EAGLE-1 drafters use the full target vocabulary, but this one's d2t/t2d is not the identity")
    spec = _eagle1_vllm_keys(c, fdt)
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
    config = {"architectures": ["EagleLlamaForCausalLM"], **_llama_layer_config(c, vocab_size=c.vocab_size, dtype=fdt)}
    req = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size}
    return ExportPlan(fmt, method, tensors, sources, omitted, spec, config, req)


def _plan_medusa(meta: dict, sd: dict[str, Tensor], fmt: str) -> ExportPlan:
    """Medusa heads -> vLLM `MedusaModel` (or our own folder for `hf`, Medusa-1 only)."""
    from drafttrain.models.eagle import validate_vocab_mapping
    from drafttrain.models.medusa import MedusaConfig, MedusaHeads

    method = meta["method"]
    c = MedusaConfig(**meta["drafter"])
    validate_vocab_mapping(sd["d2t"], sd["t2d"])
    fdt = sd["blocks.0.layers.0.weight"].dtype if c.num_layers else torch.float32
    if fmt == "sglang":
        raise ExportError("SGLang has no Medusa drafter; export Medusa heads with --format vllm")
    if fmt == "hf":
        if method == "medusa2":
            raise ExportError("a Medusa-2 drafter folder (heads + adapter/) is already the hf format; copy it, "
                              "or export the heads for vLLM with --format vllm")
        with torch.device("meta"):
            native = MedusaHeads(c).state_dict()
        spec = {k: (tuple(v.shape), fdt if v.is_floating_point() else v.dtype) for k, v in native.items()}
        return ExportPlan(fmt, method, tensors=dict(sd), sources={k: k for k in sd}, omitted={}, spec=spec,
                          config=scrub_obj(meta), required_config={"method": method, "drafttrain.format": 1})
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
    if method == "medusa2":
        omitted["adapter/"] = "Medusa-2: serve the adapted target (<drafter>/merged_target) as the vLLM model"
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
              "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": True, "max_paths": 64, "topk": 10,
              "torch_dtype": str(fdt).removeprefix("torch.")}
    req = {k: config[k] for k in ("architectures", "model_type", "hidden_size", "vocab_size", "num_heads",
                                  "num_hidden_layers", "truncated_vocab_size", "medusa_fc_bias")}
    return ExportPlan(fmt, method, tensors, sources, omitted, spec, config, req)


def _plan_draft_lm(meta: dict, sd: dict[str, Tensor], fmt: str) -> ExportPlan:
    """A draft LM is a plain HF causal LM: `hf` writes its config.json (HF's, without drafttrain's
    metadata), weights, tokenizer and generation config. vLLM and SGLang load that same folder as
    their draft model, so they get no layout of their own."""
    if fmt != "hf":
        raise ExportError(f"a draft LM is a plain HF causal LM: export it with --format hf and give that folder to "
                          f"{'vLLM' if fmt == 'vllm' else 'SGLang'} as the draft model")
    hf = meta["hf_config"]
    spec = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
    req = {k: hf[k] for k in ("architectures", "model_type", "vocab_size", "num_hidden_layers", "hidden_size")
           if k in hf}
    return ExportPlan(fmt, "draft_lm", tensors=dict(sd), sources={k: k for k in sd}, omitted={}, spec=spec,
                      config=hf, required_config=req, extra_files=dict(meta.get("hf_files", {})))


# ---- writing and checking -----------------------------------------------------------------------
def _get(config: dict, dotted: str):
    cur: object = config
    for part in dotted.split("."):
        if isinstance(cur, list):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise KeyError(dotted)
    return cur


def write_export(plan: ExportPlan, out: str | Path, card: str) -> Path:
    """Write model.safetensors + config.json + README.md atomically into `out`."""
    from safetensors.torch import save_file

    from drafttrain.drafter_io import atomic_dir

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ExportError(f"--out {out} exists and is not an export folder; choose an empty or new folder")
    with atomic_dir(out) as tmp:
        tensors = {k: v.detach().contiguous() for k, v in plan.tensors.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(card)
        for name, src in plan.extra_files.items():  # tokenizer, generation config (text files)
            (tmp / name).write_bytes(Path(src).read_bytes())
    return out


def verify_export(out: str | Path, plan: ExportPlan, source_keys: set[str]) -> dict:
    """Load an export back and check it against the plan and the format's spec.

    Returns a summary {"tensors": n, "omitted": {...}}; raises ExportError naming every problem.
    """
    out = Path(out)
    check_folder(out)
    problems: list[str] = []
    unaccounted = source_keys - {s.split(" ")[0] for s in plan.sources.values()} - set(plan.omitted)
    if unaccounted:
        problems.append(f"source tensors neither mapped nor listed as omitted: {sorted(unaccounted)}")
    got = load_tensors(out / "model.safetensors")
    missing, unknown = set(plan.spec) - set(got), set(got) - set(plan.spec)
    if missing:
        problems.append(f"missing keys {sorted(missing)}")
    if unknown:
        problems.append(f"unknown keys {sorted(unknown)}")
    for k in set(plan.spec) & set(got):
        shape, dtype = plan.spec[k]
        if tuple(got[k].shape) != shape or got[k].dtype != dtype:
            problems.append(f"{k}: {tuple(got[k].shape)} {got[k].dtype}, spec wants {shape} {dtype}")
        elif k in plan.tensors and not torch.equal(got[k], plan.tensors[k]):
            problems.append(f"{k}: values differ from the drafter's")
    config = json.loads((out / "config.json").read_text())
    for path, want in plan.required_config.items():
        try:
            have = _get(config, path)
        except (KeyError, IndexError):
            problems.append(f"config.json lacks {path}")
            continue
        if want is not None and have != want:
            problems.append(f"config.json {path} = {have!r}, expected {want!r}")
    problems += _engine_config_loads(out, plan, config)
    if problems:
        raise ExportError(f"export to {out} ({plan.fmt}) failed its check: " + "; ".join(problems))
    return {"tensors": len(got), "omitted": dict(plan.omitted)}


def _engine_config_loads(out: Path, plan: ExportPlan, config: dict) -> list[str]:
    """Parse the written config the way the consumer does (transformers / our own loader)."""
    from transformers import LlamaConfig

    try:
        if plan.method == "draft_lm":
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(str(out))
        elif plan.fmt == "hf" and plan.method in ("medusa1", "medusa2"):
            from drafttrain.models.medusa import load_medusa

            load_medusa(out)
        elif plan.fmt == "vllm" and plan.method in ("medusa1", "medusa2"):
            from transformers import PretrainedConfig

            cfg = PretrainedConfig.from_pretrained(str(out))  # vLLM's MedusaConfig is a PretrainedConfig
            if (cfg.num_heads, cfg.num_hidden_layers, cfg.truncated_vocab_size) != (
                    config["num_heads"], config["num_hidden_layers"], config["truncated_vocab_size"]):
                return ["num_heads / num_hidden_layers / truncated_vocab_size do not survive config parsing"]
        elif plan.fmt == "hf":
            from drafttrain.models.eagle import load_drafter

            load_drafter(out)
        elif plan.fmt == "vllm" and plan.method == "eagle3":
            layer = LlamaConfig(**config["transformer_layer_config"])
            if layer.num_hidden_layers != 1:
                return ["transformer_layer_config does not parse as a one-layer Llama config"]
        else:
            cfg = LlamaConfig.from_pretrained(str(out))
            if plan.fmt == "sglang" and (cfg.draft_vocab_size != config["draft_vocab_size"]
                                         or not isinstance(cfg.eagle_config, dict)):
                return ["draft_vocab_size / eagle_config do not survive transformers' config parsing"]
    except Exception as e:  # noqa: BLE001 - any parse failure is a failed check, reported in one line
        return [f"config.json does not load back ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
    return []


def read_source(folder: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """A drafter folder's config.json and tensors, after the pickle check (safetensors only)."""
    from drafttrain.drafter_io import read_drafter_config

    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"drafter folder {folder} does not exist")
    check_folder(folder)
    if (folder / "drafttrain.json").is_file():  # a draft LM: HF folder + drafttrain metadata beside it
        return _read_draft_lm(folder)
    try:
        meta = read_drafter_config(folder)
    except ValueError as e:
        raise ExportError(str(e)) from e
    return meta, load_tensors(folder / "model.safetensors")


def _read_draft_lm(folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """A draft-LM folder's drafttrain.json (+ HF config and side files) and its tensors (all shards)."""
    meta = json.loads((folder / "drafttrain.json").read_text())
    meta["hf_config"] = json.loads((folder / "config.json").read_text())
    side = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "tokenizer.model")
    meta["hf_files"] = {n: str(folder / n) for n in side if (folder / n).is_file()}
    sd: dict[str, Tensor] = {}
    for p in sorted(folder.glob("*.safetensors")):
        sd.update(load_tensors(p))
    if not sd:
        raise ExportError(f"{folder} holds no .safetensors weights")
    return meta, sd
