"""Report files of `drafttrain eval`: results.json, results.md, PNG plots, tokens.jsonl.

results.json is `Results.to_dict()`: its schema (version 4) is written down once, in
eval/results.py, beside the dataclasses it is made of. Every function here reads a `Results`
(one read back from an older file too: fields a version lacks are None).

tokens.jsonl: one line per (temperature, method, prompt): {temperature, method, prompt, id,
category, tokens}.

Deliberately not here: computing any metric (metrics.py), the schema (results.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from drafttrain.eval.results import (
    TAU_CONVENTION,
    EngineBaselines,
    Files,
    GreedyCheck,
    OracleBound,
    Results,
    Run,
    SweepRow,
)

__all__ = ["write_report", "markdown", "write_plots", "write_tokens", "text_bars"]


def _f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(results: Results) -> str:
    """One table per temperature: speed, tau, acceptance, time split, theory, repetition, match."""
    bench, machine = results.benchmark, results.machine
    lines = [f"# drafttrain eval: {results.target.spec} ({results.target.dtype}) on {bench.name}", "",
             f"{bench.num_prompts} prompts, max_new_tokens {results.config['max_new_tokens']}, "
             f"{machine.threads} threads on {machine.cpu}. {TAU_CONVENTION}.", ""]
    for run in results.runs:
        lines += _run_table(run) + _category_table(run) + _oracle_table(run) + [""]
    if results.engine_baselines is not None:
        lines += _engine_table(results.engine_baselines) + [""]
    for kind, rows in results.sweeps.items():
        lines += [f"## sweep: {kind}", ""]
        if kind == "batch_size":
            lines += _batch_summary(rows)
        lines += _sweep_charts(kind, rows)
        lines += [f"| temperature | method | {kind} | tok/s | speedup vs target | tau | note |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.temperature} | {r.method} | {getattr(r, kind)} | {r.tokens_per_s:.1f} | "
                  f"{r.speedup_vs_target:.2f} | {_f(r.tau)} | {_note(r)} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


_HEAD = ("method", "tok/s", "speedup vs target [95% CI]", "vs hf", "tau (mean ± sd)", "accept@1..4", "draft/verify/other s",
         "theory speedup (iid / cost model)", "rep 4-gram", "prompt overlap", "greedy = target")


def _run_table(run: Run) -> list[str]:
    """One line per method: speed, tau, acceptance, time split, theory, repetition, greedy match."""
    checks = run.greedy_check or {}
    lines = [f"## temperature {run.temperature}, batch {run.batch_size}", "",
             "| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    for name, m in run.methods.items():
        sp = m.speedup or {}
        tau = f"{m.tau:.2f} ({m.tau_mean:.2f} ± {m.tau_std:.2f})" if m.tau is not None else "-"
        acc = " ".join(f"{a:.2f}" for a in (m.acceptance or [])[:4]) or "-"
        ts = m.time_split
        split = f"{ts.draft:.1f}/{ts.verify + ts.prefill:.1f}/{ts.other:.1f}" if ts else "-"
        th = m.theory
        theo = f"{th.speedup_iid:.2f} / {th.speedup_cost_model:.2f}" if th else "-"
        match = "ref" if name == "target" else _match(checks.get(name))
        rep = m.repetition
        ci = m.speedup_ci95_vs_target
        vs_target = _f(sp.get("vs_target")) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        lines.append("| " + " | ".join([name, _f(m.tokens_per_s, 1), vs_target, _f(sp.get("vs_hf")),
                                         tau, acc, split, theo, _f(rep.repeated_4gram_frac),
                                         _f(rep.prompt_4gram_overlap), match]) + " |")
    return lines


def _engine_table(eb: EngineBaselines) -> list[str]:
    """The vLLM baselines: how the engine ran, start-up per baseline (never in tok/s), one line
    per baseline, temperature and batch size."""
    startup = ", ".join(f"{k} {v:.1f} s" for k, v in eb.startup_s.items())
    specs = "; ".join(f"{k}: {json.dumps(v)}" for k, v in eb.speculative_config.items() if v)
    lines = [f"## vLLM baselines ({eb.engine}, {eb.dtype}, {eb.threads} threads, "
             f"{'eager' if eb.enforce_eager else 'torch.compile'})", "",
             f"Engine start-up (not in any tok/s): {startup}." + (f" {specs}." if specs else ""),
             "Same prompt ids, max_new_tokens, EOS ids and sampling as drafttrain's rows; one engine process, run "
             "before drafttrain's rows (not interleaved with them). Speedup: drafttrain's target at the same "
             "temperature, batch size and prompts (main run or batch sweep; '-' where it did not run).", "",
             "| method | temperature | batch | prompts | tok/s | speedup vs target | greedy = target | "
             "vLLM accept@1..4 | mean acceptance length |", "|" + "---|" * 9]
    for r in eb.rows:
        match = f"{r.greedy_identical}/{r.greedy_compared}" if r.greedy_compared is not None else "-"
        acc = " ".join(f"{a:.2f}" for a in (r.acceptance or [])[:4]) or "-"
        lines.append(f"| {r.method} | {r.temperature:g} | {r.batch_size} | {r.num_prompts} | {r.tokens_per_s:.1f} | "
                     f"{_f(r.speedup_vs_target)} | {match} | {acc} | {_f(r.mean_acceptance_length)} |")
    return lines


def _match(chk: GreedyCheck | None) -> str:
    """identical / compared prompts, and whether the divergences are near-ties."""
    if chk is None:
        return "-"
    return f"{chk.identical}/{chk.compared}" + ("" if chk.all_match else
                                                " (near-ties)" if chk.all_divergences_near_ties else " (NOT near-tie)")


def _category_table(run: Run) -> list[str]:
    """tau / speedup vs target per method and benchmark category (when there are several)."""
    cats = sorted({c for m in run.methods.values() for c in m.per_category})
    if len(cats) <= 1:
        return []
    lines = ["", "per category: tau / speedup vs target", "",
             "| method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
    for name, m in run.methods.items():
        cells = []
        for c in cats:
            v = m.per_category.get(c)
            tau, speedup = (v.tau, (v.speedup or {}).get("vs_target")) if v is not None else (None, None)
            cells.append(f"{_f(tau)} / {_f(speedup)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


_EIGHTHS = " ▏▎▍▌▋▊▉"
#: batch-sweep row kinds shown in the summary table and chart (not the individual fixed lengths)
_SUMMARY_KINDS = ("target", "best_fixed", "proposer", "adaptive", "oracle")


def text_bars(items: list[tuple[str, float]], *, width: int = 40, fmt: str = "{:.2f}x", top: float | None = None,
              label_width: int = 0) -> list[str]:
    """A horizontal bar chart as text lines (reads in a terminal, a log and any Markdown code
    block): one bar per (label, value), `top` (default: the largest value) `width` characters
    long, drawn in eighths of a character; negative values draw as empty bars."""
    if not items:
        return []
    top = max(v for _, v in items) if top is None else top
    lw = max(label_width, *(len(k) for k, _ in items))
    lines = []
    for k, v in items:
        eighths = round(8 * width * max(v, 0.0) / top) if top > 0 else 0
        bar = "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")
        lines.append(f"{k:<{lw}}  {bar:<{width}}  {fmt.format(v)}")
    return lines


def _sweep_charts(kind: str, rows: list[SweepRow]) -> list[str]:
    """Speedup vs target as text bars: per batch size (target, best fixed, adaptive, oracle) for
    the batch sweep; per method over the swept values for the others."""
    out = []
    for temp in sorted({r.temperature for r in rows}):
        rs = [r for r in rows if r.temperature == temp]
        if kind == "batch_size":
            shown = [r for r in rs if r.kind in _SUMMARY_KINDS]
            groups = {b: [r for r in shown if r.batch_size == b] for b in sorted({r.batch_size for r in shown})}
            label = "batch {}".format
        else:
            groups = {m: [r for r in rs if r.method == m] for m in dict.fromkeys(r.method for r in rs)}
            label = str
        out += [f"speedup vs target-only decoding, T={temp}" + (" (oracle rows: a bound, not measured)"
                                                                  if kind == "batch_size" else ""), "", "```text"]
        top = max(r.speedup_vs_target for g in groups.values() for r in g)  # one scale for the chart
        lw = max(len(k) for g in groups.values() for k, _ in _bar_items(kind, g))
        for key, group in groups.items():
            out += [label(key), *text_bars(_bar_items(kind, group), top=top, label_width=lw), ""]
        out[-1] = "```"
        out.append("")
    return out


def _bar_items(kind: str, group: list[SweepRow]) -> list[tuple[str, float]]:
    if kind == "batch_size":
        return [(r.method + (f" (gamma {r.gamma})" if r.kind == "best_fixed" else ""), r.speedup_vs_target)
                for r in group]
    return [(f"{kind} {getattr(r, kind)}", r.speedup_vs_target) for r in group]


def _note(r: SweepRow) -> str:
    spread = r.tokens_per_s_repeats
    rep = f"median of {len(spread)} runs ({min(spread):.1f}-{max(spread):.1f} tok/s)" if spread else ""
    if r.kind == "best_fixed":
        note = f"best fixed in hindsight: gamma {r.gamma}"
    elif r.kind == "adaptive" and r.margin_vs_best_fixed is not None:
        note = f"{r.margin_vs_best_fixed:+.1%} vs {r.best_fixed}"
    elif r.kind == "oracle":
        return "bound along the visited steps (cost model), not measured"
    else:
        note = ""
    return "; ".join(x for x in (note, rep) if x)


def _oracle_table(run: Run) -> list[str]:
    """The hindsight oracle of adaptive / hybrid methods (oracle=true)."""
    with_oracle = {k: m.oracle for k, m in run.methods.items() if m.oracle is not None}
    if not with_oracle:
        return []
    lines = ["", "oracle bound: best part and length per step in hindsight, along the steps each method "
             "visited (T = 0 only), costed with the cost model; 'measured units' = measured tok/s x "
             "oracle / achieved under the model", ""]
    lines += [f"- {k}: not applicable ({o.reason})" for k, o in with_oracle.items() if not o.applicable]
    ok = {k: o for k, o in with_oracle.items() if o.applicable}
    if not ok:
        return lines
    head = ("method", "tau achieved", "tau oracle", "tok/s measured", "oracle tok/s (measured units)",
            "model tok/s: target / achieved / oracle", "best fixed per part (gamma: model tok/s)", "oracle picks")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_oracle_line(name, o) for name, o in ok.items()]
    cats = sorted({c for o in ok.values() for c in o.per_category})
    if len(cats) > 1:
        lines += ["", "oracle per category: tau achieved / tau oracle", "",
                  "| method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
        for name, o in ok.items():
            cells = [f"{_f(o.per_category[c].tau_achieved)} / {_f(o.per_category[c].tau_oracle)}"
                     if c in o.per_category else "-" for c in cats]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _oracle_line(name: str, o: OracleBound) -> str:
    t = o.tokens_per_s_model
    fixed = ", ".join(f"{p} {f.best_gamma}: {f.tokens_per_s_model:.1f}" for p, f in o.fixed.items())
    picks = ", ".join(f"{p} {n}" for p, n in o.oracle_choice.parts.items())
    return "| " + " | ".join([name, _f(o.tau_achieved), _f(o.tau_oracle), _f(o.tokens_per_s_measured, 1),
                              _f(o.tokens_per_s_oracle, 1), f"{t.target:.1f} / {t.achieved:.1f} / {t.oracle:.1f}",
                              fixed or "-", picks]) + " |"


def _batch_summary(rows: list[SweepRow]) -> list[str]:
    """Per temperature, one line per batch size: target, best fixed per proposer, adaptive
    (with its margin vs the best fixed length of its parts), oracle: tok/s (speedup)."""
    lines = []
    for temp in sorted({r.temperature for r in rows}):
        rs = [r for r in rows if r.temperature == temp and r.kind in _SUMMARY_KINDS]
        cols = list(dict.fromkeys(r.method for r in rs))
        if len(cols) < 2:
            continue
        lines += [f"T={temp}: tokens/s (speedup vs target)", "", "| batch | " + " | ".join(cols) + " |",
                  "|" + "---|" * (len(cols) + 1)]
        for b in sorted({r.batch_size for r in rs}):
            at = {r.method: r for r in rs if r.batch_size == b}
            lines.append(f"| {b} | " + " | ".join(_batch_cell(at.get(c)) for c in cols) + " |")
        lines.append("")
    return lines


def _batch_cell(r: SweepRow | None) -> str:
    if r is None:
        return "-"
    extra = f", gamma {r.gamma}" if r.kind == "best_fixed" else \
        f", {r.margin_vs_best_fixed:+.1%} vs best fixed" if r.margin_vs_best_fixed is not None else ""
    return f"{r.tokens_per_s:.1f} ({r.speedup_vs_target:.2f}x{extra})"


def write_plots(results: Results, out: Path) -> list[str]:
    """PNG plots (matplotlib Agg): acceptance per position, tau distribution, sweeps (batch size:
    tokens/s and speedup for target / best fixed / adaptive / oracle, chosen-length histograms).
    Returns names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        names.append(name)

    save(_per_run_plot(plt, results.runs, _acceptance_panel), "acceptance_per_position.png")
    save(_per_run_plot(plt, results.runs, _tau_panel), "tau_distribution.png")
    for kind, fname in (("gamma", "speedup_vs_gamma.png"), ("tree_budget", "speedup_vs_tree_budget.png")):
        if results.sweeps.get(kind):
            save(_value_sweep_plot(plt, kind, results.sweeps[kind]), fname)
    rows = results.sweeps.get("batch_size")
    if rows:
        for fname, ykey, ylabel in (("throughput_vs_batch_size.png", "tokens_per_s", "tokens/s (all rows)"),
                                    ("speedup_vs_batch_size.png", "speedup_vs_target", "speedup vs target-only")):
            save(_batch_plot(plt, rows, ykey, ylabel), fname)
        hist = [r for r in rows if r.chosen_lengths]
        if hist:
            save(_length_histograms(plt, hist), "chosen_lengths_by_batch_size.png")
    return names


def _per_run_plot(plt, runs: list[Run], panel):
    """One panel per run (temperature), drawn by `panel(ax, run)`."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        panel(ax, run)
        ax.legend(fontsize=7)
    return fig


def _acceptance_panel(ax, run: Run) -> None:
    for name, m in run.methods.items():
        if m.acceptance:
            ax.plot(range(1, len(m.acceptance) + 1), m.acceptance, marker="o", label=name)
    ax.set(title=f"acceptance per position, T={run.temperature}", xlabel="draft position", ylabel="P(accepted)",
           ylim=(0, 1.05))


def _tau_panel(ax, run: Run) -> None:
    for name, m in run.methods.items():
        if m.tau_per_prompt and name != "target":
            ax.hist(m.tau_per_prompt, bins=20, alpha=0.5, label=name)
    ax.set(title=f"tau per prompt, T={run.temperature}", xlabel="tau (bonus included)", ylabel="prompts")


def _value_sweep_plot(plt, kind: str, rows: list[SweepRow]):
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for key in sorted({(r.temperature, r.method) for r in rows}):
        pts = sorted((getattr(r, kind), r.speedup_vs_target) for r in rows if (r.temperature, r.method) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]} T={key[0]}")
    ax.set(xlabel=kind, ylabel="speedup vs target-only", title=f"speedup vs target-only vs {kind}")
    ax.legend(fontsize=7)
    return fig


def _batch_plot(plt, rows: list[SweepRow], ykey: str, ylabel: str):
    fig, ax = plt.subplots(figsize=(6.5, 4))
    _batch_lines(ax, rows, ykey)
    ax.set(xlabel="batch size", ylabel=ylabel, title=f"{ylabel} vs batch size")
    ax.set_xscale("log", base=2)
    sizes = sorted({r.batch_size for r in rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.legend(fontsize=6)
    return fig


#: batch-sweep row kind -> line style (fixed lengths are drawn faint, the derived best one bold)
_STYLE = {"target": dict(color="black", marker="o", lw=2), "best_fixed": dict(marker="s", lw=2),
          "proposer": dict(marker="s"), "adaptive": dict(marker="o", lw=2), "oracle": dict(ls="--", marker="^"),
          "fixed": dict(lw=0.7, alpha=0.3)}


def _batch_lines(ax, rows: list[SweepRow], ykey: str) -> None:
    """target / best fixed / adaptive / hybrid / oracle lines, fixed lengths faint and unlabelled;
    an oracle line takes its method's colour (a schema-1 row without a kind draws as a proposer)."""
    colors: dict = {}
    for key in list(dict.fromkeys((r.temperature, r.kind or "proposer", r.method) for r in rows)):
        temp, kind, method = key
        sel = [r for r in rows if (r.temperature, r.kind or "proposer", r.method) == key]
        pts = sorted((r.batch_size, getattr(r, ykey)) for r in sel)
        label = None if kind == "fixed" else f"{method} T={temp:g}"
        style = dict(_STYLE.get(kind, {}))
        if kind == "oracle" and (temp, sel[0].of) in colors:
            style["color"] = colors[temp, sel[0].of]
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
        colors[temp, method] = line.get_color()


def _length_histograms(plt, rows: list[SweepRow]):
    """One panel per adaptive method and temperature: share of (row, step) pairs per chosen draft
    length, one bar group per batch size."""
    keys = list(dict.fromkeys((r.temperature, r.method) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, (temp, method) in zip(axes[0], keys):
        rs = sorted((r for r in rows if (r.temperature, r.method) == (temp, method)), key=lambda r: r.batch_size)
        width = 0.8 / len(rs)
        for j, r in enumerate(rs):
            h = r.chosen_lengths
            total = max(sum(h), 1)
            ax.bar([k + (j - (len(rs) - 1) / 2) * width for k in range(len(h))], [v / total for v in h],
                   width=width, label=f"batch {r.batch_size}")
        ax.set_xticks(range(max(len(r.chosen_lengths) for r in rs)))
        ax.set(title=f"{method}, T={temp:g}", xlabel="draft length chosen", ylabel="share of (row, step)")
        ax.legend(fontsize=7)
    return fig


def write_tokens(path: Path, records: list[dict]) -> None:
    """Generated token ids, one JSON object per (temperature, method, prompt)."""
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_report(results: Results, out_dir: str | Path, token_records: list[dict]) -> Files:
    """Writes results.json, results.md, tokens.jsonl and plots into out_dir; sets and returns
    `results.files`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokens(out / "tokens.jsonl", token_records)
    plots = write_plots(results, out)
    results.files = Files(tokens="tokens.jsonl", markdown="results.md", plots=plots)
    (out / "results.md").write_text(markdown(results))
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results.to_dict(), indent=1))
    tmp.replace(out / "results.json")
    return results.files
