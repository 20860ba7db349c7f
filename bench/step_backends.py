"""One single-stream decode step of Gemma 3 under each CPU back end this machine can run.

    python bench/step_backends.py                      # gemma-3-270m bf16, context 256, 2 threads
    python bench/step_backends.py --backends transformers,fused,inductor --steps 30

Issue 19 asks which CPU back end makes the target step fastest. Rows (greedy step, argmax head,
median of --steps, the same prompt and context for all):

- ``transformers``: transformers' forward with PyTorch's matmul (`linear_backend=aten`);
- ``kernels``: transformers' forward with its linears and norms through drafttrain's kernels
  (`linear_backend=auto`), the fused layers detached;
- ``fused``: the kernels plus one C++ call per decoder layer (`decode/kernels/cpu_layers.py`, AVX2
  kernel only) — what `drafttrain eval` runs;
- ``inductor`` / ``zentorch``: the gpt-fast recipe — a hand-written Gemma 3 step over a static,
  preallocated KV cache (fixed shapes: context padded to --static-len, masked) compiled once by
  `torch.compile` with that back end (compile time printed), linears through PyTorch's matmul so
  the back end may replace them (zentorch swaps in ZenDNN kernels where the CPU has AVX-512), bf16
  intermediates rounded as eager rounds them (`emulate_precision_casts`);
- ``inductor+kernels``: the same compiled step with the AVX2 kernel as an opaque custom op.

A back end that is not installed or not supported prints one line saying so and the row is skipped.
Every compiled row checks its greedy token against the ``fused`` / ``kernels`` step.

Deliberately not here: batch > 1, verification widths, CUDA graphs (GPU), Intel's extension (no
Intel CPU here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from drafttrain.decode.kernels import cpu_layers, cpu_linear
from drafttrain.decode.kv import KVState, target_forward
from drafttrain.targets import load_target
from drafttrain.textconfig import text_config

BACKENDS = ("transformers", "kernels", "fused", "inductor", "inductor+kernels", "zentorch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="gemma-3-270m", help="a Gemma 3 target (drafttrain.targets.load_target)")
    p.add_argument("--context", type=int, default=256, help="tokens in the KV cache at each timed step")
    p.add_argument("--static-len", type=int, default=512, help="static cache length of the compiled steps")
    p.add_argument("--steps", type=int, default=20, help="timed steps per back end (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {BACKENDS}")
    return p.parse_args(argv)


def median_ms(fn, n: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts)


def engine_step(model, ids: Tensor):
    """A `target_forward` greedy step at the context of `ids` (rolled back after each call)."""
    ctx = ids.shape[1]
    kv = KVState.for_model(model, 1, torch.device("cpu"))
    target_forward(model, kv, ids, torch.arange(ctx)[None], torch.arange(-1, ctx - 1)[None], head="none")
    kv.commit(torch.arange(ctx)[None])
    tok, pos, par = torch.tensor([[123]]), torch.tensor([[ctx]]), torch.tensor([[-1]])

    def step() -> int:
        out, _ = target_forward(model, kv, tok, pos, par, head="argmax")
        kv.rollback()
        return int(out)
    return step


def static_step(model, ids: Tensor, static_len: int, linear):
    """(step function, its arguments): a hand-written Gemma 3 greedy step over a static cache of
    `static_len` entries holding `ids`' keys / values, for `torch.compile`."""
    cfg, body = text_config(model.config), model.get_decoder()
    ctx, hd = ids.shape[1], cfg.head_dim
    kv = KVState.for_model(model, 1, torch.device("cpu"))
    with cpu_linear.paused(model):
        target_forward(model, kv, ids, torch.arange(ctx)[None], torch.arange(-1, ctx - 1)[None], head="none")
    K = torch.zeros(len(body.layers), 1, cfg.num_key_value_heads, static_len, hd, dtype=torch.bfloat16)
    V = torch.zeros_like(K)
    for i, layer in enumerate(kv.cache.layers):
        K[i, :, :, :ctx], V[i, :, :, :ctx] = layer.keys, layer.values

    def norm(x: Tensor, mod) -> Tensor:  # Gemma's RMS norm: fp32, x r (1 + w), one rounding
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + mod.eps) * (1.0 + mod.weight.float())).type_as(x)

    def rot(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    scale, types = cfg.query_pre_attn_scalar ** -0.5, cfg.layer_types

    def step(tok, pos, rope, mask, K, V):
        h = body.embed_tokens(tok)
        for i, layer in enumerate(body.layers):
            a, cos, sin = layer.self_attn, *rope[types[i]]
            x = norm(h, layer.input_layernorm)
            q = norm(linear(x, a.q_proj.weight).view(1, 1, -1, hd).transpose(1, 2), a.q_norm)
            k = norm(linear(x, a.k_proj.weight).view(1, 1, -1, hd).transpose(1, 2), a.k_norm)
            v = linear(x, a.v_proj.weight).view(1, 1, -1, hd).transpose(1, 2)
            q, k = rot(q, cos, sin), rot(k, cos, sin)
            K[i].index_copy_(2, pos[0], k)
            V[i].index_copy_(2, pos[0], v)
            o = F.scaled_dot_product_attention(q, K[i], V[i], attn_mask=mask, scale=scale, enable_gqa=True)
            h = h + norm(linear(o.transpose(1, 2).reshape(1, 1, -1), a.o_proj.weight), layer.post_attention_layernorm)
            x = norm(h, layer.pre_feedforward_layernorm)
            m = layer.mlp
            x = linear(F.gelu(linear(x, m.gate_proj.weight), approximate="tanh") * linear(x, m.up_proj.weight),
                       m.down_proj.weight)
            h = h + norm(x, layer.post_feedforward_layernorm)
        return linear(norm(h, body.norm), model.get_output_embeddings().weight).argmax(-1)

    pos = torch.tensor([[ctx]])
    h0 = torch.zeros(1, 1, cfg.hidden_size, dtype=torch.bfloat16)
    rope = {t: tuple(z[:, None] for z in body.rotary_emb(h0, pos, t)) for t in set(types)}
    mask = torch.full((1, 1, 1, static_len), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16)
    mask[..., : ctx + 1] = 0
    return step, (torch.tensor([[123]]), pos, rope, mask, K, V)


def kernel_op(backend: str):
    """The AVX2 kernel as a custom op `torch.compile` treats as opaque."""
    ext = cpu_linear.KERNELS[backend].load()

    @torch.library.custom_op("drafttrain_bench::bf16_linear", mutates_args=())
    def linear(x: Tensor, w: Tensor) -> Tensor:
        return ext.bf16_linear_bf16(x, w, 64)

    @linear.register_fake
    def _(x, w):
        return x.new_empty(*x.shape[:-1], w.shape[0])
    return linear


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(wanted) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"error: unknown back end(s) {sorted(unknown)}; choose from {BACKENDS}")
    model, _, _ = load_target(args.target, dtype="bfloat16")
    if type(model.get_decoder().layers[0]).__name__ != "Gemma3DecoderLayer":
        raise SystemExit(f"error: {args.target} is not a Gemma 3 model; this bench writes Gemma 3's step by hand")
    ids = torch.randint(100, 1000, (1, args.context), generator=torch.Generator().manual_seed(0))
    kernel = cpu_linear.resolve_backend("auto", model)
    rows, ref = [], None
    print(f"{args.target} bf16, context {args.context}, {args.threads} threads, kernel {kernel}")
    with torch.inference_mode():
        if "transformers" in wanted:
            rows.append(("transformers (PyTorch matmul)", median_ms(engine_step(model, ids), args.steps), ""))
        if kernel != "aten":
            cpu_linear.install(model, kernel)
            fused = cpu_layers.fused(model)
            if "kernels" in wanted:
                with cpu_layers.detached(model):
                    step = engine_step(model, ids)
                    ref = step()
                    rows.append((f"transformers + {kernel} kernels", median_ms(step, args.steps), ""))
            if "fused" in wanted:
                if fused is None:
                    print(f"fused: no fused layers for the {kernel} kernel; skipped")
                else:
                    step = engine_step(model, ids)
                    ref = step()
                    rows.append(("fused layers (one C++ call per layer)", median_ms(step, args.steps), ""))
        for name in ("inductor", "inductor+kernels", "zentorch"):
            if name not in wanted:
                continue
            if name == "zentorch":
                try:
                    import zentorch  # noqa: F401
                except ImportError:
                    print("zentorch: not installed (pip install zentorch, AMD's torch.compile back end); skipped")
                    continue
            if name == "inductor+kernels" and kernel != "avx2":
                print(f"inductor+kernels: needs the avx2 kernel (this CPU resolves {kernel}); skipped")
                continue
            linear = kernel_op("avx2") if name == "inductor+kernels" else F.linear
            # round every bf16 intermediate as eager does: without it inductor fuses bf16 chains in
            # fp32 and Gemma 3 270M's greedy token moves (session 23: token 541 instead of 236820)
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = True
            with cpu_linear.paused(model):
                fn, fargs = static_step(model, ids, args.static_len, linear)
                t = time.perf_counter()
                compiled = torch.compile(fn, dynamic=False, backend=name.split("+")[0])
                got = int(compiled(*fargs))
                took = time.perf_counter() - t
                ms = median_ms(lambda compiled=compiled, fargs=fargs: compiled(*fargs), args.steps)
            same = "" if ref is None else ("same token" if got == ref else f"token {got} vs {ref}")
            rows.append((f"{name}, static cache of {args.static_len}", ms, f"compile {took:.0f} s; {same}"))
    print("\n| back end | step ms (median) | notes |\n|---|---|---|")
    for name, ms, note in rows:
        print(f"| {name} | {ms:.1f} | {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
