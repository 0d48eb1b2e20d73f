"""FlexAttention (``torch.nn.attention.flex_attention``), compiled, for the masks it
expresses as a ``mask_mod``: ``Causal``, ``SlidingWindow``, ``ValidLens``,
``KeyPadding``, ``Padding`` and their ``&``.

Compiled kernels (``torch.compile(flex_attention, dynamic=False)``) and block
masks are cached. It never runs where it cannot: no backward on CPU, no dropout,
no additive bias. If a compile fails, the call falls back to ``sdpa`` and the
failure is remembered: ``explain()`` reports it for that shape afterwards.

"auto" picks it only on CUDA. On this kind of CPU it lost every measured
workload (W2 padded BERT-base ~1.15x SDPA's time, W4 causal ~2x, plus a 13-15 s
cold compile), and the ``blocked`` backend serves sliding windows faster there;
name it (``backend="flex"``) to use it on CPU anyway.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from multihead import masks
from multihead.backends.registry import Request, register

_COMPILED: dict = {}
_BLOCK_MASKS: OrderedDict = OrderedDict()
_FAILED: dict = {}
MAX_BLOCK_MASKS = 32


def _flex():
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError:
        return None
    return fa


def _expressible(mask) -> str | None:
    if mask is None:
        return None
    for p in mask.parts():
        if isinstance(p, masks.Dense):
            return "dense masks and biases are not converted to a mask_mod"
        if not isinstance(p, (masks.Causal, masks.SlidingWindow, masks.ValidLens, masks.KeyPadding)):
            return f"{type(p).__name__} has no mask_mod"
    return None


def _shape_key(req: Request):
    return (req.device_type, req.dtype, req.B, req.H, req.Hkv, req.Lq, req.Lk, req.D, req.Dv)


def supports(req: Request) -> str | None:
    if _flex() is None:
        return "torch.nn.attention.flex_attention is not available in this torch"
    if req.needs_grad and req.device_type == "cpu":
        return "FlexAttention has no backward on CPU"
    if req.dropout_p > 0:
        return "no dropout"
    why = _expressible(req.mask)
    if why:
        return why
    failed = _FAILED.get(_shape_key(req))
    if failed:
        return f"its compile failed for this shape earlier ({failed}); sdpa runs instead"
    return None


def auto(req: Request) -> str | None:
    if req.device_type != "cuda":
        return "on CPU it lost every measured workload to sdpa/blocked, and compiles for 13-15 s"
    if req.mask is None or isinstance(req.mask, masks.Causal) and req.mask.align == "top-left":
        return "sdpa's fused kernels serve no mask and plain causal"
    return None


def _mask_mod(mask, Lq: int, Lk: int, device):
    parts = [] if mask is None else list(mask.parts())
    tensors = []
    for p in parts:
        if isinstance(p, masks.ValidLens):
            tensors.append(p.lens.to(device))
        elif isinstance(p, masks.KeyPadding):
            tensors.append(p.keep_mask.to(device))
        else:
            tensors.append(None)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = kv_idx >= 0
        for p, t in zip(parts, tensors):
            if isinstance(p, masks.Padding):
                ok = ok & (kv_idx < t[b]) & (q_idx < t[b])
            elif isinstance(p, masks.ValidLens):
                ok = ok & (kv_idx < (t[b] if t.dim() == 1 else t[b, q_idx]))
            elif isinstance(p, masks.KeyPadding):
                ok = ok & t[b, kv_idx]
            else:
                off = 0 if p.align == "top-left" else Lk - Lq
                if isinstance(p, masks.Causal):
                    ok = ok & (kv_idx <= q_idx + off)
                else:
                    ok = ok & (kv_idx >= q_idx + off - p.left) & (kv_idx <= q_idx + off + p.right)
        return ok

    return mask_mod


def _mask_key(mask):
    if mask is None:
        return None
    key = []
    for p in mask.parts():
        if isinstance(p, masks.ValidLens):
            key.append((type(p).__name__, tuple(p.lens.flatten().tolist()), tuple(p.lens.shape)))
        elif isinstance(p, masks.KeyPadding):
            key.append(("KeyPadding", tuple(p.keep_mask.flatten().tolist()), tuple(p.keep_mask.shape)))
        else:
            key.append(repr(p))
    return tuple(key)


def block_mask(mask, B: int, Lq: int, Lk: int, device):
    """The cached BlockMask for ``mask`` at these sizes."""
    fa = _flex()
    batched = mask is not None and any(isinstance(p, (masks.ValidLens, masks.KeyPadding)) for p in mask.parts())
    key = (_mask_key(mask), B if batched else None, Lq, Lk, str(device))
    bm = _BLOCK_MASKS.get(key)
    if bm is None:
        bm = fa.create_block_mask(_mask_mod(mask, Lq, Lk, device), B if batched else None, None, Lq, Lk,
                                  device=device)
        _BLOCK_MASKS[key] = bm
        if len(_BLOCK_MASKS) > MAX_BLOCK_MASKS:
            _BLOCK_MASKS.popitem(last=False)
    else:
        _BLOCK_MASKS.move_to_end(key)
    return bm


def _compiled(device_type: str):
    if device_type not in _COMPILED:
        _COMPILED[device_type] = torch.compile(_flex().flex_attention, dynamic=False)
    return _COMPILED[device_type]


def run(query, key, value, mask, *, scale, dropout_p):
    B, H, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    req_key = (query.device.type, query.dtype, B, H, Hkv, Lq, Lk, D, value.shape[-1])
    try:
        bm = block_mask(mask, B, Lq, Lk, query.device)
        out = _compiled(query.device.type)(query, key, value, block_mask=bm, scale=scale, enable_gqa=Hkv != H)
    except Exception as e:  # a failed compile falls back, and is remembered for explain()
        _FAILED[req_key] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        from multihead.backends import sdpa

        return sdpa.run(query, key, value, mask, scale=scale, dropout_p=dropout_p)
    if mask is not None:  # rows with nothing to attend to: zeros (as every backend)
        keep = mask.keep(B, H, Lq, Lk, query.device)
        out = out.masked_fill(~keep.any(-1, keepdim=True), 0.0)
    return out


def describe(req: Request) -> str:
    return "compiled, dynamic=False; block masks cached"


register("flex", run, supports=supports, priority=120, doc="FlexAttention (compiled)", describe=describe, auto=auto)
