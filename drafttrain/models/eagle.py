"""EAGLE-3 and EAGLE-1 feature drafters as plain `nn.Module`s.

EAGLE-3 (arXiv 2503.01840): hidden states of three target layers are fused (fc, 3H -> H); one
decoder layer whose attention reads concat(norm(token embedding), norm(feature)) (2H wide)
produces the drafter's next feature; its own norm + LM head over a reduced draft vocabulary
give the draft logits. `d2t[i]` is the offset from draft id i to its target id; `t2d` is a bool
mask over the target vocabulary.

EAGLE-1 (arXiv 2401.15077): fc(concat(token embedding, feature), 2H -> H) then one plain
decoder layer (no input norm) predicts the target's next post-norm feature; the TARGET's LM head
reads it (full vocabulary, no own head).

Token/feature alignment, shared by training and the decoder:
    drafter input at position t = (feature f_t of token x_t from the target, embedding of x_{t+1})
    with position id t + 1; the output predicts x_{t+2} and is the drafter's own guess of the
    feature at t + 1, which it feeds back as `hidden` when it unrolls (step k of an unroll for
    base position t therefore uses position id t + 1 + k).

What this module does not do: it owns no embedding (the target's is passed in and reused,
including Gemma's sqrt(H) scale, which lives inside Gemma's embedding module), it does not
run the target, and it knows nothing about trees (the decoder's proposer builds those).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafttrain.vocab import DraftVocab, build_vocab_mapping, validate_vocab_mapping  # noqa: F401 (re-exported)


@dataclass
class EagleConfig:
    """Shape of an EAGLE drafter. Saved as the `drafter` block of config.json.

    `fused` picks the layout: True is EAGLE-3 (fc fuses the aux layers, the attention reads
    [normed embedding, normed feature], own norm and draft-vocab LM head), False is EAGLE-1 (fc
    over [embedding, feature], the target's LM head). Folders saved before the field existed
    carry their method's label instead: the method passes `fused` to `from_dict`.
    """

    fused: bool = True
    hidden_size: int = 64
    vocab_size: int = 257  # the target's vocabulary
    draft_vocab_size: int = 257  # not fused: always == vocab_size
    aux_layer_ids: list[int] = field(default_factory=list)  # indices into HF hidden_states
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    embed_scale: float = 1.0  # documented only: the target's embedding module applies it
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if not self.fused and self.draft_vocab_size != self.vocab_size:
            raise ValueError("EAGLE-1 reads the target's LM head: draft_vocab_size must equal vocab_size")

    @classmethod
    def from_dict(cls, d: dict, **defaults) -> EagleConfig:
        """From a saved `drafter` block: unknown keys (an older `method` label) are dropped and
        missing ones taken from `defaults`."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in defaults.items() if k in names}, **{k: v for k, v in d.items() if k in names}})

    @property
    def num_aux(self) -> int:
        return max(1, len(self.aux_layer_ids))


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high layers {2, N/2, N-3} in HF `hidden_states` numbering
    (0 = embedding output, j = output of decoder layer j - 1). (EAGLE-1 reads the final
    post-norm hidden state, index N: its method says so.)"""
    if num_layers < 3:
        return sorted({min(2, num_layers), num_layers // 2})
    ids: list[int] = []
    for c in (2, num_layers // 2, num_layers - 3):
        c = min(max(c, 1), num_layers - 1)
        # small targets: keep three DISTINCT layers (engines expect exactly three)
        while c in ids and c < num_layers - 1:
            c += 1
        while c in ids and c > 1:
            c -= 1
        if c not in ids:
            ids.append(c)
    return sorted(ids)


def config_from_target(target_config, *, fused: bool = True, draft_vocab_size: int | None = None,
                       aux_layer_ids: list[int] | None = None) -> EagleConfig:
    """Derive the drafter's shape from a transformers target config (`fused`: the EAGLE-3
    layout; otherwise EAGLE-1, which reads the final hidden state and the full vocabulary)."""
    tc = getattr(target_config, "text_config", None) or target_config
    heads = tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    rope = getattr(tc, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "full_attention" in rope:
        rope = rope["full_attention"]
    theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or getattr(tc, "rope_theta", 10000.0)
    vocab = tc.vocab_size
    n_layers = tc.num_hidden_layers
    return EagleConfig(
        fused=fused,
        hidden_size=tc.hidden_size,
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab_size or vocab, vocab) if fused else vocab,
        aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else (default_aux_layer_ids(n_layers) if fused else [n_layers]),
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", heads) or heads,
        head_dim=head_dim,
        intermediate_size=tc.intermediate_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        embed_scale=math.sqrt(tc.hidden_size) if "gemma" in str(getattr(tc, "model_type", "")) else 1.0,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 4096),
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    # the same tensor every draft step: computed once per (head_dim, theta, device), as a normal
    # tensor even when first asked for under inference mode (training may reuse it)
    with torch.inference_mode(False):
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """[B, T] positions -> cos, sin [B, 1, T, head_dim] (rotate-half convention)."""
    inv = _inv_freq(head_dim, float(theta), position_ids.device)
    freqs = position_ids.float()[..., None] * inv  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    """Multi-head attention with GQA and RoPE; input width `in_dim` (2H for EAGLE-3, H for EAGLE-1)."""

    def __init__(self, cfg: EagleConfig, in_dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, h * d, bias=False)
        self.k_proj = nn.Linear(in_dim, kv * d, bias=False)
        self.v_proj = nn.Linear(in_dim, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def qkv(self, x: Tensor, position_ids: Tensor, *, q_last: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, in] -> q [B, h, T, d], k, v [B, kv, T, d] with RoPE applied (`q_last`: the
        last position's query only, q [B, h, 1, d])."""
        B, T, _ = x.shape
        c = self.cfg
        xq = x[:, -1:] if q_last else x
        q = self.q_proj(xq).view(B, xq.shape[1], c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, q.dtype)
        qcos, qsin = (cos[..., -1:, :], sin[..., -1:, :]) if q_last else (cos, sin)
        return apply_rope(q, qcos, qsin), apply_rope(k, cos, sin), v

    def out(self, o: Tensor) -> Tensor:
        """o [B, h, T, d] -> [B, T, H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


TTT_QUERY_CHUNK = 1024  # query rows per block; 0 = one dense block (see ttt_attention)


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], valid: Tensor | None,
                  chunk: int = TTT_QUERY_CHUNK) -> Tensor:
    """Training-time-test attention without the (L x L*k) blow-up.

    Step k of the unroll at base position t must see what the drafter sees at inference: the
    step-0 entries of every earlier real position (causal over keys[0]) plus its own chain's
    entries from steps 1..k at the same base position (the diagonal of keys[1..k]). So the
    scores are one causal [T, T] block plus k diagonal columns, O(T^2 + kT), not O(k T^2).

    Sequences longer than `chunk` go in query blocks of `chunk` rows, each recomputed in the
    backward pass (activation checkpointing), so autograd keeps no [B, h, T, T] fp32 tensor per
    unroll step: at T = 4096 that is 64 MiB per head and batch row, times 3-4 saved copies,
    times 7 steps. Block i only reads keys 0..end of block i (causal). chunk = 0 = one block.

    q [B, h, T, d]; keys / values: lists of [B, kv, T, d]; valid [B, T] bool (padding keys off).
    Returns [B, h, T, d].
    """
    T = q.shape[2]
    if not chunk or T <= chunk:
        return _ttt_block(q, keys, values, valid, 0)
    from torch.utils.checkpoint import checkpoint

    outs = []
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        ks = [keys[0][:, :, :b], *(k[:, :, a:b] for k in keys[1:])]
        vs = [values[0][:, :, :b], *(v[:, :, a:b] for v in values[1:])]
        vb = valid[:, :b] if valid is not None else None
        if torch.is_grad_enabled():
            outs.append(checkpoint(_ttt_block, q[:, :, a:b], ks, vs, vb, a, use_reentrant=False))
        else:
            outs.append(_ttt_block(q[:, :, a:b], ks, vs, vb, a))
    return torch.cat(outs, dim=2)


def _ttt_block(q: Tensor, keys: list[Tensor], values: list[Tensor], valid: Tensor | None, start: int) -> Tensor:
    """Queries start..start+C-1 of `ttt_attention`.

    q [B, h, C, d]; keys[0] / values[0] [B, kv, S, d] with S = start + C (the causal prefix);
    keys[1:] / values[1:] [B, kv, C, d] (the same rows' own chain); valid [B, S]. Returns [B, h, C, d].
    """
    B, h, C, d = q.shape
    S = keys[0].shape[2]
    groups = h // keys[0].shape[1]
    scale = 1.0 / math.sqrt(d)
    k0 = _expand_kv(keys[0], groups)
    v0 = _expand_kv(values[0], groups)
    s0 = torch.matmul(q, k0.transpose(-1, -2)).float() * scale  # [B, h, C, S]
    causal = torch.ones(C, S, dtype=torch.bool, device=q.device).tril(start)  # row i sees keys <= start + i
    mask = causal[None, None]
    if valid is not None:
        mask = mask & valid[:, None, None, :]
    s0 = s0.masked_fill(~mask, float("-inf"))
    diag = [(q * _expand_kv(k, groups)).sum(-1, keepdim=True).float() * scale for k in keys[1:]]  # [B,h,C,1]
    scores = torch.cat([s0, *diag], dim=-1)  # [B, h, C, S + k]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :S], v0)
    for j, v in enumerate(values[1:]):
        out = out + probs[..., S + j : S + j + 1] * _expand_kv(v, groups)
    return out


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleDrafter(DraftVocab, nn.Module):
    """One-layer EAGLE drafter (EAGLE-3 or EAGLE-1, by `cfg.fused`).

    Parameters saved with the drafter (SGLang-style names for EAGLE-3): `fc.*`, `midlayer.*`,
    `norm.weight`, `lm_head.weight`, buffers `d2t`, `t2d`. The target's embedding (and, for
    EAGLE-1, its LM head) are attached with `attach_target` and never saved.
    """

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        eagle3 = cfg.fused  # the EAGLE-3 layout
        # No bias in either: vLLM's EAGLE-1 (llama_eagle.py) loads fc without one.
        self.fc = nn.Linear(cfg.num_aux * H if eagle3 else 2 * H, H, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        if eagle3:
            m.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # on the token embedding
            m.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # on the feature
        m.self_attn = DrafterAttention(cfg, 2 * H if eagle3 else H)
        m.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        m.mlp = DrafterMLP(H, cfg.intermediate_size)
        if eagle3:
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # EAGLE-3 training only: fc reads aux * aux_scale (features.feature_scale); never saved,
        # folded into fc.weight by `folded_state_dict`, so saved folders and engines see plain fc.
        self.register_buffer("aux_scale", torch.ones(cfg.num_aux * H if eagle3 else 0), persistent=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        # Not submodules: never saved, never trained, never moved by .to() on the drafter.
        self._target_embed: list[nn.Module] = []
        self._target_head: list[nn.Module] = []
        self.ttt_chunk = TTT_QUERY_CHUNK  # training only; not saved
        self._scaled = False  # aux_scale differs from 1

    # ---- wiring -------------------------------------------------------------------------------
    def attach_target(self, target: nn.Module) -> EagleDrafter:
        """Reuse the target's input embedding (and LM head for EAGLE-1)."""
        self._target_embed = [target.get_input_embeddings()]
        self._target_head = [target.get_output_embeddings()]
        return self

    def embed(self, input_ids: Tensor) -> Tensor:
        if not self._target_embed:
            raise RuntimeError("call drafter.attach_target(target) before running the drafter")
        return self._target_embed[0](input_ids)

    def init_from_target(self, target: nn.Module) -> None:
        """EAGLE-3: start the draft LM head from the target's rows for the draft vocab and the
        final norm from the target's final norm (as the official recipe does)."""
        if not self.cfg.fused:
            return
        with torch.no_grad():
            w = target.get_output_embeddings().weight
            self.lm_head.weight.copy_(w[self.draft_ids.to(w.device)].to(self.lm_head.weight.dtype))

    # ---- compute ------------------------------------------------------------------------------
    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """[B, T, num_aux * H] target features -> [B, T, H] (EAGLE-1: identity)."""
        if not self.cfg.fused:
            return aux_hidden
        if self._scaled:
            aux_hidden = aux_hidden * self.aux_scale.to(aux_hidden.dtype)
        return self.fc(aux_hidden)

    @property
    def feature_scaled(self) -> bool:
        """Whether fc reads scaled features (set by `set_feature_scale`; a loaded folder never is)."""
        return self._scaled

    def set_feature_scale(self, scale: Tensor) -> None:
        """Train fc on aux * scale (EAGLE-3; see drafttrain.features.feature_scale)."""
        if not self.cfg.fused or scale.shape != self.aux_scale.shape:
            raise ValueError(f"feature scale of shape {tuple(scale.shape)} does not fit this drafter's fc "
                             f"({tuple(self.aux_scale.shape)})")
        self.aux_scale.copy_(scale)
        self._scaled = bool((scale != 1).any())

    def folded_state_dict(self) -> dict[str, Tensor]:
        """The state dict to save: fc.weight times the feature scale (the same function, plain fc)."""
        sd = self.state_dict()
        if self._scaled:
            sd["fc.weight"] = sd["fc.weight"] * self.aux_scale.to(sd["fc.weight"])[None, :]
        return sd

    def _layer_input(self, input_ids: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Returns (attention input [B,T,2H or H], residual [B,T,H])."""
        emb = self.embed(input_ids).to(hidden.dtype)
        m = self.midlayer
        if self.cfg.fused:
            x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)
            return x, hidden
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        return x, x

    def _finish(self, attn_out: Tensor, residual: Tensor) -> Tensor:
        h = residual + attn_out
        return h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))

    def logits(self, hidden_out: Tensor) -> Tensor:
        """[B, T, H] drafter output -> [B, T, Vd] logits over the draft vocabulary."""
        if self.cfg.fused:
            return self.lm_head(self.norm(hidden_out))
        head = self._target_head[0]
        return head(hidden_out.to(head.weight.dtype))

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor | None = None,
        past_key_values=None,
        attention_mask: Tensor | None = None,
        *,
        ttt_steps: int = 0,
        valid: Tensor | None = None,
        last_logits: bool = False,
        last_only: bool = False,
    ):
        """One drafting pass (inference), or with `ttt_steps > 0` the training unroll.

        The training path goes through `forward` so that DDP / FSDP wrappers see it; there
        `hidden` is the RAW target features [B, T, num_aux * H] (fused here) and the result is
        `forward_ttt`'s list.

        Args:
            input_ids: [B, T] tokens x_{t+1}.
            hidden: [B, T, H] features (fused target features, or the drafter's own hidden_out).
            position_ids: [B, T]; defaults to past_len + arange(T) (see the module docstring).
            past_key_values: optional `transformers.DynamicCache` (layer 0 is the drafter's);
                new keys/values are appended to it.
            attention_mask: optional [B, 1, T, S] bool (True = attend) or additive float mask
                over the S = past + T keys; default: causal over the new tokens, all past visible.
            last_logits: logits of the last position only ([B, 1, Vd]): a catch-up over many
                tokens needs just those, and the head is about 45% of a token's work.
            last_only: the last position's logits AND hidden_out only ([B, 1, ...]); the other
                positions only write their keys and values to the cache. What a catch-up needs:
                earlier positions are read later only through their keys and values, so their
                query, attention, o_proj and MLP (about three quarters of a token's work with
                `fc`) are skipped.

        Returns:
            (logits [B, T, Vd], hidden_out [B, T, H]); with `last_only` both [B, 1, ...].
        """
        if ttt_steps > 0:
            return self.forward_ttt(input_ids, self.fuse(hidden), valid, ttt_steps)
        B, T = input_ids.shape
        past_len = past_key_values.get_seq_length(0) if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + T, device=input_ids.device)[None].expand(B, T)
        x, residual = self._layer_input(input_ids, hidden)
        attn = self.midlayer.self_attn
        q, k, v = attn.qkv(x, position_ids, q_last=last_only)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, 0)
        S = k.shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
        if last_only:
            attention_mask, residual = attention_mask[..., -1:, :], residual[:, -1:]
        # grouped-query attention without copying the cache per query head
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=k.shape[1] != q.shape[1])
        hidden_out = self._finish(attn.out(o), residual)
        return self.logits(hidden_out[:, -1:] if last_logits else hidden_out), hidden_out

    def forward_ttt(
        self, input_ids: Tensor, hidden: Tensor, valid: Tensor, steps: int
    ) -> list[tuple[Tensor, Tensor]]:
        """Training-time-test unroll: `steps` passes feeding the drafter's own features back.

        Args:
            input_ids: [B, T + steps] tokens; step k reads input_ids[:, k + 1 : k + 1 + T]
                (x_{t+1+k}: ground-truth tokens, the drafter's own features).
            hidden: [B, T, H] fused target features f_t.
            valid: [B, T] bool, False on padding.
            steps: number of unroll steps (EAGLE-3 default 7).

        Returns:
            per step k: (logits [B, T, Vd] predicting x_{t+2+k}, hidden_out [B, T, H]).
        """
        B, T, _ = hidden.shape
        base = torch.arange(T, device=hidden.device)[None].expand(B, T)
        attn = self.midlayer.self_attn
        keys: list[Tensor] = []
        values: list[Tensor] = []
        outputs = []
        for k in range(steps):
            with torch.profiler.record_function(f"unroll_{k}"):  # named in bench/train_profile.py
                tokens = input_ids[:, k + 1 : k + 1 + T]
                x, residual = self._layer_input(tokens, hidden)
                q, kk, vv = attn.qkv(x, base + 1 + k)
                keys.append(kk)
                values.append(vv)
                o = ttt_attention(q, keys, values, valid, self.ttt_chunk)
                hidden = self._finish(attn.out(o), residual)
                outputs.append((self.logits(hidden), hidden))
        return outputs


# ---- save / load --------------------------------------------------------------------------------
def load_drafter(path: str | Path, target: nn.Module | None = None, *, map_location: str = "cpu",
                 fused: bool | None = None) -> EagleDrafter:
    """Load an EAGLE drafter folder (config.json + model.safetensors); attach and check `target`.
    `fused` fills in the layout for folders saved before their `drafter` block recorded it."""
    from drafttrain.drafter_io import load_module_folder

    defaults = {} if fused is None else {"fused": fused}
    return load_module_folder(path, lambda d: EagleDrafter(EagleConfig.from_dict(d, **defaults)), target,
                              map_location=map_location)


def eagle_config_dict(cfg: EagleConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg)))
