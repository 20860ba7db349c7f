"""Checkpoints: Accelerate's state (drafter, optimizer, RNG) + scheduler + trainer_state.json.

Each checkpoint (`<run>/checkpoints/step-N`) is written to a temp folder and renamed into place
(the rename is the commit point), so a killed run always leaves the last complete one; the oldest
beyond `keep` are removed. `latest_checkpoint` finds the newest complete one for `train.resume`.

Deliberately not here: when to save (trainer.py), the drafter folder (drafter_io.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["latest_checkpoint", "save_checkpoint"]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ck = run_dir / "checkpoints"
    if not ck.is_dir():
        return None
    done = [p for p in ck.glob("step-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def save_checkpoint(accelerator, run_dir: Path, state: dict, scheduler, keep: int) -> Path:
    ck = run_dir / "checkpoints"
    final = ck / f"step-{state['step']:07d}"
    tmp = ck / f".tmp-step-{state['step']:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank's RNG file / shard is in tmp before the rename
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), tmp / "scheduler_lambda.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # the rename is the commit point
        for old in sorted((p for p in ck.glob("step-*")), key=lambda p: p.name)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
