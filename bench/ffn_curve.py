"""The fidelity-speed curve of heads alone against heads + feed-forward neurons, where prediction happens.

all-MiniLM-L6-v2 through ``prune --hf``'s own set-up (``multihead.apps.prune.hf_models.hf_setup``: importance on the
first 128 sentences, recovery on the next and on the standard library's docstrings, fidelity on the held-out
sentences, the installed packages' descriptions and passages: the worst kind's 95% interval counts). Heads are cut
by the pruning curve (ablation, mean replacement, one step to the largest HEADS fraction); then each FFN
fraction of every feed-forward block's neurons (``multihead.heads.prune_neurons``: variance x output-column norm,
mean replacement, verified), the model distilled STEPS steps (int8 rounding simulated) and written by
``multihead.hf.export``; its ONNX Runtime int8 file is timed against the unpruned model's (exported the same way)
at batch 1 and 16 on held-out text, interleaved, medians, with the bound of the work removed.

    .venv/bin/python bench/ffn_curve.py 0,0.3 0,0.15,0.3,0.5 300   # ~15 min on 2 cores; bench/results/ffn_curve.md
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(head_fractions: list[float], ffn_fractions: list[float], steps: int) -> None:
    import multihead.hf as mhf
    from multihead import heads, timing
    from multihead.apps.common.data import docstring_sentences, package_sentences, sentences
    from multihead.apps.prune import hf_models, target
    from multihead.deploy import compare, session
    from multihead.models import minilm_path

    torch.set_num_threads(2)
    wide = docstring_sentences(16 * steps)
    setup = hf_models.hf_setup(minilm_path(), None, 128, recover_extra=wide, held_out_extra=(
        "the installed packages' descriptions", package_sentences(300, exclude=set(sentences()) | set(wide))))
    snaps = {}
    heads.pruning_curve(setup.model, setup.batches, setup.loss_fn, setup.metric_fn, step=max(head_fractions) or 0.1,
                        max_fraction=max(head_fractions) or 0.1, method="ablation", mean_replacement=True,
                        on_step=lambda row, m: snaps.__setitem__(round(row["fraction"], 2), copy.deepcopy(m).eval()))
    inputs, _ = setup.runtime_texts
    inputs = {b: inputs[b] for b in (1, 16)}
    base = mhf.export(snaps[0.0], session.scratch())  # removed when the run ends
    rows, files, models = [], {}, {}
    for hf in head_fractions:
        for ff in ffn_fractions:
            started = time.monotonic()
            m = copy.deepcopy(snaps[min(snaps, key=lambda f, hf=hf: abs(f - hf))])  # the curve's nearest step
            if ff:
                setup.ffn_fn(m, ff)
            if hf or ff:
                setup.recover_fn(m, steps, quantize="int8")
            fid = target.fidelity(setup, m)
            key = f"{hf:.0%} heads + {ff:.0%} neurons"
            files[key] = mhf.export(m, session.scratch())
            models[key] = m
            rows.append({"model": key, "fidelity": fid, "seconds": time.monotonic() - started})
            print(f"{key}: worst kind {fid.lo:.4f} (mean {fid.mean:.4f}), {time.monotonic() - started:.0f} s",
                  flush=True)
    engines = {"unpruned": session.ort_session(base["onnx_int8"])}
    engines |= {k: session.ort_session(f["onnx_int8"]) for k, f in files.items()}
    table = {}
    for B, batches in inputs.items():
        calls = {k: (lambda e=e, xs=batches: [e(b["input_ids"], b["attention_mask"]) for b in xs])
                 for k, e in engines.items()}
        t = timing.interleaved(calls, warmup=1, max_seconds=60, min_rounds=7)
        for k in files:
            bound = (sum(compare.work(snaps[0.0], b) for b in batches)
                     / sum(compare.work(models[k], b) for b in batches))
            table[(k, B)] = (t["unpruned"].median / t[k].median, bound, t[k].median / len(batches),
                             timing.busy_note({k: t[k], "unpruned": t["unpruned"]}))
    flags = "VNNI" if "avx512_vnni" in Path("/proc/cpuinfo").read_text() else "AVX2, no VNNI"
    lines = [f"Heads alone against heads + feed-forward neurons, all-MiniLM-L6-v2, {steps} recovery steps each, ONNX "
             f"Runtime int8 files against the unpruned model's int8 file ({flags}, 2 threads; `bench/ffn_curve.py`)",
             "", "| model | fidelity: worst kind's 95% interval (mean) | batch 1: speed-up of a bound (ms) | batch 16 |",
             "|---|---|---:|---:|"]
    for r in rows:
        k, fid = r["model"], r["fidelity"]
        cells = [f"{table[(k, B)][0]:.2f}x of {table[(k, B)][1]:.2f}x ({table[(k, B)][2]:.1f})" for B in (1, 16)]
        lines.append(f"| {k} | {fid.lo:.4f}-{fid.hi:.4f} ({fid.mean:.4f}, {fid.kind}) | " + " | ".join(cells) + " |")
    notes = sorted({n for v in table.values() if (n := v[3])})
    lines += [""] + [f"note: {n}" for n in notes]
    out = Path(__file__).parent / "results" / "ffn_curve.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main([float(x) for x in sys.argv[1].split(",")], [float(x) for x in sys.argv[2].split(",")], int(sys.argv[3]))
