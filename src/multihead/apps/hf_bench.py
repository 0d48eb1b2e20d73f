"""W7 of ``multihead bench``: a sentence encoder from transformers, as a practitioner serves it.

all-MiniLM-L6-v2 (the ``pretrained`` extra) at batch 16 on mixed-length sentences that no
pruning step saw (the held-out part of the corpus, as ``prune --hf`` splits it), under
``torch.inference_mode``. Peers, timed in the same process, interleaved after a warm-up, median
and min-max per batch of 16: transformers' sdpa (the reference, 1.00x), the model attached to
multihead (padded), attached padding-free (``attach(packed=True)``), and — with ``--pruned DIR``,
a directory written by ``multihead prune --hf ... --quantize int8`` — that pruned, recovered,
int8 model loaded with ``multihead.hf.load``; and with the onnx extra, ONNX Runtime's int8 model of
the unpruned checkpoint (exported by ``multihead.hf.export_onnx``, ``onnxruntime.quantization.quantize_dynamic``,
idle workers not spinning). Fidelity: mean cosine of mean-pooled last hidden
states to the sdpa model's on every timed sentence.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from multihead.apps import hf_models
from multihead.apps.ort_peer import ort_int8


def _pooled(model, batch) -> torch.Tensor:
    """Mean-pooled, normalised last hidden states (B, E): prune --hf's fidelity measure."""
    return hf_models.pooled(model, batch["input_ids"], batch["attention_mask"])


def run(pruned: str | Path | None = None, *, batch: int = 16, n_batches: int = 8, max_seconds: float = 60.0,
        log: Callable[[str], None] = print) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from multihead.extras import require

    require("transformers", "hf")
    import transformers

    import multihead.hf as mhf
    from multihead.apps import timing
    from multihead.apps.data import sentences
    from multihead.models import minilm_path

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    corpus = sentences()
    held_out = corpus[128 + min(256, len(corpus) // 4):]  # prune --hf's default split: never used for pruning
    sents = held_out[: batch * n_batches]
    encoded = [tok(sents[i:i + batch], padding=True, truncation=True, max_length=128, return_tensors="pt")
               for i in range(0, len(sents), batch)]
    batches = [{"input_ids": e["input_ids"], "attention_mask": e["attention_mask"]} for e in encoded]  # (B, L) each
    models = {
        "transformers (sdpa)": transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval(),
        "multihead, padded": mhf.attach(transformers.AutoModel.from_pretrained(path).eval()),
        "multihead, padding-free": mhf.attach(transformers.AutoModel.from_pretrained(path).eval(), packed=True),
    }
    if pruned is not None:
        m = mhf.load(pruned)
        heads = sum(a.attention_hooks.num_heads for a in mhf.attention_modules(m).values())
        from multihead.quantize import is_quantized

        models[f"multihead, {heads}/72 heads, {is_quantized(m) or 'fp32'}, padding-free"] = m
    try:  # ONNX Runtime's int8 model of the unpruned checkpoint (the onnx extra), as a practitioner would make it
        models["ONNX Runtime int8 (unpruned)"] = ort_int8(models["multihead, padded"], batches[0])
    except ImportError as e:
        log(f"  ONNX Runtime not timed: {e}")
    lengths = [int(b["attention_mask"].sum(1).min()) for b in batches], [int(b["attention_mask"].sum(1).max())
                                                                         for b in batches]
    log(f"W7: all-MiniLM-L6-v2, {len(batches)} batches of {batch} held-out sentences, {min(lengths[0])}-"
        f"{max(lengths[1])} tokens, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        ref = torch.cat([_pooled(models["transformers (sdpa)"], b) for b in batches])
        fidelity = {n: float((torch.cat([_pooled(m, b) for b in batches]) * ref).sum(-1).mean())
                    for n, m in models.items()}
        calls = {n: (lambda m=m: [m(**b) for b in batches]) for n, m in models.items()}
        t = timing.interleaved(calls, max_seconds=max_seconds)
    base = t["transformers (sdpa)"].median
    rows = []
    for n in models:
        tm = t[n].scaled(1 / len(batches))
        rows.append({"peer": n, "cosine": round(fidelity[n], 4), "ms_per_batch": tm.to_json(),
                     "speedup": round(base / t[n].median, 3),
                     "speedup_range": [round(base / t[n].max, 3), round(base / t[n].min, 3)]})
        log(f"  {n:45} cosine {fidelity[n]:.4f}  {tm.median:7.1f} ms/batch  {base / t[n].median:.2f}x "
            f"({base / t[n].max:.2f}-{base / t[n].min:.2f})")
    return {"workload": "W7", "batch": batch, "batches": len(batches), "threads": torch.get_num_threads(),
            "rows": rows, "busy": timing.busy_note(t)}


def markdown(r: dict) -> str:
    lines = [f"W7: all-MiniLM-L6-v2 through transformers, batch {r['batch']} of held-out mixed-length sentences, "
             f"{r['threads']} threads, inference_mode; speed-up = transformers sdpa's time / the peer's (median, "
             "range over interleaved rounds)", "",
             "| peer | mean cosine to sdpa | ms per batch (median, min-max) | speed-up |", "|---|---:|---:|---:|"]
    for row in r["rows"]:
        ms = row["ms_per_batch"]
        lines.append(f"| {row['peer']} | {row['cosine']:.4f} | {ms['median_ms']:.1f} ({ms['min_ms']:.1f}-"
                     f"{ms['max_ms']:.1f}) | {row['speedup']:.2f}x ({row['speedup_range'][0]:.2f}-"
                     f"{row['speedup_range'][1]:.2f}) |")
    if r.get("busy"):
        lines += ["", f"note: {r['busy']}"]
    return "\n".join(lines) + "\n"
