"""Context parallel, measured: peak memory per rank and time of :func:`multihead.distributed.ring_attention`
against one process running ``F.scaled_dot_product_attention`` on the whole sequence.

Every figure comes from fresh processes (gloo on this machine's loopback): N ranks for the
ring, one process for SDPA. In each, after a warm-up call, the peak resident set is reset
(``/proc/self/clear_refs``) and the memory reported is the peak above the resident set just
before the inputs were made, so it counts the inputs (the whole sequence for SDPA, one shard
per rank for the ring), the outputs and everything the call allocates, and not the Python
and torch libraries every process carries. Times are medians of ``reps`` calls; every rank
of the ring shares this machine's cores with the others (threads per process =
cores // N), so the ring's time here says what the schedule costs, not what N devices give.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

CASES = (("none", "contiguous"), ("causal", "zigzag"))


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024  # MiB
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _mask(name: str):
    from multihead import masks

    return None if name == "none" else masks.Causal()


def _one(run, make, backward: bool, reps: int, sync) -> tuple[float, list[float]]:
    """Peak MiB of a call above the resident set before its inputs were made (inputs included),
    then the times of ``reps`` calls; after one untimed call (lazily built pools and threads)."""
    import gc

    q, k, v, dout = make()
    out = run(q, k, v)
    if backward:
        out.backward(dout)
    del q, k, v, dout, out
    gc.collect()
    sync()
    rss0 = _status("VmRSS:")
    _reset_peak()
    times = []
    for i in range(reps):
        q, k, v, dout = make()
        sync()
        t0 = time.perf_counter()
        out = run(q, k, v)
        if backward:
            out.backward(dout)
        sync()
        times.append(time.perf_counter() - t0)
        if i == 0:
            peak = _status("VmHWM:") - rss0
        del q, k, v, dout, out
    return peak, times


def _inputs(B, H, L, D, backward: bool, seed: int):
    def make():
        g = torch.Generator().manual_seed(seed)
        q, k, v, dout = (torch.randn(B, H, L, D, generator=g) for _ in range(4))  # (B, H, L, D) each
        if backward:
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        return q, k, v, dout

    return make


def _rank(rank: int, N: int, store: str, cfg: dict, out: str) -> None:
    import torch.distributed as dist

    from multihead.core import ring as cp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=N,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // N))
    B, H, L, D, reps = cfg["B"], cfg["H"], cfg["L"], cfg["D"], cfg["reps"]
    rows = []
    for mask_name, layout in CASES:
        mask = _mask(mask_name)
        warm = [torch.randn(B, H, 4 * N, D, requires_grad=True) for _ in range(3)]
        cp.ring_attention(*warm, mask, layout=layout).sum().backward()  # kernels loaded, buffers seen
        for backward in (False, True):
            make = _inputs(B, H, L // N, D, backward, seed=rank)
            peak, times = _one(lambda q, k, v, m=mask, lay=layout: cp.ring_attention(q, k, v, m, layout=lay), make, backward,
                               reps, dist.barrier)
            s_f, s_b = cp.last_stats("fwd"), cp.last_stats("bwd")
            wait = s_f.wait_s + (s_b.wait_s if backward else 0.0)
            busy = s_f.compute_s + (s_b.compute_s if backward else 0.0)
            rows.append({"peer": f"ring N={N}", "mask": mask_name, "layout": layout,
                         "mode": "fwd+bwd" if backward else "fwd", "rank": rank, "peak_mib": round(peak, 1),
                         "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                         "comm_wait_share": wait / (wait + busy) if wait + busy else 0.0,
                         "entries": s_f.entries, "mib_sent": round(s_f.bytes_sent / 2**20, 1)})
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _single(_index: int, cfg: dict, out: str) -> None:
    import torch.nn.functional as F

    torch.set_num_threads(os.cpu_count() or 1)
    B, H, L, D, reps = cfg["B"], cfg["H"], cfg["L"], cfg["D"], cfg["reps"]
    rows = []
    for mask_name, _ in CASES:
        causal = mask_name == "causal"
        warm = [torch.randn(B, H, 64, D, requires_grad=True) for _ in range(3)]
        F.scaled_dot_product_attention(*warm, is_causal=causal).sum().backward()
        for backward in (False, True):
            make = _inputs(B, H, L, D, backward, seed=0)
            peak, times = _one(lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c), make,
                               backward, reps, lambda: None)
            rows.append({"peer": "SDPA, 1 process", "mask": mask_name, "layout": "-", "mode":
                         "fwd+bwd" if backward else "fwd", "rank": 0, "peak_mib": round(peak, 1),
                         "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)})
    Path(out, "single.json").write_text(json.dumps(rows))


def _spawn(cfg: dict, ranks: int, length: int, log) -> tuple[list, list]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        log(f"SDPA in one process, L={length} ...")
        mp.start_processes(_single, args=(cfg, tmp), nprocs=1, start_method="spawn")
        log(f"ring attention over {ranks} gloo ranks, L={length} ...")
        store = str(Path(tmp, "store"))
        mp.start_processes(_rank, args=(ranks, store, cfg, tmp), nprocs=ranks, start_method="spawn")
        single = json.loads(Path(tmp, "single.json").read_text())
        ring = [r for i in range(ranks) for r in json.loads(Path(tmp, f"rank{i}.json").read_text())]
    return single, ring


def run(*, ranks: int = 4, length: int = 16384, batch: int = 1, heads: int = 8, head_dim: int = 64, reps: int = 3,
        out: Path = Path("bench/results/context_parallel"), log=print) -> dict:
    """Measure, write ``out/cp.json`` and ``out/cp.md``, and return what was written."""
    cfg = {"B": batch, "H": heads, "L": length, "D": head_dim, "reps": reps}
    out.mkdir(parents=True, exist_ok=True)
    # a fixed malloc threshold: every block over 64 KiB is its own mapping, returned when freed, so
    # the resident set follows the live tensors (glibc's moving threshold would let a later case reuse
    # an earlier one's freed heap and show no growth)
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        single, ring = _spawn(cfg, ranks, length, log)
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    rows = []
    for base in single:
        mine = [r for r in ring if r["mask"] == base["mask"] and r["mode"] == base["mode"]]
        peak = max(r["peak_mib"] for r in mine)
        slow = max(r["median_s"] for r in mine)
        work = [r["entries"] for r in mine]
        rows.append({"mask": base["mask"], "layout": mine[0]["layout"], "mode": base["mode"],
                     "sdpa_peak_mib": base["peak_mib"], "ring_peak_mib_per_rank": peak,
                     "peak_ratio": round(peak / base["peak_mib"], 3) if base["peak_mib"] > 0 else None,
                     "sdpa_s": base["median_s"], "ring_s": slow, "time_ratio": round(slow / base["median_s"], 2),
                     "comm_wait_share": round(max(r["comm_wait_share"] for r in mine), 3),
                     "work_max_over_min": round(max(work) / max(1, min(work)), 3),
                     "mib_sent_per_rank": max(r["mib_sent"] for r in mine)})
    result = {"config": {**cfg, "ranks": ranks, "cores": os.cpu_count(), "torch": torch.__version__},
              "rows": rows, "ranks": ring, "single": single}
    (out / "cp.json").write_text(json.dumps(result, indent=1))
    (out / "cp.md").write_text(table(result))
    log(table(result))
    return result


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"Context parallel, B={c['B']}, H={c['H']}, L={c['L']}, D={c['D']}, fp32, {c['ranks']} gloo ranks on "
        f"{c['cores']} cores (torch {c['torch']}); medians of {c['reps']} calls.",
        "",
        "| mask | layout | mode | SDPA peak MiB | ring peak MiB / rank | ratio | SDPA s | ring s | ratio "
        "| comm wait share | work max/min | MiB sent / rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['mask']} | {r['layout']} | {r['mode']} | {r['sdpa_peak_mib']} | "
                     f"{r['ring_peak_mib_per_rank']} | {_ratio(r['peak_ratio'])} | {r['sdpa_s']:.2f} | {r['ring_s']:.2f} | "
                     f"{r['time_ratio']:.2f}x | {r['comm_wait_share']:.1%} | {r['work_max_over_min']:.3f} | "
                     f"{r['mib_sent_per_rank']} |")
    return "\n".join(lines) + "\n"


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}x"
