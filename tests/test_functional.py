"""The functional core and every backend against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import multihead
from conftest import AWKWARD, assert_close_to_reference, qkv
from multihead import attention, attention_weights, backends, masks, reference_attention

BACKENDS = ["sdpa", "math", "reference"]


def mask_cases(B, H, Lq, Lk, device="cpu"):
    """One of every mask kind for these sizes, rows with nothing to attend to included; their tensors on
    ``device`` (tools/gpu_check.py runs the same cases on CUDA)."""
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, Lk + 1, (B,), generator=g)
    lens[0] = Lk
    lens2 = torch.randint(0, Lk + 1, (B, Lq), generator=g)
    keep = torch.rand(B, Lk, generator=g) > 0.3
    dense_bool = torch.rand(B, 1, Lq, Lk, generator=g) > 0.4
    bias = torch.randn(1, H, Lq, Lk, generator=g)
    bias_inf = bias.masked_fill(torch.rand(1, H, Lq, Lk, generator=g) > 0.6, float("-inf"))
    lens, lens2, keep, dense_bool, bias, bias_inf = (t.to(device) for t in (lens, lens2, keep, dense_bool, bias,
                                                                             bias_inf))
    cases = {
        "none": None,
        "causal-tl": masks.Causal(),
        "causal-br": masks.Causal("bottom-right"),
        "valid-lens": masks.ValidLens(lens),
        "valid-lens-2d": masks.ValidLens(lens2),
        "key-padding": masks.KeyPadding(keep),
        "window": masks.SlidingWindow(3, 1),
        "dense-bool": masks.Dense(dense_bool),
        "dense-bias": masks.Dense(bias),
        "dense-bias-inf": masks.Dense(bias_inf),
        "lens&causal": masks.ValidLens(lens) & masks.Causal("bottom-right"),
        "bias&window": masks.Dense(bias) & masks.SlidingWindow(2),
    }
    if Lq == Lk:
        cases["padding"] = masks.Padding(lens)
    return cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_backend_matches_reference_every_mask(backend, sizes):
    B, H, Hkv, Lq, Lk, D, Dv = sizes
    q, k, v = qkv(*sizes, contiguous=False)
    for name, mask in mask_cases(B, H, Lq, Lk).items():
        try:
            assert_close_to_reference(lambda *a, **kw: attention(*a, backend=backend, **kw), q, k, v, mask)
        except AssertionError as e:
            raise AssertionError(f"mask {name}: {e}") from e


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sdpa_other_dtypes(dtype):
    q, k, v = qkv(2, 4, 2, 9, 13, 16, 8, dtype=dtype)
    for mask in (None, masks.Causal(), masks.ValidLens(torch.tensor([5, 0]))):
        assert_close_to_reference(lambda *a, **kw: attention(*a, backend="sdpa", **kw), q, k, v, mask,
                                  grads=dtype == torch.float64)


def test_custom_scale_matches_reference():
    q, k, v = qkv(2, 3, 3, 6, 8, 5, 4)
    assert_close_to_reference(lambda *a, **kw: attention(*a, backend="sdpa", **kw), q, k, v, None, scale=0.37)


def test_golden_hand_computed():
    # one query [1, 0], keys [1, 0] and [0, 1], values [1, 2] and [3, 4], D = 2:
    # scores 1/sqrt(2) and 0; weights sigmoid(1/sqrt(2)) and 1 - that.
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)  # (1, 1, 1, 2)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)  # (1, 1, 2, 2)
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=torch.float64)  # (1, 1, 2, 2)
    w0 = 1.0 / (1.0 + math.exp(-1.0 / math.sqrt(2.0)))  # 0.66976...
    expected = [w0 * 1 + (1 - w0) * 3, w0 * 2 + (1 - w0) * 4]
    for backend in BACKENDS:
        out = attention(q, k, v, backend=backend)
        assert out.flatten().tolist() == pytest.approx(expected, abs=1e-12)
    assert attention_weights(q, k).flatten().tolist() == pytest.approx([w0, 1 - w0], abs=1e-12)
    # with the second key masked, all weight goes to the first: the output is v[0]
    out = attention(q, k, v, masks.ValidLens(torch.tensor([1])))
    assert out.flatten().tolist() == pytest.approx([1.0, 2.0], abs=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_give_zeros_and_finite_grads(backend):
    B, H, Lq, Lk, D = 2, 3, 5, 6, 8
    q, k, v = qkv(B, H, H, Lq, Lk, D, D, requires_grad=True)
    cases = [
        masks.ValidLens(torch.tensor([0, 3])),  # sequence 0: nothing at all
        masks.ValidLens(torch.tensor([[0, 1, 2, 0, 6], [6, 0, 6, 0, 6]])),
        masks.Causal("bottom-right") & masks.ValidLens(torch.tensor([6, 6])),  # Lq < Lk: none empty
        masks.Dense(torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)),
        masks.Dense(torch.full((Lq, Lk), float("-inf"))),
        masks.KeyPadding(torch.zeros(B, Lk, dtype=torch.bool)),
    ]
    for mask in cases:
        out = attention(q, k, v, mask, backend=backend)
        w = attention_weights(q, k, mask)
        empty = ~mask.keep(B, H, Lq, Lk).expand(B, H, Lq, Lk).any(-1)  # (B, H, Lq)
        assert torch.isfinite(out).all()
        assert (out[empty] == 0).all()
        assert (w[empty] == 0).all()
        sums = w.sum(-1)
        assert torch.allclose(sums[~empty], torch.ones_like(sums[~empty]), atol=1e-5)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


def test_causal_bottom_right_with_more_queries_than_keys():
    q, k, v = qkv(1, 2, 2, 7, 3, 4, 4)
    for backend in BACKENDS:
        out = attention(q, k, v, masks.Causal("bottom-right"), backend=backend)
        assert (out[:, :, :4] == 0).all()  # rows 0..3 see no key
        assert (out[:, :, 4:] != 0).any()


def test_empty_key_length_gives_zeros():
    q = torch.randn(2, 3, 4, 5)
    k = torch.randn(2, 3, 0, 5)
    v = torch.randn(2, 3, 0, 6)
    out = attention(q, k, v)
    assert out.shape == (2, 3, 4, 6) and (out == 0).all()


@pytest.mark.parametrize("backend", ["auto", *backends.available()])
@pytest.mark.parametrize("sizes", [(0, 2, 2, 3, 5, 4, 6), (2, 0, 0, 3, 5, 4, 6), (2, 2, 2, 0, 5, 4, 6),
                                   (2, 2, 1, 3, 0, 4, 6), (2, 2, 2, 3, 5, 4, 0)], ids=["B=0", "H=0", "Lq=0", "Lk=0", "Dv=0"])
def test_a_call_with_nothing_to_compute_gives_zeros_and_zero_gradients_on_every_backend(backend, sizes):
    """No keys, or an empty output: (B, H, Lq, Dv) zeros whatever the backend (a kernel given such a call
    crashed: flex's compiled kernel killed the process at Lq = 0, short raised from a reshape), joined to the
    graph so that backward gives every input a zero gradient."""
    B, H, Hkv, Lq, Lk, D, Dv = sizes
    q = torch.randn(B, H, Lq, D, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, Dv, requires_grad=True)
    out = attention(q, k, v, backend=backend)
    assert out.shape == (B, H, Lq, Dv) and (out == 0).all()
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all() for t in (q, k, v))
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        attention(q, k, v, backend="nope")


def test_causality_through_gradients():
    """Output row i must not depend on keys/values after position i."""
    q, k, v = qkv(1, 2, 2, 6, 6, 8, 8, requires_grad=True)
    for backend in BACKENDS:
        out = attention(q, k, v, masks.Causal(), backend=backend)
        i = 2
        gk, gv = torch.autograd.grad(out[:, :, i].sum(), (k, v))
        assert (gk[:, :, i + 1:] == 0).all() and (gv[:, :, i + 1:] == 0).all()
        assert (gk[:, :, : i + 1] != 0).any()


def test_gqa_equals_repeated_heads():
    q, k, v = qkv(2, 6, 2, 5, 7, 8, 4)
    out = attention(q, k, v, masks.Causal())
    rep = attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), masks.Causal())
    assert torch.allclose(out, rep, atol=1e-6)


@given(
    B=st.integers(1, 3), Hkv=st.integers(1, 3), group=st.integers(1, 3), Lq=st.integers(1, 12),
    Lk=st.integers(1, 12), D=st.integers(1, 9), Dv=st.integers(1, 9),
    kind=st.sampled_from(["none", "causal-tl", "causal-br", "valid-lens", "valid-lens-2d", "key-padding",
                          "window", "dense-bool", "dense-bias", "dense-bias-inf", "lens&causal", "bias&window"]),
    seed=st.integers(0, 2**16),
)
# one key, no mask: dq and dk are exactly 0; SDPA's backward leaves roundings of dout . v (conftest's terms)
@example(B=1, Hkv=1, group=1, Lq=3, Lk=1, D=8, Dv=8, kind="none", seed=0)
def test_property_sdpa_equals_reference(B, Hkv, group, Lq, Lk, D, Dv, kind, seed):
    H = Hkv * group
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, Dv, seed=seed, contiguous=seed % 2 == 0)
    mask = mask_cases(B, H, Lq, Lk)[kind]
    assert_close_to_reference(lambda *a, **kw: attention(*a, backend="sdpa", **kw), q, k, v, mask)
    # weights: rows sum to 1 or are all zero; masked keys get exactly 0
    w = attention_weights(q, k, mask)
    if mask is not None:
        keep = mask.keep(B, H, Lq, Lk).expand(B, H, Lq, Lk)
        assert (w[~keep] == 0).all()
        empty = ~keep.any(-1)
    else:
        empty = torch.zeros(B, H, Lq, dtype=torch.bool)
    sums = w.sum(-1)
    assert torch.allclose(sums[~empty], torch.ones_like(sums[~empty]), atol=1e-5)
    assert (sums[empty] == 0).all()


def test_weights_times_values_is_the_output():
    q, k, v = qkv(2, 4, 2, 5, 9, 6, 3, dtype=torch.float64)
    mask = masks.ValidLens(torch.tensor([4, 9])) & masks.Causal("bottom-right")
    w = attention_weights(q, k, mask)  # (B, H, Lq, Lk)
    out = attention(q, k, v, mask)
    assert torch.allclose(w @ v.repeat_interleave(2, 1), out, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_drops_at_the_given_rate(backend):
    """With values = identity (Dv = Lk) the output is the dropped weights themselves."""
    p, Lk = 0.3, 64
    q = torch.randn(4, 4, 64, 16)
    k = torch.randn(4, 4, Lk, 16)
    eye = torch.eye(Lk).expand(4, 4, Lk, Lk)
    w = attention_weights(q, k)
    out = attention(q, k, eye, dropout_p=p, backend=backend)
    dropped = (out == 0) & (w > 0)
    rate = dropped.float().mean().item()
    assert abs(rate - p) < 0.02, rate
    kept = out != 0
    assert torch.allclose(out[kept], w[kept] / (1 - p), rtol=1e-4, atol=1e-6)
    # no dropout: deterministic
    assert torch.equal(attention(q, k, eye, backend=backend), attention(q, k, eye, backend=backend))


def test_fused_output_equals_reference_path():
    q, k, v = qkv(2, 4, 4, 33, 33, 16, 16)
    mask = masks.Causal() & masks.ValidLens(torch.tensor([20, 33]))
    fused = attention(q, k, v, mask)
    ref = attention(q, k, v, mask, backend="reference")
    assert torch.allclose(fused, ref, atol=1e-5)


# --- the registry ---


def test_registry_lists_and_rejects_unknown_names():
    assert backends.available() == ["blocked", "flex", "short", "sdpa", "math", "reference"]  # the order "auto" tries them
    q, k, v = qkv(1, 2, 2, 3, 3, 4, 4)
    valid = r"valid: 'auto', 'blocked', 'flex', 'short', 'sdpa', 'math', 'reference'"
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; " + valid):
        attention(q, k, v, backend="nope")
    with pytest.raises(ValueError, match="unknown attention backend"):
        with backends.use("nope"):
            pass


def test_use_changes_auto_and_explain_reports_it():
    q, k, v = qkv(1, 2, 2, 3, 3, 4, 4)
    calls = []

    def spy(query, key, value, mask, *, scale, dropout_p):
        calls.append(mask)
        return reference_attention(query, key, value, mask, scale=scale, dropout_p=dropout_p)

    backends.register("spy", spy, can_run=lambda r: None if r.Lq < 100 else "only short queries", priority=-5)
    try:
        with backends.use("spy"):
            attention(q, k, v, masks.Causal())
            text = str(multihead.explain(q, k, v))
        assert len(calls) == 1 and isinstance(calls[0], masks.Causal)
        assert "runs: spy" in text and "forced by use('spy')" in text
        text = str(multihead.explain(q, k, v))
        assert "runs: sdpa" in text
        assert "spy" in text and "ranks below 'sdpa'" in text
        long_q = torch.randn(1, 2, 100, 4)
        text = str(multihead.explain(long_q, k, v))
        assert "spy" in text and "cannot run: only short queries" in text
        with pytest.raises(ValueError, match="backend 'spy' cannot run this call: only short queries"):
            attention(long_q, k, v, backend="spy")
        with pytest.raises(ValueError, match="already registered"):
            backends.register("spy", spy)
    finally:
        backends.unregister("spy")
    assert "spy" not in backends.available()


def test_explain_reports_the_sdpa_mask_path():
    q, k, v = qkv(1, 2, 2, 3, 5, 4, 4)
    assert "is_causal=True" in str(multihead.explain(q, k, v, masks.Causal()))
    assert "dense mask" in str(multihead.explain(q, k, v, masks.Causal("bottom-right")))
    assert "needs grad: True" in str(multihead.explain(q, k, v, training=True))


def test_a_backend_that_becomes_unavailable_is_evicted_reported_once_and_not_explained():
    from multihead.backends import registry

    q, k, v = qkv(1, 2, 2, 5, 5, 4, 4)
    calls = []

    def flaky(query, key, value, mask, *, scale, dropout_p):
        calls.append(1)
        if len(calls) > 1:  # chosen and remembered on the first call, then its compiler "fails"
            raise registry.Unavailable("its kernel no longer builds")
        return reference_attention(query, key, value, mask, scale=scale, dropout_p=dropout_p)

    backends.register("flaky", flaky, priority=1000, cacheable=True)
    try:
        want = reference_attention(q, k, v)
        assert torch.allclose(attention(q, k, v), want, atol=1e-6) and len(calls) == 1
        with pytest.warns(RuntimeWarning, match="'flaky' could not run"):
            assert torch.allclose(attention(q, k, v), want, atol=1e-6)
        assert len(calls) == 2  # run once, not twice
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # reported once
            for _ in range(3):
                attention(q, k, v)
        assert len(calls) == 2  # never picked again for this kind of call
        assert "runs: flaky" not in str(multihead.explain(q, k, v))
    finally:
        backends.unregister("flaky")
        registry.forget()


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math", "reference"])
def test_a_learned_bias_gets_its_gradient_on_every_backend_that_runs_it(backend):
    """An additive bias being trained (T5's relative positions): its gradient, against the float64 reference's,
    within a small multiple of the plain float32 computation's error; a backend without gradients ('short',
    which chose by the inputs' requires_grad alone and then failed in backward, 'derivative for aten::softmax is
    not implemented') refuses the call up front."""
    from conftest import K_GRAD, ROUNDINGS, err, plain, rounding

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, L, 5, generator=g) for L in (4, 6, 6))  # (B, H, L, D), Lq != Lk, odd D
    bias0 = torch.randn(1, 3, 4, 6, generator=g, dtype=torch.float64)  # (1, H, Lq, Lk)
    bias0[..., 0, 2] = float("-inf")

    def bias_grad(fn, dtype):
        b = bias0.to(dtype).requires_grad_()
        out = fn(q.to(dtype), k.to(dtype), v.to(dtype), b)
        (grad,) = torch.autograd.grad(out, b, torch.ones_like(out))
        return grad

    ref = bias_grad(reference_attention, torch.float64)
    got = bias_grad(lambda *a: attention(*a, backend=backend), torch.float32)
    base = bias_grad(plain, torch.float32)
    assert torch.isfinite(got).all() and got[..., 0, 2].abs().max() == 0
    assert err(got, ref) <= K_GRAD * err(base, ref) + ROUNDINGS * rounding(ref, torch.float32)
    with pytest.raises(ValueError, match=r"backend 'short' cannot run this call: no gradients"):
        attention(q, k, v, bias0.float().requires_grad_(), backend="short")
