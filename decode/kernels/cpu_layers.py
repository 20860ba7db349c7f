"""Gemma 3 decode steps with one C++ call per decoder layer, on CPUs that run drafttrain's kernels.

Why: with the AVX2 kernels, Gemma 3 270M's matmuls take 27 ms of a 38-39 ms greedy step on the
2-core Zen 2 (`bench/decode_profile.py`, session 22): the rest is framework — about 2,000 small
PyTorch ops per step (views, transposes, the rotary embedding's six ops per tensor, the mask
add, SDPA's setup, residual adds) and transformers' Python around them, microseconds each. Neither
a hand-written eager forward nor `torch.compile` of one with the kernels as custom ops helped there
(session 23: 40 and 55 ms against transformers' 38-39): the cost is per op, not per Python line.
Here one C++ function (`cpu_layer_src`) runs a whole layer — norms, the seven projections through
the backend's kernel (AVX2; AVX-512 bf16 / AMX since session 27, routed per shape as the linears
are), the rotary embedding, the cache write, attention over the tree mask, the gated
MLP — rounding to bf16 where transformers' bf16 ops round. Session 28 (this Xeon, perf of a
5-token step): the scalar tanh of the gelu (~30 ns each, 184k per step) and an attention that
handled one query per key at a time were 3 ms and 2 ms of it; PyTorch's own vectorised SLEEF
tanh / exp and register tiles (4 queries x 2 keys, 4 queries x 16 lanes) brought the layers of a
1 / 3 / 5-token step from 11.3 / 14.1 / 17.2 ms to 8.4 / 9.7 / 10.4 (whole greedy steps 23.0 /
27.0 / 29.8 -> 18.7 / 20.6 / 21.3 ms, interleaved medians at context 256).

What: `install` (called by `cpu_linear.install` for the backends in `FUSED_BACKENDS`) attaches a `FusedGemma3` to a
Gemma 3 model whose linears and norms it routed; `fused(model)` returns it (None otherwise) and
`kv.target_forward` runs decode steps of up to `MAX_ROWS` rows through it: embedding and rotary
tables from the model's own modules, then one call per layer into the `KVState`'s growing cache
buffers, then the model's final norm; hidden states come out as transformers numbers them (0 = the
embeddings, i = layer i's output, the last one normed). Prefill (more rows) keeps transformers'
forward. `cpu_linear.uninstall` / `paused` detach it.

Deliberately not here: other architectures (Llama / Qwen layers differ in norms and activation; they
keep transformers' forward), logit soft caps (Gemma 2), training (no autograd).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from drafttrain.textconfig import text_config

__all__ = ["FUSED_BACKENDS", "FusedEagle3", "FusedGemma3", "MAX_ROWS", "detached", "fused", "install", "uninstall"]

#: decode-step inputs (batch rows x tokens fed) served; larger (prefill) run through transformers
MAX_ROWS = 64
#: the kernels whose extension holds the fused layers (cpu_layer_src)
FUSED_BACKENDS = ("avx2", "avx512", "amx")
_ATTR = "_drafttrain_fused_layers"


class FusedGemma3:
    """The per-layer weights and norm scales of one routed Gemma 3 model, and its decode step."""

    def __init__(self, model: nn.Module, ext, norms: list[list], pack=None):
        cfg = text_config(model.config)
        self.ext, self.body = ext, model.get_decoder()
        self.types = list(cfg.layer_types)
        self.hq, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.scaling = float(cfg.rms_norm_eps), float(cfg.query_pre_attn_scalar) ** -0.5
        self.weights = []
        for layer in self.body.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.weights.append([_stack(a.q_proj, a.k_proj, a.v_proj), a.o_proj.weight,
                                 _stack(mlp.gate_proj, mlp.up_proj), mlp.down_proj.weight])
        # `cpu_linear.pack` where the backend packs (the C++ layer takes 4-dim weights as packed):
        # the four per layer packed once, and again when a linear's weight changed (version, storage)
        self._pack, self._packed, self._key = pack, None, None
        if pack is not None and not all(w.shape[0] % 64 == 0 and w.shape[1] % 2 == 0 for ws in self.weights for w in ws):
            self._pack = None
        self._params = [m.weight for layer in self.body.layers for m in (
            layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
        self.layer_weights()
        self.norms = norms  # per layer: the installed `_Norm`s of input, q, k, post-attn, pre-ff, post-ff
        self._norm_weights = [nm.module.weight for per_layer in norms for nm in per_layer]
        self._versions, self._scales = None, None

    def layer_weights(self) -> list[list[Tensor]]:
        """Per layer the four weights the C++ layer reads: the stacks, or their packed copies."""
        if self._pack is None:
            return self.weights
        key = [(w.data_ptr(), w._version) for w in self._params]
        if key != self._key:
            self._packed = None  # the old copies go before the new ones are made
            self._packed = [[self._pack(w) for w in ws] for ws in self.weights]
            self._key = key
        return self._packed

    def scales(self) -> list[list[Tensor]]:
        """The norms' fp32 scales, cast again only when a norm weight changed (its version moved)."""
        versions = [w._version for w in self._norm_weights]
        if versions != self._versions:
            self._scales = [[nm.scale() for nm in per_layer] for per_layer in self.norms]
            self._versions = versions
        return self._scales

    def forward(self, input_ids: Tensor, positions: Tensor, masks: Tensor | dict[str, Tensor],
                cache) -> tuple[Tensor, list[Tensor]]:
        """Feeds [B, n] tokens at [B, n] positions with `KVState.extend`'s additive masks, appending
        their keys / values to `cache` (a KVState's DynamicCache of growing layers).

        Returns:
            (final normed hidden [B, n, D], transformers' hidden_states list: embeddings, layers 0 ..
            N-2's outputs, the final normed hidden).
        """
        B, n = input_ids.shape
        h = self.body.embed_tokens(input_ids).contiguous()  # each layer returns a contiguous h
        rope = {t: tuple(x.contiguous() for x in self.body.rotary_emb(h, positions, t)) for t in set(self.types)}
        if not isinstance(masks, dict):
            masks = {t: masks for t in set(self.types)}
        flat = {}  # [B, n, L + n] fp32, once per distinct mask (both types share one within the window)
        for t, m in masks.items():
            same = next((f for u, f in flat.items() if masks[u] is m), None)
            flat[t] = same if same is not None else m[:, 0].float().contiguous()
        while len(cache.layers) < min(len(self.body.layers), len(self.weights)):  # nothing fed to them yet
            cache.layers.append(cache.layer_class_to_replicate())
        states = [h]
        # as transformers' loop: the layers the body holds now (`kv.truncated_layers` shortens it)
        count = min(len(self.body.layers), len(self.weights))
        for i, (w, scales) in enumerate(zip(self.layer_weights()[:count], self.scales()[:count])):
            layer, kind = cache.layers[i], self.types[i]
            kbuf, vbuf, L = layer.reserve((B, self.hkv), n, self.hd, h.dtype, h.device)
            cos, sin = rope[kind]
            h = self.ext.gemma3_layer(h, w, scales, kbuf, vbuf, L, cos, sin, flat[kind], self.hq, self.hkv,
                                      self.hd, self.eps, self.scaling, MAX_ROWS)
            layer.advance(n)
            states.append(h)
        out = self.body.norm(h)
        states[-1] = out
        return out, states


class FusedEagle3:
    """One routed EAGLE-3 drafter's layer weights and norms, and its draft step in one C++ call.

    Why: a draft forward of the default drafter took ~1.5-1.7 ms on the 2-core Zen 2, of which its
    matmuls ~0.9: the rest was ~40 small PyTorch ops (SDPA alone ~0.38 ms for one query over 300
    keys in bf16), paid two to five times per drafted chain (session 24).
    """

    def __init__(self, drafter: nn.Module, ext, norms: list):
        cfg = drafter.cfg
        self.ext, self.drafter = ext, drafter
        self.hq, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta, self.scaling = float(cfg.rope_theta), float(cfg.head_dim) ** -0.5
        m = drafter.midlayer
        a, mlp = m.self_attn, m.mlp
        self.weights = [_stack(a.q_proj, a.k_proj, a.v_proj), a.o_proj.weight, _stack(mlp.gate_proj, mlp.up_proj),
                        mlp.down_proj.weight]
        # 7-bit codes (u, s) of the four, where `cpu_linear.quantize` moved all seven linears to them
        groups = [(a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
        fwds = [[vars(lin).get("forward") for lin in g] for g in groups]
        self.q = []
        if all(hasattr(f, "u") for g in fwds for f in g):
            for g in fwds:
                self.q += [torch.cat([f.u for f in g]), torch.cat([f.s for f in g])]
        self.norms = norms  # the installed `_Norm`s of the embedding, feature and post-attention norms
        self.eps = float(norms[0].eps)

    def forward(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor, cache) -> tuple[Tensor, Tensor]:
        """The drafter's forward for [B, n] tokens and their [B, n, H] features at [B, n] positions, with
        `KVState.extend`'s additive mask, appending keys / values to `cache` (a KVState's DynamicCache).
        Returns (logits [B, n, Vd], hidden_out [B, n, H]) as `EagleDrafter.forward` does."""
        h = self.hidden_out(input_ids, hidden, positions, mask, cache)
        return self.drafter.logits(h), h

    def hidden_out(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor, cache) -> Tensor:
        """`forward` without the LM head: hidden_out [B, n, H] (B * n <= MAX_ROWS)."""
        from drafttrain.models.eagle import rope_cos_sin

        B, n = input_ids.shape
        emb = self.drafter.embed(input_ids).to(hidden.dtype)
        cos, sin = rope_cos_sin(positions, self.hd, self.theta, hidden.dtype)
        if not cache.layers:
            cache.layers.append(cache.layer_class_to_replicate())
        layer = cache.layers[0]
        kbuf, vbuf, L = layer.reserve((B, self.hkv), n, self.hd, hidden.dtype, hidden.device)
        h = self.ext.eagle3_layer(emb.contiguous(), hidden.contiguous(), self.weights, self.q, [nm.scale() for nm in self.norms],
                                  kbuf, vbuf, L, cos.contiguous(), sin.contiguous(), mask[:, 0].float().contiguous(),
                                  self.hq, self.hkv, self.hd, self.eps, self.scaling, MAX_ROWS)
        layer.advance(n)
        return h


def _stack(*linears: nn.Linear) -> Tensor:
    """The linears' weights stacked by rows into one tensor (one pass of the kernel over all of them),
    each linear's weight becoming a view of its rows (no second copy in memory)."""
    stacked = torch.cat([m.weight.data for m in linears])
    at = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = stacked[at: at + rows]
        at += rows
    return stacked


def fused(model: nn.Module) -> FusedGemma3 | FusedEagle3 | None:
    """The attached `FusedGemma3` (a target) or `FusedEagle3` (a drafter) of `model`, or None."""
    return vars(model).get(_ATTR)


def _reason(model: nn.Module, backend: str) -> str | None:
    """Why `model` cannot take the fused layers (None: it can)."""
    if backend not in FUSED_BACKENDS:
        return f"the {backend} kernel has no fused layer"
    body = model.get_decoder() if hasattr(model, "get_decoder") and hasattr(model, "config") else None
    layers = getattr(body, "layers", None)
    if layers is None or not len(layers) or type(layers[0]).__name__ != "Gemma3DecoderLayer":
        return "not a Gemma 3 decoder"
    cfg = text_config(model.config)
    if (getattr(cfg, "attn_logit_softcapping", None) is not None or getattr(cfg, "final_logit_softcapping", None) is not None
            or getattr(cfg, "use_bidirectional_attention", False)
            or getattr(cfg, "hidden_activation", None) != "gelu_pytorch_tanh" or cfg.head_dim % 8
            or cfg.num_attention_heads % cfg.num_key_value_heads or getattr(cfg, "attention_bias", False)):
        return "a Gemma 3 variant the fused layer does not compute"
    return None


def _install_eagle3(drafter: nn.Module, backend: str, ext) -> bool:
    """Attaches a `FusedEagle3` to a bf16 EAGLE-3 drafter whose three layer norms `cpu_linear.install`
    routed in the round-first formula (the only one the C++ layer computes)."""
    if backend not in FUSED_BACKENDS or not getattr(drafter.cfg, "fused", False) or drafter.cfg.head_dim % 8:
        return False
    m = drafter.midlayer
    mods = (m.input_layernorm, m.hidden_norm, m.post_attention_layernorm)
    norms = [vars(mod).get("forward") for mod in mods]
    if not all(getattr(nm, "mode", None) == "round-first" and hasattr(nm, "scale") for nm in norms):
        return False
    if any(lin.weight.dtype != torch.bfloat16 for lin in (m.self_attn.q_proj, m.mlp.down_proj)):
        return False
    drafter.__dict__[_ATTR] = FusedEagle3(drafter, ext, norms)
    return True


def install(model: nn.Module, backend: str, ext, pack=None) -> bool:
    """Attaches a `FusedGemma3` where `_reason` finds nothing against it and `cpu_linear.install`
    routed every norm of every layer through the norm kernel in Gemma's formula (or a `FusedEagle3`
    to an EAGLE-3 drafter, `_install_eagle3`); returns whether. `pack` (`cpu_linear.pack`, or None):
    the Gemma 3 layers read their weights packed."""
    if type(model).__name__ == "EagleDrafter":
        return _install_eagle3(model, backend, ext)
    if _reason(model, backend) is not None:
        return False
    norms = []
    for layer in model.get_decoder().layers:
        mods = (layer.input_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm,
                layer.post_attention_layernorm, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
        fwd = [vars(m).get("forward") for m in mods]
        if not all(getattr(f, "mode", None) == "offset" and hasattr(f, "scale") for f in fwd):  # cpu_linear._Norm
            return False
        norms.append(fwd)
    model.__dict__[_ATTR] = FusedGemma3(model, ext, norms, pack)
    return True


def uninstall(model: nn.Module) -> None:
    """Detaches the fused layers (the model's own forward serves every step again)."""
    model.__dict__.pop(_ATTR, None)


@contextmanager
def detached(model: nn.Module):
    """transformers' forward for every decode step of the block (the kernels stay routed); the fused
    layers come back after it, as they were."""
    layers = vars(model).pop(_ATTR, None)
    try:
        yield
    finally:
        if layers is not None:
            model.__dict__[_ATTR] = layers
