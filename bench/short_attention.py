"""Where the ``short`` backend wins: key-padded attention at sentence lengths, SDPA's kernel against the scores
materialized with the softmax in place (``multihead.backends.short``). A measurement, not a feature.

Part 1, the kernel: for (B, H, L, D) over a grid of batch sizes, head counts, lengths and head sizes, with a
key-padding mask (a quarter of the keys padded), prediction (inference mode), both backends interleaved in
rounds, the best of each round's two timings; the table gives short's time over SDPA's (median and spread of the
rounds) and whether "auto" picks short there (``multihead.explain``), so the preference rule can be read against
the measurement.

Part 2, the served model: the served pruned MiniLM (``multihead.hf.serve(multihead.hf.load(DIR))``) on held-out
sentences at batch 1, 16 and 64, with short registered and without it, in ABBA order, and transformers' BertModel
(sdpa, fp32) in the same rounds.

    .venv/bin/python bench/short_attention.py bench/results/prune_minilm_hf_target/model   # ~3 min on 2 cores
                                                                  # writes bench/results/short_attention.md
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GRID = dict(B=(1, 4, 16, 64), H=(4, 12), L=(16, 32, 64, 128, 256), D=(32, 64))
ROUNDS = 9
BATCHES = (1, 16, 64)


def per_call(f, target_s: float = 0.01) -> float:
    """Seconds per call of f(), over enough calls to take about target_s."""
    f()
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            f()
        dt = time.perf_counter() - t
        if dt >= target_s or n >= 1024:
            return dt / n
        n *= 2


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def kernel_rows(grid: dict = GRID, rounds: int = ROUNDS) -> list[dict]:
    """One row per (B, H, L, D): short's time over SDPA's by round, and "auto"'s choice."""
    import multihead
    from multihead import masks

    rows = []
    for B, H, L, D in itertools.product(grid["B"], grid["H"], grid["L"], grid["D"]):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, L, H, D, generator=g).transpose(1, 2) for _ in range(3))  # (B, H, L, D) views
        keep = torch.ones(B, L, dtype=torch.bool)
        keep[:, L - L // 4:] = False  # a quarter of the keys padded
        mask = masks.KeyPadding(keep)
        with torch.inference_mode():
            ratios = []
            for _ in range(rounds):
                t = {name: min(per_call(lambda n=name, a=(q, k, v, mask): multihead.attention(*a, backend=n)) for _ in range(2))
                     for name in ("sdpa", "short")}
                ratios.append(t["short"] / t["sdpa"])
            sdpa_us = per_call(lambda a=(q, k, v, mask): multihead.attention(*a, backend="sdpa")) * 1e6
            auto = str(multihead.explain(q, k, v, mask)).split("runs: ")[1].split()[0]
        rows.append(dict(B=B, H=H, L=L, D=D, sdpa_us=sdpa_us, ratios=ratios, auto=auto))
        print(f"B {B} H {H} L {L} D {D}: short/sdpa {spread(ratios)}, auto: {auto}", flush=True)
    return rows


def served_rows(model_dir: str, rounds: int = ROUNDS, batches: tuple[int, ...] = BATCHES) -> list[dict]:
    """The served model with short registered and without it (unregistered: "auto" then picks sdpa, through the
    same dispatch path; ``backends.use("sdpa")`` would add its own dispatch cost, ~5% at batch 1), in ABBA order
    by round, and transformers' sdpa in the same rounds, per batch size."""
    import transformers

    import multihead.hf as mhf
    from multihead import backends
    from multihead.apps.common.data import held_out_batch
    from multihead.models import minilm_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = mhf.serve(mhf.load(model_dir))
        peer = transformers.AutoModel.from_pretrained(minilm_path(), attn_implementation="sdpa").eval()
    short = backends.get("short")

    def with_short(on: bool) -> None:
        if on and "short" not in backends.available():
            backends.register(short.name, short.run, can_run=short.can_run, prefer=short.prefer,
                              priority=short.priority, doc=short.doc, describe=short.describe, cacheable=short.cacheable)
        elif not on and "short" in backends.available():
            backends.unregister("short")

    rows = []
    try:
        for b in batches:
            x = held_out_batch(b)  # sentences the pruning never saw
            times = {"short": [], "sdpa only": [], "transformers": []}
            with torch.inference_mode():
                for r in range(rounds):
                    for on in ((True, False) if r % 2 == 0 else (False, True)):
                        with_short(on)
                        times["short" if on else "sdpa only"].append(per_call(lambda x=x: served(**x), 0.2))
                    times["transformers"].append(per_call(lambda x=x: peer(**x), 0.2))
            rows.append(dict(batch=b, tokens=int(x["attention_mask"].sum()), times=times))
            print(f"batch {b}: short/sdpa only {spread([a / f for a, f in zip(times['short'], times['sdpa only'])])}",
                  flush=True)
    finally:
        with_short(True)
    return rows


def main(model_dir: str | None, rounds: int = ROUNDS, grid: dict = GRID, out: Path | None = None) -> Path:
    kern = kernel_rows(grid, rounds)
    lines = [f"The `short` backend against SDPA (`bench/short_attention.py`), {torch.get_num_threads()} threads, "
             f"inference mode, key padding (a quarter of the keys), {rounds} interleaved rounds. short's time over "
             "SDPA's: median (min-max by round); below 1 short is faster. auto: the backend `multihead.explain` "
             "says auto runs.", "",
             "| B | H | L | D | SDPA, us | short / SDPA | auto |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in kern:
        lines.append(f"| {r['B']} | {r['H']} | {r['L']} | {r['D']} | {r['sdpa_us']:.0f} | {spread(r['ratios'])} | "
                     f"{r['auto']} |")
    if model_dir:
        lines += ["", f"The served pruned model ({model_dir}) on held-out sentences, ms (median of {rounds} rounds), "
                  "with short registered (auto picks it for the padded groups) and without it (unregistered: sdpa), "
                  "in ABBA order; speed-up over transformers' sdpa (fp32), median (min-max by round). Batch 1 has no "
                  "padding (no group, no change): its row is the measurement's own spread.", "",
                  "| batch | real tokens | with short, ms | sdpa only, ms | with / without | with short vs transformers "
                  "| sdpa only vs transformers |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in served_rows(model_dir, rounds):
            t = r["times"]
            med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            lines.append(
                f"| {r['batch']} | {r['tokens']} | {med['short']:.2f} | {med['sdpa only']:.2f} | "
                f"{spread([a / f for a, f in zip(t['short'], t['sdpa only'])])} | "
                f"{spread([p / a for p, a in zip(t['transformers'], t['short'])])}x | "
                f"{spread([p / f for p, f in zip(t['transformers'], t['sdpa only'])])}x |")
    out = out or Path(__file__).parent / "results" / "short_attention.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/prune_minilm_hf_target/model")
