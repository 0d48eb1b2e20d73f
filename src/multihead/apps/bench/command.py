"""``multihead bench``: the workloads asked for, each handed to its runner (W7 hf_bench, W6 cp_bench, the
others bench)."""

from __future__ import annotations

import sys
from pathlib import Path


def bench(args) -> int:
    from multihead.apps.bench import bench as workloads

    names = args.workloads  # checked by the parser (multihead_cli)
    peers = [p.strip() for p in args.peers.split(",")] if args.peers else None
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        print(f"multihead bench: --lengths takes comma-separated integers; got {args.lengths!r}", file=sys.stderr)
        return 2
    if args.memory_only:
        workloads.remeasure_memory(Path(args.out), peers)
        return 0
    if args.pruned and not Path(args.pruned, "config.json").is_file():
        print(f"multihead bench: --pruned {args.pruned} has no config.json (give a directory written by "
              "multihead prune --hf ..., e.g. OUT/model)", file=sys.stderr)
        return 2
    if "W7" in names:  # a transformers sentence encoder: its own runner and table
        import json

        from multihead.apps.bench import hf_bench

        r = hf_bench.run(args.pruned, max_seconds=args.max_seconds)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "minilm_hf.json").write_text(json.dumps(r, indent=2))
        (out / "minilm_hf.md").write_text(hf_bench.markdown(r))
        print(f"wrote {out / 'minilm_hf.md'}")
        names.remove("W7")
        if not names:
            return 0
    if "W6" in names:  # context parallel: its own processes
        from multihead.apps.bench import cp_bench

        cp_bench.run(ranks=args.ranks, length=args.cp_length, reps=args.cp_reps,
                     out=Path(args.out) / "context_parallel")
        names.remove("W6")
        if not names:
            return 0
    workloads.run(names, reps=args.reps, out=Path(args.out), memory=not args.no_memory, peers=peers, lengths=lengths,
                  compile=args.compile, decode_steps=args.decode_steps,
                  decode_batches=tuple(int(b) for b in args.decode_batches.split(",")), cpp_wrapper=args.cpp_wrapper,
                  decode_rounds=args.decode_rounds, decode_recompute=not args.decode_no_recompute)
    return 0

