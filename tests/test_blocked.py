"""The blocked backend (banded masks, masked blocks skipped) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import multihead
from conftest import AWKWARD, assert_close_to_reference, qkv
from multihead import attention, masks
from multihead.backends import blocked


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocked, "BLOCK", 16)
    monkeypatch.setattr(blocked, "MIN_SIZE", 0)
    monkeypatch.setattr(blocked, "MAX_VISITED", 1.0)


BANDS = {
    "window": masks.SlidingWindow(5),
    "window-both-sides": masks.SlidingWindow(3, 4),
    "window-br": masks.SlidingWindow(6, 0, align="bottom-right"),
    "causal-br": masks.Causal("bottom-right"),
    "causal&window": masks.Causal() & masks.SlidingWindow(9, 2),
}


@pytest.mark.parametrize("name", list(BANDS))
@pytest.mark.parametrize("sizes", AWKWARD + [(1, 2, 1, 70, 53, 8, 8), (2, 2, 2, 40, 90, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_blocked_matches_reference(small_blocks, name, sizes):
    q, k, v = qkv(*sizes, contiguous=False)
    assert_close_to_reference(lambda *a, **kw: attention(*a, backend="blocked", **kw), q, k, v, BANDS[name])


def test_blocked_is_chosen_only_where_it_wins():
    q = torch.empty(1, 2, 4096, 8)
    k = v = torch.empty(1, 2, 4096, 8)
    text = str(multihead.explain(q, k, v, masks.SlidingWindow(128)))
    assert "runs: blocked" in text and "visits" in text
    text = str(multihead.explain(q, k, v, masks.Causal()))
    assert "runs: sdpa" in text and "is_causal kernel" in text
    text = str(multihead.explain(q, k, v, masks.SlidingWindow(4000)))
    assert "runs: sdpa" in text and "dense SDPA is as fast" in text
    small = torch.empty(1, 2, 64, 8)
    assert "too small to gain" in str(multihead.explain(small, small, small, masks.SlidingWindow(4)))
    assert "only Causal / SlidingWindow" in str(multihead.explain(q, k, v, masks.ValidLens(torch.tensor([5]))))


def test_blocked_rows_with_nothing_to_see(small_blocks):
    q, k, v = qkv(1, 2, 2, 40, 10, 4, 4, requires_grad=True)
    out = attention(q, k, v, masks.Causal("bottom-right"), backend="blocked")  # rows 0..29 see nothing
    assert (out[:, :, :30] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
