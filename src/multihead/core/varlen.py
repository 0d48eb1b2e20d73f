"""Padding is not computed: pure functions for packed (variable-length) sequences.

A padded batch (B, L, ...) with a keep mask (B, L) becomes packed tokens (N, ...)
plus ``cu_seqlens`` (B+1,), the cumulative lengths (:mod:`multihead.core.padding`, as flash-attn's
``bert_padding``); :func:`attention_varlen` attends sequence by sequence on packed tokens::

    keys (B, Lk, E) --unpad--> (Nk, E) --k_proj--> (Nk, Hkv, D)
    attention_varlen(q (Nq, H, D), k (Nk, Hkv, D), v (Nk, Hkv, Dv), cu_seqlens_q, cu_seqlens_k) -> (Nq, H, Dv)
    (Nq, H*Dv) --o_proj--> (Nq, out) --pad--> (B, Lq, out)

:class:`~multihead.MultiHeadAttention` packs when its mask marks padding
(``ValidLens`` of shape (B,), ``KeyPadding``, or ``Padding`` for queries and keys)
and :func:`plan` says packing pays (:func:`packing_cost`). Queries are packed too
under ``Padding`` (padded query rows come out as zeros); under the course's
``valid_lens`` every query row is computed, exactly as before. Positional masks
that keep their meaning when trailing padding is dropped (``mask.packable``:
``Causal``, ``SlidingWindow``, top-left aligned) may be combined when the kept keys
are a prefix of each sequence. Anything else takes the dense path.
"""

from __future__ import annotations

import array
import functools
import heapq
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from multihead import masks
from multihead.core import validation
from multihead.core.functional import run
from multihead.core.padding import indices_of, pad, unpad

__all__ = ["Packed", "Packing", "Schedule", "attention_varlen", "core_calls", "cumulative", "indices_of", "pad",
           "packing_cost", "plan", "run_schedule", "schedule", "schedule_calls", "unpad"]

#: what one sequence of the per-sequence loop costs, in floating-point operations
#: it could have done instead (~50 us of Python and kernel launch at ~100 GFLOP/s here: one small
#: SDPA call with its slicing, timed on this machine; ``bench/varlen_groups.py`` times the grouping)
LOOP_COST_FLOP = 5e6

#: self-attention over packed sequences no longer than this is padded for the attention alone
#: (batched calls over sequences of like length, :func:`padded_groups`); longer ones loop over the
#: sequences
PAD_UP_TO = 128

#: the most padded calls such self-attention is cut into (1: one call padded to the longest)
MAX_GROUPS = 8


# --- attention on packed tokens ---


def attention_varlen(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    mask: masks.Mask | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Attention on packed sequences: sequence b's queries attend to sequence b's keys.

    Args:
        query: (Nq, H, D), the query tokens of every sequence, one after another.
        key: (Nk, Hkv, D); value: (Nk, Hkv, Dv).
        cu_seqlens_q, cu_seqlens_k: (B+1,) integers, cumulative lengths from 0
            (sequence b is ``query[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``).
        mask: a positional mask applied inside every sequence (``Causal``,
            ``SlidingWindow``), or None.
    Returns:
        (Nq, H, Dv).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a packed (N, heads, size) tensor; got {got}.")
    cu_q = cumulative("cu_seqlens_q", cu_seqlens_q, query.shape[0])
    cu_k = cumulative("cu_seqlens_k", cu_seqlens_k, key.shape[0])
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; got "
                         f"{len(cu_q) - 1} and {len(cu_k) - 1}.")
    q4, k4, v4 = query[None].transpose(1, 2), key[None].transpose(1, 2), value[None].transpose(1, 2)  # (1, H, N, D)
    validation.attention_inputs(q4, k4, v4, None, scale=scale, dropout_p=dropout_p)
    mask = masks.as_mask(mask)
    if mask is not None and any(not p.packable for p in mask.parts()):
        raise ValueError(f"attention_varlen applies only positional, top-left aligned masks inside each sequence "
                         f"(Causal, SlidingWindow); got {mask!r}.")
    sched = schedule(cu_q, cu_k, mask, 2.0 * query.shape[1] * (query.shape[-1] + value.shape[-1]))
    return run_schedule(query, key, value, sched, scale=scale, dropout_p=float(dropout_p), backend=backend)


def cumulative(name: str, cu: object, n: int) -> list[int]:
    """``cu`` checked as (B+1,) integer cumulative lengths rising from 0 to ``n`` tokens, as a list
    (read once: the checks and the loop then cost no tensor operations)."""
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D integer tensor (B+1,) of cumulative lengths; got {cu!r}.")
    c = cu.tolist()
    if c[0] != 0 or c[-1] != n or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"{name} must rise from 0 to the number of packed tokens ({n}); got {c}.")
    return c


class Schedule(NamedTuple):
    """How attention over packed sequences runs, decided once (:func:`schedule`), then executed
    (:func:`run_schedule`) and listed (:func:`schedule_calls`) from the same record: ``groups`` for
    short self-attention without a positional mask, padded per group of sequences of like length
    (:func:`padded_groups`); None: one call per sequence (a sequence without keys: zeros, no call)."""

    cu_q: list[int]
    cu_k: list[int]
    mask: masks.Mask | None
    groups: Groups | None


def schedule(cu_q: list[int], cu_k: list[int], mask: masks.Mask | None, pair_flop: float) -> Schedule:
    """The one decision: short self-attention without a positional mask is padded per group (``pair_flop``:
    the work of one (query, key) pair, 2·H·(D + Dv)); anything else loops over the sequences."""
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    if mask is None and q_lens == [b - a for a, b in zip(cu_k, cu_k[1:])] and q_lens and max(q_lens) <= PAD_UP_TO:
        return Schedule(cu_q, cu_k, None, padded_groups(tuple(q_lens), pair_flop, MAX_GROUPS))
    return Schedule(cu_q, cu_k, mask, None)


def schedule_calls(s: Schedule) -> list[tuple[int, int, int, masks.Mask | None]]:
    """The calls the attention core gets, in order, as (B, Lq, Lk, mask): one padded call per group
    (``KeyPadding``: padded query rows are computed and dropped), or one per sequence with keys."""
    if s.groups is None:
        return [(1, b - a, d - c, s.mask) for a, b, c, d in zip(s.cu_q, s.cu_q[1:], s.cu_k, s.cu_k[1:]) if d > c]
    calls, at = [], 0
    keep = s.groups.tensors("cpu")[1] if s.groups.groups else None  # (Σ B·Lm,)
    for g in s.groups.groups:
        calls.append((g.B, g.Lm, g.Lm, masks.KeyPadding(keep[at:at + g.B * g.Lm].view(g.B, g.Lm))))
        at += g.B * g.Lm
    return calls


def core_calls(cu_q: list[int], cu_k: list[int], mask: masks.Mask | None,
               pair_flop: float) -> list[tuple[int, int, int, masks.Mask | None]]:
    """:func:`schedule_calls` of :func:`schedule`: the calls attention over these sequences makes."""
    return schedule_calls(schedule(cu_q, cu_k, mask, pair_flop))


class Group(NamedTuple):
    """One padded call of short self-attention: B sequences padded to the longest, Lm tokens, N of
    them real."""

    B: int
    Lm: int
    N: int


class Groups(NamedTuple):
    """:func:`padded_groups`' answer: the groups, and their index arrays (machine integers, made into
    tensors by :meth:`tensors` without a Python loop)."""

    groups: tuple[Group, ...]
    index: array.array  # int64: src (Σ B·Lm,) | real (Nq,) | back (Nq, with more than one group)
    keep: array.array  # bytes 0/1 (Σ B·Lm,)

    def tensors(self, device) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """src (Σ B·Lm,): the packed token each slot of the groups (one after another) reads, a padded
        slot its sequence's last token; keep (Σ B·Lm,) bool: True at the real tokens' slots; real
        (Nq,): each group's real slots (counted from the group's first), groups concatenated; back
        (Nq,) with more than one group: where each token's row is in the groups' rows concatenated.
        Fresh tensors (the cached arrays are never shared)."""
        slots = len(self.keep)
        index = torch.frombuffer(self.index, dtype=torch.int64).to(device, copy=True)
        keep = torch.frombuffer(self.keep, dtype=torch.bool).to(device, copy=True)
        n = sum(g.N for g in self.groups)
        back = index[slots + n:] if len(self.groups) > 1 else None
        return index[:slots], keep, index[slots:slots + n], back


@functools.lru_cache(maxsize=256)
def padded_groups(lens: tuple[int, ...], pair_flop: float, max_groups: int = MAX_GROUPS) -> Groups:
    """How short self-attention over sequences of these lengths is padded: the sequences with
    tokens, sorted by length and cut into consecutive groups, each padded to its longest, wherever
    the (query, key) pairs a cut saves on padding (``pair_flop`` each) outweigh one more call
    (:data:`LOOP_COST_FLOP`): the best cut of a group, then of its parts, at most ``max_groups``
    groups. One group keeps the sequences in their order (its real rows are then the tokens in
    order). Pure functions of their arguments, cached: every layer of a model asks with the same
    lengths."""
    order = sorted((b for b, n in enumerate(lens) if n), key=lens.__getitem__)
    L = [lens[b] for b in order]  # ascending

    def best_cut(i: int, j: int) -> tuple[float, int, int, int]:  # (-pairs saved, i, cut, j) of span [i, j)
        if j - i < 2:
            return (0.0, i, j, j)
        whole = (j - i) * L[j - 1] ** 2
        c = min(range(i + 1, j), key=lambda c: (c - i) * L[c - 1] ** 2 + (j - c) * L[j - 1] ** 2)
        return (-(whole - (c - i) * L[c - 1] ** 2 - (j - c) * L[j - 1] ** 2), i, c, j)

    spans, heap = [], [best_cut(0, len(order))]  # the span whose cut saves most is cut first
    while heap:
        saved, i, c, j = heapq.heappop(heap)
        if -saved * pair_flop > LOOP_COST_FLOP and len(spans) + len(heap) + 2 <= max_groups:
            heapq.heappush(heap, best_cut(i, c))
            heapq.heappush(heap, best_cut(c, j))
        elif j > i:
            spans.append((i, j))
    spans.sort()
    members = (tuple(b for b in range(len(lens)) if lens[b]),) if len(spans) == 1 else tuple(
        tuple(order[i:j]) for i, j in spans)
    return _layout(lens, members)


@functools.lru_cache(maxsize=64)
def _layout(lens: tuple[int, ...], members: tuple[tuple[int, ...], ...]) -> Groups:
    """The index arrays of :class:`Groups` for these groups of sequences (indices into ``lens``)."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    groups, src, keep, real, tokens = [], [], bytearray(), [], []
    for group in members:
        Lm = max(lens[b] for b in group)
        for i, b in enumerate(group):
            s, n = starts[b], lens[b]
            src += range(s, s + n)
            src += [s + n - 1] * (Lm - n)  # a padded slot reads its sequence's last token
            keep += b"\x01" * n + b"\x00" * (Lm - n)
            real += range(i * Lm, i * Lm + n)
            tokens += range(s, s + n)
        groups.append(Group(len(group), Lm, sum(lens[b] for b in group)))
    index = src + real
    if len(groups) > 1:
        index += sorted(range(len(tokens)), key=tokens.__getitem__)  # token t's row: the inverse order
    return Groups(tuple(groups), array.array("q", index), array.array("b", keep))


def run_schedule(q: Tensor, k: Tensor, v: Tensor, s: Schedule, *, scale: float | None, dropout_p: float,
                 backend: str) -> Tensor:
    """Execute a :class:`Schedule` on validated packed tokens: q (Nq, H, D), k (Nk, Hkv, D), v (Nk, Hkv, Dv)
    -> (Nq, H, Dv). Nothing is decided here."""
    if s.groups is not None:
        return _run_groups(q, k, v, s.groups, scale=scale, dropout_p=dropout_p, backend=backend)
    H, Dv, outs = q.shape[1], v.shape[-1], []
    for qs, qe, ks, ke in zip(s.cu_q, s.cu_q[1:], s.cu_k, s.cu_k[1:]):
        qb = q[qs:qe].transpose(0, 1)[None]  # (nq, H, D) -> (1, H, nq, D)
        kb = k[ks:ke].transpose(0, 1)[None]  # (nk, Hkv, D) -> (1, Hkv, nk, D)
        vb = v[ks:ke].transpose(0, 1)[None]  # (nk, Hkv, Dv) -> (1, Hkv, nk, Dv)
        ob = run(qb, kb, vb, s.mask, scale=scale, dropout_p=dropout_p, backend=backend)  # (1, H, nq, Dv)
        outs.append(ob[0].transpose(0, 1))  # (1, H, nq, Dv) -> (nq, H, Dv)
    return torch.cat(outs) if outs else q.new_zeros(0, H, Dv)  # (Nq, H, Dv)


def _run_groups(q: Tensor, k: Tensor, v: Tensor, p: Groups, *, scale: float | None, dropout_p: float,
                backend: str) -> Tensor:
    """Short self-attention, one padded call per group. One gather per tensor, no zero fill: a padded slot
    holds a copy of a real token (finite, never attended to as a key under KeyPadding, its query row dropped).
    The gathers lay each group out head after head, (h, B·Lm, d): the ``short`` backend then reads its score
    matrices without a copy, and the real rows come out of its answer in one gather."""
    H, Dv = q.shape[1], v.shape[-1]
    if not p.groups:
        return q.new_zeros(0, H, Dv)  # (0, H, Dv)
    src, keep, real, back = p.tensors(q.device)  # (Σ B·Lm,), (Σ B·Lm,), (Nq,), (Nq,) or None
    heads = [t.transpose(0, 1).contiguous() for t in (q, k, v)]  # (N, h, d) -> (h, N, d), once for every group
    rows, at, n = [], 0, 0
    for g in p.groups:
        sl = slice(at, at + g.B * g.Lm)
        qp, kp, vp = (t.index_select(1, src[sl]).view(t.shape[0], g.B, g.Lm, t.shape[2]).transpose(0, 1)
                      for t in heads)  # (h, N, d) -> (h, B·Lm, d) -> (B, h, Lm, d), heads first in memory
        o = run(qp, kp, vp, masks.KeyPadding(keep[sl].view(g.B, g.Lm)), scale=scale, dropout_p=dropout_p,
                 backend=backend)  # (B, H, Lm, Dv)
        o = o.transpose(1, 2).reshape(g.B * g.Lm, H, Dv)  # (B, H, Lm, Dv) -> (B·Lm, H, Dv)
        rows.append(o.index_select(0, real[n:n + g.N]))  # (N_g, H, Dv)
        at, n = at + g.B * g.Lm, n + g.N
    if back is None:
        return rows[0]  # one group: the sequences in their order, its rows the tokens in order
    return torch.cat(rows).index_select(0, back)  # (Nq, H, Dv), token order


# --- when to pack: the plan and its cost model ---


@dataclass
class Packing:
    key_keep: Tensor  # (B, Lk) bool: the keys that are real
    query_keep: Tensor | None  # (B, Lq) bool, or None = every query row is computed
    rest: masks.Mask | None  # what remains to apply inside each sequence (positions preserved)
    reason: str


def could_pay(Lk: int, flop_per_token: float) -> bool:
    """Whether packing could pay at all: skipping even every one of Lk keys of a sequence saves
    more than the per-sequence loop costs (the cost model of :func:`packing_cost`)."""
    return Lk * flop_per_token > LOOP_COST_FLOP


def packing_cost(n_padded: int, B: int, flop_per_token: float) -> str | None:
    """The cost model: packing pays when the work it saves on padded tokens
    (``flop_per_token`` each: the projections) exceeds what the per-sequence loop costs
    (``B * LOOP_COST_FLOP``). Returns None when it pays, else why not."""
    saved, cost = n_padded * flop_per_token, B * LOOP_COST_FLOP
    if saved <= cost:
        return f"saves ~{saved / 1e6:.0f} MFLOP, less than the per-sequence loop costs (~{cost / 1e6:.0f} MFLOP)"
    return None


@functools.lru_cache(maxsize=256)
def _too_short(Lk: int, flop_per_token: float) -> str:
    """Why a call this short runs dense (made once per size: the small calls it explains are the ones
    whose time the formatting would show in)."""
    return (f"Lk={Lk}: skipping padded keys saves at most ~{Lk * flop_per_token / 1e6:.1f} MFLOP per sequence, "
            f"less than the per-sequence loop costs (~{LOOP_COST_FLOP / 1e6:.0f} MFLOP)")


def _prefix(keep: Tensor) -> bool:
    n = keep.sum(-1, keepdim=True)  # (B, 1)
    return bool((keep == (torch.arange(keep.shape[-1], device=keep.device) < n)).all())


def plan(mask: masks.Mask | None, B: int, Lq: int, Lk: int, device, *, flop_per_token: float = 0.0,
         force: bool = False) -> Packing | str:
    """A packing plan for ``mask``, or the reason the dense path runs instead
    (``force`` skips the cost model)."""
    if mask is None:
        return "no padding in the mask"
    if not force and not could_pay(Lk, flop_per_token):  # even all-padding could not pay for the loop
        return _too_short(Lk, flop_per_token)
    rest = []
    for p in mask.parts():
        if p.key_keep(Lk) is None and not p.packable:
            return f"{p!r} is applied densely"
        if p.key_keep(Lk) is None:
            rest.append(p)
    key_keep = mask.key_keep(Lk, device)
    if key_keep is None:
        return "no padding in the mask"
    query_keep = mask.query_keep(Lq, device)
    if rest and not _prefix(key_keep):
        return "the real keys are not a prefix of each sequence, and the mask depends on positions"
    if query_keep is not None and rest and not _prefix(query_keep):
        return "the real queries are not a prefix of each sequence, and the mask depends on positions"
    n_padded = key_keep.numel() - int(key_keep.sum())
    padded = n_padded / max(1, key_keep.numel())
    if not force and (why := packing_cost(n_padded, B, flop_per_token)) is not None:
        return f"{padded:.0%} of the keys are padding: skipping them {why}"
    rest_mask = None
    for r in rest:
        rest_mask = r if rest_mask is None else rest_mask & r
    return Packing(key_keep, query_keep, rest_mask, f"packing: {padded:.0%} of the keys are padding")


@dataclass
class Packed:
    """Where a module's packed tokens come from and go back to.

    q_idx: (Nq,) positions in (B*Lq), or None = every query row; k_idx: (Nk,) in (B*Lk);
    cu_q, cu_k: cumulative lengths as lists; rest: the mask applied inside each sequence;
    mask: the same attention as a mask over the padded batch (what observers are given)."""

    B: int
    Lq: int
    Lk: int
    q_idx: Tensor | None
    k_idx: Tensor
    cu_q: list[int]
    cu_k: list[int]
    rest: masks.Mask | None
    mask: masks.Mask | None
    reason: str = "packed"

    @classmethod
    def from_plan(cls, p: Packing, B: int, Lq: int, Lk: int, mask: masks.Mask) -> Packed:
        k_idx = p.key_keep.reshape(-1).nonzero().squeeze(1)  # (Nk,)
        k_lens = p.key_keep.sum(-1)  # (B,)
        if p.query_keep is None:
            q_idx, q_lens = None, [Lq] * B
        elif Lq == Lk and torch.equal(p.query_keep, p.key_keep):  # self-attention padding: the same tokens
            q_idx, q_lens = k_idx, k_lens.tolist()
        else:
            q_idx = p.query_keep.reshape(-1).nonzero().squeeze(1)  # (Nq,)
            q_lens = p.query_keep.sum(-1).tolist()
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + int(n))
        cu_k = [0]
        for n in k_lens.tolist():
            cu_k.append(cu_k[-1] + int(n))
        return cls(B, Lq, Lk, q_idx, k_idx, cu, cu_k, p.rest, mask, p.reason)

    @classmethod
    def self_attention(cls, cu_seqlens: Tensor, max_seqlen: int) -> Packed:
        """Packed self-attention tokens (queries = keys) described by ``cu_seqlens`` (B+1,), which
        must start at 0 and never decrease; ``max_seqlen``, the width of the padded layout the tokens
        come from, must be at least the longest sequence's length (checked: a smaller value would
        misplace tokens)."""
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or \
                cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be a 1-D integer tensor (B+1,) of cumulative lengths; got "
                            f"{type(cu_seqlens).__name__} {tuple(getattr(cu_seqlens, 'shape', ()))}.")
        cu = cu_seqlens.tolist()
        lens_l = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        if cu[0] != 0 or min(lens_l) < 0:
            raise ValueError(f"cu_seqlens must start at 0 and never decrease; got {cu}.")
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < max(lens_l):
            raise ValueError(f"max_seqlen must be at least the longest sequence's length, {max(lens_l)} for "
                             f"cu_seqlens {cu}; got {max_seqlen!r}.")
        idx = indices_of(cu_seqlens, max_seqlen)
        lens = cu_seqlens[1:] - cu_seqlens[:-1]  # (B,)
        return cls(len(cu) - 1, max_seqlen, max_seqlen, idx, idx, cu, cu, None, masks.Padding(lens.long()))

    def gather(self, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, Lq, ·), (B, Lk, ·), (B, Lk, ·) -> the packed (Nq, ·), (Nk, ·), (Nk, ·)."""
        B, Lq, Lk = self.B, self.Lq, self.Lk
        k = keys.reshape(B * Lk, -1).index_select(0, self.k_idx)  # (B, Lk, E) -> (Nk, E)
        v = k if values is keys else values.reshape(B * Lk, -1).index_select(0, self.k_idx)  # (Nk, E)
        if self.q_idx is None:
            q = queries.reshape(B * Lq, -1)  # (B, Lq, E) -> (B*Lq, E)
        elif queries is keys and self.q_idx is self.k_idx:
            q = k
        else:
            q = queries.reshape(B * Lq, -1).index_select(0, self.q_idx)  # (Nq, E)
        return q, k, v

    def scatter(self, out: Tensor) -> Tensor:
        """(Nq, F) -> (B, Lq, F); padded query rows are zeros."""
        if self.q_idx is None:
            return out.view(self.B, self.Lq, out.shape[-1])  # (B*Lq, F) -> (B, Lq, F)
        return pad(out, self.q_idx, self.B, self.Lq)

    def padded(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Packed q (Nq, H, D), k (Nk, Hkv, D) back in the batch's layout, (B, H, Lq, D) and
        (B, Hkv, Lk, D), zeros at padding: what an observer of the weights sees."""
        qp = q.view(self.B, self.Lq, *q.shape[1:]) if self.q_idx is None else pad(q, self.q_idx, self.B, self.Lq)
        kp = pad(k, self.k_idx, self.B, self.Lk)
        return qp.transpose(1, 2), kp.transpose(1, 2)  # (B, L, h, D) -> (B, h, L, D)
