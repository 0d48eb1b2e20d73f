"""What may attend to what: small immutable mask values.

One convention everywhere: a boolean *keep* mask, True = may attend (as
``F.scaled_dot_product_attention``, Keras and Flax). Float masks are *additive
biases* (added to the scores before the softmax; ``-inf`` = may not attend).

Every mask answers the same questions for given sizes (B, H, Lq, Lk):

- ``keep(B, H, Lq, Lk, device)``: a bool tensor broadcastable to (B, H, Lq, Lk);
- ``bias(B, H, Lq, Lk, device, dtype)``: a float tensor to add, or None;
- ``validate(B, H, Lq, Lk, device)``: raise ValueError before any computation;
- ``to_string(Lq, Lk)``: a text grid for one (batch, head), 1 = may attend.

Masks compose with ``&``: ``ValidLens(lens) & Causal()``.

Other libraries' conventions are converted once, at the boundary, by named
functions: :func:`from_torch` (torch.nn: True = ignored), :func:`from_keras`
(1 = attend) and :func:`blocked` (the Keras tutorial's 1 = blocked).

A query row with nothing to attend to gives zeros (and zero weights) on every
backend, never NaN.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "band_keep",
    "band_keys",
    "band_block",
    "zero_empty_rows",
    "Mask",
    "ValidLens",
    "KeyPadding",
    "Padding",
    "Causal",
    "SlidingWindow",
    "Dense",
    "And",
    "from_torch",
    "from_keras",
    "from_hf",
    "from_sdpa",
    "blocked",
    "from_blocked",
    "as_mask",
]

Align = Literal["top-left", "bottom-right"]


def _as_tensor(x, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (np.ndarray, list, tuple)):
        return torch.as_tensor(np.asarray(x))
    raise TypeError(f"{what} must be a torch.Tensor (or array-like); got {type(x).__name__}.")


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _value_check(ok: Tensor, message: str) -> None:
    """A check on tensor *values*, before any computation: in eager mode a ValueError with
    ``message``; under torch.compile (where reading a value would break the graph) an
    assertion compiled into the graph, raised when the graph runs. On the meta device there are
    no values to check (shapes are checked as everywhere)."""
    if _compiling():
        torch._assert_async(ok, message)
    elif ok.device.type != "meta" and not bool(ok):
        raise ValueError(message)


def stamp(t: Tensor):
    """A value that changes whenever ``t`` is changed in place: its version counter. A tensor made
    under ``torch.inference_mode()`` has none; it gets a fresh object that equals nothing, so
    anything remembered about it is never reused (computed again, which is always right)."""
    return object() if t.is_inference() else t._version


def _full(keep: Tensor, B: int, H: int, Lq: int, Lk: int) -> Tensor:
    """Broadcast a keep mask of up to 4 dims to (B, H, Lq, Lk)."""
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    return keep.expand(B, H, Lq, Lk)



# --- two rules every path shares, written once -------------------------------------------


def band_keep(lo: float, hi: float, i: Tensor, j: Tensor) -> Tensor:
    """The band rule: key j is visible to query i iff ``i + lo <= j <= i + hi`` (``lo = -inf`` /
    ``hi = inf``: no bound). i, j: positions, broadcastable (e.g. (rows, 1) and (1, keys), or
    FlexAttention's index scalars) -> bool, broadcast shape."""
    d = j - i  # how far past query i's diagonal key j lies
    if lo == -math.inf:
        return d <= hi if hi != math.inf else d == d
    return (d >= lo) & (d <= hi) if hi != math.inf else d >= lo


def band_keys(lo: float, hi: float, qs: int, qe: int, Lk: int) -> tuple[int, int]:
    """The keys [ks, ke) the band shows to any of the queries qs..qe-1 (ke <= ks: none)."""
    ks = 0 if lo == -math.inf else max(0, int(qs + lo))
    ke = Lk if hi == math.inf else min(Lk, int(qe - 1 + hi) + 1)
    return ks, ke


def band_block(lo: float, hi: float, qs: int, qn: int, ks: int, kn: int) -> int:
    """How the band meets the block of queries qs..qs+qn-1 and keys ks..ks+kn-1: 0 nothing
    visible, 1 every pair visible, 2 the band cuts the block."""
    dmin, dmax = ks - (qs + qn - 1), (ks + kn - 1) - qs  # the range of (key - query) in the block
    if dmin > hi or dmax < lo:
        return 0
    return 1 if (dmin >= lo and dmax <= hi) else 2


def zero_empty_rows(out: Tensor, keep: Tensor, *, kernel_did: bool = False) -> Tensor:
    """The zero-row rule: a query row with no key to attend to gives zeros, never NaN.
    out (B, H, Lq, Dv), keep (B|1, H|1, Lq|1, Lk) bool. ``kernel_did``: the kernel already gives
    zeros for such rows (SDPA's CPU kernels; tested in tests/test_functional.py), nothing to do.
    (The reference backend's softmax gives them by construction.)"""
    if kernel_did:
        return out
    return out.masked_fill(~keep.any(-1, keepdim=True), 0.0)


class Mask:
    """Base class of all masks. Subclasses implement :meth:`keep`; they may
    implement :meth:`bias` (additive float) and :meth:`validate`."""

    #: batch size the mask is tied to (None when it broadcasts over any batch)
    batch_size: int | None = None

    def keep(self, B: int, H: int, Lq: int, Lk: int, device=None) -> Tensor:
        """Bool tensor broadcastable to (B, H, Lq, Lk); True = may attend."""
        raise NotImplementedError

    def bias(self, B: int, H: int, Lq: int, Lk: int, device=None, dtype=None) -> Tensor | None:
        """Float tensor broadcastable to (B, H, Lq, Lk) added to the scores, or None."""
        return None

    def validate(self, B: int, H: int, Lq: int, Lk: int, device=None) -> None:
        """Raise ValueError if the mask cannot apply to scores of shape (B, H, Lq, Lk)."""

    def parts(self) -> tuple[Mask, ...]:
        """The masks this one is the conjunction of (itself when it is not an :class:`And`)."""
        return (self,)

    # --- capabilities: what a backend, the varlen path or a module may ask of a mask ---

    def key_keep(self, Lk: int, device=None) -> Tensor | None:
        """(B, Lk) bool, True = a real key, when this mask is (or contains) key padding
        that is the same for every query row; None otherwise."""
        return None

    def query_keep(self, Lq: int, device=None) -> Tensor | None:
        """(B, Lq) bool, True = a real query row, when padded query rows come out as
        zeros (:class:`Padding`); None = every query row is computed."""
        return None

    #: True when dropping trailing padding keeps the mask's meaning (a top-left aligned
    #: positional mask: it depends on positions counted from the start only)
    packable: bool = False

    def band(self, Lq: int, Lk: int) -> tuple[float, float] | None:
        """(lo, hi): key j is visible to query i iff ``i + lo <= j <= i + hi`` (±inf
        for no bound); None when the mask is not a band of diagonals."""
        return None

    def mask_mod(self, Lq: int, Lk: int, device=None):
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for this mask, or
        None when it cannot be written as one (dense masks, biases)."""
        return None

    #: whether :meth:`mask_mod` depends on the batch index (FlexAttention's block mask is then per sequence)
    batched: bool = False

    @property
    def requires_grad(self) -> bool:
        """Whether a tensor of the mask is to be differentiated (a learned bias: T5's relative positions, ALiBi
        slopes being trained): a backend without gradients must not run it."""
        return False

    def cache_key(self) -> tuple:
        """A hashable description of the mask's values (for caches of compiled masks)."""
        return (repr(self),)

    def dispatch_key(self) -> tuple:
        """What a backend may look at to decide whether it can or would run this mask: its
        kind and fields, never its tensors' values (the backend registry caches on it)."""
        return (type(self).__name__,)

    def __and__(self, other: Mask) -> Mask:
        if other is None:
            return self
        if not isinstance(other, Mask):
            raise TypeError(f"can only combine a mask with another Mask; got {type(other).__name__}.")
        return And(self.parts() + other.parts())

    def __rand__(self, other):
        if other is None:
            return self
        return NotImplemented

    def to_string(self, Lq: int, Lk: int, *, batch: int = 0, head: int = 0) -> str:
        """Draw the keep mask for one (batch, head) as a grid: rows are queries
        (Lq), columns keys (Lk); ``1`` = may attend, ``0`` = masked.

        >>> print(Causal().to_string(3, 5))
        Causal(align='top-left')  [batch 0, head 0, Lq=3, Lk=5]
        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        """
        B = max(self.batch_size or 1, batch + 1)
        keep = _full(self.keep(B, head + 1, Lq, Lk, device="cpu"), B, head + 1, Lq, Lk)[batch, head]
        rows = [" ".join("1" if x else "0" for x in row.tolist()) for row in keep]
        return "\n".join([f"{self!r}  [batch {batch}, head {head}, Lq={Lq}, Lk={Lk}]", *rows])


@dataclass(frozen=True, eq=False)
class ValidLens(Mask):
    """Valid lengths, exactly the course's ``valid_lens``: for sequence b, keys at
    positions >= lens[b] (or >= lens[b, i] for query i) are ignored.

    lens: integer tensor of shape (B,) or (B, Lq), 0 <= lens <= Lk.
    Every query row is computed; a row with length 0 comes out as zeros.
    """

    lens: Tensor

    def __post_init__(self):
        lens = _as_tensor(self.lens, "valid_lens")
        if lens.dtype.is_floating_point or lens.dtype.is_complex or lens.dtype == torch.bool:
            raise TypeError(
                f"valid_lens must hold integers; got dtype {lens.dtype}. Use lens.long() "
                "(a length counts keys, it is never fractional)."
            )
        if lens.dim() not in (1, 2):
            raise ValueError(
                f"valid_lens must have shape (B,) or (B, Lq); got shape {tuple(lens.shape)}."
            )
        if lens.numel() and lens.device.type != "meta":
            if _compiling():
                _value_check((lens >= 0).all(), "valid_lens must be >= 0")
            else:  # one read of the values: the minimum checked now, the maximum kept for validate()
                lo, hi = (int(x) for x in torch.aminmax(lens))
                if lo < 0:
                    raise ValueError(f"valid_lens must be >= 0; got minimum {lo}.")
                object.__setattr__(self, "_max", (stamp(lens), hi))
        object.__setattr__(self, "lens", lens)

    @property
    def batch_size(self) -> int:
        return self.lens.shape[0]

    def validate(self, B, H, Lq, Lk, device=None):
        lens = self.lens
        if device is not None and lens.device != torch.device(device):
            raise ValueError(
                f"valid_lens is on {lens.device} but the inputs are on {device}; "
                f"move it with valid_lens.to({str(device)!r})."
            )
        if lens.shape[0] != B:
            raise ValueError(
                f"valid_lens has batch size {lens.shape[0]} (shape {tuple(lens.shape)}) but the "
                f"inputs have B={B}; give one length per sequence: shape ({B},) or ({B}, {Lq})."
            )
        if lens.dim() == 2 and lens.shape[1] != Lq:
            raise ValueError(
                f"valid_lens of shape (B, Lq) must have Lq={Lq}; got shape {tuple(lens.shape)}."
            )
        if lens.numel() and _compiling():
            _value_check((lens <= Lk).all(), f"valid_lens must be <= Lk={Lk} (the number of keys)")
        elif lens.numel() and lens.device.type != "meta":  # a meta tensor has no values to check
            seen = self.__dict__.get("_max")  # read at construction, unless the tensor changed since
            hi = seen[1] if seen is not None and seen[0] == stamp(lens) else int(lens.max())
            if hi > Lk:
                raise ValueError(f"valid_lens must be <= Lk={Lk} (the number of keys); got maximum {hi}.")

    def keep(self, B, H, Lq, Lk, device=None):
        compiling = _compiling()  # (checked first: torch.compile then traces no cache read)
        seen = None if compiling else self.__dict__.get("_keep")  # the last one built, while the lengths are unchanged
        if seen is not None and seen[0] == (Lk, str(device), stamp(self.lens)):
            return seen[1]
        lens = self.lens if device is None else self.lens.to(device)
        pos = torch.arange(Lk, device=lens.device)  # (Lk,)
        if lens.dim() == 1:
            keep = pos < lens[:, None, None, None]  # (B, 1, 1, Lk)
        else:
            keep = pos < lens[:, None, :, None]  # (B, 1, Lq, Lk)
        if not compiling and type(self) is ValidLens:
            object.__setattr__(self, "_keep", ((Lk, str(device), stamp(self.lens)), keep))
        return keep

    def key_keep(self, Lk, device=None):
        if self.lens.dim() != 1:  # per-query lengths are not padding
            return None
        lens = self.lens if device is None else self.lens.to(device)
        return torch.arange(Lk, device=lens.device) < lens[:, None]  # (B, Lk)

    batched = True

    def mask_mod(self, Lq, Lk, device=None):
        t = self.lens if device is None else self.lens.to(device)
        if t.dim() == 1:
            return lambda b, h, q_idx, kv_idx: kv_idx < t[b]
        return lambda b, h, q_idx, kv_idx: kv_idx < t[b, q_idx]

    def cache_key(self):
        return (type(self).__name__, tuple(self.lens.shape), tuple(self.lens.flatten().tolist()))

    def dispatch_key(self):
        return (type(self).__name__, self.lens.dim())

    def __repr__(self):
        return f"ValidLens({self.lens.tolist()})"


#: the last few length tensors made into a ValidLens by :func:`valid_lens`: {id: (weakref, stamp, mask)}
_CHECKED: dict[int, tuple] = {}
_CHECKED_MAX = 8


def valid_lens(lens) -> ValidLens:
    """``ValidLens(lens)``; the same object again while the same tensor comes back unchanged (its
    values were checked when it was built, and it keeps its keep mask): the course's loops pass one
    ``valid_lens`` tensor call after call. A small bounded table outside any module (modules hold
    only parameters and buffers); not under torch.compile (a fresh one is traced), never for an
    inference tensor (:func:`stamp`)."""
    if _compiling() or not isinstance(lens, Tensor) or lens.is_inference():
        return ValidLens(lens)
    seen = _CHECKED.get(id(lens))
    if seen is not None and seen[0]() is lens and seen[1] == lens._version:
        return seen[2]
    vl = ValidLens(lens)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[id(lens)] = (weakref.ref(lens), lens._version, vl)
    return vl


@dataclass(frozen=True, eq=False)
class KeyPadding(Mask):
    """Key padding: ``keep`` is bool (B, Lk), True = a real token (may be attended to)."""

    keep_mask: Tensor

    def __post_init__(self):
        keep = _as_tensor(self.keep_mask, "KeyPadding keep")
        if keep.dtype != torch.bool:
            raise TypeError(
                f"KeyPadding needs a bool (B, Lk) tensor, True = real token; got dtype {keep.dtype}. "
                "Convert with `mask.bool()`, or `masks.from_torch(key_padding_mask=...)` for torch.nn's "
                "True = padding."
            )
        if keep.dim() != 2:
            raise ValueError(f"KeyPadding needs shape (B, Lk); got shape {tuple(keep.shape)}.")
        object.__setattr__(self, "keep_mask", keep)

    @property
    def batch_size(self) -> int:
        return self.keep_mask.shape[0]

    def validate(self, B, H, Lq, Lk, device=None):
        if tuple(self.keep_mask.shape) != (B, Lk):
            raise ValueError(
                f"KeyPadding mask must have shape (B, Lk) = ({B}, {Lk}); got {tuple(self.keep_mask.shape)}."
            )
        if device is not None and self.keep_mask.device != torch.device(device):
            raise ValueError(
                f"KeyPadding mask is on {self.keep_mask.device} but the inputs are on {device}; move it."
            )

    def keep(self, B, H, Lq, Lk, device=None):
        k = self.keep_mask if device is None else self.keep_mask.to(device)
        return k[:, None, None, :]  # (B, 1, 1, Lk)

    def key_keep(self, Lk, device=None):
        return self.keep_mask if device is None else self.keep_mask.to(device)  # (B, Lk)

    batched = True

    def mask_mod(self, Lq, Lk, device=None):
        t = self.keep_mask if device is None else self.keep_mask.to(device)
        return lambda b, h, q_idx, kv_idx: t[b, kv_idx]

    def cache_key(self):
        return ("KeyPadding", tuple(self.keep_mask.shape), tuple(self.keep_mask.flatten().tolist()))

    def __repr__(self):
        return f"KeyPadding(lens={self.keep_mask.sum(-1).tolist()})"


@dataclass(frozen=True, eq=False)
class Padding(ValidLens):
    """Self-attention padding of queries *and* keys: sequence b has lens[b] real
    tokens (lens of shape (B,)). Keys at positions >= lens[b] are ignored and the
    padded query rows come out as zeros (they have nothing to attend to)."""

    def __post_init__(self):
        super().__post_init__()
        if self.lens.dim() != 1:
            raise ValueError(f"Padding lens must have shape (B,); got {tuple(self.lens.shape)}.")

    def validate(self, B, H, Lq, Lk, device=None):
        super().validate(B, H, Lq, Lk, device)
        if Lq != Lk:
            raise ValueError(
                f"Padding is for self-attention (Lq == Lk); got Lq={Lq}, Lk={Lk}. "
                "For cross-attention use ValidLens (keys only)."
            )

    def keep(self, B, H, Lq, Lk, device=None):
        lens = self.lens if device is None else self.lens.to(device)
        pos = torch.arange(Lk, device=lens.device)  # (Lk,)
        real = pos < lens[:, None]  # (B, L)
        return real[:, None, :, None] & real[:, None, None, :]  # (B, 1, Lq, Lk)

    def query_keep(self, Lq, device=None):
        lens = self.lens if device is None else self.lens.to(device)
        return torch.arange(Lq, device=lens.device) < lens[:, None]  # (B, Lq)

    def mask_mod(self, Lq, Lk, device=None):
        t = self.lens if device is None else self.lens.to(device)
        return lambda b, h, q_idx, kv_idx: (kv_idx < t[b]) & (q_idx < t[b])

    def __repr__(self):
        return f"Padding({self.lens.tolist()})"


def _check_align(align):
    if align not in ("top-left", "bottom-right"):
        raise ValueError(f"align must be 'top-left' or 'bottom-right'; got {align!r}.")


class _Diagonal(Mask):
    """A mask defined by positions relative to a diagonal (Causal, SlidingWindow)."""

    align: Align

    def diagonal_offset(self, Lq: int, Lk: int) -> int:
        """Where query i's diagonal meets the keys: key ``i + offset`` (0 top-left, Lk - Lq bottom-right)."""
        return 0 if self.align == "top-left" else Lk - Lq

    @property
    def packable(self) -> bool:  # top-left: positions count from the start, so trailing padding can go
        return self.align == "top-left"

    def keep(self, B, H, Lq, Lk, device=None):
        lo, hi = self.band(Lq, Lk)
        i = torch.arange(Lq, device=device)[:, None]  # (Lq, 1)
        j = torch.arange(Lk, device=device)[None, :]  # (1, Lk)
        return band_keep(lo, hi, i, j)[None, None]  # (1, 1, Lq, Lk)

    def dispatch_key(self):
        return (type(self).__name__, self.align, self.__dict__.get("left"), self.__dict__.get("right"))

    def mask_mod(self, Lq, Lk, device=None):
        lo, hi = self.band(Lq, Lk)
        return lambda b, h, q_idx, kv_idx: band_keep(lo, hi, q_idx, kv_idx)


@dataclass(frozen=True)
class Causal(_Diagonal):
    """Look-ahead mask: query i may attend to key j when j <= i + offset.

    ``align`` matters only when Lq != Lk. With Lq=3, Lk=5 (1 = may attend)::

        top-left (offset 0,       bottom-right (offset Lk-Lq = 2,
        SDPA's is_causal)         flash-attn, KV-cache decoding)
        1 0 0 0 0                 1 1 1 0 0
        1 1 0 0 0                 1 1 1 1 0
        1 1 1 0 0                 1 1 1 1 1

    With Lq=5, Lk=3 bottom-right leaves the first two query rows empty: those
    rows come out as zeros::

        top-left      bottom-right
        1 0 0         0 0 0
        1 1 0         0 0 0
        1 1 1         1 0 0
        1 1 1         1 1 0
        1 1 1         1 1 1
    """

    align: Align = "top-left"

    def __post_init__(self):
        _check_align(self.align)

    def band(self, Lq, Lk):
        return -math.inf, self.diagonal_offset(Lq, Lk)


@dataclass(frozen=True)
class SlidingWindow(_Diagonal):
    """Local attention: query i may attend to key j when
    ``i + offset - left <= j <= i + offset + right`` (offset as in :class:`Causal`).

    SlidingWindow(2) with Lq = Lk = 5 (causal, the last 3 tokens)::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1
    """

    left: int
    right: int = 0
    align: Align = "top-left"

    def __post_init__(self):
        for name in ("left", "right"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"SlidingWindow {name} must be an integer >= 0; got {v!r}.")
        _check_align(self.align)

    def band(self, Lq, Lk):
        off = self.diagonal_offset(Lq, Lk)
        return off - self.left, off + self.right


@dataclass(frozen=True, eq=False)
class Dense(Mask):
    """An explicit mask broadcastable to (B, H, Lq, Lk): bool = keep mask (True =
    may attend), float = additive bias (``-inf`` = may not attend)."""

    mask: Tensor

    def __post_init__(self):
        m = _as_tensor(self.mask, "Dense mask")
        if m.dtype != torch.bool and not m.dtype.is_floating_point:
            raise TypeError(
                f"Dense mask must be bool (True = may attend) or floating (additive bias); got dtype "
                f"{m.dtype}. For 0/1 integers use masks.from_keras (1 = attend) or masks.from_blocked "
                "(1 = blocked)."
            )
        if m.dim() > 4:
            raise ValueError(f"Dense mask must have at most 4 dims (B, H, Lq, Lk); got shape {tuple(m.shape)}.")
        if m.dtype.is_floating_point and m.device.type != "meta" and _compiling():
            _value_check(~torch.isnan(m).any(), "the float (additive bias) mask holds NaN; use -inf where a key may "
                                                "not be attended to")
        elif m.dtype.is_floating_point and m.device.type != "meta" and bool(torch.isnan(m).any()):
            raise ValueError(
                f"the float (additive bias) mask of shape {tuple(m.shape)} holds NaN at {int(torch.isnan(m).sum())} "
                "positions; use -inf where a key may not be attended to (a NaN would make every score it touches NaN)."
            )
        object.__setattr__(self, "mask", m)

    @property
    def batch_size(self):
        return self.mask.shape[0] if self.mask.dim() == 4 and self.mask.shape[0] > 1 else None

    def validate(self, B, H, Lq, Lk, device=None):
        shape = (1,) * (4 - self.mask.dim()) + tuple(self.mask.shape)
        if any(s not in (1, t) for s, t in zip(shape, (B, H, Lq, Lk))):
            raise ValueError(
                f"mask of shape {tuple(self.mask.shape)} is not broadcastable to the scores' "
                f"(B, H, Lq, Lk) = ({B}, {H}, {Lq}, {Lk}); each dim must be 1 or equal."
            )
        if device is not None and self.mask.device != torch.device(device):
            raise ValueError(f"mask is on {self.mask.device} but the inputs are on {device}; move it.")

    def _4d(self, device):
        m = self.mask if device is None else self.mask.to(device)
        return m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))  # (B|1, H|1, Lq|1, Lk|1)

    def keep(self, B, H, Lq, Lk, device=None):
        m = self._4d(device)
        return m if m.dtype == torch.bool else m != float("-inf")

    def bias(self, B, H, Lq, Lk, device=None, dtype=None):
        if self.mask.dtype == torch.bool:
            return None
        m = self._4d(device)
        return m if dtype is None else m.to(dtype)

    def dispatch_key(self):
        return ("Dense", self.mask.dtype == torch.bool, self.mask.dim())

    @property
    def requires_grad(self) -> bool:
        return self.mask.requires_grad

    def __repr__(self):
        kind = "bool" if self.mask.dtype == torch.bool else "bias"
        return f"Dense({kind}, shape={tuple(self.mask.shape)})"


@dataclass(frozen=True, eq=False)
class And(Mask):
    """Conjunction: may attend where every part may; biases add up."""

    masks: tuple[Mask, ...]

    @property
    def batch_size(self):
        sizes = [m.batch_size for m in self.masks if m.batch_size is not None]
        return max(sizes) if sizes else None

    def parts(self):
        return self.masks

    def validate(self, B, H, Lq, Lk, device=None):
        for m in self.masks:
            m.validate(B, H, Lq, Lk, device)

    def keep(self, B, H, Lq, Lk, device=None):
        out = None
        for m in self.masks:
            k = m.keep(B, H, Lq, Lk, device)
            out = k if out is None else out & k
        return out

    def bias(self, B, H, Lq, Lk, device=None, dtype=None):
        out = None
        for m in self.masks:
            b = m.bias(B, H, Lq, Lk, device, dtype)
            if b is not None:
                out = b if out is None else out + b
        return out

    def key_keep(self, Lk, device=None):
        return _conjunction(m.key_keep(Lk, device) for m in self.masks)

    def query_keep(self, Lq, device=None):
        return _conjunction(m.query_keep(Lq, device) for m in self.masks)

    def band(self, Lq, Lk):
        lo, hi = -math.inf, math.inf
        for m in self.masks:
            b = m.band(Lq, Lk)
            if b is None:
                return None
            lo, hi = max(lo, b[0]), min(hi, b[1])
        return lo, hi

    @property
    def batched(self):
        return any(m.batched for m in self.masks)

    @property
    def requires_grad(self) -> bool:
        return any(m.requires_grad for m in self.masks)

    def mask_mod(self, Lq, Lk, device=None):
        mods = [m.mask_mod(Lq, Lk, device) for m in self.masks]
        if any(f is None for f in mods):
            return None

        def mask_mod(b, h, q_idx, kv_idx):
            ok = mods[0](b, h, q_idx, kv_idx)
            for f in mods[1:]:
                ok = ok & f(b, h, q_idx, kv_idx)
            return ok

        return mask_mod

    def cache_key(self):
        return tuple(m.cache_key() for m in self.masks)

    def dispatch_key(self):
        return tuple(m.dispatch_key() for m in self.masks)

    def __repr__(self):
        return " & ".join(repr(m) for m in self.masks)


def _conjunction(keeps) -> Tensor | None:
    """The & of the bool tensors given (None ones skipped), or None when there is none."""
    out = None
    for k in keeps:
        if k is not None:
            out = k if out is None else out & k
    return out


def stand_in(key: tuple, B: int, Lq: int, Lk: int) -> Mask | None:
    """A mask with this :meth:`Mask.dispatch_key` (what backends decide on), holding no values: its
    tensors are on the meta device. None for a kind this module does not know (a user's own Mask).
    The backend registry decides with it while torch.compile traces a call (see
    :func:`multihead.backends.registry.traced_choice`)."""
    if key and isinstance(key[0], tuple):  # an And: one key per part
        parts = [stand_in(k, B, Lq, Lk) for k in key]
        return None if any(p is None for p in parts) else And(tuple(parts))
    kind = key[0] if key else None
    if kind in ("ValidLens", "Padding") and len(key) == 2:
        shape = (B,) if key[1] == 1 else (B, Lq)
        return (ValidLens if kind == "ValidLens" else Padding)(torch.empty(shape, dtype=torch.long, device="meta"))
    if kind == "KeyPadding":
        return KeyPadding(torch.empty(B, Lk, dtype=torch.bool, device="meta"))
    if kind == "Causal":
        return Causal(key[1])
    if kind == "SlidingWindow":
        return SlidingWindow(key[2], key[3], key[1])
    if kind == "Dense":
        return Dense(torch.empty((1,) * key[2], dtype=torch.bool if key[1] else torch.float32, device="meta"))
    return None


def as_mask(mask) -> Mask | None:
    """None, a :class:`Mask`, or a bool/float tensor (wrapped in :class:`Dense`)."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        return Dense(mask)
    raise TypeError(
        f"mask must be a multihead.masks.Mask, a bool/float tensor or None; got {type(mask).__name__}. "
        "Convert other conventions with masks.from_torch, masks.from_keras or masks.from_blocked."
    )


# --- converters: other libraries' conventions, applied once at the boundary ---


def from_torch(attn_mask=None, key_padding_mask=None, *, num_heads: int | None = None) -> Mask | None:
    """torch.nn.MultiheadAttention's masks as a :class:`Mask`.

    attn_mask: (Lq, Lk), or (B*H, Lq, Lk) with ``num_heads`` given; bool True = *not*
        allowed to attend, float = added to the scores.
    key_padding_mask: (B, Lk); bool True = padding (ignored), float = added.
    """
    out = None
    if attn_mask is not None:
        am = _as_tensor(attn_mask, "attn_mask")
        if am.dim() == 3:
            if num_heads is None:
                raise ValueError(
                    f"attn_mask of shape {tuple(am.shape)} is (B*H, Lq, Lk): pass num_heads=H to split it."
                )
            if am.shape[0] % num_heads:
                raise ValueError(
                    f"attn_mask's first dim {am.shape[0]} is not a multiple of num_heads={num_heads}."
                )
            am = am.reshape(-1, num_heads, am.shape[1], am.shape[2])  # (B*H, Lq, Lk) -> (B, H, Lq, Lk)
        elif am.dim() != 2:
            raise ValueError(f"attn_mask must be (Lq, Lk) or (B*H, Lq, Lk); got shape {tuple(am.shape)}.")
        out = Dense(~am) if am.dtype == torch.bool else Dense(am)
    if key_padding_mask is not None:
        kpm = _as_tensor(key_padding_mask, "key_padding_mask")
        if kpm.dim() != 2:
            raise ValueError(f"key_padding_mask must be (B, Lk); got shape {tuple(kpm.shape)}.")
        m = KeyPadding(~kpm) if kpm.dtype == torch.bool else Dense(kpm[:, None, None, :])  # (B, 1, 1, Lk)
        out = m if out is None else out & m
    return out


def from_keras(attention_mask) -> Mask | None:
    """Keras' ``attention_mask``: (B, Lq, Lk), 1/True = may attend, 0 = masked."""
    if attention_mask is None:
        return None
    m = _as_tensor(attention_mask, "attention_mask")
    if m.dim() != 3:
        raise ValueError(f"attention_mask must be (B, Lq, Lk); got shape {tuple(m.shape)}.")
    if m.dtype != torch.bool:  # 0.5 was read as True: a value that is neither says nothing sure
        _value_check(((m == 0) | (m == 1)).all(), "from_keras(attention_mask) takes 0/1 values (1 = may attend); got "
                     "other values.")
    return Dense(m.bool()[:, None])  # (B, 1, Lq, Lk)


def from_hf(attention_mask) -> Mask | None:
    """Hugging Face transformers' 4-D attention masks, as its attention functions receive
    them: bool (B|1, 1|H, Lq, Lk) True = may attend, or float additive (B|1, 1|H, Lq, Lk)
    with the dtype's minimum (or -inf) where a key may not be attended to. A tokenizer's (B, L) mask is refused
    with its conversion: as 2-D it would be read as (Lq, Lk), and a float 0/1 one as a bias that masks nothing."""
    if attention_mask is None:
        return None
    m = _as_tensor(attention_mask, "attention_mask")
    if m.dim() != 4:
        raise ValueError(f"from_hf takes the 4-D masks transformers' attention functions receive, (B|1, 1|H, Lq, Lk); "
                         f"got shape {tuple(m.shape)}. A tokenizer's (B, L) attention_mask (1 = token, 0 = padding) "
                         "is masks.Dense(attention_mask.bool()[:, None, None, :]).")
    return from_sdpa(m)


def from_sdpa(attn_mask) -> Mask | None:
    """``F.scaled_dot_product_attention``'s ``attn_mask``: bool, True = may attend, or float added to the scores (the
    dtype's minimum or -inf: may not attend), broadcastable to (B, H, Lq, Lk)."""
    if attn_mask is None:
        return None
    m = _as_tensor(attn_mask, "attn_mask")
    if m.dtype == torch.bool:
        return Dense(m)
    if not m.dtype.is_floating_point:
        raise TypeError(f"attention_mask must be bool or floating; got {m.dtype}.")
    blocked_ = m <= torch.finfo(m.dtype).min / 2  # the dtype's minimum (or -inf): may not attend
    return Dense(m.masked_fill(blocked_, float("-inf")))


def from_blocked(mask) -> Mask | None:
    """The Keras tutorial's mask, 1 = blocked, 0 = may attend (it adds ``-1e9 * mask``
    to the scores), broadcastable to (B, H, Lq, Lk): e.g. a look-ahead mask (Lq, Lk)
    or a padding mask (B, 1, 1, Lk). Values must be 0 or 1. (``masks.blocked`` is the same
    function under its round-3 name.)"""
    if mask is None:
        return None
    m = _as_tensor(mask, "mask")
    if m.dtype != torch.bool:
        _value_check(((m == 0) | (m == 1)).all(), "from_blocked(mask) takes 0/1 values (1 = blocked); got other values.")
    return Dense(m == 0)


blocked = from_blocked  # the round-3 name, kept for code written against it
