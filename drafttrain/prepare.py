"""`drafttrain prepare`: compute and cache target features for offline training.

Loads the target and the training split exactly as `train` would, prints the disk estimate,
then writes bf16 shards (resumable, sharded across processes under `accelerate launch`).
"""

from __future__ import annotations

from pathlib import Path

from drafttrain.schema import TrainConfig
from drafttrain.textconfig import text_config


def prepare(cfg: TrainConfig) -> Path:
    from accelerate import PartialState

    from drafttrain.answers import training_data
    from drafttrain.data import build_datasets
    from drafttrain.distributed import cpu_processes, cpu_threads
    from drafttrain.errors import TrainingError
    from drafttrain.features import estimate_bytes, human_bytes, write_feature_cache
    from drafttrain.methods.registry import get_method
    from drafttrain.targets import load_target, num_layers

    state = PartialState(cpu=cpu_processes())
    cpu_threads(cfg.threads, state.device)
    target, tokenizer, info = load_target(cfg.target, dtype=cfg.dtype, device=state.device,
                                          revision=cfg.target_revision or None,
                                          trust_remote_code=cfg.trust_remote_code)
    with state.main_process_first():
        data = training_data(cfg.data, cfg.answers, cfg.target, target, tokenizer, progress=state.is_main_process)
        train_ds, _, report = build_datasets(data, tokenizer)
    method = get_method(cfg.method)
    if not method.offline_features:
        raise TrainingError(f"method={cfg.method} runs the target with gradients, so it needs features.mode=online "
                            "(nothing to prepare)")
    spec = method.feature_spec(cfg, None, num_layers(target))
    out = Path(cfg.features.cache_dir or Path(cfg.run_dir) / "features")
    hidden = text_config(target.config).hidden_size
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
