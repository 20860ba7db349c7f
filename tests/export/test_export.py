"""Export of tiny trained drafters: each format round-trips, engine aux numbering, card, Hub, W&B, pickles."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafttrain.cli import main
from drafttrain.export import ExportError
from drafttrain.export.command import export_drafter
from drafttrain.export.formats import sglang_aux_layer_ids, vllm_aux_layer_ids
from drafttrain.export.security import scrub_obj, scrub_text

from .conftest import write_results

# What the engines' loaders read (vllm llama_eagle3.py / sglang llama_eagle3.py): no embedding.
EAGLE3_ENGINE_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


def drafter_of(run: Path) -> Path:
    return run / "drafter"


@pytest.mark.parametrize("fmt", ["hf", "vllm", "sglang"])
def test_eagle3_export_round_trips(eagle3_run, tmp_path, fmt):
    src = load_file(str(drafter_of(eagle3_run) / "model.safetensors"))
    summary = export_drafter(drafter_of(eagle3_run), fmt, tmp_path / fmt)
    got = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert sorted(p.name for p in (tmp_path / fmt).iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert set(got) == (set(src) if fmt == "hf" else EAGLE3_ENGINE_KEYS)
    assert summary["tensors"] == len(got) and summary["omitted"] == {}
    for k in got:
        assert torch.equal(got[k], src[k]) and got[k].dtype == src[k].dtype, k
    cfg = json.loads((tmp_path / fmt / "config.json").read_text())
    if fmt == "vllm":
        assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False
        assert cfg["speculators_config"]["verifier"]["name_or_path"].endswith("llama-target")
        assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 120
    if fmt == "sglang":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 120
        assert cfg["vocab_size"] == 263 and cfg["tie_word_embeddings"] is False
    if fmt == "hf":
        assert cfg["drafttrain"]["format"] == 1 and cfg["aux_layer_ids"] == [2, 4, 5]


def test_the_check_catches_a_broken_export(eagle3_run, tmp_path):
    """verify_export fails on an extra tensor (SGLang would skip it silently) and a wrong aux id."""
    from drafttrain.export.formats import plan_export, read_source, verify_export

    meta, sd = read_source(drafter_of(eagle3_run))
    plan = plan_export(meta, sd, "sglang")
    export_drafter(drafter_of(eagle3_run), "sglang", tmp_path / "s")
    path = tmp_path / "s" / "model.safetensors"
    got = load_file(str(path))
    save_file({**got, "embed_tokens.weight": torch.zeros(263, 64)}, str(path))
    with pytest.raises(ExportError, match="unknown keys"):
        verify_export(tmp_path / "s", plan, set(sd))
    save_file(got, str(path))
    cfg_path = tmp_path / "s" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # our numbering: off by one
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="eagle_aux_hidden_state_layer_ids"):
        verify_export(tmp_path / "s", plan, set(sd))
    with pytest.raises(ExportError, match="neither mapped nor listed"):
        verify_export(tmp_path / "s", plan, set(sd) | {"embed_tokens.weight"})


def test_aux_layer_numbering_matches_native(eagle3_run, tmp_path):
    """Our ids are HF hidden_states indices; vLLM uses the same numbers, SGLang one less.

    Checked twice: the numbers written for the default 8-layer drafter, and what each engine's rule
    (vLLM: capture the stream entering layer id; SGLang: entering layer id + 1) picks on the real
    target, against HF hidden_states at our ids.
    """
    from transformers import AutoModelForCausalLM

    export_drafter(drafter_of(eagle3_run), "vllm", tmp_path / "v")
    export_drafter(drafter_of(eagle3_run), "sglang", tmp_path / "s")
    v = json.loads((tmp_path / "v" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    s = json.loads((tmp_path / "s" / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert (v, s) == ([2, 4, 5], [1, 3, 4])

    target = AutoModelForCausalLM.from_pretrained(eagle3_run.parent / "llama-target", dtype=torch.float32)
    entering: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(target.model.layers):
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: entering.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True)
    with torch.no_grad():
        hs = target(torch.tensor([[1, 40, 41, 42, 43, 44]]), output_hidden_states=True).hidden_states
    for ours, vid, sid in zip([2, 4, 5], v, s):
        assert torch.equal(entering[vid], hs[ours])  # vLLM: layer idx in aux layers -> its input
        assert torch.equal(entering[sid + 1], hs[ours])  # SGLang: layers_to_capture = id + 1
    with pytest.raises(ExportError, match="vLLM"):
        vllm_aux_layer_ids([8], 8)  # HF index N is the post-norm output: no engine captures it
    with pytest.raises(ExportError, match="SGLang"):
        sglang_aux_layer_ids([0], 8)


def test_eagle1_vllm_export_folds_embed_scale_and_refuses_a_bias(eagle1_run, tmp_path):
    # Our EAGLE-1 fc has no bias (as vLLM's); the embedding half of fc absorbs Gemma's sqrt(H).
    src_dir = drafter_of(eagle1_run)
    sd = load_file(str(src_dir / "model.safetensors"))
    assert "fc.bias" not in sd
    summary = export_drafter(src_dir, "vllm", tmp_path / "v")
    assert set(summary["omitted"]) == {"d2t", "t2d"}
    got = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in got and not any(k.startswith("midlayer") for k in got)
    assert torch.equal(got["layers.0.mlp.down_proj.weight"], sd["midlayer.mlp.down_proj.weight"])
    emb, feat = torch.randn(3, 64), torch.randn(3, 64)
    scale = 64 ** 0.5
    ours = torch.cat([emb * scale, feat], -1) @ sd["fc.weight"].T
    engine = torch.cat([emb, feat], -1) @ got["fc.weight"].T
    torch.testing.assert_close(engine, ours, rtol=1e-5, atol=1e-5)
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    # A drafter carrying a non-zero fc.bias (older format) is refused, nothing half-written.
    biased = tmp_path / "biased"
    shutil.copytree(src_dir, biased)
    sd["fc.bias"] = torch.full((64,), 0.1)
    save_file(sd, str(biased / "model.safetensors"))
    with pytest.raises(ExportError, match="fc.bias"):
        export_drafter(biased, "vllm", tmp_path / "v2")
    assert not (tmp_path / "v2").exists()


def test_card_carries_the_eval_numbers(eagle3_run, tmp_path):
    res = write_results(tmp_path / "results.json", tau=2.71, speedup=1.83)
    export_drafter(drafter_of(eagle3_run), "vllm", tmp_path / "v", results=res, repo_id="me/tiny-eagle3",
                   verifier="me/tiny-llama")
    card = (tmp_path / "v" / "README.md").read_text()
    assert "| eagle3 | mtbench | 0.0 | 2.71 | 1.83× |" in card
    assert "test-cpu" in card and "max_new_tokens=64" in card
    assert "vllm serve me/tiny-eagle3" in card
    assert "[2, 4, 5]" in card and "in vLLM's numbering: [2, 4, 5]" in card
    assert "draft vocab size: 120" in card


def test_card_front_matter_is_what_the_hub_parses(eagle3_run, tmp_path):
    """license from the target folder's own card, base_model as a Hub id, pipeline_tag, tags."""
    from huggingface_hub import ModelCard

    target = tmp_path / "target"
    target.mkdir()
    (target / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a target\n")
    drafter = tmp_path / "drafter"
    shutil.copytree(drafter_of(eagle3_run), drafter)
    meta = json.loads((drafter / "config.json").read_text())
    meta["target"]["spec"] = str(target)
    (drafter / "config.json").write_text(json.dumps(meta))
    export_drafter(drafter, "vllm", tmp_path / "v", repo_id="me/tiny-eagle3", verifier="org/llama-base")
    data = ModelCard.load(tmp_path / "v" / "README.md").data
    assert data.license == "apache-2.0" and data.base_model == "org/llama-base"
    assert data.pipeline_tag == "text-generation" and data.library_name == "drafttrain"
    assert {"speculative-decoding", "eagle3", "vllm"} <= set(data.tags)


def test_push_of_a_local_target_without_its_hub_id_is_refused(eagle3_run, tmp_path, capsys):
    out = tmp_path / "up"
    rc = main(["export", str(drafter_of(eagle3_run)), "--format", "vllm", "--out", str(out),
               "--push-to-hub", "me/tiny-eagle3", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and not out.exists()
    assert len(err) == 1 and "base_model" in err[0] and "--verifier ORG/NAME" in err[0]


@pytest.mark.parametrize("fmt, shown, hidden", [
    ("vllm", "vllm serve", "sglang.launch_server"),
    ("sglang", "sglang.launch_server", "vllm serve"),
    ("hf", "drafttrain eval", "vllm serve"),
])
def test_each_card_shows_only_its_own_engine(eagle3_run, tmp_path, fmt, shown, hidden):
    export_drafter(drafter_of(eagle3_run), fmt, tmp_path / fmt)
    card = (tmp_path / fmt / "README.md").read_text()
    assert shown in card and hidden not in card
    if fmt == "hf":
        assert "sglang.launch_server" not in card


def test_cards_give_no_serve_command_an_engine_refuses():
    """vLLM 0.32 refuses EAGLE-3 for Gemma 3 targets and reduced-vocabulary Medusa heads: those
    cards say so instead of printing a command that fails (tests/engines shows both refusals)."""
    from drafttrain.export.card import render_card

    gemma = {"method": "eagle3", "target": {"spec": "gemma-3-270m", "model_type": "gemma3_text", "vocab_size": 262144},
             "draft_vocab_size": 8192, "aux_layer_ids": [2, 9, 15]}
    card = render_card(gemma, fmt="vllm", model_ref="out")
    assert "vllm serve" not in card and "refuses EAGLE-3" in card
    assert "base_model: google/gemma-3-270m" in card and "license: gemma" in card
    sglang = render_card(gemma, fmt="sglang", model_ref="out")
    assert "sglang.launch_server" not in sglang and "MLP branch" in sglang
    llama = {**gemma, "target": {**gemma["target"], "spec": "org/llama", "model_type": "llama"}}
    assert "vllm serve out" in render_card(llama, fmt="vllm", model_ref="out")
    medusa = {"method": "medusa1", "target": {"spec": "org/llama", "model_type": "llama", "vocab_size": 1000},
              "drafter": {"num_heads": 3}}
    assert "vllm serve org/llama" in render_card({**medusa, "draft_vocab_size": 1000}, fmt="vllm", model_ref="out")
    reduced = render_card({**medusa, "draft_vocab_size": 100}, fmt="vllm", model_ref="out")
    assert "vllm serve" not in reduced and "reduced vocabulary" in reduced


def _fake_hub(monkeypatch) -> list:
    from huggingface_hub import HfApi

    calls: list = []

    def upload_folder(self, *, folder_path, repo_id, **kw):
        files = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        calls.append(("upload_folder", repo_id, kw, files))
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create_repo", repo_id, kw)))
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo_id, **kw: calls.append(("create_branch", repo_id, kw)))
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_push_to_hub_sends_exactly_the_export(eagle3_run, tmp_path, monkeypatch, capsys):
    token = "hf_" + "A1b2C3d4" * 4
    monkeypatch.setenv("HF_TOKEN", token)
    calls = _fake_hub(monkeypatch)
    res = write_results(tmp_path / "results.json")
    out = tmp_path / "up"
    base = ["export", str(drafter_of(eagle3_run)), "--format", "vllm", "--out", str(out),
            "--push-to-hub", "me/tiny-eagle3", "--results", str(res), "--verifier", "me/tiny-llama"]

    assert main([*base, "--dry-run"]) == 0
    assert calls == [] and "dry run" in capsys.readouterr().out
    dry = {p.name: p.read_bytes() for p in out.iterdir()}

    assert main([*base, "--private", "--revision", "v1"]) == 0
    assert [c[0] for c in calls] == ["create_repo", "create_branch", "upload_folder"]
    assert calls[0][2]["private"] is True and calls[1][2]["branch"] == "v1"
    _, repo, kw, sent = calls[2]
    assert repo == "me/tiny-eagle3" and kw["revision"] == "v1"
    assert sent == dry  # the dry run wrote exactly what is uploaded
    assert set(sent) == {"README.md", "config.json", "model.safetensors"}
    card = sent["README.md"].decode()
    assert "| 2.71 | 1.83× |" in card and "vllm serve me/tiny-eagle3" in card
    assert all(token.encode() not in b for b in sent.values())


def test_push_without_token_or_network_is_one_line_and_uploads_nothing(eagle3_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub import HfApi

    calls = _fake_hub(monkeypatch)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    args = ["export", str(drafter_of(eagle3_run)), "--format", "sglang", "--out", str(tmp_path / "o"),
            "--push-to-hub", "me/x", "--verifier", "me/tiny-llama"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Hugging Face token" in err[0] and calls == []

    token = "hf_" + "Z9y8X7w6" * 4
    monkeypatch.setenv("HF_TOKEN", token)

    def offline(self, **kw):
        raise ConnectionError(f"cannot reach huggingface.co with {token}")

    monkeypatch.setattr(HfApi, "upload_folder", offline)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing was uploaded" in err[0] and token not in err[0]


def _wandb_records(run_file: Path):
    """Records of a W&B offline run file (LevelDB-style log of protobuf `Record`s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf = run_file.read_bytes(), 32768, 7, b""  # 7-byte ':W&B' file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        buf = data[pos:pos + length] if kind in (1, 2) else buf + data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def test_wandb_offline_run_has_metrics_config_and_drafter_artifact(eagle3_run):
    run_files = list((eagle3_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    metrics, artifacts, config = {}, [], {}
    for rec in _wandb_records(run_files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            metrics.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "artifact":
            artifacts.append(rec.artifact)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    assert {"train/loss", "train/lr", "train/tau_sim", "eval/tau_sim"} <= set(metrics)
    assert metrics["_step"] == 2
    assert config["method"] == "eagle3" and config["train"]["max_steps"] == 2  # the resolved config
    (art,) = artifacts
    assert art.name == "run-eagle3-drafter" and art.type == "model"
    assert {e.path for e in art.manifest.contents} == {"config.json", "model.safetensors", "README.md"}
    assert json.loads(art.metadata)["steps"] == 2


def test_planted_pickle_is_refused(eagle3_run, tmp_path, capsys):
    for name in ("optimizer.bin", "notes.dat"):  # by suffix, and by content under an innocent name
        src = tmp_path / name / "drafter"
        shutil.copytree(drafter_of(eagle3_run), src)
        (src / name).write_bytes(pickle.dumps({"x": 1}, protocol=4))
        assert main(["export", str(src), "--format", "hf", "--out", str(tmp_path / name / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and name in err[0] and "pickle" in err[0]
        assert not (tmp_path / name / "out").exists()


def test_user_errors_are_one_line(eagle1_run, eagle3_run, tmp_path, capsys):
    cases = [
        (["export", str(drafter_of(eagle3_run)), "--format", "onnx", "--out", str(tmp_path / "a")], "invalid choice"),
        (["export", str(drafter_of(eagle1_run)), "--format", "sglang", "--out", str(tmp_path / "b")], "EAGLE-3 only"),
        (["export", str(tmp_path / "nope"), "--format", "hf", "--out", str(tmp_path / "c")], "does not exist"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert main(["export", "--help"]) == 0 and "--push-to-hub" in capsys.readouterr().out


def test_secrets_are_scrubbed():
    obj = {"hf_token": "abc123", "wandb": {"api_key": "0123456789abcdef"}, "tokenizer_hash": "keep",
           "train_tokens": 5, "pad_token": "<pad>", "note": "push with hf_" + "q" * 30 + " now"}
    out = scrub_obj(obj)
    assert out["hf_token"] == "***" and out["wandb"]["api_key"] == "***"
    assert out["tokenizer_hash"] == "keep" and out["train_tokens"] == 5 and out["pad_token"] == "<pad>"
    assert "q" * 30 not in out["note"]
    assert scrub_text("WANDB_API_KEY=deadbeef1234 done") == "WANDB_API_KEY=*** done"
