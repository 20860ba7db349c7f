"""Proposers: everything that turns the decoding state into a draft tree, and `load_proposer`.

Registry (spec string -> proposer):
    "ngram", "ngram:N"        prompt lookup, longest suffix N (NGramProposer)
    "corpus:FILE"             lookup in a corpus of the target's own answers, a chat JSON / JSONL
                              such as `drafttrain regenerate temperature=0` writes (CorpusProposer)
    "early-exit:K"            the target's first K layers (EarlyExitProposer)
    <drafter folder>          a drafttrain drafter folder: the method it names (config.json, or
                              drafttrain.json beside a draft LM's HF config) loads it
                              (drafttrain.methods: `load_proposer` of each method)
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
A `Proposer` instance passes through; a drafter module is wrapped by the method that claims it
(`proposer_for_module`), any other module as an HF causal LM.
`check_specs(specs)` (specs.py) checks spec strings without loading anything; `load_proposer`
runs it first, and commands run it before they load the target.

Composites: scheduler.py (the adaptive loop, AdaptiveProposer) and hybrid.py (HybridProposer).

Deliberately not here: drafting logic (one module per family), verification.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from drafttrain.decode.proposers.base import NodeDrafter, Proposer
from drafttrain.decode.proposers.corpus import CorpusProposer
from drafttrain.decode.proposers.draft_lm import DraftLMProposer, check_draft_vocab
from drafttrain.decode.proposers.eagle import EagleProposer
from drafttrain.decode.proposers.early_exit import EarlyExitProposer
from drafttrain.decode.proposers.hybrid import HybridProposer
from drafttrain.decode.proposers.medusa import MedusaProposer
from drafttrain.decode.proposers.ngram import NGramProposer
from drafttrain.decode.proposers.scheduler import AdaptiveProposer
from drafttrain.decode.proposers.specs import COMPOSITE, FORMS, check_spec, check_specs
from drafttrain.methods.registry import folder_method, get_method, method_names

__all__ = ["Proposer", "NodeDrafter", "NGramProposer", "CorpusProposer", "EarlyExitProposer", "DraftLMProposer",
           "EagleProposer", "MedusaProposer", "AdaptiveProposer", "HybridProposer", "load_proposer", "check_spec",
           "check_specs", "PROPOSERS", "COMPOSITE"]


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
    method = folder_method(folder)
    if method is not None:  # a drafttrain drafter folder: its method knows how to load it
        return _share_linear_kernel(get_method(method).load_proposer(folder, target, tokenizer=tokenizer, **options),
                                    target)
    return _share_linear_kernel(_load_draft_lm(spec, target, tokenizer, **options), target)


def _share_linear_kernel(proposer: Proposer, target: nn.Module) -> Proposer:
    """Routes a loaded drafter's bf16 linear layers through the decode kernel the target runs
    (decode/kernels/cpu_linear.py), if any: a draft step feeds as few rows as a target step, and
    through PyTorch's bf16 matmul the EAGLE-3 drafter's step cost 7.8 ms where the kernel takes
    4.6 (session 14, Gemma 3 270M, 2-core Xeon). Live modules (`load_proposer(module)`, e.g. a
    drafter in training) are left as they are.

    Where `cpu_linear.setup` chose 7-bit drafter weights (`draft_weights`; auto: EAGLE drafters only),
    the drafter's own linears move to them (`cpu_linear.quantize`; never a module of the target):
    half the bytes a draft step reads. Session 33 (this Xeon): `eagle_long`'s drafter accepts as many tokens in 7 bits
    (tau 3.00 vs 3.01 at T = 0, 1.88 vs 1.90 at T = 1, fake-quantised weights, MT-bench 8 x 256)."""
    from drafttrain.decode.kernels.cpu_linear import install, installed_backend, quantize, quantizes

    backend = installed_backend(target)
    if backend != "aten":
        for value in vars(proposer).values():
            if isinstance(value, nn.Module) and value is not target:
                install(value, backend)  # skips modules already routed (a head shared with the target)
                if quantizes(target, value):
                    quantize(value, exclude=target)
    return proposer


def _load_composite(name: str, arg: str, target: nn.Module, tokenizer, *, cost_model=None,
                    max_gamma: int = 8, cost_batch_sizes: tuple[int, ...] | None = None, **options) -> Proposer:
    """adaptive:<spec>, hybrid:<a>+<b>, adaptive:hybrid:<a>+<b> / adaptive-hybrid:<a>+<b>."""
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
    cm = _cost_model(cost_model, target, parts, cost_batch_sizes) if adaptive or cost_model is not None else None
    if name == "adaptive":
        return AdaptiveProposer(parts[0], cm, max_gamma=max_gamma)
    return HybridProposer(parts, cost_model=cm, adaptive=adaptive, max_gamma=max_gamma)


def _cost_model(cost_model, target: nn.Module, parts: list[Proposer], batch_sizes: tuple[int, ...] | None = None):
    """A CostModel from an instance, a JSON path, or (None) the target's cached / measured one
    (measured at `batch_sizes`, default 1-16, where the cache lacks them)."""
    from drafttrain.decode.costmodel import CostModel, load_or_measure, proposer_key

    if cost_model is None:
        kw = {"batch_sizes": tuple(batch_sizes)} if batch_sizes else {}
        return load_or_measure(target, {proposer_key(p): p for p in parts}, **kw)
    if isinstance(cost_model, (str, Path)):
        try:
            return CostModel.load(cost_model)
        except FileNotFoundError:
            raise ValueError(f"cost_model {str(cost_model)!r}: no such file (write one with `drafttrain profile`)") from None
    return cost_model


def _wrap_module(module: nn.Module, target: nn.Module, **options) -> Proposer:
    """A live drafter module: the first method that claims it wraps it; else an HF causal LM."""
    for name in method_names():
        proposer = get_method(name).proposer_for_module(module, target, **options)
        if proposer is not None:
            return proposer
    check_draft_vocab(module, target)
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
    check_draft_vocab(model, target)
    return DraftLMProposer(model, **options)
