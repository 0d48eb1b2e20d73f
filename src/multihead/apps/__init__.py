"""The applications built on the library: the ``multihead`` command (:mod:`.cli`), the
demo, the pruning exercise end to end, the benchmarks and the sentence corpus.
The library (everything outside ``multihead.apps``) never imports them."""
