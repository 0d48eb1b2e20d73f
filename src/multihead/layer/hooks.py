"""The one observation point of an attention module: an explicit, per-module list of hooks.

Every multihead attention module holds ``attention_hooks``, an :class:`AttentionHooks`.
Around its one attention call it

- hands the per-head query and key tensors to every **observer**
  ``fn(module, q (B, H, Lq, D), k (B, Hkv, Lk, D), mask, scale, **modifiers) -> None``
  (``softcap=`` / ``sinks=``, the score modifiers, only when the call has them)``
  (``multihead.capture`` records the weights this way), and
- passes its per-head inputs through every **input transform**
  ``fn(module, q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)) -> (q, k, v)`` before the call
  (path patching sets a receiving head's query, key or value this way; padded calls only), and
- passes the per-head output through every **transform**
  ``fn(module, out (..., H, Dv), live) -> out`` before the heads are merged
  (``multihead.heads`` gates, fills and counts heads this way). ``out`` is
  (B, Lq, H, Dv) on the dense path and (Nq, H, Dv) on packed tokens; ``live`` is
  (B, Lq) bool (the query rows that are computed) or None (all of them).

With no hook registered the module runs its fused path and pays one truth test of
an empty list. Registration returns a handle whose ``remove()`` undoes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

__all__ = ["AttentionHooks", "Observer", "Transform"]

Observer = Callable[..., None]
Transform = Callable[..., Tensor]


class _Handle:
    def __init__(self, items: list, fn):
        self._items, self._fn = items, fn

    def remove(self) -> None:
        if self._fn in self._items:
            self._items.remove(self._fn)


class Seen(NamedTuple):
    """The sizes of a module's last attention call: query heads, key/value heads, query/key and value head sizes."""

    H: int
    Hkv: int
    D: int
    Dv: int


class AttentionHooks:
    """Observers and transforms of one attention module, applied in registration order."""

    def __init__(self):
        self.observers: list[Observer] = []
        self.transforms: list[Transform] = []
        self.inputs: list[Callable] = []
        # for a foreign module (a transformers attention module, see multihead.hf.attach): its
        # head count, its head layout (which weights hold head h) and the module holding it
        self.num_heads: int | None = None
        self.layout = None
        self.parent = None
        #: after pruning, the original indices of the kept heads (a per-head input shared between
        #: layers, T5's position bias, is cut to them); None = unpruned
        self.kept: list[int] | None = None
        #: (H, Hkv, D, Dv) of the last call, and why no head layout could be derived (None: not tried)
        self.seen: Seen | None = None
        self.layout_reason: str | None = None
        #: what the last call computed (a multihead.hf.attention.Computed; see multihead.hf.explain)
        self.args = None
        #: a recorded call (args, kwargs) of the module, from the probe that derived its layout: heads.prune runs it
        #: before and after each cut and refuses a cut that does not give the gated module's outputs
        self.probe: tuple | None = None

    def add_observer(self, fn: Observer) -> _Handle:
        """``fn(module, q (B, H, Lq, D), k (B, Hkv, Lk, D), mask, scale)`` before each attention call."""
        self.observers.append(fn)
        return _Handle(self.observers, fn)

    def add_transform(self, fn: Transform) -> _Handle:
        """``fn(module, out (..., H, Dv), live) -> out`` on each per-head output, before the merge."""
        self.transforms.append(fn)
        return _Handle(self.transforms, fn)

    def add_input(self, fn) -> _Handle:
        """``fn(module, q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)) -> (q, k, v)`` before each padded
        attention call (a packed call with one registered is refused)."""
        self.inputs.append(fn)
        return _Handle(self.inputs, fn)

    def transform_inputs(self, module, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        for fn in self.inputs:
            q, k, v = fn(module, q, k, v)
        return q, k, v

    def observe(self, module, q: Tensor, k: Tensor, mask, scale, **modifiers) -> None:
        for fn in self.observers:
            fn(module, q, k, mask, scale, **modifiers)

    def transform(self, module, out: Tensor, live: Tensor | None) -> Tensor:
        for fn in self.transforms:
            out = fn(module, out, live)
        return out

    def __bool__(self) -> bool:
        return bool(self.observers or self.transforms or self.inputs)

    def __repr__(self) -> str:
        return (f"AttentionHooks({len(self.observers)} observers, {len(self.transforms)} transforms, "
                f"{len(self.inputs)} input transforms)")


#: functions ``fn(model)`` that give foreign attention modules of ``model`` their hook list before
#: :func:`hooked_modules` looks (``multihead.hf`` registers one for transformers models)
DISCOVERERS: list = []


def hooked_modules(model) -> dict:
    """Every module of ``model`` that has an attention hook list: multihead's own modules and
    foreign attention modules given one (a transformers model on multihead's attention), by
    qualified name."""
    for fn in DISCOVERERS:
        fn(model)
    return {n: m for n, m in model.named_modules() if isinstance(m.__dict__.get("attention_hooks"), AttentionHooks)}


def num_heads(module) -> int:
    """A hooked module's query head count H."""
    h = module.__dict__["attention_hooks"].num_heads
    return module.num_heads if h is None else h
