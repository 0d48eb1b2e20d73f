"""torch's ``F.scaled_dot_product_attention``.

The mask is converted once: none -> no mask; exactly ``Causal("top-left")`` ->
``is_causal=True`` (SDPA's fused causal path); anything else -> one bool keep
mask, or one float mask (bias, ``-inf`` where not kept), of broadcastable shape
(B|1, H|1, Lq, Lk). GQA uses ``enable_gqa``.
"""

from __future__ import annotations

import torch.nn.functional as F

from multihead.backends.registry import Request, register
from multihead.masks import Causal

_PLAIN_CAUSAL = Causal("top-left")


def _is_plain_causal(mask) -> bool:
    return mask == _PLAIN_CAUSAL


def run(query, key, value, mask, *, scale, dropout_p):
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=key.shape[1] != H)
    if mask is None:
        return F.scaled_dot_product_attention(query, key, value, **kw)
    if _is_plain_causal(mask):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, **kw)
    keep = mask.keep(B, H, Lq, Lk, query.device)  # (B|1, H|1, Lq|1, Lk)
    bias = mask.bias(B, H, Lq, Lk, query.device, query.dtype)
    attn_mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kw)  # (B, H, Lq, Dv)
    if query.device.type != "cpu":
        # SDPA's CPU kernels give zeros for rows with nothing to attend to (tested);
        # elsewhere we do not rely on the kernel for it.
        out = out.masked_fill(~keep.any(-1, keepdim=True), 0.0)
    return out


def describe(req: Request) -> str:
    if req.mask is None:
        return "no mask"
    if _is_plain_causal(req.mask):
        return "is_causal=True"
    return "dense mask materialized"


register("sdpa", run, priority=100, doc="torch.nn.functional.scaled_dot_product_attention", describe=describe,
         cacheable=True)
