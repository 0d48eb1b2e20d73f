"""The course's modules on multihead: parity with the course's code (its semantics
re-written here as the independent oracle), and the ViT notebook's two bugs caught."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention
from multihead.compat import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention

# --- the course's PyTorch module, as the chapter defines its behaviour ---


def course_masked_softmax(scores, valid_lens):
    """scores (B*H, Lq, Lk); valid_lens (B*H,) or (B*H, Lq). Masked scores become -1e6."""
    if valid_lens is None:
        return torch.softmax(scores, -1)
    n, Lq, Lk = scores.shape
    lens = valid_lens.repeat_interleave(Lq) if valid_lens.dim() == 1 else valid_lens.reshape(-1)  # (B*H*Lq,)
    flat = scores.reshape(-1, Lk).clone()  # (B*H*Lq, Lk)
    flat[torch.arange(Lk)[None, :] >= lens[:, None]] = -1e6
    return torch.softmax(flat.reshape(n, Lq, Lk), -1)


class CourseMultiHeadAttention(nn.Module):
    def __init__(self, key_size, query_size, value_size, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = nn.Dropout(dropout)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def split(self, X):  # (B, L, H*D) -> (B*H, L, D)
        B, L, _ = X.shape
        return X.reshape(B, L, self.num_heads, -1).permute(0, 2, 1, 3).reshape(B * self.num_heads, L, -1)

    def forward(self, queries, keys, values, valid_lens):
        q, k, v = self.split(self.W_q(queries)), self.split(self.W_k(keys)), self.split(self.W_v(values))
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # (B*H, Lq, Lk)
        self.attention_weights = course_masked_softmax(scores, valid_lens)
        out = torch.bmm(self.dropout(self.attention_weights), v)  # (B*H, Lq, D)
        B = queries.shape[0]
        out = out.reshape(B, self.num_heads, out.shape[1], -1).permute(0, 2, 1, 3).reshape(B, out.shape[1], -1)
        return self.W_o(out)


def test_d2l_toy_example_positional_and_keywords():
    X, Y, valid_lens = torch.ones(2, 4, 100), torch.ones(2, 6, 100), torch.tensor([3, 2])
    a = D2LMultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
    b = D2LMultiHeadAttention(key_size=100, query_size=100, value_size=100, num_hiddens=100, num_heads=5,
                              dropout=0.5, bias=False).eval()
    assert a(X, Y, Y, valid_lens).shape == (2, 4, 100)
    assert b(X, Y, Y, valid_lens).shape == (2, 4, 100)
    assert b.attention.attention_weights.shape == (2 * 5, 4, 6)


@pytest.mark.parametrize("bias", [False, True])
def test_d2l_parity_with_the_course_code(bias):
    course = CourseMultiHeadAttention(7, 9, 11, 20, 4, 0.2, bias=bias).eval()
    ours = D2LMultiHeadAttention(7, 9, 11, 20, 4, 0.2, bias=bias).eval()
    ours.load_state_dict(course.state_dict())  # a course state_dict loads as is (strict)
    assert sorted(ours.state_dict()) == sorted(course.state_dict())
    Q, K, V = torch.randn(3, 5, 9), torch.randn(3, 6, 7), torch.randn(3, 6, 11)
    for valid_lens in (None, torch.tensor([6, 2, 1]), torch.tensor([[1, 2, 3, 4, 5]] * 3)):
        with torch.no_grad():
            expected = course(Q, K, V, valid_lens)
            got = ours(Q, K, V, valid_lens)
        assert torch.allclose(got, expected, atol=1e-5)
        assert torch.allclose(ours.attention.attention_weights, course.attention_weights, atol=1e-6)


def test_d2l_zero_length_rows_are_zeros_not_uniform():
    """The one deliberate difference: the course gives uniform weights for a row with
    nothing to attend to; multihead gives zeros."""
    course = CourseMultiHeadAttention(4, 4, 4, 8, 2, 0.0).eval()
    ours = D2LMultiHeadAttention(4, 4, 4, 8, 2, 0.0).eval()
    ours.load_state_dict(course.state_dict())
    X = torch.randn(2, 3, 4)
    lens = torch.tensor([0, 3])
    with torch.no_grad():
        course(X, X, X, lens)
        ours(X, X, X, lens)
    cw, ow = course.attention_weights, ours.attention.attention_weights  # (B*H, Lq, Lk)
    assert torch.allclose(cw[:2], torch.full_like(cw[:2], 1 / 3))  # sequence 0, both heads: uniform
    assert (ow[:2] == 0).all()
    assert torch.allclose(ow[2:], cw[2:], atol=1e-6)


def test_d2l_training_dropout_and_weights_before_dropout():
    ours = D2LMultiHeadAttention(8, 8, 8, 8, 2, 0.5).train()
    X = torch.randn(2, 5, 8)
    ours(X, X, X, None)
    w = ours.attention.attention_weights
    assert torch.allclose(w.sum(-1), torch.ones(4, 5))  # stored before dropout, as the course stores them


# --- the Keras tutorial ---


def tutorial_attention(layer, queries, keys, values, mask=None):
    """The tutorial's computation, in torch: total-size scaling, -1e9 * mask (1 = blocked)."""
    h = layer.heads

    def split(x):  # (B, L, h*d) -> (B, h, L, d)
        return x.reshape(x.shape[0], x.shape[1], h, -1).permute(0, 2, 1, 3)

    q, k, v = split(layer.W_q(queries)), split(layer.W_k(keys)), split(layer.W_v(values))
    scores = q @ k.transpose(-1, -2) / math.sqrt(layer.d_k)
    if mask is not None:
        scores = scores + -1e9 * torch.as_tensor(mask, dtype=scores.dtype)
    out = torch.softmax(scores, -1) @ v  # (B, h, Lq, d_v/h)
    out = out.permute(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)  # (B, Lq, d_v): works for d_k != d_v
    return layer.W_o(out)


def test_keras_tutorial_configuration():
    h, d_k, d_v, d_model, batch_size, input_seq_length = 8, 64, 64, 512, 64, 5
    queries = np.random.random((batch_size, input_seq_length, d_k))
    keys = np.random.random((batch_size, input_seq_length, d_k))
    values = np.random.random((batch_size, input_seq_length, d_v))
    multihead_attention = KerasTutorialMultiHeadAttention(h, d_k, d_v, d_model)
    out = multihead_attention(queries, keys, values)
    assert out.shape == (64, 5, 512)
    assert multihead_attention.call(queries, keys, values).shape == (64, 5, 512)
    assert all(isinstance(getattr(multihead_attention, n), nn.Linear) for n in ("W_q", "W_k", "W_v", "W_o"))
    assert multihead_attention.W_q.bias is not None


@pytest.mark.parametrize("d_k, d_v", [(64, 64), (32, 48)])
def test_keras_tutorial_parity_with_masks(d_k, d_v):
    layer = KerasTutorialMultiHeadAttention(4, d_k, d_v, 24)
    B, L = 3, 6
    Q, K, V = torch.randn(B, L, 10), torch.randn(B, L, 10), torch.randn(B, L, 12)
    look_ahead = 1 - np.tril(np.ones((L, L)))  # 1 = blocked
    lens = np.array([6, 4, 2])
    padding = (np.arange(L)[None, :] >= lens[:, None]).astype(np.float32)[:, None, None, :]  # (B, 1, 1, L)
    for mask in (None, look_ahead, padding, np.maximum(look_ahead, padding)):
        got = layer(Q, K, V, mask)
        expected = tutorial_attention(layer, Q, K, V, mask)
        assert torch.allclose(got, expected, atol=1e-5)


def test_keras_tutorial_bad_sizes():
    with pytest.raises(ValueError, match=r"d_v=30 \(the total projected size\) must be divisible by h=8"):
        KerasTutorialMultiHeadAttention(8, 64, 30, 512)


# --- the ViT notebook: its two bugs, and a check that catches each ---


def vit_reference_check(forward, mha, X) -> list[str]:
    """Compare ``forward(mha, X)`` (an implementation of the notebook's multi-head
    self-attention over mha's weights) with two independent facts; return what fails."""
    failures = []
    with torch.no_grad():
        # 1. per-head scores scaled by 1/sqrt(d_k), weights softmax-normalized: the per-head loop
        H, D = mha.num_heads, mha.head_dim
        Wq, Wk, Wv, Wo = (p.weight for p in mha.projections())
        bq, bk, bv, bo = (p.bias for p in mha.projections())
        heads = []
        for h in range(H):
            sl = slice(h * D, (h + 1) * D)
            q, k, v = X @ Wq[sl].T + bq[sl], X @ Wk[sl].T + bk[sl], X @ Wv[sl].T + bv[sl]
            heads.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v)
        expected = torch.cat(heads, -1) @ Wo.T + bo
        if not torch.allclose(forward(mha, X), expected, atol=1e-5):
            failures.append("differs from softmax(q kᵀ / sqrt(d_k)) v per head")
        # 2. the weights are a convex combination: with values constant, every head outputs that constant
        saved = Wv.clone(), bv.clone()
        Wv.zero_()
        bv.fill_(1.5)
        expected_const = torch.full((*X.shape[:2], H * D), 1.5) @ Wo.T + bo
        if not torch.allclose(forward(mha, X), expected_const, atol=1e-5):
            failures.append("weights are not normalized (constant values are not preserved)")
        Wv.copy_(saved[0])
        bv.copy_(saved[1])
    return failures


def _heads(mha, X):
    B, L, _ = X.shape
    H, D = mha.num_heads, mha.head_dim
    q, k, v = (p(X).view(B, L, H, D).transpose(1, 2) for p in mha.projections()[:3])  # (B, H, L, D)
    return q, k, v


def _merge(mha, out):
    B, H, L, D = out.shape
    return mha.projections()[3](out.transpose(1, 2).reshape(B, L, H * D))  # (B, H, L, D) -> (B, L, H*D)


def buggy_scale(mha, X):  # the notebook's first bug: scores / d_k
    q, k, v = _heads(mha, X)
    return _merge(mha, torch.softmax(q @ k.transpose(-1, -2) / mha.head_dim, -1) @ v)


def buggy_values(mha, X):  # the notebook's second bug: values times the pre-softmax scores
    q, k, v = _heads(mha, X)
    scores = q @ k.transpose(-1, -2) / math.sqrt(mha.head_dim)
    return _merge(mha, scores @ v)


def test_vit_check_passes_ours_and_catches_each_notebook_bug():
    torch.manual_seed(1)
    mha = MultiHeadAttention(num_hiddens=12, num_heads=3, head_dim=5, bias=True, out_features=12)
    X = torch.randn(2, 7, 12) * 2
    mha(X)  # the input size is inferred on the first call
    assert vit_reference_check(lambda m, x: m(x), mha, X) == []
    assert "differs from softmax(q kᵀ / sqrt(d_k)) v per head" in vit_reference_check(buggy_scale, mha, X)
    assert "weights are not normalized (constant values are not preserved)" in vit_reference_check(buggy_values, mha, X)
