"""int8 for prediction: quantize() and the quantization-aware recovery that prepares for it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead.quantize import fake_quantized, quantize


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fake_quantized_rounds_as_the_int8_model_does_and_leaves_float_weights():
    m = _model().eval()
    x = torch.randn(64, 16) * 3
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        flt, q = m(x), quantize(m)(x)
        with fake_quantized(m):
            fake = m(x)
    # the rounding inside the block is the int8 model's, up to the kernels' own arithmetic
    assert (fake - q).abs().max() < 0.1 * (flt - q).abs().max()
    assert all(torch.equal(weights[n], p) for n, p in m.named_parameters()) and len(weights) == 4  # untouched
    assert all(type(p) is nn.Parameter for p in m.parameters()) and not any(
        hasattr(layer, "parametrizations") for layer in m)  # nothing of the block left on the model


def test_training_inside_fake_quantized_updates_the_float_weights():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # made before the block: the same parameters are trained
    before = m[0].weight.detach().clone()
    x = torch.randn(8, 16)
    with fake_quantized(m):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
    assert m[0].weight.grad is not None and not torch.equal(m[0].weight.detach(), before)
    with pytest.raises(ValueError, match="unknown dtype 'int4'; supported: int8"):
        with fake_quantized(m, "int4"):
            pass


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_activations_get_all_8_bits_only_where_the_kernel_is_exact(monkeypatch):
    import multihead.quantize as q

    m = _model().eval()
    x = torch.randn(256, 16) * 3
    with torch.no_grad():
        want = m(x)
        if not q.full_range_exact():
            pytest.skip("this machine's int8 kernel saturates 8-bit activations: 7 bits are used (tested below)")
        full = quantize(m)
        assert all(type(layer).__name__ == "FullRangeLinear" for layer in full if not isinstance(layer, nn.GELU))
        monkeypatch.setitem(q._EXACT, torch.backends.quantized.engine, False)  # a machine that would saturate
        seven = quantize(m)
        assert not any(type(layer).__name__ == "FullRangeLinear" for layer in seven)
        assert (full(x) - want).abs().mean() < 0.75 * (seven(x) - want).abs().mean()  # the 8th bit halves the error


def test_every_int8_layer_quantize_makes_is_int8_in_a_fresh_process(monkeypatch):
    """On a machine whose kernel is exact (VNNI), quantize makes FullRangeLinear layers: each use made a new class,
    so a model quantized before the first is_int8_linear was not int8 to it, and serve refused it ('... is
    FullRangeLinear; serve computes nn.Linear layers and multihead.quantize's int8 ones'). Forced exact here, so
    the machine need not be one."""
    import subprocess
    import sys

    code = ("import torch, multihead.quantize as q\n"
            "q._EXACT[torch.backends.quantized.engine] = True\n"
            "a = q.quantize(torch.nn.Sequential(torch.nn.Linear(8, 8)))\n"
            "b = q.quantize(torch.nn.Sequential(torch.nn.Linear(8, 8)))\n"
            "print([q.is_int8_linear(m[0]) and type(m[0]).__name__ for m in (a, b)])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['FullRangeLinear', 'FullRangeLinear']", out


def test_the_exactness_probe_catches_a_saturating_kernel(monkeypatch):
    """A kernel that saturates 16-bit pairs (as CPUs without VNNI do) is detected by the probe."""
    import multihead.quantize as q

    real = q._kernel

    def saturating(x, packed, *, reduce_range):
        y = real(x, packed, reduce_range=reduce_range)
        return y if reduce_range else y.clamp(max=0.5 * float(y.max()))  # what a saturated sum looks like

    monkeypatch.setattr(q, "_kernel", saturating)
    monkeypatch.setattr(q, "_EXACT", {})
    assert q.full_range_exact() is False


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_layer_whose_heads_were_all_pruned_stays_float_and_the_rest_is_int8():
    """Every head of an attention module cut: its q/k/v weights are (0, E) and its output projection's (E, 0),
    which the int8 kernels cannot take (they raised); they compute only their bias, so they stay float."""
    import multihead
    from multihead import heads

    torch.manual_seed(0)
    m = nn.Sequential(multihead.MultiHeadAttention(16, 4, bias=True, query_size=16, key_size=16, value_size=16),
                      multihead.MultiHeadAttention(16, 4, bias=True, query_size=16, key_size=16, value_size=16)).eval()
    heads.prune(m, {"0": [0, 1, 2, 3], "1": [2]})
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        flt, q = m(x), quantize(m)(x)
        with fake_quantized(m):
            fake = m(x)
    qm = quantize(m)
    assert [type(p).__name__ for p in qm[0].projections()] == ["Linear"] * 4  # empty: float, untouched
    assert all(type(p) is not nn.Linear for p in qm[1].projections())  # the others: int8
    with torch.no_grad():  # the emptied module computes its output projection's bias exactly, int8 or not
        assert torch.equal(qm[0](x), m[0](x)) and torch.equal(m[0](x), m[0].o_proj.bias.expand(2, 5, 16))
    assert (q - flt).abs().max() > 0  # int8 where there is work
    assert (fake - q).abs().max() < 0.1 * (flt - q).abs().max()
