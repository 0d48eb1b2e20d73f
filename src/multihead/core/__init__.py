"""The attention math: :mod:`~multihead.core.validation` (every check of user input),
:mod:`~multihead.core.functional` (``attention``, ``attention_weights``, ``explain``),
:mod:`~multihead.core.padding` (unpad, pad, index: the one packing of padded batches),
:mod:`~multihead.core.varlen` (attention over packed sequences) and :mod:`~multihead.core.ring`
(ring attention over sequence shards, ``multihead.distributed``)."""
