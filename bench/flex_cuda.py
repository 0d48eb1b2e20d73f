"""FlexAttention against SDPA on CUDA, the measurement behind "auto"'s choice there: ``python bench/flex_cuda.py [OUT]``.

Needs a CUDA GPU (``tools/gpu_check.py`` is its correctness twin). For each mask kind at a size practitioners
use, ``multihead.attention`` with ``backend="sdpa"`` (the mask as SDPA's boolean ``attn_mask``) and with
``backend="flex"`` (compiled once per shape, block mask cached), forward under ``inference_mode`` and
forward + backward, timed with CUDA events in interleaved rounds (median and min-max). Also: what flex's
compile costs on the first call at a new sequence length (it is compiled with ``dynamic=False``: every new
(B, Lq, Lk) compiles again), and which head sizes its CUDA kernel takes. Writes ``flex_cuda.md`` and
``flex_cuda.json`` to OUT (default ``bench/results/flex_cuda``).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import multihead  # noqa: E402
from multihead import masks  # noqa: E402
from multihead.backends import flex  # noqa: E402

ROUNDS, ITERS = 5, 10


def cases(dev):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(128, 513, (8,), generator=g).to(dev)
    return [  # (name, B, H, L, D, mask)
        ("padding (valid lengths 128-512)", 8, 12, 512, 64, masks.ValidLens(lens)),
        ("key padding (same lengths)", 8, 12, 512, 64,
         masks.KeyPadding(torch.arange(512, device=dev) < lens[:, None])),
        ("causal + valid lengths", 8, 12, 512, 64, masks.Causal() & masks.ValidLens(lens)),
        ("sliding window 256, L 4096", 2, 16, 4096, 64, masks.SlidingWindow(256, 0)),
        ("causal, L 4096", 2, 16, 4096, 64, masks.Causal()),
    ]


def timed(fn, *args) -> float:
    """ms per call of fn(*args), ITERS calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / ITERS


def measure(name, B, H, L, D, mask, dtype, dev) -> list[dict]:
    """Forward and forward + backward rows for one case: sdpa, flex and auto interleaved."""
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, L, D, device=dev, dtype=dtype)

    def fwd(backend):
        with torch.inference_mode():
            return multihead.attention(q.detach(), k.detach(), v.detach(), mask, backend=backend)

    def fwd_bwd(backend):
        out = multihead.attention(q, k, v, mask, backend=backend)
        torch.autograd.backward(out, do)

    err = (fwd("flex").float() - fwd("sdpa").float()).abs().max().item()
    rows = []
    for label, f in (("forward", fwd), ("forward+backward", fwd_bwd)):
        f("flex"), f("sdpa"), f("auto")  # compiles, block masks, choices
        torch.cuda.synchronize()
        t = {b: [] for b in ("sdpa", "flex", "auto")}
        for _ in range(ROUNDS):
            for b in t:
                t[b].append(timed(f, b))
        med = {b: statistics.median(x) for b, x in t.items()}
        text = str(multihead.explain(q, k, v, mask, training=label != "forward"))
        rows.append({"case": name, "dtype": str(dtype)[6:], "pass": label, "B": B, "H": H, "L": L, "D": D,
                     "ms": {b: [round(med[b], 3), round(min(x), 3), round(max(x), 3)] for b, x in t.items()},
                     "sdpa/flex": round(med["sdpa"] / med["flex"], 2),
                     "auto runs": text.split("runs:")[1].split()[0] if "runs:" in text else "?",
                     "max |flex - sdpa|": err})
        print(rows[-1], flush=True)
    return rows


def cell(ms, b) -> str:
    return f"{ms[b][0]:.3f} ({ms[b][1]:.3f}-{ms[b][2]:.3f})"


def main(out: str = "bench/results/flex_cuda") -> None:
    dev = "cuda"
    # every (mask kind, size, dtype) here is one compile of flex (dynamic=False); torch's default limit of 8
    # would make the later ones run flex's unfused eager form, and this measures the compiled kernels
    torch._dynamo.config.recompile_limit = 64
    rows, probe, compile_s = [], {}, {}
    for name, B, H, L, D, mask in cases(dev):
        for dtype in (torch.bfloat16, torch.float32):
            rows += measure(name, B, H, L, D, mask, dtype, dev)
    # a new sequence length: one compile each (dynamic=False)
    for L in (300, 301):
        q, k, v = (torch.randn(4, 12, L, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            multihead.attention(q, k, v, masks.ValidLens(torch.tensor([L, L // 2, 7, L], device=dev)), backend="flex")
        torch.cuda.synchronize()
        compile_s[f"first call at L={L} (forward)"] = round(time.perf_counter() - t0, 2)
    # head sizes the CUDA kernel takes (forward + backward, straight to the kernel, no fallback)
    for D in (8, 15, 16, 20, 24, 40, 48, 80, 96, 128, 192, 256):
        q, k, v = (torch.randn(2, 4, 128, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        try:
            o = flex.run(q, k, v, masks.ValidLens(torch.tensor([128, 60], device=dev)), scale=D ** -0.5, dropout_p=0.0)
            o.sum().backward()
            probe[D] = "ok"
        except Exception as e:  # recorded: which sizes it refuses is the result
            probe[D] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    print(compile_s, probe, flush=True)
    p = pathlib.Path(out)
    p.mkdir(parents=True, exist_ok=True)
    dev_name = torch.cuda.get_device_name()
    (p / "flex_cuda.json").write_text(json.dumps({"device": dev_name, "torch": torch.__version__, "rows": rows,
                                                  "compile_s": compile_s, "head_sizes": probe}, indent=1))
    lines = [f"FlexAttention vs SDPA through `multihead.attention`, {dev_name}, torch {torch.__version__}; ms per call, "
             f"median (min-max) over {ROUNDS} interleaved rounds of {ITERS} calls; sdpa/flex > 1: flex is faster.",
             "", "| mask | dtype | pass | sdpa ms | flex ms | auto ms | sdpa/flex | auto runs |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['case']} | {r['dtype']} | {r['pass']} | {cell(ms, 'sdpa')} | {cell(ms, 'flex')} | "
                     f"{cell(ms, 'auto')} | "
                     f"{r['sdpa/flex']} | {r['auto runs']} |")
    lines += ["", "First flex call at a new length (compile): " + json.dumps(compile_s),
              "", "Head sizes flex's CUDA kernel takes (forward + backward): " + json.dumps(probe)]
    (p / "flex_cuda.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:])
