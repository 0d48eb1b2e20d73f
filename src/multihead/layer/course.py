"""The course's modules, on multihead: their usage code runs unchanged but for
the import.

- :class:`D2LMultiHeadAttention`: Dive into Deep Learning's PyTorch
  ``MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)`` (the released
  ``d2l`` package) or the earlier ``(key_size, query_size, value_size, num_hiddens,
  num_heads, dropout, bias=False)``; a course state_dict loads as is.
- :class:`KerasTutorialMultiHeadAttention`: the Keras from-scratch tutorial's
  ``MultiHeadAttention(h, d_k, d_v, d_model)``, mask 1 = blocked.
- The ViT notebook's ``MultiHeadAttention(d_model, num_head, d_k)`` is
  ``multihead.MultiHeadAttention(num_hiddens=d_model, num_heads=num_head,
  head_dim=d_k, bias=True, out_features=d_model)`` (scores scaled by
  1/sqrt(d_k), weights normalized by the softmax before they meet the values).

One deliberate difference everywhere: a query row with nothing to attend to
(valid length 0, or every key blocked) gives zeros here; the course's code gives
uniform weights there (the mean of the values).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from multihead import masks
from multihead.core.functional import weights_of
from multihead.layer.module import MultiHeadAttention

__all__ = ["D2LMultiHeadAttention", "KerasTutorialMultiHeadAttention", "LastWeights"]


class LastWeights(nn.Module):
    """Stands where the course's ``self.attention`` (DotProductAttention) stands:
    ``.attention_weights`` is (B*H, Lq, Lk), the weights of the last forward
    (before dropout), as the course's heatmap code reads them. They are computed
    when read, so the forward itself stays on the fused path."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self._last = None

    def observe(self, module, q: Tensor, k: Tensor, mask, scale) -> None:
        """The module's observer hook: q (B, H, Lq, D), k (B, Hkv, Lk, D)."""
        self._last = (q.detach(), k.detach(), mask, scale)

    @property
    def attention_weights(self) -> Tensor | None:
        if self._last is None:
            return None
        q, k, mask, scale = self._last
        w = weights_of(q, k, mask, scale)  # (B, H, Lq, Lk)
        return w.reshape(-1, w.shape[2], w.shape[3])  # (B, H, Lq, Lk) -> (B*H, Lq, Lk)


class D2LMultiHeadAttention(MultiHeadAttention):
    """The course's PyTorch ``MultiHeadAttention``, on multihead. Both of the course's
    constructors work:

    - ``D2LMultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)``: the
      released ``d2l`` package (1.0.3) and the book's current code; input sizes are
      inferred on the first call (lazy ``W_q, W_k, W_v``);
    - ``D2LMultiHeadAttention(key_size, query_size, value_size, num_hiddens, num_heads,
      dropout, bias=False)``: the six-argument form of the earlier chapter (seeds 001
      and 003), with the input sizes given.

    ``forward(queries, keys, values, valid_lens)``: queries (B, Lq, query_size),
    keys (B, Lk, key_size), values (B, Lk, value_size), valid_lens (B,) or
    (B, Lq) or None -> (B, Lq, num_hiddens). Parameters ``W_q, W_k, W_v, W_o``
    (state_dicts of either form load strictly); ``self.attention.attention_weights``
    is (B*H, Lq, Lk) after a forward.
    """

    _proj_names = ("W_q", "W_k", "W_v", "W_o")
    _SIX = ("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "dropout", "bias")
    _THREE = ("num_hiddens", "num_heads", "dropout", "bias")

    def __init__(self, *args, **kwargs):
        six = len(args) >= 5 or any(k in kwargs for k in ("key_size", "query_size", "value_size"))
        names = self._SIX if six else self._THREE
        if len(args) > len(names):
            raise TypeError(f"D2LMultiHeadAttention takes at most {len(names)} positional arguments "
                            f"({', '.join(names)}); got {len(args)}.")
        given = dict(zip(names, args))
        for k in list(kwargs):
            if k in names:
                if k in given:
                    raise TypeError(f"D2LMultiHeadAttention got {k!r} both by position and by keyword.")
                given[k] = kwargs.pop(k)
        missing = [n for n in names[:-1] if n not in given]
        if missing:
            forms = ("D2LMultiHeadAttention(num_hiddens, num_heads, dropout, bias=False) or "
                     "D2LMultiHeadAttention(key_size, query_size, value_size, num_hiddens, num_heads, dropout, "
                     "bias=False)")
            raise TypeError(f"D2LMultiHeadAttention is missing {', '.join(missing)}: use {forms}.")
        sizes = {n: given.get(n) for n in ("query_size", "key_size", "value_size")}
        super().__init__(given["num_hiddens"], given["num_heads"], given["dropout"], given.get("bias", False),
                         **sizes, **kwargs)
        self.attention = LastWeights(self.dropout)
        self.attention_hooks.add_observer(self.attention.observe)

    def forward(self, queries, keys, values, valid_lens, *, sharded=None):  # the course's signature: all four required
        return super().forward(queries, keys, values, valid_lens, sharded=sharded)

    def explain(self, queries, keys, values, valid_lens, *, sharded=None):
        """What :meth:`forward` with these arguments does (see :meth:`MultiHeadAttention.explain`)."""
        return super().explain(queries, keys, values, valid_lens, sharded=sharded)


def _to_tensor(x, name: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.as_tensor(x, dtype=torch.get_default_dtype())
    raise TypeError(f"{name} must be a torch.Tensor or a NumPy array; got {type(x).__name__}.")


class KerasTutorialMultiHeadAttention(MultiHeadAttention):
    """The Keras from-scratch tutorial's ``MultiHeadAttention(h, d_k, d_v, d_model)``.

    ``d_k`` and ``d_v`` are the *total* projected sizes, split over ``h`` heads
    (D = d_k / h, Dv = d_v / h); the projections ``W_q, W_k, W_v, W_o`` have
    biases and infer their input sizes on the first call, as Keras' Dense does.
    Scores are scaled as the tutorial's code scales them, by 1/sqrt(d_k) of the
    *total* size (the paper scales by the per-head size, 1/sqrt(d_k / h)).
    Unlike the tutorial's reshape, d_k != d_v works.

    ``call(queries, keys, values, mask=None)`` (or calling the module):
    (B, Lq, ·), (B, Lk, ·), (B, Lk, ·) tensors or NumPy arrays -> (B, Lq, d_model).
    mask: the tutorial's convention, 1 = blocked, broadcastable to (B, h, Lq, Lk)
    (a look-ahead mask (Lq, Lk), a padding mask (B, 1, 1, Lk)).
    """

    _proj_names = ("W_q", "W_k", "W_v", "W_o")

    def __init__(self, h: int, d_k: int, d_v: int, d_model: int, **kwargs):
        for name, total in (("d_k", d_k), ("d_v", d_v)):
            if isinstance(total, int) and isinstance(h, int) and h > 0 and total % h:
                raise ValueError(f"{name}={total} (the total projected size) must be divisible by h={h}.")
        super().__init__(d_model, h, 0.0, True, head_dim=d_k // h, value_head_dim=d_v // h,
                         out_features=d_model, scale=1.0 / math.sqrt(d_k), **kwargs)
        self.heads, self.d_k, self.d_v, self.d_model = h, d_k, d_v, d_model

    def forward(self, queries, keys, values, mask=None, *, sharded=None):
        q, k, v = _to_tensor(queries, "queries"), _to_tensor(keys, "keys"), _to_tensor(values, "values")
        return super().forward(q, k, v, mask=masks.from_blocked(mask), sharded=sharded)

    def explain(self, queries, keys, values, mask=None, *, sharded=None):
        """What :meth:`forward` with these arguments does (see :meth:`MultiHeadAttention.explain`)."""
        q, k, v = _to_tensor(queries, "queries"), _to_tensor(keys, "keys"), _to_tensor(values, "values")
        return super().explain(q, k, v, mask=masks.from_blocked(mask), sharded=sharded)

    call = forward
