"""The best circuit at 5% of the edges, searched exactly: is there one that EAP and EAP-IG miss, or none at all?

The model is the how-to page's (docs/how-to/find-a-circuit.md): Olsson et al.'s 2-layer attention-only transformer
with learned positions, trained on random tokens repeated once, 81 edges. At 5% of them (MIB's count, rounded down:
4 edges) EAP's and EAP-IG's circuits restore about a third of the metric. This script tries every circuit of at most
that many edges that holds together (every edge on a path from the embedding to the logits through the circuit's
own edges), each patched exactly (``heads.faithfulness``). An edge on no such path changes nothing (a writer that no
kept edge reaches from the embedding computes what it computes in the corrupted run; a node whose output reaches the
logits through no kept edge is read corrupted everywhere; tests/test_circuits.py checks f(C) = f(C less its dangling
edges)), so these circuits are every circuit's f: the best of them is the best circuit of that size.

The circuits that hold together are the unions of input-to-logits paths, enumerated from the graph's names; each is
checked against ``EdgeScores.circuit(how="pruned")`` (pruning leaves it whole).

    nice -n 10 .venv/bin/python bench/circuit_search.py   # writes bench/results/circuit_search.md
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import torch

from multihead import heads
from multihead.models.induction import repeat_loss, repeated, train_induction


def owners(graph, reader: str) -> list[str]:
    """The writers a reader feeds: a head's query its head, a key/value head's key or value every head of its group,
    an MLP's input its MLP; the logits none (the end of a path)."""
    if reader == "logits":
        return []
    if reader.endswith(".in"):
        return [reader[:-3]]
    attn, _, name = reader.rpartition(".")
    kind, i = name[0], int(name[1:])
    if kind == "q":
        return [f"{attn}.h{i}"]
    H, Hkv = graph.sizes[attn]
    return [f"{attn}.h{h}" for h in range(H) if h // (H // Hkv) == i]


def paths(graph, longest: int) -> list[frozenset]:
    """Every path from the embedding to the logits of at most ``longest`` edges, as a set of edge indices."""
    out_of: dict[str, list[int]] = {}
    for i, (w, _) in enumerate(graph.edges):
        out_of.setdefault(w, []).append(i)
    found: list[frozenset] = []

    def walk(node, taken):
        for i in out_of.get(node, ()):
            r = graph.edges[i][1]
            if r == "logits":
                found.append(frozenset(taken + [i]))
            elif len(taken) + 1 < longest:
                for w in owners(graph, r):
                    walk(w, taken + [i])

    walk("embed", [])
    return list(dict.fromkeys(found))


def circuits(graph, most: int) -> list[frozenset]:
    """Every circuit of at most ``most`` edges that holds together: the unions of paths of that size."""
    ps = sorted(paths(graph, most), key=sorted)
    seen: set[frozenset] = set()

    def grow(start, union):
        for j in range(start, len(ps)):
            u = union | ps[j]
            if len(u) <= most and u not in seen:
                seen.add(u)
                grow(j + 1, u)

    grow(0, frozenset())
    return sorted(seen, key=lambda c: (len(c), sorted(c)))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=0.05, help="share of the edges (MIB's count: rounded down)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/circuit_search.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.monotonic()
    model = train_induction()  # the how-to page's training, step for step
    clean = repeated(torch.Generator().manual_seed(9), 8)  # the how-to page's batch and corruption
    corrupted = clean.clone()
    corrupted[:, :16] = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(5))

    def metric(out):
        return -repeat_loss(out, clean)

    graph = heads.circuit_graph(model, clean)
    n = int(a.budget * len(graph.edges))
    found = circuits(graph, n)
    for c in found:  # each holds together: MIB's pruning leaves it whole
        s = heads.EdgeScores(graph, list(graph.edges), torch.tensor([float(i in c) for i in range(len(graph.edges))],
                                                                      dtype=torch.float64), 0.0, 1.0, "eap", "denoise")
        assert set(s.circuit(threshold=0.5)) == {graph.edges[i] for i in c}, sorted(c)
    t = time.monotonic()
    f = [heads.faithfulness(model, clean, corrupted, metric, [graph.edges[i] for i in c]).f for c in found]
    t_search = time.monotonic() - t
    best = sorted(range(len(found)), key=lambda i: -f[i])
    rows = []
    for method in ("eap", "eap-ig"):
        for direction in ("denoise", "noise"):
            s = heads.edge_attribution(model, clean, corrupted, metric, method=method, direction=direction)
            for how in ("pruned", "greedy"):
                got = heads.faithfulness(model, clean, corrupted, metric, s.circuit(a.budget, how=how))
                rows.append(f"| {method} | {direction} | {how} | {got.kept} | {got.f:.4f} |")
    lines = [
        f"# The best circuit of {a.budget:.0%} of the edges, searched exactly (the how-to page's induction model)", "",
        f"`nice -n 10 python bench/circuit_search.py --budget {a.budget}` ({time.monotonic() - t0:.0f} s, "
        f"{torch.get_num_threads()} thread(s); the search {t_search:.0f} s; load: "
        f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}).", "",
        f"{len(graph.edges)} edges; {a.budget:.0%} of them is {n} (rounded down, as MIB counts). Every circuit of at "
        f"most {n} edges that holds together: {len(found)}, each patched exactly.", "",
        "| edges | circuits | best f |", "|---:|---:|---:|",
        *[f"| {k} | {sum(len(c) == k for c in found)} | {max(x for c, x in zip(found, f, strict=True) if len(c) == k):.4f} |"
          for k in range(1, n + 1) if any(len(c) == k for c in found)], "",
        "The five best:", "",
        "| f | circuit |", "|---:|---|",
        *[f"| {f[i]:.4f} | {', '.join(f'{w} -> {r}' for w, r in sorted(graph.edges[j] for j in found[i]))} |"
          for i in best[:5]], "",
        f"The attribution methods' circuits at {a.budget:.0%} (EAP-IG: 5 steps):", "",
        "| method | direction | construction | edges | f |", "|---|---|---|---:|---:|", *rows,
    ]
    text = "\n".join(lines) + "\n"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
