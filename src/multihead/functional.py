"""Scaled dot-product attention for every head in parallel: the functional core.

Shape letters (one set, everywhere): B batch, H query heads, Hkv key/value heads
(H a multiple of Hkv: grouped-query / multi-query attention), Lq query length,
Lk key length, D query/key head size, Dv value head size.

- :func:`attention` validates its inputs, picks a backend (see
  :func:`multihead.explain`) and returns (B, H, Lq, Dv).
- :func:`attention_weights` returns the weights (B, H, Lq, Lk) under the same mask.
- :func:`reference_attention` is the spec every backend is tested against.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead import backends
from multihead.backends.registry import Request
from multihead.masks import Mask, as_mask

__all__ = ["attention", "attention_weights", "reference_attention", "check_inputs", "dispatch"]


def _weights(q: Tensor, k: Tensor, mask: Mask | None, scale: float) -> Tensor:
    """softmax(q kᵀ · scale + bias) over the keys that may be attended to; a row
    with no such key gets zeros. q (B, H, Lq, D), k (B, H, Lk, D) -> (B, H, Lq, Lk)."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if mask is not None:
        bias = mask.bias(B, H, Lq, Lk, q.device, q.dtype)
        if bias is not None:
            s = s + bias
        s = s.masked_fill(~mask.keep(B, H, Lq, Lk, q.device), float("-inf"))
    m = s.detach().amax(-1, keepdim=True)  # (B, H, Lq, 1); -inf on rows with nothing to attend to
    e = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))  # masked keys -> exactly 0
    return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)  # empty rows: 0 / tiny = 0


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Mask | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    compute_dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """The spec: plain attention, computed in ``compute_dtype`` (float64 by default;
    None = the inputs' dtype) and returned in the inputs' dtype.

    query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv).
    Equivalent code::

        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = q @ k.transpose(-2, -1) * scale + bias       # (B, H, Lq, Lk)
        s = s.masked_fill(~keep, -inf)
        w = softmax(s, -1), with rows of all -inf -> 0   # never NaN
        out = dropout(w, dropout_p) @ v                  # (B, H, Lq, Dv)
    """
    H, Hkv, D = query.shape[1], key.shape[1], query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dt = compute_dtype or query.dtype
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
    v = v.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, Dv) -> (B, H, Lk, Dv)
    w = _weights(q, k, mask, scale)  # (B, H, Lq, Lk)
    if dropout_p > 0.0:
        w = F.dropout(w, dropout_p)
    return (w @ v).to(query.dtype)  # (B, H, Lq, Dv)


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def check_inputs(query, key, value=None, mask=None, *, scale=None, dropout_p=0.0) -> Mask | None:
    """Validate an attention call before any computation; returns the mask as a
    :class:`Mask` (tensors are wrapped in :class:`~multihead.masks.Dense`)."""
    named = [("query", query), ("key", key)] + ([("value", value)] if value is not None else [])
    letters = {"query": "(B, H, Lq, D)", "key": "(B, Hkv, Lk, D)", "value": "(B, Hkv, Lk, Dv)"}
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {letters[name]}; got {type(t).__name__}.")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point; got dtype {t.dtype}. Convert with {name}.float().")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D {letters[name]}; got shape {_shape(t)}. For (B, L, E) inputs use "
                "MultiHeadAttention, or split the heads: x.view(B, L, H, D).transpose(1, 2)."
            )
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) > 1:
        got = ", ".join(f"{n} {t.dtype}" for n, t in named)
        raise TypeError(f"query, key and value must share one dtype; got {got}. Cast them to one.")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"query, key and value must be on one device; got {got}.")
    B, H, Lq, D = query.shape
    if len({t.shape[0] for _, t in named}) > 1:
        got = ", ".join(f"{n} {_shape(t)}" for n, t in named)
        raise ValueError(f"query, key and value must have the same batch size B; got {got}.")
    Hkv, Lk = key.shape[1], key.shape[2]
    if key.shape[-1] != D:
        raise ValueError(
            f"query and key must have the same head size D; got query {_shape(query)} (D={D}) and key "
            f"{_shape(key)} (D={key.shape[-1]})."
        )
    if value is not None and (value.shape[1] != Hkv or value.shape[2] != Lk):
        raise ValueError(
            f"key (B, Hkv, Lk, D) and value (B, Hkv, Lk, Dv) must agree on Hkv and Lk; got key {_shape(key)} "
            f"and value {_shape(value)}."
        )
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"the query's heads H={H} must be a multiple of the key/value heads Hkv={Hkv} (grouped-query "
            f"attention: every Hkv head serves H/Hkv query heads); got query {_shape(query)}, key {_shape(key)}."
        )
    if scale is not None and (
        not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0
    ):
        raise ValueError(f"scale must be a positive finite number or None (= 1/sqrt(D)); got {scale!r}.")
    if (
        not isinstance(dropout_p, numbers.Real)
        or isinstance(dropout_p, bool)
        or not 0.0 <= float(dropout_p) < 1.0
    ):
        raise ValueError(f"dropout_p must be a number in [0, 1); got {dropout_p!r}.")
    mask = as_mask(mask)
    if mask is not None:
        mask.validate(B, H, Lq, Lk, query.device)
    return mask


def _request(query, key, value, mask, dropout_p) -> Request:
    B, H, Lq, D = query.shape
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return Request(
        query.device.type, query.dtype, B, H, key.shape[1], Lq, key.shape[2], D, value.shape[-1],
        mask, float(dropout_p), needs_grad,
    )


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask=None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Scaled dot-product attention for all heads at once.

    Args:
        query: (B, H, Lq, D).
        key: (B, Hkv, Lk, D); H must be a multiple of Hkv (GQA / MQA).
        value: (B, Hkv, Lk, Dv).
        mask: a :class:`multihead.masks.Mask`, a bool keep-mask (True = may attend)
            or float bias broadcastable to (B, H, Lq, Lk), or None.
        scale: multiplies the scores; default 1/sqrt(D).
        dropout_p: dropout on the attention weights (applied whenever > 0: pass 0
            when not training).
        backend: "auto" or a registered name (see :func:`multihead.backends.available`).

    Returns:
        (B, H, Lq, Dv). A query row with nothing to attend to (all keys masked, or
        Lk = 0) gives zeros, never NaN.
    """
    mask = check_inputs(query, key, value, mask, scale=scale, dropout_p=dropout_p)
    return dispatch(query, key, value, mask, scale=scale, dropout_p=dropout_p, backend=backend)


def dispatch(query: Tensor, key: Tensor, value: Tensor, mask: Mask | None, *, scale: float | None = None,
             dropout_p: float = 0.0, backend: str = "auto") -> Tensor:
    """:func:`attention` after :func:`check_inputs` has passed: pick the backend and run it.
    (Modules that validated their inputs already call this directly.)"""
    if key.shape[2] == 0:  # no keys: every row has nothing to attend to
        return query.new_zeros(*query.shape[:3], value.shape[-1])  # (B, H, Lq, Dv)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    b = backends.select(backend, _request(query, key, value, mask, dropout_p))
    return b.run(query, key, value, mask, scale=scale, dropout_p=float(dropout_p))


def attention_weights(query: Tensor, key: Tensor, mask=None, *, scale: float | None = None) -> Tensor:
    """The attention weights (B, H, Lq, Lk) of :func:`attention` under the same mask
    (before dropout): each row sums to 1, or is all zeros when it has nothing to
    attend to. Computed in at least float32 and returned in the inputs' dtype.

    query (B, H, Lq, D), key (B, Hkv, Lk, D).
    """
    mask = check_inputs(query, key, None, mask, scale=scale)
    H, Hkv, D = query.shape[1], key.shape[1], query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dt = torch.promote_types(query.dtype, torch.float32)
    k = key.to(dt).repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
    return _weights(query.to(dt), k, mask, scale).to(query.dtype)


def explain(query: Tensor, key: Tensor, value: Tensor, mask=None, *, dropout_p: float = 0.0,
            training: bool = False, backend: str = "auto"):
    """Which backend :func:`attention` would run for these inputs, and why every
    other backend would not. ``training=True`` asks as if gradients were needed.
    Returns an :class:`~multihead.backends.registry.Explanation`; print it."""
    mask = check_inputs(query, key, value, mask, dropout_p=dropout_p)
    req = _request(query, key, value, mask, dropout_p)
    if training:
        req = req._replace(needs_grad=True)
    return backends.explain_request(req, backend)
