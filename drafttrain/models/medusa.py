"""Medusa heads (arXiv 2401.10774) as a plain `nn.Module`, their static tree, and save / load.

K heads read the target's final post-norm hidden state h_t (what its LM head reads); head i is
`num_layers` residual blocks x <- x + SiLU(W x + b) (W, b zero-initialised, so every head starts
as the identity) followed by an LM head over the draft vocabulary, initialised from the target's
rows (or, with `share_lm_head`, the target's head itself, never saved). Head i at position t
predicts token x_{t+i+2}; the target's own head at t predicts x_{t+1}.

A reduced draft vocabulary uses EAGLE's machinery: `d2t[i]` is the offset from draft id i to
its target id, `t2d` a bool mask over the target vocabulary.

Methods: Medusa-1 (frozen target) and Medusa-2 (heads trained jointly with a LoRA adapter on
the target). A Medusa-2 drafter folder also holds `adapter/` (PEFT, safetensors) and optionally
`merged_target/`; its heads only make sense on the ADAPTED target, which `load_medusa_target`
builds and which the decoder and eval must use as the target.

`learned_tree` builds the static tree from measured per-head rank accuracies (no hard-coded
list). What this module does not do: run the target, apply PEFT (the trainer does that in one
place), or decode (drafttrain.decode.proposers.medusa).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafttrain.vocab import DraftVocab


@dataclass
class MedusaConfig:
    """Shape of a set of Medusa heads. Saved as the `drafter` block of config.json (Medusa-1 and
    Medusa-2 heads have the same shape: what differs is how they train and which target they read)."""

    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    hidden_size: int = 64
    vocab_size: int = 257  # the target's vocabulary
    draft_vocab_size: int = 257
    share_lm_head: bool = False  # reuse the target's LM head (rows of the draft vocab); not saved

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")

    @classmethod
    def from_dict(cls, d: dict) -> MedusaConfig:
        """From a saved `drafter` block; unknown keys (an older `method` label) are dropped."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def aux_layer_ids(self) -> list[int]:
        """Medusa reads only the final post-norm state, never intermediate layers."""
        return []


def config_from_target(target_config, *, num_heads: int = 4, num_layers: int = 1,
                       draft_vocab_size: int | None = None, share_lm_head: bool = False) -> MedusaConfig:
    """Medusa heads shaped for a transformers target config."""
    tc = getattr(target_config, "text_config", None) or target_config
    vocab = tc.vocab_size
    return MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=tc.hidden_size,
                        vocab_size=vocab, draft_vocab_size=min(draft_vocab_size or vocab, vocab),
                        share_lm_head=share_lm_head)


class ResBlock(nn.Module):
    """x <- x + SiLU(W x + b), `num_layers` times; W and b start at zero (identity block)."""

    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(DraftVocab, nn.Module):
    """K Medusa heads. Saved keys: `blocks.{i}.layers.{j}.{weight,bias}`, `lm_heads.{i}.weight`
    (absent with `share_lm_head`), buffers `d2t`, `t2d`."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.blocks = nn.ModuleList(ResBlock(H, cfg.num_layers) for _ in range(cfg.num_heads))
        if not cfg.share_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(H, cfg.draft_vocab_size, bias=False) for _ in range(cfg.num_heads))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self._target_head: list[nn.Module] = []  # not a submodule: never saved, trained or moved

    # ---- wiring -------------------------------------------------------------------------------
    def attach_target(self, target: nn.Module) -> MedusaHeads:
        """Remember the target's LM head (used by `share_lm_head`)."""
        self._target_head = [target.get_output_embeddings()]
        return self

    def init_from_target(self, target: nn.Module) -> None:
        """Start every head's LM head from the target's rows for the draft vocabulary."""
        if self.cfg.share_lm_head:
            return
        with torch.no_grad():
            w = target.get_output_embeddings().weight
            rows = w[self.draft_ids.to(w.device)]  # [Vd, H]
            for head in self.lm_heads:
                head.weight.copy_(rows.to(head.weight.dtype))

    # ---- compute ------------------------------------------------------------------------------
    def _head_weight(self, i: int) -> Tensor:
        if not self.cfg.share_lm_head:
            return self.lm_heads[i].weight
        if not self._target_head:
            raise RuntimeError("share_lm_head: call heads.attach_target(target) first")
        w = self._target_head[0].weight
        return w if self.cfg.draft_vocab_size == self.cfg.vocab_size else w[self.draft_ids.to(w.device)]

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., H] final post-norm target hidden states -> [K, ..., Vd] logits (head i predicts
        the token i + 2 ahead of the hidden state's token)."""
        outs = []
        for i, block in enumerate(self.blocks):
            w = self._head_weight(i)
            x = block(hidden.to(w.dtype))
            outs.append(x.to(w.dtype) @ w.t())
        return torch.stack(outs, 0)


# ---- trees ----------------------------------------------------------------------------------------
def learned_tree(rank_acc: list[list[float]], budget: int) -> list[list[int]]:
    """The static tree with the largest expected accepted length for a node budget.

    A path (r_1..r_d) is accepted with probability prod_k rank_acc[k-1][r_k] (heads treated as
    independent), and the expected number of accepted drafts is the sum over the tree's paths.
    Every path's value is at most its parent's, so growing the tree greedily from the frontier
    (children of chosen nodes) picks the best `budget` paths closed under ancestors.

    Args:
        rank_acc: [K][R] probability that head k's rank-r candidate is the right token.
        budget: number of draft nodes (root excluded).

    Returns:
        Rank paths, shallow first (what `StaticTree.of` takes).
    """
    K = len(rank_acc)
    if K == 0 or budget <= 0:
        return []
    R = len(rank_acc[0])
    heap = [(-rank_acc[0][r], (r,)) for r in range(R)]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        if -neg <= 0:
            break
        chosen.append(path)
        d = len(path)
        if d < K:
            for r in range(R):
                heapq.heappush(heap, (neg * rank_acc[d][r], (*path, r)))
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


# ---- save / load ----------------------------------------------------------------------------------
def medusa_config_dict(cfg: MedusaConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg)))


def load_medusa(path: str | Path, target: nn.Module | None = None, *, map_location: str = "cpu") -> MedusaHeads:
    """Load Medusa heads from a drafter folder; attach and check `target` (hidden, vocab, layers).

    For Medusa-2 folders, `target` should be the adapted target (`load_medusa_target`).
    """
    from drafttrain.drafter_io import load_module_folder

    return load_module_folder(path, lambda d: MedusaHeads(MedusaConfig.from_dict(d)), target, map_location=map_location)


def adapter_id(target: nn.Module) -> str | None:
    """The Medusa-2 adapter id an adapted target carries (None for a plain target)."""
    cfg = getattr(target, "config", None)
    return getattr(cfg, "drafttrain_adapter_id", None)


def load_medusa_target(path: str | Path, target: nn.Module, *, merge: bool = True) -> nn.Module:
    """The target a Medusa-2 drafter decodes with: `target` plus the folder's LoRA adapter.

    Medusa-2 trains the heads jointly with a LoRA adapter on the target, so its heads predict
    the ADAPTED model's continuation; decoding and eval must use this model as the target (it
    is a different model from the original, kept close to it by a KL term during training).

    Args:
        path: a Medusa-2 drafter folder (with `adapter/`).
        target: the original target (left untouched: the adapter is applied to a copy).
        merge: fold the adapter into the weights (a plain transformers model, as fast as the
            original); False keeps a PEFT model.

    Returns:
        The adapted target, in eval mode, with `config.drafttrain_adapter_id` set (what
        `load_proposer` checks before it pairs Medusa-2 heads with a target).
    """
    import copy

    from peft import PeftModel

    from drafttrain.drafter_io import read_drafter_config

    folder = Path(path)
    meta = read_drafter_config(folder)
    if not meta.get("adapter_id") or not (folder / "adapter").is_dir():
        raise ValueError(f"{folder} is not a Medusa-2 drafter with an adapter/ folder")
    model = PeftModel.from_pretrained(copy.deepcopy(target), str(folder / "adapter"))
    if merge:
        model = model.merge_and_unload()
    model.config.drafttrain_adapter_id = meta.get("adapter_id")
    model.eval()
    model.requires_grad_(False)
    return model
