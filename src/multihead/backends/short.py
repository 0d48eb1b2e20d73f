"""Short sequences on the CPU for prediction: the scores materialized, the softmax in place.

SDPA's CPU kernel splits every (batch, head) pair into query blocks and runs each as small matrix
products with its own bookkeeping: at the lengths a sentence has (8-128 tokens) and many (batch, head)
pairs, that fixed cost outweighs the arithmetic (a padded group of 13 sentences x 8 heads x 34 tokens,
head size 32: ~1.2 ms in SDPA, ~0.7 ms here). This backend does the plain computation, in as few passes
as it can:

    s = baddbmm(bias, q, kᵀ, alpha=scale)      # (B·H, Lq, Lk): the mask's bias, -inf where not kept
    s = softmax(s, -1), in place               # no second score buffer
    out = bmm(s, v)                            # (B·H, Lq, Dv); a row with nothing to attend to -> zeros

It computes any mask, in float32 or float64, without dropout and without gradients (the softmax is in
place: there is nothing for autograd to keep). "auto" prefers it on the CPU for key padding
(``KeyPadding``, ``ValidLens`` of shape (B,), ``Padding``: the masks a padded batch of sentences has,
and the groups :func:`multihead.core.varlen.attention_varlen` pads) when there are at least
:data:`MIN_PAIRS` (batch, head) pairs holding :data:`MIN_KEYS` keys between them and at most
:data:`MAX_SCORES` scores: measured here (through :func:`multihead.attention`) 0.5-0.95x SDPA's time from about
48 pairs, about even from 12 to 48 pairs of 64 keys or more, and slower outside (1.15-1.6x for 12-16 pairs of
16-32 keys, 1.2-2.5x beyond 2**19 scores; ``bench/short_attention.py``, ``bench/results/short_attention.md``). A call without
a mask stays with SDPA: "auto"'s choice for such a call may not depend on the lengths (a decoder's
grows each step), and SDPA's kernel without a mask is its fastest. Positional masks stay with SDPA and
``blocked``, which skip the masked blocks this computes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead import masks
from multihead.backends.registry import Request, register

#: "auto" prefers this backend from this many (batch, head) pairs: below it SDPA's fixed cost is smaller
MIN_PAIRS = 12
#: ... and from this many keys over all of them (B·H·Lk): 12 or 16 pairs of 16-32 keys ran 1.15-1.6x SDPA's time
MIN_KEYS = 768
#: ... up to this many scores (B·H·Lq·Lk, 2 MiB in float32): above it the materialized scores cost more memory
#: traffic than SDPA's blocks
MAX_SCORES = 2**19
#: the masks "auto" prefers it for: key padding, the same for every query row (their dispatch keys)
KEY_PADDING = (("KeyPadding",), ("ValidLens", 1), ("Padding", 1))


def run(query: Tensor, key: Tensor, value: Tensor, mask: masks.Mask | None, *, scale: float,
        dropout_p: float) -> Tensor:
    """query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv). The score matrices
    are taken in the order the inputs are laid out: (B·H) batch after batch, or (H·B) head after head when
    all three are transposed views of head-major storage (H, B, L, D) (a view then, no copy; the output
    is then such a view too)."""
    B, H, Lq, D = query.shape
    Hkv, Lk, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if Hkv != H:
        key = key.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
        value = value.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Lk, Dv) -> (B, H, Lk, Dv)
    heads_first = B > 1 and H > 1 and all(t.transpose(0, 1).is_contiguous() for t in (query, key, value))
    if heads_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (B, H, L, d) -> (H, B, L, d)
    q = query.reshape(-1, Lq, D)  # (B, H, Lq, D) -> (B·H, Lq, D), or (H, B, ...) -> (H·B, ...)
    k = key.reshape(-1, Lk, D)  # (B·H, Lk, D) or (H·B, Lk, D)
    v = value.reshape(-1, Lk, Dv)  # (B·H, Lk, Dv) or (H·B, Lk, Dv)
    keep = None
    if mask is None:
        add = query.new_zeros(1, 1, 1)  # broadcast over (B·H, Lq, Lk)
    else:
        keep = mask.keep(B, H, Lq, Lk, query.device)  # (B|1, H|1, Lq|1, Lk) bool
        bias = mask.bias(B, H, Lq, Lk, query.device, query.dtype)  # broadcastable to (B, H, Lq, Lk), or None
        add = (query.new_zeros(()) if bias is None else bias.to(query.dtype)).masked_fill(~keep, float("-inf"))
        while add.dim() < 4:
            add = add.unsqueeze(0)
        add = add.expand(B, H, add.shape[2], Lk)  # (B, H, Lq|1, Lk)
        if heads_first:
            add = add.transpose(0, 1)  # (H, B, Lq|1, Lk)
        add = add.reshape(B * H, add.shape[2], Lk)  # (B·H or H·B, Lq|1, Lk)
    s = torch.baddbmm(add, q, k.transpose(1, 2), alpha=scale)  # (B·H, Lq, Lk)
    torch.softmax(s, -1, out=s)  # in place
    out = torch.bmm(s, v)  # (B·H, Lq, Dv) or (H·B, Lq, Dv)
    out = out.view(H, B, Lq, Dv).transpose(0, 1) if heads_first else out.view(B, H, Lq, Dv)  # (B, H, Lq, Dv)
    if keep is not None:  # rows with nothing to attend to: NaN -> zeros, in place, with no branch on the values
        out.masked_fill_(~keep.any(-1, keepdim=True), 0.0)  # (B|1, H|1, Lq|1, 1) broadcast over (B, H, Lq, Dv)
    return out


def can_run(req: Request) -> str | None:
    if req.needs_grad:
        return "no gradients (the softmax is computed in place)"
    if req.dropout_p > 0:
        return "no dropout"
    if req.dtype not in (torch.float32, torch.float64):
        return f"float32 and float64 only (got {req.dtype}: a softmax in place in 16 bits loses what SDPA keeps)"
    return None


def prefer(req: Request) -> str | None:
    if req.device_type != "cpu":
        return "off the CPU, SDPA's fused kernels serve short sequences"
    if req.mask is None:
        return "without a mask, SDPA's kernel (auto's choice may not depend on the lengths there)"
    if req.mask.dispatch_key() not in KEY_PADDING:
        return "masks other than key padding run in SDPA or blocked, which skip masked blocks"
    if req.H != req.Hkv:
        return "grouped-query heads run in SDPA without copying the shared keys"
    if req.B * req.H < MIN_PAIRS:
        return f"fewer than {MIN_PAIRS} (batch, head) pairs: SDPA's fixed cost is smaller"
    if req.B * req.H * req.Lk < MIN_KEYS:
        return f"fewer than {MIN_KEYS} keys over the (batch, head) pairs (B·H·Lk): SDPA's fixed cost is smaller"
    if req.B * req.H * req.Lq * req.Lk > MAX_SCORES:
        return f"more than {MAX_SCORES} scores: SDPA's blocks move less memory"
    return None


def describe(req: Request) -> str:
    return f"{req.B * req.H} score matrices of {req.Lq} x {req.Lk} materialized, softmax in place"


register("short", run, can_run=can_run, prefer=prefer, priority=110,
         doc="short sequences on the CPU, prediction: scores materialized, softmax in place", describe=describe,
         cacheable=True)
