"""Tiny random targets of several families, built from config in code (never downloaded).

Used by the tests and by anyone who wants a model that runs in milliseconds. Real sizes for
comparison: Llama-3.1-8B has hidden 4096 / 32 layers / vocab 128256; Gemma 3 270M has hidden
640 / 18 layers / vocab 262144. The tiny ones keep each family's quirks (Gemma's embedding
scale and sliding-window layers, Qwen3's q/k norms) at hidden 64 and vocab 257.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


def tiny_config(
    family: str = "llama",
    *,
    vocab_size: int = 257,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
) -> PretrainedConfig:
    """Config of a tiny causal LM of `family` (one of FAMILIES)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=hidden_size // num_heads)
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        common["tie_word_embeddings"] = True
        # Sliding window of 8 tokens so tests actually cross the window edge; every 2nd layer global.
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        return Gemma3TextConfig(
            **common,
            head_dim=hidden_size // num_heads,
            sliding_window=8,
            layer_types=layer_types,
            query_pre_attn_scalar=hidden_size // num_heads,
        )
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def tiny_target(family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs):
    """A tiny random causal LM of `family`, in eval mode, with weights drawn from `seed`.

    The weights are scaled up a little from HF's 0.02 init so greedy decoding is not a flat
    distribution (a random model with tiny logits makes every argmax a near-tie).
    """
    config = tiny_config(family, **kwargs)
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


class TinyTokenizer:
    """A byte-level tokenizer for tests: ids 3..258 are bytes, 0 pad, 1 bos, 2 eos (vocab 259)."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    chat_template = None
    vocab_size = 259

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return ([self.bos_token_id] + ids) if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        data = bytes(int(i) - 3 for i in ids if int(i) >= 3)
        return data.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size
