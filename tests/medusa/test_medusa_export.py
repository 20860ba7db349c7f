"""`drafttrain export --format vllm` for Medusa heads: vLLM `MedusaModel` layout, loaded back and
run the way vLLM runs it (x <- x + SiLU(W x + b) per layer, lm_heads, token_map scatter)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from drafttrain.cli import main


def vllm_medusa_logits(config: dict, sd: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """vLLM MedusaModel's forward + compute_logits, re-stated: [N, H] -> [K, N, V] (-inf outside token_map)."""
    out = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, sd[f"blocks.{i}.layers.{j}.weight"], sd.get(f"blocks.{i}.layers.{j}.bias")))
        logits = x @ sd[f"lm_heads.{i}.weight"].t()  # [N, truncated_vocab]
        if "token_map" in sd:
            full = torch.full((hidden.shape[0], config["vocab_size"]), -torch.inf)
            full[:, sd["token_map"]] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


def test_vllm_medusa_export_round_trips(medusa1_runs, tmp_path, capsys):
    from drafttrain.models.medusa import load_medusa

    drafter = medusa1_runs[1] / "drafter"
    out = tmp_path / "vllm"
    assert main(["export", str(drafter), "--format", "vllm", "--out", str(out)]) == 0
    assert "medusa1" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["truncated_vocab_size"]) == (3, 1, 120)
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == {f"blocks.{i}.layers.0.{w}" for i in range(3) for w in ("weight", "bias")} | {
        f"lm_heads.{i}.weight" for i in range(3)} | {"token_map"}
    heads = load_medusa(drafter)
    hidden = torch.randn(16, 64)
    ours = heads(hidden)  # [K, N, Vd]
    ours_ids = heads.draft_ids[ours.argmax(-1)]  # target ids
    theirs = vllm_medusa_logits(config, sd, hidden)
    assert torch.equal(theirs.argmax(-1), ours_ids)
    top2 = ours.detach().topk(2, -1).values  # two computations agree on argmax only away from near-ties:
    assert bool((top2[..., 0] - top2[..., 1] > 1e-4).all())  # these data keep clear of them
    torch.testing.assert_close(theirs.gather(-1, ours_ids[..., None])[..., 0], ours.max(-1).values)


def test_medusa_export_refusals_are_one_line(medusa1_runs, medusa2_runs, tmp_path, capsys):
    assert main(["export", str(medusa1_runs[1] / "drafter"), "--format", "sglang", "--out", str(tmp_path / "s")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "SGLang has no Medusa" in err
    # Medusa-2 heads export for vLLM (the adapted target is served as the model) ...
    assert main(["export", str(medusa2_runs[1] / "drafter"), "--format", "vllm", "--out", str(tmp_path / "v")]) == 0
    assert "merged_target" in capsys.readouterr().out
    # ... but its hf format is the folder itself
    assert main(["export", str(medusa2_runs[1] / "drafter"), "--format", "hf", "--out", str(tmp_path / "h")]) != 0
    assert "already the hf format" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["hf"])
def test_medusa1_hf_export_loads_back(medusa1_runs, tmp_path, fmt):
    from drafttrain.export.command import export_drafter
    from drafttrain.models.medusa import load_medusa

    summary = export_drafter(medusa1_runs[1] / "drafter", fmt, tmp_path / fmt)
    assert summary["method"] == "medusa1"
    src, back = load_medusa(medusa1_runs[1] / "drafter"), load_medusa(tmp_path / fmt)
    hidden = torch.randn(5, 64)
    assert torch.equal(back(hidden), src(hidden))  # the same heads: same logits, bit for bit
    assert torch.equal(back.draft_ids, src.draft_ids)
    assert summary["tensors"] == len(back.state_dict())
