"""The whole suite as CI runs it, in three timed phases sized for a 2-core CPU.

    python tests/run_suite.py                 # what .ci/run and README's test command run
    python tests/run_suite.py --no-engines    # fast tier + mutation check (no vLLM environment)

1. Fast tier: `pytest -n 2` (every test uses one torch thread, so two xdist workers keep both
   cores busy), while vLLM's CPU environment is built beside it (`ensure_vllm_env`: pip, one core,
   minutes on a fresh machine; cached, so later runs skip it).
2. Engine tier: `pytest -m engine tests/engines`, vLLM serving drafttrain's exports, in one
   process: on two workers it took as long (363 s vs 350 s), every vLLM call and training run
   about 2-3x slower beside the other worker's.
3. Mutation check: `tests/mutation_check.py`, two mutants at a time.

Why phases and not one pytest run over everything: measured on the 2-core CPU, the fast tier and
the engine tier in one `pytest -n 2` run took 994 s, while each alone took 296 s (fast, two
workers) and 350 s + 212 s for the environment (engine, one worker). Where the overlap loses its
time was not pinned down (vLLM's processes beside two-process DDP / DeepSpeed tests are the
suspects); the pip build beside the fast tier costs it little.

Each phase's wall time is printed; the first phase that fails stops the run with its exit code.
The vLLM build's output goes to a log file whose path is printed (pip's own log is beside the
environment, see drafttrain.engines.vllm). Not a pytest module (its name does not start with test_).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build_engine_env(log_path: Path, result: dict) -> None:
    """Builds (or finds) the vLLM environment; any error is kept for the engine phase to report."""
    from drafttrain.engines.vllm import ensure_vllm_env

    t = time.monotonic()
    with open(log_path, "w") as log:
        try:
            result["python"] = ensure_vllm_env(log=lambda line: (log.write(line + "\n"), log.flush()))
        except Exception as e:  # EngineError and anything else: the engine tests fail with it again
            result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = time.monotonic() - t


def _phase(name: str, cmd: list[str], times: list[tuple[str, float, int]]) -> int:
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    t = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    times.append((name, time.monotonic() - t, rc))
    print(f"=== {name}: exit {rc} after {times[-1][1]:.0f} s", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fast tier, engine tier and mutation check, as CI runs them.")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers per pytest phase (default 2)")
    ap.add_argument("--no-engines", action="store_true", help="skip the vLLM environment and the engine tier")
    args = ap.parse_args(argv)
    engines = not args.no_engines and os.environ.get("DRAFTTRAIN_SKIP_ENGINES") != "1"
    py = sys.executable
    xdist = ["-n", str(args.workers)] if args.workers > 1 else []
    times: list[tuple[str, float, int]] = []
    t0 = time.monotonic()

    build: dict = {}
    builder = None
    if engines:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"drafttrain-vllm-env-{os.getpid()}.log"
        print(f"vLLM environment: building or reusing it in the background (progress: {log_path})", flush=True)
        builder = threading.Thread(target=_build_engine_env, args=(log_path, build), daemon=True)
        builder.start()

    rc = _phase("fast tier", [py, "-m", "pytest", *xdist, "--durations=10"], times)
    if rc == 0 and engines:
        builder.join()
        print(f"vLLM environment: {'ready' if 'python' in build else 'FAILED: ' + build.get('error', '?')} "
              f"({build['seconds']:.0f} s, beside the fast tier)", flush=True)
        rc = _phase("engine tier", [py, "-m", "pytest", "-m", "engine", "tests/engines", "--durations=10"], times)
    if rc == 0:
        rc = _phase("mutation check", [py, "tests/mutation_check.py", "--jobs", str(max(1, args.workers))], times)

    print("\nsuite: " + ", ".join(f"{n} {s:.0f} s (exit {c})" for n, s, c in times)
          + f"; {time.monotonic() - t0:.0f} s in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
