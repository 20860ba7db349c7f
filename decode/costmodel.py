"""Cost model: how long the target's verification forward and each drafter's step take, here.

Measured once per (target, device, dtype, torch threads, torch version, linear kernel) and cached as JSON, it
answers two questions for adaptive speculation (proposers/scheduler.py) and the evaluation's oracle:

    verify_time(batch, tokens)   ms of one target forward over `tokens` new tokens per row, for
                                 `batch` rows, at the measured context length
    draft_time(name, batch)      ms of one more draft step (one token per row) of proposer `name`
    draft_call_time(name, batch) ms a propose + observe call costs whatever its length (the
                                 drafter's catch-up over the accepted tokens, sampling set-up):
                                 a chain of L > 0 drafts costs draft_call_time + L x draft_time

Both are measured twice: greedy (the fused LM-head argmax, greedy drafts) and sampled (full
logits + the rejection-sampling verification at T = 1, sampled drafts with their probabilities);
`at(temperature)` picks the one a decode runs at. Sampling costs more on both sides (a 262k-vocab
softmax per verified token; draft probabilities scattered into the target's vocabulary), so a
schedule priced greedily at T > 0 drafts longer than pays.

Layout:
    CostModel            the measured grid + per-proposer costs + meta (who, where, when); save / load
    measure_cost_model   times `kv.target_forward` on a filled KV cache and each proposer's steps
                         (the timing itself: costtiming.py)
    load_or_measure      the cache ($DRAFTTRAIN_CACHE/costs, default ~/.cache/drafttrain/costs), re-measuring only what is missing
    proposer_key         the name a proposer's cost is filed under ("eagle", "early-exit:2", ...);
                         defined beside the Proposer interface (proposers/base.py), re-exported here

Interpolation: bilinear inside the grid, after the grid is made non-decreasing in both axes (more
work never takes less time) by the least-squares monotone fit (pooled adjacent violators: a noisy
high point is averaged with its neighbours, not carried to every larger point as a running max
would); beyond the grid, linear with the last segment's slope (made non-decreasing across the other
axis), so `verify_time` is monotone in batch and in tokens everywhere; below the grid, the first
value.

How drafting is timed: the proposer runs `speculative_generate` on random prompts of `context`
tokens with fixed chain lengths 1 and 4; the median time of a propose + observe call at each
(the first call excluded: it catches up on the whole prompt) gives a line, t(L) = call + L x step.
The call part holds the drafter's catch-up on the accepted tokens, as in real decoding. Until
session 34 a call at gamma 4 was divided by 4: that spread the call part over the drafts and
priced a third draft at 1.05 ms where it costs 0.86 (EAGLE at T=1, batch 1), so plans stopped
at 2 drafts where 3 decoded faster.

Deliberately not here: choosing lengths (planning.py), plotting and the CLI (drafttrain/profiling.py),
memory or power models.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from drafttrain.decode.costtiming import rounds_for, time_draft, time_verify, warm_up
from drafttrain.decode.kernels.cpu_linear import KERNELS, draft_weights_of, installed_backend
from drafttrain.decode.proposers.base import proposer_key

__all__ = ["CostModel", "measure_cost_model", "load_or_measure", "proposer_key", "FREE_PROPOSERS",
           "DEFAULT_CACHE_DIR", "default_cache_dir"]

#: proposers whose draft step costs ~nothing unless measured (host-side lookups).
FREE_PROPOSERS = ("ngram", "corpus")
DEFAULT_CACHE_DIR = "~/.cache/drafttrain/costs"


def default_cache_dir() -> Path:
    """``$DRAFTTRAIN_CACHE/costs`` if set (as for targets and data), else ``~/.cache/drafttrain/costs``."""
    root = os.environ.get("DRAFTTRAIN_CACHE")
    return Path(root) / "costs" if root else Path(DEFAULT_CACHE_DIR).expanduser()
_VERSION = 1


# ---- interpolation ----------------------------------------------------------------------------------
def _cummax(values: list[float]) -> list[float]:
    out, m = [], float("-inf")
    for v in values:
        m = max(m, v)
        out.append(m)
    return out


def _monotone(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): a point measured high is
    averaged with the lower points after it, where a running max would lift every later point to
    it. Session 31: a re-measured sampled batch-1 row read 29.2 ms for 4 tokens against 26.5 for
    5, and the running max priced 4, 5 and 6 tokens alike at 29.2 (the fit: 27.85, 27.85, 28.6)."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _end_slope(xs: list[int], ys: list[float]) -> float:
    """Slope of the last segment (>= 0); one point: proportional (y / x)."""
    if len(xs) == 1:
        return max(ys[0], 0.0) / max(xs[0], 1)
    return max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)


def _interp(xs: list[int], ys: list[float], x: float, end_slope: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending, ys non-decreasing); first value below,
    `end_slope` beyond the last point."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] + (x - xs[-1]) * end_slope
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]  # unreachable


@dataclass
class CostModel:
    """Measured costs of one target on one machine (milliseconds).

    Attributes:
        verify_ms: {(batch, tokens_per_row): ms} of one target forward over `tokens_per_row` new
            tokens per row at context `meta["context"]`; a full grid (every batch x every tokens).
        draft_ms: {proposer key: {batch: ms per draft step}} (the marginal step: see draft_fixed_ms).
        meta: target identity, device, dtype, torch threads and version, context length, date.
        sampled: the same grid and proposers timed at temperature > 0 (its own verify_ms /
            draft_ms; meta is this one's), or None (older files, or measured greedy only).
        draft_fixed_ms: {proposer key: {batch: ms}} each propose + observe call costs whatever
            its length; missing (files before session 34, free proposers): 0.
    """

    verify_ms: dict[tuple[int, int], float]
    draft_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    sampled: CostModel | None = None
    draft_fixed_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.verify_ms:
            raise ValueError("a CostModel needs at least one verify_ms entry")
        self._batches = sorted({b for b, _ in self.verify_ms})
        self._tokens = sorted({t for _, t in self.verify_ms})
        missing = [(b, t) for b in self._batches for t in self._tokens if (b, t) not in self.verify_ms]
        if missing:
            raise ValueError(f"verify_ms must be a full batch x tokens grid; missing {missing[:4]}")
        grid = [_monotone([float(self.verify_ms[b, t]) for t in self._tokens]) for b in self._batches]
        for j in range(len(self._tokens)):  # then non-decreasing in batch too
            col = _monotone([row[j] for row in grid])
            for i, row in enumerate(grid):
                row[j] = col[i]
        for row in grid:  # pooling a column can leave a row a hair out of order: a running max mends it
            row[:] = _cummax(row)
        self._grid = grid  # [batches][tokens]
        # slopes beyond the grid, non-decreasing across the other axis so monotonicity survives
        self._t_slope = _cummax([_end_slope(self._tokens, row) for row in grid])  # per batch
        self._b_slope = _cummax([_end_slope(self._batches, [row[j] for row in grid])
                                 for j in range(len(self._tokens))])  # per tokens
        self._memo: dict = {}

    # ---- queries ------------------------------------------------------------------------------------
    def at(self, temperature: float) -> CostModel:
        """The costs a decode at `temperature` pays: the sampled ones when T > 0 and they were
        measured, else these (greedy)."""
        return self.sampled if temperature > 0 and self.sampled is not None else self

    def verify_time(self, batch: int, tokens: int) -> float:
        """ms of one target forward over `tokens` new tokens per row for `batch` rows."""
        key = (batch, tokens)
        if key not in self._memo:
            self._memo[key] = self._verify(float(batch), float(tokens))
        return self._memo[key]

    def _verify(self, batch: float, tokens: float) -> float:
        bs = self._batches
        rows = [_interp(self._tokens, row, tokens, s) for row, s in zip(self._grid, self._t_slope)]
        if batch <= bs[-1]:
            return _interp(bs, rows, batch, 0.0)
        b_slope = _interp(self._tokens, self._b_slope, tokens, 0.0)  # non-decreasing in tokens
        return rows[-1] + (batch - bs[-1]) * b_slope

    def draft_time(self, name: str, batch: int) -> float:
        """ms of one draft step of proposer `name` (see `proposer_key`) for `batch` rows.

        Raises:
            KeyError: `name` was not measured and is not a free proposer (FREE_PROPOSERS).
        """
        costs = self.draft_ms.get(name)
        hit = self._memo.get((name, batch))  # (the costs it was read from, ms): a per-step query
        if hit is not None and hit[0] is costs:
            return hit[1]
        ms = self._draft(name, batch, costs)
        self._memo[name, batch] = (costs, ms)
        return ms

    def draft_call_time(self, name: str, batch: int) -> float:
        """ms each propose + observe call of proposer `name` costs whatever its length (0 when
        not measured: free proposers, files before session 34)."""
        costs = self.draft_fixed_ms.get(name)
        if costs is None:
            return 0.0
        hit = self._memo.get(("call", name, batch))
        if hit is not None and hit[0] is costs:
            return hit[1]
        xs = sorted(costs)
        ys = _monotone([float(costs[x]) for x in xs])
        ms = max(0.0, _interp(xs, ys, float(batch), _end_slope(xs, ys)))
        self._memo["call", name, batch] = (costs, ms)
        return ms

    def chain_time(self, name: str, batch: int, length: int) -> float:
        """ms of drafting a chain of `length` tokens per row (0 for no draft)."""
        if length <= 0:
            return 0.0
        return self.draft_call_time(name, batch) + length * self.draft_time(name, batch)

    def _draft(self, name: str, batch: int, costs: dict[int, float] | None) -> float:
        if costs is None:
            if name.split(":")[0] in FREE_PROPOSERS:
                return 0.0
            measured = ", ".join(sorted(self.draft_ms)) or "none"
            raise KeyError(f"the cost model has no draft cost for {name!r} (measured: {measured}); "
                           f"measure it with load_or_measure(...) or `drafttrain profile proposers=...`")
        xs = sorted(costs)
        ys = _monotone([float(costs[x]) for x in xs])
        return _interp(xs, ys, float(batch), _end_slope(xs, ys))

    @property
    def batch_sizes(self) -> list[int]:
        return list(self._batches)

    @property
    def token_counts(self) -> list[int]:
        return list(self._tokens)

    def covers(self, batch_sizes, tokens) -> bool:
        """Whether every (batch, tokens) pair was measured."""
        return all((b, t) in self.verify_ms for b in batch_sizes for t in tokens)

    def table(self) -> str:
        """A plain-text table: verify ms (batch x tokens per row), then draft ms per step."""
        cells = [f"{v:.2f}" for v in self.verify_ms.values()] + [str(t) for t in self._tokens]
        width = max(7, *(len(c) + 2 for c in cells))  # always a space between columns
        head = "verify ms  batch \\ tokens" + "".join(f"{t:>{width}}" for t in self._tokens)
        lines = [head]
        for b in self._batches:
            lines.append(f"{b:>26}" + "".join(f"{self.verify_ms[b, t]:>{width}.2f}" for t in self._tokens))
        if self.draft_ms:
            batches = sorted({b for c in self.draft_ms.values() for b in c})
            lines += ["", "draft ms / step  proposer \\ batch" + "".join(f"{b:>{width}}" for b in batches)]
            for name, c in sorted(self.draft_ms.items()):
                cells = "".join(f"{c[b]:>{width}.3f}" if b in c else f"{'-':>{width}}" for b in batches)
                lines.append(f"{name:>33}" + cells)
            if self.draft_fixed_ms:
                lines += ["", "draft ms / call  proposer \\ batch" + "".join(f"{b:>{width}}" for b in batches)]
                for name, c in sorted(self.draft_fixed_ms.items()):
                    cells = "".join(f"{c[b]:>{width}.3f}" if b in c else f"{'-':>{width}}" for b in batches)
                    lines.append(f"{name:>33}" + cells)
        if self.sampled is not None:
            lines += ["", "sampled (temperature > 0):", self.sampled.table()]
        return "\n".join(lines)

    # ---- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        verify: dict[str, dict[str, float]] = {}
        for (b, t), ms in sorted(self.verify_ms.items()):
            verify.setdefault(str(b), {})[str(t)] = ms
        draft = {n: {str(b): ms for b, ms in sorted(c.items())} for n, c in sorted(self.draft_ms.items())}
        fixed = {n: {str(b): ms for b, ms in sorted(c.items())} for n, c in sorted(self.draft_fixed_ms.items())}
        out = {"version": _VERSION, "meta": self.meta, "verify_ms": verify, "draft_ms": draft,
               "draft_fixed_ms": fixed}
        if self.sampled is not None:
            sampled = self.sampled.to_json()
            out["sampled"] = {k: sampled[k] for k in ("verify_ms", "draft_ms", "draft_fixed_ms")}
        return out

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        verify = {(int(b), int(t)): float(ms) for b, row in data["verify_ms"].items() for t, ms in row.items()}
        draft = {n: {int(b): float(ms) for b, ms in c.items()} for n, c in data.get("draft_ms", {}).items()}
        fixed = {n: {int(b): float(ms) for b, ms in c.items()} for n, c in data.get("draft_fixed_ms", {}).items()}
        meta = dict(data.get("meta", {}))
        sampled = cls.from_json({**data["sampled"], "meta": meta}) if data.get("sampled") else None
        return cls(verify, draft, meta, sampled, fixed)

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Reads a cost model JSON (as written by `save`).

        Raises:
            FileNotFoundError: no such file. ValueError: not a cost model.
        """
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
            return cls.from_json(data)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not a drafttrain cost model JSON ({type(e).__name__}: {e})") from None


# ---- measuring --------------------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "cpu"


def _identity(target: nn.Module) -> dict:
    """What the cache is keyed by: the target (config + size + dtype) and the machine."""
    p = next(target.parameters())
    config = target.config.to_dict()
    config.pop("_name_or_path", None)
    config.pop("transformers_version", None)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"target": getattr(target.config, "_name_or_path", "") or target.config.model_type,
            "model_type": target.config.model_type, "config_hash": config_hash,
            "params": sum(q.numel() for q in target.parameters()), "dtype": str(p.dtype).replace("torch.", ""),
            "device": _device_name(p.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "linear": installed_backend(target), "draft_weights": draft_weights_of(target)}


def _decoder_source_hash() -> str:
    """Hash of the decoder's Python sources (this package: sampling, verification, proposers, the
    engine): a cost measured before a change to any of them (session 24 made the keyed draws
    cheaper) would misinform the adaptive scheduler until someone deleted the cache."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _cache_file(identity: dict, cache_dir: str | Path) -> Path:
    keyed = {k: identity[k] for k in ("config_hash", "params", "dtype", "device", "threads", "torch")}
    if identity.get("linear", "aten") != "aten":  # a kernel changes every step's cost (aten: the old key)
        keyed["linear"] = identity["linear"]
        keyed["drafters"] = "kernel"  # loaded drafters run through it too (session 14): older draft costs differ
        keyed["norms"] = "kernel"  # RMS norms through the norm kernel too (session 15): every step is cheaper
        if identity["linear"] == "avx2":
            keyed["rows"] = "1+"  # session 21: one row and prefill through the AVX2 kernel too (was 2-64)
        if identity["linear"] in KERNELS:  # session 22: any change to the kernel's source re-measures
            keyed["kernel_source"] = hashlib.sha256(KERNELS[identity["linear"]].source.encode()).hexdigest()[:16]
    if identity.get("draft_weights", "bf16") != "bf16":  # session 33: 7-bit drafters step faster
        keyed["draft_weights"] = identity["draft_weights"]
    keyed["decoder_source"] = _decoder_source_hash()  # session 24: so does any change to the decoder's code
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / f"{identity['model_type']}-{digest}.json"


def measure_cost_model(target: nn.Module, proposers: dict | None = None, *, batch_sizes=(1, 2, 4, 8, 16),
                       tokens=(1, 2, 3, 4, 5, 6, 8, 12, 16), context: int = 256, repeats: int = 9,
                       progress: bool = True, verify: bool = True, sampled: bool = True,
                       warmup_s: float = 2.0) -> CostModel:
    """Times the target's verification forward on a grid and each proposer's draft step.

    Args:
        target: the target HF causal LM (eval mode), on the device to measure.
        proposers: {cost key: Proposer}; see `proposer_key`.
        batch_sizes / tokens: the grid (rows per forward x new tokens per row).
        context: committed tokens per row in the KV cache before each timed forward.
        repeats: timed calls per point (median), after one warm-up call; a batch size's points are
            called round-robin (every token count once per round), not one point's calls in a row.
            Plans weigh one more draft by the step between neighbouring token counts (~0.5 ms
            of ~18 at batch 1), so that step must be right, not only each point: with 3 calls
            the 3 -> 4 token step read 0.05 / 0.84 / 0.43 ms in three grids minutes apart, with 9
            0.64 / 0.33 / 0.60 (session 34, T=1). The cached 1.55 ms step stopped T=1 plans at
            2 drafts where 3 decoded 7% faster. Batch 1 and 2 get 4x / 2x the rounds
            (`costtiming.rounds_for`), and each point is the median of its times with every
            round's shared offset removed (`costtiming.centred_medians`; session 35).
        progress: show a progress bar with ETA.
        verify: False times the proposers only (the returned model's verify_ms is then a
            placeholder {(1, 1): 0.0}: read its draft_ms, and its sampled one's).
        sampled: also time everything at T = 1 (`CostModel.sampled`); about doubles the time.
        warmup_s: seconds of untimed verification forwards before the first timed point (each
            point also discards its own first call). Without it the first greedy batch-1 points,
            measured right after loading, read 10-40% high on a 2-core Xeon (session 29), and the
            cached model steered `adaptive:` from them in every later run.

    Returns:
        A CostModel, with `.sampled` when `sampled`.
    """
    from tqdm.auto import tqdm

    from drafttrain.decode.allocator import keep_freed_memory

    if next(target.parameters()).device.type == "cpu":
        keep_freed_memory()  # as decoding runs (speculative_generate sets it too)
    proposers = proposers or {}
    batch_sizes, tokens = sorted(set(batch_sizes)), sorted(set(tokens))
    if not batch_sizes or not tokens or min(batch_sizes) < 1 or min(tokens) < 1:
        raise ValueError("batch_sizes and tokens must be non-empty lists of integers >= 1")
    if context < 1 or repeats < 1:
        raise ValueError("context and repeats must be >= 1")
    temps = (0.0, 1.0) if sampled else (0.0,)
    draft_repeats = max(repeats, 8)  # a line through two medians: fewer calls leave its slope noisy
    verify_calls = sum(len(tokens) * (rounds_for(b, repeats) + 1) for b in batch_sizes) if verify else 0
    total = len(temps) * (verify_calls + len(proposers) * len(batch_sizes) * (repeats + 1))  # calls, for the bar
    bar = tqdm(total=total, desc="profile", unit="call", disable=not progress, dynamic_ncols=True)
    measured = []
    with torch.inference_mode():
        if verify and warmup_s > 0:
            warm_up(target, batch_sizes, tokens, context, warmup_s)
        for temp in temps:
            verify_ms: dict[tuple[int, int], float] = {}
            draft_ms: dict[str, dict[int, float]] = {}
            fixed_ms: dict[str, dict[int, float]] = {}
            how = "sampled" if temp else "greedy"
            if verify:
                for b in batch_sizes:
                    bar.set_postfix_str(f"{how} verify batch {b}")
                    verify_ms.update(time_verify(target, b, tokens, context, rounds_for(b, repeats), bar,
                                                 temperature=temp))
            for name, proposer in proposers.items():
                for b in batch_sizes:
                    bar.set_postfix_str(f"{how} draft {name} batch {b}")
                    call, step = time_draft(target, proposer, b, context, draft_repeats, temperature=temp)
                    draft_ms.setdefault(name, {})[b], fixed_ms.setdefault(name, {})[b] = step, call
                    bar.update(repeats + 1)
            measured.append((verify_ms or {(1, 1): 0.0}, draft_ms, fixed_ms))
    bar.close()
    meta = _identity(target)
    meta.update(context=context, repeats=repeats, head="argmax",
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    greedy, *hot = (CostModel(v, d, meta, None, f) for v, d, f in measured)
    greedy.sampled = hot[0] if hot else None
    return greedy


def load_or_measure(target: nn.Module, proposers: dict | None = None, *,
                    cache_dir: str | Path | None = None, refresh: bool = False, progress: bool = True,
                    **kw) -> CostModel:
    """The cached cost model of this target on this machine, measuring what is missing.

    The cache file is keyed by the target (config hash, parameter count, dtype), the device name,
    torch threads and torch version. A cached grid that lacks a requested (batch, tokens) point or
    was measured at another context or without its sampled (T > 0) half is re-measured; proposers
    not in the cache are measured (greedy and sampled) and added; everything else is reused.

    Args:
        target: the target model.
        proposers: {cost key: Proposer} (see `proposer_key`).
        cache_dir: where the JSON files live (None: `default_cache_dir()`).
        refresh: re-measure everything.
        progress: progress bar.
        **kw: `measure_cost_model` settings (batch_sizes, tokens, context, repeats, sampled).

    Returns:
        The CostModel (also saved, with the path in `meta["path"]`).
    """
    proposers = dict(proposers or {})
    ident = _identity(target)
    path = _cache_file(ident, cache_dir or default_cache_dir())
    cm = None
    if path.is_file() and not refresh:
        try:
            cm = CostModel.load(path)
        except ValueError:
            cm = None
    want_b = kw.get("batch_sizes", (1, 2, 4, 8, 16))
    want_t = kw.get("tokens", (1, 2, 3, 4, 5, 6, 8, 12, 16))
    want_s = kw.get("sampled", True)
    stale = (cm is None or (want_s and cm.sampled is None) or not cm.covers(want_b, want_t)
             or cm.meta.get("context") != kw.get("context", 256))
    if stale:
        fresh = measure_cost_model(target, proposers, progress=progress, **kw)
        if cm is not None and not refresh and (cm.sampled is not None or not want_s):  # keep drafters measured earlier
            _merge_drafts(fresh, cm)
            if want_s:
                _merge_drafts(fresh.sampled, cm.sampled)
        cm = fresh
    else:
        missing = {k: p for k, p in proposers.items()
                   if k not in cm.draft_ms or (want_s and k not in cm.sampled.draft_ms)}
        if missing:
            kw2 = {k: v for k, v in kw.items() if k != "tokens"}
            kw2["batch_sizes"] = cm.batch_sizes
            kw2["context"] = cm.meta.get("context", 256)
            added = measure_cost_model(target, missing, progress=progress, verify=False, **kw2)
            if added.sampled is not None:
                _merge_drafts(cm.sampled, added.sampled, newer=True)
            _merge_drafts(cm, added, newer=True)
        else:
            cm.meta["path"] = str(path)
            return cm
    cm.meta["path"] = str(path)
    cm.save(path)
    return cm


def _merge_drafts(into: CostModel, other: CostModel, newer: bool = False) -> None:
    """Adds `other`'s drafting costs to `into`'s (`newer`: other's win where both have a
    proposer; else into's, which were just measured)."""
    for attr in ("draft_ms", "draft_fixed_ms"):
        mine, theirs = getattr(into, attr), getattr(other, attr)
        setattr(into, attr, {**mine, **theirs} if newer else {**theirs, **mine})
