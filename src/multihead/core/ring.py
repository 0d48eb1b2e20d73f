"""Context parallelism: attention over a sequence sharded across processes.

When a sequence's keys and values no longer fit one device, every process (rank)
holds a shard of the sequence, and key/value blocks travel between the ranks while
each rank computes its queries' attention block by block; the partial results are
merged exactly with their log-sum-exp (ring attention). Everything here runs on
``torch.distributed``'s public API (process groups, ``isend``/``irecv``), launched as
PyTorch users launch anything (``torchrun``); all communication lives in this file.

Shape letters: B batch, H query heads, Hkv key/value heads, Lq/Lk the *local* query/key
lengths (one shard), D query/key head size, Dv value head size, N the group's size.

Layouts: how the global positions 0..L-1 are dealt out to the N ranks.

- ``"contiguous"``: rank r holds positions [r L/N, (r+1) L/N). L must be a multiple of N.
- ``"zigzag"``: the sequence is cut into 2N chunks; rank r holds chunks r and 2N-1-r, so
  under a causal mask every rank has the same work (the early chunk sees little, the
  late one much). L must be a multiple of 2N.

Conventions on sharded inputs: every per-token tensor is the local shard (queries,
keys, values, a :class:`~multihead.masks.KeyPadding` mask (B, Lk), per-query lengths
``ValidLens`` (B, Lq)) and is sharded with the same layout; per-sequence values are
global (``ValidLens``/``Padding`` lengths (B,) count global positions). A length L not
divisible by N (2N for zigzag) is refused with the fix: pad the sequence and mask the
padded keys (``ValidLens(lengths)``), see :func:`shard`.

The schedule (step s = 1..N-1): rank r sends its own key/value block to rank r+s and
receives rank r-s's, piece by piece (a piece is a few hundred positions, so at most two
pieces are in flight and memory stays near 1/N of one process's), computing on one
piece while the next travels. Every rank derives from positions alone which pieces
its queries can see: a piece no query of the receiver can see (causal, outside a
sliding window, past every valid length) is neither sent nor computed. The backward
pass sends each piece's key/value gradients back to its owner (rather than
recomputing the forward: one pass over the pieces instead of two).
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from multihead import masks
from multihead.core import validation
from multihead.masks import Mask

__all__ = [
    "LAYOUTS",
    "TIMEOUT_S",
    "RingStats",
    "Sharded",
    "context_parallel",
    "explain",
    "gather",
    "last_stats",
    "local_positions",
    "ring_attention",
    "shard",
]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")

#: bytes one piece of keys+values, or one (rows x piece) block of scores, may take: bounds the
#: memory the ring adds to a rank's shard (a handful of these are alive at once)
BUDGET_BYTES = 1 << 20

#: seconds the example and the tests give a collective before a hung rank is an error
TIMEOUT_S = 60


# --- groups, layouts, positions -------------------------------------------------------


def _world(group) -> tuple[int, int]:
    """(N, this rank's index in the group)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) first "
            "(torchrun sets up the environment; see examples/long_context)."
        )
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}.")


def _multiple(N: int, layout: str) -> int:
    """What a global length must be a multiple of."""
    return N if layout == "contiguous" else 2 * N


def _segments(n: int, rank: int, N: int, layout: str) -> tuple[tuple[int, int, int], ...]:
    """The runs of consecutive global positions rank ``rank`` holds, for n local positions:
    (local start, global start, length) each."""
    if layout == "contiguous":
        return ((0, rank * n, n),)
    c = n // 2
    return ((0, rank * c, c), (c, (2 * N - 1 - rank) * c, c))


def local_positions(n: int, group=None, *, layout: Layout = "contiguous", device=None) -> Tensor:
    """The global positions (n,) of this rank's n local positions (e.g. for positional encodings)."""
    _check_layout(layout)
    N, rank = _world(group)
    parts = [torch.arange(g, g + ln, device=device) for _, g, ln in _segments(n, rank, N, layout)]
    return torch.cat(parts)  # (n,)


def _length_error(what: str, L: int, N: int, layout: str) -> str:
    m = _multiple(N, layout)
    pad = -L % m
    return (
        f"{what} has length {L}, which the {layout!r} layout cannot split over N={N} ranks (it needs a multiple "
        f"of {m}). Pad the sequence by {pad} positions (e.g. torch.nn.functional.pad) and mask the padded keys "
        f"with ValidLens(lengths) (a causal mask alone already hides keys after the last real query)."
    )


def shard(x: Tensor, group=None, *, dim: int = 1, layout: Layout = "contiguous") -> Tensor:
    """This rank's shard of ``x`` (the whole tensor, the same on every rank) along ``dim``
    (the sequence: dim 1 of (B, L, ...), dim 2 of (B, H, L, D)). Returns a new contiguous
    tensor, so the whole one can be freed. No communication."""
    _check_layout(layout)
    N, rank = _world(group)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}.")
    dim = dim % x.dim()
    L = x.shape[dim]
    if L % _multiple(N, layout):
        raise ValueError(_length_error(f"x (shape {tuple(x.shape)}, dim={dim})", L, N, layout))
    parts = [x.narrow(dim, g, ln) for _, g, ln in _segments(L // N, rank, N, layout)]
    return torch.cat(parts, dim).contiguous() if len(parts) > 1 else parts[0].contiguous()


def gather(x: Tensor, group=None, *, dim: int = 1, layout: Layout = "contiguous") -> Tensor:
    """The whole tensor from every rank's shard (the inverse of :func:`shard`), on every
    rank. Every rank must hold a shard of the same shape (checked first: no rank hangs).
    Not differentiable (use it on outputs and gradients)."""
    _check_layout(layout)
    N, rank = _world(group)
    dim = dim % x.dim()
    _agree(group, x.device, None, list(x.shape), what=f"gather of shape {tuple(x.shape)}",
           names=[f"dim {i}" for i in range(x.dim())])
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(N)]
    dist.all_gather(parts, x.contiguous(), group=group)
    n = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = n * N
    out = x.new_empty(shape)
    for r, part in enumerate(parts):
        for ls, g, ln in _segments(n, r, N, layout):
            out.narrow(dim, g, ln).copy_(part.narrow(dim, ls, ln))
    return out


def _agree(group, device, error: str | None, meta: list[int], *, what: str, names: list[str]) -> None:
    """Every rank's input check, before any other communication: each rank sends whether its
    inputs passed and a few integers (its shapes) in one all-gather; every rank then raises the
    same clear error if any rank failed or the shapes differ, so no rank is left waiting."""
    N, rank = _world(group)
    mine = torch.tensor([0 if error else 1, *meta], dtype=torch.int64, device=device)  # (1 + len(meta),)
    got = [torch.empty_like(mine) for _ in range(N)]
    dist.all_gather(got, mine, group=group)
    rows = [t.tolist() for t in got]
    if error:
        raise ValueError(error)
    bad = [r for r, row in enumerate(rows) if row[0] == 0]
    if bad:
        raise ValueError(
            f"{what}: rank(s) {bad} of {N} rejected their inputs (their errors say why); nothing was sent."
        )
    if any(row[1:] != rows[0][1:] for row in rows):
        listing = "; ".join(f"rank {r}: " + ", ".join(f"{n}={v}" for n, v in zip(names, row[1:]))
                            for r, row in enumerate(rows))
        raise ValueError(
            f"{what}: the ranks' inputs disagree ({listing}). Every rank must hold an equal shard of the same "
            "global sequence (multihead.distributed.shard splits evenly), with the same kinds of mask and the same "
            "layout; nothing was sent."
        )


# --- masks on shards -------------------------------------------------------------------


@dataclass(frozen=True)
class _ShardMask:
    """A mask taken apart for blocks of global positions: the band of its diagonal parts (Causal,
    SlidingWindow), which decides which blocks are skipped or cut, and every other part made whole
    (over the global sequence) and applied through its own ``mask_mod(b, h, q_idx, kv_idx)``."""

    band: tuple[float, float] | None = None
    rest: Mask | None = None  # the other parts over the whole sequence (global positions)
    key_limit: int | None = None  # no key at a global position >= this is visible (from lengths known on the host)

_SHARDABLE = "Causal, SlidingWindow, ValidLens ((B,) global lengths or (B, Lq) local shard), Padding, KeyPadding"


def _mask_error(mask: Mask | None) -> str | None:
    for p in (mask.parts() if mask is not None else ()):
        if type(p) not in (masks.Causal, masks.SlidingWindow, masks.ValidLens, masks.Padding, masks.KeyPadding):
            return (f"mask {p!r} cannot be sharded over the sequence: a {type(p).__name__} mask names (query, key) "
                    f"pairs of the whole sequence. Context parallel runs {_SHARDABLE} and their `&`; compute other "
                    "masks without context parallel.")
    return None


def _local_checks(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, *, scale, N: int, layout: str) -> str | None:
    """This rank's input checks (no communication): the message of the first that fails."""
    try:
        validation.attention_inputs(q, k, v, None, scale=scale)
        B, H, Lq, _ = q.shape
        Lk = k.shape[2]
        for name, n in (("query", Lq), ("key", Lk)):
            if (n * N) % _multiple(N, layout) or n == 0:
                return (f"the local {name} shard has length {n}: with the {layout!r} layout over N={N} ranks a "
                        f"shard must hold a positive multiple of {_multiple(N, layout) // N} positions. "
                        + _length_error("the global sequence", n * N, N, layout))
        err = _mask_error(mask)
        if err:
            return err
        for p in (mask.parts() if mask is not None else ()):
            if type(p) is masks.KeyPadding:
                p.validate(B, H, Lq, Lk, q.device)  # the local shard (B, Lk)
            elif type(p) is masks.Padding:
                if Lq != Lk:
                    return f"Padding is for self-attention (Lq == Lk); got local Lq={Lq}, Lk={Lk}."
                p.validate(B, H, Lq * N, Lk * N, q.device)
            elif type(p) is masks.ValidLens:
                p.validate(B, H, Lq, Lk * N, q.device)  # (B, Lq) is the local shard; lengths count global keys
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _lengths_digest(mask: Mask | None) -> int:
    """A number that differs when the global (B,) lengths of ValidLens/Padding differ between ranks."""
    out = 0
    for p in (mask.parts() if mask is not None else ()):
        if isinstance(p, masks.ValidLens) and p.lens.dim() == 1 and p.lens.numel():
            lens = p.lens.to(torch.int64)
            w = torch.arange(1, lens.numel() + 1, device=lens.device)  # (B,)
            out = (out * 1_000_003 + int((lens * w).sum()) + 7 * int(lens.sum())) % (1 << 61)
    return out


def _shard_mask(mask: Mask | None, group, layout: str, Lq: int, Lk: int, N: int) -> _ShardMask:
    """The mask over the whole sequence: per-sequence lengths as they are (global already), the
    sharded parts (KeyPadding (B, Lk), ValidLens (B, Lq)) gathered from every rank (collective)."""
    if mask is None:
        return _ShardMask()
    parts = mask.parts()
    diag = [p for p in parts if isinstance(p, (masks.Causal, masks.SlidingWindow))]
    band = masks.And(tuple(diag)).band(Lq * N, Lk * N) if diag else None
    rest, limit = [], None
    for p in parts:
        if type(p) is masks.KeyPadding:  # uint8: every communication backend carries it
            rest.append(masks.KeyPadding(gather(p.keep_mask.to(torch.uint8), group, layout=layout).bool()))
        elif type(p) is masks.ValidLens and p.lens.dim() == 2:
            rest.append(masks.ValidLens(gather(p.lens, group, layout=layout)))  # (B, Lq) -> (B, N*Lq)
        elif isinstance(p, masks.ValidLens):  # (B,) global lengths, the same on every rank
            rest.append(p)
            known = p.__dict__.get("_max")  # (version, maximum length), read on the host when the mask was built
            if known is not None and known[0] == masks.stamp(p.lens):
                limit = known[1] if limit is None else min(limit, known[1])
    return _ShardMask(band, None if not rest else rest[0] if len(rest) == 1 else masks.And(tuple(rest)), limit)


# --- the plan: which (query tile, key piece) blocks each rank computes ------------------


@dataclass(frozen=True)
class _Plan:
    """Host-side schedule, the same on every rank (positions only, no tensor values).

    segments[r]: rank r's runs of global query positions; tiles[r]: rank r's query tiles, and
    pieces[r]: rank r's key pieces, each (local start, global start, length). A block (tile, piece)
    is of kind 0 (nothing visible: skipped), 1 (every pair visible as far as the band goes) or 2
    (the band cuts it); ``kinds`` holds this rank's blocks, others are worked out when asked."""

    N: int
    rank: int
    layout: str
    Lq: int
    Lk: int
    segments: tuple
    tiles: tuple
    pieces: tuple
    band: tuple[float, float] | None
    key_limit: int | None
    kinds: dict = field(compare=False, hash=False)
    _needed: dict = field(compare=False, hash=False, default_factory=dict)

    def kind(self, r: int, t: int, owner: int, p: int) -> int:
        if r == self.rank:
            return self.kinds[t, owner, p]
        return _kind(self.tiles[r][t], self.pieces[owner][p], self.band, self.key_limit)

    def needs(self, receiver: int, owner: int, p: int) -> bool:
        """Whether any query of ``receiver`` can see piece p of ``owner``'s keys (its whole runs of
        positions are checked: the tiles cut them, so this is the same as any tile seeing it)."""
        key = (receiver, owner, p)
        if key not in self._needed:
            piece = self.pieces[owner][p]
            self._needed[key] = any(_kind(seg, piece, self.band, self.key_limit) for seg in self.segments[receiver])
        return self._needed[key]


def _split(n: int, segs, size: int):
    """Cut each segment into runs of at most ``size`` positions."""
    out = []
    for ls, g, ln in segs:
        for a in range(0, ln, size):
            out.append((ls + a, g + a, min(size, ln - a)))
    return tuple(out)


def _kind(q: tuple[int, int, int], k: tuple[int, int, int], band, key_limit) -> int:
    _, qa, qn = q
    _, ka, kn = k
    if key_limit is not None and ka >= key_limit:
        return 0
    if band is None:
        return 1
    return masks.band_block(*band, qa, qn, ka, kn)


class _Grid(NamedTuple):
    """Where this rank's shards sit and how they are cut: N ranks, this one ``rank``, the ``layout``, local
    lengths Lq and Lk, query tiles of ``rows`` and key pieces of ``piece`` positions."""

    N: int
    rank: int
    layout: str
    Lq: int
    Lk: int
    rows: int
    piece: int


@lru_cache(maxsize=64)
def _plan(grid: _Grid, band, key_limit) -> _Plan:
    N, rank, layout, Lq, Lk, rows, piece = grid
    segments = tuple(_segments(Lq, r, N, layout) for r in range(N))
    tiles = tuple(_split(Lq, segments[r], rows) for r in range(N))
    pieces = tuple(_split(Lk, _segments(Lk, r, N, layout), piece) for r in range(N))
    kinds = {(t, o, p): _kind(tq, kp, band, key_limit)  # this rank's blocks: N * tiles * pieces entries
             for t, tq in enumerate(tiles[rank]) for o in range(N) for p, kp in enumerate(pieces[o])}
    return _Plan(N, rank, layout, Lq, Lk, segments, tiles, pieces, band, key_limit, kinds)


def _sizes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    """(query rows per tile, keys per piece) within :data:`BUDGET_BYTES`, for q (B, H, Lq, D), k (B, Hkv, Lk, D),
    v (B, Hkv, Lk, Dv)."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv, itemsize = k.shape[1], k.shape[2], v.shape[-1], q.element_size()
    piece = max(16, BUDGET_BYTES // max(1, B * Hkv * (D + Dv) * itemsize))
    rows = max(16, BUDGET_BYTES // max(1, B * H * min(piece, Lk) * 4))
    return min(rows, Lq), min(piece, Lk)


# --- the block computation ---------------------------------------------------------------


def _block_keep(sm: _ShardMask, kind: int, q: tuple, k: tuple, plan: _Plan, device) -> Tensor | None:
    """Bool keep mask broadcastable to (B, Hkv, g, rows, keys) for one block of global positions
    (whole sequence: N*Lq x N*Lk), or None (all kept)."""
    Lq, Lk = plan.N * plan.Lq, plan.N * plan.Lk
    _, qg, qn = q
    _, kg, kn = k
    i = torch.arange(qg, qg + qn, device=device)[:, None]  # (rows, 1) global query positions
    j = torch.arange(kg, kg + kn, device=device)[None, :]  # (1, keys) global key positions
    keep = None
    if kind == 2:
        keep = masks.band_keep(*sm.band, i, j)  # (rows, keys)
    if sm.rest is not None:
        b = torch.arange(sm.rest.batch_size, device=device)[:, None, None]  # (B, 1, 1)
        r = sm.rest.mask_mod(Lq, Lk, device)(b, 0, i[None], j[None])  # (B, rows|1, keys)
        keep = r[:, None, None] if keep is None else keep & r[:, None, None]  # (B, 1, 1, rows|1, keys)
    return keep


def _scores(qt: Tensor, kp: Tensor, scale: float, keep: Tensor | None, g: int) -> Tensor:
    """qt (B, Hkv, g*rows, D), kp (B, Hkv, keys, D) -> masked scores (B, Hkv, g*rows, keys)."""
    s = torch.matmul(qt, kp.transpose(-1, -2)).mul_(scale)  # (B, Hkv, g*rows, keys)
    if keep is not None:
        B, Hkv, gr, n = s.shape
        s.view(B, Hkv, g, gr // g, n).masked_fill_(~keep, -math.inf)  # keep broadcasts over (B, Hkv, g, rows, n)
    return s


def _finite(x: Tensor) -> Tensor:
    """-inf (a row with nothing visible) -> 0, so exp(score - x) is 0 rather than NaN."""
    return x.masked_fill(x == -math.inf, 0.0)


def _merge(acc_o: Tensor, acc_l: Tensor, o: Tensor, lse: Tensor) -> None:
    """Fold a block's normalized output o (.., rows, Dv) and log-sum-exp lse (.., rows) into the
    running ones, in place: exact (softmax over the union of the blocks' keys)."""
    new = torch.logaddexp(acc_l, lse)  # (.., rows)
    safe = _finite(new)
    a = (acc_l - safe).exp_()[..., None]  # (.., rows, 1): 0 for a row nothing has reached yet
    b = (lse - safe).exp_()[..., None]
    acc_o.mul_(a).add_(o * b)
    acc_l.copy_(new)


@dataclass
class RingStats:
    """What the last ring call did on this rank: score entries computed (B*H*rows*keys summed
    over the blocks), pieces and bytes sent, and seconds spent computing and waiting for
    communication (waits that overlap nothing)."""

    entries: int = 0
    pieces_sent: int = 0
    bytes_sent: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0

    @property
    def comm_share(self) -> float:
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total else 0.0


_LAST = {"fwd": RingStats(), "bwd": RingStats()}


def last_stats(which: str = "fwd") -> RingStats:
    """:class:`RingStats` of this rank's last ring forward (``"fwd"``) or backward (``"bwd"``)."""
    return _LAST[which]


class _Wire:
    """Point-to-point traffic of one ring pass: ops posted per tick in one batch, waits timed."""

    def __init__(self, group, stats: RingStats):
        self.group, self.stats = dist.group.WORLD if group is None else group, stats
        self.nccl = dist.get_backend(group) == "nccl"
        self.sends: list = []  # (work, buffer) in flight

    def post(self, sends: list[tuple[Tensor, int, int]], recvs: list[tuple[Tensor, int, int]]) -> list:
        """sends/recvs: (tensor, peer's index in the group, tag). Returns the recvs' works."""
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(self.group, p), self.group, tag) for t, p, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(self.group, p), self.group, tag) for t, p, tag in recvs]
        if not ops:
            return []
        if self.nccl:  # NCCL: the tick's sends and receives as one group (no pairwise ordering deadlock)
            works = dist.batch_isend_irecv(ops)
        else:
            works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        for (t, _, _), w in zip(sends, works):
            self.sends.append((w, t))
            self.stats.pieces_sent += 1
            self.stats.bytes_sent += t.numel() * t.element_size()
        return works[len(sends):]

    def wait(self, works) -> None:
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.stats.wait_s += time.perf_counter() - t0

    def settle(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` sends are in flight (their buffers may then be freed)."""
        while len(self.sends) > keep:
            self.wait([self.sends.pop(0)[0]])


def _tile(x: Tensor, g: int, rows: tuple) -> Tensor:
    """(B, H, Lq, ·) viewed (B, Hkv, g, Lq, ·) -> the tile's rows (B, Hkv, g*rows, ·)."""
    B, H, Lq, d = x.shape
    ls, _, n = rows
    return x.view(B, H // g, g, Lq, d)[:, :, :, ls:ls + n].reshape(B, H // g, g * n, d)  # (B, Hkv, g*rows, ·)


def _rows(x: Tensor, g: int, rows: tuple) -> Tensor:
    """(B, H, Lq) viewed (B, Hkv, g, Lq) -> the tile's rows (B, Hkv, g*rows)."""
    B, H, Lq = x.shape
    ls, _, n = rows
    return x.view(B, H // g, g, Lq)[:, :, :, ls:ls + n].reshape(B, H // g, g * n)  # (B, Hkv, g*rows)


@dataclass(frozen=True)
class _Call:
    group: object
    plan: _Plan
    sm: _ShardMask
    scale: float
    g: int
    D: int


def _ring_forward(c: _Call, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) -> out (B, H, Lq, Dv) in the
    accumulation dtype, lse (B, H, Lq) float."""
    plan, sm, g = c.plan, c.sm, c.g
    rank = dist.get_rank(c.group)
    stats = RingStats()
    _LAST["fwd"] = stats
    B, H, Lq, D = q.shape
    Dv = v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(B, H, Lq, Dv, dtype=acc, device=q.device)
    lse = torch.full((B, H, Lq), -math.inf, dtype=acc, device=q.device)
    out5 = out.view(B, H // g, g, Lq, Dv)  # (B, Hkv, g, Lq, Dv)
    lse4 = lse.view(B, H // g, g, Lq)  # (B, Hkv, g, Lq)
    pieces = plan.pieces
    wire = _Wire(c.group, stats)

    def compute(owner: int, p: int, kp: Tensor, vp: Tensor) -> None:
        t0 = time.perf_counter()
        for t, rows in enumerate(plan.tiles[rank]):
            kind = plan.kinds[t, owner, p]
            if not kind:
                continue
            keep = _block_keep(sm, kind, rows, pieces[owner][p], plan, q.device)
            s = _scores(_tile(q, g, rows).to(acc), kp.to(acc), c.scale, keep, g)  # (B, Hkv, g*rows, keys)
            m = torch.logsumexp(s, -1)  # (B, Hkv, g*rows)
            pr = s.sub_(_finite(m)[..., None]).exp_()  # the block's own softmax
            o = torch.matmul(pr, vp.to(acc))  # (B, Hkv, g*rows, Dv)
            ls, _, n = rows
            _merge(out5[:, :, :, ls:ls + n], lse4[:, :, :, ls:ls + n],
                   o.view(B, H // g, g, n, Dv), m.view(B, H // g, g, n))
            stats.entries += B * H * n * pieces[owner][p][2]
        stats.compute_s += time.perf_counter() - t0

    def own() -> None:  # step 0: the own block, while the first pieces travel
        for p, (ls, _, n) in enumerate(pieces[rank]):
            compute(rank, p, k[:, :, ls:ls + n], v[:, :, ls:ls + n])

    _exchange(c, _Traffic(wire, plan, rank, k, v), compute, own)
    wire.settle(0)
    return out, lse


@lru_cache(maxsize=64)
def _schedule(plan: _Plan) -> tuple[tuple[int, int], ...]:
    """Every rank's ticks, in one order all ranks share: (step s, piece index p) for s = 1..N-1
    and every piece index, skipping those no rank sends."""
    N = plan.N
    return tuple((s, p) for s in range(1, N) for p in range(len(plan.pieces[0]))
                 if any(plan.needs((o + s) % N, o, p) for o in range(N)))


def _kv_piece(k: Tensor, v: Tensor, piece: tuple) -> Tensor:
    """This rank's keys and values at one piece, side by side: (B, Hkv, keys, D + Dv), contiguous."""
    ls, _, n = piece
    return torch.cat([k[:, :, ls:ls + n], v[:, :, ls:ls + n]], -1)


class _Traffic:
    """This rank's key/value traffic around the ring: at tick (s, p) of the shared schedule, rank r sends its
    piece p to r+s when that rank needs it and receives piece p of r-s when it needs it."""

    def __init__(self, wire: _Wire, plan: _Plan, rank: int, k: Tensor, v: Tensor):
        self.wire, self.plan, self.rank, self.k, self.v = wire, plan, rank, k, v
        self.ticks = _schedule(plan)

    def post(self, i: int, in_flight: int):
        """Post tick i's traffic: this rank's piece to rank+s if it needs it (once at most ``in_flight``
        earlier sends are still under way), and a buffer for rank-s's piece if this rank needs it.
        Returns (the receive's works, the buffer (B, Hkv, keys, D+Dv) or None), or None past the last tick."""
        if i >= len(self.ticks):
            return None
        s, p = self.ticks[i]
        plan, rank, k, v, pieces = self.plan, self.rank, self.k, self.v, self.plan.pieces
        dst, src = (rank + s) % plan.N, (rank - s) % plan.N
        sends, recvs, buf = [], [], None
        if plan.needs(dst, rank, p):
            self.wire.settle(in_flight)
            sends.append((_kv_piece(k, v, pieces[rank][p]), dst, _tag(0, s, p, plan)))
        if plan.needs(rank, src, p):
            buf = k.new_empty(k.shape[0], k.shape[1], pieces[src][p][2], k.shape[-1] + v.shape[-1])  # (B, Hkv, keys, D+Dv)
            recvs.append((buf, src, _tag(0, s, p, plan)))
        return self.wire.post(sends, recvs), buf


def _exchange(c: _Call, traffic: _Traffic, compute, own) -> None:
    """Steps 1..N-1 of the forward: each tick's piece computed once it arrives; the next tick's transfers
    are posted before this tick's piece is computed, and at most two sends are in flight. ``own()``
    computes the own block once the first transfers are on their way."""
    N, D, rank = c.plan.N, c.D, traffic.rank
    nxt = traffic.post(0, in_flight=1)
    own()
    for i, (s, p) in enumerate(traffic.ticks):
        works, buf = nxt
        nxt = traffic.post(i + 1, in_flight=1)
        if buf is not None:
            traffic.wire.wait(works)
            compute((rank - s) % N, p, buf[..., :D], buf[..., D:])
    traffic.wire.settle(0)


def _tag(kind: int, s: int, p: int, plan: _Plan) -> int:
    """A distinct tag per message kind (0 keys/values, 1 their gradients), step and piece."""
    return (kind * plan.N + s) * len(plan.pieces[0]) + p


class _Backward:
    """One rank's queries in the ring backward: their output gradient, the row statistics
    (log-sum-exp, rowsum(dO * O)) and dq, accumulated in float32 or wider."""

    def __init__(self, c: _Call, q: Tensor, out: Tensor, lse: Tensor, dout: Tensor, stats: RingStats):
        self.c, self.q, self.stats = c, q, stats
        self.rank = dist.get_rank(c.group)
        B, H, Lq, D = q.shape
        self.acc = acc = torch.promote_types(q.dtype, torch.float32)
        self.dq = torch.zeros(B, H, Lq, D, dtype=acc, device=q.device)
        self.dq5 = self.dq.view(B, H // c.g, c.g, Lq, D)  # (B, Hkv, g, Lq, D)
        self.dout = dout.to(acc)
        self.delta = (self.dout * out.to(acc)).sum(-1)  # (B, H, Lq): rowsum(dO * O)
        self.lse = _finite(lse.to(acc))  # (B, H, Lq)

    def add(self, owner: int, p: int, kp: Tensor, vp: Tensor, dkp: Tensor, dvp: Tensor) -> None:
        """Add this rank's queries' gradient contributions for one key piece (kp (B, Hkv, keys, D),
        vp (.., Dv)) into dq, dkp and dvp."""
        c, q, plan, g, acc = self.c, self.q, self.c.plan, self.c.g, self.acc
        B, H, _, D = q.shape
        Hkv = H // g
        t0 = time.perf_counter()
        kp, vp = kp.to(acc), vp.to(acc)
        for t, rows in enumerate(plan.tiles[self.rank]):
            kind = plan.kinds[t, owner, p]
            if not kind:
                continue
            keep = _block_keep(c.sm, kind, rows, plan.pieces[owner][p], plan, q.device)
            qt, dot = _tile(q, g, rows).to(acc), _tile(self.dout, g, rows)  # (B, Hkv, g*rows, D), (.., Dv)
            pr = _scores(qt, kp, c.scale, keep, g)  # (B, Hkv, g*rows, keys)
            pr = pr.sub_(_rows(self.lse, g, rows)[..., None]).exp_()  # the final softmax's weights on these keys
            dvp.add_(torch.matmul(pr.transpose(-1, -2), dot))  # (B, Hkv, keys, Dv), summed over the g heads
            ds = torch.matmul(dot, vp.transpose(-1, -2))  # dP (B, Hkv, g*rows, keys)
            ds = ds.sub_(_rows(self.delta, g, rows)[..., None]).mul_(pr).mul_(c.scale)  # dS * scale
            ls, _, n = rows
            self.dq5[:, :, :, ls:ls + n].add_(torch.matmul(ds, kp).view(B, Hkv, g, n, D))
            dkp.add_(torch.matmul(ds.transpose(-1, -2), qt))  # (B, Hkv, keys, D)
            self.stats.entries += B * H * n * plan.pieces[owner][p][2]
        self.stats.compute_s += time.perf_counter() - t0


def _ring_backward(c: _Call, saved: tuple[Tensor, ...], dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of the ring forward, given what it saved (q, k, v, its output and log-sum-exp).
    Each piece's key/value gradients are summed where the piece was used and sent back to its owner."""
    q, k, v, out, lse = saved
    plan, D = c.plan, c.D
    N, rank = plan.N, dist.get_rank(c.group)
    stats = RingStats()
    _LAST["bwd"] = stats
    B, Hkv, Dv = q.shape[0], k.shape[1], v.shape[-1]
    bw = _Backward(c, q, out, lse, dout, stats)
    acc, compute = bw.acc, bw.add
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)  # (B, Hkv, Lk, D)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)  # (B, Hkv, Lk, Dv)
    pieces = plan.pieces
    wire = _Wire(c.group, stats)

    traffic = _Traffic(wire, plan, rank, k, v)
    width = D + Dv
    pending = None  # (works, buffer, piece) of the gradients coming back for one of this rank's pieces
    nxt = traffic.post(0, in_flight=3)
    for p, (ls, _, n) in enumerate(pieces[rank]):  # step 0: the own block, while the first pieces travel
        compute(rank, p, k[:, :, ls:ls + n], v[:, :, ls:ls + n], dk[:, :, ls:ls + n], dv[:, :, ls:ls + n])
    for i, (s, p) in enumerate(traffic.ticks):
        works, buf = nxt
        nxt = traffic.post(i + 1, in_flight=3)
        dst, src = (rank + s) % N, (rank - s) % N
        sends, recvs, back = [], [], None
        if buf is not None:
            wire.wait(works)
            grad = torch.zeros(B, Hkv, buf.shape[2], width, dtype=acc, device=q.device)  # (B, Hkv, keys, D+Dv)
            compute(src, p, buf[..., :D], buf[..., D:], grad[..., :D], grad[..., D:])
            sends.append((grad, src, _tag(1, s, p, plan)))
        if plan.needs(dst, rank, p):
            back = torch.empty(B, Hkv, pieces[rank][p][2], width, dtype=acc, device=q.device)
            recvs.append((back, dst, _tag(1, s, p, plan)))
        got = wire.post(sends, recvs)
        if pending is not None:
            _add_back(wire, pending, dk, dv, D)
        pending = (got, back, pieces[rank][p]) if back is not None else None
    if pending is not None:
        _add_back(wire, pending, dk, dv, D)
    wire.settle(0)
    return bw.dq, dk, dv


def _add_back(wire: _Wire, pending, dk: Tensor, dv: Tensor, D: int) -> None:
    works, back, piece = pending
    wire.wait(works)
    ls, _, n = piece
    dk[:, :, ls:ls + n].add_(back[..., :D])
    dv[:, :, ls:ls + n].add_(back[..., D:])


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        out, lse = _ring_forward(call, q, k, v)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _ = saved = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.call, saved, dout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# --- the public entry points -----------------------------------------------------------------


def _prepare(q: Tensor, k: Tensor, v: Tensor, mask, *, group, layout: str, scale) -> _Call | None:
    """Validate on every rank, agree, and build the call (None: a group of one, run locally)."""
    _check_layout(layout)
    N, _ = _world(group)
    if N == 1:  # run locally: multihead.attention checks its inputs and takes every mask it knows
        return None
    mask = masks.as_mask(mask)
    tensors = isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    error = _local_checks(q, k, v, mask, scale=scale, N=N, layout=layout) if tensors \
        else "query, key and value must be torch.Tensors (B, H, L, D)."
    device = q.device if isinstance(q, Tensor) else torch.device("cpu")
    shapes = [*q.shape, *k.shape, v.shape[-1]] if error is None else [0] * 9
    kinds = [zlib.crc32(" & ".join(type(p).__name__ for p in mask.parts()).encode())] if mask is not None else [0]
    _agree(group, device, error, shapes + kinds + [_lengths_digest(mask) if error is None else 0,
                                                   LAYOUTS.index(layout)],
           what="ring_attention",
           names=["B", "H", "Lq", "D", "key B", "Hkv", "Lk", "key D", "Dv", "mask kinds", "global lengths digest",
                  "layout"])
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    sm = _shard_mask(mask, group, layout, Lq, Lk, N)
    rows, piece = _sizes(q, k, v)
    piece = min(piece, Lk if layout == "contiguous" else Lk // 2)
    rows = min(rows, Lq if layout == "contiguous" else Lq // 2)
    plan = _plan(_Grid(N, dist.get_rank(group), layout, Lq, Lk, rows, piece), sm.band, sm.key_limit)
    return _Call(group, plan, sm, 1.0 / math.sqrt(D) if scale is None else float(scale), H // Hkv, D)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, mask=None, *, group=None, layout: Layout = "contiguous",
                   scale: float | None = None) -> Tensor:
    """Attention of this rank's queries over the whole sharded sequence.

    Args:
        q: (B, H, Lq, D), this rank's shard of the queries.
        k: (B, Hkv, Lk, D), this rank's shard of the keys (H a multiple of Hkv).
        v: (B, Hkv, Lk, Dv), this rank's shard of the values.
        mask: None, Causal, SlidingWindow (both alignments; positions are global), ValidLens
            ((B,) global lengths, or (B, Lq) this rank's shard of per-query lengths), Padding
            ((B,) global lengths, self-attention), KeyPadding ((B, Lk) this rank's shard), or
            their ``&``. Other masks name pairs of the whole sequence and are refused.
        group: the process group (default: the whole world). A group of one runs
            :func:`multihead.attention` locally (see :func:`explain`).
        layout: "contiguous" or "zigzag" (how the shards were cut; see :func:`shard`).
        scale: multiplies the scores; default 1/sqrt(D).

    Returns:
        (B, H, Lq, Dv), this rank's queries' outputs; a query with nothing to attend to gives
        zeros. Differentiable (the backward pass communicates too).

    Every rank checks its inputs and the ranks agree on the shapes in one all-gather before
    anything else is sent: a bad input on any rank raises a ValueError on every rank.
    """
    call = _prepare(q, k, v, mask, group=group, layout=layout, scale=scale)
    if call is None:
        from multihead.core.functional import attention
        return attention(q, k, v, mask, scale=scale)
    return _Ring.apply(q, k, v, call)


def explain(q: Tensor, k: Tensor, v: Tensor, mask=None, *, group=None, layout: Layout = "contiguous",
            scale: float | None = None) -> str:
    """What :func:`ring_attention` does with these shards on this rank (collective: every rank
    must call it): the local fallback for a group of one, or the ring's steps and its work."""
    call = _prepare(q, k, v, mask, group=group, layout=layout, scale=scale)
    if call is None:
        from multihead.core.functional import explain as local
        return f"context parallel: group of size 1, so attention runs locally\n{local(q, k, v, mask)}"
    plan = call.plan
    rank = dist.get_rank(group)
    work = _work(plan, q.shape[0] * q.shape[1])
    ticks = _schedule(plan)
    sent = sum(plan.needs((rank + s) % plan.N, rank, p) for s, p in ticks)
    total = (plan.N - 1) * len(plan.pieces[rank])
    return (
        f"context parallel: ring attention over N={plan.N} ranks, layout {plan.layout!r}, rank {rank}\n"
        f"  local Lq={plan.Lq}, Lk={plan.Lk}; query tiles of {plan.tiles[rank][0][2]} rows, key pieces of "
        f"{plan.pieces[rank][0][2]} positions\n"
        f"  this rank sends {sent} of {total} pieces (the others reach no query that can see them)\n"
        f"  score entries computed per rank: {work} (max/min {max(work) / max(1, min(work)):.3f})"
    )


def _work(plan: _Plan, BH: int) -> list[int]:
    """Score entries each rank computes (the blocks the plan does not skip)."""
    out = []
    for r in range(plan.N):
        n = 0
        for t, (_, _, rows) in enumerate(plan.tiles[r]):
            for o in range(plan.N):
                for p, (_, _, keys) in enumerate(plan.pieces[o]):
                    if plan.kind(r, t, o, p):
                        n += BH * rows * keys
        out.append(n)
    return out


# --- whole models: the modules' context ----------------------------------------------------


@dataclass(frozen=True)
class Sharded:
    """Sequence-sharded inputs, as a module call is told so: the call's tokens are this rank's shard
    (cut by :func:`shard` with ``layout``) of sequences spread over ``group``, and its attention is
    :func:`ring_attention`. Pass it to :meth:`multihead.MultiHeadAttention.forward` (``sharded=``), or let
    :func:`context_parallel` pass it to every attention module of a model. Checked when made."""

    group: object = None
    layout: str = "contiguous"

    def __post_init__(self):
        _check_layout(self.layout)
        _world(self.group)

    @property
    def size(self) -> int:
        """N, the group's size (1: attention runs locally)."""
        return _world(self.group)[0]

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask, *, scale) -> Tensor:
        return ring_attention(q, k, v, mask, group=self.group, layout=self.layout, scale=scale)

    def explain(self, q: Tensor, k: Tensor, v: Tensor, mask, *, scale) -> str:
        return explain(q, k, v, mask, group=self.group, layout=self.layout, scale=scale)

    def query_keep(self, mask: Mask | None, Lq: int, device) -> Tensor | None:
        """(B, Lq) True = a real query row of this shard (Padding's padded rows come out as zeros)."""
        if mask is None:
            return None
        lens = [p.lens for p in mask.parts() if type(p) is masks.Padding]
        if not lens:
            return None
        pos = local_positions(Lq, self.group, layout=self.layout, device=device)  # (Lq,) global positions
        real = None
        for t in lens:
            r = pos < t.to(device)[:, None]  # (B, Lq)
            real = r if real is None else real & r
        return real


def _takes_sharded(module) -> bool:
    """Whether ``module.forward`` has a ``sharded`` parameter (MultiHeadAttention and the course's modules)."""
    import inspect

    try:
        return "sharded" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def context_parallel(model, group=None, *, layout: Layout = "contiguous"):
    """Run ``model``'s multihead attention modules on sequence-sharded inputs: inside the block
    every one of them is called with ``sharded=Sharded(group, layout)`` (a forward pre-hook on each,
    removed at the end), so its attention is :func:`ring_attention` over ``group`` and the whole
    model (whose other layers act token by token) runs on shards made by :func:`shard`; put its
    output back together with :func:`gather`. Only ``model``'s modules are affected (nothing is
    process-wide). Masks follow :func:`ring_attention`'s conventions. Eager mode only; dropout on the
    attention weights is refused while training. An attention module that cannot run sharded
    (torch.nn's, or the drop-in :class:`~multihead.compat.TorchMultiheadAttention`) is refused
    before anything runs, by name."""
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"context_parallel(model, group=None, *, layout=...) takes the model whose attention runs on "
                        f"shards (an nn.Module); got {type(model).__name__}.")
    takers, refused = [], []
    for name, m in model.named_modules():
        if _takes_sharded(m) and hasattr(m, "_attend"):
            takers.append(m)
        elif isinstance(m, nn.MultiheadAttention) or hasattr(m, "_attend"):
            refused.append(f"{name or '(the model)'} ({type(m).__name__})")
    if refused:
        raise ValueError(f"these attention modules of {type(model).__name__} cannot run on sequence shards: "
                         f"{', '.join(refused)}; use multihead.MultiHeadAttention there.")
    if not takers:
        raise ValueError(f"{type(model).__name__} has no multihead attention module to run on shards.")
    s = Sharded(group, layout)

    def inject(module, args, kwargs):
        kwargs.setdefault("sharded", s)
        return args, kwargs

    handles = [m.register_forward_pre_hook(inject, with_kwargs=True) for m in takers]
    try:
        yield s
    finally:
        for h in handles:
            h.remove()
