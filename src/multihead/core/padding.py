"""Padding, written once: a padded batch (B, L, ...) with a keep mask (B, L) as packed tokens (N, ...),
and back -- four pure functions in the manner of flash-attn's ``bert_padding``, used by the module's
packed layout (:mod:`multihead.core.varlen`), our BERT and transformers models run padding-free
(:mod:`multihead.hf.packed`)::

    x (B, L, E) --unpad(x, keep)--> packed (N, E), indices (N,), cu_seqlens (B+1,), max_seqlen
    packed (N, F) --pad(packed, indices, B, L)--> (B, L, F), zeros at padding
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Unpadding", "indices_of", "pad", "unpad"]


class Unpadding(NamedTuple):
    """Where the real tokens of a padded (B, L) batch are: ``indices`` (N,) into the flattened B*L,
    ``cu_seqlens`` (B+1,) int32 cumulative lengths, ``max_seqlen`` the longest sequence."""

    B: int
    L: int
    indices: Tensor
    cu_seqlens: Tensor
    max_seqlen: int

    @classmethod
    def of(cls, keep: Tensor) -> Unpadding:
        """From a keep mask (B, L) bool (True = a real token)."""
        B, L = keep.shape
        lens = keep.sum(-1, dtype=torch.int32)  # (B,)
        cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))  # (B+1,)
        return cls(B, L, keep.reshape(-1).nonzero().squeeze(1), cu, int(lens.max()) if B else 0)  # (N,)

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, ...) (or (1, L, ...), shared by the batch) -> (N, ...)."""
        x = x.expand(self.B, *x.shape[1:])  # (1, L, ...) -> (B, L, ...)
        return x.reshape(self.B * self.L, *x.shape[2:]).index_select(0, self.indices)  # (B*L, ...) -> (N, ...)

    def unpack(self, packed: Tensor) -> Tensor:
        """(N, ...) -> (B, L, ...), zeros at padding."""
        return pad(packed, self.indices, self.B, self.L)


def unpad(x: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """x (B, L, ...) and keep (B, L) bool (True = a real token) ->
    (packed (N, ...), indices (N,) into the flattened (B*L), cu_seqlens (B+1,) int32, max_seqlen).

    The tokens of sequence b are ``packed[cu_seqlens[b]:cu_seqlens[b+1]]``, in order."""
    u = Unpadding.of(keep)
    return u.pack(x), u.indices, u.cu_seqlens, u.max_seqlen


def pad(packed: Tensor, indices: Tensor, B: int, L: int) -> Tensor:
    """Undo :func:`unpad`: packed (N, ...) -> (B, L, ...), zeros where there was padding."""
    out = packed.new_zeros(B * L, *packed.shape[1:])
    return out.index_copy_(0, indices, packed).view(B, L, *packed.shape[1:])  # (B*L, ...) -> (B, L, ...)


def indices_of(cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """The (N,) positions of packed tokens in a (B, max_seqlen) padded layout."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]  # (B,)
    keep = torch.arange(max_seqlen, device=lens.device) < lens[:, None]  # (B, max_seqlen)
    return keep.reshape(-1).nonzero().squeeze(1)  # (N,)
