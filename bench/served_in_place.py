"""The served encoder's residual sums and activation in place, against the same layer with fresh buffers. A
measurement, not a feature.

``multihead.hf.encoder.EncoderLayer`` adds each residual into the product it just made (``a.add_(x)``,
``h.add_(x)``) and applies the exact GELU in place (``aten.gelu_``). This times the served pruned MiniLM on
held-out sentences at batch 1, 16 and 64 with that layer and with the out-of-place twin written below (``x + a``,
``F.gelu(u)``, ``x + h``: what it did before), switched in ABBA order by round in one process, after checking
that both give the same numbers bit for bit.

    .venv/bin/python bench/served_in_place.py bench/results/prune_minilm_hf_target/model   # ~2 min on 2 cores
                                                                 # writes bench/results/served_in_place.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUNDS = 16
BATCHES = (1, 16, 64)


def out_of_place(self, x, rows, B, L, call):
    """``EncoderLayer.forward`` with a fresh buffer for every residual sum and the activation (its attention
    block is the layer's own)."""
    from multihead.quantize import linear

    a = self.attend(x, rows, B, L, call)  # (N, E)
    _, _, k_up, k_down = self.kinds
    n1, n2 = self.norm1, self.norm2
    x = F.layer_norm(x + a, n1.normalized_shape, n1.weight, n1.bias, n1.eps)  # (N, E)
    u = linear(self.up, x, kind=k_up)  # (N, the feed-forward size)
    u = F.gelu(u) if self.exact_gelu else self.act(u)
    h = linear(self.down, u, kind=k_down)  # (N, E)
    return F.layer_norm(x + h, n2.normalized_shape, n2.weight, n2.bias, n2.eps)  # (N, E)


def main(model_dir: str, rounds: int = ROUNDS, batches: tuple[int, ...] = BATCHES, out: Path | None = None) -> Path:
    import multihead.hf as mhf
    from multihead.apps.common.data import held_out_batch
    from multihead.hf import encoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = mhf.serve(mhf.load(model_dir))
    in_place = encoder.EncoderLayer.forward

    def use(fn) -> None:
        encoder.EncoderLayer.forward = fn

    lines = [f"The served model ({model_dir}) with its residual sums and GELU in place, against fresh buffers "
             f"(`bench/served_in_place.py`), {torch.get_num_threads()} threads, inference mode, {rounds} rounds in "
             "ABBA order; ms per call (medians) and in place / fresh (median, quartiles, min-max by round).", "",
             "| batch | real tokens | in place, ms | fresh buffers, ms | in place / fresh | quartiles | min-max |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    try:
        for b in batches:
            x = held_out_batch(b)  # sentences the pruning never saw
            n = max(2, 200 // b)
            times = {in_place: [], out_of_place: []}
            with torch.inference_mode():
                outs = []
                for fn in (in_place, out_of_place):
                    use(fn)
                    outs.append(served(**x).last_hidden_state)
                if not torch.equal(*outs):
                    raise AssertionError(f"batch {b}: in place and fresh buffers differ")
                for r in range(rounds):
                    for fn in ((in_place, out_of_place) if r % 2 == 0 else (out_of_place, in_place)):
                        use(fn)
                        t = time.perf_counter()
                        for _ in range(n):
                            served(**x)
                        times[fn].append((time.perf_counter() - t) / n)
            ratio = [a / f for a, f in zip(times[in_place], times[out_of_place])]
            q1, _, q3 = statistics.quantiles(ratio, n=4)
            lines.append(f"| {b} | {int(x['attention_mask'].sum())} | {statistics.median(times[in_place]) * 1e3:.2f} | "
                         f"{statistics.median(times[out_of_place]) * 1e3:.2f} | {statistics.median(ratio):.3f} | "
                         f"{q1:.3f}-{q3:.3f} | {min(ratio):.3f}-{max(ratio):.3f} |")
            print(lines[-1], flush=True)
    finally:
        use(in_place)
    out = out or Path(__file__).parent / "results" / "served_in_place.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/prune_minilm_hf_target/model")
