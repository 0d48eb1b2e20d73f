"""multihead: multi-head attention on PyTorch, exactly right, fast, and able to
show and cut its heads.

    >>> import torch, multihead
    >>> mha = multihead.MultiHeadAttention(num_hiddens=100, num_heads=5)
    >>> X = torch.ones(2, 4, 100)
    >>> mha(X, valid_lens=torch.tensor([3, 2])).shape
    torch.Size([2, 4, 100])
"""

from multihead import backends, masks
from multihead.core.functional import attention, attention_weights, explain, reference_attention
from multihead.core.varlen import attention_varlen
from multihead.grader import check, grade
from multihead.heads.capture import capture
from multihead.layer.cache import KVCache
from multihead.layer.module import MultiHeadAttention, transpose_output, transpose_qkv

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "attention",
    "attention_varlen",
    "attention_weights",
    "backends",
    "capture",
    "check",
    "grade",
    "explain",
    "masks",
    "reference_attention",
    "transpose_output",
    "transpose_qkv",
]
