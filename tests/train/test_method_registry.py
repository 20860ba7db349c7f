"""A new drafter method is one module plus a registry entry: nothing else in drafttrain changes.

The toy method below (written to a module file by the test, found through `registry.BUILTIN` like
a built-in) is a token bigram drafter: a [V, V] table of logits for the next token given the
current one, trained towards the target's next-token distribution; its proposer drafts a greedy
chain through the table. It trains through the real loop, saves a drafter folder, loads back as a
proposer through `load_proposer` and decodes losslessly (greedy output equals the target's own).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from drafttrain.config import parse_args
from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.methods import registry
from drafttrain.schema import TrainConfig
from drafttrain.trainer import train

TOY = '''
"""Toy bigram drafter (test only)."""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from drafttrain.decode.proposers.base import Proposer
from drafttrain.decode.tree import chain_tree
from drafttrain.methods.base import DrafterMethod
from drafttrain.methods.registry import register


@dataclass
class BigramConfig:
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list = field(default_factory=list)


class Bigram(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.table = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.vocab_size))

    def forward(self, ids):
        return self.table[ids]


class BigramProposer(Proposer):
    def __init__(self, model, gamma=3):
        self.model, self.default_gamma, self.calls = model, gamma, 0

    def propose(self, state):
        self.calls += 1
        tok, drafts = state.root, []
        for _ in range(state.gamma or self.default_gamma):
            tok = self.model(tok).argmax(-1)
            drafts.append(tok)
        return chain_tree(state.root, torch.stack(drafts, 1))


class Toy(DrafterMethod):
    name = "toy"

    def build(self, cfg, target, train_ds, device):
        V = target.get_output_embeddings().weight.shape[0]
        return Bigram(BigramConfig(V, V)).to(device), 1.0

    def loss(self, cfg, drafter, target, batch, feats, step):
        teacher = torch.softmax(target.get_output_embeddings()(feats["final"]).float(), -1)  # [B, T, V]
        logp = F.log_softmax(drafter(batch["input_ids"]).float(), -1)
        valid = batch["attention_mask"].bool() & batch["loss_mask"].roll(-1, 1).bool()
        ce = -(teacher * logp).sum(-1)
        n = valid.sum().clamp(min=1)
        loss = (ce * valid).sum() / n
        agree = (logp.argmax(-1) == teacher.argmax(-1)) & valid
        return loss, {"loss": float(loss.detach()), "correct": [int(agree.sum())], "count": [int(valid.sum())],
                      "run_len_sum": int(agree.sum()), "run_len_n": int(valid.sum())}

    def load_proposer(self, folder, target, *, tokenizer=None, **options):
        import json
        cfg = BigramConfig(**json.loads((folder / "config.json").read_text())["drafter"])
        model = Bigram(cfg)
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
        return BigramProposer(model.eval(), **options)


register(Toy())
'''


@pytest.fixture
def toy_method(tmp_path, monkeypatch):
    """The toy module on sys.path and in the registry's table of built-in modules."""
    (tmp_path / "toy_method.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.BUILTIN, "toy", "toy_method")
    yield "toy"
    registry._METHODS.pop("toy", None)
    sys.modules.pop("toy_method", None)


def test_a_new_method_trains_saves_loads_and_decodes_losslessly(toy_method, target_dirs, chat_file, tmp_path):
    from drafttrain.targets import load_target

    run = tmp_path / "run"
    summary = train(parse_args([f"target={target_dirs['llama']}", f"data.path={chat_file}", f"output_dir={run}",
                                "method=toy", "dtype=float32", "train.mixed_precision=no", "data.heldout=4",
                                "data.max_len=96", "train.max_steps=2", "train.lr=0.5", "train.warmup_steps=0",
                                "train.decode_eval_final=false"], TrainConfig))
    assert summary["steps"] == 2 and summary["method"] == "toy"
    folder = Path(summary["drafter_dir"])
    meta = json.loads((folder / "config.json").read_text())
    assert meta["method"] == "toy" and registry.folder_method(folder) == "toy"
    from safetensors.torch import load_file

    assert float(load_file(str(folder / "model.safetensors"))["table"].abs().sum()) > 0  # it trained

    target, _, _ = load_target(str(target_dirs["llama"]), dtype="float32")
    proposer = load_proposer(str(folder), target)
    assert type(proposer).__name__ == "BigramProposer"
    ids = torch.tensor([[5, 9, 3, 12, 7, 5, 9, 3]])
    out = speculative_generate(target, proposer, ids, max_new_tokens=16, eos_token_id=[])
    want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                           eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert out.sequences[0] == want  # lossless: the target's own greedy output
    assert proposer.calls > 0 and out.stats.target_forwards <= 16  # it drafted at every step


def test_an_unknown_method_is_one_line_with_the_closest_name():
    with pytest.raises(registry.UnknownMethodError, match="did you mean 'eagle3'"):
        registry.get_method("eagle4")
    from drafttrain.config import ConfigError

    with pytest.raises(ConfigError, match="method='eagle4' is not allowed"):
        parse_args(["method=eagle4"], TrainConfig)
