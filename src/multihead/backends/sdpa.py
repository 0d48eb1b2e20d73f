"""torch's ``F.scaled_dot_product_attention``.

The mask is converted once: none -> no mask; exactly ``Causal("top-left")`` ->
``is_causal=True`` (SDPA's fused causal path); anything else -> one bool keep
mask, or one float mask (bias, ``-inf`` where not kept), of broadcastable shape
(B|1, H|1, Lq, Lk). GQA uses ``enable_gqa``.

Attention sinks (one logit per head in every row's softmax denominator) are computed
exactly as one more key: a zero key and a zero value whose column of the float mask holds
the head's sink, so its weight is ``exp(sink)`` and it adds nothing to the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from multihead import masks
from multihead.backends.registry import Request, register
from multihead.masks import Causal

_PLAIN_CAUSAL = Causal("top-left")


def _is_plain_causal(mask) -> bool:
    return mask == _PLAIN_CAUSAL


def _with_sink_key(query, key, value, mask, sinks):
    """key (B, Hkv, Lk+1, D), value (B, Hkv, Lk+1, Dv) with a zero key/value appended, and the
    float mask (B|1, H, Lq|1, Lk+1) whose last column is each head's sink."""
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    key = torch.cat([key, key.new_zeros(*key.shape[:2], 1, key.shape[3])], dim=2)  # (B, Hkv, Lk+1, D)
    value = torch.cat([value, value.new_zeros(*value.shape[:2], 1, value.shape[3])], dim=2)  # (B, Hkv, Lk+1, Dv)
    if mask is None:
        base = query.new_zeros(1, 1, 1, Lk)
    else:
        keep = mask.keep(B, H, Lq, Lk, query.device)  # (B|1, H|1, Lq|1, Lk)
        bias = mask.bias(B, H, Lq, Lk, query.device, query.dtype)
        base = (query.new_zeros(()) if bias is None else bias).masked_fill(~keep, float("-inf"))
        while base.dim() < 4:
            base = base.unsqueeze(0)
    Bm, _, Lqm, _ = base.shape
    base = base.expand(Bm, H, Lqm, Lk)  # (B|1, H, Lq|1, Lk)
    sink = sinks.to(query.dtype).view(1, H, 1, 1).expand(Bm, H, Lqm, 1)  # (B|1, H, Lq|1, 1)
    return key, value, torch.cat([base, sink], dim=-1)  # (B|1, H, Lq|1, Lk+1)


def run(query, key, value, mask, *, scale, dropout_p, sinks=None):
    if mask is None and sinks is None:  # the common call (a decoding step's), in the fewest Python steps
        return F.scaled_dot_product_attention(query, key, value, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=key.shape[1] != query.shape[1])
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=key.shape[1] != H)
    if sinks is not None:  # every row has the sink to attend to: no NaN, and an empty row gives zeros
        key, value, attn_mask = _with_sink_key(query, key, value, mask, sinks)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kw)
    if _is_plain_causal(mask):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, **kw)
    keep = mask.keep(B, H, Lq, Lk, query.device)  # (B|1, H|1, Lq|1, Lk)
    bias = mask.bias(B, H, Lq, Lk, query.device, query.dtype)
    attn_mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kw)  # (B, H, Lq, Dv)
    return masks.zero_empty_rows(out, keep, kernel_did=query.device.type == "cpu")  # the CPU kernels give the zeros


def describe(req: Request) -> str:
    if req.sinks:
        return "sinks as one more key (a zero key and value; the float mask holds each head's sink)"
    if req.mask is None:
        return "no mask"
    if _is_plain_causal(req.mask):
        return "is_causal=True"
    return "dense mask materialized"


register("sdpa", run, priority=100, doc="torch.nn.functional.scaled_dot_product_attention", describe=describe,
         cacheable=True, modifiers=("sinks",))
