"""The backend registry: every way of computing attention is a function with one
signature, registered under a name, with a ``supports(request)`` that returns
None when it can run a call or the reason it cannot.

``run(query, key, value, mask, *, scale, dropout_p) -> (B, H, Lq, Dv)`` gets
validated inputs: query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv),
mask a :class:`multihead.masks.Mask` or None, scale a float.

"auto" picks the registered backend of highest priority whose ``supports``
returns None and whose optional ``auto(request)`` gives no reason to leave it to
being named. ``use(name)`` changes what "auto" means inside a ``with`` block;
a backend named explicitly in a call always wins.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from multihead.masks import Mask


class Request(NamedTuple):
    """What a backend needs to know to decide whether it can run a call."""

    device_type: str
    dtype: torch.dtype
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    mask: Mask | None
    dropout_p: float
    needs_grad: bool


Supports = Callable[[Request], "str | None"]


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable
    supports: Supports
    priority: int
    doc: str = ""
    describe: Callable[[Request], str] | None = field(default=None)
    #: why "auto" should not pick it for a request it can run (None = it may); naming it still runs it
    auto: Callable[[Request], str | None] | None = field(default=None)


_REGISTRY: dict[str, Backend] = {}
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("multihead_backend", default=None)


def _always(req: Request) -> None:
    return None


def register(
    name: str,
    run: Callable,
    *,
    supports: Supports | None = None,
    priority: int = 0,
    doc: str = "",
    describe: Callable[[Request], str] | None = None,
    auto: Callable[[Request], str | None] | None = None,
    replace: bool = False,
) -> Backend:
    """Add a backend. ``supports(request)`` returns None or why it cannot run;
    "auto" tries backends from the highest ``priority`` down, skipping those whose
    ``auto(request)`` gives a reason not to pick them unasked."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto'; got {name!r}.")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {name!r} is already registered; pass replace=True to replace it.")
    b = Backend(name, run, supports or _always, priority, doc, describe, auto)
    _REGISTRY[name] = b
    return b


def unregister(name: str) -> None:
    get(name)
    del _REGISTRY[name]


def available() -> list[str]:
    """Registered backend names, in the order "auto" tries them."""
    return [b.name for b in _ranked()]


def _ranked() -> list[Backend]:
    return sorted(_REGISTRY.values(), key=lambda b: -b.priority)


def get(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention backend {name!r}; valid: 'auto', " + ", ".join(repr(n) for n in available())
        ) from None


@contextlib.contextmanager
def use(name: str):
    """Inside the block, "auto" means ``name``: ``with backends.use("reference"): ...``."""
    get(name)
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def select(name: str, req: Request) -> Backend:
    """The backend that runs ``req``: the named one, or for "auto" the forced one
    (``use``) or the first of highest priority that supports the request."""
    if name == "auto":
        name = _FORCED.get()
        if name is None:
            for b in _ranked():
                if b.supports(req) is None and (b.auto is None or b.auto(req) is None):
                    return b
            raise RuntimeError(f"no attention backend supports this call: {req}")
    b = get(name)
    why = b.supports(req)
    if why is not None:
        raise ValueError(f"backend {name!r} cannot run this call: {why}. Use backend='auto' or one of {available()}.")
    return b


@dataclass
class Explanation:
    """Which backend runs a call and, for every other backend, why not."""

    request: Request
    chosen: str
    reasons: dict[str, str]

    def __str__(self) -> str:
        r = self.request
        mask = "none" if r.mask is None else repr(r.mask)
        lines = [
            f"attention call: B={r.B} H={r.H} Hkv={r.Hkv} Lq={r.Lq} Lk={r.Lk} D={r.D} Dv={r.Dv} "
            f"{str(r.dtype).replace('torch.', '')} on {r.device_type}; mask: {mask}; "
            f"dropout_p={r.dropout_p}; needs grad: {r.needs_grad}",
            f"  runs: {self.chosen}",
        ]
        width = max(len(n) for n in self.reasons) if self.reasons else 0
        for name, why in self.reasons.items():
            mark = "->" if name == self.chosen else "  "
            lines.append(f"  {mark} {name:<{width}}  {why}")
        return "\n".join(lines)


def explain_request(req: Request, name: str = "auto") -> Explanation:
    forced = _FORCED.get() if name == "auto" else name
    chosen = select(name, req).name
    reasons: dict[str, str] = {}
    for b in _ranked():
        why = b.supports(req)
        detail = f" ({b.describe(req)})" if b.describe and why is None else ""
        if b.name == chosen:
            how = f"forced by use({forced!r})" if name == "auto" and forced else (
                "named in the call" if name != "auto" else f"highest priority that can run (priority {b.priority})"
            )
            reasons[b.name] = f"chosen: {how}{detail}"
        elif why is not None:
            reasons[b.name] = f"cannot run: {why}"
        elif b.auto is not None and (not_auto := b.auto(req)) is not None:
            reasons[b.name] = f"runs only when named: {not_auto}"
        elif forced:
            reasons[b.name] = f"could run, but {chosen!r} was asked for"
        else:
            reasons[b.name] = f"could run, but ranks below {chosen!r} (priority {b.priority})"
    return Explanation(req, chosen, reasons)
