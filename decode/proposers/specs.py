"""Proposer specs checked before anything loads: `check_specs(["ngram", "runs/eagle/drafter"])`.

`drafttrain eval`, `drafttrain profile` and `load_proposer` itself call it, so a typo costs a
second instead of a target load. It reads the file system only (for a hub id also the local
Hugging Face cache and whether the Hub answers) and raises ConfigError with one line that names
the spec, the bad part and the accepted forms. What it checks, by form:

    ngram[:N], early-exit:K           N, K positive integers (K < the target's layers: the loader)
    corpus:FILE                       FILE exists
    adaptive:<spec>, hybrid:<a>+<b>[+...], adaptive-hybrid:<a>+<b>    every part, recursively
    <prefix>:...                      the prefix is one of the above
    existing folder                   drafter (config.json whose method has a proposer, drafttrain
                                      block, model.safetensors), draft LM (drafttrain.json) or HF
                                      causal LM (config.json and weights)
    anything else                     a hub id (owner/name): refused when it is not in the local HF
                                      cache and the Hub cannot be reached; otherwise a missing path

Deliberately not here: loading (`load_proposer`), and every check that needs the target (hidden
and vocab size, tokenizer hash, layer count, Medusa-2's adapter): the loaders make those.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from pathlib import Path

from drafttrain.config import ConfigError
from drafttrain.errors import first_line
from drafttrain.methods.registry import BUILTIN, folder_method, get_method, method_names
from drafttrain.targets import hub_unreachable

__all__ = ["check_spec", "check_specs", "COMPOSITE", "SIMPLE", "FORMS"]

#: simple spec prefix -> its form (the factories live in `load_proposer` / PROPOSERS).
SIMPLE = {"ngram": "ngram[:N]", "early-exit": "early-exit:K", "corpus": "corpus:FILE"}
#: composite spec prefixes: they nest other specs.
COMPOSITE = ("adaptive", "hybrid", "adaptive-hybrid")
FORMS = (", ".join(SIMPLE.values()) + ", adaptive:<spec>, hybrid:<a>+<b>[+...], adaptive-hybrid:<a>+<b>, "
         "a drafter or draft-LM folder, a causal-LM folder or hub id")

# transformers' weight files for a causal-LM folder (drafttrain writes model.safetensors)
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_PREFIX = re.compile(r"[A-Za-z][\w-]*")
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def check_specs(specs: Iterable) -> None:
    """Checks every proposer spec string (other objects pass: `load_proposer` takes them as they are).

    Raises:
        ConfigError: the first bad spec, in one line naming it and what is wrong.
    """
    for spec in specs:
        check_spec(spec)


def check_spec(spec, *, what: str = "proposer") -> None:
    """Checks one proposer spec without loading anything (see the module docstring).

    Args:
        spec: a spec string or path; anything else passes.
        what: what the spec is for, in the message ("proposer", "assistant").

    Raises:
        ConfigError: one line, "cannot load proposer '<spec>': <what is wrong>".
    """
    if not isinstance(spec, (str, Path)):
        return
    problem = _problem(str(spec))
    if problem:
        raise ConfigError(f"cannot load {what} {str(spec)!r}: {problem}")


def _problem(spec: str) -> str | None:
    """What is wrong with `spec` (None: nothing found). Follows `load_proposer`'s order: an existing
    path wins over any prefix, then prefixes, then a hub id or a missing path."""
    if not spec.strip():
        return f"empty spec; accepted forms: {FORMS}"
    if _exists(spec):
        return _folder_problem(Path(spec))
    name, colon, arg = spec.partition(":")
    if name in COMPOSITE:
        return _composite_problem(name, arg)
    if name in SIMPLE:
        return _simple_problem(name, arg)
    if colon and _PREFIX.fullmatch(name):
        return f"unknown method {name!r}{_did_you_mean(name)}; accepted forms: {FORMS}"
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or not _HUB_ID.fullmatch(spec):
        return f"no such folder or file; accepted forms: {FORMS}"
    return _hub_problem(spec)


def _exists(spec: str) -> bool:
    try:
        return Path(spec).exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def _simple_problem(name: str, arg: str) -> str | None:
    if name == "corpus":
        if not arg:
            return "corpus:FILE needs the corpus file, e.g. corpus:runs/corpus/answers.jsonl"
        if not Path(arg).is_file():
            return (f"corpus file {arg} does not exist; write one with "
                    "`drafttrain regenerate temperature=0 out=FILE.jsonl`")
        return None
    if name == "ngram" and not arg:
        return None
    letter = "N" if name == "ngram" else "K"
    if not (arg.isascii() and arg.isdigit()) or int(arg) < 1:
        return f"{name}:{letter} needs an integer {letter} >= 1, got {arg!r}"
    return None


def _composite_problem(name: str, arg: str) -> str | None:
    if name == "adaptive" and arg.startswith("hybrid:"):
        name, arg = "adaptive-hybrid", arg[len("hybrid:"):]
    if not arg:
        return f"{name}: needs what to wrap, e.g. {name}:ngram" + ("+early-exit:2" if "hybrid" in name else "")
    if "hybrid" not in name and "+" in arg:
        return f"adaptive:<spec> wraps one spec; for several parts use adaptive:hybrid:{arg}"
    parts = arg.split("+") if "hybrid" in name else [arg]
    if "hybrid" in name and (len(parts) < 2 or not all(parts)):
        return f"{name}:{arg} needs two or more parts joined by '+', e.g. ngram+early-exit:2"
    for part in parts:
        problem = _problem(part)
        if problem:
            return f"part {part!r}: {problem}"
    return None


def _folder_problem(folder: Path) -> str | None:
    if not folder.is_dir():
        hint = f" (a corpus of answers is corpus:{folder})" if folder.suffix in (".json", ".jsonl") else ""
        return f"{folder} is a file, not a drafter folder{hint}; accepted forms: {FORMS}"
    if (folder / "drafttrain.json").is_file() or (folder / "config.json").is_file():
        meta = _read_meta(folder)
        if isinstance(meta, str):
            return meta
        method = folder_method(folder)
        if method is None:  # drafttrain.json without a method: a draft-LM folder of an older format
            return weights_problem(folder, "draft-LM" if (folder / "drafttrain.json").is_file() else "causal-LM")
        if method not in method_names() and method not in BUILTIN:
            return (f"{folder}: drafter method {method!r} has no proposer yet "
                    f"(known: {', '.join(method_names())})")
        return get_method(method).check_folder(folder, meta) or None
    return f"folder {folder} has no config.json: not a drafter, draft-LM or causal-LM folder"


def _read_meta(folder: Path) -> dict | str:
    """The folder's drafttrain.json (draft LM) or config.json as a dict, or why it cannot be read."""
    path = folder / "drafttrain.json" if (folder / "drafttrain.json").is_file() else folder / "config.json"
    try:
        meta = json.loads(path.read_text())
    except (ValueError, OSError) as err:
        return f"{path} cannot be read ({first_line(err)})"
    return meta if isinstance(meta, dict) else f"{path} is not a JSON object"


def weights_problem(folder: Path, kind: str) -> str | None:
    """Why an HF causal-LM folder cannot load (no config.json, no weights), or None."""
    if not (folder / "config.json").is_file():
        return f"{kind} folder {folder} has no config.json"
    if not any((folder / w).is_file() for w in _HF_WEIGHTS):
        return f"{kind} folder {folder} has no weights ({' or '.join(_HF_WEIGHTS[::2])})"
    return None


def _hub_problem(spec: str) -> str | None:
    """A hub id loads from the local cache, or downloads when the Hub answers; else one clear line."""
    if _in_hub_cache(spec):
        return None
    why = hub_unreachable()
    if not why:
        return None
    return (f"not a local folder, and as a Hugging Face Hub id it cannot be downloaded offline ({why})"
            f"{_did_you_mean(spec)}; pass a local drafter or draft-LM folder")


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # HFValidationError: not a valid repo id after all
        return False


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, [*SIMPLE, *COMPOSITE], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
