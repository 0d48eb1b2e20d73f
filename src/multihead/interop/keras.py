"""Keras 3 ``keras.layers.MultiHeadAttention`` <-> multihead (Keras is optional:
install the ``keras`` extra; with ``KERAS_BACKEND=torch`` the two run side by side).

Keras keeps kernels as (E, H, D) for the query/key/value projections and
(H, Dv, out) for the output; multihead keeps ``nn.Linear`` weights (H*D, E) and
(out, H*Dv). Masks: Keras' ``attention_mask`` is 1 = may attend (see
:func:`multihead.masks.from_keras`); ``use_causal_mask`` is ``Causal("top-left")``.
"""

from __future__ import annotations

import numpy as np
import torch

from multihead.layer.module import MultiHeadAttention
from multihead.layer.plan import in_features


def _keras():
    try:
        import keras
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("Keras interop needs Keras 3: pip install 'multihead[keras]'.") from e
    return keras


def _np(x) -> np.ndarray:
    return np.asarray(_keras().ops.convert_to_numpy(x))


def from_keras(layer) -> MultiHeadAttention:
    """A :class:`MultiHeadAttention` with a built ``keras.layers.MultiHeadAttention``'s
    weights (kernels (E, H, D), biases, ``output_shape``). Only the default
    ``attention_axes`` (the sequence axis of 3-D inputs) is supported."""
    keras = _keras()
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise TypeError(f"from_keras takes a keras.layers.MultiHeadAttention; got {type(layer).__name__}.")
    if not layer.built:
        raise ValueError("the Keras layer is not built yet: call it once (or layer.build(...)), then convert.")
    axes = tuple(layer._attention_axes) if layer._attention_axes is not None else None
    if axes not in (None, (1,)):
        raise ValueError(
            f"only the default attention_axes (the sequence axis of (B, L, E) inputs) is supported; got {axes}."
        )
    qk, kk, vk = (_np(d.kernel) for d in (layer._query_dense, layer._key_dense, layer._value_dense))
    ok = _np(layer._output_dense.kernel)  # (H, Dv, out)
    Eq, H, D = qk.shape
    Ek, Ev, Dv, out = kk.shape[0], vk.shape[0], vk.shape[2], ok.shape[-1]
    if ok.ndim != 3:
        raise ValueError(f"only a 1-D output_shape is supported; got output kernel of shape {ok.shape}.")
    bias = layer._use_bias
    new = MultiHeadAttention(H * D, H, float(layer._dropout), bias, query_size=Eq, key_size=Ek, value_size=Ev,
                             head_dim=D, value_head_dim=Dv, out_features=out)
    q, k, v, o = new.projections()
    with torch.no_grad():
        for lin, kern in ((q, qk), (k, kk), (v, vk)):
            lin.weight.copy_(torch.from_numpy(kern.reshape(kern.shape[0], -1).T))  # (E, H, D) -> (H*D, E)
        o.weight.copy_(torch.from_numpy(ok.reshape(H * Dv, out).T))  # (H, Dv, out) -> (out, H*Dv)
        if bias:
            for lin, d in ((q, layer._query_dense), (k, layer._key_dense), (v, layer._value_dense),
                           (o, layer._output_dense)):
                lin.bias.copy_(torch.from_numpy(_np(d.bias).reshape(-1)))  # (H, D) -> (H*D,)
    return new


def to_keras(module: MultiHeadAttention):
    """A built ``keras.layers.MultiHeadAttention`` with ``module``'s weights. Keras'
    layer has no GQA and always scales by 1/sqrt(D)."""
    keras = _keras()
    H, D, Dv = module.num_heads, module.head_dim, module.value_head_dim
    q, k, v, o = module.projections()
    sizes = [in_features(p) for p in (q, k, v)]
    if None in sizes:
        raise ValueError("the module's input sizes are not known yet (lazy): call it once, then convert.")
    if module.num_kv_heads != H:
        raise ValueError(f"keras.layers.MultiHeadAttention has no GQA: num_kv_heads={module.num_kv_heads} != {H}.")
    if module.scale is not None:
        raise ValueError(f"keras.layers.MultiHeadAttention scales by 1/sqrt(D); this module uses scale={module.scale}.")
    bias = q.bias is not None
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, value_dim=Dv, dropout=module.dropout,
                                            use_bias=bias, output_shape=module.out_features)
    layer.build((None, None, sizes[0]), (None, None, sizes[2]), (None, None, sizes[1]))

    def t(x):
        return x.detach().cpu().numpy()

    layer._query_dense.kernel.assign(t(q.weight).T.reshape(sizes[0], H, D))  # (H*D, E) -> (E, H, D)
    layer._key_dense.kernel.assign(t(k.weight).T.reshape(sizes[1], H, D))  # (H*D, Ek) -> (Ek, H, D)
    layer._value_dense.kernel.assign(t(v.weight).T.reshape(sizes[2], H, Dv))  # (H*Dv, Ev) -> (Ev, H, Dv)
    layer._output_dense.kernel.assign(t(o.weight).T.reshape(H, Dv, module.out_features))  # (out, H*Dv) -> (H, Dv, out)
    if bias:
        layer._query_dense.bias.assign(t(q.bias).reshape(H, D))  # (H*D,) -> (H, D)
        layer._key_dense.bias.assign(t(k.bias).reshape(H, D))  # (H*D,) -> (H, D)
        layer._value_dense.bias.assign(t(v.bias).reshape(H, Dv))  # (H*Dv,) -> (H, Dv)
        layer._output_dense.bias.assign(t(o.bias))
    return layer
