"""The cut where prediction happens: a pruned encoder's exported files (:func:`multihead.hf.export`) against what
users run today -- the unpruned transformers model made into each runtime's files the way that runtime's
documentation does it (:func:`multihead.deploy.peers.standard_files`; with ONNX Runtime's transformer optimizer
too, the faster of the two being the peer) -- in the same runtime (ONNX Runtime fp32 and int8, OpenVINO fp32 and
int8), timed interleaved at each batch size, each speed-up beside the arithmetic bound of the work the cut removed
(:func:`work`: the floating-point operations of the padded call, as the runtimes compute padding), with the pruned
file's fidelity per kind of text. multihead's own export of the unpruned model is a row of the table, never its
baseline. Used by ``prune --hf`` and ``multihead bench --pruned``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from multihead import timing
from multihead.deploy import peers
from multihead.deploy.session import openvino_model, ort_session

#: (label, the keys of :func:`multihead.hf.export`'s result that run there -- each a way of making the file, the
#: faster counts --, how a file is opened)
RUNTIMES = (("ONNX Runtime fp32", ("onnx", "onnx_eager", "onnx_optimized", "onnx_attention", "onnx_eager_optimized"),
             ort_session),
            ("ONNX Runtime int8", ("onnx_int8", "onnx_eager_int8", "onnx_optimized_int8", "onnx_attention_int8",
                                   "onnx_eager_optimized_int8"), ort_session),
            ("OpenVINO fp32", ("openvino", "openvino_pt"), openvino_model),
            ("OpenVINO int8", ("openvino_int8", "openvino_pt_int8"), openvino_model))


def pooled(model, ids, am):
    """Mean-pooled, normalised last hidden states (B, E) of ``model`` on (input_ids, attention_mask) (B, L): the
    sentence embedding sentence-transformers' MiniLM gives, and the fidelity ``prune --hf`` measures."""
    h = model(input_ids=ids, attention_mask=am).last_hidden_state  # (B, L, E)
    m = am.to(h.dtype)[..., None]  # (B, L, 1)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)  # (B, E)


def work(model: nn.Module, batch: dict) -> float:
    """Floating-point operations of one padded call of ``model`` on ``batch`` ({"input_ids", "attention_mask"}
    (B, L)): the matrix products torch runs (``FlopCounterMode``: projections, feed-forward) plus each attention
    module's scores and weighted sum, 2·B·H·Lq·Lk·(D + Dv) with Lq = Lk = L (multihead's kernels are not seen by the
    counter). The padded call is what ONNX Runtime and OpenVINO compute; a padding-free model is counted padded."""
    from torch.utils.flop_counter import FlopCounterMode

    import multihead.hf as mhf
    from multihead.hf import packed as hf_packed

    packing = model.__dict__.get(hf_packed.KEY)
    was = packing.enabled if packing is not None else None
    if packing is not None:
        packing.enabled = False
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        if packing is not None:
            packing.enabled = was
    B, L = batch["input_ids"].shape
    scores = 0
    for m in mhf.attention_modules(model).values():
        hooks = m.attention_hooks
        D = hooks.layout.head_dim(m) if hooks.layout is not None else 0
        scores += 2 * B * hooks.num_heads * L * L * 2 * D
    return float(counter.get_total_flops() + scores)


class _OpByOp(TorchFunctionMode):
    """Every op where the FLOP counter sees it: any active function mode turns torch.nn's fused fast path
    (``torch._native_multi_head_attention``) off, and each SDPA call is computed as q k^T, softmax, @ v (the CPU
    flash kernel has no FLOP formula)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _math_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _math_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA written out: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv), no dropout."""
    if k.shape[-3] != q.shape[-3]:  # GQA: each key/value head serves H / Hkv query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)  # (B, Hkv, Lk, D) -> (B, H, Lk, D)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, Lq, Lk)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    w = s.softmax(-1)
    return (w.nan_to_num(0.0) if attn_mask is not None or is_causal else w) @ v


def flops(call: Callable[[], object]) -> float:
    """Floating-point operations of ``call()`` (any model call, no gradients), counted op by op by torch's
    ``FlopCounterMode`` with attention written out (:class:`_OpByOp`): the arithmetic a pruned model's bound is
    the ratio of (``flops(unpruned call) / flops(pruned call)``)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), _OpByOp(), FlopCounterMode(display=False) as counter:
        call()
    return float(counter.get_total_flops())


def _fastest(per: dict, label: str, side: str, sides: dict) -> tuple:
    """(key, timing) of the fastest file of ``side`` in runtime ``label`` (by median), or (None, None)."""
    got = {k: per[(label, side, k)] for k in sides[side]}
    return min(got.items(), key=lambda kv: kv[1].median) if got else (None, None)


def compare(full: nn.Module, pruned: nn.Module, standard: dict[str, Path], files_full: dict[str, Path] | None,
            files_pruned: dict[str, Path], inputs: dict[int, list[dict]], *, max_seconds: float = 20.0,
            min_rounds: int = 7, log: Callable | None = None, serve_batch: int | None = None) -> list[dict]:
    """Each runtime the pruned folder and the standard files both have: the standard files of the unpruned model
    (``standard``: :func:`multihead.deploy.peers.standard_files`), multihead's own export of it (``files_full``; None
    leaves those rows out) and the pruned files, every way of making each file (plain, ONNX Runtime's optimizer) timed
    in the same interleaved rounds (per batch size, every runtime together, each file's batches one after another as a
    server runs them; at least ``min_rounds`` unless ``max_seconds`` runs out first) on ``inputs`` ({batch size:
    batches}).
    Rows {runtime, batch, peer (the fastest standard file), peer_ms, standard {file: ms}, unpruned_ms,
    unpruned_file, unpruned_vs_peer (the peer's time over multihead's unpruned file's, round by round: below 1 is
    slower), pruned_ms and pruned_file (the file to serve: of the pruned files, the fastest at ``serve_batch``, or by
    the geometric mean over the batch sizes timed: :func:`multihead.deploy.serve.choose`), served_by (which of the
    two), fastest_file (the fastest pruned file at this batch size), forms {key: ms} (every pruned file), speedup
    (the file to serve over the peer: the median of the rounds' ratios, :func:`multihead.timing.paired`), range (its
    95% interval), bound, share} where
    ``bound`` is :func:`work`'s ratio on the same batches and ``share`` how much of the bound's gain the file to serve
    delivers ((speed-up - 1) / (bound - 1))."""
    engines: dict[str, dict[str, dict]] = {}  # runtime -> {"standard"/"unpruned"/"pruned": {key: model}}
    for label, keys, make in RUNTIMES:
        sides = {"standard": {k: make(standard[k]) for k in keys if k in standard},
                 "unpruned": {k: make(files_full[k]) for k in keys if files_full and k in files_full},
                 "pruned": {k: make(files_pruned[k]) for k in keys if k in files_pruned}}
        if sides["standard"] and sides["pruned"]:
            engines[label] = sides
    measured = {B: _timed(engines, full, pruned, batches, B, max_seconds=max_seconds, min_rounds=min_rounds, log=log)
                for B, batches in inputs.items()}
    from multihead.deploy import serve

    served = {label: serve.choose({k: {B: m[1][(label, "pruned", k)].to_json()["median_ms"]
                                       for B, m in measured.items()} for k in sides["pruned"]}, serve_batch)
              for label, sides in engines.items()}  # from the medians the rows hold: serve.from_rows agrees
    return [_row(label, B, sides, per, bound=bound, busy=busy, served=served[label])
            for B, (bound, per, busy) in measured.items() for label, sides in engines.items()]


def _timed(engines: dict, full: nn.Module, pruned: nn.Module, batches: list[dict], B: int, *, max_seconds: float,
           min_rounds: int, log) -> tuple[float, dict, dict]:
    """Every file of every runtime timed on ``batches`` in the same interleaved rounds: (the bound, {(runtime, side,
    key): Timing per batch}, {runtime: the busy-machine note})."""
    bound = sum(work(full, b) for b in batches) / sum(work(pruned, b) for b in batches)
    calls = {}
    for label, sides in engines.items():
        for side, models in sides.items():
            for k, m in models.items():
                calls[(label, side, k)] = lambda m=m, xs=batches: [m(b["input_ids"], b["attention_mask"]) for b in xs]
    names = {c: f"{c[0]}, {c[1]} {c[2]}" for c in calls}
    t = timing.interleaved({names[c]: f for c, f in calls.items()}, warmup=1, max_seconds=max_seconds,
                           min_rounds=min_rounds, max_rounds=max(60, min_rounds), late_rounds=3,
                           progress=f"runtimes, batch {B}" if log is not None else None)
    busy = {label: timing.busy_note({names[c]: t[names[c]] for c in calls if c[0] == label}) for label in engines}
    return bound, {c: t[names[c]].scaled(1 / len(batches)) for c in calls}, busy


def _row(label: str, B: int, sides: dict, per: dict, *, bound: float, busy: dict, served: dict) -> dict:
    """One row of :func:`compare`: runtime ``label`` at batch ``B``, the file to serve (``served``:
    :func:`multihead.deploy.serve.choose`'s) against the peer."""
    peer_key, peer = _fastest(per, label, "standard", sides)
    un_key, un = _fastest(per, label, "unpruned", sides)
    fast_key, _ = _fastest(per, label, "pruned", sides)
    pr_key = served["key"]
    pr = per[(label, "pruned", pr_key)]
    s, lo, hi = timing.paired(peer, pr)
    return {"runtime": label, "batch": B, "peer": peers.STANDARD[peer_key], "peer_ms": peer.to_json(),
            "standard": {peers.STANDARD[k]: per[(label, "standard", k)].to_json() for k in sides["standard"]},
            "unpruned_ms": un.to_json() if un is not None else None, "unpruned_file": un_key,
            "unpruned_vs_peer": round(timing.paired(peer, un)[0], 3) if un is not None else None,
            "pruned_ms": pr.to_json(), "pruned_file": pr_key, "served_by": served["chosen_by"],
            "fastest_file": fast_key, "forms": {k: per[(label, "pruned", k)].to_json() for k in sides["pruned"]},
            "speedup": round(s, 3), "range": [round(lo, 3), round(hi, 3)], "bound": round(bound, 3),
            "share": round((s - 1) / (bound - 1), 2) if bound > 1.001 else None, "busy": busy[label]}


def fidelity(full: nn.Module, files: dict[str, Path], kinds: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """{runtime: {kind: mean cosine}}: each file's mean-pooled, normalised output against the torch model ``full``'s
    on every batch of every kind of text (a pruned file against the unpruned model: what the cut and the runtime's
    rounding cost together). The torch model runs once per batch, whatever the number of files."""
    from multihead.deploy.serve import FORMS

    with torch.no_grad():
        want = {kind: [pooled(full, b["input_ids"], b["attention_mask"]) for b in batches]  # (B, E) each
                for kind, batches in kinds.items()}
    out = {}
    for label, keys, make in RUNTIMES:
        for key in keys:
            if key not in files:
                continue
            m = make(files[key])
            with torch.no_grad():
                out[f"{label}, {FORMS.get(key, key)} ({Path(files[key]).name})"] = {
                    kind: float(torch.cat([(pooled(m, b["input_ids"], b["attention_mask"]) * w).sum(-1)
                                           for b, w in zip(batches, want[kind])]).mean())
                    for kind, batches in kinds.items()}
    return out


def markdown(rows: list[dict], fid: dict[str, dict[str, float]] | None = None) -> str:
    """The table: per runtime and batch size, the peer (the fastest standard file of the unpruned model), multihead's
    own file of the unpruned model (and its ratio to the peer), the pruned file, ms per batch (median, min-max), the
    speed-up over the peer (the median of the rounds' ratios, its 95% interval) "of a bound"; then every standard
    file's time (the plain export, after ONNX Runtime's optimizer, ...: the peer is the fastest of them) where a
    runtime has more than one; and the fidelity per kind of text when given."""
    def ms(t):
        return f"{t['median_ms']:.2f} ({t['min_ms']:.2f}-{t['max_ms']:.2f})"

    lines = ["| runtime | batch | peer: the standard export, ms | multihead's unpruned file, ms | the pruned file to serve, ms | "
             "speed-up over the peer, per round (95% interval) | bound (work removed) | of the bound's gain |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = f"{r['share']:.0%}" if r["share"] is not None else "-"
        un = (f"{ms(r['unpruned_ms'])}, {r['unpruned_vs_peer']:.2f}x" if r.get("unpruned_ms") else "-")
        lines.append(f"| {r['runtime']} | {r['batch']} | {r['peer']}: {ms(r['peer_ms'])} | {un} | "
                     f"{ms(r['pruned_ms'])} ({r['pruned_file']}) | {r['speedup']:.2f}x ({r['range'][0]:.2f}-"
                     f"{r['range'][1]:.2f}) | {r['bound']:.2f}x | {share} |")
    if any(len(r.get("forms") or {}) > 1 for r in rows):  # every pruned form: the file to serve is the fastest
        lines += ["", "| runtime | batch | each pruned file, ms (the fastest first; the file to serve is "
                  f"{rows[0].get('served_by', 'the fastest')}) |", "|---|---:|---|"]
        lines += [f"| {r['runtime']} | {r['batch']} | " + "; ".join(
            f"{k}: {ms(t)}" for k, t in sorted(r["forms"].items(), key=lambda kt: kt[1]["median_ms"])) + " |"
            for r in rows if r.get("forms")]
    if any(len(r.get("standard") or {}) > 1 for r in rows):  # every way of making the standard file, not only the peer
        lines += ["", "| runtime | batch | each standard file of the unpruned model, ms (the fastest is the peer) |",
                  "|---|---:|---|"]
        lines += [f"| {r['runtime']} | {r['batch']} | " + "; ".join(f"{k}: {ms(t)}" for k, t in (r.get("standard") or {}).items())
                  + " |" for r in rows]
    if fid:
        kinds = list(next(iter(fid.values())))
        lines += ["", "| pruned file | " + " | ".join(f"mean cosine, {k}" for k in kinds) + " |",
                  "|---|" + "---:|" * len(kinds)]
        lines += [f"| {label} | " + " | ".join(f"{v[k]:.4f}" for k in kinds) + " |" for label, v in fid.items()]
    return "\n".join(lines) + "\n"


def worst_share(rows: list[dict]) -> float:
    """The smallest share of the bound's gain over the rows (NaN when none has a bound above 1)."""
    shares = [r["share"] for r in rows if r["share"] is not None]
    return min(shares) if shares else math.nan


def recommend(rows: list[dict], *, min_cosine: float) -> str | None:
    """From one batch size's rows of peers timed in the same rounds ({peer, cosine, ms_per_batch: {median_ms}}), the
    line naming the fastest at fidelity ``min_cosine`` or more, and by how much it leads the next (None when no row
    reaches it): the runtime to deploy at that batch size, read from the measurements."""
    ok = sorted((r for r in rows if r["cosine"] >= min_cosine), key=lambda r: r["ms_per_batch"]["median_ms"])
    if not ok:
        return None
    best = ok[0]
    lead = (f", {ok[1]['ms_per_batch']['median_ms'] / best['ms_per_batch']['median_ms']:.2f}x ahead of {ok[1]['peer']}"
            if len(ok) > 1 else "")
    return (f"fastest at mean cosine >= {min_cosine}: {best['peer']} ({best['ms_per_batch']['median_ms']:.1f} ms, "
            f"cosine {best['cosine']:.4f}{lead})")
