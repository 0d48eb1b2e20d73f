"""The main job: the course's toy example, then two small models trained here,
every head drawn (:mod:`multihead.apps.viz.course`: heatmaps, rollout, the HTML explorer), then pruned. Used by
``multihead demo``."""

from __future__ import annotations

from pathlib import Path

import torch

import multihead
from multihead import masks
from multihead.apps.viz.course import draw_reverser, draw_vit, reverser, vit
from multihead.models.seq2seq import alignment
from multihead.models.vit import accuracy, digits

#: how a rollout picture is labelled: its values are shares of an output drawn from each input


def format_weights(w: torch.Tensor, *, digits: int = 2) -> str:
    """One head's weights (Lq, Lk) as a text grid: rows are queries, columns keys."""
    Lq, Lk = w.shape
    width = digits + 2
    head = " " * 5 + " ".join(f"{'k' + str(j):>{width}}" for j in range(Lk))
    rows = [f"q{i:<4} " + " ".join(f"{x:{width}.{digits}f}" for x in w[i].tolist()) for i in range(Lq)]
    return "\n".join([head, *rows])


def toy(seed: int = 0) -> None:
    """The course's toy: batch 2, 4 queries, 6 key-value pairs, 100 hiddens, 5 heads, valid_lens [3, 2]."""
    from multihead.core.functional import attention_weights

    torch.manual_seed(seed)
    print("== the course's toy example: batch 2, 4 queries, 6 key-value pairs, 100 hiddens, 5 heads")
    num_hiddens, num_heads = 100, 5
    mha = multihead.MultiHeadAttention(num_hiddens, num_heads, dropout=0.5).eval()
    B, Lq, Lk = 2, 4, 6
    valid_lens = torch.tensor([3, 2])
    X = torch.randn(B, Lq, num_hiddens)  # (B, Lq, E)
    Y = torch.randn(B, Lk, num_hiddens)  # (B, Lk, E)
    with torch.no_grad():
        out = mha(X, Y, Y, valid_lens)
    print(f"output shape: {tuple(out.shape)}  (B, Lq, num_hiddens)")
    print("\n== which backend runs, and why (multihead.explain)")
    H, D = num_heads, num_hiddens // num_heads
    with torch.no_grad():
        q = mha.q_proj(X).view(B, Lq, H, D).transpose(1, 2)  # (B, Lq, H*D) -> (B, H, Lq, D)
        k = mha.k_proj(Y).view(B, Lk, H, D).transpose(1, 2)  # (B, Lk, H*D) -> (B, H, Lk, D)
        v = mha.v_proj(Y).view(B, Lk, H, D).transpose(1, 2)  # (B, Lk, H*D) -> (B, H, Lk, D)
        mask = masks.ValidLens(valid_lens)
        print(multihead.explain(q, k, v, mask))
        print("\n== the mask, sequence 1 (valid length 2)")
        print(mask.to_string(Lq, Lk, batch=1))
        w = attention_weights(q, k, mask)  # (B, H, Lq, Lk)
    print("\n== sequence 1, head 0: attention weights (rows sum to 1; keys >= 2 get 0)")
    print(format_weights(w[1, 0]))


class NotebookMHSA(torch.nn.Module):
    """The from-scratch ViT notebook's self-attention, in our words, with its two bugs (scores
    divided by d_k; the values multiplied by the raw scores), for the checker to find."""

    def __init__(self, d_model: int = 32, num_head: int = 4, d_k: int = 8):
        super().__init__()
        self.num_head, self.d_k = num_head, d_k
        self.query, self.key, self.value = (torch.nn.Linear(d_model, num_head * d_k) for _ in range(3))
        self.proj = torch.nn.Linear(num_head * d_k, d_model)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.num_head, self.d_k).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / self.d_k
        return self.proj((scores @ v).transpose(1, 2).reshape(b, n, -1))


def check_demo(seed: int = 0) -> None:
    """multihead.check on the ViT notebook's module: it names both bugs."""
    torch.manual_seed(seed)
    print("\n== check your own attention: the ViT notebook's module (multihead.check)")
    print(multihead.check(NotebookMHSA(), call="x"))


def prune_both(out: Path, max_seconds: float, recover: int = 150) -> list[Path]:
    """The course's second exercise on both demo models: the importance methods against the cost of cutting each
    head alone (rank correlations), the pruning curve with and without a short recovery after each cut, and the
    kept model's speed beside the bound of the work removed; ``recover``: fine-tuning steps after each cut (0: the
    cut alone). Returns the files written."""
    from multihead.apps.prune import methods, pruning

    paths = []
    for kind, setup_fn, what, fraction, step in (
            ("toy", pruning.toy_setup, "the reversal Transformer", 0.5, 0.125),
            ("vit", pruning.vit_setup, "the digits ViT", 0.5, 0.25)):
        print(f"\n== cut the heads of {what}: which experiment predicts importance, the curve, recovery, speed")
        setup = setup_fn(out / "checkpoints" / ("transformer" if kind == "toy" else "vit"))
        folder = out / f"prune_{kind}"
        cmp = methods.compare(setup, folder)
        print("  rank correlation with the cost of cutting each head alone: " + ", ".join(
            f"{k} {v['spearman']:.2f}" for k, v in sorted(cmp["methods"].items(), key=lambda kv: -kv[1]["spearman"])))
        report = pruning.run(setup, folder, pruning.Options(fraction, step=step, max_seconds=max_seconds,
                                                            recover=recover, recover_curve=recover > 0))
        for row in report["curve"]:
            after = (f", {row['metric_recovered']:.1%} after {row['recovery']['steps']} recovery steps"
                     if row.get("recovery") else "")
            print(f"  {row['fraction']:4.0%} of heads pruned: {setup.metric_name} {row['metric']:.1%} cut{after}")
        print(pruning.speed_table(report["speed"], report.get("bound")))
        bound = report.get("bound") or {}
        if bound:
            print("  bound (the arithmetic removed): " + " / ".join(f"{v:.2f}x" for v in bound.values())
                  + f" at batch {' / '.join(bound)}")
        for note in report["timing_notes"]:
            print(f"note: {note}")
        f = report["final"]
        print(f"kept: {f['fraction']:.0%} of the heads pruned{' and recovered' if recover else ''}, "
              f"{setup.metric_name} {f['metric']:.1%} "
              f"(unpruned {f['metric_unpruned']:.1%}); the model: {folder / 'model'}")
        paths += [folder / n for n in ("importance.png", "curve.png", "report.md", "methods.md")]
    return paths


def run(out: Path, *, retrain: bool = False, seed: int = 0, max_seconds: float = 20.0, recover: int = 150) -> list[Path]:
    """The whole demo; returns the files written. ``max_seconds``: each pruned model's speed table's time per
    batch size; ``recover``: fine-tuning steps after each cut of the pruning curves."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    toy(seed)
    check_demo(seed)
    print("\n== an encoder-decoder Transformer, trained to reverse digit strings (multihead modules)")
    model = reverser(out / "checkpoints" / "transformer", retrain)
    seq_ok, aligned = alignment(model)
    print(f"reversal accuracy {seq_ok:.1%}; last decoder layer's cross-attention (head mean) peaks on the aligned "
          f"source digit for {aligned:.1%} of target tokens")
    paths = draw_reverser(model, "31415926", out)
    print("\n== a ViT, trained on scikit-learn's 8x8 digits")
    v = vit(out / "checkpoints" / "vit", retrain)
    _, _, xte, yte = digits()
    print(f"ViT test accuracy {accuracy(v, xte, yte):.1%}")
    paths += draw_vit(v, 0, out)
    paths += prune_both(out, max_seconds, recover)
    print("\n== written:")
    for p in paths:
        print(f"  {p}")
    return paths
