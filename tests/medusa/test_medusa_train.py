"""Medusa-1 and Medusa-2 training on a tiny target: heads (and only the adapter) change, the
loss on a fixed batch falls, the adapted target stays close to the original, and the trained
folders decode exactly like their target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafttrain.decode import load_proposer, speculative_generate


def heads_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "drafter" / "model.safetensors"))


def fixed_batch_loss(medusa_cfg, root: Path, run: Path, method: str) -> float:
    """Loss of a saved drafter on the first 4 training records (Medusa-2: with its adapter)."""
    from drafttrain.data import build_datasets, collate
    from drafttrain.features import FeatureSpec, target_features
    from drafttrain.models.medusa import load_medusa
    from drafttrain.targets import load_target
    from drafttrain.trainer import loss_step

    cfg = medusa_cfg(root, run, f"method={method}")
    target, tok, _ = load_target(cfg.target, dtype="float32")
    train_ds, _, _ = build_datasets(cfg.data, tok)
    batch = collate([train_ds[i] for i in range(4)], tok.pad_token_id)
    if method == "medusa2":
        from peft import PeftModel

        target = PeftModel.from_pretrained(target, str(run / "drafter" / "adapter"))
        feats = {}
    else:
        feats = target_features(target, batch["input_ids"], batch["attention_mask"], FeatureSpec([]))
    heads = load_medusa(run / "drafter", target)
    with torch.no_grad():
        loss, _ = loss_step(cfg, heads, target, batch, feats)
    return float(loss)


def greedy_equal(target, folder: Path, **kw) -> None:
    ids = torch.randint(7, 263, (2, 8), generator=torch.Generator().manual_seed(3))
    ref = target.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)[:, 8:]
    out = speculative_generate(target, load_proposer(str(folder), target), ids, max_new_tokens=12,
                               eos_token_id=[], **kw)
    assert out.sequences == ref.tolist()


def test_medusa1_two_steps(make_cfg, medusa_root, medusa1_runs):
    lr0, run = medusa1_runs
    before, after = heads_weights(lr0), heads_weights(run)
    assert before.keys() == after.keys() and "lm_heads.2.weight" in after and "blocks.0.layers.0.weight" in after
    assert not torch.equal(before["blocks.0.layers.0.weight"], after["blocks.0.layers.0.weight"])
    assert torch.count_nonzero(before["blocks.0.layers.0.weight"]) == 0  # zero-initialised residual blocks
    assert fixed_batch_loss(make_cfg, medusa_root, run, "medusa1") < fixed_batch_loss(make_cfg, medusa_root, lr0, "medusa1")
    meta = json.loads((run / "drafter" / "config.json").read_text())
    assert meta["method"] == "medusa1" and meta["drafter"]["num_heads"] == 3
    assert len(meta["rank_accuracy"]) == 3 and len(meta["rank_accuracy"][0]) == 3
    assert 1 <= len(meta["tree_choices"]) <= 6
    for k in range(3):  # per-head accuracy in the folder's metrics
        assert 0.0 <= meta["metrics"][f"eval/head{k}_top1"] <= meta["metrics"][f"eval/head{k}_top5"] <= 1.0


@pytest.mark.parametrize("tree", ["learned", "chain"])
def test_medusa1_folder_decodes_like_the_target(medusa_root, medusa1_runs, tree):
    from drafttrain.targets import load_target

    target, _, _ = load_target(str(medusa_root / "target"), dtype="float32")
    greedy_equal(target, medusa1_runs[1] / "drafter", **({"gamma": 3} if tree == "chain" else {}))


def test_medusa2_two_steps_change_heads_and_adapter_only(make_cfg, medusa_root, medusa2_runs):
    lr0, run = medusa2_runs
    before, after = heads_weights(lr0), heads_weights(run)
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())
    a0 = load_file(str(lr0 / "drafter" / "adapter" / "adapter_model.safetensors"))
    a1 = load_file(str(run / "drafter" / "adapter" / "adapter_model.safetensors"))
    assert a0.keys() == a1.keys() and all("lora_" in k for k in a1)
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)  # the joint step moved the adapter
    assert fixed_batch_loss(make_cfg, medusa_root, run, "medusa2") < fixed_batch_loss(make_cfg, medusa_root, lr0, "medusa2")


def test_medusa2_folder_needs_and_decodes_with_the_adapted_target(medusa_root, medusa2_runs):
    from drafttrain.models.medusa import load_medusa_target
    from drafttrain.targets import load_target

    folder = medusa2_runs[1] / "drafter"
    target, _, _ = load_target(str(medusa_root / "target"), dtype="float32")
    with pytest.raises(ValueError, match="adapted target"):
        load_proposer(str(folder), target)
    greedy_equal(load_medusa_target(folder, target), folder)
    merged, _, _ = load_target(str(folder / "merged_target"), dtype="float32")
    greedy_equal(merged, folder, gamma=2)


def _joint_steps(medusa_cfg, root: Path, tmp: Path, kl_weight: float, steps: int = 10):
    """Medusa-2 joint steps in-process; returns (peft target, base state before, held-out batch)."""
    from accelerate import Accelerator

    from drafttrain.data import build_datasets, collate
    from drafttrain.targets import load_target
    from drafttrain.trainer import build_drafter, loss_step, param_groups, wrap_target_for_method

    cfg = medusa_cfg(root, tmp, "method=medusa2", "medusa.warmup_steps=0", f"medusa.kl_weight={kl_weight}",
                     "train.lr=1e-3")
    torch.manual_seed(0)
    target, tok, _ = load_target(cfg.target, dtype="float32")
    base_before = {k: v.clone() for k, v in target.state_dict().items()}
    train_ds, held_ds, _ = build_datasets(cfg.data, tok)
    target = wrap_target_for_method(cfg, target, Accelerator(cpu=True))
    heads, _ = build_drafter(cfg, target, train_ds, Accelerator(cpu=True))
    opt = torch.optim.AdamW(param_groups(cfg, heads, target))  # adapter 1e-3, heads 4e-3
    batch = collate([train_ds[i] for i in range(8)], tok.pad_token_id)
    for step in range(steps):
        loss, _ = loss_step(cfg, heads, target, batch, {}, step=step)
        loss.backward()
        opt.step()
        opt.zero_grad()
    held = collate([held_ds[i] for i in range(len(held_ds))], tok.pad_token_id)
    return target, base_before, held


def _heldout_kl(target, held) -> float:
    from drafttrain.features import FeatureSpec, target_features
    from drafttrain.losses import kl_to_original

    spec = FeatureSpec([])
    with torch.no_grad():
        adapted = target_features(target, held["input_ids"], held["attention_mask"], spec)["final"]
        with target.disable_adapter():
            original = target_features(target, held["input_ids"], held["attention_mask"], spec)["final"]
        return float(kl_to_original(target, adapted, original, held["attention_mask"].bool()))


def test_medusa2_kl_term_keeps_the_adapted_target_close(make_cfg, medusa_root, tmp_path):
    """Bound: mean KL(original || adapted) < 0.05 nats per held-out token after 10 joint steps
    (kl_weight 10). By Pinsker, TV <= sqrt(KL / 2) = 0.16, so at most 16% of the probability mass
    moves per token; the same steps without the KL term drift to ~0.17 nats (6x further), which
    the second assertion pins: the term, not the short run, is what keeps the target close. The
    tiny random target (init 0.2) is far more sensitive to LoRA than a trained one."""
    kept, base_before, held = _joint_steps(make_cfg, medusa_root, tmp_path / "kl", kl_weight=10.0)
    free, _, _ = _joint_steps(make_cfg, medusa_root, tmp_path / "nokl", kl_weight=0.0)
    kl_kept, kl_free = _heldout_kl(kept, held), _heldout_kl(free, held)
    assert kl_kept < 0.05, kl_kept
    assert kl_kept < kl_free / 3, (kl_kept, kl_free)
    # only the adapter trained: every base weight is bit-identical
    base_after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                  for k, v in kept.state_dict().items() if "lora_" not in k}
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)
