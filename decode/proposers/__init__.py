"""Proposers: everything that turns the decoding state into a draft tree, and `load_proposer`.

Registry (spec string -> proposer):
    "ngram", "ngram:N"        prompt lookup, longest suffix N (NGramProposer)
    "corpus:FILE"             lookup in a corpus of the target's own answers, a chat JSON / JSONL
                              such as `drafttrain regenerate temperature=0` writes (CorpusProposer)
    "early-exit:K"            the target's first K layers (EarlyExitProposer)
    <drafter folder>          drafttrain drafter (config.json "method": eagle3 / eagle1 / medusa1 /
                              medusa2; Medusa-2 needs its adapted target, see MedusaProposer)
    <draft LM folder>         drafttrain draft LM (drafttrain.json beside HF's config.json; checked
                              against the target's vocab and tokenizer hash) (DraftLMProposer)
    <HF causal LM path / id>  standalone draft LM with the target's tokenizer (DraftLMProposer)
    "adaptive:<spec>"         <spec> with its draft length chosen per step (AdaptiveProposer),
                              e.g. "adaptive:ngram", "adaptive:runs/eagle/drafter"
    "hybrid:<a>+<b>[+...]"    per row and step, the part with the highest expected accepted
                              length (HybridProposer; fixed lengths), e.g. "hybrid:ngram+runs/eagle/drafter"
    "adaptive:hybrid:<a>+<b>" both: the adaptive hybrid ("adaptive-hybrid:<a>+<b>" is the same)
The composite specs take `cost_model=` (a CostModel or the path of its JSON, see costmodel.py);
adaptive ones without it measure the target once and cache the result
(`costmodel.load_or_measure`, ~/.cache/drafttrain/costs). `max_gamma=` caps adaptive lengths;
other options go to the parts. Part specs may not contain "+".
A `Proposer` instance passes through; an `EagleDrafter` or an HF causal-LM module is wrapped.
`check_specs(specs)` (specs.py) checks spec strings without loading anything; `load_proposer`
runs it first, and commands run it before they load the target.

Deliberately not here: drafting logic (one module per family), verification.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from drafttrain.decode.proposers.base import NodeDrafter, Proposer
from drafttrain.decode.proposers.corpus import CorpusProposer
from drafttrain.decode.proposers.draft_lm import DraftLMProposer
from drafttrain.decode.proposers.eagle import EagleProposer
from drafttrain.decode.proposers.early_exit import EarlyExitProposer
from drafttrain.decode.proposers.medusa import MedusaProposer
from drafttrain.decode.proposers.ngram import NGramProposer
from drafttrain.decode.proposers.specs import (
    COMPOSITE,
    DRAFTER_METHODS,
    FORMS,
    check_spec,
    check_specs,
    drafter_method,
)

__all__ = ["Proposer", "NodeDrafter", "NGramProposer", "CorpusProposer", "EarlyExitProposer", "DraftLMProposer",
           "EagleProposer", "MedusaProposer", "HybridProposer", "load_proposer", "check_spec", "check_specs",
           "PROPOSERS", "COMPOSITE"]

def __getattr__(name: str):
    # HybridProposer is built on drafttrain.decode.adaptive, which imports this package's base
    # module: importing it lazily keeps the import graph acyclic.
    if name == "HybridProposer":
        from drafttrain.decode.proposers.hybrid import HybridProposer

        return HybridProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: spec prefix -> factory(target, arg, **options); "corpus:FILE" and the COMPOSITE prefixes
#: (specs.py) are handled in `load_proposer`.
PROPOSERS = {
    "ngram": lambda target, arg, **o: NGramProposer(int(arg) if arg else 3, **o),
    "early-exit": lambda target, arg, **o: EarlyExitProposer(target, _int_arg("early-exit", arg), **o),
}


def _int_arg(name: str, arg: str | None) -> int:
    if not arg or not arg.isdigit():
        raise ValueError(f"proposer spec {name}:K needs an integer K, got {arg!r}")
    return int(arg)


def load_proposer(spec_or_path, target: nn.Module, *, tokenizer=None, **options) -> Proposer:
    """Builds a proposer from a spec string, a folder, a model or a Proposer.

    Args:
        spec_or_path: see the module docstring.
        target: the target model (early exit runs it; drafters are checked against it).
        tokenizer: the target's tokenizer; when given, a draft LM's vocabulary size is checked.
        **options: forwarded to the proposer (e.g. gamma=5).

    Returns:
        A Proposer.

    Raises:
        ValueError: unknown spec, or a drafter that does not fit the target (a ConfigError from
            `check_spec` for anything found without loading).
    """
    if isinstance(spec_or_path, Proposer):
        return spec_or_path
    if isinstance(spec_or_path, nn.Module):
        return _wrap_module(spec_or_path, target, **options)
    spec = str(spec_or_path)
    check_spec(spec)
    name, _, arg = spec.partition(":")
    if name in COMPOSITE and not Path(spec).exists():
        return _load_composite(name, arg, target, tokenizer, **options)
    if name == "corpus" and not Path(spec).exists():
        if not arg:
            raise ValueError("proposer spec corpus:FILE needs the corpus file, e.g. corpus:runs/corpus/answers.jsonl")
        return CorpusProposer.from_file(arg, tokenizer, **options)
    if name in PROPOSERS and not Path(spec).exists():
        return PROPOSERS[name](target, arg or None, **options)
    folder = Path(spec)
    if (folder / "drafttrain.json").is_file():  # a drafttrain draft LM: a plain HF folder + metadata
        from drafttrain.models.draft_lm import load_draft_lm

        model = load_draft_lm(folder, target, tokenizer)
        _check_vocab(model, target)
        return DraftLMProposer(model, **options)
    if (folder / "config.json").is_file():
        method = drafter_method(json.loads((folder / "config.json").read_text()))
        if method in ("eagle3", "eagle1"):
            from drafttrain.models.eagle import load_drafter

            return EagleProposer(load_drafter(folder, target), **options)
        if method in ("medusa1", "medusa2"):
            return _load_medusa(folder, method, target, **options)
        if method is not None:
            raise ValueError(f"{folder}: drafter method {method!r} has no proposer yet "
                             f"(known: {', '.join(DRAFTER_METHODS)})")
    return _load_draft_lm(spec, target, tokenizer, **options)


def _load_composite(name: str, arg: str, target: nn.Module, tokenizer, *, cost_model=None,
                    max_gamma: int = 8, **options) -> Proposer:
    """adaptive:<spec>, hybrid:<a>+<b>, adaptive:hybrid:<a>+<b> / adaptive-hybrid:<a>+<b>."""
    from drafttrain.decode.adaptive import AdaptiveProposer
    from drafttrain.decode.proposers.hybrid import HybridProposer

    if name == "adaptive" and arg.startswith("hybrid:"):
        name, arg = "adaptive-hybrid", arg[len("hybrid:"):]
    if not arg:
        raise ValueError(f"proposer spec {name}: needs what to wrap, e.g. {name}:ngram"
                         + ("+early-exit:2" if "hybrid" in name else ""))
    specs = [a for a in arg.split("+")] if "hybrid" in name else [arg]
    if "hybrid" in name and (len(specs) < 2 or not all(specs)):
        raise ValueError(f"proposer spec {name}:{arg} needs two or more parts joined by '+', e.g. ngram+early-exit:2")
    parts = [load_proposer(s, target, tokenizer=tokenizer, **options) for s in specs]
    adaptive = name != "hybrid"
    cm = _cost_model(cost_model, target, parts) if adaptive or cost_model is not None else None
    if name == "adaptive":
        return AdaptiveProposer(parts[0], cm, max_gamma=max_gamma)
    return HybridProposer(parts, cost_model=cm, adaptive=adaptive, max_gamma=max_gamma)


def _cost_model(cost_model, target: nn.Module, parts: list[Proposer]):
    """A CostModel from an instance, a JSON path, or (None) the target's cached / measured one."""
    from drafttrain.decode.costmodel import CostModel, load_or_measure, proposer_key

    if cost_model is None:
        return load_or_measure(target, {proposer_key(p): p for p in parts})
    if isinstance(cost_model, (str, Path)):
        try:
            return CostModel.load(cost_model)
        except FileNotFoundError:
            raise ValueError(f"cost_model {str(cost_model)!r}: no such file (write one with `drafttrain profile`)") from None
    return cost_model


def _load_medusa(folder: Path, method: str, target: nn.Module, **options) -> Proposer:
    """Medusa heads from a folder, with the folder's learned tree as the default tree.

    A Medusa-2 folder's heads only fit the target with its adapter: `target` must come from
    `drafttrain.models.medusa.load_medusa_target(folder, target)` or be the saved
    `<folder>/merged_target`; anything else is refused (the check is the adapter id).
    """
    from drafttrain.models.medusa import adapter_id, load_medusa

    meta = json.loads((folder / "config.json").read_text())
    if method == "medusa2" and adapter_id(target) != meta.get("adapter_id"):
        raise ValueError(f"{folder} is a Medusa-2 drafter: decode with its adapted target "
                         f"(target={folder}/merged_target, or drafttrain.models.medusa.load_medusa_target)")
    heads = load_medusa(folder, target)
    layers = meta["target"]["num_hidden_layers"]
    return MedusaProposer(heads, layers, tree=options.pop("tree", None) or meta.get("tree_choices"), **options)


def _wrap_module(module: nn.Module, target: nn.Module, **options) -> Proposer:
    from drafttrain.models.eagle import EagleDrafter
    from drafttrain.models.medusa import MedusaHeads

    if isinstance(module, EagleDrafter):
        return EagleProposer(module, **options)
    if isinstance(module, MedusaHeads):
        tc = getattr(target.config, "text_config", None) or target.config
        return MedusaProposer(module, tc.num_hidden_layers, **options)
    from drafttrain.models.draft_lm import DraftLM

    if isinstance(module, DraftLM):  # the trainer's wrapper around an HF causal LM
        module = module.model
    _check_vocab(module, target)
    return DraftLMProposer(module, **options)


def _load_draft_lm(spec: str, target: nn.Module, tokenizer, **options) -> Proposer:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=next(target.parameters()).dtype)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load proposer {spec!r}: not one of {FORMS} "
                         f"({err.__class__.__name__}: {str(err).splitlines()[0]})") from None
    model.to(next(target.parameters()).device).eval()
    if tokenizer is not None and model.config.vocab_size < len(tokenizer):
        raise ValueError(f"draft LM {spec!r} has vocab {model.config.vocab_size} < tokenizer size {len(tokenizer)}")
    _check_vocab(model, target)
    return DraftLMProposer(model, **options)


def _check_vocab(model: nn.Module, target: nn.Module) -> None:
    dv = model.get_output_embeddings().weight.shape[0]
    tv = target.get_output_embeddings().weight.shape[0]
    if dv != tv:
        raise ValueError(f"draft LM vocabulary ({dv}) differs from the target's ({tv}): they must share a tokenizer")
