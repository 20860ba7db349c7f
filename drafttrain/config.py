"""Strict configuration: dataclass defaults < recipe YAML < `key=value` overrides.

`parse_args(["recipe=eagle", "train.lr=3e-4"], RootConfig)` builds a typed config. A key that is
not in the schema is an error naming the key and the closest valid one; a value of the wrong
type or outside its choices is an error naming the key, the value and what is allowed.
`describe(RootConfig)` lists every key with its default and meaning (`--help`, `print_config`).

What it does not do: interpolation, includes or config groups. One recipe file is one flat,
readable description of a run; anything fancier lives in code.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from drafttrain.errors import ConfigError as ConfigError
from drafttrain.errors import first_line

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

# The decode-time linear kernels a config may name (decode/kernels/cpu_linear.py implements them).
# They live here, not there, so that configs and `--help` never import torch.
LINEAR_BACKENDS = ("auto", "aten", "avx2", "avx512", "amx")
#: precisions of loaded drafters' weights in CPU decode steps (decode/kernels/cpu_linear.py)
DRAFT_WEIGHTS = ("auto", "bf16", "int7")
DRAFT_WEIGHTS_HELP = ("loaded drafters' linear layers in decode steps: auto (7-bit weights with a per-row scale on the "
                      "AVX-512 bf16 / AMX kernels, half the bytes a draft step reads; bf16 elsewhere), bf16 (as trained), "
                      "int7; lossless either way (the target verifies every draft)")
#: what `auto` resolves to, said once for every --help that offers a backend
LINEAR_BACKEND_HELP = ("auto (for bf16 targets: the AMX kernel where the CPU and Linux allow AMX tiles, else the AVX-512 "
                       "bf16 kernel on x86 CPUs with AVX-512 bf16, the AVX2 kernel on those with AVX2 only, else "
                       "PyTorch), aten (PyTorch's matmul), avx2, avx512, amx")


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the schema."""
    keys = []
    hints = _hints(cls)
    for name in _fields(cls):
        tp = hints[name]
        if _is_dataclass_type(tp):
            keys.extend(all_keys(tp, f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys


def _closest(key: str, cls) -> str:
    keys = all_keys(cls)
    # Also match the last component alone: `lr=...` -> `train.lr`.
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:
        tails = {k.split(".")[-1]: k for k in keys}
        t = difflib.get_close_matches(key.split(".")[-1], list(tails), n=1, cutoff=0.6)
        close = [tails[t[0]]] if t else []
    return f"; did you mean {close[0]!r}?" if close else ""


class _Raw(str):
    """A command-line value not yet interpreted: a string for str fields, YAML for the rest."""


def _coerce(key: str, value: Any, tp) -> Any:
    """Check / convert `value` for a field of type `tp`."""
    if isinstance(value, _Raw):
        if tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)):
            return str(value)
        value = parse_value(str(value))
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for a in args:
            try:
                return _coerce(key, value, a)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: expected {tp}")
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key}={value!r} is not a boolean; use true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if value.replace("e", "").replace(".", "").isdigit() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} is not an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} is not a number")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__}")
        return "" if value is None else str(value)
    return value


def _build(cls, data: dict, prefix: str = ""):
    fields = _fields(cls)
    hints = _hints(cls)
    kwargs = {}
    for name, value in data.items():
        key = prefix + name
        if name not in fields:
            raise ConfigError(f"unknown config key {key!r}{_closest(key, _root_cls[0])}")
        tp = hints[name]
        if _is_dataclass_type(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is a section; set its keys like {key}.{next(iter(_fields(tp)))}=...")
            kwargs[name] = _build(tp, value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, tp)
            choices = _choices(fields[name])
            if choices and kwargs[name] not in choices:
                raise ConfigError(
                    f"{key}={kwargs[name]!r} is not allowed; choose one of {', '.join(map(str, choices))}"
                )
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e
    return obj


_root_cls: list = [None]


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{key}: {p} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = RECIPES_DIR / f"{name}.yaml"
    if cand.exists():
        return cand
    names = sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"no recipe {name!r} (recipes: {', '.join(names)}){hint}")


def load_recipe(name: str) -> dict:
    path = recipe_path(name)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path} is not valid YAML: {first_line(e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of keys to values")
    return data


def parse_value(text: str) -> Any:
    """`key=value` values are YAML scalars/lists: 3, 1e-4, true, [2, 8, 14], null, or a string."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def parse_args(argv: list[str], cls, *, recipe_key: str = "recipe"):
    """Build `cls` from `recipe=NAME` and `key=value` arguments. Raises ConfigError."""
    _root_cls[0] = cls
    overrides: dict = {}
    recipe = None
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. recipe=eagle train.lr=1e-4)")
        key, _, raw = arg.partition("=")
        key = key.strip().lstrip("-")
        if key == recipe_key:
            recipe = raw
            continue
        _set_dotted(overrides, key, _Raw(raw))
    data: dict = {}
    if recipe:
        data = load_recipe(recipe)
        data[recipe_key] = recipe
    data = _merge(data, overrides)
    return _build(cls, data)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg, path: str | Path | None = None) -> str:
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def describe(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every key of the schema."""
    rows = []
    hints = _hints(cls)
    for name, f in _fields(cls).items():
        tp = hints[name]
        if _is_dataclass_type(tp):
            rows.extend(describe(tp, f"{prefix}{name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        helptext = f.metadata.get("help", "")
        if _choices(f):
            helptext += f" [{'|'.join(map(str, _choices(f)))}]"
        rows.append((prefix + name, repr(default) if isinstance(default, str) else str(default), helptext))
    return rows


def format_help(cls, title: str) -> str:
    rows = describe(cls)
    width = max(len(k) for k, _, _ in rows)
    dw = min(max(len(d) for _, d, _ in rows), 24)
    lines = [title, ""]
    for k, d, h in rows:
        lines.append(f"  {k:<{width}}  {d:<{dw}}  {h}")
    return "\n".join(lines)


def _choices(f) -> tuple:
    """A field's allowed values (a callable is asked each time: e.g. the registered methods)."""
    choices = f.metadata.get("choices")
    return tuple(choices()) if callable(choices) else tuple(choices or ())


def field_(default=dataclasses.MISSING, *, help: str = "", choices=None, default_factory=dataclasses.MISSING):
    """A dataclass field with its help text and allowed values (a sequence, or a callable that
    returns them when a config is checked)."""
    meta = {"help": help}
    if choices:
        meta["choices"] = choices if callable(choices) else tuple(choices)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
