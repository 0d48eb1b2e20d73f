"""The FlexAttention backend: forward parity, CPU backward refused, compile failures fall back."""

from __future__ import annotations

import pytest
import torch

import multihead
from conftest import assert_close_to_reference, qkv
from multihead import attention, masks
from multihead.backends import flex

pytest.importorskip("torch.nn.attention.flex_attention")


def test_flex_forward_matches_reference_composed_masks():
    q, k, v = qkv(2, 4, 2, 64, 64, 16, 16)
    for mask in (
        masks.ValidLens(torch.tensor([40, 64])) & masks.SlidingWindow(8),
        masks.Padding(torch.tensor([33, 0])) & masks.Causal(),
        masks.KeyPadding(torch.rand(2, 64, generator=torch.Generator().manual_seed(0)) > 0.3),
    ):
        assert_close_to_reference(lambda *a, **kw: attention(*a, backend="flex", **kw), q, k, v, mask, grads=False)
    assert not flex._FAILED  # every call really ran FlexAttention


def test_flex_refuses_cpu_backward_and_bias():
    q, k, v = qkv(1, 2, 2, 8, 8, 16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call: FlexAttention has no backward on CPU"):
        attention(q, k, v, masks.Causal(), backend="flex")
    text = str(multihead.explain(q.detach(), k.detach(), v.detach(), masks.Dense(torch.randn(8, 8))))
    assert "flex       cannot run: dense masks and biases are not converted to a mask_mod" in text
    text = str(multihead.explain(q.detach(), k.detach(), v.detach(), masks.SlidingWindow(2)))
    assert "flex       runs only when named: on CPU it lost every measured workload" in text


def test_flex_compile_failure_falls_back_and_is_explained(monkeypatch):
    from torch._inductor.exc import CppCompileError

    def broken(device_type):
        def f(*a, **kw):
            raise CppCompileError(["g++", "kernel.cpp"], "error: cur_qSplitSize8 was not declared")
        return f

    monkeypatch.setattr(flex, "_compiled", broken)
    monkeypatch.setattr(flex, "_FAILED", {})
    q, k, v = qkv(1, 2, 2, 16, 16, 16, 16)
    mask = masks.SlidingWindow(3)
    with pytest.warns(RuntimeWarning, match="'flex' could not run .*its compile failed: CppCompileError"):
        out = attention(q, k, v, mask, backend="flex")  # falls back to the next choice
    assert torch.allclose(out, attention(q, k, v, mask, backend="sdpa"))
    text = str(multihead.explain(q, k, v, mask))
    assert "its compile failed for this shape earlier (CppCompileError: C++ compile error" in text


def test_flex_other_errors_propagate(monkeypatch):
    """Only a failed compile falls back: any other error (a bad shape, out of memory) is raised."""

    def failing(device_type):
        def f(*a, **kw):
            raise RuntimeError("CUDA out of memory")
        return f

    monkeypatch.setattr(flex, "_compiled", failing)
    monkeypatch.setattr(flex, "_FAILED", {})
    q, k, v = qkv(1, 2, 2, 16, 16, 16, 16)
    with pytest.raises(RuntimeError, match="out of memory"):
        attention(q, k, v, masks.SlidingWindow(3), backend="flex")
    assert not flex._FAILED  # nothing remembered: the next call tries flex again
