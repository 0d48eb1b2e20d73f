"""Issue 80's batch-1 cell: is one more pruned ONNX form fastest at batch 1, 16 and 64 at once? A pruned
all-MiniLM-L6-v2 folder (``prune --hf`` wrote it) in ONNX Runtime int8, every form multihead writes (the SDPA graph, the
eager graph, ONNX Runtime's fused attention) beside candidates -- the eager graph through ONNX Runtime's transformer
optimizer with attention fusion off and its other fusions on (LayerNorm, skip + LayerNorm, bias + GELU, embeddings:
``FusionOptions.enable_attention = False``), the same with attention and layer norms fused but GELU and the embeddings
not, and per-tensor int8 (``quantize_dynamic(per_channel=False)``) of the eager and fused forms -- against the fastest
standard int8 file of the unpruned model (the eager export, plain and after the optimizer), interleaved rounds per
batch size, each file's speed-up over that peer the median of the rounds' ratios with its 95% interval, and each
file's mean cosine to the unpruned torch model on unseen text.

    .venv/bin/python bench/serve_forms.py --pruned OUT/model [--rounds 30] [--calls 32] [--per-tensor] [--out FILE]

Two threads, ONNX Runtime's workers not spinning; run it when nothing else runs (the spreads say how quiet it was)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pruned", required=True, help="the folder prune --hf wrote (OUT/model)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds per batch size")
    p.add_argument("--calls", type=int, default=32, help="batch-1 calls in a round (one sentence each)")
    p.add_argument("--per-tensor", action="store_true", help="per-tensor int8 of the eager and fused forms too")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue80_minilm_xeon" / "serve_forms.md"))
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    import transformers
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    import multihead.hf as mhf
    from multihead import timing
    from multihead.apps.common.data import package_sentences, sentences
    from multihead.deploy import compare, peers, session
    from multihead.deploy.onnx import quantize_standard
    from multihead.models import minilm_path

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    peer = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    full = mhf.attach(transformers.AutoModel.from_pretrained(path).eval())
    kept = mhf.load(a.pruned, quantized=False)
    unseen = package_sentences(200, exclude=set(sentences()))

    def enc(items):
        return {k: v for k, v in tok(items, padding=True, truncation=True, max_length=128, return_tensors="pt").items()
                if k in ("input_ids", "attention_mask")}

    inputs = {1: [enc(unseen[i:i + 1]) for i in range(a.calls)], 16: [enc(unseen[i:i + 16]) for i in (0, 16)],
              64: [enc(unseen[:64])]}
    scored = [enc(unseen[i:i + 16]) for i in range(0, 192, 16)]
    d = session.scratch()  # removed when the run ends
    std = peers.standard_files(peer, scored[0], openvino=False)
    files = mhf.export(kept, d / "pruned", openvino=False, serve=False)
    said = {}

    def fused(out: Path, **off) -> Path:  # the eager graph through ORT's optimizer, the fusions named in ``off`` off
        options = FusionOptions("bert")
        for name in off:
            setattr(options, name, False)
        m = optimizer.optimize_model(str(files["onnx_eager"]), model_type="bert", num_heads=0, hidden_size=0,
                                     optimization_options=options)
        said[out.name] = {k: v for k, v in m.get_fused_operator_statistics().items() if v}
        m.save_model_to_file(str(out))
        return out

    fused(d / "eager_fused.onnx", enable_attention=False)
    fused(d / "attention_only.onnx", enable_gelu=False, enable_bias_gelu=False, enable_embed_layer_norm=False)
    fused(d / "attention_embed.onnx", enable_gelu=False, enable_bias_gelu=False)
    fused(d / "attention_gelu.onnx", enable_embed_layer_norm=False)
    fused(d / "norms_only.onnx", enable_attention=False, enable_gelu=False, enable_bias_gelu=False,
          enable_embed_layer_norm=False)

    def int8(name: str) -> Path:
        return quantize_standard(d / f"{name}.onnx", d / f"{name}_int8.onnx", matmul_only=True)

    def per_tensor(source: Path, out: Path) -> Path:
        quantize_dynamic(str(source), str(out), weight_type=QuantType.QInt8, per_channel=False,
                         extra_options={"DefaultTensorType": 1}, op_types_to_quantize=["MatMul", "Attention"])
        return out

    forms = {"standard: eager attention + quantize_dynamic": std["onnx_eager_int8"],
             "standard: eager attention + ORT optimizer + quantize_dynamic": std["onnx_eager_optimized_int8"],
             "pruned: SDPA graph, int8 (model_int8.onnx)": files["onnx_int8"],
             "pruned: eager graph, int8 (model_eager_int8.onnx)": files["onnx_eager_int8"],
             "pruned: fused attention, int8 (model_optimized_int8.onnx)": files["onnx_optimized_int8"],
             "pruned: eager graph + fusions but attention, int8": int8("eager_fused"),
             "pruned: fused attention and layer norms, no GELU or embedding fusion, int8": int8("attention_only"),
             "pruned: fused attention, layer norms and embeddings, no GELU fusion, int8": int8("attention_embed"),
             "pruned: fused attention, layer norms and GELU, no embedding fusion, int8": int8("attention_gelu"),
             "pruned: layer norms fused only, int8": int8("norms_only")}
    if a.per_tensor:
        forms |= {"pruned: eager graph, per-tensor int8": per_tensor(files["onnx_eager"], d / "eager_pt.onnx"),
                  "pruned: eager graph + fusions but attention, per-tensor int8": per_tensor(
                      d / "eager_fused.onnx", d / "eager_fused_pt.onnx"),
                  "pruned: fused attention, per-tensor int8": per_tensor(files["onnx_optimized"],
                                                                         d / "optimized_pt.onnx")}
    models = {k: session.ort_session(f) for k, f in forms.items()}
    with torch.no_grad():
        want = [compare.pooled(full, b["input_ids"], b["attention_mask"]) for b in scored]
        cosine = {k: float(torch.cat([(compare.pooled(m, b["input_ids"], b["attention_mask"]) * w).sum(-1)
                                      for b, w in zip(scored, want)]).mean()) for k, m in models.items()}
    rows, peer_of = {}, {}
    for B, xs in inputs.items():
        calls = {k: (lambda m=m, xs=xs: [m(b["input_ids"], b["attention_mask"]) for b in xs]) for k, m in models.items()}
        t = timing.interleaved(calls, warmup=2, min_rounds=a.rounds, max_rounds=a.rounds, max_seconds=1e9,
                               progress=f"batch {B}")
        peer_of[B] = min((k for k in t if k.startswith("standard")), key=lambda k: t[k].median)
        for k, tm in t.items():
            s, lo, hi = timing.paired(t[peer_of[B]], tm)
            rows.setdefault(k, {})[B] = (tm.median / len(xs), tm.min / len(xs), tm.max / len(xs), s, lo, hi, tm.n)
    flags = " ".join(timing.cpu_flags()) or platform.processor()
    lines = [f"all-MiniLM-L6-v2, the folder {a.pruned}; CPU: {platform.machine()} {flags}, torch {torch.__version__}, "
             f"2 threads; {a.rounds} interleaved rounds per batch size; load average at the end "
             f"{os.getloadavg()[0]:.1f}", "",
             f"ONNX Runtime's optimizer fused, per file: {said}",
             "",
             "The peer at each batch size is the fastest standard int8 file: " + "; ".join(
                 f"batch {B}: {k.removeprefix('standard: ')}" for B, k in peer_of.items()), "",
             "| file | " + " | ".join(f"batch {B}: ms (min-max), speed-up over the peer (95% interval)" for B in inputs)
             + " | mean cosine, unseen |", "|---|" + "---:|" * (len(inputs) + 1)]
    for k, per in rows.items():
        lines.append(f"| {k} | " + " | ".join(
            f"{ms:.2f} ({lo_ms:.2f}-{hi_ms:.2f}), {s:.3f}x ({lo:.3f}-{hi:.3f})"
            for ms, lo_ms, hi_ms, s, lo, hi, _ in (per[B] for B in inputs)) + f" | {cosine[k]:.4f} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    command = f"`python bench/serve_forms.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
    Path(a.out).write_text(command + "\n\n" + text)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
