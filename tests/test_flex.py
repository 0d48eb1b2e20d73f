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


def test_flex_refuses_cuda_head_sizes_under_16():
    """Its CUDA kernel raises "NYI: embedding dimension ... must be at least 16" (an H200, tools/gpu_check.py);
    inside a caller's torch.compile that surfaced as the caller's compile error (the course's module at D = 8),
    so "auto" must never pick it there. Checked on the request (no GPU needed)."""
    from multihead.backends.registry import request

    q, k, v = qkv(2, 4, 4, 9, 9, 8, 16)
    req = request(q, k, v, masks.ValidLens(torch.tensor([9, 3])), 0.0)._replace(device_type="cuda")
    assert flex.can_run(req) == "its CUDA kernel takes head sizes of at least 16; got D=8, Dv=16"
    assert flex.can_run(req._replace(D=16, Dv=15)).endswith("got D=16, Dv=15")
    assert flex.can_run(req._replace(D=16)) is None
    assert flex.can_run(req._replace(device_type="cpu")) is None  # the CPU kernel takes them (forward)


def test_a_block_mask_made_for_prediction_is_not_reused_by_training():
    """A block mask made under inference_mode holds inference tensors; reused by a call that trains, CUDA's
    backward raised "Inference tensors cannot be saved for backward" (an H200, bench/flex_cuda.py)."""
    mask = masks.ValidLens(torch.tensor([40, 17]))
    with torch.inference_mode():
        made_for_prediction = flex.block_mask(mask, 2, 40, 40, "cpu")
        assert flex.block_mask(mask, 2, 40, 40, "cpu") is made_for_prediction  # cached for prediction
    for_training = flex.block_mask(mask, 2, 40, 40, "cpu")
    assert for_training is not made_for_prediction
    assert not for_training.kv_num_blocks.is_inference()
    assert flex.block_mask(mask, 2, 40, 40, "cpu") is for_training


def _cuda_request(mask, L=512, B=8, D=64, grad=False):
    from multihead.backends.registry import Request

    return Request("cuda", torch.bfloat16, B, 12, 12, L, L, D, D, mask, 0.0, grad)


def test_auto_prefers_flex_on_cuda_only_for_narrow_bands():
    """Measured on an H200 (bench/results/flex_cuda): flex ran padding, key-padding and causal + padding masks
    at 0.23-0.66x sdpa's speed, a 257-key window over 4096 keys at 2.1-3.4x. Checked on requests (no GPU)."""
    lens = torch.tensor([512, 200])
    slower = "on CUDA it ran slower than sdpa except for narrow bands (reaching at most 1/16 of the keys"
    for mask in (masks.ValidLens(lens), masks.KeyPadding(torch.ones(2, 512, dtype=torch.bool)),
                 masks.Causal() & masks.ValidLens(lens), masks.SlidingWindow(256, 0)):
        assert flex.prefer(_cuda_request(mask)).startswith(slower), mask
    assert flex.prefer(_cuda_request(masks.SlidingWindow(256, 0), L=4096)) is None  # reach 256 of 4096 keys
    assert flex.prefer(_cuda_request(masks.SlidingWindow(127, 128) & masks.ValidLens(lens), L=4096)) is None
    assert flex.prefer(_cuda_request(masks.SlidingWindow(256, 0), L=4095)).startswith(slower)  # 256 > 4095/16
    assert flex.prefer(_cuda_request(masks.Causal(), L=4096)).startswith("sdpa's fused kernels")
    assert flex.prefer(_cuda_request(None)).startswith("sdpa's fused kernels")


def test_auto_stops_preferring_flex_past_torchs_recompile_limit(monkeypatch):
    """flex compiles once per shape (dynamic=False; dynamic shapes gave wrong outputs on CPU in torch 2.13);
    torch runs the shapes past its recompile limit unfused, so "auto" keeps flex for the compiled ones only."""
    monkeypatch.setattr(flex, "_COMPILED_KEYS", set())
    monkeypatch.setattr(flex, "_recompile_limit", lambda: 3)
    window = masks.SlidingWindow(100, 0)
    reqs = [_cuda_request(window, L=4096, B=b) for b in range(1, 5)]
    for r in reqs[:3]:
        assert flex.prefer(r) is None
        flex._COMPILED_KEYS.add(flex._compile_key(r))  # what run() records after a compile
    assert flex.prefer(reqs[0]) is None  # compiled: no new compile
    assert flex.prefer(reqs[3]) == ("it has compiled for 3 shapes in this process; torch runs the ones past its "
                                    "recompile limit (3) unfused")


def test_run_records_what_it_compiled():
    q, k, v = qkv(1, 2, 2, 24, 24, 16, 16)
    mask = masks.SlidingWindow(3, 0)
    attention(q, k, v, mask, backend="flex")
    from multihead.backends.registry import request

    assert flex._compile_key(request(q, k, v, mask, 0.0)) in flex._COMPILED_KEYS
    assert flex._recompile_limit() == torch._dynamo.config.recompile_limit
