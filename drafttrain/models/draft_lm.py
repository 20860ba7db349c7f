"""A small draft LM distilled from the target: build it, wrap it, save it as a plain HF folder.

The student is an ordinary transformers causal LM. It is built either from the target's own
config with fewer layers (and optionally a smaller width), its layers copied from chosen target
layers and its embedding / final norm / LM head copied from the target wherever the shapes
match, or loaded from any HF causal LM id or path whose tokenizer matches the target's.

`DraftLM` is the plain `nn.Module` the trainer sees: it holds the HF model (`.model`) and a
dataclass `cfg`; its forward returns the body's final hidden states, or, given `head_fn`, runs
the caller's (chunked) LM-head loss inside forward so that distributed wrappers see every
parameter used there.

The drafter folder is a `save_pretrained` folder (config.json, model.safetensors, tokenizer,
generation_config.json) that `AutoModelForCausalLM.from_pretrained` loads and transformers'
`generate(assistant_model=...)` uses as is; drafttrain's own metadata sits beside it in
`drafttrain.json` (HF never reads it) and the card in README.md.

The folder may also hold `decode_vocab.safetensors`: the ids of the training data's most frequent
assistant tokens (`draft_lm.decode_vocab`). drafttrain's decoder then drafts from those LM-head
rows only (FR-Spec-style: drafts are proposals, so the output stays lossless), which matters when
the head is most of the student, as with Gemma's 262k-token vocabulary. The HF model itself keeps
the full head, so engines and assisted generation use it unchanged.

What it does not do: the loss (drafttrain.losses), decoding (drafttrain.decode.proposers.draft_lm).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

META_FILE = "drafttrain.json"
DECODE_VOCAB_FILE = "decode_vocab.safetensors"


class DraftLMError(ValueError):
    """A student that cannot be built for this target (bad layers, tokenizer mismatch); one line."""


@dataclass
class DraftLMConfig:
    """Shape and origin of a draft LM; saved as the `drafter` block of drafttrain.json."""

    num_layers: int = 2
    hidden_size: int = 0  # 0 = the target's width
    init_layers: list[int] = field(default_factory=list)  # target layer copied into each student layer
    init_from: str = ""  # HF id / path the student was loaded from ("" = built from the target)
    vocab_size: int = 257
    copied: list[str] = field(default_factory=list)  # parameter names initialised from the target

    @property
    def aux_layer_ids(self) -> list[int]:
        """A draft LM reads no target hidden states."""
        return []

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size


class DraftLM(nn.Module):
    """The student: an HF causal LM plus its drafttrain config.

    Args:
        model: the HF causal LM.
        cfg: how it was built.
    """

    def __init__(self, model: nn.Module, cfg: DraftLMConfig) -> None:
        super().__init__()
        self.model, self.cfg = model, cfg

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, head_fn=None):
        """[B, T] ids -> [B, T, h] final post-norm hidden states, or `head_fn(hidden, self.model)`."""
        body = self.model.get_decoder()
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return hidden if head_fn is None else head_fn(hidden, self.model)


def evenly_spaced(n_target: int, k: int) -> list[int]:
    """k target layer indices from 0..n_target-1, first and last included (k=1: the first)."""
    if k == 1:
        return [0]
    return [round(i * (n_target - 1) / (k - 1)) for i in range(k)]


def _text_config(config):
    return getattr(config, "text_config", None) or config


def student_config(target_config, num_layers: int, hidden_size: int = 0, init_layers: list[int] | None = None):
    """The target's (text) config with `num_layers` layers and optionally width `hidden_size`.

    Per-layer settings (`layer_types`: sliding vs full attention) follow the layers chosen in
    `init_layers`. A smaller width scales the MLP width with it and keeps the head count; the
    head dimension shrinks only where it was hidden / heads to begin with.
    """
    tc = copy.deepcopy(_text_config(target_config))
    n = tc.num_hidden_layers
    layers = list(init_layers) if init_layers else evenly_spaced(n, num_layers)
    if len(layers) != num_layers or any(not 0 <= i < n for i in layers):
        raise DraftLMError(f"draft_lm.init_layers {layers} must list {num_layers} target layers from 0..{n - 1}")
    tc.num_hidden_layers = num_layers
    if isinstance(getattr(tc, "layer_types", None), list) and len(tc.layer_types) == n:
        tc.layer_types = [tc.layer_types[i] for i in layers]
    if hasattr(tc, "max_window_layers"):
        tc.max_window_layers = min(tc.max_window_layers, num_layers)
    if hidden_size and hidden_size != tc.hidden_size:
        heads = tc.num_attention_heads
        if hidden_size % heads:
            raise DraftLMError(f"draft_lm.hidden_size {hidden_size} is not a multiple of the {heads} attention heads")
        old = tc.hidden_size
        if getattr(tc, "head_dim", None) == old // heads:
            if getattr(tc, "query_pre_attn_scalar", None) == tc.head_dim:
                tc.query_pre_attn_scalar = hidden_size // heads
            tc.head_dim = hidden_size // heads
        tc.intermediate_size = max(1, tc.intermediate_size * hidden_size // old)
        tc.hidden_size = hidden_size
    tc.architectures = None
    return tc, layers


def copy_from_target(student: nn.Module, target: nn.Module, layers: list[int]) -> list[str]:
    """Copy every target tensor whose name and shape fit (student layer j <- target layer layers[j]).

    Returns the names of the student parameters that were copied.
    """
    src = target.state_dict()
    copied = []
    with torch.no_grad():
        for name, p in student.state_dict().items():
            key = name
            parts = name.split(".")
            if "layers" in parts:  # model.layers.{j}.rest -> model.layers.{layers[j]}.rest
                i = parts.index("layers") + 1
                parts[i] = str(layers[int(parts[i])])
                key = ".".join(parts)
            if key in src and src[key].shape == p.shape:
                p.copy_(src[key].to(p.dtype))
                copied.append(name)
    return copied


def check_tokenizer(student_tok, target_tok, student_vocab: int, target_vocab: int, where: str) -> None:
    """Raise DraftLMError (one line) unless the two tokenizers map text to the same ids."""
    if student_vocab != target_vocab:
        raise DraftLMError(f"{where}: its vocabulary ({student_vocab} rows) differs from the target's "
                           f"({target_vocab}); a draft LM must share the target's tokenizer")
    if student_tok is None:
        return
    a, b = student_tok.get_vocab(), target_tok.get_vocab()  # the chat template may differ; the ids may not
    differ = sum(1 for k in set(a) | set(b) if a.get(k) != b.get(k))
    if differ:
        raise DraftLMError(f"{where}: its tokenizer does not match the target's ({differ} tokens map to different "
                           "ids); a draft LM must share the target's tokenizer")


def build_student(target, tokenizer, *, num_layers: int = 2, hidden_size: int = 0,
                  init_layers: list[int] | None = None, init_from: str = "", dtype=torch.float32) -> DraftLM:
    """The student for `target`.

    Args:
        target: the target HF causal LM.
        tokenizer: the target's tokenizer (checked against `init_from`'s).
        num_layers / hidden_size / init_layers: the shape when built from the target's config.
        init_from: an HF causal LM id or path to start from instead (its tokenizer must match).
        dtype: parameter dtype.

    Raises:
        DraftLMError: out-of-range layers, a width the heads do not divide, or a tokenizer mismatch.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tv = target.get_output_embeddings().weight.shape[0]
    if init_from:
        try:
            model = AutoModelForCausalLM.from_pretrained(init_from, dtype=dtype)
        except (OSError, ValueError) as e:
            raise DraftLMError(f"draft_lm.init_from {init_from!r} does not load as a causal LM "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        try:
            stok = AutoTokenizer.from_pretrained(init_from)
        except (OSError, ValueError, TypeError):
            stok = None
        check_tokenizer(stok, tokenizer, model.get_output_embeddings().weight.shape[0], tv,
                        f"draft_lm.init_from {init_from!r}")
        sc = _text_config(model.config)
        cfg = DraftLMConfig(num_layers=sc.num_hidden_layers, hidden_size=sc.hidden_size, init_from=init_from,
                            vocab_size=tv)
        return DraftLM(model, cfg)
    sc, layers = student_config(target.config, num_layers, hidden_size, init_layers)
    with torch.random.fork_rng(devices=[]):  # a fixed random init (for what is not copied), global RNG untouched
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(sc, dtype=dtype)
    copied = copy_from_target(model, target, layers)
    model.generation_config = copy.deepcopy(target.generation_config)
    cfg = DraftLMConfig(num_layers=num_layers, hidden_size=sc.hidden_size, init_layers=layers, vocab_size=tv,
                        copied=copied)
    return DraftLM(model, cfg)


def save_draft_lm(folder: str | Path, *, drafter: DraftLM, tokenizer, meta: dict, card: str,
                  write_extra=None) -> Path:
    """Write the drafter folder atomically: HF `save_pretrained` + tokenizer + drafttrain.json + README.md
    (+ whatever `write_extra(tmp_folder)` adds, e.g. the decode vocabulary)."""
    from drafttrain.drafter_io import atomic_dir

    with atomic_dir(folder) as tmp:
        drafter.model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if write_extra is not None:
            write_extra(tmp)
        (tmp / META_FILE).write_text(json.dumps({**meta, "drafter": asdict(drafter.cfg)}, indent=2, default=str))
        (tmp / "README.md").write_text(card + USAGE.format(folder=Path(folder).name))
    return Path(folder)


USAGE = """
## Use

A plain transformers causal LM sharing the target's tokenizer:

```python
draft = AutoModelForCausalLM.from_pretrained("{folder}")
target.generate(**inputs, assistant_model=draft)             # transformers assisted generation
```

drafttrain's decoder: `drafttrain eval proposers={folder}`; vLLM / SGLang take the folder as the
draft model. `drafttrain.json` holds the training metadata (target, tokenizer hash, config).
"""


def decode_vocab(token_counts: Tensor, size: int) -> tuple[Tensor, float]:
    """The `size` most frequent tokens (ascending ids) and the share of counted tokens they cover."""
    size = min(size, token_counts.numel())
    if size < 1:
        raise DraftLMError(f"draft_lm.decode_vocab must be >= 1 (0 = full vocabulary), got {size}")
    order = torch.sort(token_counts.double(), descending=True, stable=True).indices[:size]
    total = float(token_counts.sum())
    coverage = float(token_counts[order].sum()) / total if total > 0 else 0.0
    return torch.sort(order).values, coverage


def write_decode_vocab(folder: str | Path, ids: Tensor) -> Path:
    """Save the decode vocabulary (target ids) into a drafter folder, as safetensors."""
    from safetensors.torch import save_file

    path = Path(folder) / DECODE_VOCAB_FILE
    save_file({"token_ids": ids.to(torch.int64).contiguous()}, str(path))
    return path


def read_decode_vocab(folder: str | Path) -> Tensor | None:
    """The folder's decode vocabulary ([Vd] ascending target ids), or None when it has none."""
    path = Path(folder) / DECODE_VOCAB_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    ids = load_file(str(path))["token_ids"]
    if ids.dim() != 1 or ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()):
        raise DraftLMError(f"{path}: token_ids must be a non-empty, strictly ascending 1-D list; "
                           "delete the file to draft with the full vocabulary")
    return ids


def read_meta(folder: str | Path) -> dict:
    """The drafttrain.json of a draft-LM folder (method, target signature, tokenizer hash, training)."""
    return json.loads((Path(folder) / META_FILE).read_text())


def load_draft_lm(folder: str | Path, target=None, tokenizer=None, dtype=None):
    """The HF causal LM of a drafter folder, checked against `target` (and `tokenizer`) when given.

    Raises:
        DrafterMismatchError: the target's vocab size (or tokenizer hash) differs from the recorded one.
    """
    from transformers import AutoModelForCausalLM

    from drafttrain.drafter_io import DrafterMismatchError, check_target_match

    meta = read_meta(folder)
    if target is not None:
        want = meta.get("target", {}).get("vocab_size")
        have = target.get_output_embeddings().weight.shape[0]
        if want is not None and want != have:
            raise DrafterMismatchError(f"draft LM {folder} was trained for a target with vocab {want}; this target "
                                       f"has {have}. Use the target it was trained for.")
        # hidden size / layer count of the target do not constrain a standalone draft LM
        check_target_match({**meta, "target": {}}, target, folder, tokenizer)
        dtype = dtype or next(target.parameters()).dtype
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32)
    if target is not None:
        model.to(next(target.parameters()).device)
    # drafttrain's decoder drafts from these head rows (DraftLMProposer reads the attribute)
    model.drafttrain_decode_vocab = read_decode_vocab(folder)
    return model.eval()
