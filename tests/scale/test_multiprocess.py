"""Real multi-process training on CPU (gloo) through the shipped Accelerate launch configs.

Data order: EpochSampler yields one permutation of the records; `accelerator.prepare` shards the
DataLoader's batches (not the records) round-robin, so with P processes of batch b, optimizer step
s sees batches s*P .. s*P+P-1 of the b-sized split of that permutation, i.e. exactly the records
of batch s of one process with batch P*b. The loss is a token mean per process and DDP averages
the processes' gradients, so the runs agree only when every process has as many loss tokens:
equal-length records (see `uniform_chat`) and no out-of-draft-vocab masking (which drops a
data-dependent number of positions). Then the weights agree up to float summation order.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from scale_helpers import FAST, REPO, assert_same_weights, child_env, drafter_weights, train_cmd

from drafttrain.models.eagle import load_drafter
from drafttrain.targets import load_target

STEPS = ["train.max_steps=3", "train.save_every=0", "drafter.mask_out_of_vocab=false"]  # see the docstring


def _args(target, data, out, *extra):
    return [f"target={target}", f"data.path={data}", f"output_dir={out}", *FAST, *STEPS, *extra]


@pytest.fixture(scope="module")
def one_process_run(tiny_dir, uniform_chat, tmp_path_factory):
    """The reference: 1 process, batch 4."""
    out = tmp_path_factory.mktemp("one-proc") / "run"
    p = subprocess.run(train_cmd(_args(tiny_dir, uniform_chat, out, "train.batch_size=4")), cwd=REPO,
                       env=child_env(out.parent), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_ddp_two_processes_match_one_process(one_process_run, tiny_dir, uniform_chat, tmp_path, run):
    out = tmp_path / "ddp"
    # The time schedule and a snapshot add collectives (the shared clock, the gather): they must not
    # hang or split the replicas. An hour's budget leaves the cosine on the steps, as in the reference.
    p = run(train_cmd(_args(tiny_dir, uniform_chat, out, "train.batch_size=2", "train.max_minutes=60",
                            "train.lr_schedule=time", "train.snapshot_minutes=[0]"), config="ddp.yaml", nproc=2))
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "snapshots" / "train-0min" / "model.safetensors").is_file()
    assert _summary(out)["num_processes"] == 2  # really two processes, not two lone runs
    assert p.stdout.count("run finished") == 1  # the summary is printed once, by rank 0
    # 3 AdamW steps at lr 3e-3 move weights by ~1e-2; a different data split would show at that scale.
    assert_same_weights(drafter_weights(out), drafter_weights(one_process_run), atol=2e-5)


def test_deepspeed_zero2_two_processes_match_and_load(one_process_run, tiny_dir, uniform_chat, tmp_path, run):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install drafttrain[deepspeed])")
    out = tmp_path / "zero2"
    p = run(train_cmd(_args(tiny_dir, uniform_chat, out, "train.batch_size=2"), config="deepspeed_zero2.yaml",
                      nproc=2))
    assert p.returncode == 0, p.stderr[-3000:]
    s = _summary(out)
    assert s["num_processes"] == 2 and s["steps"] == 3
    assert (out / "checkpoints" / "step-0000003" / "trainer_state.json").is_file()
    target, _, _ = load_target(str(tiny_dir), dtype="float32")
    drafter = load_drafter(out / "drafter", target)
    assert drafter.cfg.draft_vocab_size == 120
    # ZeRO-2 partitions optimizer state and gradients, not the arithmetic: same weights as 1 process.
    assert_same_weights(drafter_weights(out), drafter_weights(one_process_run), atol=2e-5)


@pytest.mark.slow
def test_deepspeed_zero3_two_processes_save_a_loadable_drafter(tiny_dir, uniform_chat, tmp_path, run):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install drafttrain[deepspeed])")
    out = tmp_path / "zero3"
    p = run(train_cmd(_args(tiny_dir, uniform_chat, out, "train.batch_size=2", "train.max_steps=2"),
                      config="deepspeed_zero3.yaml", nproc=2))
    assert p.returncode == 0, p.stderr[-3000:]
    assert _summary(out)["num_processes"] == 2
    target, _, _ = load_target(str(tiny_dir), dtype="float32")
    drafter = load_drafter(out / "drafter", target)  # gathered from the ZeRO-3 partitions on rank 0
    assert all(t.numel() > 0 for t in drafter.state_dict().values())


@pytest.mark.gpu
def test_fsdp_completes_two_steps_and_saves_a_loadable_drafter(tiny_dir, uniform_chat, tmp_path, run):
    # Accelerate turns FSDP on only for GPU-like process groups (MULTI_GPU / NPU / XPU ...), never for
    # CPU processes: there the FSDP config silently trains with DDP (drafttrain logs a warning).
    if not torch.cuda.is_available():
        pytest.skip("Accelerate has no FSDP for CPU processes; needs CUDA")
    out = tmp_path / "fsdp"
    n = max(1, torch.cuda.device_count())
    p = run(train_cmd(_args(tiny_dir, uniform_chat, out, "train.batch_size=2", "train.max_steps=2"),
                      config="fsdp.yaml", nproc=n))
    assert p.returncode == 0, p.stderr[-3000:]
    assert _summary(out)["steps"] == 2
    target, _, _ = load_target(str(tiny_dir), dtype="float32")
    load_drafter(out / "drafter", target)


def test_prepare_sharded_over_two_processes_equals_one(tiny_dir, uniform_chat, tmp_path, run):
    """Offline features: shards go round-robin to ranks; the cache is the same as one process's."""
    from safetensors.torch import load_file

    args = ["features.shard_size=3", "dtype=float32", "data.heldout=4", "data.max_len=96"]
    one, two = tmp_path / "one", tmp_path / "two"
    p = run([sys.executable, "-m", "drafttrain.cli", "prepare", f"target={tiny_dir}", f"data.path={uniform_chat}",
             f"output_dir={one}", *args])
    assert p.returncode == 0, p.stderr[-3000:]
    cmd = train_cmd([f"target={tiny_dir}", f"data.path={uniform_chat}", f"output_dir={two}", *args],
                    config="ddp.yaml", nproc=2)
    cmd[cmd.index("drafttrain/train.py"):cmd.index("drafttrain/train.py") + 1] = ["-m", "drafttrain.cli", "prepare"]
    p = run(cmd)
    assert p.returncode == 0, p.stderr[-3000:]
    # Rank 0 (the only bar) did shards 0, 2, 4, 6 = 11 of the 20 records: the work was really split.
    assert "prepare features (rank 0)" in p.stderr and "11/11" in p.stderr and "20/20" not in p.stderr
    a = sorted((one / "features").glob("shard-*.safetensors"))
    b = sorted((two / "features").glob("shard-*.safetensors"))
    assert [x.name for x in a] == [x.name for x in b] and len(a) == 7
    for x, y in zip(a, b):
        ta, tb = load_file(str(x)), load_file(str(y))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
