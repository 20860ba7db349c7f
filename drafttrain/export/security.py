"""Safety rules for export: safetensors only, no pickles, no remote code, no secrets in output.

- `check_folder` refuses a drafter folder that holds pickle-based files (`.bin`, `.pt`, `.pkl`, ...)
  or any file whose first bytes are a pickle or a zip-wrapped torch pickle, whatever its name.
- `load_tensors` reads weights with `safetensors` and nothing else.
- `scrub_text` / `scrub_obj` remove Hugging Face tokens (`hf_...`), W&B keys and any value stored
  under a key named like a secret, from text and JSON-like objects written to logs, cards, configs.
- `trust_remote_code` stays off: the export never loads target code, and the serve commands it
  prints carry `--trust-remote-code` only when the drafter's training config set it.

What it does not do: it does not sandbox anything or scan safetensors payloads (they hold raw
numbers; there is nothing to execute).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from drafttrain.errors import ExportError
from drafttrain.errors import UnsafeFileError as UnsafeFileError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
_PICKLE_MAGIC = tuple(bytes([0x80, proto]) for proto in range(2, 6))  # protocol 2..5 opcode PROTO
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default container (holds data.pkl)

_HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{20,}")
_SECRET_ASSIGN = re.compile(
    r"(?i)((?:wandb_api_key|api[_-]?key|hf_token|hub_token|access[_-]?token|token|secret|password)"
    r"[\"']?\s*[:=]\s*[\"']?)([^\s\"',}]+)"
)
# A key names a secret when it ENDS in one of these words (`hf_token`, `wandb_api_key`), which keeps
# `tokenizer_hash`, `train_tokens` and special-token names (`bos_token`) untouched.
_SECRET_KEY = re.compile(r"(?i)^(?!(?:bos|eos|pad|unk|sep|cls|mask)_token$)(?:.*[_-])?"
                         r"(?:token|api[_-]?key|apikey|secret|password|passwd|credentials?)$")
_SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN", "WANDB_API_KEY")
REDACTED = "***"


def _looks_pickled(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head[:2] in _PICKLE_MAGIC or head == _ZIP_MAGIC


def check_folder(folder: str | Path) -> None:
    """Refuse a folder holding pickle files; raises UnsafeFileError naming them."""
    folder = Path(folder)
    bad = sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*")
        # safetensors files start with their header length, which can look like a pickle opcode
        # (0x80 0x02 = 640 bytes); they are parsed by safetensors, never unpickled, so skip the sniff.
        if p.is_file() and (p.suffix.lower() in PICKLE_SUFFIXES
                            or (p.suffix.lower() != ".safetensors" and _looks_pickled(p)))
    )
    if bad:
        raise UnsafeFileError(
            f"{folder} holds pickle-based file(s) {', '.join(bad)}; drafttrain reads safetensors only and "
            "never unpickles. Remove them (or re-save the weights with safetensors) and export again."
        )


def load_tensors(path: str | Path) -> dict:
    """Read a `.safetensors` file into CPU tensors; any other file type is refused."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix != ".safetensors":
        raise UnsafeFileError(f"{path}: only .safetensors weights are read (loading never unpickles)")
    if not path.is_file():
        raise ExportError(f"{path} does not exist")
    return load_file(str(path), device="cpu")


def _secret_values() -> list[str]:
    return [v for k in _SECRET_ENV if (v := os.environ.get(k)) and len(v) >= 8]


def scrub_text(text: str, extra_secrets: tuple[str, ...] = ()) -> str:
    """Text with tokens and keys replaced by `***` (known env secrets, hf_ tokens, key=value pairs)."""
    for s in (*_secret_values(), *[e for e in extra_secrets if e]):
        text = text.replace(s, REDACTED)
    text = _HF_TOKEN.sub(REDACTED, text)
    return _SECRET_ASSIGN.sub(lambda m: m.group(1) + REDACTED, text)


def scrub_obj(obj, extra_secrets: tuple[str, ...] = ()):
    """A copy of a JSON-like object with secret-named keys blanked and every string scrubbed."""
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(k, str) and _SECRET_KEY.match(k) and v not in (None, "", False)
                    else scrub_obj(v, extra_secrets)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_obj(v, extra_secrets) for v in obj]
    if isinstance(obj, str):
        return scrub_text(obj, extra_secrets)
    return obj
