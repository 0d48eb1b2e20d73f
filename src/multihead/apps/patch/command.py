"""``multihead patch`` and ``multihead circuit``: the parsed arguments handed to :mod:`.patching` and
:mod:`.circuit`."""

from __future__ import annotations


def patch(args) -> int:
    """multihead patch --hf DIR --clean TEXT --corrupted TEXT --metric SPEC: activation patching of every head."""
    from multihead.apps.patch import patching

    patching.run(args.hf, args.clean, args.corrupted, args.metric, args.out, positions=args.positions,
                 direction=args.direction, chunk=args.chunk)
    return 0


def circuit(args) -> int:
    """multihead circuit --hf DIR --clean TEXT --corrupted TEXT --metric SPEC: the circuit, scored, kept and checked."""
    from multihead.apps.patch import circuit as circuits

    circuits.run(args.hf, args.clean, args.corrupted, args.metric, args.out, method=args.method, steps=args.steps,
                 budget=args.budget, mib=args.mib, pairs=args.pairs, batch_size=args.batch_size)
    return 0

