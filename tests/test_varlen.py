"""The varlen path: padding is not computed, and the results equal the dense path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead
from multihead import MultiHeadAttention, masks, reference_attention
from multihead.core import varlen


@pytest.fixture
def path(monkeypatch):
    """path("varlen") / path("dense"): force the module's choice."""

    def choose(which):
        monkeypatch.setattr(varlen, "LOOP_COST_FLOP", 0.0 if which == "varlen" else float("inf"))

    return choose


def run_both(path, mha, args, kwargs, grads=True):
    results = {}
    for which in ("dense", "varlen"):
        path(which)
        mha.zero_grad()
        leaves = [a.detach().clone().requires_grad_(grads) for a in args]
        out = mha(*leaves, **kwargs)
        if grads:
            g = torch.Generator().manual_seed(0)
            out.backward(torch.randn(out.shape, generator=g))
        results[which] = (out, [x.grad for x in leaves], [p.grad.clone() for p in mha.parameters()] if grads else [])
    return results


CASES = [
    ("padding", lambda lens, L: masks.Padding(lens)),
    ("padding&causal", lambda lens, L: masks.Padding(lens) & masks.Causal()),
    ("valid-lens", lambda lens, L: masks.ValidLens(lens)),
    ("valid-lens&window", lambda lens, L: masks.ValidLens(lens) & masks.SlidingWindow(3)),
    ("key-padding-scattered", lambda lens, L: masks.KeyPadding(torch.rand(len(lens), L) > 0.3)),
]


@pytest.mark.parametrize("name, make", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("gqa", [False, True])
def test_varlen_equals_dense_self_attention(path, name, make, gqa):
    torch.manual_seed(0)
    B, L, E = 4, 13, 24
    mha = MultiHeadAttention(E, 6, bias=True, num_kv_heads=2 if gqa else None, query_size=E, key_size=E, value_size=E)
    lens = torch.tensor([13, 7, 0, 1])
    mask = make(lens, L)
    x = torch.randn(B, L, E)
    p = varlen.plan(mask, B, L, L, x.device, force=True)
    assert isinstance(p, varlen.Packing), p
    r = run_both(path, mha, [x], dict(mask=mask))
    (d, dg, dp), (v, vg, vp) = r["dense"], r["varlen"]
    assert torch.allclose(v, d, atol=1e-5)
    assert torch.allclose(vg[0], dg[0], atol=1e-5)
    for a, b in zip(vp, dp):
        assert torch.allclose(a, b, atol=1e-4)
    if name.startswith("padding"):
        real = torch.arange(L) < lens[:, None]
        assert (v[~real] == 0).all() and (d[~real] == 0).all()  # padded query rows: zeros on both paths


def test_varlen_cross_attention_keeps_every_query_row(path):
    torch.manual_seed(1)
    mha = MultiHeadAttention(16, 4, query_size=10, key_size=12, value_size=14)
    q, k, v = torch.randn(3, 5, 10), torch.randn(3, 9, 12), torch.randn(3, 9, 14)
    lens = torch.tensor([9, 4, 2])
    r = run_both(path, mha, [q, k, v], dict(valid_lens=lens))
    assert torch.allclose(r["varlen"][0], r["dense"][0], atol=1e-5)
    for a, b in zip(r["varlen"][1], r["dense"][1]):
        assert torch.allclose(a, b, atol=1e-5)


def test_plan_reasons():
    lens = torch.tensor([5, 3])
    assert "applied densely" in varlen.plan(masks.ValidLens(lens) & masks.Dense(torch.ones(4, 6, dtype=torch.bool)),
                                            2, 4, 6, "cpu", force=True)
    assert "bottom-right" not in str(varlen.plan(masks.ValidLens(lens), 2, 4, 6, "cpu", force=True))
    assert "applied densely" in varlen.plan(masks.ValidLens(lens) & masks.Causal("bottom-right"), 2, 4, 6, "cpu",
                                            force=True)
    scattered = masks.KeyPadding(torch.tensor([[True, False, True, True, True, True]] * 2))
    assert "not a prefix" in varlen.plan(scattered & masks.Causal(), 2, 4, 6, "cpu", force=True)
    assert "no padding" in varlen.plan(masks.Causal(), 2, 4, 6, "cpu", force=True)
    assert "Lk=6: skipping padded keys saves at most" in varlen.plan(masks.ValidLens(lens), 2, 4, 6, "cpu",
                                                                    flop_per_token=10.0)
    big = torch.randint(1, 64, (64,))
    assert "less than the per-sequence loop costs" in varlen.plan(masks.ValidLens(big), 64, 4, 64, "cpu",
                                                                  flop_per_token=1e5)


def test_module_explain_reports_the_path():
    mha = MultiHeadAttention(768, 12, query_size=768, key_size=768, value_size=768)
    x = torch.randn(8, 512, 768)
    lens = torch.randint(128, 513, (8,))
    text = str(mha.explain(x, mask=masks.Padding(lens)))
    assert text.startswith("path: packed (packing:") and "runs: sdpa" in text
    small = MultiHeadAttention(100, 5, query_size=100, key_size=100, value_size=100)
    text = str(small.explain(torch.randn(2, 4, 100), torch.randn(2, 6, 100), valid_lens=torch.tensor([3, 2])))
    assert text.startswith("path: dense (")


def test_forward_packed_checks_its_description_of_the_tokens():
    import multihead

    torch.manual_seed(0)
    m = multihead.MultiHeadAttention(16, 4)
    x = torch.randn(7, 16)  # sequences of 4 and 3 tokens
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    want = m.forward_packed(x, cu, 4)
    assert torch.allclose(m.forward_packed(x, cu, 6), want)  # a wider padded layout is fine
    with pytest.raises(ValueError, match=r"max_seqlen must be at least the longest sequence's length, 4"):
        m.forward_packed(x, cu, 3)
    with multihead.capture(m), pytest.raises(ValueError, match="max_seqlen must be at least"):
        m.forward_packed(x, cu, 2)  # was an IndexError inside varlen.pad under capture
    with pytest.raises(ValueError, match="must start at 0 and never decrease"):
        m.forward_packed(x, torch.tensor([0, 5, 4]), 5)
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer tensor"):
        m.forward_packed(x, torch.tensor([0.0, 4.0, 7.0]), 4)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=12), heads=st.sampled_from([(1, 1), (4, 2), (12, 3)]),
       D=st.sampled_from([3, 16]))
def test_padded_groups_cover_every_token_once(lens, heads, D):
    """Short self-attention is cut into padded calls of sequences of like length: every real token
    is in exactly one group's real slots, every slot reads a token of its own sequence, and the
    calls core_calls reports are the groups."""
    H = heads[0]
    p = varlen.padded_groups(tuple(lens), 2.0 * H * 2 * D)
    assert len(p.groups) <= varlen.MAX_GROUPS
    assert sum(g.B for g in p.groups) == sum(n > 0 for n in lens) and sum(g.N for g in p.groups) == sum(lens)
    if not p.groups:
        return
    src, keep, real, back = p.tensors("cpu")
    starts = torch.tensor([0, *lens]).cumsum(0)
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # (N,) each token's sequence
    at, n, tokens = 0, 0, []
    for g in p.groups:
        s, k = src[at:at + g.B * g.Lm].view(g.B, g.Lm), keep[at:at + g.B * g.Lm].view(g.B, g.Lm)
        assert g.Lm == int(k.sum(1).max()) and (seq_of[s] == seq_of[s[:, :1]]).all()  # one sequence per row
        assert (k.sum(1) == torch.tensor([lens[int(seq_of[r[0]])] for r in s])).all()
        r = real[n:n + g.N]
        assert torch.equal(r, k.reshape(-1).nonzero().squeeze(1))
        tokens.append(s.reshape(-1)[r])
        at, n = at + g.B * g.Lm, n + g.N
    tokens = torch.cat(tokens)
    assert sorted(tokens.tolist()) == list(range(sum(lens)))  # each token once
    if back is None:
        assert torch.equal(tokens, torch.arange(sum(lens)))  # one group: the tokens in order
    else:
        assert torch.equal(tokens[back], torch.arange(sum(lens)))
    cu = starts.tolist()
    calls = varlen.core_calls(cu, cu, None, 2.0 * H * 2 * D)
    assert [(B, Lq, Lk) for B, Lq, Lk, _ in calls] == [(g.B, g.Lm, g.Lm) for g in p.groups]


@pytest.mark.parametrize("lens", [[1, 2, 3, 60, 64, 2, 0, 61], [40, 0, 0, 1], [7]])
def test_grouped_padding_matches_the_reference_with_gradients(lens):
    """Lengths spread wide make several padded calls (a cut saves more than a call costs): outputs
    and gradients equal the float64 spec's per sequence, empty sequences included."""
    torch.manual_seed(1)
    H, Hkv, D, Dv = 12, 4, 48, 40
    groups = varlen.padded_groups(tuple(lens), 2.0 * H * (D + Dv)).groups
    assert len(groups) > 1 if len(lens) == 8 else len(groups) == 1  # the first cuts off the short sequences
    N = sum(lens)
    q = torch.randn(N, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(N, Hkv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(N, Hkv, Dv, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *lens]).cumsum(0)
    out = multihead.attention_varlen(q, k, v, cu, cu)  # (N, H, Dv)
    refs = []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        if b > a:
            qb, kb, vb = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # (1, h, n, d)
            refs.append(reference_attention(qb, kb, vb)[0].transpose(0, 1))  # (n, H, Dv)
    ref = torch.cat(refs)
    assert torch.allclose(out, ref, atol=1e-12)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-10)
