"""drafttrain.decode: lossless speculative decoding for HF causal LMs.

Public API:
    load_proposer(spec_or_path, target, *, tokenizer=None, **options) -> Proposer
    speculative_generate(target, proposer, input_ids, *, max_new_tokens, ...) -> GenerateOutput
    Proposer, DraftTree, StaticTree, DynamicTree, DecodeStats, GenerateOutput

Layout: engine.py (prefill / draft / verify / accept loop), tree.py (draft trees), kv.py (tree
attention masks and KV gathering), proposers/ (n-gram, early exit, draft LM, EAGLE), stats.py,
verify.py + sampling.py + kernels/ (acceptance rules and logit processing).

Deliberately not here: training drafters (drafttrain.*), benchmarks and reports (eval/).
"""

from drafttrain.decode.engine import DecodeState, GenerateOutput, speculative_generate
from drafttrain.decode.proposers import Proposer, load_proposer
from drafttrain.decode.stats import DecodeStats
from drafttrain.decode.tree import DraftTree, DynamicTree, StaticTree

__all__ = [
    "speculative_generate",
    "load_proposer",
    "Proposer",
    "DecodeState",
    "GenerateOutput",
    "DecodeStats",
    "DraftTree",
    "StaticTree",
    "DynamicTree",
]
