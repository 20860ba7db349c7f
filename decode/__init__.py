"""drafttrain.decode: lossless speculative decoding for HF causal LMs.

Public API:
    load_proposer(spec_or_path, target, *, tokenizer=None, **options) -> Proposer
    speculative_generate(target, proposer, input_ids, *, max_new_tokens, ...) -> GenerateOutput
    Proposer, DraftTree, StaticTree, DynamicTree, DecodeStats, GenerateOutput
    AdaptiveProposer, HybridProposer, AcceptanceCalibrator   adaptive speculation (proposers/scheduler.py)
    CostModel, load_or_measure, measure_cost_model           what a forward / draft step costs here

Layout: engine.py (prefill / draft / verify / accept loop), tree.py (draft trees), kv.py (tree
attention masks and KV gathering), proposers/ (n-gram, early exit, draft LM, EAGLE, Medusa,
hybrid), stats.py, verify.py + sampling.py + kernels/ (acceptance rules and logit processing),
costmodel.py + calibrator.py + planning.py (what drafts cost and are worth) under
proposers/scheduler.py + proposers/hybrid.py (draft lengths / parts chosen per step).

Deliberately not here: training drafters (drafttrain.*), benchmarks and reports (eval/).
"""

from drafttrain.decode.calibrator import AcceptanceCalibrator
from drafttrain.decode.costmodel import CostModel, load_or_measure, measure_cost_model
from drafttrain.decode.engine import DecodeState, GenerateOutput, speculative_generate
from drafttrain.decode.proposers import AdaptiveProposer, HybridProposer, Proposer, load_proposer
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
    "AdaptiveProposer",
    "HybridProposer",
    "AcceptanceCalibrator",
    "CostModel",
    "load_or_measure",
    "measure_cost_model",
]
