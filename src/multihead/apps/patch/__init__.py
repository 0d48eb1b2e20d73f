"""``multihead patch`` (patching) and ``multihead circuit`` (circuit): which heads and edges carry a behaviour."""
