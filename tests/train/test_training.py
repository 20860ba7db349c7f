"""End-to-end training on tiny targets: weights change, loss falls, features and resume agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafttrain.cli import main
from drafttrain.config import parse_args
from drafttrain.schema import TrainConfig
from drafttrain.trainer import train

FAST = ["dtype=float32", "train.mixed_precision=no", "data.heldout=4", "data.max_len=96", "train.warmup_steps=0",
        "train.log_every=1", "drafter.ttt_steps=3", "drafter.draft_vocab_size=120"]


def cfg_for(target: Path, data: Path, out: Path, *extra: str) -> TrainConfig:
    return parse_args([f"target={target}", f"data.path={data}", f"output_dir={out}", *FAST, *extra], TrainConfig)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "drafter" / "model.safetensors"))


def fixed_batch_loss(cfg: TrainConfig, run: Path) -> float:
    """Loss of the saved drafter on the first 4 training records (a fixed batch)."""
    from drafttrain.data import build_datasets, collate
    from drafttrain.features import FeatureSpec, target_features
    from drafttrain.models.eagle import load_drafter
    from drafttrain.targets import load_target
    from drafttrain.trainer import loss_step

    target, tok, _ = load_target(cfg.target, dtype="float32")
    train_ds, _, _ = build_datasets(cfg.data, tok)
    drafter = load_drafter(run / "drafter", target)
    batch = collate([train_ds[i] for i in range(4)], tok.pad_token_id)
    feats = target_features(target, batch["input_ids"], batch["attention_mask"],
                            FeatureSpec(drafter.cfg.aux_layer_ids, concat_aux=cfg.method == "eagle3"))
    with torch.no_grad():
        loss, _ = loss_step(cfg, drafter, target, batch, feats)
    return float(loss)


@pytest.mark.parametrize("method", ["eagle3", "eagle1"])
def test_two_steps_change_drafter_and_lower_loss(family, method, target_dirs, chat_file, tmp_path):
    common = (f"method={method}", "train.max_steps=2", "train.batch_size=4", "drafter.noise=0")
    frozen = cfg_for(target_dirs[family], chat_file, tmp_path / "lr0", *common, "train.lr=0")
    trained = cfg_for(target_dirs[family], chat_file, tmp_path / "run", *common, "train.lr=1e-2")
    train(frozen)
    summary = train(trained)
    assert summary["steps"] == 2
    before, after = weights(tmp_path / "lr0"), weights(tmp_path / "run")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())
    assert fixed_batch_loss(trained, tmp_path / "run") < fixed_batch_loss(frozen, tmp_path / "lr0")
    meta = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert meta["method"] == method and meta["target"]["hidden_size"] == 64
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "drafter" / "README.md").exists()


def test_online_and_offline_features_give_the_same_loss(target_dirs, chat_file, tmp_path):
    from drafttrain.data import build_datasets
    from drafttrain.features import FeatureCache, FeatureSpec, collate_features, target_features
    from drafttrain.models.eagle import EagleDrafter, config_from_target
    from drafttrain.prepare import prepare
    from drafttrain.targets import load_target
    from drafttrain.trainer import loss_step

    # bf16 target: the cache stores bf16, so online and offline features are bit-identical.
    cfg = cfg_for(target_dirs["llama"], chat_file, tmp_path / "run", "dtype=bfloat16")
    cache = prepare(cfg)
    target, tok, _ = load_target(cfg.target, dtype="bfloat16")
    train_ds, _, _ = build_datasets(cfg.data, tok)
    records = FeatureCache(cache)
    assert len(records) == len(train_ds)
    torch.manual_seed(0)
    drafter = EagleDrafter(config_from_target(target.config)).attach_target(target)
    idx = [0, 3, 5]
    offline = collate_features([records[i] for i in idx], tok.pad_token_id)
    from drafttrain.data import collate

    online = collate([train_ds[i] for i in idx], tok.pad_token_id)
    assert torch.equal(offline["input_ids"], online["input_ids"])
    spec = FeatureSpec(drafter.cfg.aux_layer_ids, concat_aux=True)
    f_on = target_features(target, online["input_ids"], online["attention_mask"], spec)
    with torch.no_grad():
        l_on, _ = loss_step(cfg, drafter, target, online, f_on)
        l_off, _ = loss_step(cfg, drafter, target, offline, {"aux": offline["aux"], "final": offline["final"]})
    assert float(l_on) == pytest.approx(float(l_off), rel=1e-5)
    # and training from the cache runs
    summary = train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "run", "dtype=bfloat16",
                            "features.mode=offline", "train.max_steps=2"))
    assert summary["steps"] == 2


def test_offline_mode_computes_the_cache_once_and_trains_as_online(target_dirs, chat_file, tmp_path):
    """features.mode=offline with no cache computes it before the first epoch; training from it
    equals online training (bf16 target: cached features are bit-identical); a second run reads the
    same cache, and a cache of other records is refused with the way out."""
    common = ("dtype=bfloat16", "train.max_steps=3", "train.lr=3e-3", "seed=1")
    train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "online", *common))
    offline = cfg_for(target_dirs["llama"], chat_file, tmp_path / "offline", *common, "features.mode=offline")
    train(offline)
    shards = sorted((tmp_path / "offline" / "features").glob("shard-*.safetensors"))
    assert shards
    on, off = weights(tmp_path / "online"), weights(tmp_path / "offline")
    assert all(torch.equal(on[k], off[k]) for k in on)
    stamps = [p.stat().st_mtime_ns for p in shards]
    train(offline)  # reused, not recomputed
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    with pytest.raises(Exception, match="does not match this config.*delete it"):
        train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "offline", *common, "features.mode=offline",
                      "data.max_len=64"))


def test_prepare_resumes_after_partial_run(target_dirs, chat_file, tmp_path):
    from drafttrain.features import shard_name
    from drafttrain.prepare import prepare

    cfg = cfg_for(target_dirs["llama"], chat_file, tmp_path / "run", "features.shard_size=5")
    out = prepare(cfg)
    full = {p.name: load_file(str(p)) for p in sorted(out.glob("shard-*"))}
    assert len(full) >= 3
    (out / shard_name(1)).unlink()  # as if killed before shard 1 was renamed into place
    (out / (shard_name(2) + ".tmp-999")).write_bytes(b"partial")
    prepare(cfg)
    again = {p.name: load_file(str(p)) for p in sorted(out.glob("shard-*.safetensors"))}
    assert again.keys() == full.keys()
    for name in full:
        for k in full[name]:
            assert torch.equal(full[name][k], again[name][k])


def test_stop_and_resume_equals_uninterrupted(target_dirs, chat_file, tmp_path):
    """Killed after step 5 (stop_after exits without saving, like a kill): the run resumes from the
    step-3 checkpoint, redoes steps 4-5 with the same data order and RNG, and ends where an
    uninterrupted run ends."""
    common = ("train.max_steps=6", "train.save_every=3", "train.lr=3e-3", "train.batch_size=2", "seed=3")
    straight = train(cfg_for(target_dirs["qwen3"], chat_file, tmp_path / "straight", *common))
    assert "resumed_from_step" not in straight
    out = train(cfg_for(target_dirs["qwen3"], chat_file, tmp_path / "resumed", *common, "train.stop_after=5"))
    assert out == {"stopped_at": 5}
    assert not (tmp_path / "resumed" / "drafter").exists()
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").glob("step-*")] == ["step-0000003"]
    summary = train(cfg_for(target_dirs["qwen3"], chat_file, tmp_path / "resumed", *common, "train.resume=true"))
    assert summary["resumed_from_step"] == 3 and summary["steps"] == 6
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_run_minutes_stops_training_when_the_whole_run_is_out_of_time(target_dirs, chat_file, tmp_path,
                                                                      monkeypatch, capsys):
    """train.run_minutes budgets the whole command (answering and features included): once the run
    has used it, less the minute kept for finishing, training stops after the step it is in and the
    drafter is still saved; with time to spare the run trains every step."""
    import drafttrain.trainer as trainer

    common = ("train.max_steps=6", "train.save_every=0", "train.run_minutes=1")
    monkeypatch.setattr(trainer, "FINISH_RESERVE_S", 60.0)  # a one-minute run with nothing left after setup
    cut = train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "cut", *common))
    assert cut["steps"] == 1 and (tmp_path / "cut" / "drafter" / "model.safetensors").is_file()
    assert "train.run_minutes=1.0 (the whole run" in capsys.readouterr().out
    monkeypatch.setattr(trainer, "FINISH_RESERVE_S", 0.0)
    assert train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "full", *common))["steps"] == 6


def _last_lr(run: Path) -> float:
    from drafttrain.checkpoints import latest_checkpoint

    return torch.load(latest_checkpoint(run) / "scheduler_lambda.pt", weights_only=False)["_last_lr"][0]


def test_time_schedule_anneals_a_clock_stopped_run_and_snapshots_mark_its_minutes(target_dirs, chat_file,
                                                                                  tmp_path, monkeypatch, capsys):
    """A run the clock stops long before its step budget ends with the learning rate at the floor under
    train.lr_schedule=time (the step schedule leaves it near the peak), and train.snapshot_minutes
    leaves a loadable drafter per mark, from the step where training time passed it. The trainer's
    clock is scripted: one second per reading (about one per step)."""
    from types import SimpleNamespace

    import drafttrain.trainer as trainer
    from drafttrain.models.eagle import load_drafter
    from drafttrain.targets import load_target

    def run(name: str, *extra: str) -> dict:
        now = [0.0]

        def clock() -> float:
            now[0] += 1.0
            return now[0]

        monkeypatch.setattr(trainer, "time", SimpleNamespace(time=clock))
        return train(cfg_for(target_dirs["llama"], chat_file, tmp_path / name, "train.max_steps=100",
                             "train.max_minutes=0.5", "train.lr=1e-3", "train.save_every=0", *extra))

    by_time = run("time", "train.lr_schedule=time", "train.snapshot_minutes=[0.1,0.25]")
    bars = re.findall(r"train \S+:.*?(\d+)/(\d+) \[", capsys.readouterr().err)
    assert bars and int(bars[-1][1]) < 50  # the bar counts the steps the time limit allows, not the 100 budgeted
    by_steps = run("steps")
    assert 20 <= by_time["steps"] == by_steps["steps"] < 50  # stopped by the clock, not the step budget
    assert _last_lr(tmp_path / "time") == pytest.approx(1e-4, rel=0.05)  # min_lr_ratio 0.1
    assert _last_lr(tmp_path / "steps") > 7e-4
    target, _, _ = load_target(str(target_dirs["llama"]), dtype="float32")
    steps = []
    for m in ("0.1", "0.25"):
        folder = tmp_path / "time" / "snapshots" / f"train-{m}min"
        load_drafter(folder, target)
        metrics = json.loads((folder / "config.json").read_text())["metrics"]
        assert metrics["train_time_s"] >= 60 * float(m)
        steps.append(metrics["step"])
    assert 0 < steps[0] < steps[1] < by_time["steps"]
    assert not (tmp_path / "steps" / "snapshots").exists()
    assert any(not torch.equal(v, weights(tmp_path / "time")[k]) for k, v in
               load_file(str(tmp_path / "time" / "snapshots" / "train-0.1min" / "model.safetensors")).items())


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0, err
    # Progress bars (weight loading) may precede it; the error itself is exactly one line.
    errors = [ln for ln in err.replace("\r", "\n").splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("drafttrain: error: "), err
    assert "Traceback" not in err
    return errors[0]


def test_missing_data_file_error(target_dirs, tmp_path, capsys):
    err = _one_line_error(capsys, ["train", f"target={target_dirs['llama']}", f"data.path={tmp_path}/nope.json",
                                   f"output_dir={tmp_path}/run", *FAST])
    assert "nope.json" in err


def test_empty_dataset_error(target_dirs, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = _one_line_error(capsys, ["train", f"target={target_dirs['llama']}", f"data.path={empty}",
                                   f"output_dir={tmp_path}/run", *FAST])
    assert "empty.jsonl" in err


def test_missing_target_error(tmp_path, chat_file, capsys):
    err = _one_line_error(capsys, ["train", f"target={tmp_path}/no-such-model", f"data.path={chat_file}", *FAST])
    assert "no-such-model" in err


def test_offline_hub_id_error(chat_file, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _one_line_error(capsys, ["train", "target=some-org/some-model-7b", f"data.path={chat_file}", *FAST])
    assert "some-org/some-model-7b" in err and "offline" in err


def test_target_drafter_mismatch_error(target_dirs, chat_file, tmp_path):
    from drafttrain.drafter_io import DrafterMismatchError
    from drafttrain.models.eagle import load_drafter
    from drafttrain.testing import tiny_target

    train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "run", "train.max_steps=1"))
    other = tiny_target("llama", vocab_size=263, hidden_size=32, num_layers=6)
    with pytest.raises(DrafterMismatchError) as e:
        load_drafter(tmp_path / "run" / "drafter", other)
    msg = str(e.value)
    assert "hidden_size 64 vs 32" in msg and len(msg.splitlines()) == 1


def test_decoding_eval_in_training_keeps_the_best_drafter(target_dirs, chat_file, tmp_path, monkeypatch):
    """The real decoding eval runs every step; the drafter of the step with the best tau (not the
    last one) is kept in best_drafter. Taus are scripted on top of the real eval (a 3-step tiny
    drafter accepts nothing, so every real tau ties at 1.0 and any step would look "best")."""
    import drafttrain.trainer

    real, calls = drafttrain.trainer.decode_eval, []
    scripted = [1.2, 1.5, 1.1, 1.1]  # steps 1, 2, 3, then the final eval

    def fake(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out["eval/decode_tau"])
        return {**out, "eval/decode_tau": scripted[len(calls) - 1]}

    monkeypatch.setattr(drafttrain.trainer, "decode_eval", fake)
    summary = train(cfg_for(target_dirs["gemma3"], chat_file, tmp_path / "run", "train.max_steps=3",
                            "train.decode_eval_every=1", "train.decode_eval_prompts=2",
                            "train.decode_eval_tokens=8", "train.decode_eval_gamma=3", "train.lr=3e-3"))
    assert len(calls) == 4 and all(1.0 <= t <= 4.0 for t in calls)  # real taus: 1 .. gamma + 1
    assert summary["best_decode_step"] == 2 and summary["best_decode_tau"] == pytest.approx(1.5)
    assert summary["eval/decode_tau"] == pytest.approx(1.1)  # the final eval, reported as such
    best = json.loads((tmp_path / "run" / "best_drafter" / "config.json").read_text())
    assert best["metrics"]["step"] == 2 and best["metrics"]["eval/decode_tau"] == pytest.approx(1.5)
    final = weights(tmp_path / "run")
    kept = load_file(str(tmp_path / "run" / "best_drafter" / "model.safetensors"))
    assert any(not torch.equal(final[k], kept[k]) for k in final)  # step 2's weights, not step 3's


def test_cpu_threads_use_the_machine_not_accelerates_one(monkeypatch):
    """`accelerate launch` exports OMP_NUM_THREADS=1; a CPU run must still use its share of the cores."""
    import os

    from drafttrain.trainer import cpu_threads

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
        torch.set_num_threads(1)
        assert cpu_threads(0, torch.device("cpu")) == 0 and torch.get_num_threads() == 1  # not launched: left alone
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # what `accelerate launch` exports
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        assert cpu_threads(0, torch.device("cpu")) == cores == torch.get_num_threads()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more processes than cores: one each
        assert cpu_threads(0, torch.device("cpu")) == 1 == torch.get_num_threads()
        assert cpu_threads(3, torch.device("cpu")) == 3 == torch.get_num_threads()  # explicit wins
        assert cpu_threads(0, torch.device("cuda")) == 0 and torch.get_num_threads() == 3  # GPUs: left alone
    finally:
        torch.set_num_threads(before)


def test_training_on_the_targets_own_answers_regenerates_once(target_dirs, chat_file, tmp_path):
    """answers.source=target: the target answers the training prompts first (cached under the data
    cache), training reads those answers, and a second run reuses the file without answering again."""
    import os

    extra = ("answers.source=target", "answers.max_new_tokens=8", "answers.batch_size=4", "data.num_samples=8",
             "data.heldout=2", "train.max_steps=2", "train.decode_eval_final=false")
    summary = train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "a", *extra))
    files = list((Path(os.environ["DRAFTTRAIN_CACHE"]) / "data" / "answers").glob("*.jsonl"))
    assert len(files) == 1 and summary["steps"] == 2
    recs = [json.loads(ln) for ln in files[0].read_text().splitlines()]
    assert len(recs) >= 10 and all(r["messages"][-1]["role"] == "assistant" for r in recs)
    data = json.loads((tmp_path / "a" / "drafter" / "config.json").read_text())["data"]
    assert data["train_records"] + data["heldout_records"] >= 8  # the regenerated records were trained on
    before = files[0].read_bytes()
    train(cfg_for(target_dirs["llama"], chat_file, tmp_path / "b", *extra))
    assert files[0].read_bytes() == before  # cached: nothing answered twice
