"""``multihead bench``: multihead against its peers, measured side by side.

One process per workload; peers interleaved round by round after a warm-up;
median, min and max of ``reps`` calls; ratios to ``torch.nn.MultiheadAttention``;
the backend (and path) that actually ran; the machine's matmul throughput
measured in the same run. Peak memory (W4) is measured in a fresh subprocess per
peer. Writes markdown, JSON and a PNG chart.

Workloads:
  W1  the course's toy: B=2, Lq=4, Lk=6, E=100, H=5, valid_lens [3, 2]
  W2  BERT-base self-attention: B=8, L=512, E=768, H=12, lengths uniform in 128..512
  W3  W2 without padding
  W4  causal self-attention: B=1, E=512, H=8, L=4096 and 8192

Peers: torch.nn.MultiheadAttention, SDPA + 4 nn.Linear, the course's code
(apps/bench/course.py), Keras 3 MultiHeadAttention (KERAS_BACKEND=torch; when
installed), FlexAttention + 4 nn.Linear (compiled, forward only on CPU), and
multihead (valid_lens, as the course; and Padding where queries are padded too).
With ``--compile`` each of them is timed compiled too, beside torch.compile's own
per-call floor (a compiled ``x[0, 0] + 1``), so a small call's compiled time can
be read as floor + graph.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import multihead
from multihead import masks
from multihead.interop import from_torch


@dataclass
class Workload:
    name: str
    B: int
    Lq: int
    Lk: int
    E: int
    H: int
    lens: torch.Tensor | None  # key lengths (B,), None = no padding
    causal: bool = False
    note: str = ""

    @property
    def self_attention(self) -> bool:
        return self.Lq == self.Lk and self.name != "W1"


def workloads(names: list[str], lengths: tuple[int, ...] = (4096, 8192)) -> list[Workload]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in names:
        if n == "W1":
            out.append(Workload("W1", 2, 4, 6, 100, 5, torch.tensor([3, 2]), note="course toy"))
        elif n == "W2":
            out.append(Workload("W2", 8, 512, 512, 768, 12, torch.randint(128, 513, (8,), generator=g),
                                note="BERT-base, padded"))
        elif n == "W3":
            out.append(Workload("W3", 8, 512, 512, 768, 12, None, note="BERT-base, no padding"))
        elif n == "W4":
            out += [Workload(f"W4-{L}", 1, L, L, 512, 8, None, causal=True, note="causal") for L in lengths]
        else:
            raise ValueError(f"unknown workload {n!r}; valid: W1, W2, W3, W4.")
    return out


# --- peers: each returns (module, call(x, y) -> output, description of what ran) ---


def _kpm(w: Workload) -> torch.Tensor | None:
    return None if w.lens is None else torch.arange(w.Lk)[None, :] >= w.lens[:, None]  # (B, Lk) True = padding


def peer_torch(w: Workload, base: nn.MultiheadAttention):
    # float masks: torch.nn's eval fast path is ~1.8x (padding) to ~6x (causal) slower with bool ones here
    kpm = _kpm(w)
    kpm = None if kpm is None else torch.zeros(kpm.shape).masked_fill(kpm, float("-inf"))
    causal = nn.Transformer.generate_square_subsequent_mask(w.Lq) if w.causal else None

    def call(x, y):
        return base(x, y, y, key_padding_mask=kpm, attn_mask=causal, need_weights=False, is_causal=w.causal)[0]

    return base, call, "need_weights=False, float masks"


class SDPALinear(nn.Module):
    def __init__(self, base: nn.MultiheadAttention, kdim: int):
        super().__init__()
        E = base.embed_dim
        self.H = base.num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(E if i in (0, 3) else kdim, E) for i in range(4))
        mha = from_torch(base)
        for mine, theirs in zip((self.q, self.k, self.v, self.o), mha.projections()):
            mine.load_state_dict(theirs.state_dict())

    def split(self, x, y):
        """x (B, Lq, E), y (B, Lk, E) -> q (B, H, Lq, D), k and v (B, H, Lk, D)."""
        B, Lq, _ = x.shape
        Lk, H = y.shape[1], self.H
        q = self.q(x).view(B, Lq, H, -1).transpose(1, 2)  # (B, Lq, E) -> (B, H, Lq, D)
        k = self.k(y).view(B, Lk, H, -1).transpose(1, 2)  # (B, Lk, E) -> (B, H, Lk, D)
        v = self.v(y).view(B, Lk, H, -1).transpose(1, 2)  # (B, Lk, E) -> (B, H, Lk, D)
        return q, k, v

    def merge(self, o):
        B, H, Lq, D = o.shape
        return self.o(o.transpose(1, 2).reshape(B, Lq, H * D))  # (B, H, Lq, D) -> (B, Lq, E)

    def forward(self, x, y, attn_mask=None, is_causal=False):
        q, k, v = self.split(x, y)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal))


def peer_sdpa(w: Workload, base):
    m = SDPALinear(base, w.E)
    keep = None if w.lens is None else (~_kpm(w))[:, None, None, :]  # (B, 1, 1, Lk)
    return m, lambda x, y: m(x, y, attn_mask=keep, is_causal=w.causal), "bool mask" if keep is not None else ""


def peer_course(w: Workload, base):
    from multihead.apps.bench import course

    m = course.ChapterMultiHeadAttention(w.E, w.E, w.E, w.E, w.H, 0.0, bias=True)
    mha = from_torch(base)
    for mine, theirs in zip((m.W_q, m.W_k, m.W_v, m.W_o), mha.projections()):
        mine.load_state_dict(theirs.state_dict())
    if w.causal:
        vl = torch.arange(1, w.Lq + 1).expand(w.B, w.Lq)  # the course's decoder: (B, Lq) valid lengths
    else:
        vl = w.lens
    return m, lambda x, y: m(x, y, y, vl), "valid_lens" + (" (B, Lq) for causal" if w.causal else "")


def peer_keras(w: Workload, base):
    if os.environ.get("KERAS_BACKEND", "torch") != "torch":
        return None
    os.environ.setdefault("KERAS_BACKEND", "torch")
    try:
        import keras
    except ImportError:
        return None
    from multihead.interop import to_keras

    layer = to_keras(from_torch(base))
    am = None if w.lens is None else (~_kpm(w))[:, None, :].expand(w.B, w.Lq, w.Lk)  # (B, Lq, Lk) 1 = attend

    def call(x, y):
        return layer(x, y, attention_mask=am, use_causal_mask=w.causal)

    return layer, call, f"keras {keras.__version__}"


_FLEX_CACHE: dict = {}


def peer_flex(w: Workload, base):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    m = SDPALinear(base, w.E)
    lens = w.lens

    def mask_mod(b, h, q_idx, kv_idx):
        ok = kv_idx >= 0
        if lens is not None:
            ok = ok & (kv_idx < lens[b])
        if w.causal:
            ok = ok & (kv_idx <= q_idx)
        return ok

    bm = create_block_mask(mask_mod, w.B if lens is not None else None, None, w.Lq, w.Lk, device="cpu")
    key = ("flex",)
    if key not in _FLEX_CACHE:
        _FLEX_CACHE[key] = torch.compile(flex_attention, dynamic=False)
    fa = _FLEX_CACHE[key]

    def call(x, y):
        q, k, v = m.split(x, y)
        return m.merge(fa(q, k, v, block_mask=bm))

    return m, call, "compiled, dynamic=False; no CPU backward"


def peer_multihead(w: Workload, base, padding: bool = False):
    m = from_torch(base)
    if w.causal:
        mask = masks.Causal()
    elif w.lens is None:
        mask = None
    else:
        mask = masks.Padding(w.lens) if padding else masks.ValidLens(w.lens)
    x = torch.zeros(w.B, w.Lq, w.E)
    y = x if w.self_attention else torch.zeros(w.B, w.Lk, w.E)
    how = m.explain(x, y, y, mask=mask)
    ran = how.plan.layout + ", " + ("/".join(dict.fromkeys(how.chosen)) or "no attention call")
    return m, lambda x, y: m(x, y, y, mask=mask), ran


def peer_valid_lens(w: Workload, base):
    """The course's own call: ``mha(queries, keys, values, valid_lens)`` with the (B,) lengths tensor."""
    m, _, ran = peer_multihead(w, base)
    return m, lambda x, y: m(x, y, y, w.lens), ran + ", valid_lens tensor"


PEERS: dict[str, Callable] = {
    "torch.nn.MHA": peer_torch,
    "SDPA+4 Linear": peer_sdpa,
    "course code": peer_course,
    "Keras 3 MHA": peer_keras,
    "FlexAttention": peer_flex,
    "multihead": peer_multihead,
    "multihead (Padding)": lambda w, base: (peer_multihead(w, base, padding=True)
                                            if w.lens is not None and w.self_attention else None),
    "multihead (valid_lens)": lambda w, base: peer_valid_lens(w, base) if w.name == "W1" else None,
}


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


@dataclass
class Result:
    workload: str
    peer: str
    mode: str
    median_ms: float
    min_ms: float
    max_ms: float
    ran: str
    ratio: float = float("nan")
    peak_mib: float | None = None
    extra: dict = field(default_factory=dict)


def _inputs(w: Workload, grad: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(w.B, w.Lq, w.E, generator=g).requires_grad_(grad)
    y = x if w.self_attention else torch.randn(w.B, w.Lk, w.E, generator=g).requires_grad_(grad)
    return x, y


def _step(call, x, y, backward: bool):
    if not backward:
        with torch.no_grad():
            call(x, y)
        return
    out = call(x, y)
    out.sum().backward() if isinstance(out, torch.Tensor) else torch.as_tensor(out).sum().backward()


#: the peers timed again under torch.compile with ``--compile``
COMPILED_PEERS = ("torch.nn.MHA", "SDPA+4 Linear", "multihead", "multihead (Padding)", "multihead (valid_lens)")

#: with ``--compile``: what torch.compile's machinery costs a call on its own (guards, the
#: autograd and inductor wrappers around a graph of one small kernel), the floor under every
#: compiled peer's time; timed in the same rounds as the peers
COMPILE_FLOOR = "torch.compile floor (x[0, 0] + 1)"


def _floor(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x[0, 0] + 1  # (E,): one small kernel


def time_workload(w: Workload, peers: list[str], reps: int, *, warmup: int = 3, log=print,
                  compile: bool = False, cpp_wrapper: bool = False) -> list[Result]:
    torch.manual_seed(0)
    base = nn.MultiheadAttention(w.E, w.H, batch_first=True)
    results = []
    for backward in (False, True):
        mode = "fwd+bwd" if backward else "fwd"
        built = {}
        for name in peers:
            if backward and name == "FlexAttention":
                continue  # no CPU backward
            try:
                p = PEERS[name](w, base)
            except Exception as e:  # a peer that cannot be built is reported (a row of the table), not fatal
                log(f"  {w.name} {mode}: {name} unavailable: {type(e).__name__}: {e}")
                results.append(_failed(w, name, mode, f"could not be built: {type(e).__name__}: {str(e)[:160]}"))
                continue
            if p is None:
                continue
            mod, call, ran = p
            if hasattr(mod, "train"):
                mod.train(backward)
            built[name] = (call, ran)
            if compile and name in COMPILED_PEERS:  # the same call, compiled (dynamic=False: one shape per workload)
                built[f"{name} (compiled)"] = (torch.compile(call, dynamic=False), ran + ", torch.compile")
            if compile and cpp_wrapper and name in COMPILED_PEERS:  # inductor's C++ wrapper: less Python per call
                built[f"{name} (compiled, cpp_wrapper)"] = (
                    torch.compile(call, dynamic=False, options={"cpp_wrapper": True}),
                    ran + ", torch.compile(options={'cpp_wrapper': True})")
        if compile:
            built[COMPILE_FLOOR] = (torch.compile(_floor, dynamic=False), "torch.compile of x[0, 0] + 1, (E,)")
        x, y = _inputs(w, backward)
        times: dict[str, list[float]] = {n: [] for n in built}
        for name, (call, _) in list(built.items()):
            try:
                for _ in range(warmup):
                    _step(call, x, y, backward)
            except Exception as e:
                log(f"  {w.name} {mode}: {name} failed: {type(e).__name__}: {str(e)[:200]}")
                results.append(_failed(w, name, mode, f"failed: {type(e).__name__}: {str(e)[:160]}"))
                del built[name], times[name]
        for _ in range(reps):  # interleaved rounds
            for name, (call, _) in built.items():
                t = time.perf_counter()
                _step(call, x, y, backward)
                times[name].append((time.perf_counter() - t) * 1e3)
        ref = statistics.median(times["torch.nn.MHA"]) if "torch.nn.MHA" in times else float("nan")
        for name, ts in times.items():
            med = statistics.median(ts)
            results.append(Result(w.name, name, mode, med, min(ts), max(ts), built[name][1], med / ref))
            log(f"  {w.name:8} {mode:8} {name:20} {med:9.2f} ms  ({med / ref:5.2f}x)  {built[name][1]}")
    return results


def _failed(w: Workload, peer: str, mode: str, why: str) -> Result:
    """A peer that could not be built or run: a row of the table saying why (no timing)."""
    nan = float("nan")
    return Result(w.name, peer, mode, nan, nan, nan, f"FAILED: {why}", nan, None, {"failed": True})


def failures(data: dict) -> list[dict]:
    """The rows of peers that could not be built or run, and the peak-memory runs that failed."""
    return [r for r in data["results"] if r.get("extra", {}).get("failed")] + data.get("memory_failures", [])


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM). Unlike getrusage's ru_maxrss, which
    Linux carries across fork + exec from the parent, VmHWM starts afresh at exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory(w: Workload, peer: str, backward: bool) -> float | None:
    """Peak RSS (MiB) of one call in a fresh process."""
    code = (
        "import sys, torch; from multihead.apps.bench import bench; "
        f"w = bench.workloads(['W4'], ({w.Lq},))[0]; base = torch.nn.MultiheadAttention(w.E, w.H, batch_first=True); "
        f"p = bench.PEERS[{peer!r}](w, base); "
        "p is None and sys.exit(3); mod, call, _ = p; "
        f"x, y = bench._inputs(w, {backward}); bench._step(call, x, y, {backward}); "
        "print(bench.peak_rss_mib())"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "KERAS_BACKEND": "torch"})
    if r.returncode == 3:  # the peer does not run this workload
        return None
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise RuntimeError(f"peak-memory run of {peer} ({'fwd+bwd' if backward else 'fwd'}) ended with code "
                           f"{r.returncode}: {tail}")
    return float(r.stdout.strip().splitlines()[-1])


def remeasure_memory(out: Path, peers: list[str] | None = None, log=print) -> dict:
    """Measure W4's peak memory again into an existing ``out/bench.json`` (timings kept)."""
    data = json.loads((out / "bench.json").read_text())
    lengths = sorted({int(r["workload"].split("-")[1]) for r in data["results"] if r["workload"].startswith("W4-")})
    for w in workloads(["W4"], tuple(lengths)):
        for r in data["results"]:
            if r["workload"] == w.name and (peers is None or r["peer"] in peers):
                r["peak_mib"] = peak_memory(w, r["peer"], r["mode"] == "fwd+bwd")
                log(f"  {w.name} {r['mode']:8} {r['peer']:20} peak RSS {r['peak_mib']} MiB")
    _write(data, out, log)
    return data


def _write(data: dict, out: Path, log=print) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(data, indent=2))
    (out / "bench.md").write_text(markdown(data))
    (out / "summary.md").write_text(summary(data))
    chart(data, out / "bench.png")
    log(f"wrote {out / 'bench.md'}, {out / 'summary.md'}, {out / 'bench.json'}, {out / 'bench.png'}")


def run(names: list[str], *, reps: int = 20, out: Path = Path("bench/results"), memory: bool = True,
        peers: list[str] | None = None, lengths: tuple[int, ...] = (4096, 8192), log=print,
        compile: bool = False, decode_steps: int = 256, decode_batches: tuple[int, ...] = (1, 16),
        cpp_wrapper: bool = False, decode_rounds: int = 3, decode_recompute: bool = True) -> dict:
    peers = peers or list(PEERS)
    torch.set_num_threads(torch.get_num_threads())
    info = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "multihead": multihead.__version__,
        "matmul_gflops": round(matmul_gflops(), 1), "reps": reps,
    }
    log(f"machine: {info['threads']} threads, fp32 matmul {info['matmul_gflops']} GFLOP/s, torch {info['torch']}")
    if "W5" in names:  # decoding: its own runner and table
        from multihead.apps.bench import decode_bench

        names = [n for n in names if n != "W5"]
        d = decode_bench.run(batches=decode_batches, steps=decode_steps, rounds=decode_rounds, log=log,
                             recompute=decode_recompute)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode.json").write_text(json.dumps({"machine": info, **d}, indent=2))
        (out / "decode.md").write_text(decode_bench.markdown(d))
        log(f"wrote {out / 'decode.md'}")
        if not names:
            return {"machine": info, "decode": d}
    results: list[Result] = []
    mem_failed: list[dict] = []
    for w in workloads(names, lengths):
        log(f"{w.name}: B={w.B} Lq={w.Lq} Lk={w.Lk} E={w.E} H={w.H} ({w.note})")
        results += time_workload(w, peers, reps, log=log, compile=compile and not w.name.startswith("W4"),
                                 cpp_wrapper=cpp_wrapper)
        if memory and w.name.startswith("W4"):
            for peer in peers:
                for backward in (False, True):
                    if backward and peer == "FlexAttention":
                        continue
                    mode = "fwd+bwd" if backward else "fwd"
                    try:
                        mib = peak_memory(w, peer, backward)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        log(f"  {w.name} {mode:8} {peer:20} peak RSS not measured: {e}")
                        mem_failed.append({"workload": w.name, "peer": peer, "mode": mode, "why": str(e)})
                        mib = None
                    for r in results:
                        if r.workload == w.name and r.peer == peer and r.mode == mode:
                            r.peak_mib = mib
                    log(f"  {w.name} {mode:8} {peer:20} peak RSS {mib} MiB")
    data = {"machine": info, "results": [r.__dict__ for r in results], "memory_failures": mem_failed}
    _write(data, out, log)
    bad = failures(data)
    if bad:
        log(f"{len(bad)} peer runs failed (rows marked FAILED in {out / 'bench.md'})")
    if any(r["peer"].startswith("multihead") for r in bad if "peer" in r):
        raise RuntimeError(f"multihead itself failed in the benchmark: {[r.get('ran', r.get('why')) for r in bad]}")
    return data


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"Machine: {m['threads']} threads, fp32 matmul {m['matmul_gflops']} GFLOP/s, torch {m['torch']}; "
        f"median of {m['reps']} interleaved calls (min-max); ratio = time / torch.nn.MultiheadAttention's.",
        "",
        "| workload | mode | peer | median ms | min-max ms | ratio | peak RSS MiB | what ran |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in data["results"]:
        if r.get("extra", {}).get("failed"):
            lines.append(f"| {r['workload']} | {r['mode']} | {r['peer']} | — | — | — | | {r['ran']} |")
            continue
        mem = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"| {r['workload']} | {r['mode']} | {r['peer']} | {r['median_ms']:.2f} | "
                     f"{r['min_ms']:.2f}-{r['max_ms']:.2f} | {r['ratio']:.2f}x | {mem} | {r['ran']} |")
    for f in data.get("memory_failures", []):
        lines.append(f"\npeak memory not measured for {f['peer']} {f['mode']} on {f['workload']}: {f['why']}")
    return "\n".join(lines) + "\n"


def summary(data: dict) -> str:
    """One row per (workload, mode), one column per peer: median ms and ratio to torch.nn.MHA."""
    rows = data["results"]
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    keys = list(dict.fromkeys((r["workload"], r["mode"]) for r in rows))
    out = ["| workload | mode | " + " | ".join(peers) + " |", "|---|---|" + "---:|" * len(peers)]
    for w, mode in keys:
        cells = []
        for p in peers:
            r = next((r for r in rows if (r["workload"], r["mode"], r["peer"]) == (w, mode, p)), None)
            if r is None:
                cells.append("—")
            elif r.get("extra", {}).get("failed"):
                cells.append("FAILED")
            else:
                mem = "" if r["peak_mib"] is None else f"<br>{r['peak_mib']:.0f} MiB"
                cells.append(f"{r['median_ms']:.1f} ms ({r['ratio']:.2f}x){mem}")
        out.append(f"| {w} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if not r.get("extra", {}).get("failed")]
    groups = sorted({(r["workload"], r["mode"]) for r in rows}, key=lambda k: (k[0], k[1] != "fwd"))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / max(1, len(peers))
    for i, p in enumerate(peers):
        xs, ys = [], []
        for j, g in enumerate(groups):
            for r in rows:
                if (r["workload"], r["mode"]) == g and r["peer"] == p:
                    xs.append(j + i * width)
                    ys.append(r["ratio"])
        ax.bar(xs, ys, width, label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], [f"{w}\n{m}" for w, m in groups], fontsize=8)
    ax.set_ylabel("time / torch.nn.MultiheadAttention")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
