"""A circuit as a picture people read: layers as rows (the embedding at the bottom, the logits on top), each head and
MLP a node, each kept edge a curve from its writer up to its reader, its width and opacity the edge's |score| (dashed
where the score is negative), its colour the reader's input: a head's query (blue), a key/value head's key (green) or
value (orange), an MLP's input (grey), the logits (purple). A key or value edge of grouped key/value heads ends under
its group (its heads joined by a bar): one receiver for the group's queries. Nodes touched by a kept edge are filled.

:func:`circuit_layout` places the nodes and edges (plain data, JSON-able); :func:`circuit_figure` draws them with
matplotlib; :func:`circuit_html` writes one self-contained page (no network: inline SVG, CSS and JS, the explorer's
approach) with pan (drag), zoom (wheel) and hover (each edge's writer, reader and score; each node's names).
:func:`faithfulness_figure` draws a faithfulness curve (:func:`multihead.heads.faithfulness_curve`).

The scores are :func:`multihead.heads.edge_attribution`'s (an :class:`~multihead.heads.EdgeScores`): read for their
graph (``units``, ``sizes``) and edges, so that this module needs nothing of :mod:`multihead.heads`.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["EDGE_COLOURS", "circuit_figure", "circuit_html", "circuit_layout", "faithfulness_figure"]

#: the colour of an edge by what it reads: a head's query, a key/value head's key or value, an MLP's input, the logits
EDGE_COLOURS = {"q": "#1f77b4", "k": "#2ca02c", "v": "#ff7f0e", "mlp": "#7f7f7f", "logits": "#9467bd"}
_PORT = {"q": -0.22, "k": 0.0, "v": 0.22}  # where a head's q/k/v input meets its node (x offset)


def _nodes(graph) -> tuple[list[dict], list[dict], dict[str, tuple], dict[str, tuple]]:
    """Rows, nodes, and where each writer leaves and each reader arrives: name -> (node ids, x, y, kind)."""
    rows, nodes, out, into = [{"y": 0.0, "label": "embed"}], [], {}, {}
    nodes.append({"id": "embed", "label": "embed", "kind": "embed", "x": 0.0, "y": 0.0, "names": ["embed"]})
    out["embed"] = (["embed"], 0.0, 0.0)
    y = 0.0
    for i, u in enumerate(graph.units):
        H, Hkv = graph.sizes[u.attn]
        y += 1.0
        rows.append({"y": y, "label": f"layer {i}"})
        xs = [h - (H - 1) / 2 for h in range(H)]
        for h, x in enumerate(xs):
            nid = f"{u.attn}.h{h}"
            nodes.append({"id": nid, "label": f"L{i}.h{h}", "kind": "head", "x": x, "y": y, "layer": i, "head": h,
                          "group": h // (H // Hkv), "names": [nid, f"{u.attn}.q{h}"]})
            out[nid] = ([nid], x, y)
            into[f"{u.attn}.q{h}"] = ([nid], x + _PORT["q"], y, "q")
        per = H // Hkv
        for g in range(Hkv):
            ids = [f"{u.attn}.h{h}" for h in range(g * per, (g + 1) * per)]
            x = sum(xs[g * per:(g + 1) * per]) / per
            for kind in "kv":
                into[f"{u.attn}.{kind}{g}"] = (ids, x + _PORT[kind], y, kind)
                next(n for n in nodes if n["id"] == ids[0])["names"].append(f"{u.attn}.{kind}{g}")
        if u.mlp is not None:
            y += 0.6
            x = (H - 1) / 2 + 1.3
            nodes.append({"id": u.mlp, "label": f"L{i} MLP", "kind": "mlp", "x": x, "y": y, "layer": i,
                          "names": [u.mlp, f"{u.mlp}.in"]})
            out[u.mlp] = ([u.mlp], x, y)
            into[f"{u.mlp}.in"] = ([u.mlp], x, y, "mlp")
    y += 1.0
    rows.append({"y": y, "label": "logits"})
    nodes.append({"id": "logits", "label": "logits", "kind": "logits", "x": 0.0, "y": y, "names": ["logits"]})
    into["logits"] = (["logits"], 0.0, y, "logits")
    return rows, nodes, out, into


def circuit_layout(scores, circuit: Sequence[Sequence] | None = None) -> dict:
    """The picture as data: ``rows`` ({y, label}: the embedding, each layer, the logits), ``nodes`` ({id, label,
    kind: embed/head/mlp/logits, x, y, names: the graph's node names drawn there, kept}), ``edges`` ({writer,
    reader, score, kind: q/k/v/mlp/logits, x1, y1 (the writer), x2, y2 (the reader)}, strongest first) and ``max``
    (the largest |score| drawn).

    scores: an :class:`~multihead.heads.EdgeScores` of every edge (:func:`multihead.heads.edge_attribution`).
    circuit: the edges drawn, (writer, reader) pairs of the graph (e.g. ``scores.circuit("5%")``); default every
        edge. An edge not in the scores is refused by name."""
    graph = scores.graph
    if not hasattr(graph, "units") or scores.method == "exact":
        raise ValueError("scores must score every edge of a graph (heads.edge_attribution's EdgeScores), not "
                         "patch_edges' chosen ones.")
    rows, nodes, out, into = _nodes(graph)
    score = dict(zip(scores.edges, scores.scores.tolist(), strict=True))
    kept = list(scores.edges) if circuit is None else [(e[0], e[1]) for e in circuit]
    edges = []
    for w, r in kept:
        if (w, r) not in score:
            raise ValueError(f"circuit edge {(w, r)!r} is not in the scores' graph (a writer to a later reader); e.g. "
                             f"{scores.edges[0]!r}.")
        (wid, x1, y1), (rid, x2, y2, kind) = out[w], into[r]
        edges.append({"writer": w, "reader": r, "score": score[(w, r)], "kind": kind, "x1": x1, "y1": y1, "x2": x2,
                      "y2": y2, "from": wid[0], "to": rid})
    edges.sort(key=lambda e: -abs(e["score"]))
    touched = {e["from"] for e in edges} | {n for e in edges for n in e["to"]}
    for n in nodes:
        n["kept"] = n["id"] in touched
    big = max((abs(e["score"]) for e in edges), default=0.0)
    return {"rows": rows, "nodes": nodes, "edges": edges, "max": big, "method": scores.method,
            "direction": scores.direction, "total": len(scores.edges)}


def _strength(e: dict, big: float) -> float:
    return abs(e["score"]) / big if big > 0 else 0.0


def circuit_figure(scores, circuit: Sequence[Sequence] | None = None, *, title: str | None = None):
    """The circuit (:func:`circuit_layout`) as a matplotlib Figure (no pyplot: the caller's backend is left alone)."""
    from multihead.extras import require

    Figure = require("matplotlib.figure", "circuit_figure").Figure
    mpath = require("matplotlib.path", "circuit_figure")
    patches = require("matplotlib.patches", "circuit_figure")
    lay = circuit_layout(scores, circuit)
    xs = [n["x"] for n in lay["nodes"]]
    top = lay["rows"][-1]["y"]
    fig = Figure(figsize=(max(5.0, 1.0 + 0.9 * (max(xs) - min(xs) + 2)), max(3.5, 1.1 * top + 1.2)))
    ax = fig.subplots()
    for e in reversed(lay["edges"]):  # the strongest drawn last, on top
        s = _strength(e, lay["max"])
        (x1, y1), (x2, y2) = (e["x1"], e["y1"] + 0.12), (e["x2"], e["y2"] - 0.12)
        mid = (y1 + y2) / 2
        p = mpath.Path([(x1, y1), (x1, mid), (x2, mid), (x2, y2)],
                       [mpath.Path.MOVETO, mpath.Path.CURVE4, mpath.Path.CURVE4, mpath.Path.CURVE4])
        ax.add_patch(patches.PathPatch(p, fill=False, lw=0.6 + 4.4 * s, alpha=0.25 + 0.75 * s,
                                       edgecolor=EDGE_COLOURS[e["kind"]], ls="--" if e["score"] < 0 else "-"))
    for n in lay["nodes"]:  # heads as discs, the rest as labelled boxes; filled where the circuit touches them
        face, ink = ("#333333", "white") if n["kept"] else ("white", "#333333")
        if n["kind"] == "head":
            ax.scatter([n["x"]], [n["y"]], s=150, facecolor=face, edgecolor="#333333", zorder=3)
            ax.text(n["x"], n["y"] + 0.14, n["label"], ha="center", va="bottom", fontsize=6, zorder=4)
        else:
            ax.text(n["x"], n["y"], n["label"], ha="center", va="center", fontsize=7, color=ink, zorder=4,
                    bbox={"boxstyle": "round,pad=0.3", "facecolor": face, "edgecolor": "#333333"})
    for g in _groups(lay["nodes"]):  # grouped key/value heads: a bar under each group
        ax.plot([g[0] - 0.15, g[1] + 0.15], [g[2] - 0.2] * 2, color="#555555", lw=1)
    ax.set_yticks([r["y"] for r in lay["rows"]], [r["label"] for r in lay["rows"]], fontsize=7)
    ax.set_xticks([])
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(-0.5, top + 0.5)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [patches.Patch(color=c, label={"mlp": "MLP input", "logits": "logits"}.get(k, f"{k} input")) for k, c in
               EDGE_COLOURS.items()]
    ax.legend(handles=handles, fontsize=6, loc="upper right", frameon=False)
    ax.set_title(title or f"{len(lay['edges'])} of {lay['total']} edges ({lay['method']}, {lay['direction']}): width "
                 "= |score|, dashed = negative", fontsize=8)
    fig.tight_layout()
    return fig


def _groups(nodes: list[dict]) -> list[tuple[float, float, float]]:
    """(x from, x to, y) of each key/value group of more than one head."""
    spans: dict[tuple, list[float]] = {}
    for n in nodes:
        if n["kind"] == "head":
            spans.setdefault((n["layer"], n["group"], n["y"]), []).append(n["x"])
    return [(min(x), max(x), key[2]) for key, x in spans.items() if len(x) > 1]


def _template() -> str:
    from importlib.resources import files

    return files("multihead.viz").joinpath("circuit.html").read_text(encoding="utf-8")


def circuit_html(scores, circuit: Sequence[Sequence] | None = None, path: str | Path | None = "circuit.html", *,
                 title: str = "multihead: circuit") -> str:
    """Write the circuit (:func:`circuit_layout`) as one self-contained HTML page to ``path`` (None: no file) and
    return the page: drag to pan, the wheel to zoom, hover an edge for its writer, reader and score, a node for its
    names; no request leaves the page (its CSP allows none)."""
    data = {"title": title, **circuit_layout(scores, circuit), "colours": EDGE_COLOURS}
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
    page = _template().replace("%TITLE%", html.escape(title)).replace("%DATA%", payload)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    return page


def faithfulness_figure(curve, *, at: tuple[float, float] | None = None, title: str | None = None):
    """A faithfulness curve (:class:`~multihead.heads.FaithfulnessCurve`) as a matplotlib Figure: f against the share
    of edges kept (log scale), one line per construction of the circuit (MIB's pruned, EAP-IG's greedy: each with its
    CPR and CMD in the legend), 1 (the whole model) and 0 (no edge: the corrupted run) marked, the first
    construction's CPR and CMD in the title; ``at``: (budget as a fraction, its f) marked (e.g. the circuit kept). Any
    object with ``budgets``, ``f``, ``cpr`` and ``cmd`` is drawn as one line."""
    from multihead.extras import require

    Figure = require("matplotlib.figure", "faithfulness_figure").Figure
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    try:  # a FaithfulnessCurve: each construction's line
        lines = [(f"{c.how}: CPR {c.cpr:.3f}, CMD {c.cmd:.3f}", c.f) for c in curve.curves.values()]
    except AttributeError:  # one curve of f
        lines = [("f (edges outside patched)", curve.f)]
    for i, (label, f) in enumerate(lines):
        ax.plot([100 * b for b in curve.budgets], f, "o-" if i == 0 else "s--", color=f"C{i}", label=label)
    for y in (0.0, 1.0):
        ax.axhline(y, color="#999999", lw=0.8, ls=":")
    if at is not None:
        ax.plot([100 * at[0]], [at[1]], "D", color="C3", label=f"the circuit kept: {at[0]:.1%}, f = {at[1]:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("edges kept (% of the graph)")
    ax.set_ylabel("faithfulness f")
    ax.set_title(title or f"faithfulness: CPR {curve.cpr:.3f} (higher better), CMD {curve.cmd:.3f} (0 best)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
