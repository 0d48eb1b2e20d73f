"""Short self-attention on packed tokens: one call padded to the longest sequence against calls
over groups of sequences of like length (``varlen.padded_groups``), as ``attention_varlen`` runs
them inside a padding-free model. Mixed lengths like W7's sentences (9-53 tokens), fresh lengths
every call (the groups are computed, not found in the cache), 2 threads, interleaved rounds.

    .venv/bin/python bench/varlen_groups.py     # writes bench/results/varlen_groups.md (--out)
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from multihead import timing
from multihead.core import varlen


def main(out: Path) -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    lines = ["# Short self-attention on packed tokens: one padded call vs groups of like length", "",
             "`.venv/bin/python bench/varlen_groups.py` (2 threads, inference mode, fresh lengths 9-53 every call so "
             "the grouping is computed each time; interleaved medians; the min-max spread mixes different batches, "
             "not noise alone).", "",
             "| B | H | D | one padded call, ms | grouped, ms | grouped / one (min-max) |",
             "|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines))
    for B, H, D in [(16, 6, 32), (16, 12, 32), (64, 6, 32), (64, 12, 64)]:
        batches = []
        for _ in range(64):  # lengths of sentences, 9-53 tokens
            lens = torch.randint(9, 54, (B,), generator=g)
            cu = torch.zeros(B + 1, dtype=torch.int32)
            cu[1:] = lens.cumsum(0)
            N = int(cu[-1])
            x = torch.randn(N, 3, H, D, generator=g)
            batches.append((x[:, 0], x[:, 1], x[:, 2], cu))  # (N, H, D) views, as a model's projections give
        it = itertools.cycle(batches)

        def run(groups: int, it=it) -> None:
            varlen.MAX_GROUPS = groups
            varlen.padded_groups.cache_clear()  # new lengths every call, as a server sees them
            q, k, v, cu = next(it)
            varlen.attention_varlen(q, k, v, cu, cu)

        with torch.inference_mode():
            t = timing.interleaved({"one": lambda: run(1), "grouped": lambda: run(8)}, min_rounds=30,
                                   max_seconds=30)
        varlen.MAX_GROUPS = 8
        one, grp = t["one"], t["grouped"]
        lines.append(f"| {B} | {H} | {D} | {one.median:.3f} | {grp.median:.3f} | {grp.median / one.median:.2f} "
                     f"({grp.min / one.max:.2f}-{grp.max / one.min:.2f}) |")
        print(lines[-1], flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "varlen_groups.md")
    main(ap.parse_args().out)
