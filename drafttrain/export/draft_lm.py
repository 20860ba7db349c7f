"""A small draft LM in each engine's layout: `DraftLMExport()`; it is a plain HF causal LM.

- `hf`: a plain HF causal-LM folder: HF's config.json (without drafttrain's metadata), the
  weights (every shard of the source, written as one model.safetensors), the tokenizer and the
  generation config; the drafttrain.json beside the source's config.json is left out. Checked with
  `transformers.AutoModelForCausalLM.from_pretrained`.
- `vllm`, `sglang`: refused. Both engines take that same hf folder as their draft model (vLLM
  `--speculative-config '{"model": DIR}'`, SGLang `--speculative-algorithm STANDALONE`), so a
  draft LM has no layout of its own there.

The source folder is the HF folder the trainer wrote plus drafttrain.json (method, target,
training settings); `read_source` merges the two: drafttrain.json's fields, `hf_config` (HF's
config.json) and `hf_files` (the side files to copy).

Deliberately not here: writing and checking the folder (formats.py), the student model itself
(models/draft_lm.py).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from torch import Tensor
from transformers import AutoModelForCausalLM

from drafttrain.errors import ExportError
from drafttrain.export.layout import DEFAULT_SPECULATIVE_TOKENS, ExportPlan, check_format
from drafttrain.export.security import check_folder, load_tensors

__all__ = ["DraftLMExport"]

# Files of an HF folder copied as they are (text: tokenizer, chat template, generation config).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "tokenizer.model")


class DraftLMExport:
    """The engine layout of a standalone draft LM: its own HF folder (hf only)."""

    reads_target_features = False

    def __repr__(self) -> str:
        return "DraftLMExport()"

    def read_source(self, folder: Path) -> tuple[dict, dict[str, Tensor]]:
        """A draft-LM folder's drafttrain.json (+ HF config and side files) and its tensors (all shards)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ExportError(f"drafter folder {folder} does not exist")
        check_folder(folder)
        meta = json.loads((folder / "drafttrain.json").read_text())
        meta["hf_config"] = json.loads((folder / "config.json").read_text())
        meta["hf_files"] = {n: str(folder / n) for n in SIDE_FILES if (folder / n).is_file()}
        sd: dict[str, Tensor] = {}
        for p in sorted(folder.glob("*.safetensors")):
            sd.update(load_tensors(p))
        if not sd:
            raise ExportError(f"{folder} holds no .safetensors weights")
        return meta, sd

    def plan(self, meta: dict, sd: dict[str, Tensor], fmt: str, *, verifier: str | None = None,
             speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> ExportPlan:
        """`hf` writes HF's config.json, the weights, tokenizer and generation config; other formats
        are refused with the hint to give that folder to the engine as its draft model."""
        check_format(fmt)
        if fmt != "hf":
            raise ExportError(f"a draft LM is a plain HF causal LM: export it with --format hf and give that folder "
                              f"to {'vLLM' if fmt == 'vllm' else 'SGLang'} as the draft model")
        hf = meta["hf_config"]
        spec = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
        req = {k: hf[k] for k in ("architectures", "model_type", "vocab_size", "num_hidden_layers", "hidden_size")
               if k in hf}
        return ExportPlan(fmt, meta["method"], tensors=dict(sd), sources={k: k for k in sd}, omitted={}, spec=spec,
                          config=hf, required_config=req, extra_files=dict(meta.get("hf_files", {})))

    def check(self, out: Path, plan: ExportPlan, config: dict) -> list[str]:
        """Load the folder as transformers does (config and weights)."""
        AutoModelForCausalLM.from_pretrained(str(out))
        return []

    def serve_command(self, meta: dict, *, model_ref: str, verifier: str, fmt: str, trust_remote_code: bool) -> str:
        """The draft-model launch line of this folder's engine (transformers for the hf folder)."""
        trc = " --trust-remote-code" if trust_remote_code else ""
        v, m = shlex.quote(verifier), shlex.quote(model_ref)
        if fmt == "vllm":
            spec = json.dumps({"model": model_ref, "num_speculative_tokens": 5})
            return f"vLLM (draft model):\n\n```bash\nvllm serve {v}{trc} --speculative-config {shlex.quote(spec)}\n```\n"
        if fmt == "sglang":
            return (f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {v}{trc} --speculative-algorithm "
                    f"STANDALONE --speculative-draft-model-path {m} --speculative-num-steps 4 --speculative-eagle-topk 1 "
                    "--speculative-num-draft-tokens 5\n```\n")
        return (f"transformers: `target.generate(**inputs, assistant_model=AutoModelForCausalLM.from_pretrained("
                f"{model_ref!r}))`\n")
