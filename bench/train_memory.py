"""Training memory and throughput of the default recipe, for 1 and 2 processes and long sequences.

    python bench/train_memory.py                                  # gemma-3-270m, recipe=eagle
    python bench/train_memory.py --target /path/to/tiny --steps 2 --seq-lens 128,256
    python bench/train_memory.py --ttt-attention                 # the TTT attention alone, chunked or not

For every (processes, sequence length) pair it runs a few optimizer steps of `recipe=eagle`
(train.max_steps) on synthetic conversations at least that long (truncated to data.max_len =
the length, so every record is exactly that long), launched the way a user would: plain
`python drafttrain/train.py` for 1 process, `accelerate launch --config_file
recipes/accelerate/ddp.yaml` for more. Each worker records its own peak RSS and, on a GPU,
`torch.cuda.max_memory_allocated`; the table shows the largest process. tokens/s comes from the
run's summary (training time only, all processes together, first step included).

Deliberately not here: checkpoints (save_every=0), evaluation, decoding, warm-up exclusion; this is
a sizing tool, not a test. Without GPUs the processes are CPU processes joined by gloo, so on a
2-core machine the 2-process tokens/s measures contention, not scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the drafter predicts several tokens ahead of the target model and the target verifies them in one "
         "forward pass so that accepted tokens cost less than one forward each").split()


def synthetic_chat(path: Path, n: int, words: int) -> Path:
    """n ShareGPT-style records whose answers have `words` words (at least `words` tokens)."""
    recs = []
    for i in range(n):
        answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
        recs.append({"conversations": [{"from": "human", "value": f"Explain speculative decoding ({i})."},
                                       {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(recs))
    return path


def worker(out_dir: str, argv: list[str]) -> int:
    """Run `drafttrain train ARGV` in this process, then write this rank's peak memory."""
    import torch

    from drafttrain.cli import main

    code = main(["train", *argv])
    rank = int(os.environ.get("RANK", "0"))
    peak = {"rank": rank, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        peak["cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(out_dir, f"peak-rank{rank}.json").write_text(json.dumps(peak))
    return code


def launch(procs: int, seq_len: int, args: argparse.Namespace, work: Path) -> dict:
    """One measurement: returns {procs, seq_len, tokens_per_s, rss_mib, cuda_mib, wall_s} or an error."""
    run_dir = work / f"p{procs}-L{seq_len}"
    run_dir.mkdir(parents=True, exist_ok=True)
    micro = args.steps * args.grad_accum * procs
    data = synthetic_chat(work / f"chat-{seq_len}.json", micro + 8, seq_len)
    train_args = [
        f"recipe={args.recipe}", f"target={args.target}", f"data.path={data}", f"data.max_len={seq_len}",
        f"data.num_samples={micro}", "data.heldout=1", f"train.max_steps={args.steps}",
        f"train.grad_accum={args.grad_accum}", f"train.batch_size={args.batch_size}", "train.save_every=0",
        "train.max_minutes=0", "train.decode_eval_final=false", "train.eval_every=0", "train.warmup_steps=0",
        f"output_dir={run_dir / 'run'}", *args.overrides,
    ]
    me = [str(Path(__file__).resolve()), "--worker", str(run_dir)]
    if procs == 1:
        cmd = [sys.executable, *me, "--", *train_args]
    else:
        accelerate = Path(sys.executable).with_name("accelerate")
        cmd = [str(accelerate), "launch", "--config_file", str(REPO / "recipes/accelerate/ddp.yaml"),
               "--num_processes", str(procs), "--main_process_port", str(args.port), *me, "--", *train_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    row: dict = {"procs": procs, "seq_len": seq_len, "wall_s": round(time.time() - t0, 1)}
    if p.returncode != 0:
        tail = [ln for ln in p.stderr.replace("\r", "\n").splitlines() if ln.strip()][-1:] or ["?"]
        row["error"] = tail[0][:200]
        return row
    summary = json.loads((run_dir / "run" / "summary.json").read_text())
    peaks = [json.loads(f.read_text()) for f in run_dir.glob("peak-rank*.json")]
    row["tokens_per_s"] = summary["train_tokens_per_s"]
    row["rss_mib"] = max(x["rss_mib"] for x in peaks)
    if any("cuda_mib" in x for x in peaks):
        row["cuda_mib"] = max(x.get("cuda_mib", 0.0) for x in peaks)
    return row


def ttt_worker(seq_len: int, chunk: int, heads: int, kv_heads: int, head_dim: int, steps: int) -> int:
    """Forward + backward of the EAGLE-3 training-time-test attention alone; prints peak RSS as JSON."""
    import torch

    from drafttrain.models.eagle import ttt_attention

    torch.manual_seed(0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.time()
    q = torch.randn(1, heads, seq_len, head_dim, requires_grad=True)
    valid = torch.ones(1, seq_len, dtype=torch.bool)
    keys, values, loss = [], [], 0.0
    for k in range(steps):  # step k attends to the causal block plus k diagonal columns
        keys.append(torch.randn(1, kv_heads, seq_len, head_dim, requires_grad=True))
        values.append(torch.randn(1, kv_heads, seq_len, head_dim, requires_grad=True))
        loss = loss + ttt_attention(q * (1 + k), keys, values, valid, chunk).square().mean()
    loss.backward()
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"seq_len": seq_len, "chunk": chunk, "peak_mib": peak, "time_s": time.time() - t0}))
    return 0


def ttt_table(args: argparse.Namespace) -> int:
    """Peak memory of the TTT attention, one block (chunk 0) vs query chunks, each in a fresh process."""
    print(f"training-time-test attention, forward + backward: batch 1, {args.heads} heads ({args.kv_heads} kv), "
          f"head_dim {args.head_dim}, {args.ttt_steps} unroll steps; peak RSS above the process baseline")
    print(f"{'seq_len':>7} {'chunk':>6} {'peak MiB':>9} {'time s':>7}")
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        for chunk in (0, args.chunk):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--ttt-worker", str(seq_len), str(chunk),
                   str(args.heads), str(args.kv_heads), str(args.head_dim), str(args.ttt_steps)]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if p.returncode != 0:
                print(f"{seq_len:>7} {chunk:>6}  failed: {p.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"{seq_len:>7} {chunk:>6} {r['peak_mib']:>9.0f} {r['time_s']:>7.1f}", flush=True)
    return 0


def table(rows: list[dict]) -> str:
    gpu = any("cuda_mib" in r for r in rows)
    head = f"{'procs':>5} {'seq_len':>7} {'tokens/s':>10} {'peak RSS MiB':>13}" + (f" {'peak CUDA MiB':>14}" if gpu else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['procs']:>5} {r['seq_len']:>7}  failed: {r['error']}")
            continue
        line = f"{r['procs']:>5} {r['seq_len']:>7} {r['tokens_per_s']:>10.1f} {r['rss_mib']:>13.0f}"
        lines.append(line + (f" {r.get('cuda_mib', 0):>14.0f}" if gpu else ""))
    return "\n".join(lines)


def main() -> int:
    if "--ttt-worker" in sys.argv:  # one attention measurement started by `ttt_table`
        i = sys.argv.index("--ttt-worker")
        return ttt_worker(*(int(x) for x in sys.argv[i + 1:i + 7]))
    if "--worker" in sys.argv:  # a training process started by `launch`
        i = sys.argv.index("--worker")
        rest = sys.argv[i + 2:]
        return worker(sys.argv[i + 1], rest[1:] if rest[:1] == ["--"] else rest)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma-3-270m", help="target (alias, hub id or folder); default gemma-3-270m")
    ap.add_argument("--recipe", default="eagle", help="recipe to measure (default: eagle, the default recipe)")
    ap.add_argument("--procs", default="1,2", help="comma-separated process counts (default 1,2)")
    ap.add_argument("--seq-lens", default="512,2048,4096", help="comma-separated sequence lengths")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per measurement (default 3)")
    ap.add_argument("--grad-accum", type=int, default=2, help="train.grad_accum (the recipe's is 2)")
    ap.add_argument("--batch-size", type=int, default=1, help="train.batch_size per process (default 1)")
    ap.add_argument("--port", type=int, default=29533, help="rendezvous port for multi-process runs")
    ap.add_argument("--out", default="", help="also write the rows as JSON to this file")
    ap.add_argument("--ttt-attention", action="store_true",
                    help="instead: peak memory of the TTT attention alone, one block vs query chunks")
    ap.add_argument("--chunk", type=int, default=1024, help="--ttt-attention: query rows per chunk")
    ap.add_argument("--heads", type=int, default=4, help="--ttt-attention: query heads (Gemma 3 270M: 4)")
    ap.add_argument("--kv-heads", type=int, default=1, help="--ttt-attention: kv heads (Gemma 3 270M: 1)")
    ap.add_argument("--head-dim", type=int, default=256, help="--ttt-attention: head dim (Gemma 3 270M: 256)")
    ap.add_argument("--ttt-steps", type=int, default=7, help="--ttt-attention: unroll steps (recipe: 7)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run (e.g. dtype=float32)")
    args = ap.parse_args()
    if args.ttt_attention:
        return ttt_table(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="drafttrain-bench-") as tmp:
        for procs in (int(x) for x in args.procs.split(",")):
            for seq_len in (int(x) for x in args.seq_lens.split(",")):
                print(f"measuring {procs} process(es), sequence length {seq_len} ...", flush=True)
                rows.append(launch(procs, seq_len, args, Path(tmp)))
    print(f"\n{args.recipe} on {args.target}: {args.steps} steps x grad_accum {args.grad_accum} x batch "
          f"{args.batch_size} per process; peak = the largest process")
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
