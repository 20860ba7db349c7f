"""EAGLE-3's per-dimension feature scale: what it measures, and that saving folds it into fc."""

from __future__ import annotations

import torch

from drafttrain.drafter_io import save_module_weights
from drafttrain.features import FeatureSpec, feature_scale, target_features
from drafttrain.models.eagle import EagleDrafter, config_from_target
from drafttrain.testing import tiny_target


def _records(n: int, length: int = 12, vocab: int = 257) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist()} for _ in range(n)]


def test_scale_brings_a_massive_dimension_to_unit_rms_and_the_rest_to_the_median():
    target = tiny_target("llama", num_layers=4)
    spec = FeatureSpec([1, 2, 3], concat_aux=True)
    with torch.no_grad():  # plant a massive activation: dimension 5 of layer 2's output
        target.model.layers[1].mlp.down_proj.weight[5] += 400.0
    recs = _records(6)
    scale = feature_scale(target, recs, spec, num_records=6)
    aux = torch.cat([target_features(target, torch.tensor(r["input_ids"])[None], None, spec)["aux"][0] for r in recs])
    rms = aux.float().pow(2).mean(0).sqrt()
    scaled = (aux.float() * scale).pow(2).mean(0).sqrt().view(3, -1)
    H = target.config.hidden_size
    assert rms[H + 5] > 20 * rms[H:2 * H].median()  # the plant took
    torch.testing.assert_close(scaled[1, 5], torch.tensor(1.0), rtol=1e-4, atol=1e-4)
    assert bool((scaled <= 1 + 1e-4).all())
    for b in range(3):  # half of every block sits at or above its median, now exactly 1
        assert int((scaled[b] > 1 - 1e-4).sum()) >= H // 2


def test_saved_drafter_folds_the_scale_into_fc_and_computes_the_same():
    target = tiny_target("gemma3", num_layers=4)
    cfg = config_from_target(target.config, draft_vocab_size=64)
    drafter = EagleDrafter(cfg).attach_target(target)
    scale = torch.rand(cfg.num_aux * cfg.hidden_size) * 3 + 0.01
    drafter.set_feature_scale(scale)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    aux = torch.randn(2, 7, cfg.num_aux * cfg.hidden_size) * 50
    with torch.no_grad():
        want, _ = drafter(ids, drafter.fuse(aux))
    sd = drafter.folded_state_dict()
    assert "aux_scale" not in sd and "aux_scale" not in drafter.state_dict()
    plain = EagleDrafter(cfg).attach_target(target)
    plain.load_state_dict(sd)
    with torch.no_grad():
        got, _ = plain(ids, plain.fuse(aux))
        unscaled, _ = plain(ids, plain.fc(aux))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(unscaled, want, rtol=1e-4, atol=1e-4)  # engines apply fc to the raw features
    assert not torch.allclose(drafter.fc.weight, sd["fc.weight"])


def test_save_module_weights_writes_the_folded_fc(tmp_path):
    from safetensors.torch import load_file

    target = tiny_target("llama", num_layers=4)
    drafter = EagleDrafter(config_from_target(target.config)).attach_target(target)
    scale = torch.full_like(drafter.aux_scale, 0.5)
    drafter.set_feature_scale(scale)
    saved = load_file(str(save_module_weights(drafter, tmp_path)))
    torch.testing.assert_close(saved["fc.weight"], drafter.fc.weight.detach() * 0.5)
