"""Report files of `drafttrain eval`: results.json, results.md, PNG plots, tokens.jsonl.

results.json (schema_version 1):

    schema_version   1
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
                     speedup_formula_measured_tau, speedup_cost_model}}
        greedy_check method -> {compared, identical, all_match, divergences: [{prompt, position,
                     expected, got, logit_gap, tolerance, near_tie}], all_divergences_near_ties}
                     (temperature 0 only; reference = target-only decoding)
    sweeps           kind -> [{temperature, method, <kind>: value, tokens_per_s, wall_s,
                     speedup_vs_target, tau?, acceptance?}]
    files            {tokens, markdown, plots: [...]}

tokens.jsonl: one line per (temperature, method, prompt): {temperature, method, prompt, id,
category, tokens}.

Deliberately not here: computing any metric (metrics.py).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report", "markdown", "write_plots", "write_tokens", "TAU_CONVENTION", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
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
        lines.append("")
    for kind, rows in results.get("sweeps", {}).items():
        lines += [f"## sweep: {kind}", "", f"| temperature | method | {kind} | tok/s | speedup vs target | tau |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['temperature']} | {r['method']} | {r[kind]} | {r['tokens_per_s']:.1f} | "
                  f"{r['speedup_vs_target']:.2f} | {_f(r.get('tau'))} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def write_plots(results: dict, out: Path) -> list[str]:
    """PNG plots (matplotlib Agg): acceptance per position, tau distribution, sweeps. Returns names."""
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

    for kind, fname, ykey, ylabel in (("gamma", "speedup_vs_gamma.png", "speedup_vs_target", "speedup vs target-only"),
                                      ("tree_budget", "speedup_vs_tree_budget.png", "speedup_vs_target", "speedup vs target-only"),
                                      ("batch_size", "throughput_vs_batch_size.png", "tokens_per_s", "tokens/s (all rows)")):
        rows = results.get("sweeps", {}).get(kind)
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for key in sorted({(r["temperature"], r["method"]) for r in rows}):
            pts = sorted((r[kind], r[ykey]) for r in rows if (r["temperature"], r["method"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]} T={key[0]}")
        ax.set(xlabel=kind, ylabel=ylabel, title=f"{ylabel} vs {kind}")
        if kind == "batch_size":
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        save(fig, fname)
    return names


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
