"""Every PyTorch mode: no_grad, inference_mode, autocast (bf16), deepcopy, pickle and the meta
device, for the module, the functional API, the course's modules and our BERT, under every mask
kind. Each mode's result is compared with the same call in plain eager mode (the float64
reference is compared with eager mode in test_functional / test_modules)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import multihead
from multihead import MultiHeadAttention, masks
from multihead.compat import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention

B, Lq, Lk, E, H = 3, 7, 9, 24, 4


def _mask(kind: str):
    """A fresh mask of each kind for (B, Lq, Lk): made inside the mode under test, as a user would."""
    lens = torch.tensor([9, 4, 0])
    return {
        "none": None,
        "valid_lens": lens,  # the course's (B,) tensor
        "valid_lens_2d": torch.tensor([[1, 2, 3, 4, 5, 6, 7]] * B),  # (B, Lq)
        "ValidLens": masks.ValidLens(lens),
        "KeyPadding": masks.KeyPadding(torch.arange(Lk) < lens[:, None]),
        "Causal": masks.Causal("bottom-right"),
        "SlidingWindow": masks.SlidingWindow(2),
        "Dense": masks.Dense(torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(1)) > 0.3),
    }[kind]


KINDS = ["none", "valid_lens", "valid_lens_2d", "ValidLens", "KeyPadding", "Causal", "SlidingWindow", "Dense"]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, Lq, E, generator=g), torch.randn(B, Lk, E, generator=g)


def _call_module(m, kind):
    x, mem = _inputs()
    mask = _mask(kind)
    if kind in ("valid_lens", "valid_lens_2d"):
        return m(x, mem, mem, mask)
    return m(x, mem, mem, mask=mask)


def _module():
    torch.manual_seed(0)
    return MultiHeadAttention(E, H, bias=True).eval()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_module_and_functional_in_no_grad_and_inference_mode(mode, kind):
    """The inference-mode defect: lengths made inside ``torch.inference_mode()`` have no version
    counter; every call with them used to raise. Same results as eager, call after call."""
    m = _module()
    want = _call_module(m, kind).detach()
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        for _ in range(2):  # twice: anything remembered from the first call must still be right
            got = _call_module(m, kind)
            assert torch.allclose(got, want, atol=1e-6), kind
        q, k, v = (torch.randn(B, H, L, 6, generator=torch.Generator().manual_seed(i)) for i, L in
                   enumerate((Lq, Lk, Lk)))
        mask = _mask(kind)
        mask = masks.ValidLens(mask) if kind.startswith("valid_lens") else mask
        out = multihead.attention(q, k, v, mask)
        ref = multihead.reference_attention(q, k, v, mask)
        assert torch.allclose(out, ref, atol=1e-5)
        w = multihead.attention_weights(q, k, mask)
        assert torch.allclose(w @ v, ref, atol=1e-5)


def test_lengths_changed_in_place_inside_inference_mode_are_seen():
    """An inference tensor is never remembered: changing it in place changes the next call."""
    m = _module()
    x, mem = _inputs()
    with torch.inference_mode():
        lens = torch.tensor([9, 4, 2])
        a = m(x, mem, mem, lens)
        lens[1] = 1
        b = m(x, mem, mem, lens)
        ref = m(x, mem, mem, torch.tensor([9, 1, 2]))
    assert not torch.allclose(a, b) and torch.allclose(b, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_course_modules_in_inference_mode(kind):
    torch.manual_seed(0)
    d2l = D2LMultiHeadAttention(E, H, 0.1).eval()
    keras = KerasTutorialMultiHeadAttention(H, 16, 16, E)
    x, mem = _inputs()
    lens = torch.tensor([3, 2, 9])
    want = d2l(x, mem, mem, lens).detach()
    blocked = (torch.arange(Lk) >= lens[:, None]).float()[:, None, None, :]  # (B, 1, 1, Lk), 1 = blocked
    want_k = keras(x, mem, mem, blocked).detach()
    with torch.inference_mode():
        assert torch.allclose(d2l(x, mem, mem, torch.tensor([3, 2, 9])), want, atol=1e-6)
        assert d2l.attention.attention_weights.shape == (B * H, Lq, Lk)
        assert torch.allclose(keras(x, mem, mem, blocked.clone()), want_k, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bf16(kind):
    m = _module()
    want = _call_module(m, kind).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got = _call_module(m, kind)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.05 * want.abs().max() + 1e-2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_after_calls_of_every_kind(how, kind):
    """A module pickles, deep-copies and saves at every moment: after calls with every mask kind
    (the course's valid_lens tensor included) it holds nothing but parameters and buffers."""
    m = _module()
    want = _call_module(m, kind).detach()
    _call_module(m, kind)
    if how == "deepcopy":
        back = copy.deepcopy(m)
    elif how == "pickle":
        back = pickle.loads(pickle.dumps(m))
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
    assert set(back.__dict__) == set(m.__dict__)
    assert torch.allclose(_call_module(back, kind), want, atol=1e-6)
    # the copy's state dict loads into a fresh module and gives the same outputs
    fresh = MultiHeadAttention(E, H, bias=True).eval()
    fresh.load_state_dict(back.state_dict())
    assert torch.allclose(_call_module(fresh, kind), want, atol=1e-6)


@pytest.mark.parametrize("kind", ["none", "Causal", "SlidingWindow", "KeyPadding", "Dense"])
def test_meta_device(kind):
    """On the meta device shapes flow through without data (masks whose checks read values are
    built on the meta device too)."""
    with torch.device("meta"):
        m = MultiHeadAttention(E, H, bias=True)
        x, mem = torch.empty(B, Lq, E), torch.empty(B, Lk, E)
        mask = _mask(kind)
        if isinstance(mask, masks.KeyPadding):
            mask = masks.KeyPadding(torch.empty(B, Lk, dtype=torch.bool))
        elif isinstance(mask, masks.Dense):
            mask = masks.Dense(torch.empty(B, 1, Lq, Lk, dtype=torch.bool))
        out = m(x, mem, mem, mask=mask)
    assert out.device.type == "meta" and out.shape == (B, Lq, E)


def test_our_bert_in_inference_mode_and_pickled():
    from multihead.models.bert import Bert, BertConfig

    torch.manual_seed(0)
    bert = Bert(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=32)).eval()
    ids = torch.randint(1, 50, (3, 8))
    am = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6])
    want = bert(ids, am).detach()
    with torch.inference_mode():
        got = bert(ids.clone(), am.clone())
    real = am.bool()
    assert torch.allclose(got[real], want[real], atol=1e-6)
    back = pickle.loads(pickle.dumps(bert))
    assert torch.allclose(back(ids, am)[real], want[real], atol=1e-6)


def test_backward_hooks_on_the_projections_fire_through_the_module():
    """A full backward hook on a projection, or a global one, sees the projections (the fast path
    that skips nn.Module.__call__ is taken only when no hook of any kind could observe them)."""
    torch.manual_seed(0)
    m = multihead.MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16, requires_grad=True)
    seen = []
    h = m.projections()[0].register_full_backward_hook(lambda mod, gi, go: seen.append("W_q"))
    m(x, x, x).sum().backward()
    h.remove()
    assert seen == ["W_q"]
    seen.clear()
    g = torch.nn.modules.module.register_module_full_backward_hook(lambda mod, gi, go: seen.append(type(mod).__name__))
    try:
        m(x, x, x).sum().backward()
    finally:
        g.remove()
    assert seen.count("Linear") == 4 and "MultiHeadAttention" in seen


