"""The course's (Dive into Deep Learning) PyTorch module -> multihead."""

from __future__ import annotations

import torch
from torch import nn

from multihead.layer.module import MultiHeadAttention


def from_d2l(module: nn.Module) -> MultiHeadAttention:
    """A :class:`MultiHeadAttention` from the course's ``MultiHeadAttention``
    (attributes ``num_heads``, ``W_q``, ``W_k``, ``W_v``, ``W_o``; dropout read from
    ``module.attention.dropout`` when present). Works for
    :class:`multihead.compat.D2LMultiHeadAttention` too."""
    missing = [n for n in ("num_heads", "W_q", "W_k", "W_v", "W_o") if not hasattr(module, n)]
    if missing:
        raise TypeError(f"from_d2l takes the course's MultiHeadAttention; {type(module).__name__} lacks {missing}.")
    Wq, Wk, Wv, Wo = module.W_q, module.W_k, module.W_v, module.W_o
    num_hiddens = Wo.out_features
    bias = Wq.bias is not None
    drop = getattr(getattr(module, "attention", None), "dropout", None)
    p = drop.p if isinstance(drop, nn.Dropout) else float(drop or 0.0)
    new = MultiHeadAttention(num_hiddens, module.num_heads, p, bias, query_size=Wq.in_features,
                             key_size=Wk.in_features, value_size=Wv.in_features,
                             head_dim=Wq.out_features // module.num_heads, out_features=num_hiddens)
    new.to(device=Wq.weight.device, dtype=Wq.weight.dtype)
    with torch.no_grad():
        for mine, theirs in zip(new.projections(), (Wq, Wk, Wv, Wo)):
            mine.weight.copy_(theirs.weight)
            if bias:
                mine.bias.copy_(theirs.bias)
    return new.train(module.training)
