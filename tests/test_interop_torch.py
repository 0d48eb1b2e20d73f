"""torch.nn.MultiheadAttention <-> multihead, the drop-in, and patching whole models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention, masks
from multihead.compat import D2LMultiHeadAttention, TorchMultiheadAttention
from multihead.interop import from_d2l, from_torch, patch, to_torch

ATOL = 1e-5


def torch_masks(B, H, Lq, Lk):
    g = torch.Generator().manual_seed(5)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, Lk - 2:] = True  # torch.nn: True = padding
    causal = nn.Transformer.generate_square_subsequent_mask(Lq)[:, :Lk] if Lq == Lk else None
    return {
        "none": {},
        "kpm": dict(key_padding_mask=kpm),
        "kpm-float": dict(key_padding_mask=torch.zeros(B, Lk).masked_fill(kpm, float("-inf"))),
        "attn-bool": dict(attn_mask=torch.rand(Lq, Lk, generator=g) > 0.7),
        "attn-float": dict(attn_mask=torch.randn(Lq, Lk, generator=g)),
        "attn-3d": dict(attn_mask=torch.randn(B * H, Lq, Lk, generator=g)),
        "both": dict(attn_mask=torch.rand(Lq, Lk, generator=g) > 0.8, key_padding_mask=kpm),
        **({"causal": dict(attn_mask=causal, is_causal=True)} if causal is not None else {}),
    }


@pytest.mark.parametrize("kdim, vdim", [(None, None), (10, 12)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("training", [False, True])
def test_from_torch_parity(kdim, vdim, bias, batch_first, training):
    E, H, B, Lq, Lk = 16, 4, 3, 6, 6 if kdim is None else 7
    ref = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).train(training)
    ours = from_torch(ref)
    assert ours.training == training
    q, k, v = torch.randn(B, Lq, E), torch.randn(B, Lk, kdim or E), torch.randn(B, Lk, vdim or E)
    tq, tk, tv = (x if batch_first else x.transpose(0, 1) for x in (q, k, v))
    for name, kw in torch_masks(B, H, Lq, Lk).items():
        expected = ref(tq, tk, tv, need_weights=False, **kw)[0]
        expected = expected if batch_first else expected.transpose(0, 1)
        mask = masks.Causal() if kw.get("is_causal") else masks.from_torch(
            kw.get("attn_mask"), kw.get("key_padding_mask"), num_heads=H)
        got = ours(q, k, v, mask=mask)
        assert torch.allclose(got, expected, atol=ATOL), name
    back = to_torch(ours, batch_first=batch_first)
    assert torch.allclose(back(tq, tk, tv)[0], ref(tq, tk, tv)[0], atol=ATOL)


def test_refusals():
    with pytest.raises(ValueError, match="add_bias_kv=True or add_zero_attn=True"):
        from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"num_kv_heads=2 != num_heads=4 \(torch.nn has no GQA\)"):
        to_torch(MultiHeadAttention(16, 4, num_kv_heads=2, query_size=16, key_size=16, value_size=16))
    with pytest.raises(ValueError, match="lazy"):
        to_torch(MultiHeadAttention(16, 4))
    with pytest.raises(TypeError, match="from_torch takes a torch.nn.MultiheadAttention; got Linear"):
        from_torch(nn.Linear(2, 2))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 6])
def test_drop_in_matches_torch_outputs_and_weights(batch_first, kdim):
    E, H, B, Lq, Lk = 12, 3, 2, 5, 4
    ref = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=batch_first).eval()
    ours = TorchMultiheadAttention.from_module(ref)
    assert isinstance(ours, nn.MultiheadAttention)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    shape = (B, Lq, E) if batch_first else (Lq, B, E)
    kshape = (B, Lk, kdim or E) if batch_first else (Lk, B, kdim or E)
    q, k = torch.randn(shape), torch.randn(kshape)
    kpm = torch.tensor([[False, False, True, False], [False, False, False, False]])
    for avg in (True, False):
        o1, w1 = ref(q, k, k, key_padding_mask=kpm, average_attn_weights=avg)
        o2, w2 = ours(q, k, k, key_padding_mask=kpm, average_attn_weights=avg)
        assert torch.allclose(o1, o2, atol=ATOL) and torch.allclose(w1, w2, atol=ATOL)
        assert w2.shape == ((B, Lq, Lk) if avg else (B, H, Lq, Lk))
    assert ours(q, k, k, need_weights=False)[1] is None
    # unbatched inputs (L, E)
    uq, uk = torch.randn(Lq, E), torch.randn(Lk, kdim or E)
    assert torch.allclose(ref(uq, uk, uk)[0], ours(uq, uk, uk)[0], atol=ATOL)


def test_drop_in_fully_masked_rows_are_zeros_where_torch_gives_nan():
    E, H = 8, 2
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = TorchMultiheadAttention.from_module(ref)
    x = torch.randn(2, 3, E)
    kpm = torch.tensor([[True, True, True], [False, False, True]])  # sequence 0: all padding
    o_ref, w_ref = ref(x, x, x, key_padding_mask=kpm)
    o, w = ours(x, x, x, key_padding_mask=kpm)
    assert torch.isnan(o_ref[0]).all()  # torch.nn's behaviour with need_weights=True
    assert torch.isfinite(o).all() and (w[0] == 0).all()
    assert torch.allclose(o[1], o_ref[1], atol=ATOL)


def _check_patched(model, run, n_expected):
    model.eval()
    patched = copy.deepcopy(model)
    replaced = patch(patched)
    assert len(replaced) == n_expected
    assert all(isinstance(m, TorchMultiheadAttention) for n, m in patched.named_modules() if n in replaced)
    assert not any(type(m) is nn.MultiheadAttention for m in patched.modules())
    for mode in ("eval", "train"):
        model.train(mode == "train")
        patched.train(mode == "train")
        with torch.no_grad():
            assert torch.allclose(run(model), run(patched), atol=ATOL), mode
    return patched


def test_patch_encoder_decoder_transformer():
    torch.manual_seed(0)
    E, H, B, S, T = 16, 4, 3, 7, 5
    src, tgt = torch.randn(B, S, E), torch.randn(B, T, E)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T)

    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False)
    _check_patched(enc, lambda m: m(src, src_key_padding_mask=kpm), 2)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    _check_patched(layer, lambda m: m(src, src_key_padding_mask=kpm), 1)
    dec = nn.TransformerDecoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    _check_patched(dec, lambda m: m(tgt, src, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=kpm), 2)
    tr = nn.Transformer(E, H, 2, 2, 32, dropout=0.0)  # sequence-first
    patched = _check_patched(
        tr, lambda m: m(src.transpose(0, 1), tgt.transpose(0, 1), tgt_mask=causal, src_key_padding_mask=kpm,
                        memory_key_padding_mask=kpm), 2 + 2 * 2)
    # gradients flow through the patched model
    patched.train()
    out = patched(src.transpose(0, 1), tgt.transpose(0, 1), tgt_mask=causal)
    out.sum().backward()
    assert all(p.grad is not None for p in patched.parameters())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_patch_encoder_with_nested_tensor_fast_path():
    E, H = 16, 4
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 2).eval()
    assert enc.use_nested_tensor
    src = torch.randn(3, 7, E)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    patched = copy.deepcopy(enc)
    patch(patched)
    assert patched.use_nested_tensor  # the drop-in takes the nested tensors torch's encoder hands its layers
    with torch.no_grad():
        a, b = enc(src, src_key_padding_mask=kpm), patched(src, src_key_padding_mask=kpm)
    assert torch.allclose(a, b, atol=ATOL)
    assert (a[1, 5:] == 0).all() and (b[1, 5:] == 0).all()  # torch's nested path zeros padded positions


def test_patch_refuses_a_lone_module():
    with pytest.raises(TypeError, match="from_module"):
        patch(nn.MultiheadAttention(8, 2))


def test_from_d2l_parity():
    from test_compat import CourseMultiHeadAttention

    course = CourseMultiHeadAttention(7, 9, 11, 20, 4, 0.0, bias=True).eval()
    ours = from_d2l(course).eval()
    Q, K, V = torch.randn(3, 5, 9), torch.randn(3, 6, 7), torch.randn(3, 6, 11)
    lens = torch.tensor([6, 2, 1])
    assert torch.allclose(ours(Q, K, V, lens), course(Q, K, V, lens), atol=ATOL)
    compat = D2LMultiHeadAttention(7, 9, 11, 20, 4, 0.0, bias=True)
    compat.load_state_dict(course.state_dict())
    assert torch.allclose(from_d2l(compat)(Q, K, V, lens), course(Q, K, V, lens), atol=ATOL)
    with pytest.raises(TypeError, match=r"from_d2l takes the course's MultiHeadAttention; Linear lacks"):
        from_d2l(nn.Linear(2, 2))
