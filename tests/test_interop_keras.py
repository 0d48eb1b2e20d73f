"""Keras 3 keras.layers.MultiHeadAttention <-> multihead, with KERAS_BACKEND=torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":  # pragma: no cover
    pytest.skip("these tests need KERAS_BACKEND=torch", allow_module_level=True)

from multihead import MultiHeadAttention, masks  # noqa: E402
from multihead.interop import from_keras, to_keras  # noqa: E402

ATOL = 1e-5


def keras_out(layer, q, v, k, **kw):
    out = layer(q, v, k, **kw)
    return torch.as_tensor(keras.ops.convert_to_numpy(out))


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("output_shape", [None, 9])
def test_from_keras_parity_with_masks(use_bias, output_shape):
    H, D, Dv, B, Lq, Lk = 3, 4, 5, 2, 6, 7
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, value_dim=Dv, use_bias=use_bias,
                                            output_shape=output_shape)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Lq, 8)).astype("float32")
    v = rng.standard_normal((B, Lk, 10)).astype("float32")
    k = rng.standard_normal((B, Lk, 11)).astype("float32")
    layer(q, v, k)  # build
    ours = from_keras(layer)
    tq, tv, tk = (torch.from_numpy(x) for x in (q, v, k))
    am = rng.random((B, Lq, Lk)) > 0.3
    am[:, :, 0] = True
    am_t = torch.from_numpy(am)
    cases = [
        ({}, None),
        (dict(attention_mask=am_t), masks.from_keras(am)),
        (dict(use_causal_mask=True), masks.Causal()),
        (dict(attention_mask=am_t, use_causal_mask=True), masks.from_keras(am) & masks.Causal()),
    ]
    for kw, mask in cases:
        expected = keras_out(layer, tq, tv, tk, **kw)
        got = ours(tq, tk, tv, mask=mask)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=ATOL), kw


def test_to_keras_round_trip():
    ours = MultiHeadAttention(12, 3, bias=True, query_size=8, key_size=6, value_size=5, value_head_dim=2,
                              out_features=7)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 5, 6), torch.randn(2, 5, 5)
    layer = to_keras(ours)
    with torch.no_grad():
        assert torch.allclose(keras_out(layer, q, v, k), ours(q, k, v), atol=ATOL)
        back = from_keras(layer)
        assert torch.allclose(back(q, k, v), ours(q, k, v), atol=ATOL)


def test_keras_refusals():
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=(1, 2))
    x = np.zeros((1, 4, 4, 6), "float32")
    layer(x, x)
    with pytest.raises(ValueError, match=r"only the default attention_axes"):
        from_keras(layer)
    with pytest.raises(ValueError, match="not built yet"):
        from_keras(keras.layers.MultiHeadAttention(num_heads=2, key_dim=3))
    with pytest.raises(ValueError, match="has no GQA"):
        to_keras(MultiHeadAttention(8, 4, num_kv_heads=2, query_size=8, key_size=8, value_size=8))
