"""The fused LM-head argmax path (no logits) decodes exactly what the logits path decodes."""

from __future__ import annotations

import pytest
import torch

from drafttrain.decode import load_proposer, speculative_generate
from drafttrain.testing import tiny_target


@pytest.mark.parametrize("fam", ["llama", "gemma3"])
def test_argmax_head_equals_logits_head_and_hf(fam):
    target = tiny_target(fam, vocab_size=1031, num_layers=4)  # odd vocab: chunking edge
    torch.manual_seed(1)
    ids = torch.randint(3, 1031, (2, 11))
    prop = load_proposer("ngram", target)
    a = speculative_generate(target, prop, ids, max_new_tokens=20, greedy_head="argmax", eos_token_id=-1)
    b = speculative_generate(target, prop, ids, max_new_tokens=20, greedy_head="logits", eos_token_id=-1)
    assert a.sequences == b.sequences
    ref = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert a.sequences == ref[:, ids.shape[1]:].tolist()
