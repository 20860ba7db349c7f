"""The drafter folder: config.json + model.safetensors + README.md, written atomically.

config.json holds the method, the target (spec, source, revision or file hash, hidden size,
vocab size, layer count, model type), the tokenizer hash, aux layer ids, draft vocab size and
coverage, the drafter's shape (`drafter`), the resolved training config and the final metrics.
Loading checks the target against it and says what differs.

What it does not do: engine formats (vLLM, SGLang) and the Hub; those live in export code.
Weights are safetensors only; nothing here unpickles.
"""

from __future__ import annotations

import json
from pathlib import Path

from drafttrain.atomic import atomic_dir as atomic_dir
from drafttrain.chat import tokenizer_hash
from drafttrain.errors import DrafterMismatchError as DrafterMismatchError
from drafttrain.textconfig import text_config

FORMAT_VERSION = 1


def target_signature(target) -> dict:
    cfg = text_config(target.config)
    info = getattr(target, "drafttrain_info", None)
    return {
        "spec": getattr(info, "spec", "") or getattr(target.config, "_name_or_path", ""),
        "source": getattr(info, "source", ""),
        "revision": getattr(info, "revision", ""),
        "model_type": getattr(cfg, "model_type", ""),
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
    }


def read_drafter_config(folder: str | Path) -> dict:
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a drafter folder (no config.json)")
    meta = json.loads(path.read_text())
    if "drafttrain" not in meta:
        raise ValueError(f"{folder}/config.json was not written by drafttrain (no 'drafttrain' block)")
    return meta


def check_target_match(meta: dict, target, folder: str | Path = "", tokenizer=None) -> None:
    """Raise DrafterMismatchError naming every field that differs between drafter and target."""
    want = meta.get("target", {})
    have = target_signature(target)
    diffs = [f"{k} {want[k]} vs {have[k]}" for k in ("hidden_size", "vocab_size", "num_hidden_layers")
             if k in want and want[k] != have[k]]
    if tokenizer is not None and meta.get("tokenizer_hash"):
        if tokenizer_hash(tokenizer) != meta["tokenizer_hash"]:
            diffs.append("tokenizer hash differs")
    if diffs:
        raise DrafterMismatchError(
            f"drafter {folder} was trained for target {want.get('spec', '?')!r}; this target differs: "
            + ", ".join(diffs) + " (drafter vs target). Use the target it was trained for."
        )


def load_module_folder(path: str | Path, build, target=None, *, map_location: str = "cpu"):
    """Load a drafter folder whose weights are one nn.Module with `d2t` / `t2d` buffers
    (EAGLE drafters, Medusa heads): build it from config.json's `drafter` block with `build`,
    load the safetensors strictly, validate the vocab mapping, and attach and check `target`."""
    from safetensors.torch import load_file

    from drafttrain.vocab import validate_vocab_mapping

    folder = Path(path)
    meta = read_drafter_config(folder)
    module = build(meta["drafter"])
    sd = load_file(str(folder / "model.safetensors"), device=map_location)
    missing, unexpected = module.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    validate_vocab_mapping(module.d2t, module.t2d)
    if target is not None:
        check_target_match(meta, target, folder)
        module.attach_target(target)
        p = next(target.parameters())
        module.to(device=p.device, dtype=p.dtype)
    module.eval()
    return module


def save_module_weights(module, folder: str | Path, dtype=None) -> Path:
    """The module's state dict (floats cast to `dtype` when given) as folder/model.safetensors; a
    module with `folded_state_dict` (an EAGLE-3 drafter trained on scaled features) saves that."""
    from safetensors.torch import save_file

    state = module.folded_state_dict() if hasattr(module, "folded_state_dict") else module.state_dict()
    sd = {k: v.detach().contiguous() for k, v in state.items()}
    if dtype is not None:
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    path = Path(folder) / "model.safetensors"
    save_file(sd, str(path), metadata={"format": "pt"})
    return path


def drafter_meta(method: str, target, tokenizer, *, aux_layer_ids: list[int], draft_vocab_size: int,
                 extra: dict, drafter_cfg: dict | None = None) -> dict:
    """The metadata every drafter folder records: format, method, target signature, tokenizer hash."""
    from drafttrain import __version__
    from drafttrain.data import tokenizer_hash

    meta = {"drafttrain": {"version": __version__, "format": FORMAT_VERSION}, "method": method,
            "target": target_signature(target), "tokenizer_hash": tokenizer_hash(tokenizer),
            "aux_layer_ids": list(aux_layer_ids), "draft_vocab_size": draft_vocab_size}
    if drafter_cfg is not None:
        meta["drafter"] = drafter_cfg
    return {**meta, **extra}


def save_drafter_folder(folder: str | Path, *, drafter, target, tokenizer, method: str, extra: dict,
                        card: str, dtype=None, write_extra=None) -> Path:
    """Write a drafttrain-native drafter folder atomically (a reader never sees a half-written one).

    `drafter` is a drafter module with a dataclass `cfg` (EAGLE drafter, Medusa heads);
    config.json holds `drafter_meta` with the `drafter` block, model.safetensors the state dict;
    `write_extra(tmp_folder)`, when given, adds files (Medusa-2's adapter) inside the same
    atomic write. (A draft LM saves a plain HF folder instead: methods/draft_lm.py.)
    """
    from dataclasses import asdict

    with atomic_dir(folder) as tmp:
        save_module_weights(drafter, tmp, dtype=dtype)
        if write_extra is not None:
            write_extra(tmp)
        meta = drafter_meta(method, target, tokenizer, aux_layer_ids=list(drafter.cfg.aux_layer_ids),
                            draft_vocab_size=drafter.cfg.draft_vocab_size, extra=extra,
                            drafter_cfg=json.loads(json.dumps(asdict(drafter.cfg))))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2, default=str))
        (tmp / "README.md").write_text(card)
    return Path(folder)


def model_card(meta: dict, summary: dict) -> str:
    """A short Markdown model card for a drafter folder."""
    t = meta.get("target", {})
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    return f"""---
library_name: drafttrain
tags: [speculative-decoding, {meta.get('method', 'drafter')}]
base_model: {t.get('spec', '')}
---
# {meta.get('method', 'drafter').upper()} drafter for `{t.get('spec', '')}`

Trained with [drafttrain](https://github.com/) (`{meta.get('recipe', '')}` recipe).

- target: `{t.get('spec', '')}` ({t.get('model_type', '')}, hidden {t.get('hidden_size')}, vocab {t.get('vocab_size')}, revision `{t.get('revision', '')}`)
- aux layers (HF hidden_states indices): {meta.get('aux_layer_ids')}
- draft vocab: {meta.get('draft_vocab_size')} tokens, covering {meta.get('vocab_coverage', 0):.1%} of training assistant tokens
- data: {meta.get('data_summary', '')}

## Training results (held-out)

| metric | value |
|---|---|
{rows}

τ here is *simulated*: teacher-forced greedy chain acceptance on held-out text, bonus token
included. Measure real speedups with `drafttrain eval`.
"""
