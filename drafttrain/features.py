"""Target features for feature drafters: computed online in the loop, or cached offline.

`target_features` runs the frozen target's body (never its full-vocab LM head) and returns the
hidden states a method needs: EAGLE-3 the concatenated aux layers, EAGLE-1 the final post-norm
state; both keep the final post-norm state, from which `teacher_draft_logits` computes the
teacher's logits over the draft vocabulary only, and `teacher_in_vocab` checks in vocab blocks
whether the teacher's full-vocab argmax lies inside the draft vocabulary.

The offline cache (`features.mode=offline`: computed before the first epoch where it is missing,
or ahead of time by `drafttrain prepare`) stores exactly those tensors per record, in bf16, in
safetensors shards of `shard_size` records, written atomically: a killed `prepare` resumes at
the first missing shard. `FeatureCache` reads them back for training, memory-mapped.

What it does not do: it does not store teacher logits (they are recomputed from the final
hidden state, which is 1/400 of Gemma's vocab width), and it never materialises a full-vocab
fp32 logits tensor.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from drafttrain.errors import TrainingError


@dataclass
class FeatureSpec:
    """Which target hidden states a drafter reads. aux_layer_ids index HF `hidden_states`;
    `concat_aux` (EAGLE-3) concatenates those layers as the "aux" feature, otherwise "aux" is the
    final post-norm state (EAGLE-1, Medusa, draft LMs)."""

    aux_layer_ids: list[int]
    concat_aux: bool = False

    @property
    def aux_key(self) -> str:
        return "aux"


def _body(target):
    return target.get_decoder() if hasattr(target, "get_decoder") else target.model


@torch.no_grad()
def target_features(target, input_ids: Tensor, attention_mask: Tensor | None, spec: FeatureSpec) -> dict[str, Tensor]:
    """Run the frozen target once.

    Args:
        input_ids: [B, T]; attention_mask: [B, T] (1 = real token; right padding).

    Returns:
        {"aux": [B, T, len(aux) * H] (EAGLE-3) or [B, T, H] (EAGLE-1: the final state),
         "final": [B, T, H] post-norm hidden state (what the LM head reads)}.
    """
    out = _body(target)(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    final = out.last_hidden_state
    if not spec.concat_aux:  # EAGLE-1 and Medusa read the final state only
        aux = final
    else:
        aux = torch.cat([hs[i] for i in spec.aux_layer_ids], dim=-1)
    return {"aux": aux, "final": final}


@torch.no_grad()
def feature_scale(target, records, spec: FeatureSpec, *, num_records: int = 16) -> Tensor:
    """[A*H] per-dimension input scale for a drafter's fc over the concatenated aux features.

    Decoder-layer outputs carry a few massive dimensions (Gemma 3 270M: one dimension of layer
    15 averages ~22,000 where the layer's median is ~190; such dimensions hold no token
    information), so a plain fc over the raw features is ill-conditioned: Adam moves every
    weight by ~lr, and on an outlier column that step moves the output by thousands, while the
    informative dimensions drown. Each layer's block is scaled by 1 / its median RMS and every
    dimension above that median down to unit RMS, measured on the first `num_records` training
    records: the informative dimensions come out O(1), the outliers no larger. The scale is a
    fixed reparametrisation, folded into fc.weight whenever the drafter is saved.
    """
    p = next(target.parameters())
    rows = []
    for i in range(min(num_records, len(records))):  # index, not list(records): a full dataset is large
        ids = torch.tensor(records[i]["input_ids"], dtype=torch.long, device=p.device)[None]
        rows.append(target_features(target, ids, None, spec)["aux"][0].float())
    aux = torch.cat(rows)  # [N, A*H]
    rms = aux.pow(2).mean(0).sqrt()
    blocks = rms.view(max(len(spec.aux_layer_ids), 1), -1)
    floor = blocks.median(dim=1, keepdim=True).values.clamp(min=1e-6)
    return (1.0 / torch.maximum(blocks, floor)).reshape(-1).cpu()


def lm_head_weight(target) -> Tensor:
    return target.get_output_embeddings().weight


def _softcap(target) -> float | None:
    cfg = getattr(target.config, "text_config", None) or target.config
    return getattr(cfg, "final_logit_softcapping", None)


def teacher_draft_logits(target, final: Tensor, draft_ids: Tensor) -> Tensor:
    """[B, T, H] final hidden -> [B, T, Vd] float32 teacher logits over the draft vocab only."""
    w = lm_head_weight(target)[draft_ids.to(final.device)]  # [Vd, H]
    logits = torch.matmul(final.to(w.dtype), w.t()).float()
    cap = _softcap(target)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    return logits


@torch.no_grad()
def teacher_in_vocab(target, final: Tensor, t2d: Tensor, block: int = 16384) -> Tensor:
    """[B, T] bool: is the teacher's full-vocab argmax inside the draft vocab?

    Computed in vocab blocks (running max + index), never as a [B, T, V] tensor. Softcapping is
    monotone, so it does not change the argmax.
    """
    if bool(t2d.all()):
        return torch.ones(final.shape[:2], dtype=torch.bool, device=final.device)
    from drafttrain.decode.kernels.greedy import greedy_lm_head_argmax_ref

    w = lm_head_weight(target)
    flat = final.reshape(-1, final.shape[-1]).to(w.dtype)
    ids = greedy_lm_head_argmax_ref(flat, w)
    return t2d.to(ids.device)[ids].view(final.shape[:2])


# ---- offline cache -------------------------------------------------------------------------------
def estimate_bytes(num_tokens: int, hidden: int, spec: FeatureSpec) -> int:
    """bf16 bytes the cache will take for `num_tokens` tokens."""
    width = hidden * (len(spec.aux_layer_ids) if spec.concat_aux else 1) + hidden
    return num_tokens * (width * 2 + 8 + 1)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def shard_name(j: int) -> str:
    return f"shard-{j:05d}.safetensors"


def write_feature_cache(
    target,
    dataset,
    spec: FeatureSpec,
    out_dir: str | Path,
    *,
    shard_size: int = 256,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 1,
    progress: bool = True,
    meta: dict | None = None,
) -> Path:
    """Compute and store features for every record of `dataset` (columns input_ids, loss_mask).

    Shards are assigned round-robin to ranks; each shard is written to a temp file and renamed,
    so a killed run leaves only complete shards and a restart skips them.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(dataset)
    num_shards = max(1, math.ceil(n / shard_size))
    info = {"num_records": n, "shard_size": shard_size, "num_shards": num_shards, "concat_aux": spec.concat_aux,
            "aux_layer_ids": spec.aux_layer_ids, **(meta or {})}
    if rank == 0:
        _atomic_write_text(out / "cache.json", json.dumps(info, indent=2))
    device = next(target.parameters()).device
    mine = [j for j in range(num_shards) if j % world_size == rank and not (out / shard_name(j)).exists()]
    total = sum(min(shard_size, n - j * shard_size) for j in mine)
    bar = tqdm(total=total, desc=f"prepare features (rank {rank})", unit="rec", disable=not progress)
    for j in mine:
        tensors: dict[str, Tensor] = {}
        lo, hi = j * shard_size, min(n, (j + 1) * shard_size)
        for start in range(lo, hi, batch_size):
            recs = [dataset[i] for i in range(start, min(hi, start + batch_size))]
            for i, r in zip(range(start, start + len(recs)), recs):
                ids = torch.tensor(r["input_ids"], dtype=torch.long, device=device)[None]
                f = target_features(target, ids, None, spec)
                tensors[f"{i}.input_ids"] = ids[0].cpu()
                tensors[f"{i}.loss_mask"] = torch.tensor(r["loss_mask"], dtype=torch.uint8)
                tensors[f"{i}.aux"] = f["aux"][0].to(torch.bfloat16).cpu().contiguous()
                tensors[f"{i}.final"] = f["final"][0].to(torch.bfloat16).cpu().contiguous()
            bar.update(len(recs))
        tmp = out / (shard_name(j) + f".tmp-{os.getpid()}")
        save_file(tensors, str(tmp))
        os.replace(tmp, out / shard_name(j))
    bar.close()
    return out


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def training_feature_cache(target, train_ds, spec: FeatureSpec, cache_dir: Path, *, shard_size: int, rank: int,
                           world_size: int, barrier, progress: bool, meta: dict) -> FeatureCache:
    """The offline cache of `train_ds`'s features in `cache_dir`: computed now where it is missing
    or unfinished (resumable shards; `barrier` waits for every process), read every epoch after.
    A cache of other records or other aux layers is refused with the way out."""
    fingerprint = records_fingerprint(train_ds)
    if not complete_cache(cache_dir):
        if progress:
            print(f"drafttrain: computing the target's features once for all epochs -> {cache_dir}", flush=True)
        write_feature_cache(target, train_ds, spec, cache_dir, shard_size=shard_size, rank=rank,
                            world_size=world_size, progress=progress, meta={**meta, "records": fingerprint})
        barrier()
    records = FeatureCache(cache_dir)
    stale = records.meta.get("records", fingerprint) != fingerprint
    if stale or len(records) != len(train_ds) or records.meta.get("aux_layer_ids") != spec.aux_layer_ids:
        what = "other records (the same count, other tokens)" if stale and len(records) == len(train_ds) else (
            f"{len(records)} records, aux {records.meta.get('aux_layer_ids')}")
        raise TrainingError(
            f"feature cache {cache_dir} does not match this config: it holds {what}, this run trains "
            f"{len(train_ds)} records, aux {spec.aux_layer_ids}; delete it or set features.cache_dir to another folder"
        )
    return records


def records_fingerprint(ds) -> str:
    """A hash of tokenised records (their token ids, in order)."""
    import hashlib

    h = hashlib.sha256()
    for ids in ds["input_ids"]:
        h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def complete_cache(folder: str | Path) -> bool:
    """Whether `folder` holds a finished cache (its cache.json and every shard it names)."""
    meta_path = Path(folder) / "cache.json"
    if not meta_path.exists():
        return False
    meta = json.loads(meta_path.read_text())
    return all((Path(folder) / shard_name(j)).exists() for j in range(meta["num_shards"]))


class FeatureCache(torch.utils.data.Dataset):
    """Records of an offline cache: dicts with input_ids, loss_mask, aux, final (tensors)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        meta_path = self.folder / "cache.json"
        if not meta_path.exists():
            raise FileNotFoundError(
                f"no feature cache in {self.folder}; run `drafttrain prepare` with the same config first"
            )
        self.meta = json.loads(meta_path.read_text())
        missing = [j for j in range(self.meta["num_shards"]) if not (self.folder / shard_name(j)).exists()]
        if missing:
            raise FileNotFoundError(
                f"feature cache {self.folder} is incomplete ({len(missing)} of {self.meta['num_shards']} shards "
                f"missing); rerun `drafttrain prepare` to finish it"
            )
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return self.meta["num_records"]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        from safetensors import safe_open

        j = i // self.meta["shard_size"]
        if j not in self._open:  # memory-mapped: a shuffled epoch reads one record, not one shard, per item
            self._open[j] = safe_open(str(self.folder / shard_name(j)), framework="pt")
        f = self._open[j]
        return {k: f.get_tensor(f"{i}.{k}") for k in ("input_ids", "loss_mask", "aux", "final")}

    def __getstate__(self) -> dict:  # DataLoader workers open their own handles
        return {**self.__dict__, "_open": {}}


def collate_features(batch: list[dict[str, Tensor]], pad_token_id: int) -> dict[str, Tensor]:
    """Right-pad cached records into a batch: input_ids, attention_mask, loss_mask [B, T], aux, final [B, T, *]."""
    T = max(r["input_ids"].numel() for r in batch)
    B = len(batch)
    out = {
        "input_ids": torch.full((B, T), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.long),
        "aux": torch.zeros(B, T, batch[0]["aux"].shape[-1], dtype=batch[0]["aux"].dtype),
        "final": torch.zeros(B, T, batch[0]["final"].shape[-1], dtype=batch[0]["final"].dtype),
    }
    for b, r in enumerate(batch):
        n = r["input_ids"].numel()
        out["input_ids"][b, :n] = r["input_ids"]
        out["attention_mask"][b, :n] = 1
        out["loss_mask"][b, :n] = r["loss_mask"].long()
        out["aux"][b, :n] = r["aux"]
        out["final"][b, :n] = r["final"]
    return out
