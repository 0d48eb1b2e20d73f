"""One grading session: the subject, how it is called and masked, and the probe inputs. Every stage
of the grader asks the module for calls through :meth:`Session.call`, with the spec's keep mask
(B, 1, Lq, Lk); the session turns it into the module's own convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from multihead.grader.subject import Probe, Reply

__all__ = ["CONVENTIONS", "MASK_SHAPES", "Inputs", "Session", "mask_form", "mask_value", "probes", "tolerance"]

#: how a module reads masks: bool keep, 1 = blocked (the Keras tutorial), additive, the course's lengths
CONVENTIONS = ("keep", "block", "additive", "valid_lens")
B, LQ, LK = 3, 5, 7


def tolerance(dtype: torch.dtype, terms: int) -> float:
    """The largest relative difference (max |a - b| / max |b|) that rounding alone makes between two computations of
    one output in ``dtype``, each a chain of sums of ``terms`` terms in all: every sum of n terms is off by at most
    n * eps times the size of its terms (eps: the dtype's machine epsilon), so two correct computations -- one
    output computed twice, in another batch, along another kernel (torch's fast path and its slow one) or the
    float64 reference -- differ by at most ``terms * eps`` of the output's size. A ValueError for a dtype that is
    not a floating one or a count below 1."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"tolerance: dtype must be a floating torch dtype (torch.float32, ...); got {dtype!r}.")
    if int(terms) < 1:
        raise ValueError(f"tolerance: terms must be the number of terms summed (>= 1); got {terms!r}.")
    return torch.finfo(dtype).eps * int(terms)


class Inputs(NamedTuple):
    """q (B, Lq, E), k, v (B, Lk, E); lens (B,) and the spec's keep mask (B, 1, Lq, Lk), or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    lens: Tensor | None
    keep: Tensor | None


#: the shapes a mask is given in: the grader's own first, then those of modules that raise on it
MASK_SHAPES = ("(B, 1, Lq, Lk)", "(B, Lq, Lk)", "(B, Lk)")


def mask_form(conv: str | None, other_dtype: bool = False, shape: str = MASK_SHAPES[0], given: str | None = None,
              seq_first: bool = False) -> str:
    """How :func:`mask_value` gives the mask (and the inputs), in words: '(B, Lk) bool'; ``given``: the convention
    the mask was found to be read in, where it is not ``conv`` ("additive", "valid_lens"); ``seq_first``: the inputs
    given sequence-first."""
    layout = "sequence-first (L, B, E) inputs, " if seq_first else ""
    if conv is None:
        return "sequence-first (L, B, E)" if seq_first else "batch-first (B, L, E)"
    if (given or conv) == "valid_lens":
        return f"{layout}lengths (B,)"
    kind = ("additive floats (0 kept, -inf blocked)" if given == "additive" else "floats") if (given or conv) == \
        "additive" else "bool" if (conv == "keep") != other_dtype else "1/0 floats"
    return f"{layout}{shape} {kind}"


def mask_value(conv: str | None, keep: Tensor | None, lens: Tensor | None, other_dtype: bool = False,
               shape: str = MASK_SHAPES[0], lens_2d: bool = False, *, shift: float = 0.0):
    """The mask in the module's convention, (B, 1, Lq, Lk) or ``shape``, or the lengths for valid_lens.
    ``other_dtype``: "keep" as float 1/0 instead of bool, "block" as bool True = blocked instead of float 1/0 (the
    same mask, for a module that only takes the other: ``masked_fill(mask, ...)`` needs bool, ``1 - mask`` a
    number). (B, Lk) holds a mask only where every query keeps the same keys: any other is refused. ``lens_2d``:
    the lengths per query row (B, Lq), as the course's decoder masks its own future (valid_lens 1, 2, ..., Lq).
    ``shift``: added to an additive mask everywhere (softmax does not see it: what tells a mask added to the scores
    from one read as a boolean)."""
    if conv is None or keep is None:
        return None
    if conv == "valid_lens" and lens_2d:
        rows = keep[:, 0]  # (B, 1, Lq, Lk) -> (B, Lq, Lk)
        n = rows.sum(-1)  # (B, Lq): each row's kept keys, a prefix
        if not bool((rows == (torch.arange(rows.shape[-1]) < n[..., None])).all()):
            raise ValueError("a mask whose rows are not prefixes of the keys cannot be given as lengths")
        return n
    if conv == "valid_lens":
        return lens
    if shape == MASK_SHAPES[1]:
        keep = keep[:, 0]  # (B, 1, Lq, Lk) -> (B, Lq, Lk)
    elif shape == MASK_SHAPES[2]:
        if not bool((keep == keep[:, :, :1]).all()):
            raise ValueError("a mask whose queries keep different keys cannot be given as (B, Lk)")
        keep = keep[:, 0, 0]  # (B, 1, Lq, Lk) -> (B, Lk): every query's keys are the same
    if conv == "keep":
        return keep.float() if other_dtype else keep
    if conv == "block":
        return ~keep if other_dtype else (~keep).float()
    return torch.full(keep.shape, float(shift)).masked_fill(~keep, float("-inf"))  # additive


def probes(E: int, Lq: int, Lk: int, *, self_attn: bool, masked: bool, causal: bool, g: torch.Generator,
           Bx: int = B, kv_sizes: tuple[int, int] | None = None, kv_same: bool = False) -> Inputs:
    """Random inputs, q (B, Lq, E) and k, v (B, Lk, E) -- or (B, Lk, Ek), (B, Lk, Ev) with ``kv_sizes``
    (cross-attention whose keys and values have sizes of their own, the course's key_size and value_size);
    ``kv_same``: the values are the keys' tensor (a module called with one context for both);
    with a mask the sequences keep Lk-1, min(Lk, 3) and Lk keys (a causal module: the lower triangle on top)."""
    Ek, Ev = kv_sizes or (E, E)
    q = torch.randn(Bx, Lq, E, generator=g)
    k = q if self_attn else torch.randn(Bx, Lk, Ek, generator=g)
    v = q if self_attn else k if kv_same and Ev == Ek else torch.randn(Bx, Lk, Ev, generator=g)
    lens = torch.tensor([max(1, Lk - 1), min(Lk, 3), Lk][:Bx]) if masked else None
    keep = None
    if lens is not None:
        keep = (torch.arange(Lk) < lens[:, None])[:, None, None, :].expand(Bx, 1, Lq, Lk)  # (B,) -> (B, 1, Lq, Lk)
    if causal:
        tri = torch.ones(Lq, Lk, dtype=torch.bool).tril()
        keep = tri[None, None].expand(Bx, 1, Lq, Lk) if keep is None else keep & tri
    return Inputs(q, k, v, lens, keep)


def _seq_first(t):
    """A 3-D tensor's first two axes swapped, (B, L, ·) <-> (L, B, ·); anything else as it is."""
    return t.transpose(0, 1) if isinstance(t, Tensor) and t.dim() == 3 else t


@dataclass
class Session:
    """The subject and how it is graded: ``conv`` its mask convention (None: it takes no mask), ``causal``,
    ``self_attn`` (queries, keys and values are one tensor), ``E`` its (queries') input size, ``g`` the run's random
    generator (the probes are drawn from it, never known in advance to a sandboxed submission), ``how``
    the call as the learner wrote it (for messages)."""

    subject: object
    conv: str | None
    causal: bool
    self_attn: bool
    E: int
    g: torch.Generator
    how: str = "m(q, k, v)"
    #: cross-attention graded on Lq == Lk (it raised on different lengths)
    square: bool = False
    #: the Linear-like layers in the order the first call ran them
    order: tuple = ()
    #: (Ek, Ev): the keys' and values' sizes where they differ from the queries' E (None: E for all three)
    kv_sizes: tuple[int, int] | None = None
    #: the call passes the module one context for keys and values (it never reads its values argument)
    kv_same: bool = False
    #: the dtype of the probes: float64 for a module whose parameters all are (built with .double())
    dtype: torch.dtype = torch.float32
    #: the mask given in the convention's other dtype (:func:`mask_value`): the module raised on the first
    other_mask: bool = False
    #: the shape the mask is given in (:data:`MASK_SHAPES`): the module raised on (B, 1, Lq, Lk)
    mask_shape: str = MASK_SHAPES[0]
    #: the mask forms tried before ``mask_shape`` / ``other_mask`` were chosen, each with what it gave (for the report)
    mask_tried: tuple = ()
    #: valid_lens given per query row (B, Lq): a causal module masking its future through them (the course's decoder)
    lens_2d: bool = False
    #: the convention the mask is given in where the module was found to read it another way than ``conv`` (the same
    #: mask: "additive", 0 kept and -inf blocked, or "valid_lens", each sequence's length); None: ``conv``
    given: str | None = None
    #: added to an additive mask (:func:`mask_value`)
    shift: float = 0.0
    #: the inputs given sequence-first, (L, B, E), and the output read back as (B, L, ·): torch.nn's default layout
    seq_first: bool = False

    @property
    def terms(self) -> int:
        """The terms summed on the way to one output of attention on the probes: the query, key and value projections
        (Eq, Ek, Ev terms), the scores (D <= E), the softmax's sum and the weighted values (Lk each), the output
        projection (E)."""
        Ek, Ev = self.kv_sizes or (self.E, self.E)
        return self.E + Ek + Ev + 2 * self.E + 2 * max(LQ, LK)

    @property
    def tol(self) -> float:
        """The relative difference rounding alone makes between two correct computations of the probes' outputs in
        the probes' dtype (:func:`tolerance` of :attr:`terms`): every comparison of two calls, and of a call with the
        float64 reference, passes within it."""
        return tolerance(self.dtype, self.terms)

    def inputs(self, Lq: int = LQ, Lk: int = LK, Bx: int = B) -> Inputs:
        Lk = Lq if self.self_attn or self.causal or self.square else Lk
        x = probes(self.E, Lq, Lk, self_attn=self.self_attn, masked=self.conv is not None, causal=self.causal,
                   g=self.g, Bx=Bx, kv_sizes=self.kv_sizes, kv_same=self.kv_same)
        if self.dtype == torch.float32:
            return x
        q = x.q.to(self.dtype)  # the same tensor for keys and values where they are one (self-attention, a context)
        k = q if x.k is x.q else x.k.to(self.dtype)
        return x._replace(q=q, k=k, v=q if x.v is x.q else k if x.v is x.k else x.v.to(self.dtype))

    def call(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None, lens: Tensor | None = None,
             **kw) -> Reply:
        """The module on (q, k, v) with the spec's ``keep`` mask (and ``lens``) in its convention; ``kw``:
        the rest of a :class:`~multihead.grader.subject.Probe` (record, replace, cotangent, order, kept)."""
        if self.dtype != torch.float32 and q.dtype != self.dtype:  # a check's float32 draw, in the module's dtype
            q2 = q.to(self.dtype)
            k2 = q2 if k is q else k.to(self.dtype)
            q, k, v = q2, k2, q2 if v is q else k2 if v is k else v.to(self.dtype)
        same = self.self_attn and k is q and v is q
        mask = mask_value(self.given or self.conv, keep, lens, self.other_mask, self.mask_shape, self.lens_2d,
                          shift=self.shift)
        if not self.seq_first:
            return self.subject.call(Probe(q, k, v, mask, same, **kw))
        t = _seq_first  # (B, L, ·) <-> (L, B, ·), one tensor staying one
        q2 = t(q)
        k2 = q2 if k is q else t(k)
        v2 = q2 if v is q else k2 if v is k else t(v)
        if kw.get("cotangent") is not None:
            kw["cotangent"] = t(kw["cotangent"])
        r = self.subject.call(Probe(q2, k2, v2, mask, same, **kw))
        return r._replace(out=t(r.out), grads={n: t(g) if n in ("q", "k", "v") else g for n, g in r.grads.items()},
                          records={n: [(t(a), t(b)) for a, b in lst] for n, lst in r.records.items()})

    def out(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None, lens: Tensor | None = None) -> Tensor:
        """The output (float64), or a RuntimeError with what the module raised."""
        r = self.call(q, k, v, keep, lens)
        if r.error is not None or r.out is None:
            raise RuntimeError(r.error or "the module returned no tensor")
        return r.out.double()
