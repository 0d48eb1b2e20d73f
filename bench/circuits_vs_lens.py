"""Edge attribution (EAP) of every edge, multihead against TransformerLens 4.3's ``attribution_patch(granularity=
"edge")``, on the same GPT-2 weights (random: the shape is what is timed), the same batch and tokens, the same metric
(the logit difference at the last position, averaged over the batch), both on CPU in float32.

What each computes. TransformerLens runs, for each row of the batch, a clean forward and a corrupted forward with
one backward, and scores every edge at every position (a Python dict of (writer, reader) node pairs per position,
the edge's contribution at that position). multihead runs one forward of each input for the whole batch and one
backward, and scores every edge summed over positions (the per-position scores summed: checked equal here, 1e-4).

Time: interleaved rounds (median, min-max) in this process. Peak memory: each measured in its own subprocess (the
model built, then the kernel's peak resident set reset -- ``/proc/self/clear_refs`` 5 -- and read back from
``VmHWM`` after one call: the peak above what the process held before the call; no warm-up call first, so a
method's first-call costs count). EAP-IG (``steps`` 5) is timed and measured for multihead alone (TransformerLens
raises NotImplementedError for ig_steps > 1).

    .venv/bin/python bench/circuits_vs_lens.py            # GPT-2 small's shape: 12 layers x 12 heads, E = 768,
                                                          # vocabulary 50257, 2 sequences of 16 tokens
    .venv/bin/python bench/circuits_vs_lens.py --tiny     # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import torch

KINDS = ("TransformerLens", "multihead", "multihead EAP-IG 5")


def _setup(a, kinds):
    """The model (GPT-2's shape), the two token batches and one callable per kind in ``kinds``."""
    import transformers as T

    layers, H, E = (2, 4, 32) if a.tiny else (12, 12, 768)
    V = 50 if a.tiny else a.vocab
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=max(a.length, 16), n_embd=E, n_layer=layers,
                                           n_head=H)).eval()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, V, (a.batch, a.length), generator=g)
    corrupted = clean.clone()
    q = a.length // 4
    corrupted[:, q:2 * q] = torch.randint(0, V, (a.batch, q), generator=g)
    calls = {}
    if "TransformerLens" in kinds:
        from transformer_lens.model_bridge import TransformerBridge
        from transformer_lens.tools.analysis import attribution_patching as ap

        from multihead.deploy.session import scratch  # removed when the run ends

        folder = scratch()
        model.save_pretrained(folder)
        bridge = TransformerBridge.boot_transformers(folder, hf_model=copy.deepcopy(model), device="cpu")
        config = ap.EdgeAttributionConfig(granularity="edge")
        calls["TransformerLens"] = lambda: ap.attribution_patch(
            bridge, clean, corrupted, lambda lg: (lg[:, -1, 3] - lg[:, -1, 5]).mean(), config)
    if any(k.startswith("multihead") for k in kinds):
        import multihead.hf as mhf
        from multihead import heads

        ours = mhf.attach(copy.deepcopy(model))

        def metric(out):
            return out.logits[:, -1, 3] - out.logits[:, -1, 5]

        calls["multihead"] = lambda: heads.edge_attribution(ours, {"input_ids": clean}, {"input_ids": corrupted},
                                                            metric)
        calls["multihead EAP-IG 5"] = lambda: heads.edge_attribution(
            ours, {"input_ids": clean}, {"input_ids": corrupted}, metric, method="eap-ig", steps=5)
    return {k: calls[k] for k in kinds}, f"GPT-2 {layers} layers x {H} heads, E={E}, vocabulary {V}"


def _status(key: str) -> int:
    """A line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _peak(a) -> None:
    """In a subprocess: the peak resident memory one call of ``a.peak`` adds, printed as JSON."""
    import ctypes
    import gc

    call = _setup(a, [a.peak])[0][a.peak]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set := the current one
    before = _status("VmRSS")
    call()
    print(json.dumps({"peak_mib": (_status("VmHWM") - before) / 2**20, "before_mib": before / 2**20}))


def _compare(calls) -> float:
    """The largest difference between TransformerLens' per-position edge scores summed over positions and
    multihead's, on this batch (their nodes mapped to multihead's names)."""
    theirs = calls["TransformerLens"]()
    ours = calls["multihead"]()

    def name(n):
        if n.kind in ("embed", "logits"):
            return n.kind
        at = f"transformer.h.{n.layer}"
        if n.kind in ("mlp_out", "mlp_in"):
            return f"{at}.mlp" + (".in" if n.kind == "mlp_in" else "")
        return f"{at}.attn.{'h' if n.kind == 'attn_head_out' else n.kind[0]}{n.head}"

    summed: dict = {}
    for (w, r), v in theirs.edge_scores.items():
        summed[(name(w), name(r))] = summed.get((name(w), name(r)), 0.0) + v
    if set(summed) != set(ours.edges):
        raise SystemExit("the two graphs differ")
    want = torch.tensor([summed[e] for e in ours.edges], dtype=torch.float64)
    return float((want - ours.scores).abs().max())


def main(argv: list[str] | None = None) -> dict:
    ap_ = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap_.add_argument("--tiny", action="store_true")
    ap_.add_argument("--batch", type=int, default=2)
    ap_.add_argument("--length", type=int, default=16)
    ap_.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2 small's by default)")
    ap_.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap_.add_argument("--max-seconds", type=float, default=240.0)
    ap_.add_argument("--peak", choices=KINDS, help=argparse.SUPPRESS)  # the memory subprocess
    ap_.add_argument("--out", default="bench/results/circuits_vs_lens")
    a = ap_.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.peak:
        return _peak(a)
    from multihead import timing

    calls, model = _setup(a, KINDS)
    diff = _compare(calls)
    t = timing.interleaved(calls, warmup=0, min_rounds=3, max_rounds=10, max_seconds=a.max_seconds)
    args = [f"--batch={a.batch}", f"--length={a.length}", f"--vocab={a.vocab}", f"--threads={a.threads}"]
    args += ["--tiny"] if a.tiny else []
    peak = {k: json.loads(subprocess.run([sys.executable, __file__, *args, f"--peak={k}"], check=True,
                                         capture_output=True, text=True).stdout.strip().splitlines()[-1])
            for k in KINDS}
    tl, tl_mib = t["TransformerLens"], peak["TransformerLens"]["peak_mib"]
    row = {"model": model, "batch": a.batch, "length": a.length, "threads": a.threads, "max_abs_diff": diff,
           "load": Path("/proc/loadavg").read_text().split()[:3]}
    lines = ["| method | ms (median, min-max) | time / TransformerLens | peak MiB | memory / TransformerLens |",
             "|---|---:|---:|---:|---:|"]
    for k in KINDS:
        row[k] = {**t[k].to_json(), "peak_mib": round(peak[k]["peak_mib"], 1),
                  "time_ratio": round(t[k].median / tl.median, 4),
                  "time_ratio_range": [round(t[k].min / tl.max, 4), round(t[k].max / tl.min, 4)],
                  "memory_ratio": round(peak[k]["peak_mib"] / tl_mib, 4)}
        r = row[k]
        lines.append(f"| {k} | {t[k].median:.0f} ({t[k].min:.0f}-{t[k].max:.0f}) | {r['time_ratio']:.3f} "
                     f"({r['time_ratio_range'][0]:.3f}-{r['time_ratio_range'][1]:.3f}) | {r['peak_mib']:.1f} | "
                     f"{r['memory_ratio']:.3f} |")
    threads = f"{a.threads} thread" + ("s" if a.threads > 1 else "")
    md = (f"{model}; batch {a.batch} x {a.length} tokens; CPU float32, {threads}; {tl.n} interleaved "
          f"rounds; load {' '.join(row['load'])}; TransformerLens' per-position scores summed vs multihead's: max "
          f"difference {diff:.1e}\n\n" + "\n".join(lines) + "\n")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "circuits_vs_lens.json").write_text(json.dumps(row, indent=1))
    (out / "circuits_vs_lens.md").write_text(md)
    print(md)
    return row


if __name__ == "__main__":
    main()
