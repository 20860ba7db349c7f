"""The end-of-run summary a training job prints: drafter folder, throughput and held-out acceptance."""

from __future__ import annotations

from drafttrain.methods.registry import get_method


def format_summary(summary: dict) -> str:
    """The lines printed after `drafttrain train`, from the dict written to <run>/summary.json."""
    lines = ["", "drafttrain: run finished", f"  drafter      {summary.get('drafter_dir')}"]
    for k in ("steps", "train_tokens", "train_time_s", "wall_time_s", "train_tokens_per_s", "vocab_coverage"):
        if k in summary:
            lines.append(f"  {k:<12} {summary[k]}")
    accs = [(k, v) for k, v in summary.items() if k.startswith("eval/acc_")]
    if accs:
        per = get_method(summary["method"]).acc_label if "method" in summary else "per unroll step"
        lines.append("  held-out acc " + " ".join(f"{v:.3f}" for _, v in accs) + f"  ({per})")
    if t1 := [v for k, v in summary.items() if k.startswith("eval/accept_t1_")]:
        lines.append("  held-out T=1 " + " ".join(f"{v:.3f}" for v in t1) + "  (sampled draft accepted: sum min(p, q))")
    if "eval/tau_sim" in summary:
        lines.append(f"  held-out simulated tau {summary['eval/tau_sim']:.3f}  (teacher-forced greedy chain averaged over "
                     "every position, bonus included)")
    if "eval/tau_walk" in summary:
        lines.append(f"  held-out walked tau    {summary['eval/tau_walk']:.3f}  (the same chain walked root to root as "
                     "greedy decoding visits them: what decoding this text reaches)")
    if "eval/decode_tau" in summary:
        lines.append(f"  held-out decoding tau  {summary['eval/decode_tau']:.3f}  (real greedy decoding, bonus included; "
                     f"{summary.get('eval/decode_tokens_per_s', 0):.1f} tok/s)")
    if "best_decode_tau" in summary:
        lines.append(f"  best decoding tau {summary['best_decode_tau']:.3f} at step {summary['best_decode_step']}: "
                     f"{summary['best_drafter_dir']}")
    return "\n".join(lines)
