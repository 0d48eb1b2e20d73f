"""Half the heads of a ViT cut by ``heads.observe`` + ``heads.prune``: speed against the unpruned
model at batch 1 and 32, interleaved rounds (median, min-max), and pruned = gated.

Two architectures at their real sizes, random weights, written in their libraries' styles (timm and
torchvision cannot be installed beside this project's CPU build of torch: their PyPI wheels' compiled
ops need torch's CUDA libraries): ViT-S/16 as timm builds it (a fused ``qkv`` Linear, then
``F.scaled_dot_product_attention``) and ViT-B/16 as torchvision builds it (``nn.MultiheadAttention``
called with ``need_weights=False``). The heads cut are each layer's least important by entropy of their
attention on random images (the speed does not depend on which).

    .venv/bin/python bench/vit_pruning.py                  # about 4 minutes on 2 cores
    .venv/bin/python bench/vit_pruning.py --tiny           # a smoke run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from multihead import heads
from multihead.apps import timing


class TimmAttention(nn.Module):
    """timm's ``Attention``: qkv (B, N, 3, H, D) -> SDPA -> proj."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, D)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, D)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))  # (B, N, H D) -> (B, N, E)


class TorchvisionAttention(nn.Module):
    """torchvision's use of ``nn.MultiheadAttention`` in its ViT ``EncoderBlock``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.self_attention = nn.MultiheadAttention(dim, num_heads, batch_first=True)

    def forward(self, x):
        return self.self_attention(x, x, x, need_weights=False)[0]


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim, eps=1e-6), attn, nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding (a strided conv), a class token, position embeddings, blocks, a head."""

    def __init__(self, attn_cls, dim: int, depth: int, num_heads: int, image: int = 224, patch: int = 16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(attn_cls(dim, num_heads), dim) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 1000)

    def forward(self, images):  # (B, 3, S, S)
        x = self.patch(images).flatten(2).transpose(1, 2)  # (B, E, S/p, S/p) -> (B, N, E)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos  # (B, N + 1, E)
        return self.head(self.norm(self.blocks(x))[:, 0])


def architectures(tiny: bool) -> dict[str, tuple]:
    if tiny:
        return {"timm ViT-S/16 (tiny)": (TimmAttention, 48, 2, 6, 32), "torchvision ViT-B/16 (tiny)":
                (TorchvisionAttention, 48, 2, 4, 32)}
    return {"timm ViT-S/16": (TimmAttention, 384, 12, 6, 224), "torchvision ViT-B/16": (TorchvisionAttention, 768, 12,
                                                                                          12, 224)}


def measure(name: str, spec: tuple, batches: list[int], max_seconds: float) -> list[dict]:
    attn_cls, dim, depth, H, image = spec
    torch.manual_seed(0)
    model = ViT(attn_cls, dim, depth, H, image=image).eval()
    probe = torch.randn(2, 3, image, image)
    found = heads.observe(model, probe)
    ent = heads.importance(model, [probe], lambda m, b: m(b).sum(), "entropy", progress=False)
    cut = {n: [int(h) for h in s.argsort()[: len(s) // 2]] for n, s in zip(ent.names, ent.scores)}
    gates = {n: torch.ones(m.attention_hooks.num_heads) for n, m in found.items()}
    for n, hs in cut.items():
        gates[n][hs] = 0.0
    with torch.no_grad(), heads.gated(model, gates):
        gated = model(probe)
    pruned = ViT(attn_cls, dim, depth, H, image=image).eval()
    pruned.load_state_dict(model.state_dict())
    heads.observe(pruned, probe)
    heads.prune(pruned, cut)
    heads.unobserve(model)  # the unpruned model as its users run it (no hooks)
    with torch.no_grad():
        diff = float((pruned(probe) - gated).abs().max())
    rows = []
    for B in batches:
        x = torch.randn(B, 3, image, image)
        with torch.inference_mode():
            t = timing.interleaved({"unpruned": lambda x=x: model(x), "pruned": lambda x=x: pruned(x)}, warmup=1,
                                   min_rounds=5, max_rounds=15, max_seconds=max_seconds)
        u, p = t["unpruned"], t["pruned"]
        rows.append({"model": name, "batch": B, "heads": f"{sum(len(c) for c in cut.values())} of {depth * H} cut",
                     "unpruned_ms": round(u.median, 2), "pruned_ms": round(p.median, 2),
                     "speedup": round(u.median / p.median, 3),
                     "speedup_range": [round(u.min / p.max, 3), round(u.max / p.min, 3)],
                     "rounds": u.n, "pruned_minus_gated": diff, "settled": u.stable and p.stable})
        print(rows[-1], flush=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | heads | unpruned ms | pruned ms | speed-up (min-max) | rounds | pruned - gated |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["speedup_range"]
        note = "" if r["settled"] else " (not settled)"
        lines.append(f"| {r['model']} | {r['batch']} | {r['heads']} | {r['unpruned_ms']} | {r['pruned_ms']} | "
                     f"{r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}){note} | {r['rounds']} | {r['pruned_minus_gated']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small models, for a smoke run")
    ap.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="timing budget per model and batch size")
    ap.add_argument("--out", default="bench/results/vit_pruning", help="folder for vit_pruning.json / .md")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    batches = [int(b) for b in a.batches.split(",")]
    rows = [r for name, spec in architectures(a.tiny).items() for r in measure(name, spec, batches, a.max_seconds)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vit_pruning.json").write_text(json.dumps(rows, indent=1))
    (out / "vit_pruning.md").write_text(to_markdown(rows))
    print(to_markdown(rows))
    return out


if __name__ == "__main__":
    main()
