"""The language-model part of a model config, for text-only and multimodal targets alike.

A text-only causal LM keeps its sizes (``hidden_size``, ``vocab_size``, ``num_hidden_layers``,
``layer_types``, ``final_logit_softcapping``, ...) on its config; a multimodal one (Gemma 3's
``Gemma3Config``) nests them under ``config.text_config``. `text_config` returns whichever holds
them, so callers read ``text_config(model.config).hidden_size`` and never branch.

Deliberately not here: vision or audio sub-configs, encoder-decoder configs (a drafter's target is
a decoder-only LM), end-of-sequence ids (`drafttrain.eos` reads both levels). A leaf: it imports
nothing of ours.
"""

from __future__ import annotations

from typing import Any

__all__ = ["text_config"]


def text_config(config: Any) -> Any:
    """``config.text_config`` when the config has one (multimodal), else ``config`` itself.

    Args:
        config: a transformers ``PretrainedConfig`` or any object with the same attributes.
    """
    return getattr(config, "text_config", None) or config
