"""Batched sampling of responses from a causal LM: the target (`drafttrain regenerate`) or the
student (on-policy draft-LM training).

`sample_responses` left-pads a batch of prompts, prefills once and decodes with the model's KV
cache, one token per step for every row, until each row has emitted an end-of-sequence id or
`max_new_tokens`. Every row draws from its own seeded generator, so a row's sample does not
depend on which other rows share its batch (what makes `regenerate` reproducible on resume).

What it does not do: beam search, repetition penalties, or speculative decoding (drafttrain.decode
does that); it returns token ids and leaves text to the caller.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor, nn

from drafttrain.eos import eos_ids as eos_ids  # re-exported: callers stop where sampling stops


def _pick(logits: Tensor, temperature: float, top_p: float, gens: list[torch.Generator]) -> Tensor:
    """[B, V] float logits -> [B] next ids: argmax at temperature 0, else nucleus sampling per row."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1).cpu()
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp > top_p  # keep the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp.masked_fill(drop, 0.0))
    return torch.stack([torch.multinomial(probs[b], 1, generator=g)[0] for b, g in enumerate(gens)]).to(logits.device)


@torch.no_grad()
def sample_responses(model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int | list[int],
                     eos: Collection[int], seeds: list[int], temperature: float = 1.0, top_p: float = 1.0,
                     pad_id: int = 0) -> list[list[int]]:
    """Sample a continuation of every prompt.

    Args:
        model: an HF causal LM (eval mode is the caller's business).
        prompts: token ids per row.
        max_new_tokens: a cap for all rows, or one per row.
        eos: ids that end a row (kept as its last token; `drafttrain.eos.eos_ids` gives the model's).
        seeds: one seed per row.
        temperature: 0 = greedy.
        top_p: nucleus mass (1 = off).
        pad_id: id fed to the left padding and to finished rows (masked out).

    Returns:
        The new token ids per row (the end-of-sequence id included when one was sampled).
    """
    device = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    caps = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * B
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P] left padding does not shift positions
    gens = [torch.Generator().manual_seed(int(s) % (2**63)) for s in seeds]
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    past, logits = out.cache, out.logits[:, -1].float()
    res: list[list[int]] = [[] for _ in range(B)]
    done = [c <= 0 for c in caps]
    for _ in range(max(caps, default=0)):
        nxt = _pick(logits, temperature, top_p, gens)  # [B]
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                res[b].append(t)
                done[b] = t in eos or len(res[b]) >= caps[b]
        if all(done):
            break
        nxt = torch.where(torch.tensor(done, device=device), torch.full_like(nxt, pad_id), nxt)
        mask = torch.cat([mask, mask.new_ones(B, 1)], -1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=past,
                    use_cache=True)
        past, logits = out.cache, out.logits[:, -1].float()
    return res
