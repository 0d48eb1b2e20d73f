"""Which experiment predicts a head's importance best: the importance methods side by side, each ranked against
what cutting that head alone actually costs.

For every head of a demo model (:class:`multihead.apps.prune.pruning.Setup`):

- **the cost of cutting it alone**: the model's own metric (digits reversed right, test accuracy) with that head
  gated off, subtracted from the unpruned model's (what a pruning step would lose);
- **gradient** (Michel et al. 2019: |dL/d gate|), **ablation** (the loss with the head gated off), **entropy** (a
  focused head scores higher) from :func:`multihead.heads.importance` on the setup's importance batches;
- **patching** (:func:`multihead.heads.patch`, noising: the clean run with that head's output from a run on other
  inputs; its score the drop of the setup's per-item log-probability metric).

Each method's scores are compared with the cost by Spearman's rank correlation (1: the same order), over every
head. The table and the JSON go beside the pruning report.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from multihead import heads

__all__ = ["compare", "markdown", "spearman"]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two score vectors (ties take the mean of their ranks)."""

    def ranks(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        order = x.argsort()
        r = torch.empty_like(x)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in x.unique():  # ties: each gets the mean of the ranks they share
            same = x == v
            r[same] = r[same].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return float(ra @ rb) / denom if denom > 0 else float("nan")


def _flat(scores: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([scores[n].double().flatten() for n in names])


def compare(setup, out: Path | None = None, *, progress: bool = False) -> dict:
    """The methods against the cost of cutting each head alone on ``setup``'s model (unchanged). Returns {"heads":
    [[module, head]], "cost": [...], "methods": {name: {"scores": [...], "spearman": rho}}}; with ``out``, writes
    methods.json and methods.md there."""
    model = setup.model
    mods = heads.attention_modules(model)
    names = list(mods)
    base = float(setup.metric_fn(model))
    cost = {}
    for n, m in mods.items():
        H = m.attention_hooks.num_heads if m.attention_hooks.num_heads is not None else m.num_heads
        drops = []
        for h in range(H):
            g = torch.ones(H)
            g[h] = 0.0
            with torch.no_grad(), heads.gated(model, {n: g}):
                drops.append(base - float(setup.metric_fn(model)))
        cost[n] = torch.tensor(drops)
    truth = _flat(cost, names)
    scores = {}
    for method in ("gradient", "ablation", "entropy"):
        imp = heads.importance(model, setup.batches, setup.loss_fn, method, progress=progress)
        scores[method] = _flat(dict(zip(imp.names, imp.scores)), names)
    if setup.patch_pair is not None:
        clean, corrupted, metric = setup.patch_pair
        r = heads.patch(model, clean, corrupted, metric, direction="noise")
        scores["patching"] = _flat({n: r.base - v for n, v in r.values.items()}, names)  # what noising it costs
    result = {"metric": setup.metric_name, "unpruned": base,
              "heads": [[n, h] for n in names for h in range(len(cost[n]))], "cost": truth.tolist(),
              "methods": {k: {"scores": v.tolist(), "spearman": spearman(v, truth)} for k, v in scores.items()}}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "methods.json").write_text(json.dumps(result, indent=1))
        (out / "methods.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    """The comparison as a table: each method's Spearman correlation with the cost of cutting a head alone, and
    whether it names the costliest head."""
    cost = torch.tensor(result["cost"])
    worst = int(cost.argmax())
    head = result["heads"][worst]
    lines = [f"# Which experiment predicts a head's importance ({len(cost)} heads)", "",
             f"The cost of cutting a head alone: {result['metric']} of the unpruned model ({result['unpruned']:.4f}) "
             f"minus that with the head gated off; the costliest is {head[0]} head {head[1]} ({cost.max():.4f}).",
             "", "| method | Spearman's rank correlation with the cost | its top head |", "|---|---:|---|"]
    for name, m in sorted(result["methods"].items(), key=lambda kv: -kv[1]["spearman"]):
        top = result["heads"][int(torch.tensor(m["scores"]).argmax())]
        lines.append(f"| {name} | {m['spearman']:.2f} | {top[0]} head {top[1]}"
                     + (" (the costliest)" if top == head else "") + " |")
    return "\n".join(lines) + "\n"
