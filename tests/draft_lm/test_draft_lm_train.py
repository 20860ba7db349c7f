"""Draft-LM training end to end on a tiny Llama target (hidden 64, 4 layers, vocab 263; real
Gemma 3 270M: 640 / 18 / 262144): two steps change the student and lower the loss, the folder is
a plain HF model that drives transformers' assisted generation and our decoder to the target's
own greedy output, it exports as a plain HF causal LM, and user mistakes end in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafttrain.cli import main
from drafttrain.models.draft_lm import DraftLM, DraftLMConfig, DraftLMError, build_student, check_tokenizer
from drafttrain.testing import tiny_target, tiny_tokenizer


def error_lines(capsys) -> list[str]:
    """The CLI's error lines (stderr also carries progress bars); never a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [ln for ln in err.splitlines() if ln.startswith("drafttrain: error:")]


def fixed_batch_loss(cfg, run: Path) -> float:
    """Divergence of the saved student on the first 4 training records (no on-policy: step None)."""
    from drafttrain.data import build_datasets, collate
    from drafttrain.features import FeatureSpec, target_features
    from drafttrain.targets import load_target
    from drafttrain.trainer import loss_step

    target, tok, _ = load_target(cfg.target, dtype="float32")
    train_ds, _, _ = build_datasets(cfg.data, tok)
    student = DraftLM(AutoModelForCausalLM.from_pretrained(run / "drafter"), DraftLMConfig())
    batch = collate([train_ds[i] for i in range(4)], tok.pad_token_id)
    feats = target_features(target, batch["input_ids"], batch["attention_mask"], FeatureSpec([]))
    with torch.no_grad():
        loss, met = loss_step(cfg, student, target, batch, feats)
    assert met["count"][0] > 0
    return float(loss)


def test_two_steps_change_student_and_lower_loss(dl_runs, dl_root, make_cfg):
    lr0, run = dl_runs
    before, after = load_file(str(lr0 / "drafter" / "model.safetensors")), load_file(str(run / "drafter" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    cfg = make_cfg(dl_root, run, "draft_lm.teacher_topk=64")
    assert fixed_batch_loss(cfg, run) < fixed_batch_loss(cfg, lr0)


def test_student_starts_from_chosen_target_layers(dl_root):
    target = AutoModelForCausalLM.from_pretrained(dl_root / "target")
    tok = AutoTokenizer.from_pretrained(dl_root / "target")
    s = build_student(target, tok, num_layers=2, init_layers=[1, 3])
    sd, td = s.model.state_dict(), target.state_dict()
    assert s.model.config.num_hidden_layers == 2
    assert torch.equal(sd["model.layers.0.mlp.up_proj.weight"], td["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(sd["model.layers.1.self_attn.q_proj.weight"], td["model.layers.3.self_attn.q_proj.weight"])
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(sd[k], td[k])
    narrow = build_student(target, tok, num_layers=1, hidden_size=32)
    assert narrow.model.config.hidden_size == 32 and narrow.cfg.init_layers == [0]
    assert narrow(torch.tensor([[5, 6, 7]])).shape == (1, 3, 32)
    with pytest.raises(DraftLMError, match="init_layers"):
        build_student(target, tok, num_layers=2, init_layers=[0, 9])


def test_gemma_student_keeps_layer_types_and_assists():
    """Gemma quirks (sliding window of 8, logit softcap, embedding scale) survive the student build."""
    target = tiny_target("gemma3", num_layers=4)  # sliding, full, sliding, full
    s = build_student(target, None, num_layers=2)  # layers 0 and 3
    assert s.model.config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.randint(7, 257, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert target.generate(ids, assistant_model=s.model.eval(), **kw).tolist() == target.generate(ids, **kw).tolist()


def test_init_from_a_draft_lm_with_the_same_tokenizer(dl_runs, dl_root):
    target = AutoModelForCausalLM.from_pretrained(dl_root / "target")
    tok = AutoTokenizer.from_pretrained(dl_root / "target")
    s = build_student(target, tok, init_from=str(dl_runs[1] / "drafter"))
    want = load_file(str(dl_runs[1] / "drafter" / "model.safetensors"))
    assert s.cfg.num_layers == 2 and all(torch.equal(s.model.state_dict()[k], v) for k, v in want.items())


def test_tokenizer_mismatch_is_one_line(dl_root, tmp_path, make_cfg, capsys):
    other = tiny_target("llama", vocab_size=300, num_layers=1)
    other.save_pretrained(tmp_path / "other")
    tiny_tokenizer(False).save_pretrained(tmp_path / "other")
    args = [f"target={dl_root / 'target'}", f"data.path={dl_root / 'chat.json'}", f"output_dir={tmp_path / 'o'}",
            "method=draft_lm", "dtype=float32", "data.heldout=4", f"draft_lm.init_from={tmp_path / 'other'}"]
    assert main(["train", *args]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "must share the target's tokenizer" in err[0] and "300" in err[0]

    class Tok:
        def __init__(self, v):
            self.v = v

        def get_vocab(self):
            return self.v

    with pytest.raises(DraftLMError, match="2 tokens map to different ids"):
        check_tokenizer(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}), 2, 2, "x")


def test_bad_divergence_name_is_one_line(dl_root, tmp_path, capsys):
    assert main(["train", f"target={dl_root / 'target'}", "method=draft_lm", "draft_lm.divergence=kl"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "draft_lm.divergence" in err[0] and "tvd" in err[0]


def test_folder_is_plain_hf_and_drives_assisted_generation(dl_runs, dl_root):
    folder = dl_runs[1] / "drafter"
    hf_cfg = json.loads((folder / "config.json").read_text())
    assert "drafttrain" not in hf_cfg and "method" not in hf_cfg
    meta = json.loads((folder / "drafttrain.json").read_text())
    assert meta["method"] == "draft_lm" and meta["drafter"]["num_layers"] == 2 and meta["tokenizer_hash"]
    assert (folder / "README.md").is_file()
    student = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(dl_root / "target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok.encode("Question 3: tell me about topic 1.")])
    kw = dict(do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    ref = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=student, **kw)
    assert assisted.tolist() == ref.tolist()


def test_decode_vocab_is_the_most_frequent_training_tokens(dl_runs, dl_root, make_cfg):
    from drafttrain.data import build_datasets
    from drafttrain.models.draft_lm import read_decode_vocab
    from drafttrain.trainer import token_counts

    folder = dl_runs[1] / "drafter"
    ids = read_decode_vocab(folder)
    meta = json.loads((folder / "drafttrain.json").read_text())
    assert ids is not None and ids.numel() == 48 == meta["decode_vocab_size"]
    assert bool((ids[1:] > ids[:-1]).all())
    cfg = make_cfg(dl_root, dl_runs[1])
    counts = token_counts(build_datasets(cfg.data, AutoTokenizer.from_pretrained(dl_root / "target"))[0], 263)
    inside = torch.zeros(263, dtype=torch.bool)
    inside[ids] = True
    assert counts[inside].min() >= counts[~inside].max()  # nothing left out is more frequent
    assert meta["decode_vocab_coverage"] == pytest.approx(float(counts[inside].sum() / counts.sum()), abs=1e-4)
    # the HF model keeps its full head: engines and assisted generation are unaffected
    assert AutoModelForCausalLM.from_pretrained(folder).get_output_embeddings().weight.shape[0] == 263


def test_decoder_drafts_only_from_the_decode_vocab(dl_runs, dl_root):
    from drafttrain.decode import load_proposer, speculative_generate

    target = AutoModelForCausalLM.from_pretrained(dl_root / "target", dtype=torch.float32).eval()
    ids = torch.randint(7, 263, (2, 10), generator=torch.Generator().manual_seed(2))
    drafted = {}
    for mode in ("auto", None):
        proposer = load_proposer(str(dl_runs[1] / "drafter"), target, gamma=4, vocab=mode)
        trees, propose = [], proposer.propose
        proposer.propose = lambda state, _p=propose, _t=trees: _t.append(_p(state)) or _t[-1]
        speculative_generate(target, proposer, ids, max_new_tokens=40, temperature=1.0, seed=0, eos_token_id=[])
        drafted[mode] = torch.cat([t.tokens[:, 1:].flatten() for t in trees])
        probs = torch.cat([t.dense_probs(263)[:, :-1].reshape(-1, 263) for t in trees])
        if mode == "auto":  # q stays over the decode vocabulary, whose ids the tree carries
            assert all(torch.equal(t.draft_vocab, proposer.vocab) for t in trees)
        assert torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5)
        if mode == "auto":
            inside = torch.zeros(263, dtype=torch.bool)
            inside[proposer.vocab] = True
            assert bool(inside[drafted[mode]].all()) and float(probs[:, ~inside].abs().max()) == 0.0
    assert not bool(inside[drafted[None]].all())  # the full head does draft outside it


def test_our_decoder_with_the_folder(dl_runs, dl_root):
    from drafttrain.decode import load_proposer, speculative_generate
    from drafttrain.decode.proposers import DraftLMProposer

    target = AutoModelForCausalLM.from_pretrained(dl_root / "target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(dl_root / "target")
    proposer = load_proposer(str(dl_runs[1] / "drafter"), target, tokenizer=tok, gamma=3)
    assert isinstance(proposer, DraftLMProposer)
    with pytest.raises(ValueError, match="vocab 263"):  # a target with another vocabulary is refused
        load_proposer(str(dl_runs[1] / "drafter"), tiny_target("llama", vocab_size=300, num_layers=1))
    ids = torch.randint(7, 263, (2, 10), generator=torch.Generator().manual_seed(1))
    ref = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)[:, 10:]
    out = speculative_generate(target, proposer, ids, max_new_tokens=20, eos_token_id=[])
    assert out.sequences == ref.tolist()


def test_export_hf_is_a_plain_causal_lm(dl_runs, tmp_path, capsys):
    from drafttrain.export.command import export_drafter

    src = dl_runs[1] / "drafter"
    export_drafter(src, "hf", tmp_path / "hf")
    assert not (tmp_path / "hf" / "drafttrain.json").exists()
    a = AutoModelForCausalLM.from_pretrained(src).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert main(["export", str(src), "--format", "vllm", "--out", str(tmp_path / "v")]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "--format hf" in err[0]


def test_offline_features_on_policy_and_frozen_embeddings(dl_root, tmp_path, make_cfg):
    """`drafttrain prepare` caches the target's final states; training reads them, on-policy
    batches (rate 1) recompute the teacher on the student's samples, and frozen embeddings stay."""
    from drafttrain.prepare import prepare
    from drafttrain.trainer import train

    cfg = make_cfg(dl_root, tmp_path / "off", "features.mode=offline", "draft_lm.on_policy_rate=1",
                   "draft_lm.on_policy_max_new_tokens=8", "train.max_steps=1", "train.lr=1e-2",
                   "draft_lm.freeze_embeddings=true")
    prepare(cfg)
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    assert train(cfg)["steps"] == 1
    sd, td = load_file(str(tmp_path / "off" / "drafter" / "model.safetensors")), load_file(
        str(dl_root / "target" / "model.safetensors"))
    assert torch.equal(sd["lm_head.weight"], td["lm_head.weight"])
    assert torch.equal(sd["model.embed_tokens.weight"], td["model.embed_tokens.weight"])
    assert not torch.equal(sd["model.layers.0.mlp.up_proj.weight"], td["model.layers.0.mlp.up_proj.weight"])
