"""Does the pruned model's fidelity hold on text nobody chose it on? all-MiniLM-L6-v2 pruned the same way
twice (`prune --hf` settings: 40% of heads, ranked once, 400 recovery steps, int8), distilled on the corpus'
recovery split alone or on that split and the standard library's docstrings
(``multihead.apps.common.data.docstring_sentences``, ~6,500 sentences), then measured on the held-out split (the
figure `prune` reports) and on sentences from the descriptions of the installed packages' metadata (their
READMEs: text neither pruning nor recovery saw, by construction), mean cosine with its 95% interval.

    .venv/bin/python bench/fidelity_unseen.py            # ~15 min on 2 cores; writes bench/results/fidelity_unseen.md
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import multihead.hf as mhf
    from multihead.apps.common.data import docstring_sentences, package_sentences, sentences
    from multihead.apps.prune import hf_models, pruning
    from multihead.apps.prune.target import Fidelity
    from multihead.deploy import peers
    from multihead.models import minilm_path

    path = minilm_path()
    wide = docstring_sentences()
    unseen = package_sentences(600, exclude=set(sentences()) | set(wide))
    base, _, tok, _ = hf_models._load(Path(path), with_peer=False)
    batches = hf_models._batches(tok, unseen, 16, False)
    with torch.no_grad():
        refs = [hf_models.pooled(base, *b) for b in batches]
    rows = []
    for label, extra in (("recovery split only", None), ("recovery split + stdlib docstrings", wide)):
        t = time.monotonic()
        setup = hf_models.hf_setup(path, recover_extra=extra)
        out = peers.scratch()  # removed when the run ends
        report = pruning.run(setup, out, pruning.Options(0.4, step=0.1, reestimate=False, recover=400,
                                                          quantize="int8", max_seconds=1.0))
        model = mhf.load(out / "model")
        with torch.no_grad():
            cos = torch.cat([(hf_models.pooled(model, *b) * r).sum(-1) for b, r in zip(batches, refs)])
        rows.append((label, Fidelity(**{k: v for k, v in zip(("mean", "lo", "hi", "n"), (
            report["final"]["fidelity"]["mean"], *report["final"]["fidelity"]["ci95"],
            report["final"]["fidelity"]["n"]))}), Fidelity.of(cos), time.monotonic() - t))
        print(rows[-1][0], rows[-1][1], rows[-1][2], f"{rows[-1][3]:.0f} s", file=sys.stderr)
    lines = ["all-MiniLM-L6-v2, 40% of heads pruned (ranked once), 400 recovery steps, int8; mean cosine to the "
             "unpruned model with its 95% interval", "",
             f"| distilled on | held-out split ({rows[0][1].n} sentences) | package descriptions ({len(unseen)} "
             "sentences, never seen) | time |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {held} | {pkg} | {secs:.0f} s |" for label, held, pkg, secs in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / "fidelity_unseen.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
