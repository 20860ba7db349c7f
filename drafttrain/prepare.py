"""`drafttrain prepare`: compute and cache target features for offline training.

Loads the target and the training split exactly as `train` would, prints the disk estimate,
then writes bf16 shards (resumable, sharded across processes under `accelerate launch`).
"""

from __future__ import annotations

from pathlib import Path

from drafttrain.schema import TrainConfig


def prepare(cfg: TrainConfig) -> Path:
    from accelerate import PartialState

    from drafttrain.data import build_datasets
    from drafttrain.features import FeatureSpec, estimate_bytes, human_bytes, write_feature_cache
    from drafttrain.models.eagle import default_aux_layer_ids
    from drafttrain.targets import load_target, num_layers
    from drafttrain.trainer import cpu_processes, cpu_threads

    state = PartialState(cpu=cpu_processes())
    cpu_threads(cfg.threads, state.device)
    target, tokenizer, info = load_target(cfg.target, dtype=cfg.dtype, device=state.device,
                                          revision=cfg.target_revision or None,
                                          trust_remote_code=cfg.trust_remote_code)
    with state.main_process_first():
        train_ds, _, report = build_datasets(cfg.data, tokenizer)
    aux = cfg.drafter.aux_layer_ids or default_aux_layer_ids(num_layers(target), cfg.method)
    if cfg.method in ("medusa1", "medusa2", "draft_lm"):  # they read the final hidden state only
        aux = []
    spec = FeatureSpec(cfg.method, list(aux))
    out = Path(cfg.features.cache_dir or Path(cfg.run_dir) / "features")
    hidden = (getattr(target.config, "text_config", None) or target.config).hidden_size
    n_tokens = sum(len(r["input_ids"]) for r in train_ds)
    if state.is_main_process:
        print(report.summary())
        print(f"drafttrain prepare: {len(train_ds)} records, {n_tokens} tokens -> {out} "
              f"(about {human_bytes(estimate_bytes(n_tokens, hidden, spec))} on disk)", flush=True)
    write_feature_cache(target, train_ds, spec, out, shard_size=cfg.features.shard_size,
                        rank=state.process_index, world_size=state.num_processes,
                        progress=state.is_main_process,
                        meta={"target": cfg.target, "target_revision": info.revision})
    state.wait_for_everyone()
    if state.is_main_process:
        print(f"drafttrain prepare: done; train with features.mode=offline features.cache_dir={out}")
    return out
