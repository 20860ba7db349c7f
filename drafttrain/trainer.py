"""The training loop, top to bottom: setup, loop, eval, save.

The same function runs under plain `python` on a CPU and under `accelerate launch` on many GPUs:
Accelerate prepares the drafter, optimizer and data in one place (`setup`), the target stays a
frozen replica, and method differences live in `drafttrain.losses` (one function per method).

Checkpoints (`<run>/checkpoints/step-N`) hold Accelerate's state (drafter, optimizer, RNG) plus
the scheduler and `trainer_state.json` (step, epoch, position in the epoch); each is written to
a temp folder and renamed, so a killed run always leaves the last complete one. `train.resume`
continues from it with the same data order.

Several processes (recipes/accelerate/*.yaml): without CUDA they are joined by gloo
(`_launch_kwargs`); stop decisions (signal, time limit) are agreed by all ranks before anyone
saves (`agreed`); the target is loaded as a full replica even under ZeRO-3 (`full_replica`); the
final drafter is gathered from FSDP / ZeRO-3 shards (`gathered_drafter`).

Medusa heads (`medusa1`, `medusa2`) run through the same loop: `build_drafter` builds the heads,
`wrap_target_for_method` puts Medusa-2's LoRA adapter on the target (the one place PEFT is
applied), `loss_step` picks the loss, and the final save adds the static tree learned from
held-out head accuracies (and Medusa-2's adapter).

Draft LMs (`draft_lm`) too: `build_drafter` builds the student (drafttrain.distill), `loss_step`
takes the divergence (with on-policy batches mixed in), and the drafter folder is a plain HF one.

What it does not do: subclass transformers' Trainer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from drafttrain.config import dump_yaml, to_dict
from drafttrain.progress import keep_alive
from drafttrain.schema import TrainConfig


class TrainingError(RuntimeError):
    """A run that must stop (NaN loss, bad cache); the message names step, batch and what was kept."""


def log(accelerator, msg: str) -> None:
    if accelerator is None or accelerator.is_main_process:
        print(msg, flush=True)


# ---- data order ----------------------------------------------------------------------------------
class EpochSampler(Sampler[int]):
    """A permutation of range(n) drawn from (seed, epoch): the same order on resume."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class _Records(Dataset):
    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return self.ds[int(i)]


# ---- schedule ------------------------------------------------------------------------------------
def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


# ---- checkpoints ---------------------------------------------------------------------------------
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


# ---- metrics -------------------------------------------------------------------------------------
@dataclass
class StepMetrics:
    """Sums over micro-steps / batches, turned into means by `summary`."""

    loss_sum: float = 0.0
    n: int = 0
    correct: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    run_len_sum: int = 0
    run_len_n: int = 0
    tokens: int = 0
    topk_correct: list[int] = field(default_factory=list)  # Medusa: per-head top-k hits
    topk: int = 0

    def add(self, m: dict, tokens: int) -> None:
        self.loss_sum += m["loss"]
        self.n += 1
        if not self.correct:
            self.correct = [0] * len(m["correct"])
            self.count = [0] * len(m["count"])
        for k, (c, n) in enumerate(zip(m["correct"], m["count"])):
            self.correct[k] += c
            self.count[k] += n
        if "topk_correct" in m:
            self.topk = m["topk"]
            self.topk_correct = [a + b for a, b in zip(self.topk_correct or [0] * len(m["topk_correct"]),
                                                      m["topk_correct"])]
        self.run_len_sum += m["run_len_sum"]
        self.run_len_n += m["run_len_n"]
        self.tokens += tokens

    def summary(self, prefix: str) -> dict:
        from drafttrain.losses import simulated_tau

        out = {f"{prefix}/loss": self.loss_sum / max(self.n, 1)}
        for k, (c, n) in enumerate(zip(self.correct, self.count)):
            out[f"{prefix}/acc_{k}"] = c / max(n, 1)
        for k, (c, n) in enumerate(zip(self.topk_correct, self.count)):  # Medusa heads
            out[f"{prefix}/head{k}_top1"] = self.correct[k] / max(n, 1)
            out[f"{prefix}/head{k}_top{self.topk}"] = c / max(n, 1)
        out[f"{prefix}/tau_sim"] = simulated_tau(self.run_len_sum, self.run_len_n)
        return out


# ---- the run ------------------------------------------------------------------------------------
def cpu_processes() -> bool:
    """True when a launcher started several processes on a machine without CUDA.

    Accelerate then needs `cpu=True` to join them with gloo; without it each process silently
    trains alone (and all of them write the same run folder).
    """
    return not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _launch_kwargs() -> dict:
    """Accelerator arguments for CPU processes: gloo under DeepSpeed (which refuses cpu=True), else cpu=True."""
    if not cpu_processes():
        return {}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": True}


def _mixed_precision(cfg: TrainConfig, target_dtype: torch.dtype) -> str:
    mp = cfg.train.mixed_precision
    if mp == "auto":
        return "bf16" if target_dtype == torch.bfloat16 else "no"
    return mp


MEDUSA = ("medusa1", "medusa2")


def loss_step(cfg: TrainConfig, drafter, target, batch: dict, feats: dict, step: int | None = None):
    """The one place where methods differ. `step` (None = evaluation) picks Medusa-2's stage."""
    from drafttrain.losses import eagle1_loss, eagle3_loss, medusa2_loss, medusa_loss

    d, m = cfg.drafter, cfg.medusa
    if cfg.method == "draft_lm":  # a small causal LM distilled from the target (drafttrain.distill)
        from drafttrain.distill import draft_lm_step

        return draft_lm_step(cfg, drafter, target, batch, feats, step)
    if cfg.method == "medusa1":
        return medusa_loss(drafter, target, batch, feats["final"], step_weight=d.step_weight,
                           self_distill=m.self_distill, topk=m.topk)
    if cfg.method == "medusa2":
        joint = step is None or step >= m.warmup_steps
        return medusa2_loss(drafter, target, batch, joint=joint, step_weight=d.step_weight,
                            self_distill=m.self_distill, heads_coefficient=m.heads_coefficient,
                            kl_weight=m.kl_weight, topk=m.topk)
    if cfg.method == "eagle3":
        return eagle3_loss(drafter, target, batch, feats, steps=d.ttt_steps, step_weight=d.step_weight,
                           mask_out_of_vocab=d.mask_out_of_vocab)
    return eagle1_loss(drafter, target, batch, feats, feature_weight=d.feature_weight, ce_weight=d.ce_weight,
                       noise=d.noise)


def batch_features(cfg: TrainConfig, target, batch: dict, spec) -> dict:
    from drafttrain.features import target_features

    if cfg.method == "medusa2":  # the loss runs the (adapted) target itself, with grad
        return {}
    if "aux" in batch:  # offline cache
        return {"aux": batch["aux"], "final": batch["final"].to(next(target.parameters()).dtype)}
    return target_features(target, batch["input_ids"], batch["attention_mask"], spec)


@torch.no_grad()
def evaluate(cfg: TrainConfig, drafter, target, loader, spec, accelerator) -> dict:
    from tqdm.auto import tqdm

    raw = accelerator.unwrap_model(drafter)
    was_training = raw.training
    raw.eval()
    m = StepMetrics()
    for batch in tqdm(loader, desc="held-out eval", unit="batch", leave=False, dynamic_ncols=True,
                      disable=not accelerator.is_main_process):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        feats = batch_features(cfg, target, batch, spec)
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
    gamma = cfg.train.decode_eval_gamma
    if cfg.method in MEDUSA:  # a Medusa chain is at most one draft per head
        gamma = min(gamma, cfg.medusa.num_heads)
    try:
        with torch.no_grad(), accelerator.autocast():
            res = run(target, raw, prompts, max_new_tokens=cfg.train.decode_eval_tokens, temperature=0.0,
                      gamma=gamma)
    finally:
        raw.train(was_training)
    acc = res.get("acceptance") or []
    return {"eval/decode_tau": res["tau"], "eval/decode_tokens_per_s": res["tokens_per_s"],
            **{f"eval/decode_accept_{k}": a for k, a in enumerate(acc)}}


def token_counts(ds, vocab_size: int) -> torch.Tensor:
    """[V] counts of loss-masked tokens (the tokens the drafter must predict)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in ds:
        ids = torch.tensor(r["input_ids"], dtype=torch.long)
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size].double()
    return counts


def build_drafter(cfg: TrainConfig, target, train_ds, accelerator):
    from drafttrain.models.eagle import EagleDrafter, build_vocab_mapping, config_from_target

    if cfg.method in MEDUSA:
        return build_medusa(cfg, target, train_ds, accelerator)
    if cfg.method == "draft_lm":
        from drafttrain.distill import build_draft_lm

        return build_draft_lm(cfg, target, accelerator)
    tcfg = getattr(target.config, "text_config", None) or target.config
    vd = cfg.drafter.draft_vocab_size or tcfg.vocab_size
    ecfg = config_from_target(target.config, cfg.method, draft_vocab_size=vd,
                              aux_layer_ids=cfg.drafter.aux_layer_ids or None)
    bad = [i for i in ecfg.aux_layer_ids if not 0 <= i <= tcfg.num_hidden_layers]
    if bad:
        raise TrainingError(
            f"drafter.aux_layer_ids {bad} out of range: the target has hidden_states 0..{tcfg.num_hidden_layers}"
        )
    drafter = EagleDrafter(ecfg)
    coverage = 1.0
    if cfg.method == "eagle3":
        counts = token_counts(train_ds, tcfg.vocab_size)
        d2t, t2d, coverage = build_vocab_mapping(counts, ecfg.draft_vocab_size)
        drafter.set_vocab_mapping(d2t, t2d)
    drafter.attach_target(target)
    drafter.init_from_target(target)
    dtype = getattr(torch, cfg.drafter.dtype)
    drafter.to(device=accelerator.device, dtype=dtype)
    return drafter, coverage


def build_medusa(cfg: TrainConfig, target, train_ds, accelerator):
    """Medusa heads for `target`; a reduced draft vocab (drafter.draft_vocab_size) as in EAGLE-3."""
    from drafttrain.models.eagle import build_vocab_mapping
    from drafttrain.models.medusa import MedusaHeads, config_from_target

    tcfg = getattr(target.config, "text_config", None) or target.config
    m = cfg.medusa
    mcfg = config_from_target(target.config, cfg.method, num_heads=m.num_heads, num_layers=m.num_layers,
                              draft_vocab_size=cfg.drafter.draft_vocab_size or tcfg.vocab_size,
                              share_lm_head=m.share_lm_head)
    heads = MedusaHeads(mcfg)
    coverage = 1.0
    if mcfg.draft_vocab_size < mcfg.vocab_size:
        d2t, t2d, coverage = build_vocab_mapping(token_counts(train_ds, tcfg.vocab_size), mcfg.draft_vocab_size)
        heads.set_vocab_mapping(d2t, t2d)
    heads.attach_target(target)
    heads.init_from_target(target)
    heads.to(device=accelerator.device, dtype=getattr(torch, cfg.drafter.dtype))
    return heads, coverage


def wrap_target_for_method(cfg: TrainConfig, target, accelerator):
    """Medusa-2 only: a LoRA adapter on the target (PEFT), the one place it is applied.

    Base weights stay frozen; only the adapter's A/B matrices train. Other methods get the
    target back unchanged.
    """
    if cfg.method != "medusa2":
        return target
    from peft import LoraConfig, get_peft_model

    if cfg.features.mode == "offline":
        raise TrainingError("method=medusa2 trains the target's adapter, so it needs features.mode=online")
    if accelerator.num_processes > 1:
        raise TrainingError("method=medusa2 runs on one process for now (the LoRA adapter is not synchronised "
                            "across processes); launch without accelerate's multi-process mode")
    m = cfg.medusa
    lora = LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=0.0, target_modules=list(m.lora_target_modules))
    return get_peft_model(target, lora)


def adapter_params(target) -> list[torch.nn.Parameter]:
    """The trainable parameters of the target (Medusa-2's LoRA adapter; empty otherwise)."""
    return [p for p in target.parameters() if p.requires_grad]


def param_groups(cfg: TrainConfig, drafter, target) -> list[dict]:
    """Optimizer groups: the drafter at train.lr; Medusa-2's heads at lr * head_lr_mult plus the adapter at lr."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    if cfg.method != "medusa2":
        return [{"params": params}]
    return [{"params": params, "lr": cfg.train.lr * cfg.medusa.head_lr_mult},
            {"params": adapter_params(target), "lr": cfg.train.lr}]


@torch.no_grad()
def medusa_rank_accuracy(heads, target, records, pad: int, max_rank: int, batch_size: int = 4) -> list[list[float]]:
    """[K][R]: how often head k's rank-r candidate equals the target's greedy token at that place.

    Head k at position t is scored against the target's argmax at position t+k+1 (the token
    x_{t+k+2} greedy decoding would emit after the data prefix), over assistant positions: the
    per-depth acceptance a static tree sees (teacher-forced). Target = the adapted one for Medusa-2.
    """
    from drafttrain.data import collate
    from drafttrain.decode.kernels.greedy import greedy_lm_head_argmax_ref
    from drafttrain.features import FeatureSpec, target_features
    from drafttrain.losses import _shift

    K = heads.cfg.num_heads
    hits = torch.zeros(K, max_rank, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    device = next(heads.parameters(), heads.d2t).device
    for start in range(0, len(records), batch_size):
        batch = collate([records[i] for i in range(start, min(len(records), start + batch_size))], pad)
        batch = {k: v.to(device) for k, v in batch.items()}
        final = target_features(target, batch["input_ids"], batch["attention_mask"], FeatureSpec("medusa1", []))["final"]
        w = target.get_output_embeddings().weight
        greedy = greedy_lm_head_argmax_ref(final.reshape(-1, final.shape[-1]).to(w.dtype), w).view(final.shape[:2])
        logits = heads(final)  # [K, B, T, Vd]
        attn, lmask = batch["attention_mask"].bool(), batch["loss_mask"].bool()
        for k in range(K):
            valid = attn & _shift(attn, k + 2, False) & _shift(lmask, k + 2, False)
            top = logits[k].topk(min(max_rank, logits.shape[-1]), -1).indices  # [B, T, R] draft ids
            top = top + heads.d2t[top]  # target ids
            want = _shift(greedy, k + 1, -1)
            hit = (top == want[..., None]) & valid[..., None]  # [B, T, R]
            hits[k, : hit.shape[-1]] += hit.sum((0, 1)).double().cpu()
            counts[k] += valid.sum().double().cpu()
    return (hits / counts.clamp(min=1)[:, None]).tolist()


def drafter_extras(cfg: TrainConfig, raw, target, train_ds, held_ds, tokenizer, pad: int) -> tuple[dict, object]:
    """What a drafter folder adds beyond weights and config: (metadata fields, a writer of extra
    files called inside the folder's atomic write, or None)."""
    if cfg.method in MEDUSA:
        return medusa_extras(cfg, raw, target, held_ds, tokenizer, pad)
    if cfg.method == "draft_lm" and cfg.draft_lm.decode_vocab:
        from drafttrain.models.draft_lm import decode_vocab, write_decode_vocab

        ids, coverage = decode_vocab(token_counts(train_ds, raw.cfg.vocab_size), cfg.draft_lm.decode_vocab)
        fields = {"decode_vocab_size": int(ids.numel()), "decode_vocab_coverage": round(coverage, 4)}
        return fields, lambda folder: write_decode_vocab(folder, ids)
    return {}, None


def medusa_extras(cfg: TrainConfig, heads, target, held_ds, tokenizer, pad: int) -> tuple[dict, object]:
    """What a Medusa drafter folder adds: (config.json fields, a writer for extra files).

    Fields: `rank_accuracy` [K][R] on held-out data, `tree_choices` (the static tree learned
    from it) and, for Medusa-2, `adapter_id`. The writer saves Medusa-2's adapter (PEFT,
    safetensors) in `adapter/` and, with medusa.save_merged, the merged target in `merged_target/`.
    """
    import copy
    import uuid

    from drafttrain.models.medusa import learned_tree

    m = cfg.medusa
    n = min(len(held_ds), m.tree_records)
    acc = medusa_rank_accuracy(heads, target, [held_ds[i] for i in range(n)], pad, m.tree_max_rank) if n else []
    fields = {"rank_accuracy": acc, "tree_choices": learned_tree(acc, m.tree_budget) if acc else []}
    if cfg.method != "medusa2":
        return fields, None
    fields["adapter_id"] = uuid.uuid4().hex

    def write(folder: Path) -> None:
        target.save_pretrained(str(folder / "adapter"), safe_serialization=True)
        if m.save_merged:
            merged = copy.deepcopy(target).merge_and_unload()
            merged.config.drafttrain_adapter_id = fields["adapter_id"]
            merged.save_pretrained(str(folder / "merged_target"), safe_serialization=True)
            tokenizer.save_pretrained(str(folder / "merged_target"))

    return fields, write


def agreed(accelerator, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over processes, so all of them save and stop at the same step.

    A signal or the time limit can reach one process a step before another; acting on the local
    flag would leave the others waiting forever in the checkpoint's collectives.
    """
    if accelerator.num_processes == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], device=accelerator.device)
    return tuple(bool(v) for v in accelerator.reduce(t, reduction="sum").tolist())


class _StopFlag:
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
    if hasattr(fresh, "attach_target"):
        fresh.attach_target(target)
    return fresh.to(device=accelerator.device)


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


def train(cfg: TrainConfig) -> dict:
    """Run one training job; returns the summary dict (also written to <run>/summary.json)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from drafttrain.data import build_datasets, collate
    from drafttrain.drafter_io import model_card, save_drafter_folder
    from drafttrain.features import FeatureCache, FeatureSpec, collate_features
    from drafttrain.targets import load_target, resolve_dtype
    from drafttrain.tracking import make_tracker

    t_start = time.time()
    run_dir = Path(cfg.run_dir)
    target_dtype = resolve_dtype(cfg.dtype)
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.train.grad_accum,
        mixed_precision=_mixed_precision(cfg, target_dtype),
        step_scheduler_with_optimizer=False,
        **_launch_kwargs(),
    )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.distributed_type != "FSDP":
        log(accelerator, f"drafttrain: warning: FSDP was requested but Accelerate runs {accelerator.distributed_type.value} "
            "here (it has no FSDP for CPU processes)")
    set_seed(cfg.seed)
    threads = cpu_threads(cfg.threads, accelerator.device)
    if threads:
        log(accelerator, f"drafttrain: {threads} CPU thread(s) per process")
    if accelerator.is_main_process:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrainingError(f"output_dir {run_dir} cannot be created ({e.strerror}); choose another "
                                f"output_dir=") from e
        if not os.access(run_dir, os.W_OK):
            raise TrainingError(f"output_dir {run_dir} is not writable; choose another output_dir=")
        dump_yaml(cfg, run_dir / "config.yaml")

    # ---- setup: target, data, drafter --------------------------------------------------------
    log(accelerator, f"drafttrain: loading target {cfg.target} ({cfg.dtype})")
    with full_replica(accelerator):
        target, tokenizer, info = load_target(cfg.target, dtype=cfg.dtype, device=accelerator.device,
                                              revision=cfg.target_revision or None,
                                              trust_remote_code=cfg.trust_remote_code)
    with accelerator.main_process_first():
        train_ds, held_ds, report = build_datasets(cfg.data, tokenizer)
    log(accelerator, report.summary())
    target = wrap_target_for_method(cfg, target, accelerator)
    drafter, coverage = build_drafter(cfg, target, train_ds, accelerator)
    if cfg.method == "draft_lm" and cfg.draft_lm.decode_vocab:
        # decoding evals in training draft from the same head rows as the saved folder will
        from drafttrain.models.draft_lm import decode_vocab

        drafter.model.drafttrain_decode_vocab = decode_vocab(
            token_counts(train_ds, drafter.cfg.vocab_size), cfg.draft_lm.decode_vocab)[0]
    spec = FeatureSpec(cfg.method, drafter.cfg.aux_layer_ids)
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    log(accelerator, f"drafttrain: {cfg.method} drafter, {n_params / 1e6:.1f}M trainable params, aux layers "
        f"{drafter.cfg.aux_layer_ids}, draft vocab {drafter.cfg.draft_vocab_size} (covers {coverage:.1%} of "
        f"assistant tokens)")

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if cfg.features.mode == "offline":
        cache_dir = Path(cfg.features.cache_dir or run_dir / "features")
        records = FeatureCache(cache_dir)
        if len(records) != len(train_ds) or records.meta.get("aux_layer_ids") != spec.aux_layer_ids:
            raise TrainingError(
                f"feature cache {cache_dir} does not match this config ({len(records)} records, aux "
                f"{records.meta.get('aux_layer_ids')} vs {len(train_ds)} records, aux {spec.aux_layer_ids}); "
                f"rerun `drafttrain prepare` with the same settings"
            )
        collate_fn = lambda b: collate_features(b, pad)  # noqa: E731
    else:
        records = _Records(train_ds)
        collate_fn = lambda b: collate(b, pad)  # noqa: E731
    sampler = EpochSampler(len(records), cfg.seed)
    loader = DataLoader(records, batch_size=cfg.train.batch_size, sampler=sampler, collate_fn=collate_fn,
                        num_workers=cfg.train.num_workers)
    held_loader = DataLoader(_Records(held_ds), batch_size=cfg.train.batch_size,
                             collate_fn=lambda b: collate(b, pad)) if len(held_ds) else None

    optimizer = torch.optim.AdamW(param_groups(cfg, drafter, target), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                  weight_decay=cfg.train.weight_decay)
    drafter, optimizer, loader = accelerator.prepare(drafter, optimizer, loader)
    extra_params = adapter_params(target)  # Medusa-2's adapter: clipped with the drafter
    micro_per_epoch = len(loader)
    steps_per_epoch = max(1, micro_per_epoch // cfg.train.grad_accum)
    total_steps = cfg.train.max_steps or steps_per_epoch * cfg.train.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.train.warmup_steps, total_steps, cfg.train.min_lr_ratio))

    state = {"step": 0, "epoch": 0, "micro_in_epoch": 0, "tokens": 0, "train_time_s": 0.0,
             "best_tau_sim": None}
    resumed_from = None
    if cfg.train.resume:
        ck = latest_checkpoint(run_dir)
        if ck is None:
            log(accelerator, f"drafttrain: train.resume=true but no checkpoint in {run_dir}/checkpoints; starting fresh")
        else:
            accelerator.load_state(str(ck))
            scheduler.load_state_dict(torch.load(ck / "scheduler_lambda.pt", weights_only=True))
            state = json.loads((ck / "trainer_state.json").read_text())
            resumed_from = state["step"]
            log(accelerator, f"drafttrain: resumed from {ck} (step {state['step']}, epoch {state['epoch']})")

    tracker = make_tracker(cfg.tracking, is_main=accelerator.is_main_process, project=cfg.wandb.project,
                           entity=cfg.wandb.entity, name=cfg.wandb.name or run_dir.name, mode=cfg.wandb.mode,
                           config=to_dict(cfg), run_dir=str(run_dir))

    decode_prompts: list[list[int]] = []
    if cfg.train.decode_eval_every or cfg.train.decode_eval_final:
        from drafttrain.data import heldout_prompts

        decode_prompts = heldout_prompts(cfg.data, tokenizer, cfg.train.decode_eval_prompts)

    def save_best(dec: dict) -> None:
        """Keep the drafter with the best decoding tau so far in <run>/best_drafter (atomic)."""
        raw = accelerator.unwrap_model(drafter)
        card = model_card({"method": cfg.method, "recipe": cfg.recipe, "target": {"spec": cfg.target},
                           "aux_layer_ids": raw.cfg.aux_layer_ids, "draft_vocab_size": raw.cfg.draft_vocab_size,
                           "vocab_coverage": coverage}, {"step": state["step"], **dec})
        fields, write_extra = drafter_extras(cfg, raw, target, train_ds, held_ds, tokenizer, pad)
        save_drafter_folder(run_dir / "best_drafter", drafter=raw, target=target, tokenizer=tokenizer,
                            method=cfg.method, card=card, write_extra=write_extra,
                            extra={"recipe": cfg.recipe, "vocab_coverage": coverage, "training": to_dict(cfg),
                                   "metrics": {"step": state["step"], **dec}, **fields})

    # ---- loop -----------------------------------------------------------------------------------
    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=state["step"], desc=f"train {cfg.method}", unit="step",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    window = StepMetrics()
    last_eval: dict = {}
    t_loop = time.time() - state["train_time_s"]
    stopped_early = False
    drafter.train()
    with _StopFlag() as stop, keep_alive(bar):  # the bar's clock moves during long steps too
        while state["step"] < total_steps and not stopped_early:
            sampler.set_epoch(state["epoch"])
            it = accelerator.skip_first_batches(loader, state["micro_in_epoch"]) if state["micro_in_epoch"] else loader
            for batch in it:
                state["micro_in_epoch"] += 1
                feats = batch_features(cfg, target, batch, spec)
                with accelerator.accumulate(drafter):
                    with accelerator.autocast():
                        loss, met = loss_step(cfg, drafter, target, batch, feats, step=state["step"])
                    if not torch.isfinite(loss):
                        kept = latest_checkpoint(run_dir)
                        bar.close()  # so the error starts its own line, not the progress bar's
                        raise TrainingError(
                            f"loss is {loss.item()} at step {state['step'] + 1} (epoch {state['epoch']}, batch "
                            f"{state['micro_in_epoch']}); stopped. Last good checkpoint: {kept or 'none'}"
                        )
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and cfg.train.grad_clip > 0:
                        clip = [*drafter.parameters(), *extra_params] if extra_params else drafter.parameters()
                        accelerator.clip_grad_norm_(clip, cfg.train.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad()
                ntok = int(batch["attention_mask"].sum())
                window.add(met, ntok)
                state["tokens"] += ntok * accelerator.num_processes
                if not accelerator.sync_gradients:
                    continue
                scheduler.step()
                state["step"] += 1
                state["train_time_s"] = time.time() - t_loop
                s = window.summary("train")
                bar.update(1)
                bar.set_postfix(loss=f"{s['train/loss']:.3f}", acc0=f"{s.get('train/acc_0', 0):.2f}",
                                tau=f"{s['train/tau_sim']:.2f}")
                if state["step"] % cfg.train.log_every == 0 or state["step"] == total_steps:
                    s["train/lr"] = scheduler.get_last_lr()[0]
                    s["train/tokens_per_s"] = state["tokens"] / max(state["train_time_s"], 1e-9)
                    tracker.log(s, step=state["step"])
                    window = StepMetrics()
                if cfg.train.eval_every and state["step"] % cfg.train.eval_every == 0 and held_loader:
                    last_eval = evaluate(cfg, drafter, target, held_loader, spec, accelerator)
                    tracker.log(last_eval, step=state["step"])
                    bar.write(f"step {state['step']}: " + ", ".join(f"{k}={v:.3f}" for k, v in last_eval.items()))
                if (cfg.train.decode_eval_every and state["step"] % cfg.train.decode_eval_every == 0
                        and decode_prompts and accelerator.is_main_process):
                    dec = decode_eval(cfg, drafter, target, decode_prompts, accelerator)
                    tracker.log(dec, step=state["step"])
                    bar.write(f"step {state['step']}: decoding tau {dec['eval/decode_tau']:.3f} "
                              f"(greedy chain of {cfg.train.decode_eval_gamma}, {len(decode_prompts)} held-out prompts)")
                    if state.get("best_decode_tau") is None or dec["eval/decode_tau"] > state["best_decode_tau"]:
                        state["best_decode_tau"] = dec["eval/decode_tau"]
                        state["best_decode_step"] = state["step"]
                        save_best(dec)
                if cfg.train.stop_after and state["step"] >= cfg.train.stop_after:
                    log(accelerator, f"drafttrain: train.stop_after={cfg.train.stop_after} reached; exiting without final save")
                    bar.close()
                    return {"stopped_at": state["step"]}
                out_of_time = cfg.train.max_minutes and state["train_time_s"] > 60 * cfg.train.max_minutes
                stop_now, out_of_time = agreed(accelerator, stop.stop, bool(out_of_time))
                if out_of_time:
                    log(accelerator, f"drafttrain: train.max_minutes={cfg.train.max_minutes} reached at step {state['step']}")
                if cfg.train.save_every and state["step"] % cfg.train.save_every == 0 or stop_now:
                    save_checkpoint(accelerator, run_dir, state, scheduler, cfg.train.keep_checkpoints)
                if stop_now:
                    log(accelerator, f"drafttrain: stopped by signal at step {state['step']}; resume with train.resume=true")
                    bar.close()
                    tracker.finish()
                    raise SystemExit(130)
                if state["step"] >= total_steps or out_of_time:
                    stopped_early = bool(out_of_time)
                    break
            else:
                state["epoch"] += 1
                state["micro_in_epoch"] = 0
                continue
            if state["step"] >= total_steps:
                break
    bar.close()

    # ---- final eval + save ---------------------------------------------------------------------
    log(accelerator, f"drafttrain: saving the final checkpoint (step {state['step']})")
    save_checkpoint(accelerator, run_dir, state, scheduler, cfg.train.keep_checkpoints)
    if held_loader:
        log(accelerator, f"drafttrain: held-out evaluation ({len(held_ds)} records)")
    final_eval = evaluate(cfg, drafter, target, held_loader, spec, accelerator) if held_loader else {}
    if cfg.train.decode_eval_final and decode_prompts and accelerator.is_main_process:
        log(accelerator, f"drafttrain: decoding {len(decode_prompts)} held-out prompts with the drafter (real tau)")
        final_eval.update(decode_eval(cfg, drafter, target, decode_prompts, accelerator))
    tracker.log(final_eval, step=state["step"])
    raw = gathered_drafter(accelerator, drafter, target)
    summary = {
        "drafter_dir": str(run_dir / "drafter"),
        "method": cfg.method,
        "target": cfg.target,
        "steps": state["step"],
        "train_tokens": state["tokens"],
        "train_time_s": round(state["train_time_s"], 1),
        "wall_time_s": round(time.time() - t_start, 1),
        "train_tokens_per_s": round(state["tokens"] / max(state["train_time_s"], 1e-9), 1),
        "vocab_coverage": round(coverage, 4),
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        **{k: round(v, 4) for k, v in final_eval.items()},
    }
    if resumed_from is not None:
        summary["resumed_from_step"] = resumed_from
    if state.get("best_decode_tau") is not None:
        summary["best_decode_tau"] = round(state["best_decode_tau"], 4)
        summary["best_drafter_dir"] = str(run_dir / "best_drafter")
        summary["best_decode_step"] = state.get("best_decode_step")
    if accelerator.is_main_process:
        log(accelerator, f"drafttrain: writing the drafter folder {run_dir / 'drafter'}")
        extra_fields, write_extra = drafter_extras(cfg, raw, target, train_ds, held_ds, tokenizer, pad)
        if cfg.method in MEDUSA:
            summary["tree_choices"] = extra_fields["tree_choices"]
        meta = {"method": cfg.method, "recipe": cfg.recipe, "target": {"spec": cfg.target},
                "aux_layer_ids": raw.cfg.aux_layer_ids, "draft_vocab_size": raw.cfg.draft_vocab_size,
                "vocab_coverage": coverage, "data_summary": report.summary().splitlines()[0]}
        card = model_card(meta, {k: v for k, v in summary.items() if k.startswith("eval/") or k in (
            "steps", "train_tokens", "train_time_s", "train_tokens_per_s")})
        save_drafter_folder(run_dir / "drafter", drafter=raw, target=target, tokenizer=tokenizer, method=cfg.method,
                            card=card, extra={"recipe": cfg.recipe, "vocab_coverage": coverage,
                                              "training": to_dict(cfg), "metrics": summary,
                                              "data": report.__dict__ if hasattr(report, "__dict__") else {},
                                              **extra_fields},
                            write_extra=write_extra)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        tracker.log_artifact(run_dir / "drafter", name=f"{run_dir.name}-drafter", metadata=summary)
    tracker.finish()
    accelerator.wait_for_everyone()
    return summary


def format_summary(summary: dict) -> str:
    lines = ["", "drafttrain: run finished", f"  drafter      {summary.get('drafter_dir')}"]
    for k in ("steps", "train_tokens", "train_time_s", "wall_time_s", "train_tokens_per_s", "vocab_coverage"):
        if k in summary:
            lines.append(f"  {k:<12} {summary[k]}")
    accs = [(k, v) for k, v in summary.items() if k.startswith("eval/acc_")]
    if accs:
        per = "per head" if str(summary.get("method", "")).startswith("medusa") else "per unroll step"
        lines.append("  held-out acc " + " ".join(f"{v:.3f}" for _, v in accs) + f"  ({per})")
    if "eval/tau_sim" in summary:
        lines.append(f"  held-out simulated tau {summary['eval/tau_sim']:.3f}  (teacher-forced greedy chain, bonus included)")
    if "eval/decode_tau" in summary:
        lines.append(f"  held-out decoding tau  {summary['eval/decode_tau']:.3f}  (real greedy decoding, bonus included; "
                     f"{summary.get('eval/decode_tokens_per_s', 0):.1f} tok/s)")
    if "best_decode_tau" in summary:
        lines.append(f"  best decoding tau {summary['best_decode_tau']:.3f} at step {summary['best_decode_step']}: "
                     f"{summary['best_drafter_dir']}")
    return "\n".join(lines)
