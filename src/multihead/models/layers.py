"""Transformer blocks built from :class:`multihead.MultiHeadAttention`."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from multihead.layer.module import MultiHeadAttention


def sinusoidal_positions(L: int, E: int) -> Tensor:
    """The Transformer paper's fixed position encodings -> (L, E)."""
    pos = torch.arange(L, dtype=torch.float32)[:, None]  # (L, 1)
    div = torch.exp(torch.arange(0, E, 2, dtype=torch.float32) * (-math.log(10000.0) / E))  # (E/2,)
    pe = torch.zeros(L, E)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)[:, : E // 2]
    return pe


class FeedForward(nn.Sequential):
    def __init__(self, E: int, hidden: int, dropout: float = 0.0):
        super().__init__(nn.Linear(E, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, E))


class EncoderBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, E: int, heads: int, ffn: int, dropout: float = 0.0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.attn = MultiHeadAttention(E, heads, dropout, True, query_size=E, key_size=E, value_size=E)
        self.ffn = FeedForward(E, ffn, dropout)

    def forward(self, x: Tensor, valid_lens: Tensor | None = None, mask=None) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, valid_lens, mask=mask)  # (B, L, E)
        return x + self.ffn(self.norm2(x))


class DecoderBlock(nn.Module):
    """Pre-norm: causal self-attention, cross-attention to the encoder's output, feed-forward."""

    def __init__(self, E: int, heads: int, ffn: int, dropout: float = 0.0):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(E), nn.LayerNorm(E), nn.LayerNorm(E)
        self.self_attn = MultiHeadAttention(E, heads, dropout, True, query_size=E, key_size=E, value_size=E)
        self.cross_attn = MultiHeadAttention(E, heads, dropout, True, query_size=E, key_size=E, value_size=E)
        self.ffn = FeedForward(E, ffn, dropout)

    def forward(self, y: Tensor, memory: Tensor, memory_lens: Tensor | None, causal, cache=None) -> Tensor:
        """y (B, T, E), memory (B, S, E) -> (B, T, E). With a :class:`multihead.KVCache`, y holds
        the new positions only: self-attention sees every cached one (bottom-right causal),
        cross-attention reuses the memory projected on the first step."""
        h = self.norm1(y)
        y = y + self.self_attn(h, mask=None if cache is not None else causal, cache=cache)  # (B, T, E)
        y = y + self.cross_attn(self.norm2(y), memory, memory, memory_lens, cache=cache)  # keys (B, S, E)
        return y + self.ffn(self.norm3(y))
