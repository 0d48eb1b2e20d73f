"""Score modifiers are part of the spec: softcap (Gemma 2: scores -> c * tanh(scores / c)
before the mask's bias) and attention sinks (gpt-oss: one logit per head in each row's softmax
denominator, then dropped). The float64 reference computes them; every backend that lists a
modifier matches the reference (outputs and gradients, the tolerance rule); a backend that does
not list it never runs such a call, and explain says why."""

from __future__ import annotations

import pytest
import torch

import multihead
from conftest import AWKWARD, assert_close_to_reference, qkv
from multihead import attention, attention_weights, backends, reference_attention
from test_functional import mask_cases

SOFTCAP = 2.5


def _sinks(H, dtype=torch.float32, seed=7):
    return (2 * torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).to(dtype)


def _independent(q, k, v, keep, softcap=None, sinks=None):
    """Written apart from the reference: the sink as one more column of the logits, an
    ordinary softmax, the column dropped (how the sink is usually explained). float64, no GQA."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with nothing (and no sink): zeros
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


@pytest.mark.parametrize("mods", ["softcap", "sinks", "both"])
def test_reference_equals_an_independent_formula(mods):
    B, H, Lq, Lk, D = 2, 3, 5, 6, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (Lq, Lk, Lk))
    keep = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
    keep[1, :, 2] = False  # a row with nothing to attend to
    kw = {"softcap": SOFTCAP if mods != "sinks" else None, "sinks": _sinks(H, torch.float64) if mods != "softcap" else None}
    ref = reference_attention(q, k, v, keep, **kw)
    assert torch.allclose(ref, _independent(q, k, v, keep, **kw), atol=1e-12)
    assert (ref[1, :, 2] == 0).all()
    w = attention_weights(q, k, keep, **kw)
    assert torch.allclose(w @ v, ref, atol=1e-12)
    if kw["sinks"] is not None:  # the sink takes its share: rows sum to less than one
        assert (w.sum(-1) < 1).all()


@pytest.mark.parametrize("backend", ["sdpa", "math", "reference", "auto"])
@pytest.mark.parametrize("sizes", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_every_backend_that_computes_sinks_matches_the_reference(backend, sizes):
    B, H, Hkv, Lq, Lk, D, Dv = sizes
    q, k, v = qkv(*sizes, contiguous=False)
    sinks = _sinks(H)
    for name, mask in mask_cases(B, H, Lq, Lk).items():
        try:
            assert_close_to_reference(lambda *a, **kw: attention(*a, backend=backend, **kw), q, k, v, mask,
                                      sinks=sinks)
        except AssertionError as e:
            raise AssertionError(f"mask {name}: {e}") from e


@pytest.mark.parametrize("backend", ["math", "reference", "auto"])
@pytest.mark.parametrize("sizes", AWKWARD[:3], ids=lambda s: "x".join(map(str, s)))
def test_every_backend_that_computes_softcap_matches_the_reference(backend, sizes):
    B, H, Hkv, Lq, Lk, D, Dv = sizes
    q, k, v = qkv(*sizes, contiguous=False)
    for name, mask in mask_cases(B, H, Lq, Lk).items():
        for kw in ({"softcap": SOFTCAP}, {"softcap": SOFTCAP, "sinks": _sinks(H)}):
            try:
                assert_close_to_reference(lambda *a, **k_: attention(*a, backend=backend, **k_), q, k, v, mask, **kw)
            except AssertionError as e:
                raise AssertionError(f"mask {name}, {list(kw)}: {e}") from e


def test_the_sinks_gradient_matches_the_reference():
    q, k, v = qkv(2, 4, 2, 5, 7, 8, 8, requires_grad=False)
    for backend in ("sdpa", "math"):
        s = _sinks(4).requires_grad_()
        s64 = _sinks(4, torch.float64).requires_grad_()
        out = attention(q, k, v, multihead.masks.Causal("bottom-right"), sinks=s, backend=backend)
        ref = reference_attention(q.double(), k.double(), v.double(), multihead.masks.Causal("bottom-right"), sinks=s64)
        dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        (g,) = torch.autograd.grad(out, s, dout.float())
        (gr,) = torch.autograd.grad(ref, s64, dout)
        assert (g.double() - gr).abs().max() < 1e-5, backend


def test_a_backend_that_does_not_list_a_modifier_never_runs_it():
    q, k, v = qkv(1, 2, 2, 3, 3, 4, 4)
    e = multihead.explain(q, k, v, softcap=SOFTCAP)
    assert e.chosen == "math" and "score modifiers: softcap" in str(e)
    assert e.reasons["sdpa"] == "cannot run: does not compute the score modifier softcap"
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run this call: does not compute the score modifier "
                                         "softcap"):
        attention(q, k, v, softcap=SOFTCAP, backend="sdpa")
    assert multihead.explain(q, k, v, sinks=_sinks(2)).chosen == "sdpa"
    seen = []

    def plain_only(query, key, value, mask, *, scale, dropout_p):  # a user's backend that lists no modifier
        seen.append(1)
        return reference_attention(query, key, value, mask, scale=scale)

    backends.register("plain-only", plain_only, priority=1000)
    try:
        out = attention(q, k, v, sinks=_sinks(2))
        assert not seen and torch.allclose(out, reference_attention(q, k, v, sinks=_sinks(2)), atol=1e-6)
        attention(q, k, v)
        assert seen  # without modifiers it is chosen
    finally:
        backends.unregister("plain-only")


def test_bad_modifiers_are_refused_before_any_computation():
    q, k, v = qkv(1, 2, 2, 3, 3, 4, 4)
    with pytest.raises(ValueError, match=r"softcap must be a positive finite number or None .*got -1.0"):
        attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must be a floating tensor of shape \(H,\) = \(2,\), one logit per query "
                                         r"head; got shape \(3,\)"):
        attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match=r"sinks must be a torch.Tensor of shape \(H,\) = \(2,\)"):
        attention_weights(q, k, sinks=[0.0, 1.0])
    with pytest.raises(ValueError, match="unknown score modifiers"):
        backends.register("x", lambda *a, **k: None, modifiers=("alibi",))


def test_the_reported_draw_is_inside_the_rule():
    """The case that failed CI (issue "green on a fresh machine"): sinks on sdpa, output error 2.392e-7
    against plain float32's 7.66e-8, under the old bound of 2 x plain + one rounding (2.384e-7). The draw
    came from another CPU and cannot be replayed here, so its figures are the explicit case: the rule
    (conftest: K_OUT x plain + ROUNDINGS roundings at the reference's magnitude) admits it at any output
    magnitude of order one."""
    from conftest import K_OUT, ROUNDINGS, rounding

    for mag in (0.1, 0.5, 1.0, 1.9):
        ref = torch.full((2,), mag)
        bound = K_OUT * 7.66e-8 + ROUNDINGS * rounding(ref, torch.float32)
        assert 2.392e-7 <= bound
