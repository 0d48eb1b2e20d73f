"""A module call, planned once -- the planning and the plan, in one file.

:func:`make` (what :meth:`multihead.MultiHeadAttention.plan` returns) decides, before any projection
runs, how a call's tokens are laid out and which calls its attention core will get:

- ``dense``: (B, L, ·) as given; one core call over (B, H, Lq, Lk) with the call's mask;
- ``packed``: padding is not computed; the real tokens (N, ·) are projected and the core runs the
  plan's :class:`multihead.core.varlen.Schedule` (for short self-attention one padded call per group of
  sequences of like length, else one per sequence), decided here and executed as it is;
- ``cached``: a decoding step with a :class:`multihead.KVCache` (the core gets the step's queries
  against every cached key);
- ``sharded``: this rank's shard of sequences spread over a process group
  (:class:`multihead.distributed.Sharded`, passed by the caller); the core is ring attention.

``forward`` executes the :class:`Plan` (nothing below it re-decides the layout, the grouping or the
backend's inputs); ``explain`` returns an :class:`Explanation` of the same plan with the request each
core call makes of the backend registry and the registry's decision, rendered as text, markdown or
HTML from one structure (:meth:`Explanation.sections`).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from multihead import masks
from multihead.backends import registry
from multihead.core import validation, varlen
from multihead.core.ring import Sharded
from multihead.layer.cache import KVCache
from multihead.masks import Mask

__all__ = ["Call", "CoreCall", "Explanation", "Plan", "make"]

Layout = Literal["dense", "packed", "cached", "sharded"]


class Call(NamedTuple):
    """A module call's arguments as ``forward`` received them: queries (B, Lq, query_size), keys
    (B, Lk, key_size) or None (= queries), values (B, Lk, value_size) or None (= keys), the course's
    ``valid_lens``, a ``mask``, a :class:`multihead.KVCache` and a :class:`multihead.distributed.Sharded`
    (each None when not given)."""

    queries: object
    keys: object = None
    values: object = None
    valid_lens: object = None
    mask: object = None
    cache: object = None
    sharded: object = None


class CoreCall(NamedTuple):
    """One call the attention core receives: queries (B, H, Lq, D) against keys (B, Hkv, Lk, D) under
    ``mask``, made ``count`` times in a row (the per-sequence loop of the packed layout)."""

    B: int
    Lq: int
    Lk: int
    mask: Mask | None
    count: int = 1


class Plan(NamedTuple):
    """How one module call runs: the layout and why, the validated mask over the padded call
    (B, H, Lq, Lk), and the calls the attention core gets, in order (none when no head is left or
    there are no keys: the output is zeros). ``packed`` (:class:`multihead.core.varlen.Packed`) says where
    the real tokens are for the packed layout and ``schedule`` how the core runs on them; ``sharded`` is
    the caller's
    :class:`multihead.distributed.Sharded` for the sharded one. (A NamedTuple, as CoreCall: one is
    made on every call, and a tuple is made in a fraction of a frozen dataclass's time.)"""

    layout: Layout
    why: str
    mask: Mask | None
    calls: tuple[CoreCall, ...]
    packed: object = None
    sharded: object = None
    #: the packed layout's :class:`multihead.core.varlen.Schedule`: what the core executes
    schedule: object = None

    def requests(self, *, H: int, Hkv: int, D: int, Dv: int, dtype: torch.dtype, device_type: str,
                 dropout_p: float, needs_grad: bool) -> tuple[registry.Request, ...]:
        """The request of each core call (what a backend is selected on), repeated ``count`` times."""
        out = []
        for c in self.calls:
            req = registry.Request(device_type, dtype, c.B, H, Hkv, c.Lq, c.Lk, D, Dv, c.mask, float(dropout_p),
                                   needs_grad)
            out.extend([req] * c.count)
        return tuple(out)


def _mask_text(m: Mask | None) -> str:
    return "none" if m is None else repr(m)


@dataclass(frozen=True)
class Explanation:
    """:meth:`multihead.MultiHeadAttention.explain`'s answer: the :class:`Plan` forward executes, the
    requests its core calls make (``requests``, one per call, in order) and, per distinct call, the
    backend registry's decision (``decisions``: a :class:`multihead.backends.registry.Choice`, or
    the ring's own account under context parallel). ``str()`` is the text; a notebook shows it as a
    table (``_repr_markdown_``/``_repr_html_``). All three come from :meth:`sections`."""

    plan: Plan
    requests: tuple[registry.Request, ...]
    decisions: tuple[tuple[int, object], ...]  # (how many calls, registry.Choice or text)

    @property
    def chosen(self) -> tuple[str, ...]:
        """The backend each distinct core call runs on ("ring" for ring attention over several ranks)."""
        return tuple(d.chosen if isinstance(d, registry.Choice) else "ring" for _, d in self.decisions)

    def sections(self) -> tuple[str, list[dict]]:
        """(title, sections): the one structure every rendering reads. A section is
        {"call": the call's line, "count": n, "rows": [(chosen, backend, decision)], "text": prose or None}."""
        p = self.plan
        title = f"path: {p.layout} ({p.why})"
        out = []
        for n, d in self.decisions:
            if isinstance(d, registry.Choice):
                r = d.request
                call = (f"attention call: B={r.B} H={r.H} Hkv={r.Hkv} Lq={r.Lq} Lk={r.Lk} D={r.D} Dv={r.Dv} "
                        f"{str(r.dtype).replace('torch.', '')} on {r.device_type}; mask: {_mask_text(r.mask)}; "
                        f"dropout_p={r.dropout_p}; needs grad: {r.needs_grad}")
                rows = [(name == d.chosen, name, why) for name, why in d.reasons.items()]
                out.append({"call": call, "count": n, "runs": d.chosen, "rows": rows, "text": None})
            else:
                out.append({"call": "ring attention", "count": n, "runs": "ring", "rows": [], "text": str(d)})
        if not self.decisions:
            out.append({"call": "no attention call", "count": 0, "runs": None, "rows": [],
                        "text": "the output is zeros (no head is left, or there are no keys)"})
        return title, out

    def __str__(self) -> str:
        title, secs = self.sections()
        lines = [title]
        for s in secs:
            times = f" (x{s['count']}, one per sequence)" if s["count"] > 1 else ""
            lines.append(s["call"] + times)
            if s["runs"] is not None and s["rows"]:
                lines.append(f"  runs: {s['runs']}")
                width = max(len(name) for _, name, _ in s["rows"])
                lines += [f"  {'->' if c else '  '} {name:<{width}}  {why}" for c, name, why in s["rows"]]
            if s["text"]:
                lines += ["  " + t for t in s["text"].splitlines()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_markdown_(self) -> str:
        title, secs = self.sections()
        out = [f"**{title}**"]
        for s in secs:
            times = f" ×{s['count']}" if s["count"] > 1 else ""
            out += ["", f"`{s['call']}`{times}"]
            if s["rows"]:
                out += ["", "| | backend | decision |", "|---|---|---|"]
                out += [f"| {'→' if c else ''} | {name} | {why} |" for c, name, why in s["rows"]]
            if s["text"]:
                out += ["", "```", s["text"], "```"]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        title, secs = self.sections()
        e = html.escape
        out = [f"<p><b>{e(title)}</b></p>"]
        for s in secs:
            times = f" &times;{s['count']}" if s["count"] > 1 else ""
            out.append(f"<p><code>{e(s['call'])}</code>{times}</p>")
            if s["rows"]:
                body = "".join(f"<tr><td>{'&rarr;' if c else ''}</td><td>{e(name)}</td><td>{e(why)}</td></tr>"
                               for c, name, why in s["rows"])
                out.append(f"<table><tr><th></th><th>backend</th><th>decision</th></tr>{body}</table>")
            if s["text"]:
                out.append(f"<pre>{e(s['text'])}</pre>")
        return "\n".join(out)


def explanation(plan: Plan, requests: tuple[registry.Request, ...], backend: str, ring=None) -> Explanation:
    """The registry's decision for each run of equal requests (``ring``: the ring's text, for a
    sharded plan over several ranks)."""
    decisions: list[tuple[int, object]] = []
    if ring is not None:
        return Explanation(plan, requests, ((len(requests) or 1, ring),))
    for req in requests:
        if decisions and decisions[-1][1].request == req:
            decisions[-1] = (decisions[-1][0] + 1, decisions[-1][1])
        else:
            decisions.append((1, registry.explain_request(req, backend)))
    return Explanation(plan, requests, tuple(decisions))


# --- planning -----------------------------------------------------------------------------------------


def in_features(lin) -> int | None:
    """A projection's input size, None while a lazy layer has not seen an input (a lazy layer filled by
    ``load_state_dict`` knows it from its weight)."""
    if isinstance(lin, torch.nn.modules.lazy.LazyModuleMixin):
        return None if lin.has_uninitialized_params() else lin.weight.shape[-1]
    return lin.in_features


def flop_per_token(projs, sizes: tuple[int, int, int]) -> float:
    """Projection work per token (multiply-adds x 2), what packing saves on each padded token; ``sizes``:
    the (validated) feature sizes of queries, keys and values, the q, k, v projections' inputs."""
    o = projs[3]
    return 2.0 * (sizes[0] * projs[0].out_features + sizes[1] * projs[1].out_features +
                  sizes[2] * projs[2].out_features + o.in_features * o.out_features)


def inputs(m, projs, call: Call, *, Lk: int | None = None, sharded: bool = False):
    """Defaults (keys = queries, values = keys), checks, and one validated mask from the call's valid_lens
    & mask (over ``Lk`` keys, default the keys' length): (queries, keys, values, mask), everything checked
    before any projection runs. ``sharded``: shards of a sequence, whose masks ring attention checks against
    the whole sequence."""
    queries, keys, values, valid_lens, mask = call[:5]
    keys = queries if keys is None else keys
    values = keys if values is None else values
    q, k, v = projs[0], projs[1], projs[2]
    validation.module_inputs((("queries", queries), ("keys", keys), ("values", values)),
                             (("query_size", in_features(q)), ("key_size", in_features(k)),
                              ("value_size", in_features(v))))
    mk = masks.as_mask(mask)
    if valid_lens is not None:
        vl = valid_lens if isinstance(valid_lens, Mask) else masks.valid_lens(valid_lens)
        mk = vl if mk is None else vl & mk
    if mk is not None and not sharded:
        mk.validate(queries.shape[0], m.num_heads, queries.shape[1], keys.shape[1] if Lk is None else Lk,
                    queries.device)
    return queries, keys, values, mk


def _calls(m, B: int, Lq: int, Lk: int, mask) -> tuple[CoreCall, ...]:
    """The one core call of a dense, cached or local sharded layout (none without heads or keys)."""
    return () if m.num_heads == 0 or Lk == 0 else (CoreCall(B, Lq, Lk, mask),)


def _sharded(m, projs, call: Call):
    sharded = call.sharded
    if not isinstance(sharded, Sharded):
        raise TypeError(f"sharded must be a multihead.distributed.Sharded(group, layout) (or None); got "
                        f"{type(sharded).__name__}.")
    if call.cache is not None:
        raise ValueError("cache and sharded cannot be given together: a KV cache decodes one sequence on one "
                         "process; gather the sequence first.")
    m._check_sharded()
    queries, keys, values, mk = inputs(m, projs, call, sharded=True)
    B, Lq, Lk = queries.shape[0], queries.shape[1], keys.shape[1]
    if sharded.size == 1:
        why, calls = "sequence-sharded inputs; a group of one runs attention locally", _calls(m, B, Lq, Lk, mk)
    else:
        why = f"sequence-sharded inputs: ring attention over {sharded.size} ranks, layout {sharded.layout!r}"
        calls = () if m.num_heads == 0 else (CoreCall(B, Lq, Lk, mk),)
    return Plan("sharded", why, mk, calls, sharded=sharded), queries, keys, values


def _cached(m, projs, call: Call):
    queries, keys, cache = call.queries, call.keys, call.cache
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a multihead.KVCache (or None); got {type(cache).__name__}.")
    B, n = queries.shape[0], queries.shape[1]
    if (keys is None or keys is queries) and call.values is not None and call.values is not queries:
        raise ValueError("with a cache, a self-attention step (keys not given, or keys=queries) projects its keys and "
                         "values from the queries, and values were given apart; for cross-attention give keys and "
                         "values both (the memory), or give neither.")
    if keys is None or keys is queries:  # self-attention: masks cover every cached position and the step's
        Lk = cache.length(m) + n
        self_call = Call(queries, queries, queries, call.valid_lens, call.mask)  # keys and values: the step's own
        queries, keys, values, mk = inputs(m, projs, self_call, Lk=Lk)
        cache.check(m, B, n)  # batch and room, before any computation
        if n > 1 or mk is not None:  # one new position sees every cached one: no mask needed
            mk = masks.Causal("bottom-right") if mk is None else masks.Causal("bottom-right") & mk
        why = f"decoding step: {n} new position(s) appended to {Lk - n} cached"
    else:  # cross-attention: the memory is projected on the first step and reused
        queries, keys, values, mk = inputs(m, projs, call)
        cache.check(m, B, 0)
        memory = cache.memory(m)
        Lk = keys.shape[1] if memory is None else memory[0].shape[2]
        why = ("cross-attention step: the memory is projected once" if memory is None else
               "cross-attention step: the cached memory is reused")
    return Plan("cached", why, mk, _calls(m, B, n, Lk, mk)), queries, keys, values


def packed_plan(m, packed: varlen.Packed, mk) -> Plan:
    """The packed layout: the varlen schedule decided once, and the core calls it makes."""
    calls: list[CoreCall] = []
    sched = None
    if m.num_heads:
        sched = varlen.schedule(packed.cu_q, packed.cu_k, packed.rest,
                                2.0 * m.num_heads * (m.head_dim + m.value_head_dim))
        for B, Lq, Lk, mask in varlen.schedule_calls(sched):
            last = calls[-1] if calls else None
            if last is not None and (last.B, last.Lq, last.Lk) == (B, Lq, Lk) and last.mask is mask:
                calls[-1] = CoreCall(B, Lq, Lk, mask, last.count + 1)
            else:
                calls.append(CoreCall(B, Lq, Lk, mask))
    return Plan("packed", packed.reason, mk, tuple(calls), packed=packed, schedule=sched)


def make(m, projs, call: Call):
    """Check everything and plan ``call``, a call of module ``m`` (its projections ``projs``): (the
    :class:`Plan`, queries, keys, values with their defaults filled)."""
    if call.sharded is not None:
        return _sharded(m, projs, call)
    if call.cache is not None:
        return _cached(m, projs, call)
    queries, keys, values, mk = inputs(m, projs, call)
    B, Lq, Lk = queries.shape[0], queries.shape[1], keys.shape[1]
    if mk is None:
        return Plan("dense", "no padding in the mask", mk, _calls(m, B, Lq, Lk, mk)), queries, keys, values
    if torch.compiler.is_compiling():  # packing needs data-dependent shapes: one graph, no break
        why = "under torch.compile (packing needs data-dependent shapes)"
        return Plan("dense", why, mk, _calls(m, B, Lq, Lk, mk)), queries, keys, values
    fpt = flop_per_token(projs, (queries.shape[2], keys.shape[2], values.shape[2]))
    p = varlen.plan(mk, B, Lq, Lk, queries.device, flop_per_token=fpt)
    if not isinstance(p, varlen.Packing):
        return Plan("dense", p, mk, _calls(m, B, Lq, Lk, mk)), queries, keys, values
    return packed_plan(m, varlen.Packed.from_plan(p, B, Lq, Lk, mk), mk), queries, keys, values
