"""Half the heads of a ViT cut by ``heads.observe`` + ``heads.prune``: speed against the unpruned
model at batch 1 and 32, interleaved rounds (median, min-max), and pruned = gated.

The real packages (the ``vision`` extra), random weights at their real sizes: timm's
``vit_small_patch16_224`` and ``deit_small_patch16_224`` (timm's ``Attention``, fused attention on: one
``F.scaled_dot_product_attention`` call, as timm runs it by default) and torchvision's ``vit_b_16``
(``nn.MultiheadAttention`` called with ``need_weights=False``). The heads cut are each layer's least important
by entropy of their attention on random images (the speed does not depend on which). The bound beside each
speed-up is the arithmetic one: the multiply-adds of the pruned model against the unpruned one's
(``torch.utils.flop_counter``), so "1.20x of a 1.25x bound" says how much of the work removed became time.

    .venv/bin/python bench/vit_pruning.py                  # about 5 minutes on 2 cores
    .venv/bin/python bench/vit_pruning.py --tiny           # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from multihead import heads, timing
from multihead.deploy.compare import flops

#: (package, model name, create kwargs for --tiny)
MODELS = {
    "timm vit_small_patch16_224": ("timm", "vit_small_patch16_224",
                                   dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=6)),
    "timm deit_small_patch16_224": ("timm", "deit_small_patch16_224",
                                    dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=6)),
    "torchvision vit_b_16": ("torchvision", "vit_b_16",
                             dict(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=48, mlp_dim=96)),
}


def build(package: str, name: str, tiny: dict | None) -> tuple[torch.nn.Module, int]:
    """The model with random weights (tiny: the given sizes) and its image side."""
    torch.manual_seed(0)
    if package == "timm":
        import timm

        model = timm.create_model(name, pretrained=False, **(tiny or {}))
        side = (tiny or {}).get("img_size", 224)
    else:
        import torchvision

        # vit_b_16 fixes its sizes (patch 16, 12 layers of 12 heads, 768 wide); the tiny one is the same class smaller
        model = torchvision.models.VisionTransformer(**tiny) if tiny else getattr(torchvision.models, name)(weights=None)
        side = (tiny or {}).get("image_size", 224)
    return model.eval(), side


def work(model: torch.nn.Module, x: torch.Tensor) -> float:
    """FLOPs of one forward on ``x``, attention included (:func:`multihead.deploy.compare.flops`)."""
    return flops(lambda: model(x))


def measure(name: str, tiny: bool, batches: list[int], max_seconds: float) -> list[dict]:
    package, model_name, small = MODELS[name]
    model, side = build(package, model_name, small if tiny else None)
    probe = torch.randn(2, 3, side, side)
    found = heads.observe(model, probe)
    ent = heads.importance(model, [probe], lambda m, b: m(b).sum(), "entropy", progress=False)
    cut = {n: [int(h) for h in s.argsort()[: len(s) // 2]] for n, s in zip(ent.names, ent.scores)}
    gates = {n: torch.ones(m.attention_hooks.num_heads) for n, m in found.items()}
    for n, hs in cut.items():
        gates[n][hs] = 0.0
    with torch.no_grad(), heads.gated(model, gates):
        gated = model(probe)
    pruned = copy.deepcopy(model)
    heads.prune(pruned, cut)
    heads.unobserve(model)  # both as their users run them (no hooks)
    heads.unobserve(pruned)
    with torch.no_grad():
        diff = float((pruned(probe) - gated).abs().max())
    total = sum(len(s) for s in ent.scores)  # heads before the cut
    rows = []
    for B in batches:
        x = torch.randn(B, 3, side, side)
        bound = work(model, x[:1]) / work(pruned, x[:1])
        with torch.inference_mode():
            t = timing.interleaved({"unpruned": lambda x=x: model(x), "pruned": lambda x=x: pruned(x)}, warmup=1,
                                   min_rounds=5, max_rounds=15, max_seconds=max_seconds)
        u, p = t["unpruned"], t["pruned"]
        rows.append({"model": name + (" (tiny)" if tiny else ""), "batch": B,
                     "heads": f"{sum(len(c) for c in cut.values())} of {total} cut",
                     "unpruned_ms": round(u.median, 2), "pruned_ms": round(p.median, 2),
                     "speedup": round(u.median / p.median, 3), "bound": round(bound, 3),
                     "speedup_range": [round(u.min / p.max, 3), round(u.max / p.min, 3)],
                     "rounds": u.n, "pruned_minus_gated": diff, "settled": u.stable and p.stable})
        print(rows[-1], flush=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | heads | unpruned ms | pruned ms | speed-up (min-max) | bound (work removed) | rounds | "
             "pruned - gated |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["speedup_range"]
        note = "" if r["settled"] else " (not settled)"
        lines.append(f"| {r['model']} | {r['batch']} | {r['heads']} | {r['unpruned_ms']} | {r['pruned_ms']} | "
                     f"{r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}){note} | {r['bound']:.2f}x | {r['rounds']} | "
                     f"{r['pruned_minus_gated']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small models, for a smoke run")
    ap.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="timing budget per model and batch size")
    ap.add_argument("--out", default="bench/results/vit_pruning", help="folder for vit_pruning.json / .md")
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    rows = [r for name in MODELS for r in measure(name, a.tiny, batches, a.max_seconds)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vit_pruning.json").write_text(json.dumps(rows, indent=1))
    (out / "vit_pruning.md").write_text(to_markdown(rows))
    print(to_markdown(rows))
    return out


if __name__ == "__main__":  # the benchmark's own process: both cores (a caller keeps its threads)
    torch.set_num_threads(2)
    main()
