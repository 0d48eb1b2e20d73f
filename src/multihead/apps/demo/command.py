"""``multihead demo``: the parsed arguments handed to :func:`multihead.apps.demo.demo.run`."""

from __future__ import annotations

from pathlib import Path


def demo(args) -> int:
    from multihead.apps.demo.demo import run

    run(Path(args.out), retrain=args.retrain, seed=args.seed, max_seconds=args.max_seconds, recover=args.recover)
    return 0

