"""Attention rollout (Abnar & Zuidema 2020): how much each output position draws
on each input position through all the layers.

Per layer: A = 0.5 * mean over heads of W + 0.5 * I, rows renormalized; the
rollout is the product A_L ... A_2 A_1 (the last layer on the left).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def rollout(captured: Mapping[str, Tensor], *, names: Sequence[str] | None = None, residual: float = 0.5,
            causal: bool = False) -> Tensor:
    """Rollout over self-attention layers, in the order given (default: the order
    they ran, as :func:`multihead.capture` records them).

    captured: name -> (B, H, L, L). Returns (B, L, L): row i says how much output
    position i draws on each input position (rows sum to 1).

    ``causal=True`` is the decoder form: each layer's map is made lower-triangular
    (a position draws only on itself and earlier ones) before it is renormalized,
    so the product stays causal.
    """
    names = list(captured) if names is None else list(names)
    if not names:
        raise ValueError("rollout needs at least one layer's weights.")
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1]; got {residual}.")
    out = None
    for n in names:
        w = captured[n]
        if w.dim() != 4 or w.shape[-1] != w.shape[-2]:
            raise ValueError(f"rollout needs self-attention weights (B, H, L, L); {n} has shape {tuple(w.shape)}.")
        W = w.detach().double().mean(1)  # (B, L, L): heads averaged
        L = W.shape[-1]
        A = (1 - residual) * W + residual * torch.eye(L, dtype=W.dtype, device=W.device)
        if causal:
            A = A.tril()
        A = A / A.sum(-1, keepdim=True).clamp_min(1e-12)  # rows sum to 1
        out = A if out is None else A @ out
    return out.to(captured[names[0]].dtype)
