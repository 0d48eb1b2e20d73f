"""Where multihead's own batch-1 call spends its time: kernels against Python, beside ONNX Runtime's file.

A directory written by ``prune --hf ... --quantize int8`` (``DIR``), loaded as users load it
(``multihead.hf.load``: padding-free, int8) and served (``multihead.hf.serve``), and its ONNX Runtime int8 file
(``DIR/onnx/model_int8.onnx``), each called on the same held-out sentences one at a time. The wall time per call
(median of interleaved rounds) is split with ``torch.profiler`` into the time inside ATen operators (the kernels,
summed self CPU time of the top-level ops) and the rest (Python: modules, hooks, the plan, the tokens' bookkeeping).

    .venv/bin/python bench/batch1_profile.py OUT/model   # ~1 min; writes bench/results/batch1_profile.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _kernel_ms(model, batches) -> float:
    """Milliseconds per call spent inside ATen operators (self CPU time of every op, summed), profiled."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches:
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "quantized::"))]
    return sum(e.self_cpu_time_total for e in ops) / 1e3 / len(batches)


def main(model_dir: str) -> None:
    import transformers

    import multihead.hf as mhf
    from multihead import timing
    from multihead.apps.common.data import sentences
    from multihead.deploy import session

    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    held = sentences()[400:432]
    batches = [{k: v for k, v in tok([s], return_tensors="pt").items() if k in ("input_ids", "attention_mask")}
               for s in held]
    loaded = mhf.load(model_dir)
    models = {"multihead.hf.load (padding-free, int8)": loaded, "multihead.hf.serve (int8)": mhf.serve(loaded),
              "ONNX Runtime int8 file": session.ort_session(Path(model_dir) / "onnx" / "model_int8.onnx")}
    calls = {n: (lambda m=m: [m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]) for b in batches])
             for n, m in models.items()}
    with torch.no_grad():
        t = timing.interleaved(calls, warmup=2, max_seconds=60)
    lines = [f"Batch 1 on {len(batches)} held-out sentences, {model_dir}, 2 threads "
             f"({'VNNI' if 'avx512_vnni' in Path('/proc/cpuinfo').read_text() else 'AVX2, no VNNI'}; "
             "`bench/batch1_profile.py`)", "", "| model | ms per call (median, min-max) | in ATen kernels | the rest |",
             "|---|---:|---:|---:|"]
    for n, m in models.items():
        wall = t[n].median / len(batches)
        if isinstance(m, torch.nn.Module):
            k = _kernel_ms(m, batches)
            split = f"{k:.2f} ms ({k / wall:.0%}) | {wall - k:.2f} ms ({1 - k / wall:.0%})"
        else:
            split = "- | -"
        lines.append(f"| {n} | {wall:.2f} ({t[n].min / len(batches):.2f}-{t[n].max / len(batches):.2f}) | {split} |")
    note = timing.busy_note(t)
    lines += [""] + ([f"note: {note}"] if note else [])
    out = Path(__file__).parent / "results" / "batch1_profile.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
