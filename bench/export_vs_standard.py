"""The runtime table of issue 63 on all-MiniLM-L6-v2: the standard export of the unpruned model (``torch.onnx.export``
+ ``quantize_dynamic`` per channel, and after ONNX Runtime's transformer optimizer), multihead's export of the unpruned
model and of a pruned one, in ONNX Runtime fp32 and int8 at batch 1, 16 and 64 on unseen text, each speed-up over the
peer beside the bound of the work removed, the pruned files' cosine on that text, and the CPU's flags.

    .venv/bin/python bench/export_vs_standard.py [--fraction 0.4] [--pruned OUT/model] [--keep-per-layer N]
        [--max-seconds 20] [--min-rounds 7] [--batches 1 16 64] [--calls 8] [--openvino] [--profile-openvino]
        [--serve-batch N]

Without ``--pruned`` the cut is ``--fraction`` of the heads, least important by ablation (mean replacement) on 64
sentences, with no recovery (a speed measurement: the fidelity is the zero-shot one); with it, the folder ``prune
--hf`` wrote (its float weights). ``--keep-per-layer N`` keeps the first N heads of every layer instead: with N = 1,
the most a cut of heads can give in each runtime, beside the bound of that cut (its fidelity is not the point).
Two threads, ONNX Runtime's workers not spinning, rounds interleaved (at least ``--min-rounds`` per batch size unless
``--max-seconds`` runs out first), each speed-up the median of the rounds' ratios with its 95% interval.
``--profile-openvino`` then times OpenVINO's int8 files node by node at batch 1 (OpenVINO's own per-node counters, the
batch-1 inputs): where the cut's work goes at the batch size where it gains least."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _flags() -> str:
    from multihead.timing import CPU_FLAGS, cpu_flags

    return " ".join(cpu_flags()) or platform.processor() or "none of " + ", ".join(CPU_FLAGS)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fraction", type=float, default=0.4)
    p.add_argument("--pruned", default=None)
    p.add_argument("--keep-per-layer", type=int, default=None,
                   help="keep the first N heads of every layer (a ceiling of what cutting heads gives)")
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--min-rounds", type=int, default=7)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], choices=[1, 16, 64])
    p.add_argument("--calls", type=int, default=8,
                   help="batch-1 calls in each round (one sentence each; more average a short call's jitter)")
    p.add_argument("--openvino", action="store_true",
                   help="OpenVINO's rows too (fp32, and NNCF's static int8 calibrated on 64 training sentences)")
    p.add_argument("--serve-batch", type=int, default=None,
                   help="the file to serve is the fastest pruned form at this batch size (default: the best geometric "
                        "mean over the batch sizes timed)")
    p.add_argument("--profile-openvino", action="store_true",
                   help="after the table, OpenVINO's int8 files node by node at batch 1 (needs --openvino)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prune_minilm_hf_standard" / "export_vs_standard.md"),
                   help="the table, with the command that made it (printed too)")
    a = p.parse_args(argv)
    if a.profile_openvino and not (a.openvino and 1 in a.batches):
        raise SystemExit("--profile-openvino: profiles OpenVINO's int8 files at batch 1; give --openvino and keep "
                         "batch 1 in --batches")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    import transformers

    import multihead.hf as mhf
    from multihead import heads
    from multihead.apps.common.data import package_sentences, sentences
    from multihead.apps.prune import hf_models
    from multihead.deploy import compare, peers, session
    from multihead.models import minilm_path

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    peer = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    full = mhf.attach(transformers.AutoModel.from_pretrained(path).eval())
    corpus = sentences()
    calib = [dict(tok(corpus[i:i + 16], padding=True, return_tensors="pt")) for i in range(0, 64, 16)]
    if a.pruned:
        kept, how = mhf.load(a.pruned, quantized=False), f"the folder {a.pruned}"
    elif a.keep_per_layer is not None:
        import copy

        kept, n = copy.deepcopy(full), full.config.num_attention_heads
        if not 1 <= a.keep_per_layer <= n:
            raise SystemExit(f"--keep-per-layer: got {a.keep_per_layer}; give 1 to {n} (the heads of a layer)")
        heads.prune(kept, {name: list(range(a.keep_per_layer, n)) for name, _ in kept.named_modules()
                           if name.endswith("attention.self")})
        how = f"every layer's first {a.keep_per_layer} of {n} heads kept, no recovery"
    else:
        batches = [((b["input_ids"], b["attention_mask"]), None) for b in calib]

        def loss(m, b):
            (ids, am), _ = b
            with torch.no_grad():
                ref = hf_models.pooled(full, ids, am)
            return 1 - (hf_models.pooled(m, ids, am) * ref).sum(-1).mean()

        import copy

        kept = copy.deepcopy(full)
        fill = heads.mean_head_outputs(kept, batches, loss)
        imp = heads.importance(kept, batches, loss, "ablation", fill=fill, progress=False)
        n = round(a.fraction * 72)
        heads.prune(kept, imp.least(n), mean_outputs=fill)
        how = f"{n} of 72 heads cut by ablation order, no recovery"
    unseen = package_sentences(200, exclude=set(corpus))
    sizes = {B: n for B, n in {1: a.calls, 16: 2, 64: 1}.items() if B in a.batches}
    inputs = {B: [{k: v for k, v in tok(unseen[i:i + B], padding=True, truncation=True, max_length=128,
                                         return_tensors="pt").items() if k in ("input_ids", "attention_mask")}
                  for i in range(0, B * n, B)] for B, n in sizes.items()}
    kinds = {"unseen package descriptions": [{k: v for k, v in tok(unseen[i:i + 16], padding=True, truncation=True,
                                                                 max_length=128, return_tensors="pt").items()
                                              if k in ("input_ids", "attention_mask")} for i in range(0, 192, 16)]}
    d = session.scratch()  # removed when the run ends
    ov = {"calibration": calib, "openvino": True} if a.openvino else {"openvino": False}
    standard = peers.standard_files(peer, next(iter(kinds.values()))[0], ov.get("calibration"), openvino=ov["openvino"])
    base = mhf.export(full, d / "unpruned", serve=False, **ov)
    files = mhf.export(kept, d / "pruned", serve=False, **ov)
    rows = compare.compare(full, kept, standard, base, files, inputs, max_seconds=a.max_seconds,
                           min_rounds=a.min_rounds, log=print, serve_batch=a.serve_batch)
    table = (f"all-MiniLM-L6-v2, {how}; CPU: {platform.machine()} {_flags()}, torch {torch.__version__}, 2 threads\n\n"
             + compare.markdown(rows, compare.fidelity(full, files, kinds)))
    from multihead.deploy import serve  # each runtime's file to serve, chosen from this table

    chosen = "\n".join(serve.lines(serve.write(d / "pruned", files, serve.from_rows(rows), a.serve_batch,
                                               measured_on="this table's unseen text")))
    print("\n" + table + "\n" + chosen)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(f"`python bench/export_vs_standard.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
                           + table + "\n\n" + chosen + "\n")
    print(f"wrote {a.out}")
    if a.profile_openvino:
        peer_ir = standard.get("openvino_pt_int8") or standard["openvino_int8"]
        _profile({"peer": peer_ir, "unpruned": base["openvino_int8"], "pruned": files["openvino_int8"]}, inputs[1])


def _profile(irs: dict, batches: list[dict], passes: int = 20) -> None:
    """Each OpenVINO IR in ``irs`` ({name: path}) run ``passes`` times over ``batches`` (batch 1), the files
    interleaved pass by pass, compiled as the table compiles them plus OpenVINO's per-node counters: microseconds a
    call per layer's product (q, k, v, o, the two feed-forward ones) and attention, the other nodes by type, their sum
    and the wall time a call."""
    import re
    from collections import Counter

    import openvino as ov

    part = re.compile(r"layer\.(\d+)\.(attention\.self\.(?:query|key|value)|attention\.output\.dense|"
                      r"intermediate\.dense|output\.dense|attention\.self/aten::scaled_dot_product_attention)")
    runs = {}
    for name, f in irs.items():
        c = ov.Core().compile_model(str(f), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2,
                                                    "PERFORMANCE_HINT": "LATENCY", "PERF_COUNT": "YES"})
        names, r = [i.get_any_name() for i in c.inputs], c.create_infer_request()
        feeds = [{n: b.get(n, torch.zeros_like(b["input_ids"])).numpy() for n in names} for b in batches]  # types: 0
        for fd in feeds:  # warm: every length compiled once
            r.infer(fd)
        runs[name] = (r, feeds, Counter(), [0.0])
    for p in range(passes):  # the files interleaved, their order alternating: the machine's drift shared
        for name in (list(runs) if p % 2 == 0 else list(runs)[::-1]):
            r, feeds, us, wall = runs[name]
            for fd in feeds:
                t = time.perf_counter()
                r.infer(fd)
                wall[0] += time.perf_counter() - t
                for n in r.profiling_info:
                    if n.status == n.Status.EXECUTED and n.node_type != "Transpose" and (m := part.search(n.node_name)):
                        us[f"layer {m.group(1)} {m.group(2).split('/')[0].replace('attention.self', 'attention')}"] \
                            += n.real_time.total_seconds()
                    elif n.status == n.Status.EXECUTED:
                        us[f"other: {n.node_type}"] += n.real_time.total_seconds()
    got = {}
    for name, (_, feeds, us, wall) in runs.items():
        calls = passes * len(feeds)
        got[name] = {k: v / calls * 1e6 for k, v in us.items()} | {"all nodes": sum(us.values()) / calls * 1e6,
                                                                    "wall a call": wall[0] / calls * 1e6}
    keys = sorted(set().union(*got.values()) - {"all nodes", "wall a call"}) + ["all nodes", "wall a call"]
    print("\nOpenVINO int8 at batch 1, microseconds a call (OpenVINO's per-node counters)\n")
    print("| node | " + " | ".join(got) + " |\n|---|" + "---:|" * len(got))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{got[n].get(k, 0.0):.1f}" for n in got) + " |")


if __name__ == "__main__":
    main()
