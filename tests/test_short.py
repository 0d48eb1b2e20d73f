"""The short backend (short sequences, prediction: scores materialized, softmax in place) against the float64
reference, and where "auto" picks it."""

from __future__ import annotations

import pytest
import torch

import multihead
from conftest import AWKWARD, assert_close_to_reference, qkv
from multihead import attention, masks
from multihead.core.varlen import attention_varlen, core_calls


def _masks(B: int, Lq: int, Lk: int) -> dict:
    g = torch.Generator().manual_seed(3)
    pad = torch.rand(B, Lk, generator=g) > 0.4
    pad[0] = False  # a sequence with no real key: its rows come out as zeros
    lens = torch.randint(0, Lk + 1, (B,), generator=g)
    out = {
        "none": None,
        "key-padding": masks.KeyPadding(pad),
        "valid-lens": masks.ValidLens(lens),
        "valid-lens-per-query": masks.ValidLens(torch.randint(0, Lk + 1, (B, Lq), generator=g)),
        "causal": masks.Causal(),
        "dense-float": masks.Dense(torch.randn(B, 1, Lq, Lk, generator=g)),
        "causal&valid-lens": masks.Causal("bottom-right") & masks.ValidLens(lens),
    }
    if Lq == Lk:
        out["padding"] = masks.Padding(lens)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", AWKWARD + [(4, 8, 8, 34, 34, 32, 32)], ids=lambda s: "x".join(map(str, s)))
def test_short_matches_reference_on_every_mask(sizes, dtype):
    q, k, v = qkv(*sizes, dtype=dtype, contiguous=False)
    B, Lq, Lk = sizes[0], sizes[3], sizes[4]
    with torch.no_grad():
        for mask in _masks(B, Lq, Lk).values():
            assert_close_to_reference(lambda *a, **kw: attention(*a, backend="short", **kw), q, k, v, mask,
                                      grads=False)


def test_short_gives_zeros_not_nan_for_a_row_with_nothing_to_attend_to():
    q, k, v = qkv(3, 4, 4, 6, 6, 8, 8)
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[1] = False
    with torch.no_grad():
        out = attention(q, k, v, masks.KeyPadding(keep), backend="short")
        lens = attention(q, k, v, masks.ValidLens(torch.tensor([6, 0, 2])), backend="short")
    assert (out[1] == 0).all() and torch.isfinite(out).all()
    assert (lens[1] == 0).all() and torch.isfinite(lens).all()


def test_short_reads_both_layouts_and_answers_in_the_inputs_order():
    """Head-major storage (H, B, L, D) is read without a copy and gives the same numbers as batch-major."""
    B, H, L, D = 5, 6, 9, 8
    g = torch.Generator().manual_seed(0)
    store = torch.randn(3, H, B, L, D, generator=g)  # head-major: (H, B, L, D) each
    q, k, v = (t.transpose(0, 1) for t in store)  # (B, H, L, D) views
    mask = masks.KeyPadding(torch.rand(B, L, generator=g) > 0.3)
    with torch.no_grad():
        heads_first = attention(q, k, v, mask, backend="short")
        batch_first = attention(q.contiguous(), k.contiguous(), v.contiguous(), mask, backend="short")
        ref = attention(q, k, v, mask, backend="reference")
    assert heads_first.shape == (B, H, L, D)
    torch.testing.assert_close(heads_first, batch_first)
    torch.testing.assert_close(heads_first, ref, atol=1e-5, rtol=1e-5)


def test_short_refuses_what_it_cannot_compute_and_says_why():
    q, k, v = qkv(4, 8, 8, 10, 10, 8, 8, requires_grad=True)
    mask = masks.KeyPadding(torch.ones(4, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"backend 'short' cannot run this call: no gradients"):
        attention(q, k, v, mask, backend="short")
    with torch.no_grad():
        with pytest.raises(ValueError, match="no dropout"):
            attention(q, k, v, mask, dropout_p=0.1, backend="short")
        with pytest.raises(ValueError, match=r"float32 and float64 only \(got torch.bfloat16"):
            attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, backend="short")


def test_auto_picks_short_only_for_short_key_padded_prediction_on_the_cpu():
    def runs(B, H, L, mask, *, grad=False, Hkv=None):
        q = torch.empty(B, H, L, 32, requires_grad=grad)
        kv = torch.empty(B, Hkv or H, L, 32)
        with torch.set_grad_enabled(grad):
            text = str(multihead.explain(q, kv, kv, mask))
        return text.split("runs: ")[1].split()[0], text

    pad = masks.KeyPadding(torch.ones(16, 34, dtype=torch.bool))
    name, text = runs(16, 8, 34, pad)
    assert name == "short" and "128 score matrices of 34 x 34" in text
    assert runs(16, 8, 34, masks.ValidLens(torch.full((16,), 20)))[0] == "short"
    assert runs(16, 8, 34, masks.Padding(torch.full((16,), 20)))[0] == "short"
    name, text = runs(16, 8, 34, pad, grad=True)
    assert name == "sdpa" and "no gradients" in text
    name, text = runs(16, 8, 34, None)
    assert name == "sdpa" and "without a mask" in text
    name, text = runs(16, 8, 34, masks.Causal())
    assert name == "sdpa" and "masks other than key padding" in text
    name, text = runs(1, 8, 34, masks.KeyPadding(torch.ones(1, 34, dtype=torch.bool)))
    assert name == "sdpa" and "fewer than 12 (batch, head) pairs" in text
    name, text = runs(1, 12, 32, masks.KeyPadding(torch.ones(1, 32, dtype=torch.bool)))
    assert name == "sdpa" and "fewer than 768 keys over the (batch, head) pairs" in text
    assert runs(1, 12, 64, masks.KeyPadding(torch.ones(1, 64, dtype=torch.bool)))[0] == "short"
    name, text = runs(16, 8, 96, masks.KeyPadding(torch.ones(16, 96, dtype=torch.bool)))
    assert name == "sdpa" and "more than 524288 scores" in text
    name, text = runs(16, 8, 34, pad, Hkv=2)
    assert name == "sdpa" and "grouped-query heads" in text


def test_packed_sentences_run_on_short_and_equal_the_reference():
    """attention_varlen's padded groups (the served encoder's path) under no_grad pick short; the answer is the
    per-sequence reference, and the same with gradients (sdpa)."""
    g = torch.Generator().manual_seed(5)
    lens = [25, 11, 17, 22, 18, 55, 43, 24, 32, 26, 31, 39, 31, 26, 23, 34]
    N, H, D = sum(lens), 8, 32
    qkv_ = torch.randn(N, 3, H, D, generator=g)  # a fused projection's output, as the served encoder has it
    q, k, v = qkv_.unbind(1)  # 3 x (N, H, D), strided views
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    calls = core_calls(cu.tolist(), cu.tolist(), None, 2.0 * H * (D + D))  # the padded groups, (B, Lm, Lm, mask)
    assert len(calls) >= 2
    for B, Lq, _, mask in calls:  # the 13 shorter sentences, then the 3 longest
        t = torch.empty(B, H, Lq, D)
        with torch.no_grad():
            assert "runs: short" in str(multihead.explain(t, t, t, mask))
    assert [B for B, *_ in calls] == [13, 3]
    with torch.no_grad():
        out = attention_varlen(q, k, v, cu, cu)
    ref = torch.cat([multihead.reference_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                                   v[a:b].transpose(0, 1)[None])[0].transpose(0, 1)
                     for a, b in zip(cu.tolist(), cu.tolist()[1:])])  # (N, H, D)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    qg = q.detach().clone().requires_grad_()
    torch.testing.assert_close(attention_varlen(qg, k, v, cu, cu), ref, atol=2e-6, rtol=1e-5)


def test_short_compiles_whole_graph_and_keeps_the_zero_row_rule():
    """Under torch.compile(fullgraph=True) "auto" picks short as in eager, with no branch on the mask's values
    (rows with nothing to attend to are zeroed in place, unconditionally)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(8, 4, 32, 16, generator=g) for _ in range(3))
    keep = torch.arange(32)[None] < torch.tensor([32, 3, 0, 20, 11, 5, 19, 2])[:, None]  # sequence 2: all padding
    mask = masks.KeyPadding(keep)
    with torch.no_grad():
        assert "runs: short" in str(multihead.explain(q, k, v, mask))
        out = torch.compile(lambda q, k, v, m: attention(q, k, v, m), fullgraph=True)(q, k, v, mask)
        ref = attention(q, k, v, mask, backend="reference")
    assert (out[2] == 0).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
