"""Short self-attention on packed tokens: one call padded to the longest sequence against calls
over groups of sequences of like length (``varlen.padded_groups``), as ``attention_varlen`` runs
them inside a padding-free model. Mixed lengths like W7's sentences (9-53 tokens), fresh lengths
every call (the groups are computed, not found in the cache), 2 threads, interleaved rounds.

    .venv/bin/python bench/varlen_groups.py
"""

from __future__ import annotations

import itertools

import torch

from multihead import timing
from multihead.core import varlen


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    print("| B | H | D | one padded call, ms | grouped, ms | grouped / one (min-max) |")
    print("|---:|---:|---:|---:|---:|---:|")
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
        print(f"| {B} | {H} | {D} | {one.median:.3f} | {grp.median:.3f} | {grp.median / one.median:.2f} "
              f"({grp.min / one.max:.2f}-{grp.max / one.min:.2f}) |")


if __name__ == "__main__":
    main()
