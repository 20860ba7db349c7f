"""The whole suite as CI runs it, in four timed phases sized for a 2-core CPU.

    python tests/run_suite.py                 # all four phases
    python -m pytest -n 2 && python tests/run_suite.py --after-fast-tier   # README's test command, .ci/run
    python tests/run_suite.py --no-engines    # fast tier + mutation check (no vLLM environment)

1. Fast tier: `pytest -n 2` (every test uses one torch thread, so two xdist workers keep both
   cores busy: 296 s vs 610 s on one worker, on the 2-core CPU).
2. vLLM's CPU environment, built if it is not cached (`ensure_vllm_env`: pip, minutes on a fresh
   machine).
3. Engine tier: `pytest -m engine tests/engines`, vLLM serving drafttrain's EAGLE-3 and EAGLE-1
   exports (one process, one thread; vLLM's engine core in-process). The other engine tests
   (Medusa-1, an export folder served alone, the full-vocabulary export, a refusal, the
   engine-check CLI, eval baselines, the reduced-Medusa xfail) are `slow` only:
   `python -m pytest -m slow tests/engines` (~10 min).
4. Mutation check: `tests/mutation_check.py --no-baseline`, two mutants at a time. Its baseline
   (every selection on the unmutated copy) is what phase 1 has just run and passed on the same
   files; the copy's own import check still runs.

Nothing overlaps, as measured on the 2-core CPU: the environment's build beside the fast tier made
that phase 620 s (296 s alone, the build 212 s alone); both pytest tiers in one `pytest -n 2` took
994 s; the engine tier on two workers 363 s (350 s on one); the engine tier beside the mutation
check ran past 570 s (in turn: ~470 s, then ~250 s). Work that runs beside other work here slows down more
than it gains. The DeepSpeed two-process test is the fast tier's tail on a fresh machine (79-150 s:
DeepSpeed JIT-compiles its CPU shm_comm op into ~/.cache/torch_extensions; 20 s once cached).

Each phase's wall time is printed; the first phase that fails stops the run with its exit code.
Not a pytest module (its name does not start with test_).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    ap.add_argument("--after-fast-tier", action="store_true",
                    help="start at phase 2: the caller has just run the fast tier (README's test command "
                    "runs `python -m pytest -n 2` itself, then this)")
    args = ap.parse_args(argv)
    engines = not args.no_engines and os.environ.get("DRAFTTRAIN_SKIP_ENGINES") != "1"
    py = sys.executable
    xdist = ["-n", str(args.workers)] if args.workers > 1 else []
    times: list[tuple[str, float, int]] = []
    t0 = time.monotonic()

    rc = 0 if args.after_fast_tier else _phase("fast tier", [py, "-m", "pytest", *xdist, "--durations=10"], times)
    if rc == 0 and engines:
        t = time.monotonic()
        print("\n=== vLLM environment: building it unless it is cached", flush=True)
        try:
            from drafttrain.engines.vllm import ensure_vllm_env

            ensure_vllm_env(log=lambda line: print(line, flush=True))
            times.append(("vLLM environment", time.monotonic() - t, 0))
        except Exception as e:  # EngineError: one line naming pip's error; the engine tests would fail the same way
            print(f"=== vLLM environment: FAILED: {e}", flush=True)
            times.append(("vLLM environment", time.monotonic() - t, 1))
            rc = 1
        if rc == 0:
            rc = _phase("engine tier", [py, "-m", "pytest", "-m", "engine", "tests/engines", "--durations=10"], times)
    if rc == 0:
        rc = _phase("mutation check", [py, "tests/mutation_check.py", "--no-baseline", "--jobs",
                                       str(max(1, args.workers))], times)

    print("\nsuite: " + ", ".join(f"{n} {s:.0f} s (exit {c})" for n, s, c in times)
          + f"; {time.monotonic() - t0:.0f} s in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
