"""Masks: meaning, composition, drawings, converters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead import masks


def full(mask, B, H, Lq, Lk):
    return mask.keep(B, H, Lq, Lk).expand(B, H, Lq, Lk)


def test_valid_lens_is_the_course_masking():
    m = masks.ValidLens(torch.tensor([3, 2]))
    k = full(m, 2, 1, 4, 6)
    assert k[0, 0].sum(-1).tolist() == [3, 3, 3, 3]
    assert k[1, 0].sum(-1).tolist() == [2, 2, 2, 2]
    m2 = masks.ValidLens(torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]]))  # (B, Lq): per query
    k2 = full(m2, 2, 1, 4, 6)
    assert k2[0, 0].sum(-1).tolist() == [1, 2, 3, 4] and k2[1, 0].sum(-1).tolist() == [4, 3, 2, 1]
    assert (k2[0, 0, 1] == torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.bool)).all()


def test_causal_alignments_as_drawn():
    tl = masks.Causal().to_string(3, 5).splitlines()[1:]
    br = masks.Causal("bottom-right").to_string(3, 5).splitlines()[1:]
    assert tl == ["1 0 0 0 0", "1 1 0 0 0", "1 1 1 0 0"]
    assert br == ["1 1 1 0 0", "1 1 1 1 0", "1 1 1 1 1"]
    br2 = masks.Causal("bottom-right").to_string(5, 3).splitlines()[1:]
    assert br2 == ["0 0 0", "0 0 0", "1 0 0", "1 1 0", "1 1 1"]
    # the two agree when Lq == Lk
    assert torch.equal(full(masks.Causal(), 1, 1, 6, 6), full(masks.Causal("bottom-right"), 1, 1, 6, 6))
    # and top-left is torch's tril
    assert torch.equal(full(masks.Causal(), 1, 1, 3, 5)[0, 0], torch.ones(3, 5, dtype=torch.bool).tril())


def test_sliding_window_and_docstring_grid():
    rows = masks.SlidingWindow(2).to_string(5, 5).splitlines()[1:]
    assert rows == ["1 0 0 0 0", "1 1 0 0 0", "1 1 1 0 0", "0 1 1 1 0", "0 0 1 1 1"]
    assert rows == [r.strip() for r in masks.SlidingWindow.__doc__.split("::")[1].strip().splitlines()]
    both = full(masks.SlidingWindow(1, 1), 1, 1, 4, 4)[0, 0]
    assert both.sum(-1).tolist() == [2, 3, 3, 2]


def test_causal_docstring_grids_are_true():
    doc = masks.Causal.__doc__
    assert "1 0 0 0 0                 1 1 1 0 0" in doc
    assert "1 1 1 0 0                 1 1 1 1 1" in doc


def test_composition_ands_keeps_and_adds_biases():
    lens = masks.ValidLens(torch.tensor([4, 2]))
    m = lens & masks.Causal()
    assert isinstance(m, masks.And) and len(m.parts()) == 2
    assert torch.equal(full(m, 2, 1, 4, 4), full(lens, 2, 1, 4, 4) & full(masks.Causal(), 2, 1, 4, 4))
    m3 = m & masks.SlidingWindow(1)
    assert len(m3.parts()) == 3  # flattened
    b1, b2 = torch.randn(1, 1, 3, 3), torch.randn(3, 3)
    bb = masks.Dense(b1) & masks.Dense(b2)
    assert torch.allclose(bb.bias(1, 1, 3, 3), b1 + b2)
    assert lens & None is lens
    with pytest.raises(TypeError, match="can only combine a mask with another Mask"):
        lens & torch.ones(2)


def test_padding_masks_queries_and_keys():
    m = masks.Padding(torch.tensor([2, 3]))
    k = full(m, 2, 1, 3, 3)
    assert k[0, 0].tolist() == [[True, True, False], [True, True, False], [False, False, False]]
    assert k[1, 0].all()


def test_from_torch_inverts_polarity():
    am = torch.tensor([[False, True], [False, False]])  # torch.nn: True = not allowed
    m = masks.from_torch(attn_mask=am)
    assert torch.equal(full(m, 1, 1, 2, 2)[0, 0], ~am)
    fam = torch.tensor([[0.0, float("-inf")], [0.5, 0.0]])
    m = masks.from_torch(attn_mask=fam)
    assert torch.equal(m.bias(1, 1, 2, 2)[0, 0], fam)
    assert torch.equal(full(m, 1, 1, 2, 2)[0, 0], torch.tensor([[True, False], [True, True]]))
    kpm = torch.tensor([[False, False, True]])  # True = padding
    m = masks.from_torch(key_padding_mask=kpm)
    assert isinstance(m, masks.KeyPadding) and full(m, 1, 1, 2, 3)[0, 0, 0].tolist() == [True, True, False]
    both = masks.from_torch(attn_mask=torch.zeros(2, 3, dtype=torch.bool), key_padding_mask=kpm)
    assert full(both, 1, 1, 2, 3)[0, 0].tolist() == [[True, True, False]] * 2
    per_head = torch.zeros(2 * 3, 4, 5, dtype=torch.bool)  # (B*H, Lq, Lk)
    per_head[4, 1, 2] = True  # batch 1, head 1
    m = masks.from_torch(attn_mask=per_head, num_heads=3)
    assert not full(m, 2, 3, 4, 5)[1, 1, 1, 2] and full(m, 2, 3, 4, 5).sum() == 2 * 3 * 4 * 5 - 1
    with pytest.raises(ValueError, match="pass num_heads=H"):
        masks.from_torch(attn_mask=per_head)
    assert masks.from_torch() is None


def test_from_keras_and_blocked():
    km = torch.tensor([[[1, 0], [1, 1]]])  # (B, Lq, Lk), 1 = attend
    assert full(masks.from_keras(km), 1, 2, 2, 2)[0, 1].tolist() == [[True, False], [True, True]]
    look_ahead = 1 - np.tril(np.ones((3, 3)))  # the tutorial's: 1 = blocked
    m = masks.from_blocked(look_ahead)
    assert masks.blocked is masks.from_blocked  # the round-3 name still works
    assert torch.equal(full(m, 1, 1, 3, 3), full(masks.Causal(), 1, 1, 3, 3))
    with pytest.raises(ValueError, match="takes 0/1 values"):
        masks.blocked(np.array([[0.5]]))
    with pytest.raises(ValueError, match=r"from_keras\(attention_mask\) takes 0/1 values"):  # 0.5 was read as True
        masks.from_keras(torch.tensor([[[1.0, 0.5]]]))


def test_from_hf_takes_the_4d_masks_and_refuses_a_tokenizers_with_its_conversion():
    """A tokenizer's (B, L) mask given to from_hf was read as (Lq, Lk), and as float 0/1 as a bias of +1 that masks
    nothing; from_sdpa keeps SDPA's own convention (any broadcastable shape)."""
    am = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for bad in (am.bool(), am.float()):
        with pytest.raises(ValueError, match=r"got shape \(2, 3\). A tokenizer's \(B, L\) attention_mask .* is "
                                             r"masks.Dense\(attention_mask.bool\(\)\[:, None, None, :\]\)"):
            masks.from_hf(bad)
    keep = full(masks.Dense(am.bool()[:, None, None, :]), 2, 1, 3, 3)
    bias = torch.zeros(2, 1, 1, 3).masked_fill(~am.bool()[:, None, None, :], torch.finfo(torch.float32).min)
    assert torch.equal(full(masks.from_hf(bias), 2, 1, 3, 3), keep)
    assert torch.equal(full(masks.from_hf(am.bool()[:, None, None, :]), 2, 1, 3, 3), keep)
    tri = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(full(masks.from_sdpa(tri), 1, 1, 3, 3), full(masks.Causal(), 1, 1, 3, 3))


def test_to_string_header_names_the_mask():
    s = masks.ValidLens(torch.tensor([1, 2])).to_string(2, 3, batch=1)
    assert s.splitlines() == ["ValidLens([1, 2])  [batch 1, head 0, Lq=2, Lk=3]", "1 1 0", "1 1 0"]


def test_masks_are_immutable():
    m = masks.Causal()
    with pytest.raises(AttributeError):
        m.align = "bottom-right"


# --- the band rule and the zero-row rule, each written once (masks.band_*, masks.zero_empty_rows) ---


@settings(max_examples=200, deadline=None)
@given(lo=st.one_of(st.just(-math.inf), st.integers(-12, 12)), width=st.one_of(st.just(math.inf), st.integers(0, 12)),
       qs=st.integers(0, 10), qn=st.integers(1, 6), ks=st.integers(0, 10), kn=st.integers(1, 6))
def test_the_band_helpers_agree_with_the_rule(lo, width, qs, qn, ks, kn):
    hi = lo + width if lo != -math.inf else (width if width != math.inf else math.inf)
    i = torch.arange(qs, qs + qn)[:, None]  # (qn, 1)
    j = torch.arange(ks, ks + kn)[None, :]  # (1, kn)
    keep = masks.band_keep(lo, hi, i, j)  # (qn, kn)
    brute = torch.tensor([[lo <= b - a <= hi for b in range(ks, ks + kn)] for a in range(qs, qs + qn)])
    assert torch.equal(keep, brute)
    kind = masks.band_block(lo, hi, qs, qn, ks, kn)
    assert kind == (0 if not brute.any() else 1 if brute.all() else 2)
    first, end = masks.band_keys(lo, hi, qs, qs + qn, ks + kn)  # keys 0..ks+kn-1
    seen = torch.tensor([[lo <= b - a <= hi for b in range(ks + kn)] for a in range(qs, qs + qn)]).any(0)
    visible = seen.nonzero().flatten().tolist()
    assert (visible == list(range(first, end))) if visible else end <= first


def test_rows_with_nothing_to_attend_to_are_zeroed_once():
    out = torch.randn(2, 1, 3, 4)
    keep = torch.tensor([[True, False], [False, False], [False, True]])[None, None]  # (1, 1, Lq=3, Lk=2)
    z = masks.zero_empty_rows(out, keep)
    assert torch.equal(z[:, :, 1], torch.zeros(2, 1, 4)) and torch.equal(z[:, :, [0, 2]], out[:, :, [0, 2]])
    assert masks.zero_empty_rows(out, keep, kernel_did=True) is out
