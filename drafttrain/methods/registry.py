"""The method registry: drafter method names -> method objects (one module per method).

A method object (`drafttrain.methods.base.DrafterMethod`) says everything that differs between
drafter kinds: how to build the drafter from the target, which target features it reads, its
loss and metrics, what it saves beside the weights, how each engine format exports it and how
the decoder loads its folder as a proposer. The training loop, the exporter and the proposer
loader ask the registry for the method and never branch on its name.

Built-in methods are imported on first use from `BUILTIN` (name -> module path; each module
calls `register` when imported), so this module imports nothing of drafttrain's and anything may
import it. A new method is one module that defines its method object and calls `register`, plus
a line in `BUILTIN` (or a `register` call by whoever uses it, e.g. a test or a plugin).

Deliberately not here: the methods themselves, the interface they implement (base.py).
"""

from __future__ import annotations

import difflib
import importlib
import json
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN", "DEFAULT_METHOD", "UnknownMethodError", "register", "get_method", "method_names", "folder_method"]

#: method name -> the module that defines (and registers) it
BUILTIN: dict[str, str] = {
    "eagle3": "drafttrain.methods.eagle3",
    "eagle1": "drafttrain.methods.eagle1",
    "medusa1": "drafttrain.methods.medusa1",
    "medusa2": "drafttrain.methods.medusa2",
    "draft_lm": "drafttrain.methods.draft_lm",
}

#: the method a recipe-less config trains
DEFAULT_METHOD = "eagle3"

_METHODS: dict[str, Any] = {}


class UnknownMethodError(ValueError):
    """A method name that is neither built in nor registered; the message suggests the closest."""


def register(method: Any) -> Any:
    """Adds `method` (an object with a `name`) to the registry, replacing one of the same name."""
    _METHODS[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    """Every known method name: built-in ones first, then registered extras."""
    return tuple(dict.fromkeys([*BUILTIN, *_METHODS]))


def get_method(name: str) -> Any:
    """The method object registered under `name` (importing its built-in module on first use)."""
    if name not in _METHODS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in _METHODS:
        close = difflib.get_close_matches(str(name), method_names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownMethodError(f"unknown drafter method {name!r} (known: {', '.join(method_names())}){hint}")
    return _METHODS[name]


def folder_method(folder: str | Path) -> str | None:
    """The method a drafter folder was saved by, or None when it is not a drafttrain folder.

    A drafttrain.json beside HF's config.json (draft LMs, plain HF folders) wins over the
    `method` field of config.json (EAGLE, Medusa and other drafttrain-native folders).
    """
    folder = Path(folder)
    for name in ("drafttrain.json", "config.json"):
        path = folder / name
        if path.is_file():
            try:
                meta = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                return None
            if isinstance(meta, dict) and isinstance(meta.get("method"), str):
                return meta["method"]
    return None
