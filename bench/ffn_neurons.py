"""Would pruning the feed-forward's neurons reach issue 35's speed at cosine >= 0.95? A measurement, not a feature.

The model is the one `prune --hf` keeps for all-MiniLM-L6-v2 at --target-cosine 0.95 (31% of heads pruned, 400
recovery steps; its float weights, ``multihead.hf.load(DIR, quantized=False)``). Each layer's feed-forward neurons
are ranked by the mean |GELU output| over the importance sentences times the norm of the neuron's output column,
the lowest FRACTION of every layer cut (``multihead.heads.surgery.select`` on intermediate.dense's rows and
output.dense's columns), the model distilled towards the unpruned one as `prune --hf` does (STEPS steps, int8
rounding simulated, the same recovery text), then quantized to int8. Fidelity is measured as `prune --hf` reports
it: the mean cosine with its 95% interval on each kind of held-out text (the split and the installed packages'
descriptions). Speed: the served int8 model (``multihead.hf.serve``) at batch 1 and 16 against transformers'
sdpa fp32 unpruned, one held-out batch each, medians of 15 calls (a rough figure; W7 is the interleaved one).

    .venv/bin/multihead prune --hf <all-MiniLM-L6-v2> --target-cosine 0.95 --recover 400 --quantize int8 --out P
    .venv/bin/python bench/ffn_neurons.py P/model 0.3,0.5 300   # ~8 min on 2 cores; writes bench/results/ffn_neurons.md
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(model_dir: str, fractions: list[float], steps: int) -> None:
    import multihead.hf as mhf
    from multihead.apps.common.data import docstring_sentences, package_sentences, sentences
    from multihead.apps.prune import hf_models, target
    from multihead.heads.surgery import select
    from multihead.models import minilm_path
    from multihead.quantize import quantize

    wide = docstring_sentences(16 * steps)
    unseen = package_sentences(300, exclude=set(sentences()) | set(wide))
    setup = hf_models.hf_setup(minilm_path(), None, 128, None, recover_extra=wide,
                               held_out_extra=("the installed packages' descriptions", unseen))
    base = mhf.load(model_dir, quantized=False)
    layers = base.encoder.layer
    summed = [torch.zeros(layer.intermediate.dense.out_features) for layer in layers]  # (I,) per layer

    def record(i):
        def hook(module, args, out):  # out (B, L, I): the GELU outputs
            summed[i].add_(out.abs().flatten(0, -2).sum(0))
        return hook

    hooks = [layer.intermediate.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for (ids, am), _ in setup.batches:
            base(input_ids=ids, attention_mask=am)
    for h in hooks:
        h.remove()
    score = [s * layer.output.dense.weight.norm(dim=0) for s, layer in zip(summed, layers)]  # (I,) per layer

    def cut(fraction: float):
        m = copy.deepcopy(base)
        for s, layer in zip(score, m.encoder.layer):
            keep = sorted(s.argsort(descending=True)[: s.numel() - int(fraction * s.numel())].tolist())
            layer.intermediate.dense = select(layer.intermediate.dense, out_rows=keep)
            layer.output.dense = select(layer.output.dense, in_cols=keep)
        return m

    def ms(model) -> dict[int, float]:
        out = {}
        with torch.inference_mode():
            for B in (1, 16):
                ids, am = setup.speed_inputs[B][0]
                for _ in range(3):
                    model(input_ids=ids, attention_mask=am)
                times = []
                for _ in range(15):
                    t = time.perf_counter()
                    model(input_ids=ids, attention_mask=am)
                    times.append(time.perf_counter() - t)
                out[B] = 1e3 * statistics.median(times)
        return out

    peer = ms(setup.peer[1])
    rows = [("heads pruned (the kept model), int8", target.fidelity(setup, quantize(base)),
             ms(mhf.serve(quantize(base))))]
    for fraction in fractions:
        m = cut(fraction)
        zero_shot = target.fidelity(setup, m)
        setup.recover_fn(m, steps, quantize="int8")
        rows.append((f"+ {fraction:.0%} of FFN neurons, zero-shot (float)", zero_shot, None))
        rows.append((f"+ {fraction:.0%} of FFN neurons, {steps} recovery steps (float)", target.fidelity(setup, m), None))
        q = quantize(m)
        rows.append((f"+ {fraction:.0%} of FFN neurons, {steps} recovery steps, int8", target.fidelity(setup, q),
                     ms(mhf.serve(q))))
    lines = [f"FFN neuron pruning on {model_dir} (`bench/ffn_neurons.py`), {torch.get_num_threads()} threads; "
             f"transformers sdpa fp32 unpruned: {peer[1]:.1f} ms at batch 1, {peer[16]:.1f} ms at batch 16", "",
             "| model | fidelity (worst kind, 95% interval) | other kind | served int8 vs sdpa, batch 1 / 16 |",
             "|---|---|---|---:|"]
    for name, f, speed in rows:
        other = f.others[0] if f.others else None
        sp = f"{peer[1] / speed[1]:.2f}x / {peer[16] / speed[16]:.2f}x" if speed else ""
        lines.append(f"| {name} | {f.mean:.4f} ({f.lo:.4f}-{f.hi:.4f}, {f.kind}) | "
                     + (f"{other.mean:.4f} ({other.kind})" if other else "") + f" | {sp} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / "ffn_neurons.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1], [float(x) for x in sys.argv[2].split(",")], int(sys.argv[3]))
