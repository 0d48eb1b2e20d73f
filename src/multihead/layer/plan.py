"""A module call, planned once.

:meth:`multihead.MultiHeadAttention.plan` decides, before any projection runs, how a call's tokens
are laid out and which calls its attention core will get:

- ``dense``: (B, L, ·) as given; one core call over (B, H, Lq, Lk) with the call's mask;
- ``packed``: padding is not computed; the real tokens (N, ·) are projected and the core gets
  :func:`multihead.core.varlen.core_calls`' calls (for short self-attention one padded call per group
  of sequences of like length, else one per sequence);
- ``cached``: a decoding step with a :class:`multihead.KVCache` (the core gets the step's queries
  against every cached key);
- ``sharded``: this rank's shard of sequences spread over a process group
  (:class:`multihead.distributed.Sharded`, passed by the caller); the core is ring attention.

``forward`` executes the :class:`Plan`; ``explain`` returns an :class:`Explanation` of the same
plan with the request each core call makes of the backend registry and the registry's decision,
rendered as text, markdown or HTML from one structure (:meth:`Explanation.sections`).

Dependency order: masks -> checks -> backends -> functional -> varlen -> distributed -> plan -> modules.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from multihead.backends import registry
from multihead.masks import Mask

__all__ = ["CoreCall", "Explanation", "Plan"]

Layout = Literal["dense", "packed", "cached", "sharded"]


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
    the real tokens are for the packed layout; ``sharded`` is the caller's
    :class:`multihead.distributed.Sharded` for the sharded one. (A NamedTuple, as CoreCall: one is
    made on every call, and a tuple is made in a fraction of a frozen dataclass's time.)"""

    layout: Layout
    why: str
    mask: Mask | None
    calls: tuple[CoreCall, ...]
    packed: object = None
    sharded: object = None

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
    backend registry's decision (``decisions``: a :class:`multihead.backends.registry.Explanation`, or
    the ring's own account under context parallel). ``str()`` is the text; a notebook shows it as a
    table (``_repr_markdown_``/``_repr_html_``). All three come from :meth:`sections`."""

    plan: Plan
    requests: tuple[registry.Request, ...]
    decisions: tuple[tuple[int, object], ...]  # (how many calls, registry.Explanation or text)

    @property
    def chosen(self) -> tuple[str, ...]:
        """The backend each distinct core call runs on ("ring" for ring attention over several ranks)."""
        return tuple(d.chosen if isinstance(d, registry.Explanation) else "ring" for _, d in self.decisions)

    def sections(self) -> tuple[str, list[dict]]:
        """(title, sections): the one structure every rendering reads. A section is
        {"call": the call's line, "count": n, "rows": [(chosen, backend, decision)], "text": prose or None}."""
        p = self.plan
        title = f"path: {p.layout} ({p.why})"
        out = []
        for n, d in self.decisions:
            if isinstance(d, registry.Explanation):
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
