"""``multihead prune``: importance, the cut step by step, the target search, recovery, and the pruned model
written; ``--hf`` on a transformers encoder (hf_models) or causal LM (decoder, causal)."""
