"""End-of-sequence ids: one rule (`drafttrain.eos.eos_ids`) for the decoder, the evaluator and sampling.

Models are stand-ins (SimpleNamespace) carrying only the fields the rule reads, plus a real
transformers Gemma3Config (a multimodal config whose ids live under text_config) and a tiny llama
(hidden 64, 4 layers, vocab 257; Gemma 3 270M: 640 / 18 / 262144) to show the decoder stopping.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma3Config

from drafttrain.decode import speculative_generate
from drafttrain.decode.engine import _eos_set
from drafttrain.eos import eos_ids
from drafttrain.eval.runner import eos_ids as runner_eos_ids
from drafttrain.rollouts import eos_ids as rollouts_eos_ids
from drafttrain.testing import tiny_config, tiny_target


def model(eos=None, generation=None, text_eos=None, *, has_generation_config=True):
    config = SimpleNamespace(eos_token_id=eos)
    if text_eos is not None:
        config.text_config = SimpleNamespace(eos_token_id=text_eos)
    m = SimpleNamespace(config=config)
    if has_generation_config:
        m.generation_config = SimpleNamespace(eos_token_id=generation)
    return m


def test_tokenizer_only():
    tok = SimpleNamespace(eos_token_id=7)
    assert eos_ids(None, tok) == [7]
    assert eos_ids(model(has_generation_config=False), tok) == [7]


def test_config_only():
    assert eos_ids(model(eos=2, has_generation_config=False)) == [2]
    assert eos_ids(model(eos=2, generation=None)) == [2]


def test_gemma_style_text_config():
    assert eos_ids(model(text_eos=1, has_generation_config=False)) == [1]
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    config = Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision)
    assert getattr(config, "eos_token_id", None) is None  # the ids live under text_config only
    assert eos_ids(SimpleNamespace(config=config)) == [2]


def test_generation_config_joins_config_and_tokenizer():
    # Gemma 3: generation config <eos> and <end_of_turn>, config <eos>; a tokenizer may name another.
    m = model(eos=1, generation=[1, 106])
    assert eos_ids(m) == [1, 106]
    assert eos_ids(m, SimpleNamespace(eos_token_id=50)) == [1, 50, 106]


@pytest.mark.parametrize("value", [[5, 3], (3, 5), {3, 5}, torch.tensor([5, 3]), [5, 3, 5]])
def test_list_valued_ids(value):
    assert eos_ids(model(eos=value)) == [3, 5]
    assert eos_ids(model(generation=value)) == [3, 5]


def test_explicit_override():
    m = model(eos=2, generation=[2, 9], text_eos=4)
    tok = SimpleNamespace(eos_token_id=7)
    assert eos_ids(m, tok, explicit=11) == [11]
    assert eos_ids(m, tok, explicit=[12, 11]) == [11, 12]
    assert eos_ids(m, tok, explicit=torch.tensor(13)) == [13]
    assert eos_ids(m, tok, explicit=[]) == []  # "never stop early" is a choice, not a missing value


def test_none_at_all():
    assert eos_ids() == []
    assert eos_ids(model(), SimpleNamespace(eos_token_id=None)) == []
    assert eos_ids(model(has_generation_config=False), SimpleNamespace()) == []


def test_callers_share_the_rule():
    m = model(eos=2, generation=[9], text_eos=4)
    tok = SimpleNamespace(eos_token_id=7)
    assert runner_eos_ids(m, tok) == [2, 4, 7, 9]
    assert sorted(rollouts_eos_ids(m, tok)) == [2, 4, 7, 9]
    assert _eos_set(m, None) == {2, 4, 9}  # the decoder has no tokenizer
    assert _eos_set(m, []) == set()


def test_decoder_stops_at_config_eos_the_generation_config_omits():
    target = tiny_target("llama")
    ids = torch.tensor([[5, 17, 42, 8]])
    free = speculative_generate(target, None, ids, max_new_tokens=12, eos_token_id=[]).sequences[0]
    k = next(k for k in range(1, len(free)) if free[k] not in free[:k])  # a token first seen at k
    target.config.eos_token_id = free[k]
    target.generation_config.eos_token_id = [258]  # not in the vocabulary: never emitted
    out = speculative_generate(target, None, ids, max_new_tokens=12).sequences[0]
    assert out == free[: k + 1]  # the old resolver read the generation config only and ran on
