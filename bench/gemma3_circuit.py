"""The IOI circuit of Gemma 3 270M (base) by EAP-IG (:mod:`multihead.heads.circuits`), a family whose blocks normalise
the attention's and the MLP's outputs before the residual add: each reader's input is rebuilt with that norm run on
its own patched sum of the layer's heads, and EAP-IG's gradient is taken through it.

The graph: the embedding, 18 layers x 4 heads' outputs and 18 MLPs (each with its norm after it) -> each head's query,
the key/value group's key and value (1 group of 4 query heads a layer: one receiver), each MLP's input, the logits.
The metric logit(IO) - logit(S) at the last position on one batch of generated IOI prompts (:mod:`multihead.apps.common.ioi`,
one template); scores denoise; f = (m(C) - m(empty)) / (m(N) - m(empty)) at MIB's budgets for MIB's pruned and
EAP-IG's greedy circuits (``faithfulness_curve``), with both ends checked (no edge: the corrupted run; every edge:
the clean run) and the top edges' EAP-IG scores beside exact edge patching.

    nice -n 5 .venv/bin/python bench/gemma3_circuit.py   # writes bench/results/gemma3_circuit.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import multihead.hf as mhf
    from multihead.models import gemma3_path

    path = gemma3_path()
    tok = AutoTokenizer.from_pretrained(path)
    return tok, mhf.attach(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="IOI prompts (one template: one batch)")
    ap.add_argument("--steps", type=int, default=5, help="EAP-IG's integration points")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/gemma3_circuit.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from multihead import heads
    from multihead.apps.common import ioi

    t0 = time.monotonic()
    tok, model = _load()
    b = ioi.batches(tok, ioi.make(a.prompts, tok, seed=0, templates=ioi.TEMPLATES[:1]))[0]
    clean, corrupted = {"input_ids": b["input_ids"]}, {"input_ids": b["corrupted_ids"]}

    def metric(out):
        return ioi.logit_diff(out.logits.float(), b)

    def run(m, x):
        return m(**x, logits_to_keep=1)  # the last position's logits only: the metric reads nothing else

    t = time.monotonic()
    s = heads.edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=a.steps, run=run)
    t_scores = time.monotonic() - t
    t = time.monotonic()
    curve = heads.faithfulness_curve(model, clean, corrupted, metric, s, run=run)
    t_curve = time.monotonic() - t
    none = heads.faithfulness(model, clean, corrupted, metric, [], run=run)
    every = heads.faithfulness(model, clean, corrupted, metric, s.edges, run=run)
    top = [e[:2] for e in s.top(5)]
    exact = heads.patch_edges(model, clean, corrupted, metric, top, run=run)
    lines = [
        "# The IOI circuit of Gemma 3 270M by EAP-IG (norms after the attention and the MLP)", "",
        f"`nice -n 5 python bench/gemma3_circuit.py --prompts {a.prompts} --steps {a.steps}` "
        f"({time.monotonic() - t0:.0f} s, {torch.get_num_threads()} threads; scores {t_scores:.0f} s, curve "
        f"{t_curve:.0f} s; load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}).", "",
        f"{len(b['io'])} IOI prompts of {b['input_ids'].shape[1]} tokens; {len(s.edges)} edges; m(N) (clean) "
        f"{curve.full:+.4f}, m(empty) (corrupted) {curve.empty:+.4f}. Ends, patched: no edge kept "
        f"{none.circuit:+.6f} (off the corrupted run by {abs(none.circuit - none.empty):.1e}), every edge "
        f"{every.circuit:+.6f} (off the clean run by {abs(every.circuit - every.full):.1e}).", "",
        curve.to_markdown(), "",
        "| top edge (EAP-IG) | EAP-IG | exact edge patching |", "|---|---:|---:|",
        *[f"| {w} -> {r} | {v:.4f} | {x:.4f} |" for (w, r), v, x in
          zip(top, s.scores[s.graph.index(top)].tolist(), exact.scores.tolist(), strict=True)],
    ]
    text = "\n".join(lines) + "\n"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
