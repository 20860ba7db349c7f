"""One tracker object: a no-op when tracking is off, W&B when `tracking=wandb`.

W&B runs offline when there is no API key or no network (and says how to `wandb sync` later).
Metric keys are `/`-namespaced (`train/loss`, `eval/tau_sim`). Only rank 0 tracks.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


class NoTracker:
    """Tracking off: every call does nothing."""

    run_dir: str | None = None

    def log(self, metrics: dict, step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | Path, name: str, type_: str = "model", metadata: dict | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


def _online_possible() -> bool:
    if not (os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").exists()):
        return False
    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=2).close()
        return True
    except OSError:
        return False


class WandbTracker:
    def __init__(self, *, project: str, entity: str, name: str, mode: str, config: dict, run_dir: str) -> None:
        import wandb

        if mode == "auto":
            mode = "online" if _online_possible() else "offline"
        self.mode = mode
        self.run = wandb.init(project=project, entity=entity or None, name=name or None, mode=mode,
                              config=config, dir=run_dir, reinit="finish_previous")
        self.run_dir = self.run.dir

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def log_artifact(self, path: str | Path, name: str, type_: str = "model", metadata: dict | None = None) -> None:
        import wandb

        art = wandb.Artifact(name=name, type=type_, metadata=metadata or {})
        art.add_dir(str(path)) if Path(path).is_dir() else art.add_file(str(path))
        self.run.log_artifact(art)

    def finish(self) -> None:
        run_path = Path(self.run.dir).parent
        self.run.finish()
        if self.mode == "offline":
            print(f"W&B run saved offline; upload it later with: wandb sync {run_path}")


def make_tracker(kind: str, *, is_main: bool, **kwargs):
    if kind == "none" or not is_main:
        return NoTracker()
    if kind == "wandb":
        try:
            return WandbTracker(**kwargs)
        except ImportError as e:
            raise SystemExit("tracking=wandb needs wandb: pip install 'drafttrain[wandb]'") from e
    raise ValueError(f"unknown tracker {kind!r}")
