"""Weights in and out of other implementations.

- torch.nn: :func:`from_torch`, :func:`to_torch`, :func:`patch` (swap every
  ``nn.MultiheadAttention`` in a model for the drop-in, weights carried over);
- Keras 3: :func:`from_keras`, :func:`to_keras` (``keras.layers.MultiHeadAttention``);
- the course: :func:`from_d2l`.
"""

from multihead.interop.d2l import from_d2l
from multihead.interop.keras import from_keras, to_keras
from multihead.interop.torch_nn import from_torch, patch, to_torch

__all__ = ["from_d2l", "from_keras", "from_torch", "patch", "to_keras", "to_torch"]
