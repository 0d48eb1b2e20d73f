"""Attention rollout (Abnar & Zuidema 2020): how much each output position draws
on each input position through all the layers.

Per layer: A = 0.5 * mean over heads of W + 0.5 * I, rows renormalized; the
rollout is the product A_L ... A_2 A_1 (the last layer on the left).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

_CROSS = ("cross", "encdec", "encoder_attn", "enc_dec")


def _stack(name: str) -> str:
    """'decoder.layers.3.self_attn' -> 'decoder.layers.*.self_attn': the layers of one stack share it."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


# heatmaps(rollout(...)[:, None], **ROLLOUT_AXES): the axes and colour scale of a rollout picture
ROLLOUT_AXES = dict(value_label="rollout: share of the output drawn from each input", xlabel="input position",
                    ylabel="output position")


def stacks_of(captured: Mapping[str, Tensor]) -> dict[str, list[str]]:
    """The capture's self-attention layers grouped by stack ({'encoder.layers.*.self_attn': [names]}),
    in the order they ran; cross-attention layers are left out."""
    stacks: dict[str, list[str]] = {}
    for n in captured:
        if not any(c in n.lower() for c in _CROSS):
            stacks.setdefault(_stack(n), []).append(n)
    return stacks


def rollout(captured: Mapping[str, Tensor], *, names: Sequence[str] | None = None, residual: float = 0.5,
            causal: bool = False) -> Tensor:
    """Rollout over self-attention layers, in the order given (default: the order
    they ran, as :func:`multihead.capture` records them).

    captured: name -> (B, H, L, L). Returns (B, L, L): row i says how much output
    position i draws on each input position (rows sum to 1).

    ``causal=True`` is the decoder form: each layer's map is made lower-triangular
    (a position draws only on itself and earlier ones) before it is renormalized,
    so the product stays causal.

    The layers must be one stack's self-attention (same name up to the layer index, same
    positions): a capture of an encoder-decoder is refused with the stacks it holds, never
    multiplied across them; pass ``names=`` one stack's layers.
    """
    names = list(captured) if names is None else list(names)
    if not names:
        raise ValueError("rollout needs at least one layer's weights.")
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1]; got {residual}.")
    missing = [n for n in names if n not in captured]
    if missing:
        raise ValueError(f"rollout: {missing} are not in the capture; it holds {list(captured)}.")
    cross = [n for n in names if any(c in n.lower() for c in _CROSS)]
    if cross:
        raise ValueError(f"rollout multiplies self-attention maps of one stack; {cross} are cross-attention. Pass "
                         "names= the self-attention layers of one stack (the encoder's, or the decoder's).")
    stacks = stacks_of({n: captured[n] for n in names})
    if len(stacks) > 1 and any(p.isdigit() for n in names for p in n.split(".")):
        first = next(iter(stacks.values()))
        raise ValueError(f"rollout multiplies the layers of one stack; the capture holds {len(stacks)}: "
                         f"{', '.join(sorted(stacks))}. Pass names= one of them, e.g. names={first}.")
    sizes = {tuple(captured[n].shape[-2:]) for n in names}
    if len(sizes) > 1:
        raise ValueError(f"rollout needs every layer on the same positions; the weights have (Lq, Lk) {sorted(sizes)}.")
    out = None
    for n in names:
        w = captured[n]
        if w.dim() != 4 or w.shape[-1] != w.shape[-2]:
            raise ValueError(f"rollout needs self-attention weights (B, H, L, L); {n} has shape {tuple(w.shape)}.")
        if w.isnan().any():
            raise ValueError(f"rollout: {n}'s weights hold NaN (a pruned head's place?); give the heads the model "
                             "computes.")
        W = w.detach().double().mean(1) if w.shape[1] else w.new_zeros(w.shape[0], *w.shape[2:]).double()
        # (B, L, L): heads averaged (no heads left: nothing but the residual)
        L = W.shape[-1]
        A = (1 - residual) * W + residual * torch.eye(L, dtype=W.dtype, device=W.device)
        if causal:
            A = A.tril()
        A = A / A.sum(-1, keepdim=True).clamp_min(1e-12)  # rows sum to 1
        out = A if out is None else A @ out
    return out.to(captured[names[0]].dtype)
