"""The applications built on the library: one folder per command of ``multihead`` (demo, viz, prune, check, bench,
patch and circuit), each holding what that command needs (its ``command.py`` takes the parsed arguments); what two
commands share in :mod:`.common`; :mod:`.cli` dispatches the arguments :mod:`multihead_cli` parsed. The library
(everything outside ``multihead.apps``) never imports them."""

from __future__ import annotations


def __getattr__(name: str):
    """``from multihead.apps import vision``, as the vision how-to first wrote it, kept working (now
    :mod:`multihead.apps.viz.vision`)."""
    if name == "vision":
        from multihead.apps.viz import vision

        return vision
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
