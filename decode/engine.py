"""The speculative generate loop: prefill, draft, verify, accept (gpt-fast style).

    prefill  the target reads each prompt minus its last token; that last token is the root
    draft    the proposer returns a tree hanging off the root
    verify   one target forward over the tree (tree attention mask, tree position ids), then
             `verify_tree` picks the accepted path and one more token (recovered or bonus)
    accept   emit path + next token (cut at EOS / max_new_tokens), keep only the path's KV,
             the next token becomes the new root

Batching: prompts are left-padded; rows accept different numbers of tokens, so the committed
KV segment has holes (masked out) where a row kept fewer entries than the longest row; every
row keeps its own positions. Rows finish independently; after a step in which rows finished,
the batch is compacted to the active rows (`KVState.select_rows` + `Proposer.select_rows`: one
copy of the active rows' KV, at most B - 1 times per call), so later drafts and verifications
cost what the active rows need; `state.rows` maps batch rows back to the caller's rows
(outputs, per-row stats, step logs). With `compact=False`, or a proposer whose `select_rows`
returns False, a finished row stays in the batch with an empty tree until all are done.
Outputs do not depend on compaction: greedy steps are per-row functions of the prefix, and
seeded draws are keyed per row: verification by (seed, root position, node), sampled drafts by
(seed, draft position); only unseeded sampling (a shared generator) sees the batch's shape. `proposer=None`
runs target-only decoding through the same loop (a root-only tree), so baselines share every
line of code with speculation.

Deliberately not here: proposers (proposers/), acceptance rules (verify.py), logit processing
(sampling.py), KV layout (kv.py), benchmarks and reports (bench/, eval/).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch
from torch import Tensor, nn

from drafttrain.decode.allocator import keep_freed_memory
from drafttrain.decode.kv import KVState, target_forward
from drafttrain.decode.proposers.base import Proposer
from drafttrain.decode.sampling import row_seeds
from drafttrain.decode.stats import DecodeStats
from drafttrain.decode.tree import DraftTree, DynamicTree, StaticTree, parse_tree, root_only
from drafttrain.decode.verify import VerifyResult, verify_greedy_ids, verify_tree
from drafttrain.eos import eos_ids

__all__ = ["DecodeState", "GenerateOutput", "speculative_generate"]


@dataclass
class DecodeState:
    """Everything a proposer may read about the current step.

    Attributes:
        target: the target model.
        kv: the target's KVState (committed = every accepted token except the root).
        tokens: per row, prompt (no padding) + emitted tokens; the last one is the root.
        root: [B] last accepted token (node 0 of the next tree).
        root_pos: [B] its absolute position (= len(tokens[b]) - 1).
        active: [B] rows still generating.
        temperature / top_k / top_p: sampling settings (target and draft alike).
        generator: RNG for draft sampling and verification when no seed keys them.
        seed: keys sampled drafts (`keyed_categorical`) and verification draws.
        gamma: chain length requested by the caller (None: the proposer's default).
        tree: None (chain), StaticTree or DynamicTree.
        options: extra keyword options passed to speculative_generate.
        greedy_head: "argmax" (fused LM-head argmax, no logits) or "logits" (the model's own
            forward) for greedy verification.
        stats: the call's DecodeStats (adaptive / hybrid proposers record their choices there).
        rows: the caller's row (index into input_ids) of each batch row (finished rows leave the
            batch, see the module docstring).
        room: [B] tokens each row may still emit (max_new_tokens minus what it emitted); a draft
            deeper than room can never be emitted (the step's output is cut there).
    """

    target: nn.Module
    kv: KVState
    tokens: list[list[int]]
    root: Tensor
    root_pos: Tensor
    active: Tensor
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    seed: int | Tensor | None = None
    gamma: int | None = None
    tree: StaticTree | DynamicTree | None = None
    options: dict | None = None
    greedy_head: str = "argmax"
    stats: DecodeStats | None = None
    rows: list[int] | None = None
    room: Tensor | None = None


@dataclass
class GenerateOutput:
    """Result of `speculative_generate`.

    Attributes:
        sequences: per row, the NEW token ids (prompt excluded), EOS included when hit.
        stats: counters of the call (τ, acceptance, time split).
    """

    sequences: list[list[int]]
    stats: DecodeStats

    def padded(self, pad_token_id: int = 0) -> tuple[Tensor, Tensor]:
        """(tokens [B, max_len] right-padded, lengths [B])."""
        lengths = torch.tensor([len(s) for s in self.sequences])
        out = torch.full((len(self.sequences), int(lengths.max(initial=0))), pad_token_id, dtype=torch.long)
        for b, s in enumerate(self.sequences):
            out[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        return out, lengths


# ---- the four steps -----------------------------------------------------------------------------
def prefill(state: DecodeState, input_ids: Tensor, attention_mask: Tensor, proposer: Proposer | None,
            stats: DecodeStats) -> None:
    """Target forward over each prompt minus its last token; commits that KV."""
    B, P = input_ids.shape
    hidden_ids = tuple(proposer.needs_hidden_states) if proposer is not None else ()
    hidden: dict[int, Tensor] = {}
    if P > 1:
        ids, valid = input_ids[:, :-1], attention_mask[:, :-1].bool()  # [B, P-1]
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        col = torch.arange(P - 1, device=ids.device).expand(B, -1)
        parents = torch.where(col > 0, col - 1, -1)  # causal chain; padding masked by `valid`
        with stats.timer("prefill"):
            if _rows_apart(valid):
                hidden = _prefill_rows(state, ids, valid, positions, hidden_ids)
            else:
                _, hidden = target_forward(state.target, state.kv, ids, positions, parents, valid=valid,
                                           hidden_ids=hidden_ids, head="none")  # prompt logits: unused
                state.kv.commit(torch.where(valid, col, -1))
        stats.prefill_forwards += 1
    if proposer is not None:
        with stats.timer("draft"):
            proposer.prefill(state, hidden)


#: On CPU a batch's prompts are prefilled one row at a time when padding would be more than this
#: share of the padded batch's tokens: prefill there is compute-bound, so its time follows the tokens
#: computed, padding included. Session 37, EPYC, gemma-3-270m, four batches of four (ms in all):
#: `bench=mixed`'s prompts (28-182 tokens) 1,620-1,720 batched vs 1,210-1,310 row by row; lengths
#: 10/20/30/60 690-710 vs 565; 8/12/40/200 2,320-2,340 vs 955-975.
PREFILL_PADDING_SHARE = 0.25


def _rows_apart(valid: Tensor) -> bool:
    """Whether to prefill row by row (see PREFILL_PADDING_SHARE)."""
    B, n = valid.shape
    if B == 1 or valid.device.type != "cpu":
        return False
    real = float(valid.sum())
    return 0 < real < (1 - PREFILL_PADDING_SHARE) * B * n


def _prefill_rows(state: DecodeState, ids: Tensor, valid: Tensor, positions: Tensor,
                  hidden_ids: tuple[int, ...]) -> dict[int, Tensor]:
    """Prefill of each row's real tokens alone, assembled into the batch's left-padded cache (the
    same entries, positions and validity a batched prefill commits, padding entries zero) and
    hidden states ([B, P-1, H], zero at padding)."""
    B, n = ids.shape
    rows, hidden = [], {}
    for b in range(B):
        m = int(valid[b].sum())
        if m == 0:  # a one-token prompt: nothing to prefill, its columns are all padding
            rows.append((0, None))
            continue
        kv = KVState.for_model(state.target, 1, ids.device)
        pos = positions[b:b + 1, n - m:]
        par = torch.arange(-1, m - 1, device=ids.device)[None]
        _, h = target_forward(state.target, kv, ids[b:b + 1, n - m:], pos, par, hidden_ids=hidden_ids, head="none")
        kv.commit(torch.arange(m, device=ids.device)[None], prefix=True)
        rows.append((m, [(layer.keys, layer.values) for layer in kv.cache.layers]))
        for i, t in h.items():
            if i not in hidden:
                hidden[i] = t.new_zeros(B, n, t.shape[-1])
            hidden[i][b, n - m:] = t[0]
    some = next(layers for m, layers in rows if m)
    for li in range(len(some)):
        k0, v0 = some[li]
        keys = k0.new_zeros(B, k0.shape[1], n, k0.shape[-1])
        values = v0.new_zeros(B, v0.shape[1], n, v0.shape[-1])
        for b, (m, layers) in enumerate(rows):
            if m:
                keys[b, :, n - m:], values[b, :, n - m:] = layers[li]
        state.kv.cache.update(keys, values, li)
    state.kv.valid, state.kv.pos = valid.clone(), positions.clone()  # as a batched commit leaves them
    return hidden


def draft(state: DecodeState, proposer: Proposer | None) -> DraftTree:
    """Asks the proposer for a tree; finished rows get an empty one."""
    if proposer is None:
        return root_only(state.root)
    tree = proposer.propose(state)
    if tree.tokens.shape[0] != state.root.shape[0] or not torch.equal(tree.tokens[:, 0], state.root):
        raise RuntimeError(f"{type(proposer).__name__}.propose returned a tree whose node 0 is not the root")
    return tree.without_rows(~state.active)


def verify(state: DecodeState, tree: DraftTree, proposer: Proposer | None
           ) -> tuple[VerifyResult, dict[int, Tensor]]:
    """One target forward over the tree, then the acceptance rule of verify.py."""
    positions = state.root_pos[:, None] + tree.depths()  # [B, N]
    node_parents = torch.where(tree.parents >= 0, state.kv.pending_len + tree.parents, tree.parents)
    hidden_ids = tuple(proposer.needs_hidden_states) if proposer is not None else ()
    if state.temperature == 0 and state.greedy_head == "argmax":
        # Greedy: the target's choice at each node, from the fused LM-head argmax (no logits).
        top, hidden = target_forward(state.target, state.kv, tree.tokens, positions, node_parents,
                                     hidden_ids=hidden_ids, head="argmax")  # [B, N]
        return verify_greedy_ids(top, tree.tokens, tree.parents), hidden
    logits, hidden = target_forward(state.target, state.kv, tree.tokens, positions, node_parents,
                                    hidden_ids=hidden_ids)  # logits [B, N, V]
    result = verify_tree(logits, tree.tokens, tree.parents, tree.draft_probs,
                         temperature=state.temperature, top_k=state.top_k, top_p=state.top_p,
                         generator=state.generator, seed=state.seed, positions=positions,
                         draft_vocab=tree.draft_vocab)
    return result, hidden


def accept(state: DecodeState, tree: DraftTree, result: VerifyResult, out: list[list[int]],
           max_new_tokens: int, eos: set[int], stats: DecodeStats, rows: list[int] | None = None) -> None:
    """Emits accepted drafts + next token per row, cut at EOS and at max_new_tokens; keeps the
    accepted path's KV; moves the root. `rows[b]`: the caller's row of batch row b (out, stats)."""
    B = tree.tokens.shape[0]
    tokens = tree.tokens.tolist()
    paths = result.accepted.tolist()
    num = result.num_accepted.tolist()
    next_tok = result.next_token.tolist()
    active = state.active.tolist()
    depth_drafted = tree.depths().max(1).values.tolist()
    stats.record_step(depth_drafted, num, active)
    width = 1 + max(num, default=0)
    keep = [[-1] * width for _ in range(B)]  # built in Python: one tensor at the end, not two writes a row
    for b in range(B):
        if not active[b]:
            continue
        r = b if rows is None else rows[b]
        path = paths[b][: num[b]]
        emitted = [tokens[b][i] for i in path] + [next_tok[b]]
        room = max_new_tokens - len(out[r])
        cut = next((j + 1 for j, t in enumerate(emitted) if t in eos), len(emitted))
        emitted = emitted[: min(cut, room)]
        out[r].extend(emitted)
        state.tokens[b].extend(emitted)
        stats.tokens_emitted += len(emitted)
        stats.per_row_tokens[r] += len(emitted)
        stats.per_row_forwards[r] += 1
        if len(out[r]) >= max_new_tokens or (emitted and emitted[-1] in eos):
            active[b] = False
        keep[b][: 1 + len(path)] = [0, *path]  # the root's KV and the accepted path's
    # pending = the tree's N nodes: keep root + path, per row (holes where a row kept fewer)
    in_order = list(range(width))
    state.kv.commit(torch.tensor(keep, dtype=torch.long, device=tree.tokens.device),
                    prefix=all(k == in_order for k in keep))
    state.active = torch.tensor(active, device=state.active.device)
    state.root = torch.tensor([t[-1] for t in state.tokens], device=state.root.device)
    state.root_pos = torch.tensor([len(t) - 1 for t in state.tokens], device=state.root.device)
    r = range(B) if rows is None else rows
    state.room = torch.tensor([max_new_tokens - len(out[i]) for i in r], device=state.root.device)


def _compact(state: DecodeState, proposer: Proposer | None) -> bool:
    """Drops finished rows from the batch (state.rows follows); False, changing nothing, when
    the proposer cannot select rows."""
    idx = state.active.nonzero()[:, 0]
    if proposer is not None and not proposer.select_rows(idx):
        return None
    state.kv.select_rows(idx)
    keep = idx.tolist()
    state.tokens = [state.tokens[i] for i in keep]
    state.root, state.root_pos, state.active = state.root[idx], state.root_pos[idx], state.active[idx]
    if state.room is not None:
        state.room = state.room[idx]
    if isinstance(state.seed, Tensor):  # per-row seeds follow their rows
        state.seed = state.seed[idx]
    state.rows = [state.rows[i] for i in keep]
    return True


# ---- public entry point -------------------------------------------------------------------------
@torch.inference_mode()
def speculative_generate(target: nn.Module, proposer: Proposer | None, input_ids: Tensor, *,
                         attention_mask: Tensor | None = None, max_new_tokens: int,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         seed: int | Sequence[int] | Tensor | None = None,
                         eos_token_id: int | list[int] | None = None,
                         gamma: int | None = None, tree=None, generator: torch.Generator | None = None,
                         greedy_head: str = "argmax", compact: bool = True, **opts) -> GenerateOutput:
    """Lossless speculative decoding of a batch of prompts.

    Args:
        target: an HF causal LM (transformers v5), in eval mode.
        proposer: a `Proposer` (see `load_proposer`), or None for target-only decoding.
        input_ids: [B, P] prompts, LEFT-padded when lengths differ.
        attention_mask: [B, P] 1 = real token; required when prompts are padded.
        max_new_tokens: new tokens per row (a row stops earlier on EOS).
        temperature: 0 = greedy; > 0 = sampling (target and draft processed alike).
        top_k / top_p: sampling filters (0 / 1.0 = off).
        seed: keys sampled drafts and verification's counter-based draws per row, which makes
            a row's output independent of the batch (its other rows, its size, compaction). An
            int gives every caller row its own stream (`row_seeds`: row i is keyed by the seed and
            i, so N copies of a prompt give N samples); a sequence or [B] tensor gives one seed
            per row as it is (like per-request seeds: equal seeds, equal streams).
        eos_token_id: id or ids that end a row (included in its output; [] = none); default:
            every id the target's generation config and config name (`drafttrain.eos`).
        gamma: chain length (drafts per step) for chain proposers.
        tree: None (chain), "dynamic" / DynamicTree (EAGLE-2), or a list of rank paths (static).
        generator: optional torch.Generator for the random draws (unused when `seed` is given,
            except by proposers that sample on their own).
        greedy_head: "argmax" verifies greedy steps from the fused LM-head argmax (kernels/greedy.py,
            Triton on CUDA) without materialising logits; "logits" uses the model's own forward.
        compact: drop finished rows from the batch after the step they finish in (default);
            False keeps them, with empty trees, until every row is done.
        **opts: kept in `state.options` for proposers.

    Returns:
        GenerateOutput(sequences=new tokens per row, stats=DecodeStats).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    B, P = input_ids.shape
    device = input_ids.device
    if device.type == "cpu":
        keep_freed_memory()  # large per-step temporaries stop faulting their pages in (allocator.py)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded: attention_mask[:, -1] must be 1 for every row")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = _eos_set(target, eos_token_id)
    if isinstance(seed, Integral) or (isinstance(seed, Tensor) and seed.dim() == 0):
        seed = row_seeds(int(seed), B, device)  # one stream per caller row, not one shared by all
    elif seed is not None:
        seed = torch.as_tensor(seed, dtype=torch.long, device=device).reshape(-1)
        if seed.numel() != B:
            raise ValueError(f"seed has {seed.numel()} values for {B} rows; give one int or one per row")
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(seed[0]))
    tokens = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask)]
    state = DecodeState(
        target=target, kv=KVState.for_model(target, B, device), tokens=tokens,
        root=input_ids[:, -1].clone(), root_pos=torch.tensor([len(t) - 1 for t in tokens], device=device),
        active=torch.ones(B, dtype=torch.bool, device=device), temperature=float(temperature),
        top_k=top_k, top_p=top_p, generator=generator, seed=seed, gamma=gamma, tree=parse_tree(tree), options=opts,
        greedy_head=greedy_head, room=torch.full((B,), max_new_tokens, dtype=torch.long, device=device),
    )
    stats = DecodeStats(per_row_tokens=[0] * B, per_row_forwards=[0] * B)
    state.stats = stats
    out: list[list[int]] = [[] for _ in range(B)]

    state.rows = list(range(B))
    prefill(state, input_ids, attention_mask, proposer, stats)
    while bool(state.active.any()):
        with stats.timer("draft"):
            tree = draft(state, proposer)
        with stats.timer("verify"):
            result, hidden = verify(state, tree, proposer)
        with stats.timer("other"):
            accept(state, tree, result, out, max_new_tokens, eos, stats, state.rows)
        if proposer is not None:
            with stats.timer("draft"):
                proposer.observe(state, tree, result, hidden)
        if compact and not bool(state.active.all()) and bool(state.active.any()):
            with stats.timer("other"):  # after a row finished (every kept row is active)
                compact = _compact(state, proposer)  # False: the proposer cannot, keep the full batch
    return GenerateOutput(out, stats)


def _eos_set(target: nn.Module, eos_token_id) -> set[int]:
    """The ids that end a row: `eos_token_id` when given, else the target's (`drafttrain.eos`)."""
    return set(eos_ids(target, explicit=eos_token_id))
