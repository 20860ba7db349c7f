"""Several processes and one machine's cores: what the training loop needs from distribution.

Without CUDA, processes from `accelerate launch` are joined by gloo (`launch_kwargs`); stop
decisions (signal, time limit) are agreed by all ranks before anyone saves (`agreed`, `StopFlag`);
the frozen target is loaded as a full replica even under ZeRO-3 (`full_replica`); the final
drafter is gathered from FSDP / ZeRO-3 shards (`gathered_drafter`); a CPU run uses its share of
the cores (`cpu_threads`).

Deliberately not here: the loop itself (trainer.py), checkpoints (checkpoints.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["cpu_processes", "launch_kwargs", "agreed", "StopFlag", "full_replica", "gathered_drafter", "cpu_threads"]


def cpu_processes() -> bool:
    """True when a launcher started several processes on a machine without CUDA.

    Accelerate then needs `cpu=True` to join them with gloo; without it each process silently
    trains alone (and all of them write the same run folder).
    """
    return not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_kwargs() -> dict:
    """Accelerator arguments for CPU processes: gloo under DeepSpeed (which refuses cpu=True), else cpu=True."""
    if not cpu_processes():
        return {}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": True}


def agreed(accelerator, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over processes, so all of them save and stop at the same step.

    A signal or the time limit can reach one process a step before another; acting on the local
    flag would leave the others waiting forever in the checkpoint's collectives.
    """
    if accelerator.num_processes == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], device=accelerator.device)
    return tuple(bool(v) for v in accelerator.reduce(t, reduction="sum").tolist())


def max_over_processes(accelerator, value: float) -> float:
    """The largest of each process's `value` (the training clock under train.lr_schedule=time: every
    process must set the same learning rate, or DDP replicas drift apart)."""
    if accelerator.num_processes == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class StopFlag:
    """SIGTERM / SIGINT: finish the current step, save a checkpoint, exit cleanly."""

    def __init__(self) -> None:
        self.stop = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.stop:  # second signal: give up now
            raise KeyboardInterrupt
        self.stop = True
        print(f"\ndrafttrain: got signal {signum}; saving a checkpoint and stopping (send again to abort)", flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


@contextmanager
def full_replica(accelerator) -> Iterator[None]:
    """Load the frozen target unpartitioned under DeepSpeed ZeRO-3.

    Accelerate registers its DeepSpeed config with transformers, and transformers then creates
    every `from_pretrained` model partitioned under ZeRO-3. The target is not part of the DeepSpeed
    engine, so nothing would gather its weights: it must be a plain replica.
    """
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == "DEEPSPEED" else None
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def gathered_drafter(accelerator, drafter, target):
    """The unwrapped drafter with full weights, for saving.

    Under FSDP / ZeRO-3 the wrapped module only holds this process's shard, so the full state dict
    is gathered (a collective: every process must call this) into a fresh copy. DDP, ZeRO-2 and a
    single process return the unwrapped module itself.
    """
    raw = accelerator.unwrap_model(drafter)
    if accelerator.distributed_type not in ("DEEPSPEED", "FSDP"):
        return raw
    full = accelerator.get_state_dict(drafter)  # complete on the main process
    if not accelerator.is_main_process:
        return raw
    fresh = type(raw)(raw.cfg) if hasattr(raw, "cfg") else type(raw)(raw.config)  # ours / an HF draft LM
    fresh.load_state_dict({k: v.to("cpu") for k, v in full.items()})
    if getattr(raw, "feature_scaled", False):  # EAGLE-3's feature scale is a non-persistent buffer: carry it over
        fresh.set_feature_scale(raw.aux_scale.detach().to("cpu"))
    if hasattr(fresh, "attach_target"):
        fresh.attach_target(target)
    return fresh.to(device=accelerator.device)


def _others_running(samples: int = 3, gap: float = 0.1) -> int:
    """Runnable tasks besides this one right now (fewest over a few looks; -1 where /proc is missing)."""
    seen = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                seen.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return -1
        if i + 1 < samples:
            time.sleep(gap)
    return min(seen)


def busy_cores_warning(threads: int) -> str:
    """A one-line warning when other jobs already keep this machine's cores busy ("" if not):
    torch's CPU threads wait for each other at every op, so `threads` threads on fewer free cores
    run many times slower than fewer threads (2 threads on one free core: 25x slower here)."""
    if not hasattr(os, "getloadavg") or threads <= 1:
        return ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0]
    if cores - load >= threads - 0.5 or _others_running() == 0:  # the load average lags a finished job by minutes
        return ""
    free = max(1, int(cores - load + 0.5))
    return (f"drafttrain: warning: load average {load:.1f} on {cores} cores, and this run uses {threads} threads; "
            f"threads wait for each other on shared cores: set threads={free} or run when the machine is idle")


def cpu_threads(threads: int, device: torch.device) -> int:
    """Sets torch's CPU threads; returns the number set (0 = left alone, e.g. on GPUs).

    `accelerate launch` exports OMP_NUM_THREADS=1 unless told otherwise, which leaves all but one
    core idle in a single-process CPU run. `threads=0` (auto) gives each process of such a launch
    its share of the machine's cores instead; other runs (plain `python`, which already uses every
    core, or GPUs) are left alone. An explicit `threads=N` wins everywhere.
    """
    launched = "ACCELERATE_DYNAMO_BACKEND" in os.environ and os.environ.get("OMP_NUM_THREADS") == "1"
    if threads <= 0 and (torch.device(device).type != "cpu" or not launched):
        return 0
    if threads <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("ACCELERATE_NUM_PROCESSES") or 1)
        threads = max(1, cores // max(local, 1))
    torch.set_num_threads(threads)
    return threads
