"""`drafttrain profile`: measure (or read from the cache) the target's cost model and show it.

    drafttrain profile target=gemma-3-270m proposers=ngram,early-exit:6 batch_sizes=1,4,16

Prints the verification grid (ms per forward: batch x tokens per row) and each proposer's draft
step (ms per step, per batch size), greedy and (`sampled=true`, the default) at T = 1, and writes
a PNG: verify ms vs tokens per row, one line per batch size; draft ms per step vs batch size, one
line per proposer; T = 1 dashed. The JSON lands in the cache
(`cache_dir`), where adaptive / hybrid proposers find it; `refresh=true` re-measures.

Deliberately not here: the measuring and the cache (drafttrain.decode.costmodel), decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from drafttrain.config import (
    DRAFT_WEIGHTS,
    DRAFT_WEIGHTS_HELP,
    LINEAR_BACKEND_HELP,
    LINEAR_BACKENDS,
    ConfigError,
    field_,
)
from drafttrain.errors import first_line

__all__ = ["ProfileConfig", "run_profile", "plot_cost_model", "help_text"]


@dataclass
class ProfileConfig:
    target: str = field_("gemma-3-270m", help="target: packaged alias, HF hub id, local folder or .gguf file")
    dtype: str = field_("bfloat16", help="target dtype", choices=("auto", "bfloat16", "float32", "float16"))
    device: str = field_("auto", help="cpu | cuda | auto (cuda when available)")
    proposers: list[str] = field_(default_factory=lambda: ["ngram"], help="comma list of proposer specs whose draft step to time (ngram[:N], corpus:FILE, early-exit:K, drafter folder, draft-LM id/path)")
    batch_sizes: list[int] = field_(default_factory=lambda: [1, 2, 4, 8, 16], help="rows per forward")
    tokens: list[int] = field_(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8, 12, 16], help="new tokens per row per forward")
    context: int = field_(256, help="tokens already in the KV cache per row")
    repeats: int = field_(9, help="timed calls per point (median, each round's shared offset removed), after one warm-up; batch 1 / 2 get 4x / 2x; plans weigh the step between token counts, which fewer calls leave noisy")
    sampled: bool = field_(True, help="also time everything at T = 1 (full logits + rejection sampling, sampled drafts): what adaptive decoding prices T > 0 with; about doubles the time")
    threads: int = field_(0, help="torch threads; 0 = leave as is (part of the cache key)")
    output: str = field_("runs/profile/cost_model.png", help="PNG plot path (the JSON goes to cache_dir; a copy beside the PNG)")
    cache_dir: str = field_("", help="cost model cache folder; '' = $DRAFTTRAIN_CACHE/costs or ~/.cache/drafttrain/costs")
    refresh: bool = field_(False, help="re-measure even when the cache has it")
    progress: bool = field_(True, help="show a progress bar with ETA")
    linear_backend: str = field_("auto", help="the target's linear layers, as in `drafttrain eval` (part of the cache key): " + LINEAR_BACKEND_HELP, choices=LINEAR_BACKENDS)
    draft_weights: str = field_("auto", help="as in `drafttrain eval` (part of the cache key): " + DRAFT_WEIGHTS_HELP, choices=DRAFT_WEIGHTS)

    def __post_init__(self) -> None:
        if not self.batch_sizes or not self.tokens or min(self.batch_sizes) < 1 or min(self.tokens) < 1:
            raise ConfigError("batch_sizes and tokens must be non-empty lists of integers >= 1")
        if self.context < 1 or self.repeats < 1 or self.threads < 0:
            raise ConfigError("context and repeats must be >= 1, threads >= 0")


def help_text() -> str:
    from drafttrain.config import format_help

    return format_help(ProfileConfig, "usage: drafttrain profile [key=value ...]\n\n"
                       "Measures the target's verification forward (batch x tokens per row) and each\n"
                       "proposer's draft step, caches the cost model and plots it.\n\nkeys (default, meaning):")


def plot_cost_model(cm, path: str | Path) -> Path:
    """Two panels: verify ms vs tokens per row (a line per batch size); draft ms vs batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {}
    for model, style, tag in ((cm, "-", ""), (cm.sampled, "--", " T=1")):
        if model is None:
            continue
        for b in model.batch_sizes:
            line, = left.plot(model.token_counts, [model.verify_ms[b, t] for t in model.token_counts], style,
                              marker="o", color=colours.get(b), label=f"batch {b}{tag}")
            colours.setdefault(b, line.get_color())
        for name, costs in sorted(model.draft_ms.items()):
            xs = sorted(costs)
            line, = right.plot(xs, [costs[x] for x in xs], style, marker="o", color=colours.get(name),
                               label=f"{name}{tag}")
            colours.setdefault(name, line.get_color())
    left.set(xlabel="tokens per row", ylabel="ms per target forward", title="verification (dashed: T=1)")
    left.legend(fontsize=7, ncol=2)
    right.set(xlabel="batch size", ylabel="ms per draft step", title="drafting")
    if cm.draft_ms:
        right.legend(fontsize=8)
    meta = cm.meta
    fig.suptitle(f"{meta.get('target', '?')} · {meta.get('dtype', '?')} · {meta.get('device', '?')} · "
                 f"{meta.get('threads', '?')} threads · context {meta.get('context', '?')}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_profile(cfg: ProfileConfig):
    """Loads the target and proposers, measures or reads the cost model, prints, plots; returns it."""
    import torch

    from drafttrain.decode import load_proposer
    from drafttrain.decode.costmodel import load_or_measure, proposer_key
    from drafttrain.decode.kernels import cpu_linear
    from drafttrain.decode.proposers import check_specs
    from drafttrain.targets import load_target

    check_specs(cfg.proposers)  # ConfigError before the target loads
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer, _ = load_target(cfg.target, dtype=cfg.dtype, device=device)
    try:
        print(cpu_linear.setup(target, cfg.linear_backend, cfg.draft_weights), flush=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    proposers = {}
    for spec in cfg.proposers:
        try:
            p = load_proposer(spec, target, tokenizer=tokenizer)
        except (ValueError, OSError) as e:
            raise ConfigError(f"proposer {spec!r}: {first_line(e)}") from None
        proposers[proposer_key(p)] = p
    cm = load_or_measure(target, proposers, cache_dir=cfg.cache_dir or None, refresh=cfg.refresh, progress=cfg.progress,
                         batch_sizes=cfg.batch_sizes, tokens=cfg.tokens, context=cfg.context, repeats=cfg.repeats,
                         sampled=cfg.sampled)
    print(cm.table())
    png = plot_cost_model(cm, cfg.output)
    copy = cm.save(png.with_suffix(".json"))
    print(f"cost model: {cm.meta['path']} (copy: {copy}); plot: {png}")
    return cm
