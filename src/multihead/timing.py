"""Timings that hold still: every candidate measured in the same rounds, interleaved,
after a warm-up, until the median of each is known to within a tolerance (its 95%
interval), with the min-max kept and a busy machine said, not hidden; each round's time
is kept, so that :func:`paired` reads two candidates' ratio round by round."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Timing", "cpu_flags", "interleaved", "median_interval", "paired"]

#: a spread (max - min) above this share of the median marks the machine as busy
BUSY_SPREAD = 0.20


@dataclass
class Timing:
    """One candidate's times (ms): median, its 95% interval, min, max, number of rounds, and each round's time in
    order (``samples``: what :func:`paired` reads)."""

    median: float
    lo: float
    hi: float
    min: float
    max: float
    n: int
    samples: tuple[float, ...] = field(default=(), repr=False, compare=False)

    @property
    def spread(self) -> float:
        return (self.max - self.min) / self.median if self.median else 0.0

    @property
    def stable(self) -> bool:
        """The median's 95% interval lies within ±5% of it."""
        return self.median > 0 and (self.hi - self.lo) / self.median <= 0.10

    def scaled(self, f: float) -> Timing:
        """The same timing with every figure multiplied by ``f`` (e.g. per batch of a call over several)."""
        return Timing(self.median * f, self.lo * f, self.hi * f, self.min * f, self.max * f, self.n,
                      tuple(x * f for x in self.samples))

    def to_json(self) -> dict:
        return {"median_ms": round(self.median, 3), "ci95_ms": [round(self.lo, 3), round(self.hi, 3)],
                "min_ms": round(self.min, 3), "max_ms": round(self.max, 3), "rounds": self.n}


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95% interval of the median: the order statistics
    n/2 ± 0.98 sqrt(n) (the binomial's normal approximation)."""
    s = sorted(xs)
    n = len(s)
    half = 0.98 * math.sqrt(n)
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return s[lo], s[hi]


def interleaved(calls: dict[str, Callable[[], object]], *, warmup: int = 2, min_rounds: int = 7,
                max_rounds: int = 60, rel: float = 0.05, max_seconds: float = 120.0,
                late_rounds: int | None = None, progress: str | None = None) -> dict[str, Timing]:
    """Time every call in the same rounds (the order rotates each round) until the
    median's 95% interval of each is within ±``rel`` of it (after ``min_rounds``), or
    ``max_rounds`` / ``max_seconds`` is reached (after ``late_rounds``, default
    ``min_rounds``: fewer rounds when a time budget runs short). ``progress``: a bar with
    that description, in seconds of the ``max_seconds`` allowed. Returns {name: Timing}
    in milliseconds, each round's time kept."""
    late_rounds = min_rounds if late_rounds is None else min(late_rounds, min_rounds)
    names = list(calls)
    bar = None
    if progress is not None:
        from multihead.extras import progress as progress_bar

        bar = progress_bar(total=round(max_seconds), desc=progress, unit="s",
                           bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s allowed{postfix}")
    start = time.perf_counter()
    for _ in range(warmup):
        for n in names:
            calls[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(max_rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t = time.perf_counter()
            calls[n]()
            times[n].append((time.perf_counter() - t) * 1e3)
        spent = time.perf_counter() - start
        if bar is not None:
            bar.n = min(spent, bar.total)
            bar.set_postfix_str(f"round {r + 1}", refresh=True)
        if r + 1 >= late_rounds and spent > max_seconds:
            break
        if r + 1 >= min_rounds and all((hi - lo) <= 2 * rel * statistics.median(ts)
                                       for ts in times.values() for lo, hi in [median_interval(ts)]):
            break
    if bar is not None:
        bar.close()
    out = {}
    for n, ts in times.items():
        lo, hi = median_interval(ts)
        out[n] = Timing(statistics.median(ts), lo, hi, min(ts), max(ts), len(ts), tuple(ts))
    return out


def paired(slow: Timing, fast: Timing) -> tuple[float, float, float]:
    """(median, low, high): how many times faster ``fast`` ran than ``slow``, read round by round (each round's
    ratio, both timed in that round) -- the median of the rounds' ratios and its 95% interval
    (:func:`median_interval`). A slow drift of the machine's speed moves both sides of a round alike and cancels,
    where the ratio of two medians keeps it. Both must come from the same :func:`interleaved` call (ValueError)."""
    if not slow.samples or len(slow.samples) != len(fast.samples):
        raise ValueError(f"paired: the timings must hold the same rounds' times, got {len(slow.samples)} and "
                         f"{len(fast.samples)} rounds; time both in one interleaved() call.")
    ratios = [a / b for a, b in zip(slow.samples, fast.samples)]
    lo, hi = median_interval(ratios)
    return statistics.median(ratios), lo, hi


def busy_note(timings: dict[str, Timing]) -> str | None:
    """A sentence for the report when the machine was busy or the medians did not settle."""
    spread = max((t.spread for t in timings.values()), default=0.0)
    unstable = [n for n, t in timings.items() if not t.stable]
    notes = []
    if spread > BUSY_SPREAD:
        notes.append(f"the machine was busy: the widest min-max spread was {spread:.0%} of its median (> "
                     f"{BUSY_SPREAD:.0%})")
    if unstable:
        notes.append("medians not settled to ±5% within the time allowed: " + ", ".join(unstable))
    return "; ".join(notes) or None


#: the CPU flags that decide which kernels run fast (int8 dot products, matrix tiles, wide vectors)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "amx_tile", "fma",
             "neon", "asimd")


def cpu_flags() -> list[str]:
    """The CPU's vector and matrix flags that decide kernel speed (avx2, avx512f, avx512_vnni, amx_int8, ...), read
    from ``/proc/cpuinfo`` (sorted; empty where it cannot be read): every results file names them."""
    from pathlib import Path

    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(words & set(CPU_FLAGS))
