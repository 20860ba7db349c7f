"""The training loop, top to bottom: setup, loop, eval, save. It knows no drafter method.

    setup     accelerator, run folder, target, data, the method's drafter, loaders, optimizer,
              schedule, resume, tracker (`setup` and the short functions it calls)
    loop      per optimizer step: the method's loss, backward, clip, step; then log, evaluate,
              decode-evaluate, stop or checkpoint (`run_loop`, `train_step`, `after_step`)
    finish    final checkpoint, held-out eval, decoding eval, the drafter folder, the summary

Everything that differs between drafter kinds (how the drafter is built from the target, which
target features it reads, its loss and metrics, its optimizer groups, what its folder holds) is
asked of its method object (`drafttrain.methods`, by `cfg.method`): this module never branches on
a method's name. The same function runs under plain `python` on a CPU and under `accelerate
launch` on many GPUs (distributed.py); checkpoints are atomic and `train.resume` continues from
the last one with the same data order (checkpoints.py).

What it does not do: subclass transformers' Trainer.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from drafttrain.checkpoints import latest_checkpoint, save_checkpoint
from drafttrain.config import dump_yaml, to_dict
from drafttrain.distributed import (  # noqa: F401 (cpu_processes, cpu_threads: re-exported)
    StopFlag,
    agreed,
    busy_cores_warning,
    cpu_processes,
    cpu_threads,
    full_replica,
    gathered_drafter,
    launch_kwargs,
    max_over_processes,
)
from drafttrain.errors import TrainingError
from drafttrain.methods.registry import get_method
from drafttrain.progress import keep_alive
from drafttrain.schedule import EpochSampler, Records, lr_lambda
from drafttrain.schema import TrainConfig
from drafttrain.step_metrics import StepMetrics  # noqa: F401 (re-exported)
from drafttrain.vocab import token_counts  # noqa: F401 (re-exported)

__all__ = ["train", "TrainingError", "loss_step", "build_drafter", "param_groups", "wrap_target_for_method",
           "evaluate", "decode_eval", "latest_checkpoint"]


def log(accelerator, msg: str) -> None:
    if accelerator is None or accelerator.is_main_process:
        print(msg, flush=True)


# ---- what the method decides -------------------------------------------------------------------------
def _mixed_precision(cfg: TrainConfig, target_dtype: torch.dtype) -> str:
    mp = cfg.train.mixed_precision
    if mp == "auto":
        return "bf16" if target_dtype == torch.bfloat16 else "no"
    return mp


def loss_step(cfg: TrainConfig, drafter, target, batch: dict, feats: dict, step: int | None = None):
    """(loss, metrics) of one batch from the method's loss; `step` None = evaluation."""
    return get_method(cfg.method).loss(cfg, drafter, target, batch, feats, step)


def build_drafter(cfg: TrainConfig, target, train_ds, accelerator):
    """(drafter on the accelerator's device, draft-vocab coverage) built by the method."""
    return get_method(cfg.method).build(cfg, target, train_ds, accelerator.device)


def wrap_target_for_method(cfg: TrainConfig, target, accelerator):
    """The target as the method trains with it (checked first: e.g. Medusa-2's adapter)."""
    method = get_method(cfg.method)
    method.check_config(cfg, accelerator.num_processes)
    return method.wrap_target(cfg, target)


def param_groups(cfg: TrainConfig, drafter, target) -> list[dict]:
    return get_method(cfg.method).param_groups(cfg, drafter, target)


def adapter_params(target) -> list[torch.nn.Parameter]:
    """The trainable parameters of the target (an adapter some methods put on it; else empty)."""
    return [p for p in target.parameters() if p.requires_grad]


@torch.no_grad()
def evaluate(cfg: TrainConfig, drafter, target, loader, spec, accelerator) -> dict:
    from tqdm.auto import tqdm

    method = get_method(cfg.method)
    raw = accelerator.unwrap_model(drafter)
    was_training = raw.training
    raw.eval()
    m = StepMetrics()
    for batch in tqdm(loader, desc="held-out eval", unit="batch", leave=False, dynamic_ncols=True,
                      disable=not accelerator.is_main_process):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        feats = method.batch_features(cfg, target, batch, spec)
        with accelerator.autocast():
            _, met = loss_step(cfg, raw, target, batch, feats)
        m.add(met, int(batch["attention_mask"].sum()))
    raw.train(was_training)
    return m.summary("eval")


def decode_eval(cfg: TrainConfig, drafter, target, prompts: list[list[int]], accelerator) -> dict:
    """Real decoding on held-out prompts (greedy chain): tau from the decoder, not simulated.

    Runs on the main process only; the drafter is put in eval mode and back."""
    from drafttrain.eval.quick import decode_eval as run

    raw = accelerator.unwrap_model(drafter)
    was_training = raw.training
    raw.eval()
    try:
        with torch.no_grad(), accelerator.autocast():
            res = run(target, raw, prompts, max_new_tokens=cfg.train.decode_eval_tokens, temperature=0.0,
                      gamma=get_method(cfg.method).decode_gamma(cfg))
    finally:
        raw.train(was_training)
    acc = res.get("acceptance") or []
    return {"eval/decode_tau": res["tau"], "eval/decode_tokens_per_s": res["tokens_per_s"],
            **{f"eval/decode_accept_{k}": a for k, a in enumerate(acc)}}


# ---- setup -----------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything the loop and the final save share (built by `setup`)."""

    cfg: TrainConfig
    method: object
    accelerator: object
    run_dir: Path
    t_start: float
    target: object = None
    tokenizer: object = None
    data: object = None  # the DataConfig training reads (the target's answers with answers.source=target)
    train_ds: object = None
    held_ds: object = None
    report: object = None
    drafter: object = None
    coverage: float = 1.0
    spec: object = None
    pad: int = 0
    sampler: object = None
    loader: object = None
    held_loader: object = None
    optimizer: object = None
    scheduler: object = None
    total_steps: int = 0
    train_budget_s: float = 0.0  # train.lr_schedule=time: the training seconds the cosine spans
    extra_params: list = field(default_factory=list)
    state: dict = field(default_factory=dict)
    resumed_from: int | None = None
    tracker: object = None
    decode_prompts: list = field(default_factory=list)
    window: StepMetrics = field(default_factory=StepMetrics)  # train metrics since the last log line


def _accelerator(cfg: TrainConfig):
    from accelerate import Accelerator

    from drafttrain.targets import resolve_dtype

    accelerator = Accelerator(gradient_accumulation_steps=cfg.train.grad_accum,
                              mixed_precision=_mixed_precision(cfg, resolve_dtype(cfg.dtype)),
                              step_scheduler_with_optimizer=False, **launch_kwargs())
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.distributed_type != "FSDP":
        log(accelerator, f"drafttrain: warning: FSDP was requested but Accelerate runs {accelerator.distributed_type.value} "
            "here (it has no FSDP for CPU processes)")
    return accelerator


def _run_folder(cfg: TrainConfig, accelerator) -> Path:
    run_dir = Path(cfg.run_dir)
    if accelerator.is_main_process:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrainingError(f"output_dir {run_dir} cannot be created ({e.strerror}); choose another "
                                f"output_dir=") from e
        if not os.access(run_dir, os.W_OK):
            raise TrainingError(f"output_dir {run_dir} is not writable; choose another output_dir=")
        dump_yaml(cfg, run_dir / "config.yaml")
    return run_dir


def _load_target_and_data(run: Run) -> None:
    from drafttrain.answers import training_data
    from drafttrain.data import build_datasets
    from drafttrain.targets import load_target

    cfg, acc = run.cfg, run.accelerator
    log(acc, f"drafttrain: loading target {cfg.target} ({cfg.dtype})")
    with full_replica(acc):
        run.target, run.tokenizer, _ = load_target(cfg.target, dtype=cfg.dtype, device=acc.device,
                                                   revision=cfg.target_revision or None,
                                                   trust_remote_code=cfg.trust_remote_code)
    with acc.main_process_first():  # rank 0 answers the prompts (when asked) and tokenises; the others read
        run.data = training_data(cfg.data, cfg.answers, cfg.target, run.target, run.tokenizer,
                                 progress=acc.is_main_process)
        run.train_ds, run.held_ds, run.report = build_datasets(run.data, run.tokenizer)
    log(acc, run.report.summary())
    run.pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0


def _build_drafter(run: Run) -> None:
    from drafttrain.targets import num_layers

    cfg = run.cfg
    log(run.accelerator, f"drafttrain: building the {cfg.method} drafter from the target")
    run.target = wrap_target_for_method(cfg, run.target, run.accelerator)
    run.drafter, run.coverage = build_drafter(cfg, run.target, run.train_ds, run.accelerator)
    run.spec = run.method.feature_spec(cfg, run.drafter, num_layers(run.target))
    d = run.drafter
    n_params = sum(p.numel() for p in d.parameters() if p.requires_grad)
    log(run.accelerator, f"drafttrain: {cfg.method} drafter, {n_params / 1e6:.1f}M trainable params, aux layers "
        f"{d.cfg.aux_layer_ids}, draft vocab {d.cfg.draft_vocab_size} (covers {run.coverage:.1%} of "
        f"assistant tokens)")


def _records(run: Run):
    """(records, collate) of the training data: offline feature cache or tokenised records."""
    from drafttrain.data import collate
    from drafttrain.features import collate_features, training_feature_cache

    cfg, pad, acc = run.cfg, run.pad, run.accelerator
    if cfg.features.mode != "offline":
        return Records(run.train_ds), lambda b: collate(b, pad)
    if not run.method.offline_features:
        raise TrainingError(f"method={cfg.method} runs the target with gradients, so it needs features.mode=online")
    folder = Path(cfg.features.cache_dir or run.run_dir / "features")
    records = training_feature_cache(run.target, run.train_ds, run.spec, folder, shard_size=cfg.features.shard_size,
                                     rank=acc.process_index, world_size=acc.num_processes, barrier=acc.wait_for_everyone,
                                     progress=acc.is_main_process, meta={"target": cfg.target})
    return records, lambda b: collate_features(b, pad)


def _loaders_and_optimizer(run: Run) -> None:
    from drafttrain.data import collate

    cfg, acc, pad = run.cfg, run.accelerator, run.pad
    records, collate_fn = _records(run)
    run.sampler = EpochSampler(len(records), cfg.seed)
    loader = DataLoader(records, batch_size=cfg.train.batch_size, sampler=run.sampler, collate_fn=collate_fn,
                        num_workers=cfg.train.num_workers)
    run.held_loader = DataLoader(Records(run.held_ds), batch_size=cfg.train.batch_size,
                                 collate_fn=lambda b: collate(b, pad)) if len(run.held_ds) else None
    optimizer = torch.optim.AdamW(param_groups(cfg, run.drafter, run.target), lr=cfg.train.lr,
                                  betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)
    run.drafter, run.optimizer, run.loader = acc.prepare(run.drafter, optimizer, loader)
    run.extra_params = adapter_params(run.target)  # an adapter on the target: clipped with the drafter
    steps_per_epoch = max(1, len(run.loader) // cfg.train.grad_accum)
    run.total_steps = cfg.train.max_steps or steps_per_epoch * cfg.train.epochs
    time_progress = (lambda: _time_progress(run)) if cfg.train.lr_schedule == "time" else None
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(
        run.optimizer, lr_lambda(cfg.train.warmup_steps, run.total_steps, cfg.train.min_lr_ratio, time_progress))


def _time_progress(run: Run) -> float:
    """The fraction of the training time budget used (train.lr_schedule=time); 0 before the loop
    and without a time limit (the cosine then follows the steps alone)."""
    if not run.train_budget_s:
        return 0.0
    return run.state.get("train_time_s", 0.0) / run.train_budget_s


def _train_budget_s(run: Run) -> float:
    """Seconds of training the limits allow, counted from this process's first step (a resumed run's
    training time so far included): train.max_minutes, or what train.run_minutes leaves."""
    cfg, used = run.cfg.train, run.state["train_time_s"]
    budgets = [60.0 * cfg.max_minutes] if cfg.max_minutes else []
    if cfg.run_minutes:
        budgets.append(used + 60.0 * cfg.run_minutes - FINISH_RESERVE_S - (time.time() - run.t_start))
    return max(1.0, min(budgets)) if budgets else 0.0


def _resume(run: Run) -> None:
    run.state = {"step": 0, "epoch": 0, "micro_in_epoch": 0, "tokens": 0, "train_time_s": 0.0,
                 "best_tau_sim": None}
    if not run.cfg.train.resume:
        return
    ck = latest_checkpoint(run.run_dir)
    if ck is None:
        log(run.accelerator, f"drafttrain: train.resume=true but no checkpoint in {run.run_dir}/checkpoints; "
            "starting fresh")
        return
    run.accelerator.load_state(str(ck))
    run.scheduler.load_state_dict(torch.load(ck / "scheduler_lambda.pt", weights_only=True))
    run.state = json.loads((ck / "trainer_state.json").read_text())
    run.resumed_from = run.state["step"]
    log(run.accelerator, f"drafttrain: resumed from {ck} (step {run.state['step']}, epoch {run.state['epoch']})")


def setup(cfg: TrainConfig) -> Run:
    """Everything before the first step, in the order that fixes the RNG stream."""
    from accelerate.utils import set_seed

    from drafttrain.tracking import make_tracker

    accelerator = _accelerator(cfg)
    set_seed(cfg.seed)
    threads = cpu_threads(cfg.threads, accelerator.device)
    if threads:
        busy = busy_cores_warning(threads * accelerator.num_processes)
        log(accelerator, f"drafttrain: {threads} CPU thread(s) per process" + (f"\n{busy}" if busy else ""))
    run = Run(cfg, get_method(cfg.method), accelerator, _run_folder(cfg, accelerator), time.time())
    _load_target_and_data(run)
    _build_drafter(run)
    _loaders_and_optimizer(run)
    _resume(run)
    run.tracker = make_tracker(cfg.tracking, is_main=accelerator.is_main_process, project=cfg.wandb.project,
                               entity=cfg.wandb.entity, name=cfg.wandb.name or run.run_dir.name, mode=cfg.wandb.mode,
                               config=to_dict(cfg), run_dir=str(run.run_dir))
    if cfg.train.decode_eval_every or cfg.train.decode_eval_final:
        from drafttrain.data import heldout_prompts

        run.decode_prompts = heldout_prompts(run.data, run.tokenizer, cfg.train.decode_eval_prompts)
    return run


# ---- loop ------------------------------------------------------------------------------------------
def train_step(run: Run, batch: dict) -> tuple[dict, int]:
    """One micro-batch: the method's loss, backward, clip and step (Accelerate accumulates)."""
    acc, cfg, state = run.accelerator, run.cfg, run.state
    feats = run.method.batch_features(cfg, run.target, batch, run.spec)
    with acc.accumulate(run.drafter):
        with acc.autocast():
            loss, met = loss_step(cfg, run.drafter, run.target, batch, feats, step=state["step"])
        if not torch.isfinite(loss):
            kept = latest_checkpoint(run.run_dir)
            raise TrainingError(
                f"loss is {loss.item()} at step {state['step'] + 1} (epoch {state['epoch']}, batch "
                f"{state['micro_in_epoch']}); stopped. Last good checkpoint: {kept or 'none'}")
        acc.backward(loss)
        if acc.sync_gradients and cfg.train.grad_clip > 0:
            clip = [*run.drafter.parameters(), *run.extra_params] if run.extra_params else run.drafter.parameters()
            acc.clip_grad_norm_(clip, cfg.train.grad_clip)
        run.optimizer.step()
        run.optimizer.zero_grad()
    return met, int(batch["attention_mask"].sum())


def _log_step(run: Run, bar, t_loop: float) -> None:
    """Bar and tracker after an optimizer step (a logged window starts afresh)."""
    cfg, state = run.cfg, run.state
    elapsed = time.time() - t_loop
    state["train_time_s"] = max_over_processes(run.accelerator, elapsed) if run.train_budget_s else elapsed
    s = run.window.summary("train")
    if run.train_budget_s and state["step"] >= 5:  # the time limit ends the run first: the bar and its ETA say so
        left = max(0.0, run.train_budget_s - state["train_time_s"])
        bar.total = max(state["step"] + 1, min(run.total_steps, state["step"] + round(left * state["step"] / max(state["train_time_s"], 1e-9))))
    bar.update(1)
    bar.set_postfix(loss=f"{s['train/loss']:.3f}", acc0=f"{s.get('train/acc_0', 0):.2f}", tau=f"{s['train/tau_sim']:.2f}")
    if state["step"] % cfg.train.log_every == 0 or state["step"] == run.total_steps:
        s["train/lr"] = run.scheduler.get_last_lr()[0]
        s["train/tokens_per_s"] = state["tokens"] / max(state["train_time_s"], 1e-9)
        run.tracker.log(s, step=state["step"])
        run.window = StepMetrics()


def _periodic_evals(run: Run, bar) -> None:
    """Held-out loss every train.eval_every steps; real decoding every train.decode_eval_every,
    keeping the drafter of the best decoding tau in <run>/best_drafter."""
    cfg, state, acc = run.cfg, run.state, run.accelerator
    if cfg.train.eval_every and state["step"] % cfg.train.eval_every == 0 and run.held_loader:
        ev = evaluate(cfg, run.drafter, run.target, run.held_loader, run.spec, acc)
        run.tracker.log(ev, step=state["step"])
        bar.write(f"step {state['step']}: " + ", ".join(f"{k}={v:.3f}" for k, v in ev.items()))
    if not (cfg.train.decode_eval_every and state["step"] % cfg.train.decode_eval_every == 0
            and run.decode_prompts and acc.is_main_process):
        return
    dec = decode_eval(cfg, run.drafter, run.target, run.decode_prompts, acc)
    run.tracker.log(dec, step=state["step"])
    bar.write(f"step {state['step']}: decoding tau {dec['eval/decode_tau']:.3f} "
              f"(greedy chain of {cfg.train.decode_eval_gamma}, {len(run.decode_prompts)} held-out prompts)")
    if state.get("best_decode_tau") is None or dec["eval/decode_tau"] > state["best_decode_tau"]:
        state["best_decode_tau"] = dec["eval/decode_tau"]
        state["best_decode_step"] = state["step"]
        raw = run.accelerator.unwrap_model(run.drafter)
        scores = {"step": state["step"], **dec}
        _save_drafter(run, raw, run.run_dir / "best_drafter", _extras(run, raw), card_summary=scores, metrics=scores)


def _snapshots(run: Run) -> None:
    """The drafter folder <run>/snapshots/train-<M>min once training time passes each of
    train.snapshot_minutes: one per step, once each (also across a resume), at the same step on
    every process (the gather under FSDP / ZeRO-3 is a collective)."""
    cfg, state, acc = run.cfg, run.state, run.accelerator
    done = state.setdefault("snapshots", [])
    left = sorted(m for m in cfg.train.snapshot_minutes if m not in done)
    if not left or not agreed(acc, state["train_time_s"] >= 60 * left[0])[0]:
        return
    m = left[0]
    raw = gathered_drafter(acc, run.drafter, run.target)
    if acc.is_main_process:
        folder = run.run_dir / "snapshots" / f"train-{m:g}min"
        scores = {"step": state["step"], "train_time_s": round(state["train_time_s"], 1), "train_tokens": state["tokens"]}
        _save_drafter(run, raw, folder, _extras(run, raw), card_summary=scores, metrics=scores)
        log(acc, f"drafttrain: snapshot after {m:g} training minutes (step {state['step']}): {folder}")
    done.append(m)


#: seconds `train.run_minutes` keeps for what follows training: the final checkpoint, held-out eval
#: and drafter folder (session 21, default recipe on a 2-core Zen 2: ~20 s)
FINISH_RESERVE_S = 60.0


def after_step(run: Run, stop: StopFlag, bar) -> str | None:
    """Evals, stop decisions and checkpoints after an optimizer step: "stopped_at" (stop_after),
    "out_of_time", "done", or None to go on. A signal saves and exits with code 130."""
    cfg, state, acc = run.cfg, run.state, run.accelerator
    _periodic_evals(run, bar)
    if cfg.train.stop_after and state["step"] >= cfg.train.stop_after:
        log(acc, f"drafttrain: train.stop_after={cfg.train.stop_after} reached; exiting without final save")
        return "stopped_at"
    over_train = bool(cfg.train.max_minutes) and state["train_time_s"] > 60 * cfg.train.max_minutes
    over_run = bool(cfg.train.run_minutes) and time.time() - run.t_start > 60 * cfg.train.run_minutes - FINISH_RESERVE_S
    stop_now, out_of_time = agreed(acc, stop.stop, over_train or over_run)
    if out_of_time:
        why = (f"train.max_minutes={cfg.train.max_minutes}" if over_train else
               f"train.run_minutes={cfg.train.run_minutes} (the whole run, {(time.time() - run.t_start) / 60:.1f} min so far)")
        log(acc, f"drafttrain: {why} reached at step {state['step']}")
    _snapshots(run)
    if cfg.train.save_every and state["step"] % cfg.train.save_every == 0 or stop_now:
        save_checkpoint(acc, run.run_dir, state, run.scheduler, cfg.train.keep_checkpoints)
    if stop_now:
        log(acc, f"drafttrain: stopped by signal at step {state['step']}; resume with train.resume=true")
        bar.close()
        run.tracker.finish()
        raise SystemExit(130)
    if out_of_time:
        return "out_of_time"
    return "done" if state["step"] >= run.total_steps else None


def _epoch(run: Run, stop: StopFlag, bar, t_loop: float) -> str | None:
    """One pass over the rest of the current epoch; the first non-None `after_step` outcome."""
    state, acc = run.state, run.accelerator
    run.sampler.set_epoch(state["epoch"])
    it = acc.skip_first_batches(run.loader, state["micro_in_epoch"]) if state["micro_in_epoch"] else run.loader
    for batch in it:
        state["micro_in_epoch"] += 1
        try:
            met, ntok = train_step(run, batch)
        except TrainingError:
            bar.close()  # so the error starts its own line, not the progress bar's
            raise
        run.window.add(met, ntok)
        state["tokens"] += ntok * acc.num_processes
        if not acc.sync_gradients:
            continue
        run.scheduler.step()
        state["step"] += 1
        _log_step(run, bar, t_loop)
        outcome = after_step(run, stop, bar)
        if outcome is not None:
            return outcome
    state["epoch"] += 1
    state["micro_in_epoch"] = 0
    return None


def run_loop(run: Run) -> str:
    """Optimizer steps until the step budget, the time limit or stop_after; returns the outcome."""
    from tqdm.auto import tqdm

    state = run.state
    bar = tqdm(total=run.total_steps, initial=state["step"], desc=f"train {run.cfg.method}", unit="step",
               disable=not run.accelerator.is_main_process, dynamic_ncols=True)
    t_loop = time.time() - state["train_time_s"]
    run.train_budget_s = max_over_processes(run.accelerator, _train_budget_s(run))  # one schedule for all processes
    run.drafter.train()
    outcome = "done"
    with StopFlag() as stop, keep_alive(bar):  # the bar's clock moves during long steps too
        while state["step"] < run.total_steps:
            outcome = _epoch(run, stop, bar, t_loop) or "done"
            if outcome != "done" or state["step"] >= run.total_steps:
                break
    bar.close()
    return outcome


# ---- finish ----------------------------------------------------------------------------------------
def _save_drafter(run: Run, raw, folder: Path, extras: tuple[dict, object], *, card_summary: dict,
                  metrics: dict, data_summary: str | None = None, data: dict | None = None) -> None:
    """Write a drafter folder through the method: weights, config (with the method's `extras`
    fields), model card, and the extras' files inside the same atomic write."""
    from drafttrain.drafter_io import model_card

    cfg = run.cfg
    fields, write_extra = extras
    meta = {"method": cfg.method, "recipe": cfg.recipe, "target": {"spec": cfg.target},
            "aux_layer_ids": raw.cfg.aux_layer_ids, "draft_vocab_size": raw.cfg.draft_vocab_size,
            "vocab_coverage": run.coverage}
    if data_summary is not None:
        meta["data_summary"] = data_summary
    extra = {"recipe": cfg.recipe, "vocab_coverage": run.coverage, "training": to_dict(cfg), "metrics": metrics}
    if data is not None:
        extra["data"] = data
    run.method.save(folder, drafter=raw, target=run.target, tokenizer=run.tokenizer,
                    card=model_card(meta, card_summary), write_extra=write_extra, extra={**extra, **fields})


def _extras(run: Run, raw) -> tuple[dict, object]:
    return run.method.extras(run.cfg, raw, run.target, run.train_ds, run.held_ds, run.tokenizer, run.pad)


def _final_eval(run: Run) -> dict:
    cfg, acc = run.cfg, run.accelerator
    if run.held_loader:
        log(acc, f"drafttrain: held-out evaluation ({len(run.held_ds)} records)")
    final = evaluate(cfg, run.drafter, run.target, run.held_loader, run.spec, acc) if run.held_loader else {}
    if cfg.train.decode_eval_final and run.decode_prompts and acc.is_main_process:
        log(acc, f"drafttrain: decoding {len(run.decode_prompts)} held-out prompts with the drafter (real tau)")
        final.update(decode_eval(cfg, run.drafter, run.target, run.decode_prompts, acc))
    run.tracker.log(final, step=run.state["step"])
    return final


def _summary(run: Run, final_eval: dict) -> dict:
    state, acc = run.state, run.accelerator
    summary = {
        "drafter_dir": str(run.run_dir / "drafter"),
        "method": run.cfg.method,
        "target": run.cfg.target,
        "steps": state["step"],
        "train_tokens": state["tokens"],
        "train_time_s": round(state["train_time_s"], 1),
        "wall_time_s": round(time.time() - run.t_start, 1),
        "train_tokens_per_s": round(state["tokens"] / max(state["train_time_s"], 1e-9), 1),
        "vocab_coverage": round(run.coverage, 4),
        "num_processes": acc.num_processes,
        "device": str(acc.device),
        **{k: round(v, 4) for k, v in final_eval.items()},
    }
    if run.resumed_from is not None:
        summary["resumed_from_step"] = run.resumed_from
    if state.get("best_decode_tau") is not None:
        summary["best_decode_tau"] = round(state["best_decode_tau"], 4)
        summary["best_drafter_dir"] = str(run.run_dir / "best_drafter")
        summary["best_decode_step"] = state.get("best_decode_step")
    return summary


def finish(run: Run) -> dict:
    """Final checkpoint, held-out and decoding evals, the drafter folder and the summary."""
    cfg, acc, state = run.cfg, run.accelerator, run.state
    log(acc, f"drafttrain: saving the final checkpoint (step {state['step']})")
    save_checkpoint(acc, run.run_dir, state, run.scheduler, cfg.train.keep_checkpoints)
    final_eval = _final_eval(run)
    raw = gathered_drafter(acc, run.drafter, run.target)
    summary = _summary(run, final_eval)
    if acc.is_main_process:
        log(acc, f"drafttrain: writing the drafter folder {run.run_dir / 'drafter'}")
        extras = _extras(run, raw)
        summary.update(run.method.summary_fields(extras[0]))
        card = {k: v for k, v in summary.items() if k.startswith("eval/") or k in (
            "steps", "train_tokens", "train_time_s", "train_tokens_per_s")}
        _save_drafter(run, raw, run.run_dir / "drafter", extras, card_summary=card, metrics=summary,
                      data_summary=run.report.summary().splitlines()[0],
                      data=run.report.__dict__ if hasattr(run.report, "__dict__") else {})
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        run.tracker.log_artifact(run.run_dir / "drafter", name=f"{run.run_dir.name}-drafter", metadata=summary)
    run.tracker.finish()
    acc.wait_for_everyone()
    return summary


def train(cfg: TrainConfig) -> dict:
    """Run one training job; returns the summary dict (also written to <run>/summary.json)."""
    run = setup(cfg)
    if run_loop(run) == "stopped_at":
        return {"stopped_at": run.state["step"]}
    return finish(run)
