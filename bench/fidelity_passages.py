"""Does the pruned model keep its fidelity on long inputs? all-MiniLM-L6-v2 with the 22 heads that
`prune --hf --target-cosine 0.95` removed in round 4 (``bench/results/prune_minilm_hf_target/report.json``'s
31% step; each removed head replaced by its mean output), recovered for 400 steps with int8 rounding, twice from
the same snapshot: on sentences only (16 a step, the recovery split and the standard library's docstrings), and
on those sentences with two passages of the same text joined to 129-256 tokens after every third batch
(``multihead.apps.prune.hf_models._recovery_batches``). Both measured on the three kinds of held-out text `prune --hf`
uses: the held-out split's sentences, 300 sentences of the installed packages' descriptions, and 32 passages of
the held-out sentences joined to 163-256 tokens; mean cosine with its 95% interval, float and int8.

    .venv/bin/python bench/fidelity_passages.py     # ~8 min on 2 cores; writes bench/results/fidelity_passages.md
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
STEPS = 400


def main() -> None:
    from multihead import heads
    from multihead.apps.common.data import docstring_sentences, package_sentences, sentences
    from multihead.apps.prune import hf_models, target
    from multihead.models import minilm_path
    from multihead.quantize import quantize

    path = minilm_path()
    wide = docstring_sentences(16 * STEPS)  # what prune --hf --recover 400 adds (--recover-text wide)
    unseen = ("the installed packages' descriptions", package_sentences(300, exclude=set(sentences()) | set(wide)))
    setup = hf_models.hf_setup(path, recover_extra=wide, held_out_extra=unseen)
    removed = json.loads((HERE / "results/prune_minilm_hf_target/report.json").read_text())["curve"][3]["removed"]
    snapshot = copy.deepcopy(setup.model)
    heads.prune(snapshot, removed, mean_outputs=heads.mean_head_outputs(setup.model, setup.batches, setup.loss_fn))
    _, _, tok, _ = hf_models._load(path, with_peer=False)
    limit = hf_models._passage_limit(tok, setup.model)
    own = hf_models._split(sentences(), 128, None, None)[1]  # the recovery split, as hf_setup cuts it
    rows = [("none (zero-shot)", target.fidelity(setup, snapshot), None, 0.0)]
    for label, lim in (("sentences", None), ("sentences + passages (2 after every 3rd batch)", limit)):
        started = time.monotonic()
        batches = hf_models._recovery_batches(tok, setup.model, False, own, wide, lim)
        model = copy.deepcopy(snapshot)
        hf_models.recover(model, batches, STEPS, False, quantize="int8")
        rows.append((label, target.fidelity(setup, model), target.fidelity(setup, quantize(model, "int8")),
                     time.monotonic() - started))
        print(label, rows[-1][1], rows[-1][2], flush=True)
    kinds = [k[0] for k in setup.held_out_kinds]

    def cells(f):
        by = {x.kind: x for x in (f, *f.others)}
        return " | ".join(f"{by[k].mean:.4f} ({by[k].lo:.4f}-{by[k].hi:.4f})" for k in kinds)

    lines = [f"all-MiniLM-L6-v2, 50 of 72 heads (round 4's kept step), {STEPS} recovery steps with int8 rounding; mean "
             "cosine to the unpruned model (95% interval) on each kind of held-out text", "",
             "| recovery distils on | model | " + " | ".join(f"{k} ({n})" for k, n, *_ in setup.held_out_kinds)
             + " | time |", "|---|---|" + "---:|" * (len(kinds) + 1)]
    for label, f, q, secs in rows:
        lines.append(f"| {label} | float | {cells(f)} | {secs:.0f} s |")
        if q is not None:
            lines.append(f"| {label} | int8 | {cells(q)} | |")
    lines += ["", "Command: `.venv/bin/python bench/fidelity_passages.py` (2 cores). `prune --hf` measures the three "
              "kinds (`--passages 32`, `--unseen-sentences 300`) and, with passages measured, recovers on passages "
              "too; the worst kind is the reported figure and the one `--target-cosine` must meet."]
    text = "\n".join(lines) + "\n"
    print(text)
    (HERE / "results" / "fidelity_passages.md").write_text(text)


if __name__ == "__main__":
    main()
