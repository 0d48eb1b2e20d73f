"""int8 activations rounded per call or per token: fidelity, batch independence and time. A measurement, not a
feature.

PyTorch's dynamic int8 Linear (the one `quantize` uses, as ONNX Runtime's dynamic quantization does) rounds a
call's activations over one range, the whole call's: every token of every sentence in the batch. So a sentence's
embedding depends on the sentences it is batched with, and an outlier token coarsens the rounding of all others.
Per token, each row x of a call is divided by its own max|x| before the same kernel runs (one extra row pins the
call's range to [-1, 1], so a row's rounding depends on that row only), and the product's rows are multiplied
back by it, the bias added after (the weights packed without it):

    y = (W (x / s)) * s + b,    s = max|x| per row    (x: (N, in), N the call's real tokens)

Measured on a `prune --hf ... --quantize int8` output:
- fidelity as `prune --hf` reports it (mean cosine to the unpruned model, 95% interval, on each kind of held-out
  text) for the float model, int8 per call (as `quantize` makes it) and int8 per token;
- batch independence: the mean-pooled embedding of each of 64 held-out sentences encoded alone and within batches
  of 16 (cosine between the two, mean and least);
- time: the served encoder (`multihead.hf.serve`) at batch 1, 16 and 64, per call against per token, interleaved
  rounds (the per-token rounds run with `multihead.quantize._kernel` replaced by the function below: this script's
  own patch, for the measurement).

    .venv/bin/python bench/int8_per_token.py P/model   # ~6 min on 2 cores; writes bench/results/int8_per_token.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUNDS = 9


def _unbiased(packed) -> tuple[object, torch.Tensor | None]:
    """The packed int8 weights without their bias, and the bias: (packed', (out,) or None)."""
    w, b = packed.unpack()
    return torch.ops.quantized.linear_prepack(w, None), b


def per_token(x: torch.Tensor, packed, b: torch.Tensor | None, reduce_range: bool) -> torch.Tensor:
    """x (N, in) -> (N, out): the int8 product with each row rounded over its own range (see the docstring)."""
    N = x.shape[0]
    s = x.abs().amax(-1, keepdim=True).clamp_min_(torch.finfo(x.dtype).tiny)  # (N, 1)
    xn = x.new_zeros(N + 1, x.shape[1])  # (N + 1, in): the rows scaled to [-1, 1], then the pinning row
    torch.div(x, s, out=xn[:N])
    xn[N, 0], xn[N, 1] = 1.0, -1.0
    y = torch.ops.quantized.linear_dynamic(xn, packed, reduce_range=reduce_range)[:N].mul_(s)  # (N, out)
    return y if b is None else y.add_(b)


class PerToken(nn.Module):
    """An int8 layer of `quantize` computed per token (its int8 rows and scales, unchanged)."""

    def __init__(self, q: nn.Module, reduce_range: bool):
        super().__init__()
        self.packed, self.b = _unbiased(q._packed_params._packed_params)
        self.reduce_range = reduce_range

    def forward(self, x):
        return per_token(x.reshape(-1, x.shape[-1]), self.packed, self.b, self.reduce_range).view(*x.shape[:-1], -1)


def per_token_model(q: nn.Module) -> nn.Module:
    """``q`` (a quantized model) with each int8 layer replaced by its :class:`PerToken` (in place)."""
    from multihead.quantize import is_int8_linear, kernel_kind

    for parent in list(q.modules()):
        for name, child in list(parent.named_children()):
            if is_int8_linear(child) and child.in_features:
                setattr(parent, name, PerToken(child, kernel_kind(child)))
    return q


def _pooled(model, tok, texts: list[str]) -> torch.Tensor:
    x = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=128)
    with torch.inference_mode():
        h = model(**x).last_hidden_state  # (B, L, E)
    w = x["attention_mask"].unsqueeze(-1).to(h.dtype)  # (B, L, 1)
    return torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1)  # (B, E)


def batch_independence(model, tok, texts: list[str]) -> tuple[float, float]:
    alone = torch.cat([_pooled(model, tok, [t]) for t in texts])
    grouped = torch.cat([_pooled(model, tok, texts[i:i + 16]) for i in range(0, len(texts), 16)])
    cos = (alone * grouped).sum(-1)
    return float(cos.mean()), float(cos.min())


def timings(served, tok, texts: list[str]) -> dict[tuple[str, int], list[float]]:
    import multihead.quantize as mq

    plain = mq._kernel
    cache: dict[int, tuple] = {}

    def token_kernel(x, packed, *, reduce_range):
        entry = cache.get(id(packed))
        if entry is None:
            entry = cache[id(packed)] = (*_unbiased(packed), packed)  # the packed object kept alive with its id
        return per_token(x, entry[0], entry[1], reduce_range)

    kernels = {"per call": plain, "per token": token_kernel}
    batches = {n: tok(texts[:n], return_tensors="pt", padding=True) for n in (1, 16, 64)}
    out = {(k, n): [] for k in kernels for n in batches}
    try:
        with torch.inference_mode():
            for r in range(ROUNDS + 1):
                for k in (kernels if r % 2 else list(kernels)[::-1]):
                    mq._kernel = kernels[k]
                    for n, x in batches.items():
                        reps = {1: 10, 16: 2, 64: 1}[n]
                        t = time.perf_counter()
                        for _ in range(reps):
                            served(**x)
                        if r:  # the first round warms up
                            out[(k, n)].append((time.perf_counter() - t) / reps)
    finally:
        mq._kernel = plain
    return out


def main(model_dir: str) -> None:
    import multihead.hf as mhf
    from multihead.apps.common.data import package_sentences, sentences
    from multihead.apps.prune import hf_models, target
    from multihead.models import minilm_path
    from multihead.quantize import quantize

    unseen = package_sentences(300, exclude=set(sentences()))
    setup = hf_models.hf_setup(minilm_path(), None, 128, None,
                               held_out_extra=("the installed packages' descriptions", unseen))
    _, _, tok, _ = hf_models._load(minilm_path(), with_peer=False)
    base = mhf.load(model_dir, quantized=False)
    models = {"float (no int8)": base, "int8 per call (as `quantize` makes it)": quantize(base),
              "int8 per token": per_token_model(quantize(base))}
    held = hf_models._split(sentences(), 128, None, None)[2][:64]  # held-out sentences, never trained on
    kinds = [k[0] for k in setup.held_out_kinds]
    rows = []
    for name, m in models.items():
        f = target.fidelity(setup, m)
        by = {x.kind: x for x in (f, *f.others)}
        rows.append((name, [by[k] for k in kinds], batch_independence(m, tok, held)))
        print(name, [f"{by[k].mean:.4f}" for k in kinds], rows[-1][2], flush=True)
    times = timings(mhf.serve(mhf.load(model_dir)), tok, held)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"int8 activations rounded per call or per token, on {model_dir} (`bench/int8_per_token.py`, 2 threads)",
             "", "| model | " + " | ".join(f"{k} ({n})" for k, n, *_ in setup.held_out_kinds)
             + " | alone vs in batches of 16: mean cosine (least) |", "|---|" + "---|" * (len(kinds) + 1)]
    for name, fs, (mean, least) in rows:
        lines.append(f"| {name} | " + " | ".join(f"{f.mean:.4f} ({f.lo:.4f}-{f.hi:.4f})" for f in fs)
                     + f" | {mean:.5f} ({least:.5f}) |")
    lines += ["", f"Served (`multihead.hf.serve`), median of {ROUNDS} interleaved rounds, ms; the ratio is per token "
              "over per call:",
              "", "| batch | int8 per call | int8 per token | ratio (spread by round) |", "|---:|---:|---:|---|"]
    for n in (1, 16, 64):
        a, b = times[("per call", n)], times[("per token", n)]
        ratios = sorted(y / x for x, y in zip(a, b, strict=True))
        lines.append(f"| {n} | {1e3 * med[('per call', n)]:.1f} | {1e3 * med[('per token', n)]:.1f} | "
                     f"{med[('per token', n)] / med[('per call', n)]:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / "int8_per_token.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1])
