"""``multihead demo``: the course's two small models trained, drawn and pruned."""
