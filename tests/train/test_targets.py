"""Target loading: folders, dtype choice, clear errors for what cannot be loaded, GGUF guard."""

from __future__ import annotations

import pytest
import torch

from drafttrain.targets import TargetError, _forbid_casts, load_target, resolve_dtype, resolve_target_path
from drafttrain.testing import FAMILIES, tiny_target, tiny_tokenizer


@pytest.mark.parametrize("fam", FAMILIES)
def test_every_tiny_family_loads_from_a_folder(fam, tmp_path):
    tok = tiny_tokenizer(False)
    tiny_target(fam, vocab_size=len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok2, info = load_target(str(tmp_path), dtype="float32")
    assert info.source == "folder" and len(info.revision) == 64
    assert not any(p.requires_grad for p in model.parameters())
    assert tok2.encode("hi") and len(tok2) >= len(tok)  # qwen2 maps to its own class, which may add a token


def test_dtype_choice():
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto") in (torch.bfloat16, torch.float32)
    with pytest.raises(TargetError, match="dtype"):
        resolve_dtype("int3")


def test_missing_paths_are_clear(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target_path("./no/such/folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="config.json"):
        resolve_target_path(str(tmp_path / "empty"))


def test_offline_hub_id_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TargetError) as e:
        load_target("nobody/nothing-1b")
    msg = str(e.value)
    assert "nobody/nothing-1b" in msg and "offline" in msg and "\n" not in msg


def test_quantized_gguf_model_refuses_casts():
    m = tiny_target("llama")
    _forbid_casts(m)
    with pytest.raises(TargetError, match="quantized"):
        m.to(torch.bfloat16)
    with pytest.raises(TargetError):
        m.half()
    m.to("cpu")  # device moves are fine


@pytest.mark.slow
def test_packaged_gemma_alias_loads_and_generates():
    model, tok, info = load_target("gemma-3-270m", dtype="float32")
    assert info.source == "alias" and model.config.num_hidden_layers == 18
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    # a broken conversion (wrong dequantisation, untied head, unscaled embeddings) writes garbage
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" a + b")
