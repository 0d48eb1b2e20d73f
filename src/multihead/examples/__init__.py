"""Runnable examples: ``python -m multihead.examples.<name>`` (see each module's docstring)."""
