"""Where the served int8 model's time goes, and how far another int8 kernel would take it. A measurement, not a feature.

Issue 35 asks for 3.5x transformers' sdpa at batch 16 and for batch 1 ahead of ONNX Runtime int8. The served
pruned model (``multihead.hf.serve(multihead.hf.load(DIR))``) computes only the real tokens, so each of its int8
products is an (M, K) x (K, N) product with M the batch's real tokens. For every product of every layer (the fused
query/key/value, the output, the feed-forward's up and down), at the M of real held-out batches of 1, 16 and 64
sentences, this times, interleaved in one process:

- PyTorch's dynamic int8 kernel (fbgemm here), called as the served encoder calls it (``quantize.linear``);
- ONNX Runtime's ``DynamicQuantizeMatMul`` (com.microsoft) holding the same int8 rows and per-row scales (IO
  binding, no copies; its activations use all 8 bits, its own choice);
- float32 ``F.linear`` on the dequantized weights (MKL).

Then the whole served encoder and transformers' ``BertModel`` (sdpa, fp32) on the same batches, interleaved: the
products' share of the served time, and the ceiling "the served encoder with ONNX Runtime's products in place of
PyTorch's" = served - Σ fbgemm + Σ ONNX Runtime, as a speed-up over sdpa. Each kernel's result is compared with
the float product of the dequantized weights (relative error), so the timed graphs compute the same product.

    .venv/bin/python bench/int8_kernels.py bench/results/prune_minilm_hf_target/model   # ~4 min on 2 cores
                                                                   # writes bench/results/int8_kernels.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUNDS = 9
BATCHES = (1, 16, 64)


def ort_product(w_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """An ONNX Runtime session computing x (M, K) -> x @ dequant(w).T + bias with DynamicQuantizeMatMul; w_int8 (N, K)
    int8 rows, scales (N,). Returns run(x) -> (M, N), writing into a buffer bound once per M."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    N, K = w_int8.shape
    inits = [numpy_helper.from_array(w_int8.T.contiguous().numpy(), "B"),  # (K, N)
             numpy_helper.from_array(scales.float().numpy(), "scale"),
             numpy_helper.from_array(np.zeros(N, np.int8), "zero"),
             numpy_helper.from_array((bias if bias is not None else torch.zeros(N)).detach().float().numpy(), "bias")]
    node = helper.make_node("DynamicQuantizeMatMul", ["A", "B", "scale", "zero", "bias"], ["Y"], domain="com.microsoft")
    graph = helper.make_graph([node], "product", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle workers would slow torch beside it
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    bound: dict = {}  # M -> [io binding, output (M, N), the input whose memory is bound]

    def run(x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        if M not in bound:
            y = torch.empty(M, N)
            io = session.io_binding()
            io.bind_output("Y", "cpu", 0, np.float32, (M, N), y.data_ptr())
            bound[M] = [io, y, None]
        entry = bound[M]
        if entry[2] is not x:  # bound once per input tensor (the timed loop passes the same one)
            x = x.contiguous()
            entry[0].bind_input("A", "cpu", 0, np.float32, (M, K), x.data_ptr())
            entry[2] = x
        session.run_with_iobinding(entry[0])
        return entry[1]

    return run


def products(served) -> list[tuple[str, object, object, object, int]]:
    """(name, fbgemm call, ONNX Runtime call, float call, K) for every int8 product of the served encoder
    (``multihead.hf.serve`` of a quantized model). Raises TypeError for a float layer."""
    from multihead.quantize import is_int8_linear, kernel_kind, linear

    out = []
    for i, layer in enumerate(served.layers):
        for part in ("qkv", "out", "up", "down"):
            m = getattr(layer, part)
            if m is None:
                continue
            if not is_int8_linear(m):
                raise TypeError(f"int8_kernels: layer {i}'s {part} is {type(m).__name__}, not int8: serve a model "
                                "quantized with multihead.quantize (prune --hf ... --quantize int8 writes one).")
            w = m.weight()  # (N, K) per-row qint8
            bias = None if m.bias() is None else m.bias().detach()
            wf = w.dequantize()  # (N, K)
            kind = kernel_kind(m)
            out.append((f"layer {i} {part} ({w.shape[1]}x{w.shape[0]})",
                        lambda x, m=m, kind=kind: linear(m, x, kind=kind),
                        ort_product(w.int_repr(), w.q_per_channel_scales(), bias),
                        lambda x, wf=wf, bias=bias: F.linear(x, wf, bias), w.shape[1]))
    return out


def per_call(f, x, target_s: float = 0.02) -> float:
    """Seconds per call of f(x), over enough calls to take about target_s."""
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            f(x)
        dt = time.perf_counter() - t
        if dt >= target_s or n >= 512:
            return dt / n
        n *= 2


def main(model_dir: str, rounds: int = ROUNDS) -> None:
    import transformers

    import multihead.hf as mhf
    from multihead.apps.common.data import held_out_batch
    from multihead.models import minilm_path

    torch.manual_seed(0)
    batches = {b: tuple(held_out_batch(b).values()) for b in BATCHES}  # (ids, mask): text the pruning never saw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = mhf.serve(mhf.load(model_dir))
        sdpa = transformers.AutoModel.from_pretrained(minilm_path(), attn_implementation="sdpa").eval()
    prods = products(served)
    xs = {b: {K: torch.randn(int(am.sum()), K) for K in {p[4] for p in prods}} for b, (_, am) in batches.items()}

    errors = {"fbgemm": 0.0, "ORT": 0.0}
    with torch.inference_mode():
        for _, fb, ortf, fl, K in prods:
            x = xs[16][K]
            ref = fl(x)
            for name, f in (("fbgemm", fb), ("ORT", ortf)):
                errors[name] = max(errors[name], float((f(x) - ref).norm() / ref.norm()))

        times = {(b, name, e): [] for b in BATCHES for name, *_ in prods for e in ("fbgemm", "ORT", "fp32")}
        whole = {(b, e): [] for b in BATCHES for e in ("served", "sdpa")}
        for r in range(rounds):
            for b, (ids, am) in batches.items():
                for name, fb, ortf, fl, K in prods:
                    x = xs[b][K]
                    for e, f in (("fbgemm", fb), ("ORT", ortf), ("fp32", fl)):
                        times[b, name, e].append(per_call(f, x))
                for e, f in (("served", served), ("sdpa", sdpa)):
                    whole[b, e].append(per_call(lambda a, f=f: f(input_ids=a[0], attention_mask=a[1]), (ids, am), 0.05))
            print(f"round {r + 1}/{rounds}", flush=True)

    med = {k: statistics.median(v) * 1e3 for k, v in {**times, **whole}.items()}  # ms
    lines = [
        f"Int8 products of the served pruned model ({model_dir}; `bench/int8_kernels.py`), {torch.get_num_threads()} "
        f"threads, inference mode, medians of {rounds} interleaved rounds, ms. Relative error against the float product "
        f"of the dequantized weights, the worst product at batch 16: PyTorch fbgemm {errors['fbgemm']:.4f}, ONNX Runtime "
        f"{errors['ORT']:.4f} (its 16-bit pair sums saturate on a CPU without VNNI; see the script's docstring).",
        "",
        "| batch | real tokens M | Σ products: PyTorch int8 | ONNX Runtime int8 | fp32 | PyTorch / ONNX Runtime "
        "(min-max by round) | served encoder | transformers sdpa | served speed-up (min-max) | products' share "
        "| speed-up with ONNX Runtime's products (ceiling; min-max) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    for b, (_, am) in batches.items():
        by_round = {e: [sum(times[b, n, e][r] for n, *_ in prods) for r in range(rounds)] for e in ("fbgemm", "ORT")}
        served_r, sdpa_r = whole[b, "served"], whole[b, "sdpa"]
        s = {e: sum(med[b, n, e] for n, *_ in prods) for e in ("fbgemm", "ORT", "fp32")}
        served_ms, sdpa_ms = med[b, "served"], med[b, "sdpa"]
        kernel = spread([f / o for f, o in zip(by_round["fbgemm"], by_round["ORT"])])
        speed = spread([d / v for d, v in zip(sdpa_r, served_r)])
        ceiling = spread([d / (v - f + o) for d, v, f, o in zip(sdpa_r, served_r, by_round["fbgemm"], by_round["ORT"])])
        lines.append(f"| {b} | {int(am.sum())} | {s['fbgemm']:.2f} | {s['ORT']:.2f} | {s['fp32']:.2f} | {kernel} | "
                     f"{served_ms:.2f} | {sdpa_ms:.2f} | {speed} | {s['fbgemm'] / served_ms:.0%} | {ceiling} |")
    for b in (1, 16):
        lines += ["", f"Per product at batch {b} (M = {int(batches[b][1].sum())}), ms: PyTorch int8 / ONNX Runtime int8 "
                  "/ fp32 (PyTorch's time over ONNX Runtime's)", "",
                  "| product | PyTorch int8 | ONNX Runtime int8 | fp32 | ratio |", "|---|---:|---:|---:|---:|"]
        for name, *_ in prods:
            a, o, f32 = (med[b, name, e] for e in ("fbgemm", "ORT", "fp32"))
            lines.append(f"| {name} | {a:.3f} | {o:.3f} | {f32:.3f} | {a / o:.2f} |")
    out = Path(__file__).parent / "results" / "int8_kernels.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/prune_minilm_hf_target/model")
