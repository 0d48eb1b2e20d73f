"""Circuits at a budget, three constructions (``EdgeScores.circuit(how=...)``): MIB's pruned top n, EAP-IG's greedy
circuit and the raw top n, on the models the tests train -- f at 5% and 10% of the edges and CPR / CMD over MIB's
budgets, for EAP and EAP-IG (5 steps), denoising and noising. Writes bench/results/circuit_constructions.md.

The models (trained here as the tests train them; the same seeds): tests/test_circuits_trained.py's two sparse
2-layer attention-only models (257 edges: induction, look-back), its GPT-2 trained to copy the token two back (2
layers with MLPs, 110 edges) and tests/test_patching.py's induction model with learned positions (81 edges).

    .venv/bin/python bench/circuit_constructions.py
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HOWS = ("pruned", "greedy", "top")


def _models():
    """(name, model, clean, corrupted, metric) for each model the tests train."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_circuits_trained as tt
    from test_patching import _repeat_loss, _repeated, trained_induction

    for task in ("induction", "look-back"):
        clean, targets = tt._batch(task, torch.Generator().manual_seed(9), 8)
        corrupted = clean.clone()
        corrupted[:, :tt.N] = tt._distinct(torch.Generator().manual_seed(5), 8)
        yield f"sparse {task}", tt._trained(task), clean, corrupted, (lambda out, t=targets: -tt._loss(out, t))
    clean = tt._two_back(torch.Generator().manual_seed(9), 8)
    yield ("GPT-2 copy two back", tt._copy_two_back(), clean, tt._two_back(torch.Generator().manual_seed(5), 8),
           lambda out: -tt._two_back_loss(out.logits, clean))
    clean = _repeated(torch.Generator().manual_seed(9), 8)
    corrupted = clean.clone()
    corrupted[:, :16] = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(5))
    yield "induction, learned positions", trained_induction(), clean, corrupted, lambda out: -_repeat_loss(out, clean)


def main() -> None:
    from multihead import heads

    torch.set_num_threads(2)
    rows = ["| model (edges) | scores | " + " | ".join(f"{h}: 5% | {h}: 10% | {h}: CPR, CMD" for h in HOWS) + " |",
            "|---|---|" + "---:|---:|---:|" * len(HOWS)]
    for name, model, clean, corrupted, metric in _models():
        for method in ("eap", "eap-ig"):
            for direction in ("denoise", "noise"):
                s = heads.edge_attribution(model, clean, corrupted, metric, method=method, direction=direction, steps=5)
                c = heads.faithfulness_curve(model, clean, corrupted, metric, s, how=HOWS)
                five, ten = c.budgets.index(0.05), c.budgets.index(0.1)
                cells = [f"{c[h].kept[five]}: {c[h].f[five]:.2f} | {c[h].kept[ten]}: {c[h].f[ten]:.2f} | "
                         f"{c[h].cpr:.2f}, {c[h].cmd:.2f}" for h in HOWS]
                rows.append(f"| {name} ({len(s.edges)}) | {method} {direction} | " + " | ".join(cells) + " |")
                print(rows[-1], flush=True)
    out = ROOT / "bench" / "results" / "circuit_constructions.md"
    out.write_text("# Circuits at a budget: pruned, greedy, top\n\nEach cell: edges kept: f (f at 5% and 10% of the "
                   "edges; CPR and CMD over MIB's budgets). `.venv/bin/python bench/circuit_constructions.py` "
                   f"({platform.processor() or platform.machine()}, 2 threads).\n\n" + "\n".join(rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
