"""MultiHeadAttention: the course's examples, every constructor form, and parity
with an independent per-head computation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention, masks, transpose_output, transpose_qkv

TOY = dict(num_hiddens=100, num_heads=5)


def toy_inputs():
    X = torch.ones(2, 4, 100)  # (B, Lq, E): batch 2, 4 queries
    Y = torch.ones(2, 6, 100)  # (B, Lk, E): 6 key-value pairs
    return X, Y, torch.tensor([3, 2])


@pytest.mark.parametrize(
    "make",
    [
        lambda: MultiHeadAttention(100, 5, 0.5),  # lazy: sizes inferred, as MXNet/DJL
        lambda: MultiHeadAttention(100, 5, 0.5, False, query_size=100, key_size=100, value_size=100),
        lambda: MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5, bias=True),
    ],
    ids=["lazy", "sizes", "keywords"],
)
def test_course_toy_example(make):
    mha = make().eval()
    X, Y, valid_lens = toy_inputs()
    assert mha(X, Y, Y, valid_lens).shape == (2, 4, 100)
    assert mha(X, Y, Y, torch.tensor([[1, 2, 3, 4], [6, 5, 4, 3]])).shape == (2, 4, 100)
    assert isinstance(mha.q_proj, nn.Linear) and mha.q_proj.in_features == 100


def test_lazy_sizes_inferred_per_input():
    mha = MultiHeadAttention(16, 4)
    out = mha(torch.randn(2, 3, 7), torch.randn(2, 5, 9), torch.randn(2, 5, 11))  # cross-attention, all sizes differ
    assert out.shape == (2, 3, 16)
    assert (mha.q_proj.in_features, mha.k_proj.in_features, mha.v_proj.in_features) == (7, 9, 11)


def per_head_attention(mha, X, Y, Z, keep=None):
    """An independent computation: a loop over heads, each head its own slice of the weights."""
    H, Hkv, D, Dv = mha.num_heads, mha.num_kv_heads, mha.head_dim, mha.value_head_dim
    Wq, Wk, Wv, Wo = (p.weight.double() for p in mha.projections())
    bq, bk, bv, bo = (p.bias.double() if p.bias is not None else 0.0 for p in mha.projections())
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        q = X.double() @ Wq[h * D:(h + 1) * D].T + (bq[h * D:(h + 1) * D] if torch.is_tensor(bq) else 0)
        k = Y.double() @ Wk[g * D:(g + 1) * D].T + (bk[g * D:(g + 1) * D] if torch.is_tensor(bk) else 0)
        v = Z.double() @ Wv[g * Dv:(g + 1) * Dv].T + (bv[g * Dv:(g + 1) * Dv] if torch.is_tensor(bv) else 0)
        s = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, Lq, Lk)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        heads.append(torch.softmax(s, -1) @ v)  # (B, Lq, Dv)
    return torch.cat(heads, -1) @ Wo.T + bo  # (B, Lq, out)


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_heads=2), dict(num_kv_heads=1, value_head_dim=3, out_features=5),
                                dict(head_dim=7, bias=True)])
def test_module_equals_per_head_loop(kw):
    kw = {"bias": False, **kw}
    mha = MultiHeadAttention(24, 6, query_size=10, key_size=9, value_size=8, **kw)
    X, Y, Z = torch.randn(3, 5, 10), torch.randn(3, 7, 9), torch.randn(3, 7, 8)
    lens = torch.tensor([7, 3, 1])
    keep = torch.arange(7)[None, None, :] < lens[:, None, None]  # (B, 1, Lk)
    out = mha(X, Y, Z, lens)
    ref = per_head_attention(mha, X, Y, Z, keep)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_self_attention_defaults_and_mask_argument():
    mha = MultiHeadAttention(16, 4)
    X = torch.randn(2, 5, 16)
    causal = mha(X, mask=masks.Causal())
    assert torch.allclose(causal, mha(X, X, X, mask=torch.ones(5, 5, dtype=torch.bool).tril()), atol=1e-6)
    # valid_lens and mask compose
    both = mha(X, valid_lens=torch.tensor([5, 2]), mask=masks.Causal())
    keep = torch.ones(5, 5, dtype=torch.bool).tril() & (torch.arange(5) < 2)
    assert torch.allclose(both[1], mha(X[1:], mask=keep)[0], atol=1e-6)
    # the first row of a causal self-attention sees only itself: prefix-independent
    X2 = X.clone()
    X2[:, 3:] = torch.randn(2, 2, 16)
    assert torch.allclose(mha(X2, mask=masks.Causal())[:, :3], causal[:, :3], atol=1e-6)


def test_vit_notebook_unit_test_gradients_reach_every_parameter():
    # the notebook's MultiHeadAttention(d_model=512, num_head=8, d_k=64), with bias
    mha = MultiHeadAttention(num_hiddens=512, num_heads=8, head_dim=64, bias=True, out_features=512)
    y = mha(torch.randn(2, 128, 512))
    assert y.shape == (2, 128, 512)
    y.mean().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_transpose_output_inverts_transpose_qkv():
    X = torch.randn(3, 7, 4 * 5)  # (B, L, H*D)
    T = transpose_qkv(X, 4)
    assert T.shape == (3 * 4, 7, 5)
    assert torch.equal(T[1 * 4 + 2], X[1, :, 2 * 5:3 * 5])  # sequence 1, head 2
    assert torch.equal(transpose_output(T, 4), X)


def test_dropout_eval_deterministic_training_random():
    mha = MultiHeadAttention(32, 4, dropout=0.5)
    X = torch.randn(2, 9, 32)
    mha.eval()
    assert torch.equal(mha(X), mha(X))
    mha.train()
    a, b = mha(X), mha(X)
    assert not torch.allclose(a, b)
    mha0 = MultiHeadAttention(32, 4, dropout=0.0).train()
    assert torch.equal(mha0(X), mha0(X))


def test_state_dict_round_trip_and_repr():
    mha = MultiHeadAttention(24, 6, num_kv_heads=2, query_size=24, key_size=24, value_size=24)
    other = MultiHeadAttention(24, 6, num_kv_heads=2, query_size=24, key_size=24, value_size=24)
    other.load_state_dict(mha.state_dict())
    X = torch.randn(1, 4, 24)
    assert torch.equal(mha(X), other(X))
    assert sorted(mha.state_dict()) == ["k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight"]
    assert "num_kv_heads=2" in repr(mha)


def test_a_valid_lens_tensor_passed_again_is_checked_again_only_when_it_changed():
    """The checked mask is remembered outside the module (masks.valid_lens), never in it."""
    torch.manual_seed(0)
    m = MultiHeadAttention(12, 3).eval()
    x = torch.randn(2, 4, 12)
    lens = torch.tensor([3, 2])
    a = m(x, x, x, lens)
    first = masks.valid_lens(lens)
    assert masks.valid_lens(lens) is first  # the same tensor, unchanged: the same checked mask
    assert torch.equal(m(x, x, x, lens), a)
    lens[1] = 4  # changed in place: checked and built again
    assert masks.valid_lens(lens) is not first
    assert torch.equal(m(x, x, x, lens), m(x, x, x, torch.tensor([3, 4])))
    lens[0] = 9
    with pytest.raises(ValueError, match="valid_lens must be <= Lk=4"):
        m(x, x, x, lens)
    lens[0] = -1
    with pytest.raises(ValueError, match="valid_lens must be >= 0"):
        m(x, x, x, lens)
