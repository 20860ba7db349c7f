"""Training-time-test attention in query chunks equals the one-block path, forward and backward.

The chunked path exists for long sequences (4k tokens: see `ttt_attention`); these tests use odd
lengths (13, 63) and chunks that do not divide them, GQA (4 query heads on 2 kv heads) and
right padding, so every block boundary case is crossed.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.models.eagle import EagleDrafter, config_from_target, ttt_attention
from drafttrain.testing import tiny_target


def _inputs(T: int, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)  # fp32: the scores are fp32 whatever the input dtype
    B, h, kv, d = 2, 4, 2, 8
    q = torch.randn(B, h, T, d, generator=g, dtype=torch.float32)
    keys = [torch.randn(B, kv, T, d, generator=g, dtype=torch.float32) for _ in range(steps)]
    values = [torch.randn(B, kv, T, d, generator=g, dtype=torch.float32) for _ in range(steps)]
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, T - 4:] = False  # right padding on the second row
    return q, keys, values, valid


@pytest.mark.parametrize("T,chunk", [(13, 5), (13, 1), (63, 16), (63, 62)])
def test_chunked_ttt_attention_matches_one_block(T, chunk):
    q, keys, values, valid = _inputs(T, steps=3)
    leaves = [q, *keys, *values]
    for t in leaves:
        t.requires_grad_(True)
    dense = ttt_attention(q, keys, values, valid, chunk=0)
    grads_dense = torch.autograd.grad(dense.square().sum(), leaves)
    chunked = ttt_attention(q, keys, values, valid, chunk=chunk)
    grads_chunked = torch.autograd.grad(chunked.square().sum(), leaves)
    torch.testing.assert_close(chunked, dense, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_chunked, grads_dense):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_ttt_attention_is_causal():
    """Changing keys after position t must not change block outputs at or before t."""
    q, keys, values, valid = _inputs(20, steps=2)
    out = ttt_attention(q, keys, values, valid, chunk=6)
    keys2 = [k.clone() for k in keys]
    values2 = [v.clone() for v in values]
    keys2[0][:, :, 15:] += 3.0
    values2[0][:, :, 15:] -= 2.0
    out2 = ttt_attention(q, keys2, values2, valid, chunk=6)
    torch.testing.assert_close(out2[:, :, :15], out[:, :, :15])
    assert not torch.allclose(out2[:, :, 15:], out[:, :, 15:])


def test_drafter_unroll_same_with_and_without_chunks():
    """The whole EAGLE-3 unroll (7 steps, gradients into the drafter) does not depend on the chunk size."""
    target = tiny_target("llama", vocab_size=257, num_layers=6)
    torch.manual_seed(0)
    drafter = EagleDrafter(config_from_target(target.config)).attach_target(target)
    B, T, steps = 2, 37, 7
    ids = torch.randint(3, 257, (B, T + steps + 1))
    aux = torch.randn(B, T, 3 * 64)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, 30:] = False

    def run(chunk: int):
        drafter.zero_grad()
        drafter.ttt_chunk = chunk
        outs = drafter(ids, aux, ttt_steps=steps, valid=valid)
        loss = sum((0.8**k) * logits.float().logsumexp(-1).mean() for k, (logits, _) in enumerate(outs))
        loss.backward()
        return [o[0].detach() for o in outs], {n: p.grad.clone() for n, p in drafter.named_parameters()}

    outs_dense, grads_dense = run(0)
    outs_chunked, grads_chunked = run(8)
    for a, b in zip(outs_chunked, outs_dense):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for n in grads_dense:
        torch.testing.assert_close(grads_chunked[n], grads_dense[n], rtol=1e-4, atol=1e-6)
