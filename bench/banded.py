"""Banded masks: the blocked backend against SDPA's dense mask, and SDPA's causal
kernel against the machine's matmul throughput (why plain causal stays with SDPA). Printed, and written to
bench/results/banded.md with the command that made it.

    .venv/bin/python bench/banded.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import multihead
from multihead import masks


def ms(f, reps: int = 5) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


OUT = Path(__file__).resolve().parent / "results" / "banded.md"


def main() -> None:
    lines = ["`python bench/banded.py`", ""]

    def say(line: str) -> None:
        print(line)
        lines.append(line)

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak = 2 * 2048**3 / ms(lambda: a @ b) / 1e6
    say(f"fp32 matmul: {peak:.0f} GFLOP/s")
    H, D = 8, 64
    for L in (4096, 8192):
        qkv = tuple(torch.randn(1, H, L, D) for _ in range(3))

        def run(mask, backend, qkv=qkv):
            with torch.no_grad():
                return multihead.attention(*qkv, mask, backend=backend)

        causal = ms(lambda: run(masks.Causal(), "sdpa"))
        flop = 2 * 2 * L * L * D * H / 2  # QK^T and PV, the causal half
        say(f"L={L}: SDPA causal {causal:.1f} ms = {flop / causal / 1e6:.0f} GFLOP/s "
            f"({flop / causal / 1e6 / peak:.0%} of matmul); the causal half at matmul peak would take "
            f"{flop / peak / 1e6:.1f} ms ({flop / peak / 1e6 / causal:.2f}x)")
        for name, m in (("SlidingWindow(256)", masks.SlidingWindow(256)),
                        ("Causal(bottom-right) & SlidingWindow(1024)",
                         masks.Causal("bottom-right") & masks.SlidingWindow(1024))):
            dense = ms(lambda m=m: run(m, "sdpa"))
            blocked = ms(lambda m=m: run(m, "blocked"))
            say(f"  {name}: sdpa (dense mask) {dense:.1f} ms, blocked {blocked:.1f} ms "
                f"({blocked / dense:.2f}x)")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
