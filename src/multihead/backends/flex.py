"""FlexAttention (``torch.nn.attention.flex_attention``), compiled, for the masks it
expresses as a ``mask_mod``: ``Causal``, ``SlidingWindow``, ``ValidLens``,
``KeyPadding``, ``Padding`` and their ``&``.

Compiled kernels (``torch.compile(flex_attention, dynamic=False)``) and block
masks are cached. It never runs where it cannot: no backward on CPU, no dropout,
no additive bias. If its compile fails (and only then) the call falls back to
the next choice, a warning says why once, and ``explain()`` reports it for that
shape afterwards; every other error propagates.

"auto" picks it only on CUDA, and there only for narrow bands (a sliding window
reaching at most 1/16 of the keys, :data:`BAND_FRACTION`), head sizes of at least 16,
and while torch's recompile limit allows a compile for a new shape; measured on an
H200 (``bench/flex_cuda.py``), it ran padding and causal masks slower than SDPA's
kernels. On this kind of CPU it lost every measured workload (W2 padded BERT-base
~1.15x SDPA's time, W4 causal ~2x, plus a 13-15 s cold compile), and the ``blocked``
backend serves sliding windows faster there; name it (``backend="flex"``) to use it
on CPU anyway. Compiled with static shapes: ``dynamic=None`` gave wrong outputs at
some lengths on CPU (torch 2.13: L = 40 and 120 after compiling at 17 and 33).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from multihead import masks
from multihead.backends.registry import Request, Unavailable, forget, register, request

_COMPILED: dict = {}
_BLOCK_MASKS: OrderedDict = OrderedDict()
#: shapes whose compile failed: {shape key: reason}; a failed compile is not retried
_FAILED: dict = {}
MAX_BLOCK_MASKS = 32
#: FlexAttention's CUDA kernel refuses smaller query/key and value head sizes ("NYI: embedding dimension ...
#: must be at least 16", torch 2.11 on an H200, tools/gpu_check.py); inside a caller's torch.compile that
#: error is raised when the caller's graph compiles, where no fallback can catch it, so it is refused here
MIN_CUDA_HEAD_SIZE = 16
#: "auto" prefers flex on CUDA only for masks whose band of diagonals reaches (hi - lo: a query sees at most
#: reach + 1 keys) at most this fraction of the keys. Measured on an H200 (bench/flex_cuda.py,
#: bench/results/flex_cuda): a 257-key sliding window over 4096 keys (6%) ran 2.1-3.4x faster than sdpa's
#: kernels with the mask, forward and backward, bf16 and fp32; padding, key padding and causal + padding at
#: 512 ran at 0.23-0.66x sdpa's speed, and plain causal at 0.15-0.58x.
BAND_FRACTION = 1 / 16
#: the calls flex compiled for (:func:`_compile_key`); torch counts its recompiles of flex_attention per process
#: and, past ``torch._dynamo.config.recompile_limit``, runs new ones unfused (the whole score matrix, slower
#: than sdpa), so "auto" then keeps flex for the shapes it already compiled
_COMPILED_KEYS: set = set()


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
    if req.device_type == "cuda" and min(req.D, req.Dv) < MIN_CUDA_HEAD_SIZE:
        return (f"its CUDA kernel takes head sizes of at least {MIN_CUDA_HEAD_SIZE}; got D={req.D}, Dv={req.Dv}")
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
    if _reach(req.mask, req.Lq, req.Lk) > BAND_FRACTION * req.Lk:
        return (f"on CUDA it ran slower than sdpa except for narrow bands (reaching at most 1/{round(1 / BAND_FRACTION)}"
                " of the keys; bench/results/flex_cuda)")
    limit = _recompile_limit()
    if _compile_key(req) not in _COMPILED_KEYS and len(_COMPILED_KEYS) >= limit:
        return (f"it has compiled for {len(_COMPILED_KEYS)} shapes in this process; torch runs the ones past its "
                f"recompile limit ({limit}) unfused")
    return None


def _reach(mask, Lq: int, Lk: int) -> float:
    """hi - lo of the band of diagonals the mask's band parts keep (a query sees keys i+lo..i+hi: reach + 1 at
    most; its other parts, padding say, only hide more); inf when no part bounds it."""
    lo, hi = -math.inf, math.inf
    for m in mask.parts():
        b = m.band(Lq, Lk)
        if b is not None:
            lo, hi = max(lo, b[0]), min(hi, b[1])
    return hi - lo


def _compile_key(req: Request) -> tuple:
    """What a new compile of flex (dynamic=False) is made for: the sizes, dtype, device, the mask's kind and
    whether it needs gradients."""
    return _shape_key(req) + (None if req.mask is None else req.mask.dispatch_key(), req.needs_grad)


def _recompile_limit() -> int:
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def block_mask(mask, B: int, Lq: int, Lk: int, device):
    """The cached BlockMask for ``mask`` at these sizes."""
    fa = _flex()
    batched = mask is not None and mask.batched
    # a block mask made under inference_mode holds inference tensors, which autograd may not save: one made
    # for prediction is never reused by a call that trains (a CUDA crash in backward, tools/gpu_check.py)
    key = (None if mask is None else mask.cache_key(), B if batched else None, Lq, Lk, str(device),
           torch.is_inference_mode_enabled())
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
    req = request(query, key, value, mask, dropout_p)
    try:
        out = _compiled(query.device.type)(query, key, value, block_mask=bm, scale=scale, enable_gqa=Hkv != H)
    except _compile_errors() as e:  # only a failed compile falls back; it is remembered for explain()
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        _FAILED[_shape_key(req)] = reason
        forget()  # its capability changed: "auto"'s remembered choices are dropped
        raise Unavailable(f"its compile failed: {reason}") from e
    _COMPILED_KEYS.add(_compile_key(req))
    if mask is not None:
        out = masks.zero_empty_rows(out, mask.keep(B, H, Lq, Lk, query.device))
    return out


def describe(req: Request) -> str:
    return "compiled, dynamic=False; block masks cached"


register("flex", run, can_run=can_run, prefer=prefer, priority=120, doc="FlexAttention (compiled)",
         describe=describe, cacheable=True)
