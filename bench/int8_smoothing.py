"""How much of int8's fidelity loss would per-channel activation smoothing win back? A measurement, not a feature.

On this CPU (AVX2, no VNNI) PyTorch's dynamic int8 Linear quantizes each call's activations per tensor with 7
bits, and the pruned all-MiniLM-L6-v2 that `prune --hf --target-cosine 0.95` keeps loses 0.975 -> 0.961 mean cosine
on unseen text to it. Smoothing (SmoothQuant, Xiao et al. 2023) divides each input channel j of a Linear by
s_j = max|X_j|^alpha / max|W_j|^(1-alpha) and multiplies the weight's column j by it: the float function is the
same, the activations' outlier channels shrink before they are rounded and the weights (rounded per output row)
take the scale. max|X_j| comes from the importance sentences. Here the division is a separate step before each
int8 Linear (in a BERT the input of q/k/v and of the feed-forward is also the residual stream, so it cannot be
folded into the LayerNorm before it). Fidelity as `prune --hf` reports it: mean cosine with its 95% interval on
the installed packages' descriptions and on the held-out split.

    .venv/bin/python bench/int8_smoothing.py P/model 0.6,0.7,0.8   # P: a `prune --hf ... --quantize int8` output
                                                                   # ~3 min on 2 cores; writes bench/results/int8_smoothing.md
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Smoothed(nn.Module):
    """``lin(x / s)``, s (in_features,): the smoothed layer (``lin``'s columns already multiplied by s)."""

    def __init__(self, s: torch.Tensor, lin: nn.Module):
        super().__init__()
        self.register_buffer("s", s)
        self.lin = lin

    def forward(self, x):
        return self.lin(x / self.s)


def main(model_dir: str, alphas: list[float]) -> None:
    import multihead.hf as mhf
    from multihead.apps.common.data import package_sentences, sentences
    from multihead.apps.prune import hf_models, target
    from multihead.models import minilm_path
    from multihead.quantize import quantize

    unseen = package_sentences(300, exclude=set(sentences()))
    setup = hf_models.hf_setup(minilm_path(), None, 128, None,
                               held_out_extra=("the installed packages' descriptions", unseen))
    base = mhf.load(model_dir, quantized=False)
    linears = {n: m for n, m in base.named_modules() if type(m) is nn.Linear and m.weight.numel()}
    amax: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):  # args[0] (..., in_features)
            a = args[0].detach().abs().flatten(0, -2).amax(0)  # (in_features,)
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    with torch.no_grad():
        for (ids, am), _ in setup.batches:
            base(input_ids=ids, attention_mask=am)
    for h in hooks:
        h.remove()
    rows = [("float (no int8)", target.fidelity(setup, base)),
            ("int8, as `quantize` makes it", target.fidelity(setup, quantize(base)))]
    for alpha in alphas:
        m = copy.deepcopy(base)
        for name in linears:
            lin = m.get_submodule(name)
            w_max = lin.weight.detach().abs().amax(0).clamp_min(1e-5)  # (in_features,)
            s = (amax[name].clamp_min(1e-5) ** alpha / w_max ** (1 - alpha)).clamp_min(1e-5)  # (in_features,)
            with torch.no_grad():
                lin.weight.mul_(s[None, :])  # (out, in) * (1, in)
            parent, _, child = name.rpartition(".")
            setattr(m.get_submodule(parent), child, Smoothed(s, lin))
        rows.append((f"int8, smoothed, alpha {alpha}", target.fidelity(setup, quantize(m))))
    lines = [f"int8 with per-channel activation smoothing on {model_dir} (`bench/int8_smoothing.py`)", "",
             "| model | cosine, the installed packages' descriptions (95% interval) | the held-out split |", "|---|---|---|"]
    for name, f in rows:
        other = f.others[0]
        lines.append(f"| {name} | {f.mean:.4f} ({f.lo:.4f}-{f.hi:.4f}) | {other.mean:.4f} ({other.lo:.4f}-{other.hi:.4f}) |"
                     if f.kind != "the held-out split" else
                     f"| {name} | {other.mean:.4f} ({other.lo:.4f}-{other.hi:.4f}) | {f.mean:.4f} ({f.lo:.4f}-{f.hi:.4f}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / "int8_smoothing.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1], [float(x) for x in sys.argv[2].split(",")])
