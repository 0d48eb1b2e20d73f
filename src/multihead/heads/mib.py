"""Circuits MIB's way (the Mechanistic Interpretability Benchmark, Mueller et al. 2025): a dataset of prompt pairs
padded on the right, each scored at its own last real token and averaged over the dataset, on MIB's graph (a key and
a value reader per query head: ``ungroup=True``); and the circuit written in the graph file MIB's evaluator reads
(EAP-IG's ``Graph.from_json``), and read back.

- :func:`prompt_pairs` builds a :class:`PromptPairs` from texts (or token ids): a pair whose clean and corrupted
  prompts differ in length, or an answer that is not one token, is refused naming the pair, before any forward.
- :func:`dataset_attribution` scores every edge over the dataset (EAP or EAP-IG, batch by batch: each batch's mean
  weighted by its size, as EAP-IG divides its summed scores by the items), the metric MIB's ``logit_diff``: the clean
  answer's logit minus the corrupted answer's at the last real token.
- :func:`dataset_faithfulness_curve` (and :func:`dataset_faithfulness`): f at each budget, the metric averaged over the
  dataset before the ratio, ``f = (mean m(C) - mean m(empty)) / (mean m(N) - mean m(empty))``, as MIB's
  ``evaluate_area_under_curve``; CPR and CMD by its trapezoid rule over the budgets.
- :func:`write_mib_graph` / :func:`read_mib_graph`: MIB's JSON graph (``cfg``, ``nodes`` with ``in_graph``,
  ``edges`` named ``input->a0.h0<q>``, ``a0.h0->m0``, ``m1->logits`` with ``score`` and ``in_graph``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead.heads.circuits import (
    MIB_BUDGETS,
    CircuitCurve,
    CircuitGraph,
    EdgeScores,
    Faithfulness,
    FaithfulnessCurve,
    _budget,
    _direction,
    _eval,
    _faith,
    _graddrop_checked,
    _how,
    _method_checked,
    _Model,
    _scores,
    _trapezoid,
)

__all__ = ["PromptPairs", "dataset_attribution", "dataset_faithfulness", "dataset_faithfulness_curve", "mib_names",
           "prompt_pairs", "read_mib_graph", "write_mib_graph"]


@dataclass(frozen=True)
class PromptPairs:
    """A dataset of N prompt pairs, MIB's way: ``clean`` and ``corrupted`` (N, L) token ids padded on the right with
    ``pad``, ``lengths`` (N,) each pair's real tokens (clean and corrupted the same), ``answers`` (N, 2) the clean
    answer's token and the corrupted answer's (the metric: their logits' difference at the last real token)."""

    clean: Tensor
    corrupted: Tensor
    lengths: Tensor
    answers: Tensor
    pad: int = 0

    def __len__(self) -> int:
        return int(self.clean.shape[0])

    def batches(self, batch_size: int) -> Iterator[tuple[dict, dict, Callable, int]]:
        """(clean inputs, corrupted inputs, metric, B) per batch of ``batch_size`` pairs in order: ``input_ids`` and
        ``attention_mask`` cut to the batch's longest pair; the metric (B,) MIB's logit difference at each row's last
        real token."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number >= 1 (pairs a forward); got {batch_size!r}.")
        for a in range(0, len(self), batch_size):
            n = self.lengths[a:a + batch_size]
            L = int(n.max())
            mask = torch.arange(L)[None, :] < n[:, None]  # (B, L): the real tokens
            ins = [{"input_ids": t[a:a + batch_size, :L], "attention_mask": mask.long()}
                   for t in (self.clean, self.corrupted)]
            yield ins[0], ins[1], _logit_diff(n - 1, self.answers[a:a + batch_size]), int(n.shape[0])


def _logit_diff(last: Tensor, answers: Tensor) -> Callable:
    """MIB's ``logit_diff``: (B,) logit of answers[:, 0] minus logit of answers[:, 1] at positions ``last`` (B,)."""
    def metric(out):
        logits = out.logits if hasattr(out, "logits") else out  # (B, L, V)
        rows = torch.arange(logits.shape[0], device=logits.device)
        at = logits[rows, last.to(logits.device)]  # (B, V): each row's last real token
        a = answers.to(logits.device)
        return at.gather(-1, a[:, :1])[:, 0] - at.gather(-1, a[:, 1:])[:, 0]
    return metric


def _ids(tokenizer, text, what: str, bos: bool) -> list[int]:
    if isinstance(text, str):
        if tokenizer is None:
            raise ValueError(f"{what} is text ({text!r}): pass tokenizer= to tokenize it, or give token ids.")
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if bos:
            if tokenizer.bos_token_id is None:
                raise ValueError("bos=True but the tokenizer has no bos_token_id; pass bos=False.")
            ids = [tokenizer.bos_token_id] + ids
        return ids
    ids = [int(t) for t in (text.tolist() if isinstance(text, Tensor) else text)]
    if not ids:
        raise ValueError(f"{what} is empty: every prompt needs at least one token.")
    return ids


def _answer(tokenizer, a, what: str) -> int:
    if isinstance(a, str):
        if tokenizer is None:
            raise ValueError(f"{what} is text ({a!r}): pass tokenizer= to tokenize it, or give a token id.")
        got = tokenizer(a, add_special_tokens=False)["input_ids"]
        if len(got) != 1:
            raise ValueError(f"{what} {a!r} is {len(got)} tokens for this tokenizer; the metric reads one token's "
                             "logit: give answers of one token each (e.g. with their leading space).")
        return int(got[0])
    if isinstance(a, bool) or not isinstance(a, int) or a < 0:
        raise ValueError(f"{what} must be a token id (an int >= 0) or a one-token text; got {a!r}.")
    return a


def prompt_pairs(clean: Sequence, corrupted: Sequence, answers: Sequence[tuple], *, tokenizer=None, bos: bool = False,
                 pad: int | None = None) -> PromptPairs:
    """A :class:`PromptPairs` from ``clean`` and ``corrupted`` prompts (texts, with ``tokenizer``; or token id lists)
    and ``answers`` ((clean answer, corrupted answer) per pair: one-token texts or token ids). ``bos``: prepend the
    tokenizer's BOS (as MIB's ``tokenize_plus`` does). Refused before any forward, one line each: lists of different
    lengths, a pair whose clean and corrupted prompts differ in token count (edges are compared position by
    position), an answer that is not one token."""
    if not (len(clean) == len(corrupted) == len(answers)) or not len(clean):
        raise ValueError(f"clean, corrupted and answers must be lists of the same length >= 1 (one entry per pair); got "
                         f"{len(clean)}, {len(corrupted)} and {len(answers)}.")
    rows, ans = [], []
    for i, (c, x, a) in enumerate(zip(clean, corrupted, answers, strict=True)):
        ci, xi = _ids(tokenizer, c, f"clean[{i}]", bos), _ids(tokenizer, x, f"corrupted[{i}]", bos)
        if len(ci) != len(xi):
            raise ValueError(f"pair {i}: clean is {len(ci)} tokens and corrupted {len(xi)}: edges are compared "
                             "position by position, so each pair needs the same token count; change words one for "
                             "one, or drop the pair.")
        if not isinstance(a, tuple | list) or len(a) != 2:
            raise ValueError(f"answers[{i}] must be (the clean answer, the corrupted answer); got {a!r}.")
        rows.append((ci, xi))
        ans.append([_answer(tokenizer, a[0], f"answers[{i}][0]"), _answer(tokenizer, a[1], f"answers[{i}][1]")])
    if pad is None:
        pad = getattr(tokenizer, "pad_token_id", None) or getattr(tokenizer, "eos_token_id", None) or 0
    L = max(len(ci) for ci, _ in rows)
    ids = torch.full((2, len(rows), L), int(pad), dtype=torch.long)  # (2, N, L): right-padded
    for n, (ci, xi) in enumerate(rows):
        ids[0, n, :len(ci)], ids[1, n, :len(xi)] = torch.tensor(ci), torch.tensor(xi)
    lengths = torch.tensor([len(ci) for ci, _ in rows])
    return PromptPairs(ids[0], ids[1], lengths, torch.tensor(ans, dtype=torch.long), int(pad))


def _pairs_checked(pairs) -> None:
    if not isinstance(pairs, PromptPairs):
        raise TypeError(f"pairs must be a PromptPairs (heads.prompt_pairs(clean, corrupted, answers, ...)); got "
                        f"{type(pairs).__name__}.")


def dataset_attribution(model: nn.Module, pairs: PromptPairs, *, method: str = "eap-ig", steps: int = 5,
                        direction: str = "noise", batch_size: int = 16, ungroup: bool = True,
                        readout: str | None = None, graddrop: bool | None = None) -> EdgeScores:
    """Every edge's score over the dataset (:class:`EdgeScores`): :func:`~multihead.heads.edge_attribution` on each
    batch with MIB's metric, each batch's mean weighted by its size (the scores, ``base`` and ``source`` are means over
    the pairs; with AtP*'s GradDrop, each batch's magnitudes averaged). Defaults are MIB's: EAP-IG,
    ``direction="noise"`` (EAP-IG's: the clean run's gradient, the corrupted run's change), the ungrouped graph."""
    _pairs_checked(pairs)
    _method_checked(method, steps, graddrop)
    _direction(direction, None, None)
    m = _Model(model, None, readout, ungroup)
    graddrop = _graddrop_checked(m, method, graddrop)
    steps = steps if method == "eap-ig" else 1
    total, base_v, src_v, graph, N = None, 0.0, 0.0, None, 0
    with _eval(model):
        for clean, corrupted, metric, B in pairs.batches(batch_size):
            base_in, src_in = _direction(direction, clean, corrupted)
            g, full, _, bv, sv, _ = _scores(m, base_in, src_in, metric, method=method, steps=steps,
                                             graddrop=graddrop)
            if graph is not None and g.edges != graph.edges:
                raise ValueError("the model's graph changed between batches (head counts differ by call).")
            graph, total = g, full * B if total is None else total + full * B
            base_v, src_v, N = base_v + bv * B, src_v + sv * B, N + B
    w, r = graph.matrix()
    scores = (total / N)[w.to(total.device), r.to(total.device)].cpu()
    return EdgeScores(graph, list(graph.edges), scores, base_v / N, src_v / N, method, direction, steps, graddrop)


def _dataset_faith(model, pairs, circuits: list[list], *, ungroup, batch_size, chunk, readout):
    m = _Model(model, None, readout, ungroup)
    got, full, empty, N, graph, kept = None, 0.0, 0.0, 0, None, None
    with _eval(model):
        for clean, corrupted, metric, B in pairs.batches(batch_size):
            graph, g, f, e, kept = _faith(m, clean, corrupted, metric, circuits, chunk)
            got = [x * B for x in g] if got is None else [a + x * B for a, x in zip(got, g, strict=True)]
            full, empty, N = full + f * B, empty + e * B, N + B
    full, empty = full / N, empty / N
    if full == empty:
        raise ValueError("the clean and corrupted prompts give the same mean metric: f is undefined.")
    return graph, [(x / N - empty) / (full - empty) for x in got], [x / N for x in got], full, empty, kept


def dataset_faithfulness(model: nn.Module, pairs: PromptPairs, circuit: Sequence[tuple[str, str]], *,
                         ungroup: bool = True, batch_size: int = 16, readout: str | None = None) -> Faithfulness:
    """A circuit's faithfulness over the dataset: each pair's clean run with every edge outside ``circuit`` patched
    from its corrupted run, the metric averaged over the pairs before the ratio (MIB's)."""
    _pairs_checked(pairs)
    graph, f, got, full, empty, kept = _dataset_faith(model, pairs, [[e[:2] for e in circuit]], ungroup=ungroup,
                                                      batch_size=batch_size, chunk=1, readout=readout)
    return Faithfulness(f[0], got[0], full, empty, kept[0], len(graph.edges))


def dataset_faithfulness_curve(model: nn.Module, pairs: PromptPairs, scores: EdgeScores, *,
                               budgets: Sequence[float | str] = MIB_BUDGETS,
                               how: str | Sequence[str] = ("pruned", "greedy"), batch_size: int = 16, chunk: int = 4,
                               readout: str | None = None) -> FaithfulnessCurve:
    """f at each budget over the dataset (MIB's ``evaluate_area_under_curve``: the pruned top ``int(budget x
    edges)``, the metric averaged over the pairs before the ratio, CPR and CMD by the trapezoid rule), on the graph
    ``scores`` were computed on."""
    _pairs_checked(pairs)
    fr = [_budget(b) for b in budgets]
    hows = [_how(h) for h in ([how] if isinstance(how, str) else list(how))]
    if not fr or not hows or len(set(hows)) != len(hows):
        raise ValueError(f"budgets and how must each name at least one (how each construction once); got {budgets!r}, "
                         f"{how!r}.")
    if scores.method == "exact":
        raise ValueError("scores must score every edge of the graph (an attribution's), not patch_edges' chosen ones.")
    circuits = [tuple(scores.circuit(b, how=h)) for h in hows for b in fr]
    unique = list(dict.fromkeys(circuits))
    graph, f, _, full, empty, kept = _dataset_faith(model, pairs, [list(c) for c in unique],
                                                    ungroup=scores.graph.ungrouped, batch_size=batch_size,
                                                    chunk=chunk, readout=readout)
    if graph.edges != scores.edges:
        raise ValueError("scores were computed on another graph (another model, or ungroup= otherwise).")
    at = [unique.index(c) for c in circuits]
    curves = {}
    for i, h in enumerate(hows):
        fh = [f[j] for j in at[i * len(fr):(i + 1) * len(fr)]]
        kh = [kept[j] for j in at[i * len(fr):(i + 1) * len(fr)]]
        curves[h] = CircuitCurve(h, kh, fh, _trapezoid(fr, fh), _trapezoid(fr, [abs(1 - x) for x in fh]))
    return FaithfulnessCurve(fr, full, empty, curves)


# --------------------------------------------------------------------------------------------- MIB's graph file


def mib_names(graph: CircuitGraph) -> dict[str, str]:
    """{our node name: MIB's}: writers ``embed`` -> ``input``, ``{attn}.h{h}`` -> ``a{l}.h{h}``, ``{mlp}`` ->
    ``m{l}``; readers ``{attn}.q{h}`` -> ``a{l}.h{h}<q>`` (k, v alike), ``{mlp}.in`` -> ``m{l}``, ``logits``. Refused
    naming why where MIB's graph cannot hold this one: grouped key/value readers (build it with ``ungroup=True``),
    a layer without an MLP, layers of different head counts, parallel and sequential blocks mixed."""
    Hs = {graph.sizes[u.attn] for u in graph.units}
    if any(H != Hkv for H, Hkv in Hs):
        raise ValueError("MIB's graph has a key and a value reader per query head; this one has one per key/value "
                         "head: score it with ungroup=True.")
    if len({H for H, _ in Hs}) != 1:
        raise ValueError(f"MIB's graph has the same head count in every layer; this model's layers have {sorted(Hs)}.")
    if any(u.mlp is None for u in graph.units):
        raise ValueError("MIB's graph has an MLP in every layer; this model has layers without one (attention-only): "
                         "its circuit cannot be written in MIB's file.")
    if len({u.parallel for u in graph.units}) != 1:
        raise ValueError("MIB's graph is parallel or sequential throughout; this model mixes the two.")
    out = {"embed": "input", "logits": "logits"}
    for layer, u in enumerate(graph.units):
        H = graph.sizes[u.attn][0]
        for h in range(H):
            out[f"{u.attn}.h{h}"] = f"a{layer}.h{h}"
            for x in "qkv":
                out[f"{u.attn}.{x}{h}"] = f"a{layer}.h{h}<{x}>"
        out[u.mlp] = f"m{layer}"
        out[f"{u.mlp}.in"] = f"m{layer}"
    return out


def _edge_name(names: dict[str, str], w: str, r: str) -> str:
    dst = names[r]
    if dst.endswith(">"):  # an attention reader: MIB writes "parent->a1.h0<q>"
        head, qkv = dst[:-3], dst[-2]
        return f"{names[w]}->{head}<{qkv}>"
    return f"{names[w]}->{dst}"


def write_mib_graph(scores: EdgeScores, path: str | Path, circuit: Sequence[tuple[str, str]] = ()) -> Path:
    """Write ``scores`` (every edge's) and ``circuit`` (the edges in the graph: ``in_graph``) in MIB's JSON graph file,
    which MIB's ``run_evaluation.py --circuit-files`` and EAP-IG's ``Graph.from_json`` read: ``cfg`` (n_layers,
    n_heads, parallel_attn_mlp, d_model), ``nodes`` (``in_graph``: a node with a circuit edge out of it, the logits
    always), ``edges`` (``score``, ``in_graph``). Refused where MIB's graph cannot hold the model (:func:`mib_names`)."""
    g = scores.graph
    names = mib_names(g)
    if scores.edges != g.edges:
        raise ValueError("scores must score every edge of the graph (an attribution's), not patch_edges' chosen ones.")
    kept = {tuple(e[:2]) for e in circuit}
    missing = kept - set(g.edges)
    if missing:
        raise ValueError(f"circuit edge {sorted(missing)[0]!r} is not in the graph.")
    u0 = g.units[0]
    cfg = {"n_layers": len(g.units), "n_heads": g.sizes[u0.attn][0], "parallel_attn_mlp": bool(u0.parallel),
           "d_model": int(g.width)}
    nodes = {names[w]: {"in_graph": False} for w in g.writers}
    nodes["logits"] = {"in_graph": True}
    for w, _ in kept:
        nodes[names[w]]["in_graph"] = True
    edges = {_edge_name(names, w, r): {"score": float(s), "in_graph": (w, r) in kept}
             for (w, r), s in zip(g.edges, scores.scores.tolist(), strict=True)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cfg": cfg, "nodes": nodes, "edges": edges}))
    return path


def read_mib_graph(path: str | Path, graph: CircuitGraph) -> tuple[EdgeScores, list[tuple[str, str]]]:
    """MIB's JSON graph file read onto ``graph`` (the model's, ``ungroup=True``): (every edge's score as an
    :class:`EdgeScores` of method "file", the edges with ``in_graph``, strongest first). Refused naming what differs
    where the file's ``cfg`` or edges are not this graph's."""
    d = json.loads(Path(path).read_text())
    if not isinstance(d, dict) or not {"cfg", "nodes", "edges"} <= set(d):
        raise ValueError(f"{path}: not MIB's graph file (a JSON object with cfg, nodes and edges).")
    names = mib_names(graph)
    u0 = graph.units[0]
    want = {"n_layers": len(graph.units), "n_heads": graph.sizes[u0.attn][0], "parallel_attn_mlp": bool(u0.parallel)}
    got = {k: d["cfg"].get(k) for k in want}
    if got != want:
        raise ValueError(f"{path}: its cfg {got} is not this model's graph {want}.")
    ours = {_edge_name(names, w, r): i for i, (w, r) in enumerate(graph.edges)}
    if set(d["edges"]) != set(ours):
        extra = sorted(set(d["edges"]) ^ set(ours))[0]
        raise ValueError(f"{path}: its edges are not this graph's (e.g. {extra!r}).")
    scores = torch.zeros(len(graph.edges), dtype=torch.float64)
    kept = torch.zeros(len(graph.edges), dtype=torch.bool)
    for name, e in d["edges"].items():
        scores[ours[name]], kept[ours[name]] = float(e["score"]), bool(e["in_graph"])
    s = EdgeScores(graph, list(graph.edges), scores, float("nan"), float("nan"), "file", "noise")
    order = scores.abs().argsort(descending=True, stable=True)
    return s, [graph.edges[i] for i in order.tolist() if kept[i]]
