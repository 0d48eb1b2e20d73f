"""Head surgery, written once: which rows and columns belong to heads, a projection cut to
them, and a removed head's mean output folded into the output projection's bias.

Used by :func:`multihead.heads.prune` (multihead's own modules) and by the transformers head
layouts (:mod:`multihead.hf_heads`). A projection is ``nn.Linear`` (weight (out, in)) or
transformers' ``Conv1D`` (weight (in, out), y = x W + b).

Dependency order: modules -> surgery -> heads, hf_heads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.modules import linear

__all__ = ["fold_into_bias", "head_rows", "is_conv1d", "out_in", "select"]


def head_rows(heads: list[int], size: int) -> list[int]:
    """The rows (or columns) of heads ``heads`` in a projection laid out head by head, ``size``
    per head: head h owns h*size .. h*size + size - 1."""
    return [h * size + d for h in heads for d in range(size)]


def is_conv1d(p: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): weight (in, out), y = x W + b."""
    return type(p).__name__ == "Conv1D"


def out_in(p: nn.Module) -> Tensor:
    """The projection's weight as (out, in), whatever its layout (a view, not a copy)."""
    return p.weight.t() if is_conv1d(p) else p.weight


def select(p: nn.Module, out_rows: list[int] | None = None, in_cols: list[int] | None = None) -> nn.Module:
    """A new projection of ``p``'s kind keeping output rows ``out_rows`` and input columns
    ``in_cols`` (None: all) of its weight and bias, on its device and dtype. A Conv1D left without
    input columns becomes an nn.Linear (Conv1D cannot have zero input features)."""
    w = out_in(p).detach()  # (out, in)
    if out_rows is not None:
        w = w[out_rows]
    if in_cols is not None:
        w = w[:, in_cols]
    b = p.bias.detach() if p.bias is not None else None
    if b is not None and out_rows is not None:
        b = b[out_rows]
    conv = is_conv1d(p) and w.shape[1] > 0
    if conv:
        new = type(p)(w.shape[0], w.shape[1])
        new.weight = nn.Parameter(w.t().contiguous())  # (out, in) -> Conv1D's (in, out)
        new.bias = None if b is None else nn.Parameter(b.contiguous())
    else:
        new = linear(w.shape[1], w.shape[0], b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w)
            if b is not None:
                new.bias.copy_(b)
    return new.to(device=w.device, dtype=w.dtype)


def fold_into_bias(new_o: nn.Module, old_o: nn.Module, cols: list[int], mean: Tensor) -> None:
    """Fold what removed heads contributed on average into ``new_o``'s bias: ``old_o``'s weight
    columns ``cols`` (the removed heads' inputs) times ``mean`` (their mean outputs, flattened to
    len(cols)) is a constant (out,) added to the bias (made when ``new_o`` has none)."""
    w = out_in(old_o)  # (out, H*Dv)
    const = w[:, cols] @ mean.reshape(-1).to(w.dtype)  # (out,)
    with torch.no_grad():
        if new_o.bias is None:
            new_o.bias = nn.Parameter(torch.zeros_like(const))
        new_o.bias += const
