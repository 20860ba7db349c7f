"""Tiny random targets of several families, built from config in code (never downloaded).

Used by the tests and by anyone who wants a model that runs in milliseconds. Real sizes for
comparison: Llama-3.1-8B has hidden 4096 / 32 layers / vocab 128256; Gemma 3 270M has hidden
640 / 18 layers / vocab 262144. The tiny ones keep each family's quirks (Gemma's embedding
scale and sliding-window layers, Qwen3's q/k norms) at hidden 64 and vocab 257.
`OracleProposer` drafts a known continuation (optionally one wrong token) for verification tests.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from drafttrain.decode import Proposer
from drafttrain.decode.tree import chain_tree

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

        # Untied on purpose (real Gemma 3 ties): with a tied head, the sqrt(H)-scaled input embedding
        # dominates the tiny residual stream, so greedy decoding just repeats the last token forever.
        common["tie_word_embeddings"] = False
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


# A small ChatML-like template with role markers; the `generation` variant marks replies for
# `return_assistant_tokens_mask`. Real templates (Llama 3, Qwen) have the same shape.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_CHAT_TEMPLATE_GENERATION = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>"
    "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


def tiny_tokenizer(with_template: bool, *, generation: bool = False):
    """A real byte-level `PreTrainedTokenizerFast` built in code: one token per UTF-8 byte.

    Ids 0..6 are the special tokens in TINY_SPECIAL_TOKENS (pad, bos, eos, role markers, end of
    turn), 7..262 the 256 bytes (vocab 263; Gemma 3 has 262144). Decoding is lossless, so tests can
    compare decoded masked tokens with the assistant text character for character.

    Args:
        with_template: attach TINY_CHAT_TEMPLATE (else the tokenizer has no chat template).
        generation: use the `{% generation %}`-marked variant of the template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    vocab.update({ch: len(TINY_SPECIAL_TOKENS) + i for i, ch in enumerate(byte_chars)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        additional_special_tokens=list(TINY_SPECIAL_TOKENS[3:]),
    )
    if with_template:
        tok.chat_template = TINY_CHAT_TEMPLATE_GENERATION if generation else TINY_CHAT_TEMPLATE
    return tok


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state, so each in-process training run starts clean."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def chat_records(n: int = 24) -> list[dict]:
    """`n` tiny ShareGPT-style conversations (5 topics, so a drafter has something to learn)."""
    return [{"conversations": [
        {"from": "human", "value": f"Question {i}: tell me about topic {i % 5}."},
        {"from": "gpt", "value": f"Topic {i % 5} is a fine topic; the answer is {i * 3}. Thanks!"},
    ]} for i in range(n)]


def save_tiny_run_root(root, *, family: str = "llama", num_layers: int = 4, n_records: int = 24):
    """Write `root/target` (a tiny target + byte tokenizer, loadable by `load_target`) and
    `root/chat.json` (`chat_records`); returns `root` as a Path."""
    import json
    from pathlib import Path

    root = Path(root)
    tok = tiny_tokenizer(False)
    tiny_target(family, vocab_size=len(tok), num_layers=num_layers).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    (root / "chat.json").write_text(json.dumps(chat_records(n_records)))
    return root


def strong_draft_lm(seed: int = 3, noise: float = 0.002, family: str = "llama"):
    """A tiny target copy with Gaussian weight noise (std `noise`): as a draft LM of
    `tiny_target(family)` its drafts are accepted often, not always (random tiny drafters almost never are)."""
    model = tiny_target(family)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return model


def record_proposals(proposer) -> list[tuple[list[int], list[int]]]:
    """Wraps `proposer.propose` so each call appends (row 0's tokens so far, row 0's drafts); returns that list."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def spy(state):
        tree = propose(state)
        seen.append((list(state.tokens[0]), tree.tokens[0, 1:].tolist()))
        return tree

    proposer.propose = spy
    return seen


class OracleProposer(Proposer):
    """Drafts the known greedy continuation; a wrong token at depth `wrong_at` (1-based) forces
    partial acceptance there."""

    def __init__(self, prompts: list[torch.Tensor], continuations: list[list[int]], gamma: int,
                 wrong_at: int | list[int | None] | None = None, vocab_size: int = 257):
        self.full = [p.tolist() + c for p, c in zip(prompts, continuations)]
        self.vocab_size = vocab_size
        self.default_gamma = gamma
        self.wrong_at = wrong_at if isinstance(wrong_at, list) else [wrong_at] * len(prompts)

    def propose(self, state):
        g = state.gamma or self.default_gamma
        drafts = torch.zeros(len(state.tokens), g, dtype=torch.long)
        for b, seq in enumerate(state.tokens):
            cont = self.full[b][len(seq): len(seq) + g]
            drafts[b, : len(cont)] = torch.tensor(cont, dtype=torch.long)
            w = self.wrong_at[b]
            if w is not None and w <= g:
                drafts[b, w - 1] = (drafts[b, w - 1] + 1) % self.vocab_size
        return chain_tree(state.root, drafts)
