"""Report files of `drafttrain eval`: results.json, results.md, PNG plots, tokens.jsonl.

results.json (schema_version 2; 2 added the oracle, adaptive fields and batch-sweep row kinds):

    schema_version   2
    tau_convention   "tau = tokens emitted per target forward, bonus token included (EAGLE)"
    created          ISO time;  config: the resolved EvalConfig;  machine: cpu, threads, torch, ...
    target           {spec, dtype, source, path}
    benchmark        {name, num_prompts, categories: {category: count}, prompt_tokens_mean}
    runs             one per temperature:
        temperature, batch_size
        methods      name -> {kind: engine|hf, spec, num_prompts, tokens, wall_s, tokens_per_s,
                     speedup: {vs_target, vs_hf, ...}, speedup_per_prompt_vs_target: {mean, std},
                     repetition: {repeated_4gram_frac, prompt_4gram_overlap},
                     per_category: {cat: {tokens, wall_s, tokens_per_s, num_prompts, tau?, speedup?}},
                     engine only: tau, tau_mean, tau_std, tau_per_prompt, acceptance (per position),
                     accept_counts, draft_counts, drafted_per_cycle, target_forwards, row_forwards,
                     time_split: {draft, verify, prefill, other}, theory: {alpha, gamma, c,
                     t_step_s, draft/verify/other_s_per_cycle, verify_ratio, tau_iid, speedup_iid,
                     speedup_formula_measured_tau, speedup_cost_model},
                     adaptive / hybrid only: chosen_lengths (histogram over (row, step) of the
                     draft length verified), chosen_parts {part: (row, step) count},
                     oracle (oracle=true): T > 0 -> {applicable: false, reason}; T = 0 ->
                     {applicable, along, parts, steps, row_steps, tau_achieved, tau_oracle,
                     tokens_per_s_model: {target, achieved, oracle} (cost model),
                     speedup_model: {achieved, oracle}, oracle_over_achieved,
                     tokens_per_s_measured, tokens_per_s_oracle (measured x oracle/achieved),
                     oracle_choice: {lengths, parts}, fixed: {part: {best_gamma,
                     tokens_per_s_model, tau, speedup_model, by_gamma}}, per_category: {cat:
                     {row_steps, tau_achieved, tau_oracle, tokens_per_s_model_achieved,
                     tokens_per_s_model_oracle}}}: the bound in hindsight ALONG THE STEPS THE
                     METHOD VISITED (eval/oracle.py)}
        greedy_check method -> {compared, identical, all_match, divergences: [{prompt, position,
                     expected, got, logit_gap, tolerance, near_tie}], all_divergences_near_ties}
                     (temperature 0 only; reference = target-only decoding)
    sweeps           kind -> [{temperature, method, <kind>: value, tokens_per_s, wall_s,
                     speedup_vs_target, tau?, acceptance?, per_category?: {cat: {tokens_per_s,
                     speedup_vs_target, tau?}}}]
                     batch_size rows also carry kind: target | fixed {proposer, gamma} |
                     proposer | best_fixed {proposer, gamma; derived: fastest fixed gamma in
                     hindsight, method "<proposer>@best"} | adaptive {chosen_lengths,
                     chosen_parts, best_fixed, best_fixed_tokens_per_s, margin_vs_best_fixed =
                     tokens/s ratio - 1} | oracle {of, oracle: dict as above; derived, tokens_per_s
                     in measured units, NOT a measurement}; with sweep_repeats > 1 each measured
                     row is its median-time repeat and carries tokens_per_s_repeats (every repeat)
    files            {tokens, markdown, plots: [...]}

tokens.jsonl: one line per (temperature, method, prompt): {temperature, method, prompt, id,
category, tokens}.

Deliberately not here: computing any metric (metrics.py).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report", "markdown", "write_plots", "write_tokens", "TAU_CONVENTION", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2
TAU_CONVENTION = "tau = tokens emitted per target forward, bonus token included (EAGLE convention); prefill excluded"


def _f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(results: dict) -> str:
    """One table per temperature: speed, tau, acceptance, time split, theory, repetition, match."""
    bench = results["benchmark"]
    lines = [f"# drafttrain eval: {results['target']['spec']} ({results['target']['dtype']}) on {bench['name']}", "",
             f"{bench['num_prompts']} prompts, max_new_tokens {results['config']['max_new_tokens']}, "
             f"{results['machine'].get('threads')} threads on {results['machine'].get('cpu', '?')}. {TAU_CONVENTION}.", ""]
    head = ("method", "tok/s", "speedup vs target", "vs hf", "tau (mean ± sd)", "accept@1..4",
            "draft/verify/other s", "theory speedup (iid / cost model)", "rep 4-gram", "prompt overlap", "greedy = target")
    for run in results["runs"]:
        checks = run.get("greedy_check") or {}
        lines += [f"## temperature {run['temperature']}, batch {run['batch_size']}", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, m in run["methods"].items():
            sp = m.get("speedup", {})
            tau = f"{m['tau']:.2f} ({m['tau_mean']:.2f} ± {m['tau_std']:.2f})" if "tau" in m else "-"
            acc = " ".join(f"{a:.2f}" for a in m.get("acceptance", [])[:4]) or "-"
            ts = m.get("time_split")
            split = f"{ts['draft']:.1f}/{ts['verify'] + ts['prefill']:.1f}/{ts['other']:.1f}" if ts else "-"
            th = m.get("theory")
            theo = f"{th['speedup_iid']:.2f} / {th['speedup_cost_model']:.2f}" if th else "-"
            chk = checks.get(name)
            match = "ref" if name == "target" else "-" if chk is None else (
                f"{chk['identical']}/{chk['compared']}" + ("" if chk["all_match"] else
                                                           " (near-ties)" if chk["all_divergences_near_ties"] else " (NOT near-tie)"))
            rep = m["repetition"]
            lines.append("| " + " | ".join([name, _f(m["tokens_per_s"], 1), _f(sp.get("vs_target")), _f(sp.get("vs_hf")),
                                             tau, acc, split, theo, _f(rep["repeated_4gram_frac"]),
                                             _f(rep["prompt_4gram_overlap"]), match]) + " |")
        cats = sorted({c for m in run["methods"].values() for c in m["per_category"]})
        if len(cats) > 1:
            lines += ["", "per category: tau / speedup vs target", "",
                      "| method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
            for name, m in run["methods"].items():
                cells = []
                for c in cats:
                    v = m["per_category"].get(c, {})
                    cells.append(f"{_f(v.get('tau'))} / {_f(v.get('speedup', {}).get('vs_target'))}")
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += _oracle_table(run)
        lines.append("")
    for kind, rows in results.get("sweeps", {}).items():
        lines += [f"## sweep: {kind}", ""]
        if kind == "batch_size":
            lines += _batch_summary(rows)
        lines += _sweep_charts(kind, rows)
        lines += [f"| temperature | method | {kind} | tok/s | speedup vs target | tau | note |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['temperature']} | {r['method']} | {r[kind]} | {r['tokens_per_s']:.1f} | "
                  f"{r['speedup_vs_target']:.2f} | {_f(r.get('tau'))} | {_note(r)} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


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


def _sweep_charts(kind: str, rows: list[dict]) -> list[str]:
    """Speedup vs target as text bars: per batch size (target, best fixed, adaptive, oracle) for
    the batch sweep; per method over the swept values for the others."""
    out = []
    for temp in sorted({r["temperature"] for r in rows}):
        rs = [r for r in rows if r["temperature"] == temp]
        if kind == "batch_size":
            shown = [r for r in rs if r.get("kind") in _SUMMARY_KINDS]
            groups = {b: [r for r in shown if r["batch_size"] == b] for b in sorted({r["batch_size"] for r in shown})}
            label = "batch {}".format
        else:
            groups = {m: [r for r in rs if r["method"] == m] for m in dict.fromkeys(r["method"] for r in rs)}
            label = str
        out += [f"speedup vs target-only decoding, T={temp}" + (" (oracle rows: a bound, not measured)"
                                                                  if kind == "batch_size" else ""), "", "```text"]
        def items(group: list[dict]) -> list[tuple[str, float]]:
            if kind == "batch_size":
                return [(r["method"] + (f" (gamma {r['gamma']})" if r.get("kind") == "best_fixed" else ""),
                         r["speedup_vs_target"]) for r in group]
            return [(f"{kind} {r[kind]}", r["speedup_vs_target"]) for r in group]

        top = max(r["speedup_vs_target"] for g in groups.values() for r in g)  # one scale for the chart
        lw = max(len(k) for g in groups.values() for k, _ in items(g))
        for key, group in groups.items():
            out += [label(key), *text_bars(items(group), top=top, label_width=lw), ""]
        out[-1] = "```"
        out.append("")
    return out


def _note(r: dict) -> str:
    kind = r.get("kind")
    spread = r.get("tokens_per_s_repeats")
    rep = f"median of {len(spread)} runs ({min(spread):.1f}-{max(spread):.1f} tok/s)" if spread else ""
    if kind == "best_fixed":
        note = f"best fixed in hindsight: gamma {r['gamma']}"
    elif kind == "adaptive" and "margin_vs_best_fixed" in r:
        note = f"{r['margin_vs_best_fixed']:+.1%} vs {r['best_fixed']}"
    elif kind == "oracle":
        return "bound along the visited steps (cost model), not measured"
    else:
        note = ""
    return "; ".join(x for x in (note, rep) if x)


def _oracle_table(run: dict) -> list[str]:
    """The hindsight oracle of adaptive / hybrid methods (oracle=true)."""
    with_oracle = {k: m["oracle"] for k, m in run["methods"].items() if "oracle" in m}
    if not with_oracle:
        return []
    lines = ["", "oracle bound: best part and length per step in hindsight, along the steps each method "
             "visited (T = 0 only), costed with the cost model; 'measured units' = measured tok/s x "
             "oracle / achieved under the model", ""]
    na = {k: o["reason"] for k, o in with_oracle.items() if not o["applicable"]}
    lines += [f"- {k}: not applicable ({why})" for k, why in na.items()]
    ok = {k: o for k, o in with_oracle.items() if o["applicable"]}
    if not ok:
        return lines
    head = ("method", "tau achieved", "tau oracle", "tok/s measured", "oracle tok/s (measured units)",
            "model tok/s: target / achieved / oracle", "best fixed per part (gamma: model tok/s)", "oracle picks")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, o in ok.items():
        t = o["tokens_per_s_model"]
        fixed = ", ".join(f"{p} {f['best_gamma']}: {f['tokens_per_s_model']:.1f}" for p, f in o["fixed"].items())
        picks = ", ".join(f"{p} {n}" for p, n in o["oracle_choice"]["parts"].items())
        lines.append("| " + " | ".join([name, _f(o["tau_achieved"]), _f(o["tau_oracle"]),
                                         _f(o.get("tokens_per_s_measured"), 1), _f(o.get("tokens_per_s_oracle"), 1),
                                         f"{t['target']:.1f} / {t['achieved']:.1f} / {t['oracle']:.1f}", fixed or "-",
                                         picks]) + " |")
    cats = sorted({c for o in ok.values() for c in o["per_category"]})
    if len(cats) > 1:
        lines += ["", "oracle per category: tau achieved / tau oracle", "",
                  "| method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
        for name, o in ok.items():
            cells = [f"{_f(o['per_category'][c]['tau_achieved'])} / {_f(o['per_category'][c]['tau_oracle'])}"
                     if c in o["per_category"] else "-" for c in cats]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _batch_summary(rows: list[dict]) -> list[str]:
    """Per temperature, one line per batch size: target, best fixed per proposer, adaptive
    (with its margin vs the best fixed length of its parts), oracle: tok/s (speedup)."""
    lines = []
    for temp in sorted({r["temperature"] for r in rows}):
        rs = [r for r in rows if r["temperature"] == temp and r.get("kind") in _SUMMARY_KINDS]
        cols = list(dict.fromkeys(r["method"] for r in rs))
        if len(cols) < 2:
            continue
        lines += [f"T={temp}: tokens/s (speedup vs target)", "", "| batch | " + " | ".join(cols) + " |",
                  "|" + "---|" * (len(cols) + 1)]
        for b in sorted({r["batch_size"] for r in rs}):
            at = {r["method"]: r for r in rs if r["batch_size"] == b}
            cells = []
            for c in cols:
                r = at.get(c)
                if r is None:
                    cells.append("-")
                    continue
                extra = f", gamma {r['gamma']}" if r["kind"] == "best_fixed" else \
                    f", {r['margin_vs_best_fixed']:+.1%} vs best fixed" if "margin_vs_best_fixed" in r else ""
                cells.append(f"{r['tokens_per_s']:.1f} ({r['speedup_vs_target']:.2f}x{extra})")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def write_plots(results: dict, out: Path) -> list[str]:
    """PNG plots (matplotlib Agg): acceptance per position, tau distribution, sweeps (batch size:
    tokens/s and speedup for target / best fixed / adaptive / oracle, chosen-length histograms).
    Returns names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    runs = results["runs"]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        names.append(name)

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for name, m in run["methods"].items():
            if m.get("acceptance"):
                ax.plot(range(1, len(m["acceptance"]) + 1), m["acceptance"], marker="o", label=name)
        ax.set(title=f"acceptance per position, T={run['temperature']}", xlabel="draft position", ylabel="P(accepted)",
               ylim=(0, 1.05))
        ax.legend(fontsize=7)
    save(fig, "acceptance_per_position.png")

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for name, m in run["methods"].items():
            if m.get("tau_per_prompt") and name != "target":
                ax.hist(m["tau_per_prompt"], bins=20, alpha=0.5, label=name)
        ax.set(title=f"tau per prompt, T={run['temperature']}", xlabel="tau (bonus included)", ylabel="prompts")
        ax.legend(fontsize=7)
    save(fig, "tau_distribution.png")

    for kind, fname in (("gamma", "speedup_vs_gamma.png"), ("tree_budget", "speedup_vs_tree_budget.png")):
        rows = results.get("sweeps", {}).get(kind)
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for key in sorted({(r["temperature"], r["method"]) for r in rows}):
            pts = sorted((r[kind], r["speedup_vs_target"]) for r in rows if (r["temperature"], r["method"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]} T={key[0]}")
        ax.set(xlabel=kind, ylabel="speedup vs target-only", title=f"speedup vs target-only vs {kind}")
        ax.legend(fontsize=7)
        save(fig, fname)
    rows = results.get("sweeps", {}).get("batch_size")
    if rows:
        for fname, ykey, ylabel in (("throughput_vs_batch_size.png", "tokens_per_s", "tokens/s (all rows)"),
                                    ("speedup_vs_batch_size.png", "speedup_vs_target", "speedup vs target-only")):
            fig, ax = plt.subplots(figsize=(6.5, 4))
            _batch_lines(ax, rows, ykey)
            ax.set(xlabel="batch size", ylabel=ylabel, title=f"{ylabel} vs batch size")
            ax.set_xscale("log", base=2)
            sizes = sorted({r["batch_size"] for r in rows})
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.minorticks_off()
            ax.legend(fontsize=6)
            save(fig, fname)
        hist = [r for r in rows if r.get("chosen_lengths")]
        if hist:
            save(_length_histograms(plt, hist), "chosen_lengths_by_batch_size.png")
    return names


#: batch-sweep row kind -> line style (fixed lengths are drawn faint, the derived best one bold)
_STYLE = {"target": dict(color="black", marker="o", lw=2), "best_fixed": dict(marker="s", lw=2),
          "proposer": dict(marker="s"), "adaptive": dict(marker="o", lw=2), "oracle": dict(ls="--", marker="^"),
          "fixed": dict(lw=0.7, alpha=0.3)}


def _batch_lines(ax, rows: list[dict], ykey: str) -> None:
    """target / best fixed / adaptive / hybrid / oracle lines, fixed lengths faint and unlabelled;
    an oracle line takes its method's colour."""
    colors: dict = {}
    for key in list(dict.fromkeys((r["temperature"], r.get("kind", "proposer"), r["method"]) for r in rows)):
        temp, kind, method = key
        sel = [r for r in rows if (r["temperature"], r.get("kind", "proposer"), r["method"]) == key]
        pts = sorted((r["batch_size"], r[ykey]) for r in sel)
        label = None if kind == "fixed" else f"{method} T={temp:g}"
        style = dict(_STYLE.get(kind, {}))
        if kind == "oracle" and (temp, sel[0].get("of")) in colors:
            style["color"] = colors[temp, sel[0]["of"]]
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
        colors[temp, method] = line.get_color()


def _length_histograms(plt, rows: list[dict]):
    """One panel per adaptive method and temperature: share of (row, step) pairs per chosen draft
    length, one bar group per batch size."""
    keys = list(dict.fromkeys((r["temperature"], r["method"]) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, (temp, method) in zip(axes[0], keys):
        rs = sorted((r for r in rows if (r["temperature"], r["method"]) == (temp, method)), key=lambda r: r["batch_size"])
        width = 0.8 / len(rs)
        for j, r in enumerate(rs):
            h = r["chosen_lengths"]
            total = max(sum(h), 1)
            ax.bar([k + (j - (len(rs) - 1) / 2) * width for k in range(len(h))], [v / total for v in h],
                   width=width, label=f"batch {r['batch_size']}")
        ax.set_xticks(range(max(len(r["chosen_lengths"]) for r in rs)))
        ax.set(title=f"{method}, T={temp:g}", xlabel="draft length chosen", ylabel="share of (row, step)")
        ax.legend(fontsize=7)
    return fig


def write_tokens(path: Path, records: list[dict]) -> None:
    """Generated token ids, one JSON object per (temperature, method, prompt)."""
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_report(results: dict, out_dir: str | Path, token_records: list[dict]) -> dict:
    """Writes results.json, results.md, tokens.jsonl and plots into out_dir; returns the files map."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokens(out / "tokens.jsonl", token_records)
    plots = write_plots(results, out)
    results["files"] = {"tokens": "tokens.jsonl", "markdown": "results.md", "plots": plots}
    (out / "results.md").write_text(markdown(results))
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out / "results.json")
    return results["files"]
