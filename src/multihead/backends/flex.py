"""FlexAttention (``torch.nn.attention.flex_attention``), compiled, for the masks it
expresses as a ``mask_mod``: ``Causal``, ``SlidingWindow``, ``ValidLens``,
``KeyPadding``, ``Padding`` and their ``&``.

Compiled kernels (``torch.compile(flex_attention, dynamic=False)``) and block
masks are cached. It never runs where it cannot: no backward on CPU, no dropout,
no additive bias. If its compile fails (and only then) the call falls back to
the next choice, a warning says why once, and ``explain()`` reports it for that
shape afterwards; every other error propagates.

"auto" picks it only on CUDA. On this kind of CPU it lost every measured
workload (W2 padded BERT-base ~1.15x SDPA's time, W4 causal ~2x, plus a 13-15 s
cold compile), and the ``blocked`` backend serves sliding windows faster there;
name it (``backend="flex"``) to use it on CPU anyway.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from multihead import masks
from multihead.backends.registry import Request, Unavailable, forget, register

_COMPILED: dict = {}
_BLOCK_MASKS: OrderedDict = OrderedDict()
#: shapes whose compile failed: {shape key: reason}; a failed compile is not retried
_FAILED: dict = {}
MAX_BLOCK_MASKS = 32


try:  # imported once here: an import inside a traced call would break torch.compile's graph
    from torch.nn.attention import flex_attention as _FA
except ImportError:  # older torch
    _FA = None


def _flex():
    return _FA


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the compiler failed", not "the inputs are wrong"."""
    errs: list[type[BaseException]] = []
    try:
        from torch._dynamo.exc import BackendCompilerFailed

        errs.append(BackendCompilerFailed)
    except ImportError:
        pass
    try:
        from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

        errs += [CppCompileError, InvalidCxxCompiler]
    except ImportError:
        pass
    return tuple(errs)


def _shape_key(req: Request):
    return (req.device_type, req.dtype, req.B, req.H, req.Hkv, req.Lq, req.Lk, req.D, req.Dv)


def can_run(req: Request) -> str | None:
    if _flex() is None:
        return "torch.nn.attention.flex_attention is not available in this torch"
    if req.needs_grad and req.device_type == "cpu":
        return "FlexAttention has no backward on CPU"
    if req.dropout_p > 0:
        return "no dropout"
    if req.mask is not None and req.mask.mask_mod(req.Lq, req.Lk) is None:
        return "dense masks and biases are not converted to a mask_mod"
    failed = _FAILED.get(_shape_key(req))
    if failed:
        return f"its compile failed for this shape earlier ({failed})"
    return None



def prefer(req: Request) -> str | None:
    if req.device_type != "cuda":
        return "on CPU it lost every measured workload to sdpa/blocked, and compiles for 13-15 s"
    if req.mask is None or req.mask.band(req.Lq, req.Lk) == (-float("inf"), 0):
        return "sdpa's fused kernels serve no mask and plain causal"
    return None


def block_mask(mask, B: int, Lq: int, Lk: int, device):
    """The cached BlockMask for ``mask`` at these sizes."""
    fa = _flex()
    batched = mask is not None and mask.batched
    key = (None if mask is None else mask.cache_key(), B if batched else None, Lq, Lk, str(device))
    bm = _BLOCK_MASKS.get(key)
    if bm is None:
        mod = (lambda b, h, q_idx, kv_idx: kv_idx >= 0) if mask is None else mask.mask_mod(Lq, Lk, device)
        bm = fa.create_block_mask(mod, B if batched else None, None, Lq, Lk, device=device)
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
    bm = block_mask(mask, B, Lq, Lk, query.device)
    try:
        out = _compiled(query.device.type)(query, key, value, block_mask=bm, scale=scale, enable_gqa=Hkv != H)
    except _compile_errors() as e:  # only a failed compile falls back; it is remembered for explain()
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        _FAILED[(query.device.type, query.dtype, B, H, Hkv, Lq, Lk, D, value.shape[-1])] = reason
        forget()  # its capability changed: "auto"'s remembered choices are dropped
        raise Unavailable(f"its compile failed: {reason}") from e
    if mask is not None:
        out = masks.zero_empty_rows(out, mask.keep(B, H, Lq, Lk, query.device))
    return out


def describe(req: Request) -> str:
    return "compiled, dynamic=False; block masks cached"


register("flex", run, can_run=can_run, prefer=prefer, priority=120, doc="FlexAttention (compiled)",
         describe=describe, cacheable=True)
