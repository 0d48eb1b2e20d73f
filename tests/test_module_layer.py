"""The module layer (issue "one way through"): one hook list, varlen as pure functions,
checks in one place, capability vs preference in backends; and the six defects found
in the old layer, each with its test."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multihead
from conftest import assert_close_to_reference, qkv
from multihead import MultiHeadAttention, heads, masks, reference_attention
from multihead.core import varlen
from multihead.models import checkpoint


@pytest.fixture
def force_varlen(monkeypatch):
    monkeypatch.setattr(varlen, "LOOP_COST_FLOP", 0.0)


# --- the six defects ---


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_quantized_projections_are_the_ones_that_run():
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, bias=True, query_size=32, key_size=32, value_size=32).eval()
    x = torch.randn(2, 5, 32)
    before = m(x)  # has run once (the old layer cached its projections here)
    torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, inplace=True)
    after = m(x)
    assert not torch.equal(after, before)  # the int8 layers ran
    assert (after - before).abs().max() < 0.05  # and they compute roughly the same thing
    lens = torch.tensor([5, 2])
    assert m(x, mask=masks.Padding(lens)).shape == (2, 5, 32)  # the cost model reads quantized layers' sizes too


class _Holder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.attn = MultiHeadAttention(cfg.E, cfg.H, query_size=cfg.E, key_size=cfg.E, value_size=cfg.E)

    def forward(self, x):
        return self.attn(x)


def test_pruned_bias_free_module_saves_and_loads(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Cfg:
        E: int = 24
        H: int = 6

    torch.manual_seed(0)
    model = _Holder(Cfg()).eval()
    heads.prune(model, {"attn": [1, 4]})  # no mean replacement: o_proj stays bias-free
    assert model.attn.o_proj.bias is None
    checkpoint.save(model, tmp_path / "m")
    back = checkpoint.load(_Holder, Cfg, tmp_path / "m")
    assert back.attn.num_heads == 4 and back.attn.o_proj.bias is None
    x = torch.randn(2, 5, 24)
    assert torch.equal(back(x), model(x))
    # with mean replacement the folded means give o_proj a bias, and that loads too
    model2 = _Holder(Cfg()).eval()
    means = heads.mean_head_outputs(model2, [torch.randn(2, 5, 24)], lambda m, b: m(b))
    heads.prune(model2, {"attn": [0]}, mean_outputs=means)
    checkpoint.save(model2, tmp_path / "m2")
    back2 = checkpoint.load(_Holder, Cfg, tmp_path / "m2")
    assert back2.attn.o_proj.bias is not None and torch.equal(back2(x), model2(x))


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), True, 0.0, -1.0, "0.5"])
def test_module_scale_is_checked_as_the_functional_api_checks_it(bad):
    q, k, v = qkv(1, 2, 2, 3, 3, 4, 4)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number or None") as functional_error:
        multihead.attention(q, k, v, scale=bad)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number or None") as module_error:
        MultiHeadAttention(8, 2, scale=bad)
    assert str(functional_error.value) == str(module_error.value)  # one rule, one message


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.1", float("nan")])
def test_dropout_has_one_rule_everywhere(bad):
    from multihead.compat import TorchMultiheadAttention

    q, k, v = qkv(1, 2, 2, 3, 3, 4, 4)
    msgs = []
    for make in (lambda: multihead.attention(q, k, v, dropout_p=bad), lambda: MultiHeadAttention(8, 2, dropout=bad),
                 lambda: TorchMultiheadAttention(8, 2, dropout=bad)):
        with pytest.raises(ValueError, match=r"must be a number in \[0, 1\)") as e:
            make()
        msgs.append(str(e.value).split(" must")[1])
    assert len(set(msgs)) == 1


def test_a_forced_backend_runs_whenever_it_can_compute():
    q, k, v = qkv(2, 4, 2, 9, 9, 8, 8)  # far below blocked's "worth it" size
    mask = masks.SlidingWindow(2)
    text = str(multihead.explain(q, k, v, mask))
    assert "runs: sdpa" in text and "blocked    runs only when named: Lq*Lk=81 < 1048576: too small to gain" in text
    assert_close_to_reference(lambda *a, **kw: multihead.attention(*a, backend="blocked", **kw), q, k, v, mask)
    with pytest.raises(ValueError, match="backend 'blocked' cannot run this call: only Causal / SlidingWindow"):
        multihead.attention(q, k, v, masks.ValidLens(torch.tensor([3, 9])), backend="blocked")


def test_capture_does_not_change_the_path_or_the_output(force_varlen):
    torch.manual_seed(0)
    m = MultiHeadAttention(24, 6, bias=True, num_kv_heads=2, query_size=24, key_size=24, value_size=24).eval()
    x = torch.randn(3, 7, 24)
    for mask in (masks.Padding(torch.tensor([7, 4, 1])), masks.ValidLens(torch.tensor([7, 2, 5]))):
        assert str(m.explain(x, mask=mask)).startswith("path: packed")
        outside = m(x, mask=mask)
        with multihead.capture(m) as cap:
            inside = m(x, mask=mask)
        assert torch.equal(inside, outside)  # the same path ran
        # the recorded weights equal the dense path's, from the same projections
        q = m.q_proj(x).view(3, 7, 6, 4).transpose(1, 2)  # (B, H, L, D)
        k = m.k_proj(x).view(3, 7, 2, 4).transpose(1, 2)  # (B, Hkv, L, D)
        dense = multihead.attention_weights(q, k, mask)  # (B, H, L, L)
        assert cap["MultiHeadAttention"].shape == (3, 6, 7, 7)
        assert torch.allclose(cap["MultiHeadAttention"], dense, atol=1e-6)


# --- one hook list ---


def test_hooks_are_per_module_and_removed():
    a, b = MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)
    seen = []
    h = a.attention_hooks.add_observer(lambda mod, q, k, mask, scale: seen.append((mod, q.shape, k.shape)))
    x = torch.randn(2, 3, 16)
    a(x)
    b(x)
    assert len(seen) == 1 and seen[0][0] is a and seen[0][1] == (2, 4, 3, 4)
    h.remove()
    a(x)
    assert len(seen) == 1 and not a.attention_hooks


def test_gates_and_means_work_the_same_on_the_packed_path(force_varlen):
    torch.manual_seed(1)
    m = MultiHeadAttention(24, 6, bias=True, query_size=24, key_size=24, value_size=24).eval()
    x = torch.randn(3, 7, 24)
    mask = masks.Padding(torch.tensor([7, 4, 2]))
    g = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 1.0])
    fill = torch.randn(6, 4)
    outs, means = {}, {}
    for path, cost in (("packed", 0.0), ("dense", float("inf"))):
        varlen.LOOP_COST_FLOP = cost
        assert str(m.explain(x, mask=mask)).startswith(f"path: {path}")
        with heads.gated(m, {"": g}, fill={"": fill}):
            outs[path] = m(x, mask=mask)
        means[path] = heads.mean_head_outputs(m, [x], lambda mod, b: mod(b, mask=mask))[""]
    assert torch.allclose(outs["packed"], outs["dense"], atol=1e-5)
    assert torch.allclose(means["packed"], means["dense"], atol=1e-5)
    # the mean is over the 13 real rows only: compare with a hand computation
    q = m.q_proj(x).view(3, 7, 6, 4).transpose(1, 2)
    k = m.k_proj(x).view(3, 7, 6, 4).transpose(1, 2)
    v = m.v_proj(x).view(3, 7, 6, 4).transpose(1, 2)
    o = reference_attention(q, k, v, mask).transpose(1, 2)  # (B, L, H, Dv)
    real = torch.arange(7) < torch.tensor([7, 4, 2])[:, None]
    assert torch.allclose(means["packed"], o[real].mean(0), atol=1e-5)


# --- varlen as pure functions ---


def test_unpad_pad_round_trip_and_cu_seqlens():
    x = torch.randn(3, 5, 2)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    packed, idx, cu, maxlen = varlen.unpad(x, keep)
    assert packed.shape == (8, 2) and cu.tolist() == [0, 3, 8, 8] and maxlen == 5
    assert torch.equal(packed[3:8], x[1])
    back = varlen.pad(packed, idx, 3, 5)
    assert torch.equal(back[keep], x[keep]) and (back[~keep] == 0).all()


@pytest.mark.parametrize("lens", [[5, 3, 1], [200, 130, 7]])  # short: one padded call; long: per sequence
def test_attention_varlen_equals_padded_attention(lens):
    torch.manual_seed(0)
    B, L, H, Hkv, D, Dv = len(lens), max(lens), 6, 2, 8, 5
    q, k, v = qkv(B, H, Hkv, L, L, D, Dv, dtype=torch.float64)
    keep = torch.arange(L) < torch.tensor(lens)[:, None]  # (B, L)
    pq, _, cu, _ = varlen.unpad(q.transpose(1, 2), keep)  # (N, H, D)
    pk, _, _, _ = varlen.unpad(k.transpose(1, 2), keep)
    pv, idx, _, _ = varlen.unpad(v.transpose(1, 2), keep)
    for mask in (None, masks.Causal(), masks.SlidingWindow(2)):
        out = multihead.attention_varlen(pq, pk, pv, cu, cu, mask)  # (N, H, Dv)
        full = masks.Padding(torch.tensor(lens)) & mask if mask is not None else masks.Padding(torch.tensor(lens))
        ref = reference_attention(q, k, v, full).transpose(1, 2)  # (B, L, H, Dv)
        assert torch.allclose(varlen.pad(out, idx, B, L), ref, atol=1e-10)


def test_attention_varlen_errors():
    q = torch.randn(5, 2, 4)
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match=r"query must be a packed \(N, heads, size\) tensor; got \(1, 5, 2, 4\)"):
        multihead.attention_varlen(q[None], q, q, cu, cu)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must rise from 0 to the number of packed tokens \(5\)"):
        multihead.attention_varlen(q, q, q, cu, torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="only positional, top-left aligned masks"):
        multihead.attention_varlen(q, q, q, cu, cu, masks.Causal("bottom-right"))


def test_reference_validates_its_inputs():
    q, k, v = qkv(2, 3, 3, 4, 0, 5, 6)  # Lk = 0: zeros, as attention() gives
    assert torch.equal(reference_attention(q, k, v), torch.zeros(2, 3, 4, 6))
    assert torch.equal(multihead.attention(q, k, v), torch.zeros(2, 3, 4, 6))
    q, k, v = qkv(1, 3, 2, 4, 4, 5, 5)
    with pytest.raises(ValueError, match=r"the query's heads H=3 must be a multiple of the key/value heads Hkv=2"):
        reference_attention(q, k, v)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number"):
        reference_attention(*qkv(1, 2, 2, 3, 3, 4, 4), scale=float("inf"))


def test_four_python_frames_from_forward_to_sdpa_on_a_plain_call():
    """The course's call (valid lengths, inference mode): at most 4 Python frames between the module's forward
    and the frame that calls F.scaled_dot_product_attention (issue 34: the plan is executed, not re-decided)."""
    import sys

    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    m = MultiHeadAttention(32, 4, dropout=0.0).eval()
    chains = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                f, names = sys._getframe(1), []  # the frame that called SDPA, then up to forward
                while f is not None and f.f_code is not type(m).forward.__code__:
                    names.append(f.f_code.co_name)
                    f = f.f_back
                chains.append(names if f is not None else None)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 5, 32)
    with torch.inference_mode(), Spy():
        m(x, x, x, torch.tensor([3, 5]))
    assert len(chains) == 1 and chains[0] is not None and len(chains[0]) <= 4, chains
