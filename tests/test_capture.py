"""multihead.capture: per-head weights from any model, return values unchanged."""

from __future__ import annotations

import torch
from torch import nn

import multihead
from multihead import MultiHeadAttention, masks, reference_attention
from multihead.compat import D2LMultiHeadAttention
from multihead.core.functional import weights_of
from multihead.interop import patch


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList([MultiHeadAttention(16, 4), MultiHeadAttention(16, 2)])
        self.cross = MultiHeadAttention(16, 4, num_kv_heads=2)

    def forward(self, x, mem, lens):
        for layer in self.enc:
            x = x + layer(x, valid_lens=lens)
        return self.cross(x, mem, mask=masks.Causal("bottom-right"))


def test_capture_records_every_module_and_changes_nothing():
    torch.manual_seed(0)
    model = Tiny().eval()
    x, mem, lens = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.tensor([5, 3])
    outside = model(x, mem, lens)
    with multihead.capture(model) as captured:
        inside = model(x, mem, lens)
    assert torch.equal(inside, outside)
    assert list(captured) == ["enc.0", "enc.1", "cross"]
    assert captured["enc.0"].shape == (2, 4, 5, 5) and captured["cross"].shape == (2, 4, 5, 7)
    # rows sum to 1; sequence 1's keys >= 3 get exactly 0
    w = captured["enc.1"]
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 5))
    assert (w[1, :, :, 3:] == 0).all()
    # equal to the reference weights computed independently from the projections
    layer = model.enc[0]
    q = layer.q_proj(x).view(2, 5, 4, 4).transpose(1, 2).double()  # (B, H, L, D)
    k = layer.k_proj(x).view(2, 5, 4, 4).transpose(1, 2).double()
    ref = weights_of(q, k, masks.ValidLens(lens), 0.5)
    assert torch.allclose(captured["enc.0"].double(), ref, atol=1e-6)
    # weights @ values is the attention output (GQA module)
    c = model.cross
    xq = x + model.enc[0](x, valid_lens=lens)
    xq = xq + model.enc[1](xq, valid_lens=lens)
    qc = c.q_proj(xq).view(2, 5, 4, 4).transpose(1, 2)
    kc = c.k_proj(mem).view(2, 7, 2, 4).transpose(1, 2)
    vc = c.v_proj(mem).view(2, 7, 2, 4).transpose(1, 2)
    out = reference_attention(qc, kc, vc, masks.Causal("bottom-right"))
    assert torch.allclose(captured["cross"] @ vc.repeat_interleave(2, 1), out, atol=1e-5)


def test_capture_outside_records_nothing_and_options_work():
    model = Tiny().eval()
    x, mem, lens = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.tensor([5, 3])
    with multihead.capture(model, include=["enc.*"], max_elements=2 * 2 * 5 * 5, to_cpu=True) as c:
        model(x, mem, lens)
        model(x, mem, lens)
    assert list(c) == ["enc.1"] and "enc.0" in c.skipped  # enc.0 (4 heads) is over the cap
    assert len(c.calls("enc.1")) == 2
    model(x, mem, lens)
    assert len(c.calls("enc.1")) == 2  # nothing recorded after the block
    assert not multihead.capture.__module__ == ""  # the context manager is importable as multihead.capture
    with multihead.capture(model, include=lambda name, m: m.num_heads == 4) as c2:
        model(x, mem, lens)
    assert list(c2) == ["enc.0", "cross"]


def test_capture_keeps_graph_when_asked():
    model = Tiny()
    x, mem, lens = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.tensor([5, 3])
    with multihead.capture(model, detach=False) as c:
        model(x, mem, lens)
    c["enc.0"].sum().backward()  # the weights' graph reaches the projections
    assert model.enc[0].q_proj.weight.grad is not None


def test_capture_compat_and_patched_torch_modules():
    d2l = D2LMultiHeadAttention(8, 8, 8, 8, 2, 0.0).eval()
    x = torch.randn(2, 3, 8)
    with multihead.capture(d2l) as c:
        d2l(x, x, x, torch.tensor([3, 1]))
    assert torch.allclose(c["D2LMultiHeadAttention"].reshape(4, 3, 3), d2l.attention.attention_weights)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    patch(enc)
    with multihead.capture(enc) as c:
        enc(torch.randn(2, 4, 8))
    assert list(c) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert c["layers.0.self_attn"].shape == (2, 2, 4, 4)
    # without a model: anonymous names in call order
    with multihead.capture() as c:
        d2l(x, x, x, None)
    assert list(c) == ["D2LMultiHeadAttention#0"]
