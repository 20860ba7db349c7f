"""`drafttrain export`: plan, write, card, load back and check; optionally push to the Hub.

    drafttrain export DRAFTER --format hf|vllm|sglang --out DIR
        [--push-to-hub REPO_ID [--private] [--revision R] [--dry-run]] [--results PATH] [--verifier ID]

What it does not do: train or evaluate; with `--dry-run` it never touches the network.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from drafttrain.export import ExportError

HELP = """usage: drafttrain export DRAFTER --format hf|vllm|sglang --out DIR
                        [--push-to-hub REPO_ID [--private] [--revision R] [--dry-run]]
                        [--results PATH] [--verifier ID] [--speculative-tokens K]

Writes DRAFTER (a drafttrain drafter folder) in the layout an engine loads, loads it back and
checks every key, shape, dtype and config field against that engine's loader, and writes a
model card (README.md). Weights are read and written as safetensors only.

  --format hf       the drafttrain folder (for the Hub and drafttrain's own decoder)
  --format vllm     EAGLE-3: speculators format (`vllm serve DIR` alone works); EAGLE-1: EagleLlamaForCausalLM;
                    Medusa: MedusaModel (blocks.*, lm_heads.*, token_map for a reduced vocab)
  --format sglang   EAGLE-3: LlamaForCausalLMEagle3 (no embedding; the target's is shared)
  --out DIR         folder to write (replaced atomically if it holds a previous export)
  --results PATH    a `drafttrain eval` results.json for the card (default: one next to DRAFTER)
  --verifier ID     the target as engines should load it and the card's base_model names it (Hub id or
                    path; default: the drafter's target; a Hub id is needed to push a local target's drafter)
  --push-to-hub ID  upload DIR to this Hub repo (token: HF_TOKEN or `hf auth login`)
  --private         create the repo private
  --revision R      upload to branch R (created if missing)
  --dry-run         write exactly the folder that would be uploaded, and upload nothing
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line via run_guarded, not argparse's usage dump
        raise ExportError(f"export: {message} (see drafttrain export --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="drafttrain export", add_help=False)
    p.add_argument("drafter")
    p.add_argument("--format", required=True, choices=("hf", "vllm", "sglang"))
    p.add_argument("--out", required=True)
    p.add_argument("--results")
    p.add_argument("--verifier")
    p.add_argument("--speculative-tokens", type=int, default=3)
    p.add_argument("--push-to-hub", dest="repo_id")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision")
    p.add_argument("--dry-run", action="store_true")
    return p


def export_drafter(drafter: str | Path, fmt: str, out: str | Path, *, results: str | Path | None = None,
                   verifier: str | None = None, repo_id: str | None = None, speculative_tokens: int = 3) -> dict:
    """Export `drafter` to `out` in `fmt`, load it back and check it; returns a summary dict."""
    # Imported here, not at the top: they load torch and transformers, which `--help` does not need.
    from drafttrain.export.card import base_model_facts, find_results, read_results, render_card
    from drafttrain.export.formats import plan_export, read_source, verify_export, write_export

    src, out = Path(drafter), Path(out)
    if out.resolve() == src.resolve():
        raise ExportError("--out must differ from the drafter folder")
    meta, sd = read_source(src)
    if repo_id and base_model_facts(meta, verifier)[0] is None:
        raise ExportError(f"a card pushed to the Hub names its base_model by Hub id, and the target "
                          f"{meta.get('target', {}).get('spec')!r} is a local path: pass --verifier ORG/NAME "
                          "(the target's Hub id); nothing was written or uploaded")
    try:
        plan = plan_export(meta, sd, fmt, verifier=verifier, speculative_tokens=speculative_tokens)
    except ValueError as e:  # invalid d2t/t2d or config from the drafter folder itself
        raise ExportError(f"{src}: {e}") from e
    res_path = find_results(src, results)
    res = read_results(res_path) if res_path else None
    card = render_card(meta, fmt=fmt, model_ref=repo_id or str(out), verifier=verifier, results=res,
                       engine_aux=plan.engine_aux)
    write_export(plan, out, card)
    check = verify_export(out, plan, set(sd))
    return {"out": str(out), "format": fmt, "method": plan.method, "results": str(res_path) if res_path else None,
            **check}


def cmd_export(argv: list[str]) -> None:
    """Entry point for `drafttrain export` (errors raise ExportError; the CLI prints one line)."""
    from drafttrain.export.hub import files_to_upload, push_to_hub

    a = _parser().parse_args(argv)
    if (a.private or a.revision or a.dry_run) and not a.repo_id:
        raise ExportError("--private, --revision and --dry-run go with --push-to-hub REPO_ID")
    summary = export_drafter(a.drafter, a.format, a.out, results=a.results, verifier=a.verifier,
                             repo_id=a.repo_id, speculative_tokens=a.speculative_tokens)
    omitted = summary["omitted"]
    print(f"drafttrain: exported {a.drafter} -> {a.out} ({a.format}, {summary['method']}): "
          f"{summary['tensors']} tensors checked against the format"
          + (f"; omitted on purpose: {', '.join(f'{k} ({v})' for k, v in omitted.items())}" if omitted else ""))
    if not a.repo_id:
        return
    files = files_to_upload(a.out)
    if a.dry_run:
        print(f"drafttrain: dry run: would upload {', '.join(files)} from {a.out} to {a.repo_id}"
              f"{' (private)' if a.private else ''}{f' at revision {a.revision}' if a.revision else ''}; nothing sent")
        return
    url = push_to_hub(a.out, a.repo_id, private=a.private, revision=a.revision)
    print(f"drafttrain: uploaded {', '.join(files)} to {a.repo_id}: {url}")
