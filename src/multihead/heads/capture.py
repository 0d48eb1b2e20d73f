"""Opt-in recording of every head's attention weights, from any model.

    with multihead.capture(model) as captured:
        model(x)
    captured["encoder.layers.0.attn"]        # (B, H, Lq, Lk), the last call's weights

Inside the block every multihead attention module (``MultiHeadAttention``, the
course's compat modules, ``TorchMultiheadAttention`` and so patched torch.nn
models) records its weights, computed by :func:`multihead.attention_weights`
under the same mask, keyed by the module's qualified name in ``model``.

``capture`` adds an observer to each module's own hook list
(:class:`multihead.layer.hooks.AttentionHooks`) and removes it on exit. It changes
neither the return values nor the path a module takes: on the packed (varlen)
path the weights are computed from the packed projections put back in the
batch's layout, so they equal the dense path's; the one visible difference is
that a query row that is not computed there (padding under ``masks.Padding``, or
a BERT model's packed padding) has weights of zeros. Outside the block nothing
is recorded: the only cost is one check of an empty list.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from multihead.core.functional import weights_of
from multihead.heads.observe import nothing_seen, on_call
from multihead.layer.hooks import hooked_modules
from multihead.layer.module import AttentionCore

__all__ = ["capture", "Captured"]


class Captured(Mapping):
    """Name -> weights (B, H, Lq, Lk) of the module's last call, in the order the
    modules first ran. ``calls(name)`` gives every call's weights; ``skipped``
    says which calls were not kept and why; ``kv_heads`` {name: Hkv} how many key/value heads the module's last
    call had (fewer than H: grouped, query head h reads key/value group h // (H // Hkv)), which the heatmaps and the
    explorer label."""

    def __init__(self, model: nn.Module | None, include, detach: bool, to_cpu: bool, max_elements: int | None):
        self._names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self._include = include
        self.detach, self.to_cpu, self.max_elements = detach, to_cpu, max_elements
        self._calls: dict[str, list[Tensor]] = {}
        self.skipped: dict[str, str] = {}
        self.kv_heads: dict[str, int] = {}
        self._anon: dict[int, str] = {}

    def _name(self, module) -> str | None:
        name = self._names.get(id(module))
        if name is None:
            if self._names:  # a model was given and this module is not in it
                return None
            name = self._anon.setdefault(id(module), f"{type(module).__name__}#{len(self._anon)}")
        return name if name else type(module).__name__

    def _wanted(self, name: str, module) -> bool:
        inc = self._include
        if inc is None:
            return True
        if callable(inc):
            return bool(inc(name, module))
        return any(fnmatch.fnmatchcase(name, pat) for pat in inc)

    def record(self, module, q: Tensor, k: Tensor, mask, scale, *, softcap=None, sinks=None) -> None:
        """The observer hook: q (B, H, Lq, D), k (B, Hkv, Lk, D), and the call's score modifiers."""
        name = self._name(module)
        if name is None or not self._wanted(name, module):
            return
        B, H, Lq, _ = q.shape
        n = B * H * Lq * k.shape[2]
        if self.max_elements is not None and n > self.max_elements:
            self.skipped[name] = f"weights of {n} elements (B={B}, H={H}, Lq={Lq}, Lk={k.shape[2]}) > max_elements"
            return
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.detach):
            w = weights_of(q, k, mask, scale, softcap, sinks)  # (B, H, Lq, Lk)
        if self.to_cpu:
            w = w.cpu()
        self._calls.setdefault(name, []).append(w)
        self.kv_heads[name] = k.shape[1]

    def calls(self, name: str) -> list[Tensor]:
        return list(self._calls[name])

    def __getitem__(self, name: str) -> Tensor:
        return self._calls[name][-1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def __repr__(self) -> str:
        items = ", ".join(f"{n}: {tuple(w.shape)}" for n, w in self.items())
        return f"Captured({{{items}}})"


@contextlib.contextmanager
def capture(
    model: nn.Module | None = None,
    *,
    include: list[str] | Callable[[str, nn.Module], bool] | None = None,
    detach: bool = True,
    to_cpu: bool = False,
    max_elements: int | None = None,
):
    """Record every multihead attention module's per-head weights inside the block.

    Args:
        model: names the modules (their qualified names in it); modules outside it
            are ignored. None: every multihead module alive now, named ``ClassName#i``
            in order of first call.
        include: glob patterns over names (``["encoder.*"]``) or a predicate
            ``(name, module) -> bool``; None = all.
        detach: record without autograd history (default); False keeps the graph
            so a loss can be taken of the weights.
        to_cpu: move each record to the CPU.
        max_elements: skip (and list in ``captured.skipped``) weights larger than this.

    Yields a :class:`Captured` mapping.
    """
    rec = Captured(model, include, detach, to_cpu, max_elements)
    mods = list(hooked_modules(model).values()) if model is not None else AttentionCore.alive()
    handles = [m.attention_hooks.add_observer(rec.record) for m in mods]
    lazy = contextlib.nullcontext() if mods or model is None else \
        on_call(model, lambda name, m: handles.append(m.attention_hooks.add_observer(rec.record)))
    try:
        with lazy:
            yield rec
    finally:
        for h in handles:
            h.remove()
    if model is not None and not handles:
        raise ValueError(nothing_seen(model, "record"))
