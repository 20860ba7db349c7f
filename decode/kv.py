"""KV-cache bookkeeping for tree decoding: who may attend to whom, and which entries survive.

A `KVState` wraps a transformers `DynamicCache` built WITHOUT a config, so every layer is a
plain growing layer (below) that stores all keys (sliding-window layers included). The sliding window
is enforced by the attention mask we build, not by the cache: v5's `DynamicSlidingWindowLayer`
drops keys beyond the window on every update, which makes gathering an accepted path out of
a verified tree impossible once the window is full. Keeping everything costs memory on long
Gemma 3 contexts; it buys exact in-place reindexing for every layer type.

Cache entries come in two segments:
  * committed: tokens known to be part of the output (or prompt). Per row, `valid` marks real
    entries (left padding and holes left by rows that accepted fewer tokens are False) and
    `pos` gives each entry's absolute position.
  * pending: tokens fed since the last commit (a draft tree). Their ancestry says which pending
    entries each pending entry may see (its tree ancestors and itself).
`commit(keep)` gathers the kept pending entries per row into the committed segment (rows may
keep different numbers; shorter rows get holes); `rollback()` drops the pending segment;
`select_rows(idx)` keeps a subset of the batch rows (finished rows leave the batch).

Masks are additive float masks [B, 1, q, kv] (0 = attend, dtype min = blocked), which both
the eager and SDPA attention paths of transformers v5 accept unchanged when passed as 4D;
models with sliding layers (Gemma 3) get a dict {layer_type: mask}, which their forward uses
as-is.

Each layer's keys and values live in a buffer with room to spare (`_GrowingLayer`): feeding n
tokens writes them in place instead of `DynamicLayer`'s `torch.cat` of the whole cache (two per
layer per step), a commit that keeps a prefix or a rollback only moves the length, and the buffer
doubles when full. Session 23, 2-core Zen 2, Gemma 3 270M bf16, one greedy step + commit through
the AVX2 kernels (medians of 15): context 256 batch 1 37.6 ms (37.3 with `cat`, the same), context
1,024 39.1 (42.0), context 256 batch 16 108.7 (114.9). Tried there and dropped: the cache and
attention in float32 (bf16 SDPA of one query is 5x slower than float32 in a loop of its own, but
not inside the step: 38.0 vs 37.7 ms at batch 1, 46.9 vs 45.1 at batch 4).

Deliberately not here: fixed-size (compiled) caches, paged attention, chunked attention
(Llama 4), quantised caches. Calling a model is the caller's job (`target_forward` is the one
generic helper).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from drafttrain.decode.kernels import cpu_layers
from drafttrain.decode.kernels.cpu_linear import head_argmax, routes
from drafttrain.textconfig import text_config

__all__ = ["KVState", "target_forward", "truncated_layers", "attention_layout"]


def attention_layout(config) -> tuple[list[str] | None, int | None]:
    """(layer_types or None, sliding_window or None) of a causal LM config.

    Raises:
        NotImplementedError: for layer types the mask builder does not know (chunked attention).
    """
    config = text_config(config)
    types = getattr(config, "layer_types", None)
    if not types:
        return None, None
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise NotImplementedError(f"tree decoding does not support layer types {sorted(unknown)}")
    window = getattr(config, "sliding_window", None) if "sliding_attention" in types else None
    return list(types), window


class _GrowingLayer(DynamicLayer):
    """A cache layer whose keys and values are views of buffers with spare room: `update` writes
    new entries in place (no copy of the layer's cache per step); the buffers double when full."""

    def __init__(self):
        self._kbuf = self._vbuf = None
        self._len = 0
        super().__init__()

    # `keys` / `values` are the filled part; assigning a tensor makes it the whole buffer (the
    # parent class and transformers' utilities assign, e.g. `reset`).
    @property
    def keys(self) -> Tensor | None:
        return None if self._kbuf is None else self._kbuf[:, :, : self._len]

    @keys.setter
    def keys(self, t: Tensor | None) -> None:
        self._kbuf, self._len = t, (0 if t is None else t.shape[-2])

    @property
    def values(self) -> Tensor | None:
        return None if self._vbuf is None else self._vbuf[:, :, : self._len]

    @values.setter
    def values(self, t: Tensor | None) -> None:
        self._vbuf, self._len = t, (0 if t is None else t.shape[-2])

    @property
    def length(self) -> int:
        """Entries held (the filled part of the buffers)."""
        return self._len

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[-2]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, L = key_states.shape[-2], self._len
        kbuf, vbuf, _ = self.reserve(key_states.shape[:2], n, key_states.shape[-1], key_states.dtype, key_states.device)
        kbuf[:, :, L: L + n] = key_states
        vbuf[:, :, L: L + n] = value_states
        self._len = L + n
        return self.keys, self.values

    def reserve(self, lead: tuple[int, int], n: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor, int]:
        """Makes room for n more entries; returns (key buffer, value buffer, filled length): contiguous
        [B, heads, capacity, head_dim] buffers whose entries from the filled length on are free.
        A writer that fills entries L .. L + n itself calls `advance(n)` after."""
        L = self._len
        if self._kbuf is None or L + n > self.capacity or not self._kbuf.is_contiguous():
            cap = max(2 * self.capacity, L + n, 64)
            kbuf = torch.empty(*lead, cap, head_dim, dtype=dtype, device=device)
            vbuf = torch.empty(*lead, cap, head_dim, dtype=dtype, device=device)
            if L:
                kbuf[:, :, :L] = self._kbuf[:, :, :L]
                vbuf[:, :, :L] = self._vbuf[:, :, :L]
            self._kbuf, self._vbuf = kbuf, vbuf
            self.device, self.is_initialized = device, True
        return self._kbuf, self._vbuf, L

    def advance(self, n: int) -> None:
        """Counts n entries written into the buffers `reserve` returned as filled."""
        self._len += n

    def truncate(self, length: int) -> None:
        """Keeps the first `length` entries (the rest of the buffer is spare room)."""
        self._len = min(length, self._len)

    def gather(self, idx: Tensor, start: int = 0) -> None:
        """Keeps the first `start` entries, then entries start + idx [B, m] (per row, in order), in
        place: only the entries after `start` are read and written (a step's pending tail, not the
        whole cache)."""
        for buf in (self._kbuf, self._vbuf):
            tail = buf[:, :, start: self._len]
            g = tail.gather(2, idx[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[-1]))
            buf[:, :, start: start + idx.shape[1]] = g
        self._len = start + idx.shape[1]

    def select(self, rows: Tensor | None = None, cols: Tensor | None = None) -> None:
        """Keeps batch rows `rows` and then entries `cols` (fresh buffers, no spare room)."""
        k, v = self.keys, self.values
        if rows is not None:
            k, v = k[rows], v[rows]
        if cols is not None:
            k, v = k[:, :, cols], v[:, :, cols]
        self._kbuf, self._vbuf, self._len = k.contiguous(), v.contiguous(), k.shape[-2]


class KVState:
    """A DynamicCache plus the per-row validity / position bookkeeping tree attention needs."""

    def __init__(self, batch_size: int, device: torch.device, *, layer_types=None, sliding_window=None):
        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = _GrowingLayer
        self.layer_types = layer_types
        self.window = sliding_window
        B = batch_size
        self.valid = torch.zeros(B, 0, dtype=torch.bool, device=device)  # [B, Lc]
        self.pos = torch.zeros(B, 0, dtype=torch.long, device=device)  # [B, Lc]
        self.pend_valid = torch.zeros(B, 0, dtype=torch.bool, device=device)  # [B, Lp]
        self.pend_pos = torch.zeros(B, 0, dtype=torch.long, device=device)  # [B, Lp]
        # pending entries' ancestors-or-self, as [B, Lp, Lp] bool (`_anc`) or per-row bitmasks
        # (`_anc_bits`), whichever the last `extend` built; the other is derived when asked for
        self._anc: Tensor | None = torch.zeros(B, 0, 0, dtype=torch.bool, device=device)
        self._anc_bits: list[list[int]] | None = [[] for _ in range(B)]

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, device: torch.device) -> KVState:
        types, window = attention_layout(model.config)
        return cls(batch_size, device, layer_types=types, sliding_window=window)

    @property
    def committed_len(self) -> int:
        return self.valid.shape[1]

    @property
    def pending_len(self) -> int:
        return self.pend_valid.shape[1]

    def seq_lengths(self) -> Tensor:
        """[B] number of real committed entries per row."""
        return self.valid.sum(-1)

    # ---- extend: register new (pending) tokens and build their mask --------------------------------
    def extend(self, positions: Tensor, parents: Tensor, valid: Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> Tensor | dict[str, Tensor]:
        """Registers n new tokens as pending and returns the attention mask for feeding them.

        Args:
            positions: [B, n] absolute positions of the new tokens.
            parents: [B, n] index into the pending segment INCLUDING the new tokens (so new
                token j may name an earlier new token, index Lp + j' with j' < j) of the token
                each new token extends; -1 = extends the committed sequence directly (sees all
                committed entries, no pending ones); -2 = padding (sees only itself).
            valid: [B, n] bool; False marks padding. Defaults to parents != -2.
            dtype: float dtype of the additive mask (the model's dtype).

        Returns:
            [B, 1, n, Lc + Lp + n] additive mask, or {layer_type: mask} for sliding-window models
            (one tensor for both types while every key lies within the window).
        """
        B, n = positions.shape
        Lp = self.pending_len
        real = parents != -2
        valid = real if valid is None else valid & real
        pend_valid = torch.cat([self.pend_valid, valid], 1)  # [B, Lp + n]
        if B * n <= _SMALL and Lp + n <= _SMALL:
            see_pend = self._see_pending_small(parents, valid, pend_valid, Lp)
        else:
            see_pend = self._see_pending(parents, valid, pend_valid, Lp)
        self.pend_valid = pend_valid
        self.pend_pos = torch.cat([self.pend_pos, positions], 1)
        see_comm = self.valid[:, None, :] & valid[:, :, None]  # [B, n, Lc]
        allowed = torch.cat([see_comm, see_pend], -1)  # [B, n, Lc + Lp + n]
        if self.layer_types is None or self.window is None:
            return _additive(allowed, dtype)
        full = _additive(allowed, dtype)
        key_pos = torch.cat([self.pos, self.pend_pos], 1)  # [B, Lc + Lp + n]
        if n and int(positions.max()) - int(key_pos.min()) < self.window:  # every key is near every query
            return {t: full for t in set(self.layer_types)}
        near = (positions[:, :, None] - key_pos[:, None, :]) < self.window
        masks = {"full_attention": full, "sliding_attention": _additive(allowed & (near | ~valid[:, :, None]), dtype)}
        return {t: masks[t] for t in set(self.layer_types)}

    def _see_pending_small(self, parents: Tensor, valid: Tensor, pend_valid: Tensor, Lp: int) -> Tensor:
        """`_see_pending` for a few tokens, in Python over bitmasks (one per pending entry: its
        ancestors-or-self) instead of ~10 tensor ops per new token: a decode step's 1-6 tokens."""
        B, n = parents.shape
        par, val = parents.tolist(), valid.tolist()
        old = self._ancestor_bits()
        pend_valid = pend_valid.tolist()
        rows, bits = [], []
        for b in range(B):
            anc = list(old[b])
            seen = sum(1 << i for i, v in enumerate(pend_valid[b]) if v)  # valid pending entries, new ones too
            for j in range(n):
                p, own = par[b][j], 1 << (Lp + j)
                anc.append((anc[p] if p >= 0 else 0) | own)
            width = Lp + n
            rows.append([[bool((anc[Lp + j] & seen if val[b][j] else 1 << (Lp + j)) >> k & 1) for k in range(width)]
                         for j in range(n)])
            bits.append(anc)
        self._anc_bits, self._anc = bits, None
        return torch.tensor(rows, dtype=torch.bool, device=parents.device).view(B, n, Lp + n)

    def _see_pending(self, parents: Tensor, valid: Tensor, pend_valid: Tensor, Lp: int) -> Tensor:
        """[B, n, Lp + n] which pending entries (old and new) each new token sees: its tree ancestors
        and itself among the valid ones (padding sees only itself); records the new ancestry."""
        B, n = parents.shape
        device = parents.device
        col = torch.arange(n, device=device)
        if Lp == 0 and bool(((parents == col - 1) | (parents < 0)).all()):
            # chains only (a prefill, a catch-up; -1 starts a chain): token j's ancestors-or-self are
            # j and the tokens back to its chain's start, no loop over the n tokens
            start = torch.where(parents < 0, col, 0).cummax(1).values  # [B, n] where j's chain starts
            anc_all = (col[None, None, :] <= col[None, :, None]) & (col[None, None, :] >= start[:, :, None])
        else:
            anc_all = torch.zeros(B, Lp + n, Lp + n, dtype=torch.bool, device=device)  # ancestors-or-self
            anc_all[:, :Lp, :Lp] = self._ancestor_tensor()
            rows = torch.arange(B, device=device)
            for j in range(n):
                p = parents[:, j]  # [B]
                inherited = anc_all[rows, p.clamp(min=0)] & (p >= 0)[:, None]  # [B, Lp + n]
                inherited[:, Lp + j] = True
                anc_all[:, Lp + j] = inherited
        self._anc, self._anc_bits = anc_all, None
        anc_new = anc_all[:, Lp:]  # [B, n, Lp + n]
        self_only = torch.zeros_like(anc_new)
        self_only[:, torch.arange(n), Lp + torch.arange(n)] = True
        return torch.where(valid[:, :, None], anc_new & pend_valid[:, None, :], self_only)

    def _ancestor_bits(self) -> list[list[int]]:
        """Per row, per pending entry: the bitmask of its ancestors-or-self among pending entries."""
        if self._anc_bits is None:
            self._anc_bits = [[sum(1 << k for k, x in enumerate(r) if x) for r in row] for row in self._anc.tolist()]
        return self._anc_bits

    def _ancestor_tensor(self) -> Tensor:
        """[B, Lp, Lp] bool: pending entry i's ancestors-or-self among pending entries (row i)."""
        if self._anc is None:
            Lp = self.pending_len
            self._anc = torch.tensor([[[bool(a >> k & 1) for k in range(Lp)] for a in row] for row in self._anc_bits],
                                     dtype=torch.bool, device=self.valid.device).view(len(self._anc_bits), Lp, Lp)
        return self._anc

    # ---- commit / rollback ------------------------------------------------------------------------
    def commit(self, keep: Tensor, *, prefix: bool | None = None) -> None:
        """Moves the kept pending entries, per row, into the committed segment.

        Args:
            keep: [B, m] indices into the pending segment, in order; -1 leaves a hole (a row
                that keeps fewer entries than another).
            prefix: whether every row keeps entries 0 .. m-1 (a caller that built `keep` on the
                host knows; None: checked here).
        """
        Lc, Lp = self.committed_len, self.pending_len
        m = keep.shape[1]
        device = keep.device
        # Every row keeping the first m pending entries in order (target-only steps, a chain's
        # accepted prefix at batch 1) is a slice of the cache, not a gather of all of it.
        if prefix is None:
            prefix = bool((keep == torch.arange(m, device=device)).all())
        prefix = prefix and m <= Lp
        idx = None if prefix else keep.clamp(min=0)  # into the pending tail; the committed part stays
        for layer in self._layers():
            if layer.length != Lc + Lp:
                raise RuntimeError("cache layer length out of sync with KVState (roll back drafts first)")
            if prefix:
                layer.truncate(Lc + m)
            else:
                layer.gather(idx, start=Lc)
        if prefix:
            kept_valid, kept_pos = self.pend_valid[:, :m], self.pend_pos[:, :m]
        else:
            k = keep.clamp(min=0)
            kept_valid, kept_pos = (keep >= 0) & self.pend_valid.gather(1, k), self.pend_pos.gather(1, k)
        self.valid = torch.cat([self.valid, kept_valid], 1)
        self.pos = torch.cat([self.pos, kept_pos], 1)
        self._clear_pending()

    def select_rows(self, idx: Tensor) -> None:
        """Keeps only batch rows `idx` ([B'] long, in the new order), in the cache and in the
        bookkeeping; then drops committed columns no kept row uses (e.g. the left padding of
        longer, finished prompts). Only between steps: nothing may be pending."""
        if self.pending_len:
            raise RuntimeError("select_rows with pending entries (commit or roll back first)")
        idx = idx.to(self.valid.device)
        self.valid, self.pos = self.valid[idx], self.pos[idx]
        used = self.valid.any(0)  # [Lc]
        cols = None if bool(used.all()) else used.nonzero()[:, 0]
        for layer in self._layers():
            layer.select(idx, cols)
        if cols is not None:
            self.valid, self.pos = self.valid[:, cols], self.pos[:, cols]
        self._clear_pending()

    def rollback(self) -> None:
        """Drops every pending entry (in every layer that holds more than the committed ones)."""
        for layer in self._layers():
            layer.truncate(self.committed_len)
        self._clear_pending()

    def _layers(self) -> list[_GrowingLayer]:
        """The cache layers holding entries (every layer is a `_GrowingLayer`: see `__init__`)."""
        return [layer for layer in self.cache.layers if layer.length]

    def _clear_pending(self) -> None:
        self.pend_valid, self.pend_pos = self.valid[:, :0], self.pos[:, :0]  # empty views: no allocation
        self._anc, self._anc_bits = None, [[] for _ in range(self.valid.shape[0])]


#: `extend` builds ancestry in Python up to this many new tokens (batch x n) and pending entries
_SMALL = 64
_FILL: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, q, k] bool -> [B, 1, q, k] additive float mask (0 = attend, the dtype's min = blocked)."""
    key = (dtype, allowed.device)
    if key not in _FILL:
        _FILL[key] = (torch.zeros((), dtype=dtype, device=allowed.device),
                      torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device))
    zero, blocked = _FILL[key]
    return torch.where(allowed, zero, blocked)[:, None]


def target_forward(model: nn.Module, kv: KVState, input_ids: Tensor, positions: Tensor, parents: Tensor,
                   *, valid: Tensor | None = None, hidden_ids: list[int] | tuple[int, ...] = (),
                   head: str = "logits"):
    """Feeds n new tokens of a tree through an HF causal LM, appending them as pending KV.

    Args:
        model: an HF causal LM (transformers v5).
        kv: the model's KVState.
        input_ids: [B, n] tokens.
        positions: [B, n] absolute positions.
        parents: [B, n] see `KVState.extend`.
        valid: [B, n] optional padding mask.
        hidden_ids: HF hidden_states indices to return.
        head: "logits" (the model's own full forward), "argmax" (decoder body, then the fused
            LM-head argmax of kernels/greedy.py: never materialises [B, n, V] logits), "hidden"
            (decoder body; returns its final post-norm states for the caller's own head, e.g. a
            draft LM drafting from a subset of the head's rows) or "none" (decoder body only,
            e.g. for prefill, whose logits nobody reads).

    Returns:
        (logits [B, n, V] | argmax ids [B, n] | final hidden [B, n, H] | None, {index: hidden [B, n, H]}).
    """
    layers = cpu_layers.fused(model)
    use_fused = layers is not None and input_ids.numel() <= cpu_layers.MAX_ROWS and not torch.is_grad_enabled()
    # the fused layers add fp32 masks (a blocked entry's exp is 0 from either dtype's min)
    dtype = torch.float32 if use_fused else next(model.parameters()).dtype
    mask = kv.extend(positions, parents, valid, dtype=dtype)
    head_module = model.get_output_embeddings()
    if head != "logits" and getattr(head_module, "bias", None) is not None:
        head = "logits" if head == "argmax" else head  # a biased head: keep the model's own path
    if use_fused:
        # one C++ call per decoder layer (kernels/cpu_layers.py); Gemma 3 has no final logit cap
        last, states = layers.forward(input_ids, positions, mask, kv.cache)
        hidden = {i: states[i] for i in hidden_ids}
        if head == "logits":
            return head_module(last), hidden
    else:
        kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=kv.cache,
                      use_cache=True, output_hidden_states=bool(hidden_ids))
        if head == "logits":
            out = model(**kwargs)
            return out.logits, {i: out.hidden_states[i] for i in hidden_ids}
        body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        out = body(**kwargs)
        last = out.last_hidden_state
        hidden = {i: out.hidden_states[i] for i in hidden_ids} if hidden_ids else {}
    result = None
    if head == "argmax":
        # Positive logit scales and tanh soft caps are monotone: argmax(h @ W^T) is the
        # model's greedy token.
        from drafttrain.decode.kernels.greedy import greedy_lm_head_argmax

        flat = last.reshape(-1, last.shape[-1])  # [B * n, H]
        if routes(head_module, flat.shape[0]):
            # the CPU kernel reads the head once for every row, argmax fused where it can
            result = head_argmax(head_module, flat).view(last.shape[:2])  # first maximum on ties
        else:
            result = greedy_lm_head_argmax(flat, head_module.weight).view(last.shape[:2])
    elif head == "hidden":
        result = last
    return result, hidden


@contextmanager
def truncated_layers(model: nn.Module, num_layers: int):
    """Temporarily run only the first `num_layers` decoder layers of an HF causal LM.

    Every v5 decoder-only model loops over `self.layers[: config.num_hidden_layers]`, so swapping
    in a shorter ModuleList (sharing the same modules) runs a prefix of the stack; the final norm
    still applies. Attention modules keep their layer_idx, so they read and write cache layers
    0..num_layers-1 of whatever cache is passed.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    full = base.layers
    base.layers = nn.ModuleList(list(full)[:num_layers])
    try:
        yield model
    finally:
        base.layers = full
