"""The runtime table of issue 63 on all-MiniLM-L6-v2: the standard export of the unpruned model (``torch.onnx.export``
+ ``quantize_dynamic`` per channel, and after ONNX Runtime's transformer optimizer), multihead's export of the unpruned
model and of a pruned one, in ONNX Runtime fp32 and int8 at batch 1, 16 and 64 on unseen text, each speed-up over the
peer beside the bound of the work removed, the pruned files' cosine on that text, and the CPU's flags.

    .venv/bin/python bench/export_vs_standard.py [--fraction 0.4] [--pruned OUT/model] [--keep-per-layer N]
        [--max-seconds 20] [--min-rounds 7] [--batches 1 16 64] [--calls 8] [--openvino]

Without ``--pruned`` the cut is ``--fraction`` of the heads, least important by ablation (mean replacement) on 64
sentences, with no recovery (a speed measurement: the fidelity is the zero-shot one); with it, the folder ``prune
--hf`` wrote (its float weights). ``--keep-per-layer N`` keeps the first N heads of every layer instead: with N = 1,
the most a cut of heads can give in each runtime, beside the bound of that cut (its fidelity is not the point).
Two threads, ONNX Runtime's workers not spinning, rounds interleaved (at least ``--min-rounds`` per batch size unless
``--max-seconds`` runs out first), each speed-up the median of the rounds' ratios with its 95% interval."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch


def _flags() -> str:
    want = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")
    try:
        have = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return platform.processor()
    return " ".join(f for f in want if f in have) or "none of " + ", ".join(want)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fraction", type=float, default=0.4)
    p.add_argument("--pruned", default=None)
    p.add_argument("--keep-per-layer", type=int, default=None,
                   help="keep the first N heads of every layer (a ceiling of what cutting heads gives)")
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--min-rounds", type=int, default=7)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], choices=[1, 16, 64])
    p.add_argument("--calls", type=int, default=8,
                   help="batch-1 calls in each round (one sentence each; more average a short call's jitter)")
    p.add_argument("--openvino", action="store_true",
                   help="OpenVINO's rows too (fp32, and NNCF's static int8 calibrated on 64 training sentences)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    import transformers

    import multihead.hf as mhf
    from multihead import heads
    from multihead.apps import deploy, hf_models, runtimes
    from multihead.apps.data import package_sentences, sentences
    from multihead.models import minilm_path

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    peer = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    full = mhf.attach(transformers.AutoModel.from_pretrained(path).eval())
    corpus = sentences()
    calib = [dict(tok(corpus[i:i + 16], padding=True, return_tensors="pt")) for i in range(0, 64, 16)]
    if a.pruned:
        kept, how = mhf.load(a.pruned, quantized=False), f"the folder {a.pruned}"
    elif a.keep_per_layer is not None:
        import copy

        kept, n = copy.deepcopy(full), full.config.num_attention_heads
        if not 1 <= a.keep_per_layer <= n:
            raise SystemExit(f"--keep-per-layer: got {a.keep_per_layer}; give 1 to {n} (the heads of a layer)")
        heads.prune(kept, {name: list(range(a.keep_per_layer, n)) for name, _ in kept.named_modules()
                           if name.endswith("attention.self")})
        how = f"every layer's first {a.keep_per_layer} of {n} heads kept, no recovery"
    else:
        batches = [((b["input_ids"], b["attention_mask"]), None) for b in calib]

        def loss(m, b):
            (ids, am), _ = b
            with torch.no_grad():
                ref = hf_models.pooled(full, ids, am)
            return 1 - (hf_models.pooled(m, ids, am) * ref).sum(-1).mean()

        import copy

        kept = copy.deepcopy(full)
        fill = heads.mean_head_outputs(kept, batches, loss)
        imp = heads.importance(kept, batches, loss, "ablation", fill=fill, progress=False)
        n = round(a.fraction * 72)
        heads.prune(kept, imp.least(n), mean_outputs=fill)
        how = f"{n} of 72 heads cut by ablation order, no recovery"
    unseen = package_sentences(200, exclude=set(corpus))
    sizes = {B: n for B, n in {1: a.calls, 16: 2, 64: 1}.items() if B in a.batches}
    inputs = {B: [{k: v for k, v in tok(unseen[i:i + B], padding=True, truncation=True, max_length=128,
                                         return_tensors="pt").items() if k in ("input_ids", "attention_mask")}
                  for i in range(0, B * n, B)] for B, n in sizes.items()}
    kinds = {"unseen package descriptions": [{k: v for k, v in tok(unseen[i:i + 16], padding=True, truncation=True,
                                                                 max_length=128, return_tensors="pt").items()
                                              if k in ("input_ids", "attention_mask")} for i in range(0, 192, 16)]}
    d = runtimes.scratch()  # removed when the run ends
    ov = {"calibration": calib, "openvino": True} if a.openvino else {"openvino": False}
    standard = runtimes.standard_files(peer, next(iter(kinds.values()))[0], ov.get("calibration"), openvino=ov["openvino"])
    base = mhf.export(full, d / "unpruned", **ov)
    files = mhf.export(kept, d / "pruned", **ov)
    rows = deploy.compare(full, kept, standard, base, files, inputs, max_seconds=a.max_seconds,
                           min_rounds=a.min_rounds, log=print)
    print(f"\nall-MiniLM-L6-v2, {how}; CPU: {platform.machine()} {_flags()}, torch {torch.__version__}, "
          f"2 threads\n")
    print(deploy.markdown(rows, deploy.fidelity(full, files, kinds)))


if __name__ == "__main__":
    main()
