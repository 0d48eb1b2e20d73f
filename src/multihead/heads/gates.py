"""Head gates: a gate ξ_h on every head's output, installed in each attention module's own hook
list for the length of a ``with`` block (no flag threads through any forward). What
:mod:`multihead.heads.importance` measures with and :mod:`multihead.heads` prunes to.

Dependency order: hooks, capture -> gates -> importance -> heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from multihead.layer.hooks import hooked_modules
from multihead.layer.hooks import num_heads as _num_heads

__all__ = ["attention_modules", "gated"]


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every attention module in ``model`` with a hook list (multihead's own, and a transformers
    model's after ``multihead.hf.attach``), by qualified name, in order."""
    return hooked_modules(model)


@contextlib.contextmanager
def gated(model: nn.Module, values: Mapping[str, Tensor] | None = None, *, requires_grad: bool = False,
          fill: Mapping[str, Tensor] | None = None):
    """Inside the block every head's output is scaled by its gate (default 1).
    With ``fill`` ({module: (H, Dv)}), a head's output becomes
    ``gate * output + (1 - gate) * fill``: gated off, it is replaced by ``fill``
    (e.g. its mean output) instead of zeros. Yields {module name: gates (H,)}; the
    gates are removed afterwards. Gates are a tensor or a list of numbers per module, one finite number a head;
    every module's are checked before any is set (ValueError / TypeError naming the module).

    A model whose modules call SDPA and that nothing has observed yet is observed on its first call inside the
    block (:func:`multihead.heads.observe.on_call`): the yielded dict fills as its modules are found, each module's
    given gates are checked then, and a name in ``values`` or ``fill`` that no call reached is refused at the end."""
    mods = attention_modules(model)
    if not mods:
        with _gated_on_call(model, values, requires_grad, fill) as gates:
            yield gates
        return
    for name in list(values or ()) + list(fill or ()):
        if name not in mods:
            raise ValueError(f"no multihead attention module named {name!r}; modules: {list(mods)}.")
    gates = {name: _gates_of(name, m, None if values is None else values.get(name)) for name, m in mods.items()}
    handles = []
    for name, m in mods.items():
        gates[name].requires_grad_(requires_grad)
        handles.append(m.attention_hooks.add_transform(_gate(gates[name], None if fill is None else fill.get(name))))
    try:
        yield gates
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _gated_on_call(model: nn.Module, values, requires_grad: bool, fill):
    """:func:`gated` on a model observed on its first call inside the block."""
    from multihead.heads.observe import nothing_seen, on_call

    gates, handles = {}, []

    def found(name: str, m: nn.Module) -> None:
        gates[name] = _gates_of(name, m, None if values is None else values.get(name)).requires_grad_(requires_grad)
        handles.append(m.attention_hooks.add_transform(_gate(gates[name], None if fill is None else fill.get(name))))

    try:
        with on_call(model, found):
            yield gates
    finally:
        for h in handles:
            h.remove()
    if not gates:
        raise ValueError(nothing_seen(model, "gate"))
    missing = sorted((set(values or ()) | set(fill or ())) - set(gates))
    if missing:
        raise ValueError(f"no attention module named {missing} was called in the block; modules: {list(gates)}.")


def _gates_of(name: str, m: nn.Module, given) -> Tensor:
    """Module ``name``'s gates (H,): a copy of ``given`` (a tensor or a list of numbers), or ones."""
    H = _num_heads(m)
    w = next(iter(m.parameters()))
    if given is None:
        return torch.ones(H, device=w.device, dtype=w.dtype)
    try:
        g = given.detach().clone() if isinstance(given, Tensor) else torch.tensor(given, dtype=w.dtype, device=w.device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"gates for {name} must be a tensor or a list of {H} numbers; got {given!r}.") from None
    if g.shape != (H,):
        raise ValueError(f"gates for {name} must have shape ({H},) (its heads); got {tuple(g.shape)}.")
    if g.is_floating_point() and not bool(torch.isfinite(g).all()):
        raise ValueError(f"gates for {name} must be finite; got {g.tolist()}.")
    return g


def _gate(g: Tensor, fill: Tensor | None):
    """A transform: head h's output (..., H, Dv) becomes ``g[h] * out + (1 - g[h]) * fill[h]``."""

    def transform(module, out: Tensor, live) -> Tensor:
        gh = g.to(device=out.device, dtype=out.dtype)[:, None]  # (H,) -> (H, 1), on the output's device
        if fill is None:
            return out * gh
        return out * gh + (1 - gh) * fill.to(device=out.device, dtype=out.dtype)  # fill (H, Dv)

    return transform
