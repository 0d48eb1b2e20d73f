"""Scaled dot-product attention for every head in parallel: the functional core.

Shape letters (one set, everywhere): B batch, H query heads, Hkv key/value heads
(H a multiple of Hkv: grouped-query / multi-query attention), Lq query length,
Lk key length, D query/key head size, Dv value head size.

- :func:`attention` validates its inputs, picks a backend (see
  :func:`multihead.explain`) and returns (B, H, Lq, Dv).
- :func:`attention_weights` returns the weights (B, H, Lq, Lk) under the same mask.
- :func:`reference_attention` is the spec every backend is tested against (it
  lives with the reference backend, :mod:`multihead.backends.reference`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from multihead import backends
from multihead.backends import registry
from multihead.backends.reference import reference_attention, weights
from multihead.core import validation
from multihead.masks import Mask

__all__ = ["attention", "attention_weights", "explain", "reference_attention", "run", "weights_of"]


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask=None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    softcap: float | None = None,
    sinks: Tensor | None = None,
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
        softcap: score modifier (Gemma 2's ``attn_logit_softcapping``): the scores become
            ``softcap * tanh(scores / softcap)`` before the mask's bias is added.
        sinks: (H,) score modifier (gpt-oss' attention sinks): one logit per query head that
            joins each row's softmax denominator and is then dropped.

        A backend that does not compute a score modifier never runs a call that has it
        (:func:`explain` says so); ``"math"`` and ``"reference"`` compute both.

    Returns:
        (B, H, Lq, Dv). A query row with nothing to attend to (all keys masked, or
        Lk = 0) gives zeros, never NaN.
    """
    mask = validation.attention_inputs(query, key, value, mask, scale=scale, dropout_p=dropout_p, softcap=softcap,
                                   sinks=sinks)
    return run(query, key, value, mask, scale=scale, dropout_p=float(dropout_p), backend=backend, softcap=softcap,
               sinks=sinks)


#: :func:`attention` on inputs :mod:`multihead.core.validation` has passed (the modules validate once, before
#: their projections, and call this): the registry's one door (no frame of its own between a module and its backend)
run = registry.call


def attention_weights(query: Tensor, key: Tensor, mask=None, *, scale: float | None = None,
                      softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """The attention weights (B, H, Lq, Lk) of :func:`attention` under the same mask
    and score modifiers (before dropout): each row sums to 1 (less with ``sinks``, whose
    share is dropped), or is all zeros when it has nothing to attend to. Computed in at
    least float32 and returned in the inputs' dtype.

    query (B, H, Lq, D), key (B, Hkv, Lk, D).
    """
    mask = validation.attention_inputs(query, key, None, mask, scale=scale, softcap=softcap, sinks=sinks)
    return weights_of(query, key, mask, scale, softcap, sinks)


def weights_of(query: Tensor, key: Tensor, mask: Mask | None, scale: float | None, softcap: float | None = None,
             sinks: Tensor | None = None) -> Tensor:
    """:func:`attention_weights` on validated inputs."""
    H, Hkv, D = query.shape[1], key.shape[1], query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dt = torch.promote_types(query.dtype, torch.float32)
    k = key.to(dt).repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
    sinks = None if sinks is None else sinks.to(dt)
    return weights(query.to(dt), k, mask, scale, softcap, sinks).to(query.dtype)


def explain(query: Tensor, key: Tensor, value: Tensor, mask=None, *, dropout_p: float = 0.0,
            training: bool = False, backend: str = "auto", softcap: float | None = None,
            sinks: Tensor | None = None):
    """Which backend :func:`attention` would run for these inputs, and why every
    other backend would not. ``training=True`` asks as if gradients were needed.
    Returns an :class:`~multihead.backends.registry.Choice`; print it."""
    mask = validation.attention_inputs(query, key, value, mask, dropout_p=dropout_p, softcap=softcap, sinks=sinks)
    req = registry.request(query, key, value, mask, dropout_p, softcap=softcap, sinks=sinks)
    if training:
        req = req._replace(needs_grad=True)
    return backends.explain_request(req, backend)
