"""Each divergence's value and gradient against a direct reference: the textbook formula in
probability space on small tensors (full vocabulary and top-k + rest bucket), analytic gradients
where they are short, and the chunked path against the unchunked one. Vocab 37 and 263 (not a
power of two); real Gemma 3 vocab is 262144."""

from __future__ import annotations

import pytest
import torch

from drafttrain.losses import chunked_divergence, token_divergence


def ref_probs(s_logits, t_logits, k):
    """(q, p) as explicit probability vectors: full, or top-k of the teacher plus one rest bucket."""
    q, p = torch.softmax(s_logits.double(), -1), torch.softmax(t_logits.double(), -1)
    if k == 0:
        return q, p
    idx = t_logits.topk(k, -1).indices
    qk, pk = q.gather(-1, idx), p.gather(-1, idx)
    return torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1), torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)


def reference(kind, s_logits, t_logits, k=0, beta=0.5, w=(0.5, 0.0, 0.0, 0.5)):
    q, p = ref_probs(s_logits, t_logits, k)
    fkl = (p * (p / q).log()).sum(-1)
    rkl = (q * (q / p).log()).sum(-1)
    m = beta * p + (1 - beta) * q
    js = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    tvd = 0.5 * (p - q).abs().sum(-1)
    if kind == "mix":
        return w[0] * fkl + w[1] * rkl + w[2] * js + w[3] * tvd
    return {"fkl": fkl, "rkl": rkl, "jsd": js, "tvd": tvd}[kind]


def logits(n=5, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2, torch.randn(n, v, generator=g) * 2


KINDS = ["fkl", "rkl", "jsd", "tvd", "mix"]


@pytest.mark.parametrize("k", [0, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_value_and_grad_match_reference(kind, k):
    s, t = logits()
    beta, w = 0.3, (0.2, 0.3, 0.1, 0.4)
    s1 = s.clone().requires_grad_()
    ours = token_divergence(s1, t, kind, topk=k, beta=beta, mix_weights=w)
    s2 = s.double().clone().requires_grad_()
    ref = reference(kind, s2, t.double(), k, beta, w)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-4)
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(s1.grad.double(), s2.grad, atol=1e-5, rtol=1e-4)


def test_analytic_gradients_full_vocab():
    """d FKL / ds = q - p; d RKL / ds_j = q_j (log q_j - log p_j - RKL); d TVD / ds_j = q_j (c_j - sum_i c_i q_i) / 2, c = sign(q - p)."""
    s, t = logits(4, 263, seed=1)
    q, p = torch.softmax(s, -1), torch.softmax(t, -1)
    for kind in ("fkl", "rkl", "tvd"):
        x = s.clone().requires_grad_()
        token_divergence(x, t, kind).sum().backward()
        if kind == "fkl":
            want = q - p
        elif kind == "rkl":
            r = (q * (q.log() - p.log())).sum(-1, keepdim=True)
            want = q * (q.log() - p.log() - r)
        else:
            c = torch.sign(q - p)
            want = 0.5 * q * (c - (c * q).sum(-1, keepdim=True))
        torch.testing.assert_close(x.grad, want, atol=1e-6, rtol=1e-4)


def test_identical_distributions_give_zero_and_full_topk_is_full():
    s, _ = logits()
    for kind in KINDS:
        assert token_divergence(s, s, kind).abs().max() < 1e-6
        assert token_divergence(s, s, kind, topk=8).abs().max() < 1e-6
    s, t = logits()
    torch.testing.assert_close(token_divergence(s, t, "fkl", topk=37), token_divergence(s, t, "fkl"))


@pytest.mark.parametrize("k", [0, 16])
@pytest.mark.parametrize("kind", ["fkl", "jsd", "tvd"])
def test_chunked_path_matches_direct(kind, k):
    """Hidden states through two LM heads, chunk 7 over 23 positions vs all at once: same values,
    same gradients for the student's hidden states and head."""
    g = torch.Generator().manual_seed(2)
    N, h, H, V = 23, 8, 12, 263
    s_head, t_head = torch.nn.Linear(h, V, bias=False), torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(s_head.weight, generator=g)
    torch.nn.init.normal_(t_head.weight, generator=g)
    sh, th = torch.randn(N, h, generator=g), torch.randn(N, H, generator=g)
    x1 = sh.clone().requires_grad_()
    d, s_arg, t_arg = chunked_divergence(x1, s_head, th, t_head, kind, topk=k, chunk=7)
    d.sum().backward()
    assert t_head.weight.grad is None  # the teacher never gets a gradient
    g1, gw1 = x1.grad.clone(), s_head.weight.grad.clone()
    s_head.weight.grad = None
    x2 = sh.clone().requires_grad_()
    ref = token_divergence(s_head(x2), t_head(th).detach(), kind, topk=k)
    ref.sum().backward()
    torch.testing.assert_close(d, ref)
    torch.testing.assert_close(g1, x2.grad)
    torch.testing.assert_close(gw1, s_head.weight.grad)
    assert torch.equal(s_arg, s_head(sh).argmax(-1)) and torch.equal(t_arg, t_head(th).argmax(-1))
    for logits in (s_head(sh), t_head(th)):  # exact argmax equality across two reductions (chunked
        top2 = logits.detach().topk(2, -1).values  # vs whole) is only meaningful away from near-ties
        assert bool((top2[:, 0] - top2[:, 1] > 1e-4).all())


def test_bad_divergence_name_and_beta():
    s, t = logits()
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        token_divergence(s, t, "kl")
    with pytest.raises(ValueError, match="jsd_beta"):
        token_divergence(s, t, "jsd", beta=1.0)


def test_config_choices_match_the_registry():
    from drafttrain.config import _fields
    from drafttrain.losses import DIVERGENCES
    from drafttrain.schema import DraftLMSettings

    assert _fields(DraftLMSettings)["divergence"].metadata["choices"] == DIVERGENCES
