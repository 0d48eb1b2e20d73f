"""The module layer: :mod:`~multihead.layer.module` (``MultiHeadAttention``: project, attend, merge,
project), :mod:`~multihead.layer.plan` (a call planned once: the plan ``forward`` executes and
``explain`` shows), :mod:`~multihead.layer.hooks` (each module's one list of observers and transforms),
:mod:`~multihead.layer.cache` (``KVCache``), :mod:`~multihead.layer.course` (the course's modules) and
:mod:`~multihead.layer.dropin` (the ``torch.nn.MultiheadAttention`` drop-in)."""
