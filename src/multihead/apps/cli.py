"""The ``multihead`` command's dispatch: the arguments :mod:`multihead_cli` parsed (without torch) handed to the
command's own folder (``apps/<command>/command.py``). Nothing here parses, and nothing here imports the parser:
``multihead_cli`` calls :func:`run`, never the other way round."""

from __future__ import annotations


def run(args, fork_server: tuple | None = None) -> int:
    """Run the command ``args.func`` names with its parsed ``args``; its exit code. ``fork_server``: the grader's
    fork server the parser started before torch was imported (:func:`multihead.grader.runner.adopt` takes it)."""
    if fork_server is not None:
        from multihead.grader import runner

        runner.adopt(*fork_server)
    if args.func == "demo":
        from multihead.apps.demo.command import demo as handler
    elif args.func == "viz":
        from multihead.apps.viz.command import viz as handler
    elif args.func == "prune":
        from multihead.apps.prune.command import prune as handler
    elif args.func == "check":
        from multihead.apps.check.command import check as handler
    elif args.func == "bench":
        from multihead.apps.bench.command import bench as handler
    elif args.func == "patch":
        from multihead.apps.patch.command import patch as handler
    elif args.func == "circuit":
        from multihead.apps.patch.command import circuit as handler
    else:
        raise ValueError(f"no command {args.func!r}: the parser (multihead_cli.build_parser) and this dispatch differ")
    return handler(args)
