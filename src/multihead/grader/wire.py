"""Messages between the grader and a submission's sandbox: a JSON header and tensors as safetensors
bytes, never pickle (nothing that crosses can carry code). A frame is ``<II>`` (header length,
payload length), the header, the payload; the reader refuses oversized frames. Records
(:class:`~multihead.grader.subject.Probe`, :class:`~multihead.grader.subject.Reply`,
:class:`~multihead.grader.subject.Description`) are flattened to (header, tensors) and back here.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from multihead.grader.report import safe
from multihead.grader.subject import Description, Probe, Reply

__all__ = ["Closed", "Deadline", "recv", "send"]

MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 30


class Closed(EOFError):
    """The other end closed its pipe (the sandbox's process ended, or the grader went away)."""


class Deadline(TimeoutError):
    """No whole message arrived before the deadline."""


def send(fd: int, header: dict, tensors: dict[str, Tensor] | None = None) -> None:
    payload = st_save({k: t.detach().contiguous().clone() for k, t in (tensors or {}).items()}) if tensors else b""
    head = json.dumps(header).encode()
    data = struct.pack("<II", len(head), len(payload)) + head + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Deadline(f"no answer within the time limit ({got} of {n} bytes)")
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise Closed("the other end closed the pipe")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def recv(fd: int, deadline: float | None = None) -> tuple[dict, dict[str, Tensor]]:
    """(header, tensors) of the next frame; raises :class:`Closed`, :class:`Deadline`, or ValueError for
    a malformed or oversized frame."""
    nh, np_ = struct.unpack("<II", _read(fd, 8, deadline))
    if nh > MAX_HEADER or np_ > MAX_PAYLOAD:
        raise ValueError(f"a message of {nh} + {np_} bytes is over the limit")
    header = json.loads(_read(fd, nh, deadline))
    if not isinstance(header, dict):
        raise ValueError("a message header that is not an object")
    tensors = st_load(_read(fd, np_, deadline)) if np_ else {}
    return header, tensors


# --- records as (header, tensors) -------------------------------------------------------------


def probe_out(p: Probe) -> tuple[dict, dict]:
    t = {"q": p.q, "k": p.k, "v": p.v}
    if p.mask is not None:
        t["mask"] = p.mask
    if p.cotangent is not None:
        t["cotangent"] = p.cotangent
    for i, x in enumerate((p.replace or {}).values()):
        t[f"replace.{i}"] = x
    return ({"op": "call", "same": p.same, "record": list(p.record), "replace": list(p.replace or {}),
             "order": p.order, "kept": p.kept, "fresh": p.fresh, "watch": p.watch, "forbid": list(p.forbid)}, t)


def probe_in(h: dict, t: dict) -> Probe:
    return Probe(t["q"], t["k"], t["v"], t.get("mask"), bool(h.get("same")), tuple(h.get("record", ())),
                 {n: t[f"replace.{i}"] for i, n in enumerate(h.get("replace", ()))}, t.get("cotangent"),
                 bool(h.get("order")), bool(h.get("kept")), bool(h.get("fresh")), bool(h.get("watch")),
                 tuple(str(n) for n in h.get("forbid", ())))


def reply_out(r: Reply) -> tuple[dict, dict]:
    t = {}
    if r.out is not None:
        t["out"] = r.out
    if r.weights is not None:
        t["weights"] = r.weights
    rec = {}
    for name, calls in r.records.items():
        rec[name] = []
        for i, (x, y) in enumerate(calls):
            rec[name].append([x is not None, y is not None])
            if x is not None:
                t[f"rec.{name}.{i}.in"] = x
            if y is not None:
                t[f"rec.{name}.{i}.out"] = y
    for name, g in r.grads.items():
        t[f"grad.{name}"] = g
    return {"error": r.error, "records": rec, "order": list(r.order), "kept": list(r.kept), "changed": list(r.changed),
            "drawn": list(r.drawn), "picked": r.picked, "called": list(r.called)}, t


def reply_in(h: dict, t: dict) -> Reply:
    records = {name: [(t.get(f"rec.{name}.{i}.in") if has_x else None, t.get(f"rec.{name}.{i}.out") if has_y else None)
                      for i, (has_x, has_y) in enumerate(calls)] for name, calls in h.get("records", {}).items()}
    grads = {k[5:]: v for k, v in t.items() if k.startswith("grad.")}
    err = h.get("error")
    return Reply(t.get("out"), t.get("weights"), None if err is None else safe(err), records, grads,
                 tuple(str(x) for x in h.get("order", ())), tuple(str(x) for x in h.get("kept", ())),
                 tuple(safe(x, 20) for x in h.get("changed", ())), tuple(safe(x, 40) for x in h.get("drawn", ())),
                 safe(h.get("picked") or "", 200), tuple(safe(x, 100) for x in h.get("called", ())))


def description_out(d: Description) -> tuple[dict, dict]:
    t = {}
    for name, (w, b) in d.linear.items():
        t[f"linear.{name}.weight"] = w
        if b is not None:
            t[f"linear.{name}.bias"] = b
    for name, p in d.params.items():
        t[f"param.{name}"] = p
    return ({"modules": d.modules, "linear": {n: b is not None for n, (_, b) in d.linear.items()},
             "trainable": list(d.trainable), "ints": d.ints, "scale": d.scale, "forward": [list(f) for f in d.forward],
             "lazy": d.lazy, "float64": d.float64, "shared": [list(g) for g in d.shared]}, t)


def description_in(h: dict, t: dict) -> Description:
    linear = {n: (t[f"linear.{n}.weight"], t.get(f"linear.{n}.bias") if has_b else None)
              for n, has_b in h.get("linear", {}).items()}
    params = {k[6:]: v for k, v in t.items() if k.startswith("param.")}
    ints = {str(m): {str(a): int(v) for a, v in d.items() if isinstance(v, int)} for m, d in h.get("ints", {}).items()}
    scale = h.get("scale")
    return Description({str(k): str(v) for k, v in h.get("modules", {}).items()}, linear, params,
                       tuple(str(x) for x in h.get("trainable", ())), ints,
                       float(scale) if isinstance(scale, int | float) else None,
                       tuple((str(n), bool(r)) for n, r in h.get("forward", ())), bool(h.get("lazy")),
                       bool(h.get("float64")), tuple(tuple(str(n) for n in g) for g in h.get("shared", ())))

