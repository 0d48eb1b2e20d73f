"""W7 of ``multihead bench``: a sentence encoder from transformers, as a practitioner serves it.

all-MiniLM-L6-v2 (the ``pretrained`` extra) at batch 1, 16 and 64 on mixed-length sentences that no pruning
step saw (the held-out part of the corpus, as ``prune --hf`` splits it: never used for importance or
recovery), under ``torch.inference_mode``. Peers, timed in the same process, interleaved after a warm-up,
median and min-max per batch, per batch size: transformers' sdpa (the reference, 1.00x), the model attached
to multihead (padded), attached padding-free (``attach(packed=True)``), the same weights served
(``multihead.hf.serve``: the encoder rebuilt lean for prediction), and — with ``--pruned DIR``, a
directory written by ``multihead prune --hf ...`` — that pruned (recovered, int8) model loaded with
``multihead.hf.load``, that model served, and that model's float weights exported (``multihead.hf.export_onnx``) and quantized by
ONNX Runtime (the pruned model served by another runtime); with the ``onnx`` extra, ONNX Runtime's int8 model of
the unpruned checkpoint, and with
the ``openvino`` extra, OpenVINO's fp32 model of it, and with ``nncf`` too its int8 model (static quantization
calibrated on the corpus' importance split; all from ``multihead.hf.export_onnx``; see
:mod:`multihead.deploy.peers`). Fidelity: mean cosine of mean-pooled last hidden states to the sdpa model's
on every timed sentence.

And inside sentence-transformers (when installed): ``SentenceTransformer(<package>).encode`` on the same
sentences (it tokenizes, sorts by length and batches itself) with its own model, with that model attached
padding-free, and with the pruned model in its place (as loaded, and served) — the whole ``encode`` timed, so tokenization is in
every row.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from multihead.apps.prune import hf_models

#: the fidelity a recommended runtime must keep (mean cosine to transformers' sdpa on the timed sentences)
RECOMMEND_COSINE = 0.95
#: batches of each size timed (so each batch size sees 32-64 sentences)
BATCHES = {1: 32, 16: 4, 64: 1}


def _pooled(model, batch) -> torch.Tensor:
    """Mean-pooled, normalised last hidden states (B, E): prune --hf's fidelity measure."""
    return hf_models.pooled(model, batch["input_ids"], batch["attention_mask"])


def _models(path, pruned, example: dict, log, calibration: list[dict] | None = None) -> dict:
    """{name: model called as model(input_ids=, attention_mask=)}: the peers this machine has (``calibration``:
    batches of text the timing never uses, for OpenVINO's static int8 model)."""
    import transformers

    import multihead.hf as mhf
    from multihead.deploy import onnx, peers
    from multihead.deploy.session import ort_session

    models = {
        "transformers (sdpa)": transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval(),
        "multihead, padded": mhf.attach(transformers.AutoModel.from_pretrained(path).eval()),
        "multihead, padding-free": mhf.attach(transformers.AutoModel.from_pretrained(path).eval(), packed=True),
    }
    models["multihead served, fp32"] = mhf.serve(models["transformers (sdpa)"])  # the same weights, lean
    if pruned is not None:
        from multihead.quantize import is_quantized

        m = mhf.load(pruned)
        kept, total = (sum(a.attention_hooks.num_heads for a in mhf.attention_modules(x).values())
                       for x in (m, models["multihead, padded"]))
        heads = f"{kept}/{total}"  # the pruned model's heads / the checkpoint's (72 in all-MiniLM-L6-v2)
        models[f"multihead, {heads} heads, {is_quantized(m) or 'fp32'}, padding-free"] = m
        models[f"multihead served, {heads} heads, {is_quantized(m) or 'fp32'}"] = mhf.serve(m)
    models |= peers.peers(models["transformers (sdpa)"], example, log, calibration)  # what practitioners deploy
    if pruned is not None and any(n.startswith("ONNX Runtime") for n in models):  # the pruned model served by ORT
        from multihead.deploy.onnx import ONNX_DIR, ONNX_SERVE_INT8_FILE

        written = Path(pruned) / ONNX_DIR / ONNX_SERVE_INT8_FILE  # its int8 file to serve where the folder has it
        models[f"multihead, {heads} heads, exported, ONNX Runtime int8"] = (
            ort_session(written) if written.is_file() else
            onnx.ort_int8(onnx.export(mhf.load(pruned, quantized=False), example)))
    return models


def _time_batch_size(models: dict, batches: list, ref: torch.Tensor, max_seconds: float) -> tuple[list, str | None]:
    """Every model on ``batches`` in interleaved rounds: (rows of the table, the busy-machine note)."""
    from multihead import timing

    fidelity = {n: float((torch.cat([_pooled(m, b) for b in batches]) * ref).sum(-1).mean()) for n, m in models.items()}
    calls = {n: (lambda m=m: [m(**b) for b in batches]) for n, m in models.items()}
    t = timing.interleaved(calls, max_seconds=max_seconds, late_rounds=3)  # 3 rounds when the time runs short
    base = t["transformers (sdpa)"].median
    rows = [{"peer": n, "cosine": fidelity[n], "ms_per_batch": t[n].scaled(1 / len(batches)).to_json(),
             "speedup": round(base / t[n].median, 3),
             "speedup_range": [round(base / t[n].max, 3), round(base / t[n].min, 3)]} for n in models]
    return rows, timing.busy_note(t)


def run(pruned: str | Path | None = None, *, sizes: tuple[int, ...] = (1, 16, 64), n_batches: int | None = None,
        st_sentences: int = 64, max_seconds: float = 60.0, log: Callable[[str], None] = print) -> dict:
    """The tables above: {"sizes": {batch size: rows}, "sentence_transformers": rows or None}. ``n_batches``:
    batches timed per size (default :data:`BATCHES`); ``st_sentences``: sentences per ``encode``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from multihead.extras import require

    require("transformers", "hf")
    import transformers

    from multihead.apps.common.data import sentences
    from multihead.models import minilm_path

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    corpus = sentences()
    held_out = corpus[128 + min(256, len(corpus) // 4):]  # prune --hf's default split: never used for pruning
    per_size = {}
    models = None
    for B in sizes:
        sents = held_out[: B * (n_batches or BATCHES.get(B, 1))]
        batches = [dict(tok(sents[i:i + B], padding=True, truncation=True, max_length=128, return_tensors="pt"))
                   for i in range(0, len(sents), B)]
        batches = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]} for b in batches]  # (B, L)
        if models is None:  # OpenVINO's int8 calibrated on the importance split (never timed here)
            calib = [{k: v for k, v in tok(corpus[i:i + 16], padding=True, truncation=True, max_length=128,
                                           return_tensors="pt").items() if k in ("input_ids", "attention_mask")}
                     for i in range(0, 128, 16)]
            models = _models(path, pruned, batches[0], log, calib)
        with torch.inference_mode():
            ref = torch.cat([_pooled(models["transformers (sdpa)"], b) for b in batches])
            rows, busy = _time_batch_size(models, batches, ref, max_seconds)
        lens = [int(n) for b in batches for n in b["attention_mask"].sum(1)]
        log(f"W7 batch {B}: {len(batches)} batches of held-out sentences, {min(lens)}-{max(lens)} tokens, "
            f"{torch.get_num_threads()} threads")
        for r in rows:
            ms = r["ms_per_batch"]["median_ms"]
            log(f"  {r['peer']:45} cosine {r['cosine']:.4f}  {ms:7.1f} ms/batch  {r['speedup']:.2f}x "
                f"({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})")
        per_size[str(B)] = {"batches": len(batches), "tokens": [min(lens), max(lens)], "rows": rows, "busy": busy}
    st = _sentence_transformers(path, pruned, held_out[:st_sentences], max_seconds, log)
    deployed = None if pruned is None else _runtime_table(
        path, pruned, tok, held_out, calibration=calib, max_seconds=max_seconds, log=log,
        sizes={B: n_batches or hf_models.RUNTIME_BATCHES.get(B, 1) for B in sizes})
    from multihead.timing import cpu_flags

    return {"workload": "W7", "threads": torch.get_num_threads(), "cpu_flags": cpu_flags(), "sizes": per_size,
            "sentence_transformers": st, "runtimes": deployed}


def _runtime_table(path, pruned, tok, held_out: list[str], *, calibration: list[dict], max_seconds: float,
                   log, sizes: dict[int, int]) -> dict | None:
    """The pruned model's own runtime files (``pruned``/onnx, ``pruned``/openvino as ``prune --hf`` wrote them;
    exported here from its float weights when the folder has none) against the unpruned checkpoint's standard files
    (exported as users export it: :func:`multihead.deploy.peers.standard_files`), with multihead's own export of the
    unpruned checkpoint as a column, in each runtime: :func:`multihead.deploy.compare.compare` on three kinds of unseen
    text (the held-out
    sentences, the installed packages' descriptions, passages of the held-out sentences), with the fidelity of each
    pruned file per kind. None without the onnx extra."""
    import tempfile

    import transformers

    import multihead.hf as mhf
    from multihead.apps.common.data import package_sentences
    from multihead.deploy import compare
    from multihead.extras import require

    try:
        require("onnxscript", "the runtime table")
    except ImportError as e:
        log(f"  no runtime table: {e}")
        return None
    from multihead.deploy import onnx as d_onnx
    from multihead.deploy import openvino as d_ov
    from multihead.deploy import peers

    full = mhf.attach(transformers.AutoModel.from_pretrained(path).eval())
    kept = mhf.load(pruned, quantized=False)
    names = {"onnx": d_onnx.ONNX_FILE, "onnx_int8": d_onnx.ONNX_INT8_FILE, "onnx_eager": d_onnx.ONNX_EAGER_FILE,
             "onnx_eager_int8": d_onnx.ONNX_EAGER_INT8_FILE, "onnx_optimized": d_onnx.ONNX_OPT_FILE,
             "onnx_optimized_int8": d_onnx.ONNX_OPT_INT8_FILE, "onnx_attention": d_onnx.ONNX_ATTENTION_FILE,
             "onnx_attention_int8": d_onnx.ONNX_ATTENTION_INT8_FILE}
    written = {k: Path(pruned) / d_onnx.ONNX_DIR / n for k, n in names.items()} | {
        k: Path(pruned) / d_ov.OPENVINO_DIR / n for k, n in (("openvino", d_ov.OPENVINO_FILE),
                                                            ("openvino_int8", d_ov.OPENVINO_INT8_FILE))}
    files = {k: f for k, f in written.items() if f.is_file()}
    with tempfile.TemporaryDirectory(prefix="multihead-") as made:  # this table's own files: removed after it
        if "onnx" not in files:
            files = mhf.export(kept, Path(made) / "pruned", calibration=calibration, serve=False)
        base = mhf.export(full, Path(made) / "unpruned", openvino=False, serve=False)  # a column: ONNX Runtime's
        # (OpenVINO's would be converted from the same graph as the standard ones)
        peer = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
        standard = peers.standard_files(peer, calibration[0], calibration)  # as the speed table's peers: one export
        n = max(sizes) * max(sizes.values())  # items of each kind: enough for the largest batch's batches
        others = package_sentences(n, exclude=set(held_out))
        long = hf_models.passages(tok, held_out[200:], n, hf_models.PASSAGE_TOKENS)
        kinds = (("the held-out sentences", n), ("the installed packages' descriptions", len(others)),
                 ("passages of held-out sentences", len(long), "passages"))
        inputs, by_kind = hf_models.runtime_texts(tok, kinds, held_out[:n] + others, long, hf_models.PASSAGE_TOKENS,
                                                  sizes)
        rows = compare.compare(full, kept, standard, base, files, inputs, max_seconds=max_seconds, log=log)
        fid = compare.fidelity(full, files, by_kind)
    log(compare.markdown(rows, fid))
    return {"rows": rows, "fidelity": fid}


def _sentence_transformers(path, pruned, sents: list[str], max_seconds: float, log) -> dict | None:
    """``SentenceTransformer.encode`` (batch 16) with its own model, attached padding-free, and with the pruned
    model in its place: {rows, busy}, or None without sentence-transformers."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        log("  sentence-transformers not installed: its table is skipped")
        return None
    import multihead.hf as mhf
    from multihead import timing

    def encoder(swap=None, packed=False, served=False):
        st = SentenceTransformer(str(path), device="cpu")
        if packed:
            mhf.attach(st[0].auto_model, packed=True)
        if swap is not None:  # (.auto_model is a read-only view of .model)
            st[0].model = mhf.serve(mhf.load(swap)) if served else mhf.load(swap)
        return st.eval()

    encoders = {"sentence-transformers": encoder(), "sentence-transformers + multihead padding-free":
                encoder(packed=True)}
    if pruned is not None:
        encoders["sentence-transformers + the pruned model"] = encoder(swap=pruned)
        encoders["sentence-transformers + the pruned model served"] = encoder(swap=pruned, served=True)
    with torch.inference_mode():
        ref = encoders["sentence-transformers"].encode(sents, batch_size=16, convert_to_tensor=True)
        cos = {n: float((e.encode(sents, batch_size=16, convert_to_tensor=True) * ref).sum(-1).mean())
               for n, e in encoders.items()}
        t = timing.interleaved({n: (lambda e=e: e.encode(sents, batch_size=16)) for n, e in encoders.items()},
                               max_seconds=max_seconds, late_rounds=3)
    base = t["sentence-transformers"].median
    rows = [{"peer": n, "cosine": cos[n], "ms_per_encode": t[n].to_json(),
             "speedup": round(base / t[n].median, 3),
             "speedup_range": [round(base / t[n].max, 3), round(base / t[n].min, 3)]} for n in encoders]
    for r in rows:
        log(f"  {r['peer']:50} cosine {r['cosine']:.4f}  {r['ms_per_encode']['median_ms']:7.1f} ms  "
            f"{r['speedup']:.2f}x")
    return {"sentences": len(sents), "rows": rows, "busy": timing.busy_note(t)}


def _table(first: str, what: str, rows: list[dict], key: str) -> list[str]:
    """A markdown table of ``rows``: peer, mean cosine, ``row[key]`` ms (median, min-max), speed-up (range)."""
    lines = [f"| {first} | mean cosine{' to sdpa' if first == 'peer' else ''} | ms per {what} (median, min-max) | "
             "speed-up |", "|---|---:|---:|---:|"]
    for row in rows:
        ms, lo_hi = row[key], row["speedup_range"]
        lines.append(f"| {row['peer']} | {row['cosine']:.4f} | {ms['median_ms']:.1f} ({ms['min_ms']:.1f}-"
                     f"{ms['max_ms']:.1f}) | {row['speedup']:.2f}x ({lo_hi[0]:.2f}-{lo_hi[1]:.2f}) |")
    return lines


def markdown(r: dict) -> str:
    lines = [f"W7: all-MiniLM-L6-v2 through transformers, held-out mixed-length sentences, {r['threads']} threads "
             f"on a CPU with {' '.join(r.get('cpu_flags') or []) or 'unknown flags'}, "
             "inference_mode; speed-up = transformers sdpa's time / the peer's (median, range over interleaved "
             "rounds)", ""]
    from multihead.deploy import compare

    for B, s in r["sizes"].items():
        lines += [f"**Batch {B}** ({s['batches']} batches, {s['tokens'][0]}-{s['tokens'][1]} tokens)", ""]
        lines += _table("peer", "batch", s["rows"], "ms_per_batch")
        best = compare.recommend(s["rows"], min_cosine=RECOMMEND_COSINE)
        lines += ["", f"Recommended at batch {B}: {best}."] if best else []
        lines += (["", f"note: {s['busy']}"] if s.get("busy") else []) + [""]
    st = r.get("sentence_transformers")
    if st:
        lines += [f"**Inside sentence-transformers**: `encode` of {st['sentences']} sentences, batch_size=16 "
                  "(tokenization and its length sorting included)", ""]
        lines += _table("encoder", "encode", st["rows"], "ms_per_encode")
        lines += (["", f"note: {st['busy']}"] if st.get("busy") else [])
    if r.get("runtimes"):
        lines += ["", "**Where prediction happens**: the pruned model's own files against the unpruned checkpoint's "
                  "standard files (exported as each runtime's documentation does it; the faster way is the peer), "
                  "multihead's own export of the unpruned checkpoint beside them, runtime by runtime, on unseen text "
                  "of three kinds (ms per batch); the bound is the ratio of the padded call's floating-point work", "",
                  compare.markdown(r["runtimes"]["rows"], r["runtimes"]["fidelity"])]
    return "\n".join(lines) + "\n"
