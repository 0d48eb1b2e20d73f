"""The backend registry: every way of computing attention is a function with one
signature (:class:`RunFn`), registered under a name with two questions it answers:

- ``can_run(request)``: *capability*, None when it can compute the call, else why not;
- ``prefer(request)``: *preference*, None when "auto" may pick it, else why it should
  only run when named (e.g. "too small to gain").

``run(query, key, value, mask, *, scale, dropout_p) -> (B, H, Lq, Dv)`` gets
validated inputs: query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv),
mask a :class:`multihead.masks.Mask` or None, scale a float.

"auto" picks the registered backend of highest priority that can run the call and
prefers to. ``use(name)`` changes what "auto" means inside a ``with`` block; a
backend named explicitly in a call runs whenever it can compute it.

A backend that finds it cannot run after all for a reason outside the inputs (its
compiler failed) raises :class:`Unavailable`; the call then runs on the next
choice, and the reason is reported once (a warning) and by ``explain()``. Every
other error propagates.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

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
    #: score modifiers of the call (see :func:`multihead.attention`): the tanh cap, None = none
    softcap: float | None = None
    #: whether per-head sink logits join each row's softmax denominator
    sinks: bool = False

    @property
    def head(self) -> tuple:
        """(device_type, dtype, B, H, Hkv, Lq, Lk, D, Dv): the sizes a choice is keyed on."""
        return (self.device_type, self.dtype, self.B, self.H, self.Hkv, self.Lq, self.Lk, self.D, self.Dv)

    def modifiers(self) -> frozenset[str]:
        """The score modifiers this call asks for: a subset of {"softcap", "sinks"}."""
        return frozenset(n for n, on in (("softcap", self.softcap is not None), ("sinks", self.sinks)) if on)


class RunFn(Protocol):
    """A backend's computation: validated (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)
    -> (B, H, Lq, Dv); a row with nothing to attend to gives zeros. A backend registered with
    ``modifiers`` also receives those score modifiers as keywords when a call has them
    (``softcap=`` a float, ``sinks=`` an (H,) tensor); it never receives one it did not list."""

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, mask: Mask | None, *, scale: float,
                 dropout_p: float) -> Tensor: ...


Reason = Callable[[Request], "str | None"]


class Unavailable(RuntimeError):
    """Raised by a backend's ``run`` when it cannot compute after all for a reason that is
    not the inputs' (its compiler failed): the call falls back to the next choice."""


@dataclass(frozen=True)
class Backend:
    name: str
    run: RunFn
    #: capability: None when it can compute the request, else why not
    can_run: Reason
    priority: int
    doc: str = ""
    describe: Callable[[Request], str] | None = field(default=None)
    #: preference: why "auto" should not pick it for a request it can run (None = it may); naming it still runs it
    prefer: Reason | None = field(default=None)
    #: its can_run and prefer depend only on the request's sizes, dtype, device, dropout, grad need and the
    #: mask's kind (Mask.dispatch_key), never on tensor values: "auto"'s choice may then be cached
    cacheable: bool = False
    #: the score modifiers its ``run`` computes ({"softcap", "sinks"}); a call with any other is not its
    modifiers: frozenset[str] = frozenset()

    def why_not(self, req: Request) -> str | None:
        """None when this backend can compute ``req``, else why not (score modifiers first)."""
        missing = req.modifiers() - self.modifiers
        if missing:
            return f"does not compute the score modifier{'s' if len(missing) > 1 else ''} {', '.join(sorted(missing))}"
        return self.can_run(req)


_REGISTRY: dict[str, Backend] = {}
#: the score modifiers a call may carry (see :func:`multihead.attention`)
MODIFIERS = frozenset({"softcap", "sinks"})
#: the names ``use()`` has forced, innermost last (a plain list, which torch.compile traces: a
#: context variable would break the graph; ``use`` is therefore process-wide, not per thread)
_FORCED: list[str] = []
#: changes whenever what "auto" picks may change: a backend registered or removed, the remembered choices
#: forgotten, a failure recorded, ``use()`` entered or left. A caller that kept a choice (a decoding step
#: run again, :meth:`multihead.MultiHeadAttention.forward`) may run it again while this is the same.
generation = 0


def _changed() -> None:
    global generation
    generation += 1


def _always(req: Request) -> None:
    return None


def register(
    name: str,
    run: RunFn,
    *,
    can_run: Reason | None = None,
    prefer: Reason | None = None,
    priority: int = 0,
    doc: str = "",
    describe: Callable[[Request], str] | None = None,
    replace: bool = False,
    cacheable: bool = False,
    modifiers: frozenset[str] | set[str] | tuple[str, ...] = (),
) -> Backend:
    """Add a backend. ``can_run(request)`` returns None or why it cannot compute the
    call; "auto" tries backends from the highest ``priority`` down, skipping those
    that cannot run and those whose ``prefer(request)`` gives a reason not to pick
    them unasked. ``cacheable=True`` promises that both depend only on the request's
    sizes, dtype, device, dropout, grad need and the mask's kind (``Mask.dispatch_key``) and,
    for a call without a mask, not on Lq or Lk, so the choice for such a call can be remembered
    (the built-in backends make that promise). ``modifiers``: the score modifiers ``run`` computes
    (``"softcap"``, ``"sinks"``); it receives them as keywords, and only those."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto'; got {name!r}.")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {name!r} is already registered; pass replace=True to replace it.")
    if not callable(run):
        raise TypeError(f"run must be callable (query, key, value, mask, *, scale, dropout_p); got {type(run).__name__}.")
    unknown = set(modifiers) - MODIFIERS
    if unknown:
        raise ValueError(f"unknown score modifiers {sorted(unknown)}; known: {sorted(MODIFIERS)}.")
    b = Backend(name, run, can_run or _always, priority, doc, describe, prefer, cacheable, frozenset(modifiers))
    _REGISTRY[name] = b
    _CHOICE.clear()
    _changed()
    return b


def unregister(name: str) -> None:
    get(name)
    del _REGISTRY[name]
    _CHOICE.clear()
    _changed()


#: remembered choices of "auto": {(forced, request without the mask, the mask's kind): Backend}
_CHOICE: dict = {}
_CHOICE_MAX = 512
#: (choice key, backend name) of calls a backend raised Unavailable for: "auto" does not pick it
#: for that kind of call again (reported once), so it is neither run twice nor named by explain
_FAILED: set = set()


def choice_key(head: tuple, dropout_p: float, needs_grad: bool, mask: Mask | None) -> tuple:
    """What "auto"'s remembered choice is keyed on: (device type, dtype, B, H, Hkv, Lq, Lk, D, Dv),
    whether there is dropout, whether gradients are needed, and the mask's kind. Without a mask the
    lengths are left out (no cacheable backend's choice depends on them then), so a decoder whose
    key length grows by one each step finds its choice every step."""
    if mask is None:
        return (head[:5] + head[7:], dropout_p > 0, needs_grad, None)  # (device, dtype, B, H, Hkv, D, Dv)
    return (head, dropout_p > 0, needs_grad, mask.dispatch_key())


def _key(req: Request) -> tuple:
    """:func:`choice_key` of a request, with its score modifiers (calls with modifiers are keyed apart)."""
    key = choice_key(req.head, req.dropout_p, req.needs_grad, req.mask)
    return key + (req.softcap is not None, req.sinks) if req.modifiers() else key


def remembered(key: tuple) -> Backend | None:
    """"auto"'s remembered choice for a call of this kind (see :func:`choice_key`), if any and
    nothing is forced by ``use()``."""
    return None if _FORCED else _CHOICE.get(key)


def _plain_key(query: Tensor, key: Tensor, value: Tensor) -> tuple:
    """:func:`choice_key` of a call on these tensors with no mask, no dropout and no gradients."""
    B, H, Lq, D = query.shape
    head = (query.device.type, query.dtype, B, H, key.shape[1], Lq, key.shape[2], D, value.shape[-1])  # Request.head
    return choice_key(head, 0.0, False, None)


class Kept(NamedTuple):
    """"auto"'s choice for one kind of call, kept by a caller that makes that call again and again (a
    decoding step run again): the backend, the :data:`generation` it was chosen in, the dtype and the scale."""

    backend: Backend
    generation: int
    dtype: torch.dtype
    scale: float


def keep(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Kept | None:
    """The backend "auto" remembers for attention on query (B, H, Lq, D), key (B, Hkv, Lk, D), value
    (B, Hkv, Lk, Dv) with no mask, no dropout and no gradients, kept for :func:`run_kept`; None when it has not
    chosen for such a call yet or ``use()`` forces one."""
    b = remembered(_plain_key(query, key, value))
    return None if b is None else Kept(b, generation, query.dtype, query.shape[-1] ** -0.5 if scale is None else scale)


def run_kept(kept: Kept | None, query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
    """Run a kept choice on a call of the kind it was kept for (no mask, no dropout) -> (B, H, Lq, Dv); None when
    it no longer holds (the registry changed, another dtype, gradients on) or its backend raised
    :class:`Unavailable` (reported and evicted as :func:`call` does): the caller then goes through :func:`call`."""
    if kept is None or kept.generation != generation or kept.dtype is not query.dtype or torch.is_grad_enabled():
        return None
    try:
        return kept.backend.run(query, key, value, None, scale=kept.scale, dropout_p=0.0)
    except Unavailable as e:
        failed(kept.backend, _plain_key(query, key, value), e)
        return None


def forget() -> None:
    """Drop the remembered choices and failures (a backend's capability changed, e.g. its compiler
    was fixed)."""
    _CHOICE.clear()
    _FAILED.clear()
    _changed()


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
    """Inside the block, "auto" means ``name``: ``with backends.use("reference"): ...``
    (process-wide: every thread sees it)."""
    get(name)
    _FORCED.append(name)
    _changed()
    try:
        yield
    finally:
        _FORCED.pop()
        _changed()


def select(name: str, req: Request, *, exclude: frozenset[str] = frozenset()) -> Backend:
    """The backend that runs ``req``: the named one, or for "auto" the forced one
    (``use``) or the first of highest priority that can run the request and prefers to."""
    if name == "auto":
        forced = _FORCED[-1] if _FORCED else None
        if forced is None or forced in exclude:
            return _auto(req, exclude)
        name = forced
    b = get(name)
    why = b.why_not(req)
    if why is not None:
        raise ValueError(f"backend {name!r} cannot run this call: {why}. Use backend='auto' or one of {available()}.")
    return b


def _auto(req: Request, exclude: frozenset[str]) -> Backend:
    """"auto"'s choice, remembered per kind of call when every backend is cacheable."""
    remember = not exclude and not torch.compiler.is_compiling()
    if remember:
        key = _key(req)
        b = _CHOICE.get(key)
        if b is not None:
            return b
    failed = {n for k, n in _FAILED if k == _key(req)} if _FAILED else set()
    for b in _ranked():
        if b.name not in exclude and b.name not in failed and b.why_not(req) is None and \
                (b.prefer is None or b.prefer(req) is None):
            if remember and all(x.cacheable for x in _REGISTRY.values()):
                if len(_CHOICE) >= _CHOICE_MAX:
                    _CHOICE.clear()
                _CHOICE[key] = b
            return b
    raise RuntimeError(f"no attention backend can run this call: {req}")


def _constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch's compiler at import time
    (1.8 s of every ``import multihead``, every CLI command and every spawned process): the decorator only
    sets this marker on the function; tests/test_compile.py checks that it still does."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_result
def traced_choice(head: tuple, mask_key: tuple | None, dropout_p: float, needs_grad: bool,
                  forced: str | None) -> str | None:
    """"auto"'s choice while torch.compile traces a call, made once and baked into the graph: the
    name of the backend :func:`select` picks for (device type, dtype, B, H, Hkv, Lq, Lk, D, Dv), a
    mask of kind ``mask_key`` (:meth:`Mask.dispatch_key`; cacheable backends decide on nothing
    else), dropout and grad need, ``forced`` being the innermost :func:`use` (read by the caller, so
    the graph is guarded on it). None when a backend is not cacheable or the mask's kind is not one
    :func:`multihead.masks.stand_in` knows: the caller then selects while tracing. Nothing about
    the registry is re-checked on each compiled call (it cost a small call ~15 us of guards); a
    backend registered after compiling takes part once ``torch.compiler.reset()`` retraces."""
    from multihead.masks import stand_in

    mask = None if mask_key is None else stand_in(mask_key, head[2], head[5], head[6])
    if (mask_key is not None and mask is None) or not all(b.cacheable for b in _REGISTRY.values()):
        return None
    req = Request(*head, mask, dropout_p, needs_grad)
    return select(forced, req).name if forced is not None else _auto(req, frozenset()).name


_REPORTED: set[tuple[str, str]] = set()


def request(query: Tensor, key: Tensor, value: Tensor, mask: Mask | None, dropout_p: float, *,
            softcap: float | None = None, sinks: Tensor | None = None) -> Request:
    """The :class:`Request` of a call on (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) tensors."""
    B, H, Lq, D = query.shape
    needs_grad = torch.is_grad_enabled() and (any(t is not None and t.requires_grad for t in (query, key, value, sinks))
                                              or (mask is not None and mask.requires_grad))  # a learned bias
    return Request(query.device.type, query.dtype, B, H, key.shape[1], Lq, key.shape[2], D, value.shape[-1], mask,
                   float(dropout_p), needs_grad, None if softcap is None else float(softcap), sinks is not None)


def call(query: Tensor, key: Tensor, value: Tensor, mask: Mask | None, *, scale: float | None, dropout_p: float,
         backend: str = "auto", softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention on validated inputs, dispatched: the one door to the backends. query (B, H, Lq, D), key
    (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv); no keys or an empty output: zeros, no backend
    runs. "auto" without score modifiers runs its remembered choice for this kind of call (while torch.compile
    traces: its choice made once, :func:`traced_choice`); otherwise :func:`select` chooses. A backend that raises
    :class:`Unavailable` is reported once and the next choice runs."""
    B, H, Lq, _ = query.shape
    if key.shape[2] == 0 or B * H * Lq * value.shape[-1] == 0:  # no keys (nothing to attend to) or no output
        if backend != "auto":
            get(backend)  # a name that is not registered is refused all the same
        return _zeros(query, key, value)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if softcap is None and sinks is None and backend == "auto":
        D = query.shape[-1]
        head = (query.device.type, query.dtype, B, H, key.shape[1], Lq, key.shape[2], D, value.shape[-1])  # Request.head
        needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                                  or (mask is not None and mask.requires_grad))
        if torch.compiler.is_compiling():  # chosen once, while tracing
            name = traced_choice(head, None if mask is None else mask.dispatch_key(), dropout_p, needs_grad,
                                 _FORCED[-1] if _FORCED else None)
            b = None if name is None else _REGISTRY.get(name)
        else:  # a call of a kind seen before: its remembered backend
            b = None if _FORCED else _CHOICE.get(choice_key(head, dropout_p, needs_grad, mask))
        if b is not None:
            try:
                return b.run(query, key, value, mask, scale=scale, dropout_p=dropout_p)
            except Unavailable as e:  # reported once and evicted; the full path below falls back
                failed(b, choice_key(head, dropout_p, needs_grad, mask), e)
    req = request(query, key, value, mask, dropout_p, softcap=softcap, sinks=sinks)
    return run(backend, req, query, key, value, mask, scale=scale, dropout_p=dropout_p, softcap=softcap, sinks=sinks)


def _zeros(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """(B, H, Lq, Dv) zeros for a call with nothing to compute: no keys, or an empty output (B, H, Lq or Dv
    is 0; a kernel given one crashed: flex's compiled kernel killed the process at Lq = 0). Joined to the
    inputs' graph by sums over empty slices (exactly 0, never NaN), so backward gives each a zero gradient."""
    z = query.new_zeros(*query.shape[:3], value.shape[-1])  # (B, H, Lq, Dv)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        z = z + (query[..., :0].sum() + key[..., :0].sum() + value[..., :0].sum())
    return z


def run(name: str, req: Request, query: Tensor, key: Tensor, value: Tensor, mask: Mask | None, *, scale: float,
        dropout_p: float, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Select a backend for ``req`` and run it; a backend that raises :class:`Unavailable`
    is reported once (a warning) and the next choice runs."""
    exclude: frozenset[str] = frozenset()
    mods = modifier_kwargs(softcap, sinks)
    while True:
        b = select(name, req, exclude=exclude)
        try:
            return b.run(query, key, value, mask, scale=scale, dropout_p=dropout_p, **mods)
        except Unavailable as e:
            failed(b, _key(req), e)
            exclude = exclude | {b.name}
            name = "auto"


def failed(b: Backend, key: tuple, e: Exception) -> None:
    """``b`` raised Unavailable on a call of kind ``key``: reported once (a warning), evicted from
    the remembered choices, and never "auto"'s choice for that kind again (until :func:`forget`)."""
    _changed()
    if b.cacheable and len(_FAILED) < _CHOICE_MAX:
        _FAILED.add((key, b.name))
    if _CHOICE.get(key) is b:
        del _CHOICE[key]
    if (b.name, str(e)) not in _REPORTED:
        _REPORTED.add((b.name, str(e)))
        warnings.warn(f"attention backend {b.name!r} could not run ({e}); falling back", RuntimeWarning, stacklevel=4)


def modifier_kwargs(softcap: float | None, sinks: Tensor | None) -> dict:
    """The score-modifier keywords a call passes to its backend: only those it has."""
    mods = {}
    if softcap is not None:
        mods["softcap"] = softcap
    if sinks is not None:
        mods["sinks"] = sinks
    return mods


@dataclass
class Choice:
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
            f"dropout_p={r.dropout_p}; needs grad: {r.needs_grad}"
            + (f"; score modifiers: {', '.join(sorted(r.modifiers()))}" if r.modifiers() else ""),
            f"  runs: {self.chosen}",
        ]
        width = max(len(n) for n in self.reasons) if self.reasons else 0
        for name, why in self.reasons.items():
            mark = "->" if name == self.chosen else "  "
            lines.append(f"  {mark} {name:<{width}}  {why}")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:  # a table in a notebook
        head = str(self).splitlines()[0]
        rows = [f"| {'**' + n + '**' if n == self.chosen else n} | {why} |" for n, why in self.reasons.items()]
        return "\n".join([f"`{head}`", "", "| backend | decision |", "|---|---|", *rows])


def explain_request(req: Request, name: str = "auto") -> Choice:
    forced = (_FORCED[-1] if _FORCED else None) if name == "auto" else name
    chosen = select(name, req).name
    reasons: dict[str, str] = {}
    for b in _ranked():
        why = b.why_not(req)
        detail = f" ({b.describe(req)})" if b.describe and why is None else ""
        if b.name == chosen:
            how = f"forced by use({forced!r})" if name == "auto" and forced else (
                "named in the call" if name != "auto" else f"highest priority that can run (priority {b.priority})"
            )
            reasons[b.name] = f"chosen: {how}{detail}"
        elif why is not None:
            reasons[b.name] = f"cannot run: {why}"
        elif b.prefer is not None and (not_auto := b.prefer(req)) is not None:
            reasons[b.name] = f"runs only when named: {not_auto}"
        elif forced:
            reasons[b.name] = f"could run, but {chosen!r} was asked for"
        else:
            reasons[b.name] = f"could run, but ranks below {chosen!r} (priority {b.priority})"
    return Choice(req, chosen, reasons)
