"""Export a drafter folder: read it, plan its engine layout, write it, load it back and check it.

Formats (`FORMATS`): `hf` (the drafter's own folder, re-written with secrets scrubbed: for the Hub
and drafttrain's decoder), `vllm` and `sglang` (the layouts those engines load). Which formats a
drafter has, and how its tensors and config map into each, is its method's business: the method
registry (`drafttrain.methods.registry`) names the method and the method's engine layout answers
(`layout.EngineLayout`, families in eagle.py, medusa.py and draft_lm.py, each citing the engine
loader it was checked against). This module is the part every method shares:

- `read_source(folder)`: the folder's method (`registry.folder_method`) reads it;
  `read_native_source` is the reader of drafttrain-native folders (config.json with the
  `drafttrain` block + model.safetensors), which most layouts use.
- `plan_export(meta, sd, fmt)`: the method's `ExportPlan` for `fmt`.
- `write_export(plan, out, card)`: model.safetensors + config.json + README.md (+ side files),
  atomically.
- `verify_export(out, plan, source_keys)`: every source tensor is either mapped
  (`plan.sources`) or listed in `plan.omitted` with a reason; it fails on anything else, on a
  missing or unknown key, a wrong shape or dtype, a tensor that differs from the plan, or a
  missing or wrong config field, and then asks the method to parse the written config the way
  the consumer does.

What this module does not do: run vLLM or SGLang (neither is a dependency), convert between dtypes
(the export keeps the drafter's saved dtype), upload (see `hub`), or know any method's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from drafttrain.atomic import atomic_dir
from drafttrain.errors import ExportError
from drafttrain.export.layout import (  # noqa: F401 (re-exported: the public names of this module)
    DEFAULT_SPECULATIVE_TOKENS,
    FORMATS,
    ExportPlan,
    check_format,
    read_native_source,
    sglang_aux_layer_ids,
    vllm_aux_layer_ids,
)
from drafttrain.export.medusa import medusa_vllm_keys  # noqa: F401 (re-exported)
from drafttrain.export.security import check_folder, load_tensors
from drafttrain.methods.registry import UnknownMethodError, folder_method, get_method

__all__ = [
    "DEFAULT_SPECULATIVE_TOKENS", "FORMATS", "ExportPlan", "check_folder", "load_tensors", "medusa_vllm_keys",
    "method_of", "plan_export", "read_native_source", "read_source", "sglang_aux_layer_ids", "verify_export",
    "vllm_aux_layer_ids", "write_export",
]


def method_of(name: str | None):
    """The registered method called `name`; ExportError naming it and the known ones otherwise."""
    try:
        return get_method(name or "")
    except UnknownMethodError as e:
        raise ExportError(f"cannot export: {e}") from None


def read_source(folder: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """A drafter folder's metadata and tensors, read by its method after the pickle check
    (safetensors only). A folder that names no method is read as a drafttrain-native one, which
    says what it lacks."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"drafter folder {folder} does not exist")
    check_folder(folder)
    name = folder_method(folder)
    if name is None:
        return read_native_source(folder)
    return method_of(name).read_source(folder)


def plan_export(meta: dict, sd: dict[str, Tensor], fmt: str, *, verifier: str | None = None,
                speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> ExportPlan:
    """Map a drafter's tensors and config into `fmt` (its method's layout); raises ExportError when
    the format cannot hold it or no method of that name is known."""
    check_format(fmt)
    return method_of(meta.get("method")).plan_export(meta, sd, fmt, verifier=verifier,
                                                     speculative_tokens=speculative_tokens)


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


def _tensor_problems(plan: ExportPlan, got: dict[str, Tensor], source_keys: set[str]) -> list[str]:
    """Unaccounted source tensors, missing / unknown keys, wrong shapes, dtypes or values."""
    problems: list[str] = []
    unaccounted = source_keys - {s.split(" ")[0] for s in plan.sources.values()} - set(plan.omitted)
    if unaccounted:
        problems.append(f"source tensors neither mapped nor listed as omitted: {sorted(unaccounted)}")
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
    return problems


def _config_problems(out: Path, plan: ExportPlan, config: dict) -> list[str]:
    """Missing or wrong required config fields, then the consumer's own parse (the method's check)."""
    problems: list[str] = []
    for path, want in plan.required_config.items():
        try:
            have = _get(config, path)
        except (KeyError, IndexError):
            problems.append(f"config.json lacks {path}")
            continue
        if want is not None and have != want:
            problems.append(f"config.json {path} = {have!r}, expected {want!r}")
    method = method_of(plan.method)
    try:
        problems += method.check_export(out, plan, config)
    except Exception as e:  # noqa: BLE001 - any parse failure is a failed check, reported in one line
        problems.append(f"config.json does not load back ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})")
    return problems


def verify_export(out: str | Path, plan: ExportPlan, source_keys: set[str]) -> dict:
    """Load an export back and check it against the plan and the format's spec.

    Returns a summary {"tensors": n, "omitted": {...}}; raises ExportError naming every problem.
    """
    out = Path(out)
    check_folder(out)
    got = load_tensors(out / "model.safetensors")
    problems = _tensor_problems(plan, got, source_keys)
    problems += _config_problems(out, plan, json.loads((out / "config.json").read_text()))
    if problems:
        raise ExportError(f"export to {out} ({plan.fmt}) failed its check: " + "; ".join(problems))
    return {"tensors": len(got), "omitted": dict(plan.omitted)}
