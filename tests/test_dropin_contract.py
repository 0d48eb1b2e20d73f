"""The torch.nn drop-in keeps torch.nn.MultiheadAttention's contract, case by case as
PyTorch's own MultiheadAttention and Transformer tests exercise it (our tests, written
for the same cases): appended key/value positions, torch.nn's input checks and
messages, per-sample 3-D masks, the is_causal hint, bias=False, separate projection
weights, a bias of another dtype, TorchScript."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch
from torch import nn

from multihead.compat import TorchMultiheadAttention
from multihead.interop import patch

ATOL = 1e-5


def _pair(E, H, **kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, **kw)
    ours = TorchMultiheadAttention.from_module(ref)
    return ref, ours


@pytest.mark.parametrize("bias_kv, zero_attn", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("kv_dim", [None, 7])
@pytest.mark.parametrize("batch_first", [False, True])
def test_appended_key_value_positions_match_torch(bias_kv, zero_attn, kv_dim, batch_first):
    E, H, B, Lq, Lk = 12, 4, 3, 5, 6
    ref, ours = _pair(E, H, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kv_dim, vdim=kv_dim,
                      batch_first=batch_first)
    ref.eval(), ours.eval()
    kd = kv_dim or E
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Lq, E, generator=g)
    k = torch.randn(B, Lk, kd, generator=g)
    v = torch.randn(B, Lk, kd, generator=g)
    if not batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    kpm = torch.rand(B, Lk, generator=g) > 0.6
    attn_bool = torch.rand(Lq, Lk, generator=g) > 0.7  # True = not allowed (torch.nn)
    attn_float = torch.zeros(B * H, Lq, Lk).masked_fill(torch.rand(B * H, Lq, Lk, generator=g) > 0.7, float("-inf"))
    for kw in ({}, {"key_padding_mask": kpm}, {"attn_mask": attn_bool}, {"attn_mask": attn_float},
               {"attn_mask": attn_bool, "key_padding_mask": kpm}):
        for avg in (True, False):
            a, wa = ref(q, k, v, average_attn_weights=avg, **kw)
            b, wb = ours(q, k, v, average_attn_weights=avg, **kw)
            assert torch.isfinite(a).all()  # the appended positions leave no row empty
            assert torch.allclose(a, b, atol=ATOL), kw
            assert wa.shape == wb.shape and torch.allclose(wa, wb, atol=ATOL), kw
    # training, gradients through bias_k / bias_v too
    ref.train(), ours.train()
    ref.dropout = ours.dropout = 0.0
    a, _ = ref(q, k, v, key_padding_mask=kpm)
    b, _ = ours(q, k, v, key_padding_mask=kpm)
    a.sum().backward()
    b.sum().backward()
    for (n, p), (_, r) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, r.grad, atol=1e-4), n


CASES_3D = [
    ("key", (4, 4), (4, 4, 4), "For batched (3-D) `query`, expected `key` and `value` to be 3-D but found 2-D and "
                               "3-D tensors respectively"),
    ("value", (4, 4, 4), (4, 4), "For batched (3-D) `query`, expected `key` and `value` to be 3-D but found 3-D and "
                                 "2-D tensors respectively"),
]


def _bad_calls():
    q3, q2 = torch.randn(4, 4, 4), torch.randn(4, 4)
    yield (q3, torch.randn(4, 4), q3), {}, "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors respectively"
    yield (q3, q3, torch.randn(4, 4)), {}, "expected `key` and `value` to be 3-D but found 3-D and 2-D tensors respectively"
    yield (q3, q3, q3), {"key_padding_mask": torch.tensor([False, False, True, True])}, \
        "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead"
    yield (q3, q3, q3), {"attn_mask": torch.tensor([False, False, True, True])}, \
        "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"
    yield (q2, torch.randn(4, 4, 4), q2), {}, "expected `key` and `value` to be 2-D but found 3-D and 2-D tensors"
    yield (q2, q2, torch.randn(4, 4, 4)), {}, "expected `key` and `value` to be 2-D but found 2-D and 3-D tensors"
    yield (q2, q2, q2), {"key_padding_mask": torch.tensor([[False, False, True, True] * 2])}, \
        "expected `key_padding_mask` to be `None` or 1-D but found 2-D tensor instead"
    yield (q2, q2, q2), {"attn_mask": torch.tensor([False, False, True, True])}, \
        "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"
    yield (q2, q2, q2), {"attn_mask": torch.ones(5, 4, 4, dtype=torch.bool)}, \
        r"Expected `attn_mask` shape to be \(4, 4, 4\)"
    yield (torch.randn(4),) * 3, {}, "query should be unbatched 2D or batched 3D tensor but received 1-D query tensor"
    yield (torch.randn(4, 4, 5),) * 3, {}, "was expecting embedding dimension of 4, but got 5"


@pytest.mark.parametrize("case", range(11))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_invalid_shapes_raise_torchs_errors_before_any_computation(case, mode):
    args, kw, msg = list(_bad_calls())[case]
    for mha in (nn.MultiheadAttention(4, 4), TorchMultiheadAttention(4, 4)):
        mha.train(mode == "train")
        with torch.no_grad(), pytest.raises(AssertionError, match=msg):
            mha(*args, **kw)
    with pytest.raises(ValueError, match=msg):  # ours is a ValueError too
        TorchMultiheadAttention(4, 4)(*args, **kw)


def test_per_sample_3d_attn_mask_equals_2d_calls():
    E, H, B, Lq, Lk = 8, 4, 5, 2, 3
    mha = TorchMultiheadAttention(E, H).eval()
    g = torch.Generator().manual_seed(2)
    q, k = torch.rand(B, Lq, E, generator=g), torch.rand(B, Lk, E, generator=g)
    am = torch.zeros(B, Lq, Lk).masked_fill(torch.rand(B, Lq, Lk, generator=g) > 0.5, float("-inf"))
    am[:, :, 0] = 0.0  # every row keeps a key (torch.nn would give NaN otherwise)
    out3 = mha(q.transpose(0, 1), k.transpose(0, 1), k.transpose(0, 1), attn_mask=am.repeat_interleave(H, 0))[0]
    for i in range(B):
        out2 = mha(q[i:i + 1].transpose(0, 1), k[i:i + 1].transpose(0, 1), k[i:i + 1].transpose(0, 1),
                   attn_mask=am[i])[0]
        assert torch.allclose(out3[:, i:i + 1], out2, atol=1e-6)


def test_bias_false_and_separate_projection_weights():
    mha = TorchMultiheadAttention(8, 4, bias=False)
    assert mha.in_proj_bias is None and mha.out_proj.bias is None
    x = torch.rand(1, 5, 8)
    assert mha(x, x, x)[0].shape == (1, 5, 8)
    sep = TorchMultiheadAttention(4, 4, kdim=2, vdim=2, dtype=torch.double)
    assert sep.in_proj_weight is None
    out, w = sep(torch.rand(4, 4, 4, dtype=torch.double), torch.rand(4, 4, 2, dtype=torch.double),
                 torch.rand(4, 4, 2, dtype=torch.double))
    assert out.shape == (4, 4, 4) and out.dtype == torch.double and w.shape == (4, 4, 4)


def test_a_bias_of_another_dtype_is_promoted():
    mha = TorchMultiheadAttention(4, 4, batch_first=True, dtype=torch.double).eval()
    ref = mha.to_torch().eval()
    mha.in_proj_bias = nn.Parameter(mha.in_proj_bias.to(torch.half))
    ref.in_proj_bias = nn.Parameter(ref.in_proj_bias.to(torch.half))
    q = torch.randn(4, 4, 4, dtype=torch.double)
    with torch.no_grad():
        out = mha(q, q, q)[0]
        assert out.dtype == torch.double and torch.allclose(out, ref(q, q, q)[0], atol=1e-6)


def test_is_causal_is_torchs_hint():
    E, H = 4, 1
    mha = TorchMultiheadAttention(E, H)
    x = torch.randn(1, 2, E)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        mha(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="Need attn_mask if specifying the is_causal hint"):
        mha(x, x, x, is_causal=True)
    # with all-ones weights the causal result is known exactly: every output is 16
    ones = TorchMultiheadAttention(E, H)
    ones.in_proj_weight = nn.Parameter(torch.ones(3 * E, E))
    ones.out_proj.weight = nn.Parameter(torch.ones(E, E))
    qkv = torch.ones(1, 2, E)
    mask = nn.Transformer.generate_square_subsequent_mask(2)
    out, _ = ones(qkv, qkv, qkv, attn_mask=mask, need_weights=False, is_causal=True)
    assert torch.equal(out, torch.full((1, 2, E), 16.0))
    # an encoder trained with the hint, patched
    layer = nn.TransformerEncoderLayer(2, 1, 4, dropout=0.0, batch_first=True, activation="gelu")
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    patch(enc)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1, momentum=0.9)
    inputs = torch.randn(1, 2, 2)
    outputs = enc(inputs, mask=nn.Transformer.generate_square_subsequent_mask(2), is_causal=True)
    loss = nn.functional.mse_loss(outputs, inputs)
    loss.backward()
    opt.step()
    assert all(p.grad is not None for p in enc.parameters())
    # the hint gives what the explicit causal mask gives
    ref = TorchMultiheadAttention(6, 2).eval()
    y = torch.randn(5, 3, 6)
    m = nn.Transformer.generate_square_subsequent_mask(5)
    assert torch.allclose(ref(y, y, y, attn_mask=m, is_causal=True)[0], ref(y, y, y, attn_mask=m)[0], atol=1e-6)


@pytest.mark.parametrize("kv", [None, 256])
def test_torchscript_scripts_the_same_weights(kv):
    mha = TorchMultiheadAttention(128, 8, kdim=kv, vdim=kv).eval()
    scripted = torch.jit.script(mha)
    q, k = torch.randn(5, 2, 128), torch.randn(7, 2, kv or 128)
    assert torch.allclose(scripted(q, k, k)[0], mha(q, k, k)[0], atol=1e-5)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    patch(enc)
    x = torch.randn(2, 5, 16)
    before = enc(x)
    assert torch.allclose(torch.jit.script(enc)(x), before, atol=1e-5)
    # torch's scripting swaps the plain module into the model in place (documented)
    assert type(enc.layers[0].self_attn) is nn.MultiheadAttention


def test_torchscript_where_torch_nn_itself_is_patched_to_the_drop_in(monkeypatch):
    """With ``torch.nn.MultiheadAttention`` replaced by the drop-in everywhere (as
    tools/torch_tests_on_dropin.py runs PyTorch's tests), scripting still gets torch's own class: a
    TransformerEncoder of a TransformerEncoderLayer subclass, and a module with kdim/vdim (no in_proj_weight)."""
    import torch.nn.modules.transformer as transformer

    monkeypatch.setattr(nn, "MultiheadAttention", TorchMultiheadAttention)
    monkeypatch.setattr(transformer, "MultiheadAttention", TorchMultiheadAttention)

    class MyLayer(nn.TransformerEncoderLayer):
        pass

    torch.manual_seed(0)
    enc = nn.TransformerEncoder(MyLayer(8, 4, 32, batch_first=True), num_layers=2).eval()
    assert type(enc.layers[0].self_attn) is TorchMultiheadAttention
    x = torch.rand(2, 4, 8)
    with torch.no_grad():
        before = enc(x, mask=torch.zeros(4, 4, dtype=torch.bool))
        scripted = torch.jit.script(enc)
        assert torch.allclose(scripted(x, mask=torch.zeros(4, 4, dtype=torch.bool)), before, atol=1e-6)
    mha = nn.MultiheadAttention(16, 4, kdim=12, vdim=12).eval()
    assert type(mha) is TorchMultiheadAttention and mha.in_proj_weight is None
    q, k = torch.randn(3, 2, 16), torch.randn(5, 2, 12)
    with torch.no_grad():
        assert torch.allclose(torch.jit.script(mha)(q, k, k)[0], mha(q, k, k)[0], atol=1e-6)


def test_every_combination_constructs_like_torch():
    for bias, bkv, zattn, bf in itertools.product([True, False], repeat=4):
        ref = nn.MultiheadAttention(8, 2, bias=bias, add_bias_kv=bkv, add_zero_attn=zattn, batch_first=bf)
        ours = TorchMultiheadAttention.from_module(ref)
        assert list(ours.state_dict()) == list(ref.state_dict())
        assert ours.to_torch().state_dict().keys() == ref.state_dict().keys()


@pytest.mark.parametrize("kv", [None, 6])
@pytest.mark.parametrize("bias_kv", [False, True])
def test_torchs_attributes_are_truthful(kv, bias_kv):
    """F.multi_head_attention_forward with the module's own attributes (as PyTorch's tests call it)
    computes what the module computes: ``_qkv_same_embed_dim`` says which weights hold the projections."""
    torch.manual_seed(0)
    m = TorchMultiheadAttention(8, 2, kdim=kv, vdim=kv, add_bias_kv=bias_kv).eval()
    assert m._qkv_same_embed_dim == (kv is None) == (m.in_proj_weight is not None) == (m.q_proj_weight is None)
    q, k = torch.randn(5, 3, 8), torch.randn(4, 3, kv or 8)
    want, want_w = nn.functional.multi_head_attention_forward(
        q, k, k, m.embed_dim, m.num_heads, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v, m.add_zero_attn,
        m.dropout, m.out_proj.weight, m.out_proj.bias, training=False, use_separate_proj_weight=not m._qkv_same_embed_dim,
        q_proj_weight=m.q_proj_weight, k_proj_weight=m.k_proj_weight, v_proj_weight=m.v_proj_weight)
    got, got_w = m(q, k, k)
    assert torch.allclose(got, want, atol=ATOL) and torch.allclose(got_w, want_w, atol=ATOL)


def test_torchs_fused_encoder_layer_is_not_taken(monkeypatch):
    """In eval without grad torch's TransformerEncoderLayer would compute the whole layer natively
    (bypassing its attention module); with the drop-in it runs its modules, this one included."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
    ours = copy.deepcopy(layer)
    patch(ours)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = layer(x)

    def fused(*args, **kwargs):
        raise AssertionError("torch's fused encoder layer ran")

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", fused)
    with torch.no_grad():
        with pytest.raises(AssertionError, match="fused encoder layer ran"):
            layer(x)  # torch.nn's own module takes it (the mock would catch ours too)
        seen = []
        g = nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(mod))  # global: not
        try:  # one the layer looks for
            got = ours(x)
        finally:
            g.remove()
        assert ours.self_attn in seen and torch.allclose(got, want, atol=ATOL)
        for again in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):  # the hook survives copies
            assert torch.allclose(again(x), want, atol=ATOL)
        ours.self_attn._forward_pre_hooks.clear()  # without the drop-in's own no-op hook, torch would fuse it
        with pytest.raises(AssertionError, match="fused encoder layer ran"):
            ours(x)


def test_the_nested_tensor_reason_is_torchs():
    """TransformerEncoder's enable_nested_tensor decision reads the drop-in's attributes and gives
    torch.nn's reason (here: bias=False)."""
    import warnings

    for drop_in in (False, True):
        layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, bias=False)
        if drop_in:
            patch(layer)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            enc = nn.TransformerEncoder(layer, 2)
        assert not enc.use_nested_tensor
        assert [str(w.message) for w in seen] == ["enable_nested_tensor is True, but self.use_nested_tensor is False "
                                                  "because encoder_layer.self_attn was passed bias=False"]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_as_torchs_encoder_hands_them():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2).eval()
    ours = copy.deepcopy(enc)
    patch(ours)
    src = torch.randn(3, 7, 16)
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[1, 5:] = False
    keep[2, 1:] = False
    x = torch._nested_tensor_from_mask(src, keep, mask_check=False)  # 3 sequences of 7, 5, 1 tokens
    with torch.no_grad():
        want, got = enc(x), ours(x)
    assert got.is_nested and [t.shape for t in got.unbind()] == [t.shape for t in want.unbind()]
    assert all(torch.allclose(a, b, atol=ATOL) for a, b in zip(want.unbind(), got.unbind()))
    with torch.no_grad():
        assert torch.allclose(ours(src, src_key_padding_mask=~keep), enc(src, src_key_padding_mask=~keep), atol=ATOL)
    mha = ours.layers[0].self_attn
    with pytest.raises(ValueError, match="NestedTensor input as query, key and value all nested, .*key_padding_mask"):
        mha(x, x, x, need_weights=False, key_padding_mask=~keep)
    with pytest.raises(ValueError, match="all nested"):
        mha(x, src, src)
    with pytest.raises(AssertionError, match="unbatched 2D or batched 3D tensor but received 1-D query tensor"):
        empty = torch.nested.nested_tensor([])
        mha(empty, empty, empty)
    # the weights as torch.nn's fast path gives them for nested input: padded, zero outside each sequence
    plain = enc.layers[0].self_attn
    for average in (True, False):
        with torch.no_grad():
            (o1, w1), (o2, w2) = (m(x, x, x, average_attn_weights=average) for m in (plain, mha))
        assert w1.shape == w2.shape and torch.allclose(w1, w2, atol=ATOL)
        assert all(torch.allclose(a, b, atol=ATOL) for a, b in zip(o1.unbind(), o2.unbind()))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("extra", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}])
def test_nested_cross_attention_is_each_sequence_alone(layout, extra):
    """Nested query / key / value of their own lengths (cross-attention, as newer torch.nn takes them outside
    its fast path): each output sequence is the unbatched call on that sequence, gradients included."""
    torch.manual_seed(1)
    mha = TorchMultiheadAttention(10, 5, batch_first=True, kdim=6, vdim=6, **extra)
    qs = [torch.randn(n, 10, requires_grad=True) for n in (4, 6)]
    ks = [torch.randn(n, 6) for n in (7, 16)]
    nq, nk = (torch.nested.as_nested_tensor(t, layout=layout) for t in (qs, ks))
    out, weights = mha(nq, nk, nk)
    assert out.is_nested and out.layout == layout and weights.shape == (2, 4 + 2, 16 + len(extra))
    for b, (q, k) in enumerate(zip(qs, ks)):
        want, want_w = mha(q, k, k)  # unbatched (Lq_b, E), weights (Lq_b, Lk_b')
        assert torch.allclose(out.unbind()[b], want, atol=ATOL)
        lk = k.shape[0]
        got_w = torch.cat([weights[b, :q.shape[0], :lk], weights[b, :q.shape[0], 16:]], -1)  # own keys + appended
        assert torch.allclose(got_w, want_w, atol=ATOL) and not weights[b, q.shape[0]:].any()
    grad, = torch.autograd.grad(out.unbind()[1].sum(), qs[1])
    want_grad, = torch.autograd.grad(mha(qs[1], ks[1], ks[1])[0].sum(), qs[1])
    assert torch.allclose(grad, want_grad, atol=ATOL)


def test_the_tool_runs_torchs_tests_on_the_drop_in(tmp_path):
    """tools/torch_tests_on_dropin.py: every torch.nn.MultiheadAttention a test file builds (directly, or inside
    nn.TransformerEncoderLayer) is the drop-in, and pytest's exit code comes back (here on a small test file; the
    real one is PyTorch's test/nn/test_multihead_attention.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parent.parent / "tools" / "torch_tests_on_dropin.py"
    (tmp_path / "test_built.py").write_text(
        "import torch\n"
        "from torch.nn import MultiheadAttention\n"
        "from multihead.layer.dropin import TorchMultiheadAttention\n\n"
        "def test_built_is_the_drop_in():\n"
        "    assert MultiheadAttention is TorchMultiheadAttention\n"
        "    assert type(torch.nn.MultiheadAttention(4, 2)) is TorchMultiheadAttention\n"
        "    assert type(torch.nn.TransformerEncoderLayer(4, 2, 8).self_attn) is TorchMultiheadAttention\n\n"
        "def test_a_failure_is_reported():\n"
        "    assert False\n")
    run = subprocess.run([sys.executable, str(tool), str(tmp_path / "test_built.py")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 passed" in run.stdout and "test_a_failure_is_reported" in run.stdout
