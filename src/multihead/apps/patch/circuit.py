"""``multihead circuit --hf DIR``: the circuit of a behaviour in a local transformers causal language model, from two
texts of the same length and a metric named on the command line (read as ``multihead patch`` reads them): every edge
scored (EAP or EAP-IG), the circuit of ``--budget`` of the edges kept as MIB builds it (the top edges by |score| less
those on no input-to-logits path: ``EdgeScores.circuit``'s default) and checked by intervention (its faithfulness f),
the faithfulness curve over MIB's budgets with CPR and CMD for that construction and EAP-IG's greedy one. Writes
OUT/circuit.json, circuit.md, circuit.png, circuit.html, curve.png and explorer.html (the clean run's heads, the
circuit's outlined). MIB's way: ``--mib`` scores MIB's graph (a key and a value reader per query head) and writes
OUT/importances.json, the graph file MIB's evaluator reads (``heads.write_mib_graph``); ``--pairs FILE`` (JSON lines
``{"clean": ..., "corrupted": ..., "answers": [A, B]}``) scores a dataset of prompt pairs, padded, each at its last
real token, averaged (``heads.dataset_attribution``), in place of one --clean/--corrupted/--metric."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["FILES", "METHODS", "MIB_FILE", "checked", "read_pairs", "run"]

#: the scoring methods the command takes (heads.edge_attribution's)
METHODS = ("eap", "eap-ig", "atp*")
#: the files the command writes into OUT
FILES = ("circuit.json", "circuit.md", "circuit.png", "circuit.html", "curve.png", "explorer.html")
#: with --mib, also: MIB's graph file (the name MIB's run_evaluation.py looks for)
MIB_FILE = "importances.json"


def checked(method: str, steps: int, budget: str | float) -> float:
    """The options refused before anything loads, one line each: an unknown method, steps < 1, a budget outside
    (0, 100%]. Returns the budget as a fraction of the edges."""
    from multihead.heads.circuits import _budget

    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}; got {method!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be a whole number >= 1 (EAP-IG's integration points); got {steps!r}.")
    try:
        return _budget(budget)
    except ValueError:
        raise ValueError(f"--budget must be a share of the edges in (0, 100%], e.g. 1% or 0.01; got {budget!r}.") \
            from None


def _kept_nodes(layout: dict) -> tuple[list[str], list[str]]:
    """The heads and the MLPs the circuit's edges touch (a key/value edge touches every head of its group)."""
    heads = [n["id"] for n in layout["nodes"] if n["kind"] == "head" and n["kept"]]
    mlps = [n["id"] for n in layout["nodes"] if n["kind"] == "mlp" and n["kept"]]
    return heads, mlps


def _markdown(record: dict, scores) -> str:
    c, cur = record["circuit"], record["curve"]
    lines = [f"# Circuit: {record['metric']}", "",
             f"clean: `{record['clean']}`; corrupted: `{record['corrupted']}`; {record['direction']}: base "
             f"{record['base']:.4f}, source {record['source']:.4f}", "",
             "| method | steps | budget | edges kept | f at the budget | CPR | CMD |",
             "|---|---:|---:|---:|---:|---:|---:|",
             f"| {record['method']} | {record['steps']} | {record['budget']:.2%} | {c['kept']} of {c['total']} | "
             f"{c['f']:.4f} | {cur['cpr']:.4f} | {cur['cmd']:.4f} |", "",
             f"Kept heads ({len(c['heads'])}): {', '.join(c['heads']) or 'none'}" +
             (f"; MLPs: {', '.join(c['mlps'])}" if c["mlps"] else ""), "",
             "f = (m(C) - m(empty)) / (m(N) - m(empty)): the clean run with every edge outside the circuit patched from "
             f"the corrupted run (m(C) {c['circuit_metric']:.4f}, m(N) {c['full']:.4f}, m(empty) {c['empty']:.4f}).",
             "", "## The curve", "", _curve_table(cur), "", f"## The top {min(20, len(scores.edges))} edges", "",
             scores.to_markdown(20), ""]
    return "\n".join(lines)


def _curve_table(cur: dict) -> str:
    cs = cur["constructions"]
    lines = ["| budget | " + " | ".join(f"{h} edges | {h} f" for h in cs) + " |", "|---:|" + "---:|---:|" * len(cs)]
    for i, b in enumerate(cur["budgets"]):
        lines.append(f"| {b:.1%} | " + " | ".join(f"{c['kept'][i]} | {c['f'][i]:.4f}" for c in cs.values()) + " |")
    areas = "; ".join(f"{h}: CPR {c['cpr']:.4f}, CMD {c['cmd']:.4f}" for h, c in cs.items())
    return "\n".join(lines) + f"\n\n{areas} (CPR higher better, CMD 0 best)"


def _record(scores, f: dict, curve, layout: dict, *, path, clean: str, corrupted: str, what: str, budget: float) -> dict:
    heads, mlps = _kept_nodes(layout)
    return {
        "model": str(path), "clean": clean, "corrupted": corrupted, "metric": what, "method": scores.method,
        "steps": scores.steps, "direction": scores.direction, "budget": budget, "base": scores.base,
        "source": scores.source,
        "nodes": {"writers": scores.graph.writers, "readers": scores.graph.readers},
        "edges": [[w, r, s] for (w, r), s in zip(scores.edges, scores.scores.tolist(), strict=True)],
        "circuit": {"edges": [[w, r] for w, r in f["edges"]], "kept": f["result"].kept, "total": f["result"].total,
                    "f": f["result"].f, "circuit_metric": f["result"].circuit, "full": f["result"].full,
                    "empty": f["result"].empty, "heads": heads, "mlps": mlps},
        "curve": {"budgets": curve.budgets, "how": curve.how, "kept": curve.kept, "f": curve.f, "full": curve.full,
                  "empty": curve.empty, "cpr": curve.cpr, "cmd": curve.cmd,
                  "constructions": {h: {"kept": c.kept, "f": c.f, "cpr": c.cpr, "cmd": c.cmd}
                                    for h, c in curve.curves.items()}},
    }


def read_pairs(file: str | Path) -> list[dict]:
    """The prompt pairs of a JSON-lines file, one ``{"clean": TEXT, "corrupted": TEXT, "answers": [A, B]}`` a line;
    a line otherwise is refused naming its number."""
    rows = []
    for i, line in enumerate(Path(file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not {"clean", "corrupted", "answers"} <= set(row):
            raise ValueError(f"--pairs {file}: line {i} is not a JSON object with clean, corrupted and answers "
                             '(e.g. {"clean": "...", "corrupted": "...", "answers": [" Mary", " John"]}).')
        rows.append(row)
    if not rows:
        raise ValueError(f"--pairs {file}: no pairs in it (one JSON object a line).")
    return rows


def _dataset(path, pairs_file, *, method, steps, frac, mib, batch_size):
    """--pairs: the model, its tokenizer, the pairs (checked before the model loads), scores, the circuit, f, curve."""
    import transformers

    import multihead.hf as mhf
    from multihead import heads
    from multihead.apps.prune.hf_models import _tokenizer

    rows = read_pairs(pairs_file)
    tok, _ = _tokenizer(Path(path))
    pairs = heads.prompt_pairs([r["clean"] for r in rows], [r["corrupted"] for r in rows],
                               [tuple(r["answers"]) for r in rows], tokenizer=tok)
    model = mhf.attach(transformers.AutoModelForCausalLM.from_pretrained(path).eval())
    scores = heads.dataset_attribution(model, pairs, method=method, steps=steps, batch_size=batch_size, ungroup=mib)
    kept = scores.circuit(frac)
    f = heads.dataset_faithfulness(model, pairs, kept, ungroup=mib, batch_size=batch_size)
    curve = heads.dataset_faithfulness_curve(model, pairs, scores, batch_size=batch_size)
    n = int(pairs.lengths[0])
    first = {"input_ids": pairs.clean[:1, :n], "attention_mask": torch.ones(1, n, dtype=torch.long)}
    what = f"logit(answer) - logit(corrupted answer), {len(pairs)} pairs"
    return model, tok, scores, kept, f, curve, first, what, rows[0]


def run(path: str | Path, clean: str | None, corrupted: str | None, metric: str | None, out: str | Path, *,
        method: str = "eap-ig", steps: int = 5, budget: str | float = "1%", mib: bool = False,
        pairs: str | Path | None = None, batch_size: int = 16) -> dict:
    """Find the circuit in the model at ``path``; writes OUT/circuit.json (loads back with :func:`json.load`: every
    edge with its score, the circuit kept with its f, the curve), circuit.md, circuit.png, circuit.html, curve.png and
    explorer.html; with ``mib``, on MIB's graph, and OUT/importances.json (``heads.read_mib_graph`` reads it back);
    with ``pairs`` (a JSON-lines file, :func:`read_pairs`), over that dataset instead of ``clean``/``corrupted``/
    ``metric``. Returns the record written to circuit.json."""
    import multihead
    from multihead import heads
    from multihead.apps.patch.patching import _last_logits_only, load
    from multihead.viz import circuit_figure, circuit_html, circuit_layout, explorer, faithfulness_figure

    frac = checked(method, steps, budget)
    one = (clean, corrupted, metric)
    if (pairs is None and None in one) or (pairs is not None and any(x is not None for x in one)):
        raise ValueError("give --clean, --corrupted and --metric (one pair), or --pairs FILE (a dataset), not both.")
    if pairs is not None:
        model, tok, scores, kept, f, curve, first, what, row = _dataset(path, pairs, method=method, steps=steps,
                                                                        frac=frac, mib=mib, batch_size=batch_size)
        clean, corrupted, inputs = row["clean"], row["corrupted"], [first]
    else:
        model, inputs, fn, what, tok = load(path, clean, corrupted, metric, command="circuit",
                                            why="edges are compared position by position")
        call = _last_logits_only(model) if metric != "loss" else None
        scores = heads.edge_attribution(model, inputs[0], inputs[1], fn, method=method, steps=steps, run=call,
                                        ungroup=mib)
        kept = scores.circuit(frac)
        f = heads.faithfulness(model, inputs[0], inputs[1], fn, kept, run=call, ungroup=mib)
        curve = heads.faithfulness_curve(model, inputs[0], inputs[1], fn, scores, run=call)
    layout = circuit_layout(scores, kept)
    record = _record(scores, {"edges": kept, "result": f}, curve, layout, path=path, clean=clean, corrupted=corrupted,
                     what=what, budget=frac)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "circuit.json").write_text(json.dumps(record, indent=1))
    (out / "circuit.md").write_text(_markdown(record, scores))
    if mib:
        heads.write_mib_graph(scores, out / MIB_FILE, kept)
    title = f"{what}: {len(kept)} of {len(scores.edges)} edges ({method}), f = {f.f:.3f}"
    circuit_figure(scores, kept, title=title).savefig(out / "circuit.png", dpi=110)
    circuit_html(scores, kept, out / "circuit.html", title=f"multihead circuit: {title}")
    faithfulness_figure(curve, at=(frac, f.f)).savefig(out / "curve.png", dpi=110)
    with torch.no_grad(), multihead.capture(model) as cap:  # the clean run's heads, the circuit's outlined
        model(**inputs[0])
    tokens = [tok.decode([i]) for i in inputs[0]["input_ids"][0].tolist()]
    score = dict(zip(scores.edges, scores.scores.tolist(), strict=True))
    explorer(cap, tokens, out / "explorer.html", circuit=[(w, r, score[w, r]) for w, r in kept],
             title=f"multihead circuit: {what}")
    print(_markdown(record, scores).split("## The curve")[0].rstrip())
    print(f"wrote {', '.join(str(out / n) for n in FILES + ((MIB_FILE,) if mib else ()))}")
    return record
