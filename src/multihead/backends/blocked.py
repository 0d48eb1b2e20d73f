"""Banded masks without the masked work: causal and sliding-window attention
(``Causal``, ``SlidingWindow``, either alignment, and their ``&``) computed one
query block at a time over only the keys the block can see.

For query block [qs, qe) the visible keys are [qs + lo, qe - 1 + hi] (the band's
offsets); keys outside that range are never touched. Blocks the band covers
completely run SDPA with no mask; the others with a small bool mask for their
tile. Each block is an ordinary SDPA call, so autograd gives the backward.

It can run any banded mask, with dropout, on any device. "auto" prefers it on the
CPU where the band is narrow: when the keys it visits are at most half of Lq x Lk
and the problem is large enough (Lq * Lk >= 2**20). Plain top-left causal stays
with ``sdpa``'s fused ``is_causal`` kernel, which on this kind of CPU already runs
at ~70% of the machine's matmul throughput.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from multihead import masks
from multihead.backends.registry import Request, register

BLOCK = 256
#: below this many scores (Lq * Lk) the per-block Python loop costs more than it saves
MIN_SIZE = 2**20
#: above this share of the scores visited, one dense SDPA call is as fast
MAX_VISITED = 0.5


def _band(mask, Lq: int, Lk: int) -> tuple[float, float] | None:
    return None if mask is None else mask.band(Lq, Lk)


def visited(lo: float, hi: float, Lq: int, Lk: int, block: int = BLOCK) -> int:
    """How many (query, key) pairs the blocked loop computes."""
    n = 0
    for qs in range(0, Lq, block):
        qe = min(qs + block, Lq)
        ks, ke = masks.band_keys(lo, hi, qs, qe, Lk)
        n += (qe - qs) * max(0, ke - ks)
    return n


def can_run(req: Request) -> str | None:
    if _band(req.mask, req.Lq, req.Lk) is None:
        return "only Causal / SlidingWindow masks (and their &)"
    return None


_PLAIN_CAUSAL = masks.Causal("top-left")


def prefer(req: Request) -> str | None:
    if req.device_type != "cpu":
        return "off the CPU, SDPA's fused kernels and FlexAttention serve banded masks"
    if req.mask == _PLAIN_CAUSAL:
        return "plain top-left causal runs faster in sdpa's is_causal kernel"
    if req.Lq * req.Lk < MIN_SIZE:
        return f"Lq*Lk={req.Lq * req.Lk} < {MIN_SIZE}: too small to gain"
    share = visited(*_band(req.mask, req.Lq, req.Lk), req.Lq, req.Lk) / (req.Lq * req.Lk)
    if share > MAX_VISITED:
        return f"the band covers {share:.0%} of the scores (> {MAX_VISITED:.0%}): dense SDPA is as fast"
    return None


def run(query, key, value, mask, *, scale, dropout_p):
    B, H, Lq, _ = query.shape
    Hkv, Lk, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if Hkv != H:  # the per-block SDPA calls get plain multi-head inputs
        key = key.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
        value = value.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, Dv) -> (B, H, Lk, Dv)
    lo, hi = mask.band(Lq, Lk)
    outs = []
    for qs in range(0, Lq, BLOCK):
        qe = min(qs + BLOCK, Lq)
        ks, ke = masks.band_keys(lo, hi, qs, qe, Lk)
        if ke <= ks:  # the whole block sees nothing
            outs.append(query.new_zeros(B, H, qe - qs, Dv))
            continue
        qb, kb, vb = query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke]  # (B, H, bq, D), (B, H, bk, D)
        if masks.band_block(lo, hi, qs, qe - qs, ks, ke - ks) == 1:  # the band covers the whole block
            o = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, dropout_p=dropout_p)
        else:
            i = torch.arange(qs, qe, device=query.device)[:, None]  # (bq, 1)
            j = torch.arange(ks, ke, device=query.device)[None, :]  # (1, bk)
            keep = masks.band_keep(lo, hi, i, j)  # (bq, bk)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep, scale=scale, dropout_p=dropout_p)
            o = masks.zero_empty_rows(o, keep, kernel_did=query.device.type == "cpu")
        outs.append(o)  # (B, H, bq, Dv)
    return torch.cat(outs, dim=2)  # (B, H, Lq, Dv)


def describe(req: Request) -> str:
    b = _band(req.mask, req.Lq, req.Lk)
    if b is None:
        return ""
    return f"visits {visited(*b, req.Lq, req.Lk) / (req.Lq * req.Lk):.0%} of the scores in blocks of {BLOCK}"


register("blocked", run, can_run=can_run, prefer=prefer, priority=150, doc="banded masks, masked blocks skipped",
         describe=describe, cacheable=True)
