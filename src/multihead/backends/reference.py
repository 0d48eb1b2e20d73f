"""The spec: plain attention, short and readable, computed in float64 by default.
Every other backend is tested against it. As a backend ("reference") it is slow
and exact; "auto" picks it only when nothing faster can run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.backends.registry import Request, register
from multihead.core import validation
from multihead.masks import Mask

__all__ = ["reference_attention", "weights"]


def weights(q: Tensor, k: Tensor, mask: Mask | None, scale: float, softcap: float | None = None,
            sinks: Tensor | None = None) -> Tensor:
    """softmax(q kᵀ · scale + bias) over the keys that may be attended to; a row
    with no such key gets zeros. q (B, H, Lq, D), k (B, H, Lk, D) -> (B, H, Lq, Lk).

    softcap: the scores become ``softcap * tanh(scores / softcap)`` before the mask's bias
    (Gemma 2). sinks (H,): one logit per head that joins every row's softmax denominator and
    is then dropped (gpt-oss' attention sinks): the row's weights sum to less than 1."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if Lk == 0:  # nothing to attend to anywhere
        return s
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        bias = mask.bias(B, H, Lq, Lk, q.device, q.dtype)
        if bias is not None:
            s = s + bias
        s = s.masked_fill(~mask.keep(B, H, Lq, Lk, q.device), float("-inf"))
    m = s.detach().amax(-1, keepdim=True)  # (B, H, Lq, 1); -inf on rows with nothing to attend to
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None]  # (H,) -> (1, H, 1, 1)
        m = torch.maximum(m, sink.detach())
        e = torch.exp(s - m)  # masked keys -> exactly 0
        return e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))  # the sink's share is dropped
    e = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))  # masked keys -> exactly 0
    return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)  # empty rows: 0 / tiny = 0


def compute(query: Tensor, key: Tensor, value: Tensor, mask: Mask | None, *, scale: float | None,
            dropout_p: float = 0.0, compute_dtype: torch.dtype | None = torch.float64,
            softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """:func:`reference_attention` on inputs already validated."""
    H, Hkv, D = query.shape[1], key.shape[1], query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dt = compute_dtype or query.dtype
    q, k, v = query.to(dt), key.to(dt), value.to(dt)
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
    v = v.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, Dv) -> (B, H, Lk, Dv)
    w = weights(q, k, mask, scale, softcap, None if sinks is None else sinks.to(dt))  # (B, H, Lq, Lk)
    if dropout_p > 0.0:
        w = F.dropout(w, dropout_p)
    return (w @ v).to(query.dtype)  # (B, H, Lq, Dv)


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask=None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    compute_dtype: torch.dtype | None = torch.float64,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The spec: plain attention, computed in ``compute_dtype`` (float64 by default;
    None = the inputs' dtype) and returned in the inputs' dtype. Inputs are checked
    as :func:`multihead.attention` checks them.

    query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv).
    Equivalent code::

        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = q @ k.transpose(-2, -1) * scale              # (B, H, Lq, Lk)
        s = softcap * tanh(s / softcap)                  # only with softcap
        s = (s + bias).masked_fill(~keep, -inf)
        w = softmax(s, -1), with rows of all -inf -> 0   # never NaN; Lk = 0 gives zeros
        w = exp(s - m) / (sum(exp(s - m)) + exp(sinks[h] - m))   # instead, with sinks (H,)
        out = dropout(w, dropout_p) @ v                  # (B, H, Lq, Dv)
    """
    mask = validation.attention_inputs(query, key, value, mask, scale=scale, dropout_p=dropout_p, softcap=softcap,
                                   sinks=sinks)
    return compute(query, key, value, mask, scale=scale, dropout_p=float(dropout_p), compute_dtype=compute_dtype,
                   softcap=softcap, sinks=sinks)


def run(query, key, value, mask, *, scale, dropout_p, softcap=None, sinks=None):
    return compute(query, key, value, mask, scale=scale, dropout_p=dropout_p, softcap=softcap, sinks=sinks)


def run_math(query, key, value, mask, *, scale, dropout_p, softcap=None, sinks=None):
    """The spec computed in the inputs' dtype (at least float32): what transformers' "eager" does."""
    dt = torch.promote_types(query.dtype, torch.float32)
    return compute(query, key, value, mask, scale=scale, dropout_p=dropout_p, compute_dtype=dt, softcap=softcap,
                   sinks=sinks)


def describe(req: Request) -> str:
    return "float64 spec"


register("reference", run, priority=0, doc="the float64 spec", describe=describe, cacheable=True,
         modifiers=("softcap", "sinks"))
register("math", run_math, priority=10, doc="the spec in the inputs' dtype (score modifiers sdpa has not)",
         describe=lambda req: "plain softmax(q kᵀ) v in the inputs' dtype, at least float32", cacheable=True,
         modifiers=("softcap", "sinks"))
