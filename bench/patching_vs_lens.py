"""Activation patching of every head, multihead against TransformerLens, on the same GPT-2 weights: time per
experiment (the clean run with its cache, then every head patched over all positions), interleaved rounds
(median, min-max), the two results compared. TransformerLens runs one forward per head; multihead batches the
patches along the batch dimension (``chunk`` a forward, never spanning two layers) and runs the layers before a
patch once, at the base run's batch (checked on the first chunk against the whole forward); timed twice, called as
TransformerLens calls the model (every position's logits) and, since the metric reads the last position only, with
``run=`` passing transformers' ``logits_to_keep=1``.

    .venv/bin/python bench/patching_vs_lens.py            # GPT-2 small's shape: 12 layers x 12 heads, E = 768,
                                                          # vocabulary 50257, 4 sequences of 32 tokens
    .venv/bin/python bench/patching_vs_lens.py --tiny     # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--chunk", type=int, default=16, help="multihead's patches per forward")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2 small's by default)")
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--out", default="bench/results/patching_vs_lens")
    a = ap.parse_args(argv)
    import transformer_lens.patching as tl_patching
    import transformers as T
    from transformer_lens.model_bridge import TransformerBridge

    import multihead.hf as mhf
    from multihead import heads, timing
    from multihead.deploy.session import scratch  # removed when the run ends

    layers, H, E, L, B = (2, 4, 32, 8, 2) if a.tiny else (12, 12, 768, 32, 4)
    torch.manual_seed(0)
    V = 50 if a.tiny else a.vocab
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=max(L, 16), n_embd=E, n_layer=layers,
                                           n_head=H)).eval()  # sdpa, as transformers loads it: nothing forced eager
    folder = scratch()
    model.save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(folder, hf_model=copy.deepcopy(model), device="cpu")
    ours = mhf.attach(copy.deepcopy(model))
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, V, (B, L), generator=g)
    corrupted = clean.clone()
    corrupted[:, L // 4: L // 2] = torch.randint(0, V, (B, L // 2 - L // 4), generator=g)

    def lens():
        _, cache = bridge.run_with_cache(clean)
        return tl_patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, cache,
                                                               lambda lg: (lg[:, -1, 3] - lg[:, -1, 5]).mean())

    def multihead_patch():
        return heads.patch(ours, {"input_ids": clean}, {"input_ids": corrupted},
                           lambda out: out.logits[:, -1, 3] - out.logits[:, -1, 5], chunk=a.chunk)

    def last_logits(model, inputs):  # the metric reads the last position: transformers' logits_to_keep=1
        return model(**inputs, logits_to_keep=1)

    def multihead_last():
        return heads.patch(ours, {"input_ids": clean}, {"input_ids": corrupted},
                           lambda out: out.logits[:, -1, 3] - out.logits[:, -1, 5], chunk=a.chunk, run=last_logits)

    with torch.no_grad():
        want = lens().double()
        diff = max(float((f().grid() - want).abs().max()) for f in (multihead_patch, multihead_last))
    t = timing.interleaved({"TransformerLens": lens, "multihead": multihead_patch, "last": multihead_last},
                           warmup=1, min_rounds=3, max_rounds=10, max_seconds=a.max_seconds)
    tl = t["TransformerLens"]
    row = {"model": f"GPT-2 {layers} layers x {H} heads, E={E}, vocabulary {V}", "batch": B, "length": L,
           "chunk": a.chunk, "lens_ms": round(tl.median, 1), "rounds": tl.n, "max_abs_diff": diff}
    for key, name in (("multihead", "multihead"), ("last", "multihead_last_logits")):
        mh = t[key]
        row |= {f"{name}_ms": round(mh.median, 1), f"{name}_speedup": round(tl.median / mh.median, 2),
                f"{name}_speedup_range": [round(tl.min / mh.max, 2), round(tl.max / mh.min, 2)]}
    md = ("| model | B x L | TransformerLens ms | multihead ms (speed-up, min-max) | multihead, logits of the last "
          "position only (`run=`, `logits_to_keep=1`) | rounds | max difference |\n|---|---:|---:|---:|---:|---:|---:|\n"
          f"| {row['model']} | {B} x {L} | {row['lens_ms']} | " + " | ".join(
              f"{row[n + '_ms']} ({row[n + '_speedup']:.2f}x, {row[n + '_speedup_range'][0]:.2f}-"
              f"{row[n + '_speedup_range'][1]:.2f})" for n in ("multihead", "multihead_last_logits"))
          + f" | {row['rounds']} | {diff:.1e} |\n")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "patching_vs_lens.json").write_text(json.dumps(row, indent=1))
    (out / "patching_vs_lens.md").write_text(md)
    print(md)
    return row


if __name__ == "__main__":  # the benchmark's own process: both cores (a caller keeps its threads)
    torch.set_num_threads(2)
    main()
