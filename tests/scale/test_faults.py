"""Surviving faults, each in a real subprocess: SIGKILL mid-`prepare` and mid-training, SIGTERM,
a NaN loss, an output folder that cannot be written.

What a user must be able to rely on: a killed run leaves its last complete checkpoint (or
cache shard) readable and resuming gives the same result as never stopping; a signal saves and
exits; a NaN names the step and batch and keeps the last good checkpoint; bad paths are one line.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from scale_helpers import FAST, assert_same_weights, cli_cmd, drafter_weights, train_cmd, wait_for

from drafttrain.trainer import latest_checkpoint


def _args(target, data, out, *extra):
    return [f"target={target}", f"data.path={data}", f"output_dir={out}", *FAST, *extra]


def _shards(folder) -> dict:
    return {p.name: load_file(str(p)) for p in sorted(folder.glob("shard-*.safetensors"))}


def test_prepare_killed_midway_then_restarted_equals_uninterrupted(tiny_dir, uniform_chat, tmp_path, run, start):
    common = ("features.shard_size=2",)  # 20 training records -> 10 shards
    straight = tmp_path / "straight"
    p = run(cli_cmd("prepare", _args(tiny_dir, uniform_chat, straight, *common)))
    assert p.returncode == 0, p.stderr[-3000:]
    want = _shards(straight / "features")
    assert len(want) == 10

    killed = tmp_path / "killed"
    proc = start(cli_cmd("prepare", _args(tiny_dir, uniform_chat, killed, *common),
                         faults=["--sleep-per-record", "0.1"]), "prepare")
    wait_for(lambda: (killed / "features" / "shard-00003.safetensors").exists(), proc, what="shard 3")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _shards(killed / "features")
    assert 4 <= len(done) < 10, f"killed too late to test anything: {len(done)} shards"

    p = run(cli_cmd("prepare", _args(tiny_dir, uniform_chat, killed, *common)))
    assert p.returncode == 0, p.stderr[-3000:]
    got = _shards(killed / "features")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys()
        for k in want[name]:
            assert torch.equal(got[name][k], want[name][k]), f"{name}/{k}"


def test_training_killed_midway_then_resumed_equals_uninterrupted(tiny_dir, uniform_chat, tmp_path, run, start):
    common = ("train.max_steps=8", "train.save_every=3", "train.batch_size=2")
    straight = tmp_path / "straight"
    p = run(train_cmd(_args(tiny_dir, uniform_chat, straight, *common)))
    assert p.returncode == 0, p.stderr[-3000:]

    killed = tmp_path / "killed"
    proc = start(cli_cmd("train", _args(tiny_dir, uniform_chat, killed, *common),
                         faults=["--sleep-per-step", "0.3"]), "train")
    first = killed / "checkpoints" / "step-0000003" / "trainer_state.json"
    wait_for(first.exists, proc, what="the step-3 checkpoint")
    time.sleep(0.45)  # into step 5: between checkpoints
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "drafter").exists()
    ck = latest_checkpoint(killed)
    assert ck is not None and json.loads((ck / "trainer_state.json").read_text())["step"] in (3, 6)

    p = run(train_cmd(_args(tiny_dir, uniform_chat, killed, *common, "train.resume=true")))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout
    assert json.loads((killed / "summary.json").read_text())["steps"] == 8
    assert_same_weights(drafter_weights(killed), drafter_weights(straight), atol=1e-6, rtol=1e-5)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_dir, uniform_chat, tmp_path, run, start):
    common = ("train.max_steps=40", "train.save_every=0", "train.batch_size=2", "train.epochs=10")
    out = tmp_path / "run"
    proc = start(cli_cmd("train", _args(tiny_dir, uniform_chat, out, *common), faults=["--sleep-per-step", "0.2"]),
                 "train")
    wait_for(lambda: "train eagle3:" in (tmp_path / "train.err").read_text(), proc, what="the training loop")
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    out_text = (tmp_path / "train.out").read_text()
    assert "got signal 15" in out_text and "resume with train.resume=true" in out_text
    ck = latest_checkpoint(out)
    assert ck is not None
    step = json.loads((ck / "trainer_state.json").read_text())["step"]
    assert 0 < step < 40
    assert not (out / "drafter").exists()

    p = run(train_cmd(_args(tiny_dir, uniform_chat, out, *common, "train.resume=true")))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"(step {step}," in p.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 40


def test_nan_loss_stops_naming_step_and_batch_and_keeps_last_checkpoint(tiny_dir, uniform_chat, tmp_path, run):
    out = tmp_path / "run"
    p = run(cli_cmd("train", _args(tiny_dir, uniform_chat, out, "train.max_steps=6", "train.save_every=2",
                                   "train.batch_size=2"), faults=["--nan-at-step", "4"]))
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.replace("\r", "\n").splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    msg = errors[0]
    assert msg.startswith("drafttrain: error: loss is nan at step 4 (epoch 0, batch 4)"), msg
    assert str(out / "checkpoints" / "step-0000002") in msg
    ck = latest_checkpoint(out)
    assert ck is not None and ck.name == "step-0000002"
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == 2
    sd = load_file(str(ck / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in sd.values() if t.is_floating_point())
    assert not (out / "drafter").exists()


def test_output_dir_that_cannot_be_created_is_one_line(tiny_dir, uniform_chat, tmp_path, run):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    p = run(train_cmd(_args(tiny_dir, uniform_chat, blocker / "run", "train.max_steps=1")))
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.replace("\r", "\n").splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert errors[0].startswith("drafttrain: error: output_dir ") and "a-file/run" in errors[0]


def test_read_only_output_dir_is_one_line(tiny_dir, uniform_chat, tmp_path, run):
    import os

    if os.geteuid() == 0:
        pytest.skip("root can write into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        p = run(train_cmd(_args(tiny_dir, uniform_chat, ro, "train.max_steps=1")))
    finally:
        ro.chmod(0o700)
    assert p.returncode == 2
    assert "drafttrain: error: output_dir" in p.stderr and "not writable" in p.stderr


@pytest.mark.parametrize("exc,needle", [
    (OSError(28, "No space left on device", "/runs/x/checkpoints/.tmp-step-0000200/optimizer.bin"),
     "disk full while writing /runs/x/checkpoints/.tmp-step-0000200/optimizer.bin"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail"),
     "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); lower train.batch_size"),
    (MemoryError(), "out of memory; lower train.batch_size"),
])
def test_disk_full_and_out_of_memory_are_one_line(exc, needle, capsys, monkeypatch):
    from drafttrain.cli import run_guarded

    monkeypatch.delenv("DRAFTTRAIN_DEBUG", raising=False)

    def fail():
        raise exc

    assert run_guarded(fail) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("drafttrain: error: ") and needle in err, err
