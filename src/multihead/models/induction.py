"""Olsson et al.'s (2022) two-layer attention-only transformer and the task that forms its induction head: random
tokens repeated once. The model the circuit how-to page trains inline, here for the tests and the benchmarks that
read the same circuit (:func:`train_induction`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import masks
from multihead.layer.module import MultiHeadAttention


class AttentionOnly(nn.Module):
    """Embedding + learned positions, two causal :class:`~multihead.MultiHeadAttention` layers (E features, H heads,
    biases) on the residual stream, an unembedding: ``(B, L)`` token ids -> ``(B, L, V)`` logits, L <= ``L``."""

    def __init__(self, V: int = 32, E: int = 32, H: int = 4, L: int = 32):
        super().__init__()
        self.embed, self.pos = nn.Embedding(V, E), nn.Parameter(torch.randn(L, E) * 0.02)
        self.layers = nn.ModuleList(MultiHeadAttention(E, H, bias=True) for _ in range(2))
        self.out = nn.Linear(E, V)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]  # (B, L, E)
        for layer in self.layers:
            x = x + layer(x, mask=masks.Causal())
        return self.out(x)  # (B, L, V)


def repeated(g: torch.Generator, B: int, n: int = 16, V: int = 32) -> Tensor:
    """(B, 2n) token ids: n random tokens (of ``V``), then the same again."""
    half = torch.randint(0, V, (B, n), generator=g)  # (B, n)
    return torch.cat([half, half], 1)  # (B, 2n)


def repeat_loss(logits: Tensor, ids: Tensor, n: int = 16) -> Tensor:
    """(B,): the cross-entropy of predicting the repeated half, each token from the one before it."""
    return F.cross_entropy(logits[:, n:-1].transpose(1, 2), ids[:, n + 1:], reduction="none").mean(-1)


def train_induction(*, steps: int = 3000, stop: float = 0.08, seed: int = 0) -> AttentionOnly:
    """:class:`AttentionOnly` trained on :func:`repeated` batches of 64 (Adam, 1e-3; seed ``seed`` for the weights
    and the data) until the loss is under ``stop`` or ``steps`` steps have run; returned in eval mode. The
    second layer forms an induction head (seed 0: under 0.08 in about 1,000 steps)."""
    torch.manual_seed(seed)
    model = AttentionOnly()
    model(torch.zeros(1, 32, dtype=torch.long))  # builds the lazy layers
    opt, g = torch.optim.Adam(model.parameters(), 1e-3), torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = repeated(g, 64)  # (64, 32)
        loss = repeat_loss(model(ids), ids).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < stop:
            break
    return model.eval()
