"""Activation patching of every head, multihead against TransformerLens, on the same GPT-2 weights: time per
experiment (the clean run with its cache, then every head patched over all positions), interleaved rounds
(median, min-max), the two results compared. TransformerLens runs one forward per head; multihead batches the
patches along the batch dimension (``chunk`` a forward) and runs the blocks before a patch once, at the base run's
batch (checked on the first chunk against the whole forward).

    .venv/bin/python bench/patching_vs_lens.py            # GPT-2 small's shape: 12 layers x 12 heads, E = 768
    .venv/bin/python bench/patching_vs_lens.py --tiny     # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--chunk", type=int, default=16, help="multihead's patches per forward")
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--out", default="bench/results/patching_vs_lens")
    a = ap.parse_args(argv)
    import transformer_lens.patching as tl_patching
    import transformers as T
    from transformer_lens.model_bridge import TransformerBridge

    import multihead.hf as mhf
    from multihead import heads
    from multihead.apps import timing

    layers, H, E, L, B = (2, 4, 32, 8, 2) if a.tiny else (12, 12, 768, 32, 4)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=1000, n_positions=max(L, 16), n_embd=E, n_layer=layers,
                                           n_head=H)).eval()  # sdpa, as transformers loads it: nothing forced eager
    folder = tempfile.mkdtemp()
    model.save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(folder, hf_model=copy.deepcopy(model), device="cpu")
    ours = mhf.attach(copy.deepcopy(model))
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 1000, (B, L), generator=g)
    corrupted = clean.clone()
    corrupted[:, L // 4: L // 2] = torch.randint(0, 1000, (B, L // 2 - L // 4), generator=g)

    def lens():
        _, cache = bridge.run_with_cache(clean)
        return tl_patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, cache,
                                                               lambda lg: (lg[:, -1, 3] - lg[:, -1, 5]).mean())

    def multihead_patch():
        return heads.patch(ours, {"input_ids": clean}, {"input_ids": corrupted},
                           lambda out: out.logits[:, -1, 3] - out.logits[:, -1, 5], chunk=a.chunk)

    with torch.no_grad():
        diff = float((multihead_patch().grid() - lens().double()).abs().max())
    t = timing.interleaved({"TransformerLens": lens, "multihead": multihead_patch}, warmup=1, min_rounds=3,
                           max_rounds=10, max_seconds=a.max_seconds)
    tl, mh = t["TransformerLens"], t["multihead"]
    row = {"model": f"GPT-2 {layers} layers x {H} heads, E={E}", "batch": B, "length": L, "chunk": a.chunk,
           "lens_ms": round(tl.median, 1), "multihead_ms": round(mh.median, 1),
           "speedup": round(tl.median / mh.median, 2),
           "speedup_range": [round(tl.min / mh.max, 2), round(tl.max / mh.min, 2)], "rounds": tl.n,
           "max_abs_diff": diff}
    md = ("| model | B x L | TransformerLens ms | multihead ms | speed-up (min-max) | rounds | max difference |\n"
          "|---|---:|---:|---:|---:|---:|---:|\n"
          f"| {row['model']} | {B} x {L} | {row['lens_ms']} | {row['multihead_ms']} | {row['speedup']:.2f}x "
          f"({row['speedup_range'][0]:.2f}-{row['speedup_range'][1]:.2f}) | {row['rounds']} | {diff:.1e} |\n")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "patching_vs_lens.json").write_text(json.dumps(row, indent=1))
    (out / "patching_vs_lens.md").write_text(md)
    print(md)
    return row


if __name__ == "__main__":  # the benchmark's own process: both cores (a caller keeps its threads)
    torch.set_num_threads(2)
    main()
