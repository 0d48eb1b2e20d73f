"""Probe and compare, written once: run a transformers model on one probe call twice (two
attention implementations, or padded and padding-free), record every module's output as it
finishes, and name the first module whose output differs -- with one tolerance rule.

Used by ``attach``'s whole-model check (:func:`multihead.hf.attach`: multihead's attention against
transformers' eager attention) and by the padding-free check (:mod:`multihead.hf.packed`)::

    before = probe.run(model, x)          # Run(output, outputs {module: tensor}, order)
    ...switch something...
    after = probe.run(model, x)
    if probe.differs(before.output[keep], after.output[keep]):
        name = probe.first_difference(before, after, view_before, view_after)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["Run", "differs", "first_difference", "first_output", "padded_example", "recording", "run", "tolerance"]


def first_output(out) -> Tensor | object:
    """The first tensor of a module's or model's output (a tensor, a tuple, a ModelOutput)."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple | list):
        return out[0]
    return out[0] if hasattr(out, "__getitem__") else out


def tolerance(reference: Tensor) -> float:
    """How far a recomputation of ``reference`` may be from it: 1e-4 (or 16 roundings of its dtype,
    whichever is larger) relative to its largest magnitude (at least 1). Two attention
    implementations sum in different orders; through a few layers of float32 that stays within
    1e-5 of the magnitude, a mistake (a mask dropped, a position mixed in) is percents."""
    mag = float(reference.abs().max()) if reference.numel() else 0.0
    return max(1e-4, 16 * torch.finfo(reference.dtype).eps) * max(1.0, mag)


def differs(reference: Tensor, other: Tensor) -> bool:
    """Whether ``other`` is not ``reference`` recomputed (another shape, or beyond :func:`tolerance`)."""
    if reference.shape != other.shape:
        return True
    return bool(((reference.float() - other.float()).abs() > tolerance(reference)).any())


def padded_example(example: dict) -> dict:
    """``example`` as a padded batch: kept when it has an ``attention_mask``, else three sequences of
    lengths L, L-2 and 1 (L = max(its length, 6)) drawn from its vocabulary, padding at the end,
    with its other (1, ...) inputs (decoder ids, pixels) repeated to (3, ...)."""
    x = dict(example)
    ids = x.get("input_ids")
    if not isinstance(ids, Tensor):
        raise ValueError("packed=True needs token inputs: give attach(..., example={'input_ids': ..., "
                         "'attention_mask': ...}).")
    if "attention_mask" not in x:
        g = torch.Generator().manual_seed(1)
        L = max(int(ids.shape[1]), 6)
        vocab = int(ids.max()) + 1
        ids = torch.randint(1, max(2, vocab), (3, L), generator=g).to(ids.device)  # (3, L)
        am = torch.ones(3, L, dtype=torch.long, device=ids.device)  # (3, L)
        am[1, L - 2:] = 0  # lengths L, L-2, 1: padding at the end (and a sequence of one token)
        am[2, 1:] = 0
        x["input_ids"], x["attention_mask"] = ids, am
        x = {k: v.expand(3, *v.shape[1:]) if isinstance(v, Tensor) and v.dim() and v.shape[0] == 1 else v
             for k, v in x.items()}  # the other (1, ...) inputs -> (3, ...)
    return x


@contextlib.contextmanager
def recording(model: nn.Module, prefix: str = ""):
    """Within the block, each module's (under ``prefix``) first output tensor is recorded as it
    finishes: yields ({name: tensor}, [names in completion order]); the hooks go at the end."""
    rec, order = {}, []

    def hook(name):
        def f(mod, args, out):
            o = first_output(out)
            if isinstance(o, Tensor):
                rec[name] = o.detach()
                order.append(name)
        return f

    hs = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n and n.startswith(prefix)]
    try:
        yield rec, order
    finally:
        for h in hs:
            h.remove()


class Run(NamedTuple):
    """One probe call: the model's first output, every module's first output by name, and the
    modules in the order they finished (a module's parts finish before it does)."""

    output: Tensor
    outputs: dict[str, Tensor]
    order: list[str]


def run(model: nn.Module, x: dict, prefix: str = "") -> Run:
    """``model(**x)`` without gradients, every module under ``prefix`` recorded."""
    with recording(model, prefix) as (rec, order), torch.no_grad():
        out = first_output(model(**x)).detach()
    return Run(out, rec, order)


def first_difference(reference: Run, other: Run, view_reference: Callable[[Tensor], Tensor | None],
                     view_other: Callable[[Tensor], Tensor | None]) -> str | None:
    """The first module (in ``other``'s completion order) whose outputs, each seen through its view
    (None: not comparable), :func:`differs`; None when none does."""
    for name in other.order:
        u, v = reference.outputs.get(name), other.outputs[name]
        if u is None or not u.is_floating_point():
            continue
        u, v = view_reference(u), view_other(v)
        if u is not None and v is not None and u.shape == v.shape and differs(u, v):
            return name
    return None
