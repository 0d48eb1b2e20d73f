"""The documented door to the course's modules and the torch.nn drop-in (they live in
:mod:`multihead.layer.course` and :mod:`multihead.layer.dropin`)::

    from multihead.compat import D2LMultiHeadAttention as MultiHeadAttention   # the course's code, unchanged
"""

from multihead.layer.course import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention, LastWeights
from multihead.layer.dropin import PrunedMultiheadAttention, TorchMultiheadAttention

__all__ = ["D2LMultiHeadAttention", "KerasTutorialMultiHeadAttention", "LastWeights", "PrunedMultiheadAttention",
           "TorchMultiheadAttention"]
