"""The file to serve, chosen where it runs: of the forms :func:`multihead.deploy.folder.export` writes for a runtime
(the SDPA graph, the eager graph, ONNX Runtime's fused attention with and without its GELU fusion; each fp32 and
int8), the one that runs fastest on
this machine, written under one fixed name per runtime (:data:`SERVE`: ``onnx/serve_int8.onnx`` for ONNX Runtime
int8, ...) beside the others, which are kept. Fastest at the batch size the user serves (``serve_batch``), or by
default the best geometric mean over batch 1, 16 and 64 (:data:`SERVE_BATCHES`); where the fastest form differs by
batch size the record says which to use for which. The times come from the runtime table ``prune --hf`` prints
(:func:`from_rows`) or, for a folder written alone, from a short timing of the forms here (:func:`measure`). The
record (``export.json``'s "serve") names the CPU's flags the choice was made on: another CPU may choose another."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from multihead import timing
from multihead.deploy.onnx import EXPORT_JSON, ONNX_DIR, ONNX_SERVE_FILE, ONNX_SERVE_INT8_FILE
from multihead.deploy.openvino import OPENVINO_DIR, OPENVINO_SERVE_FILE, OPENVINO_SERVE_INT8_FILE

#: per runtime (the runtime table's labels): the file to serve, relative to the folder, and the forms (keys of
#: :func:`multihead.deploy.folder.export`'s result) it is chosen among
SERVE = {"ONNX Runtime fp32": (f"{ONNX_DIR}/{ONNX_SERVE_FILE}", ("onnx", "onnx_eager", "onnx_optimized",
                                                                 "onnx_attention")),
         "ONNX Runtime int8": (f"{ONNX_DIR}/{ONNX_SERVE_INT8_FILE}",
                               ("onnx_int8", "onnx_eager_int8", "onnx_optimized_int8", "onnx_attention_int8")),
         "OpenVINO fp32": (f"{OPENVINO_DIR}/{OPENVINO_SERVE_FILE}", ("openvino",)),
         "OpenVINO int8": (f"{OPENVINO_DIR}/{OPENVINO_SERVE_INT8_FILE}", ("openvino_int8",))}
#: each runtime's serving file's key in :func:`multihead.deploy.folder.export`'s result
SERVE_KEYS = {"ONNX Runtime fp32": "serve", "ONNX Runtime int8": "serve_int8", "OpenVINO fp32": "openvino_serve",
              "OpenVINO int8": "openvino_serve_int8"}
#: the batch sizes whose geometric mean chooses the file to serve when no batch size is named
SERVE_BATCHES = (1, 16, 64)
#: each form, as the report labels it
FORMS = {"onnx": "SDPA graph", "onnx_int8": "SDPA graph, int8", "onnx_eager": "eager graph",
         "onnx_eager_int8": "eager graph, int8", "onnx_optimized": "fused attention (ORT optimizer)",
         "onnx_optimized_int8": "fused attention (ORT optimizer), int8",
         "onnx_attention": "fused attention, GELU unfused (ORT optimizer)",
         "onnx_attention_int8": "fused attention, GELU unfused (ORT optimizer), int8", "openvino": "OpenVINO IR",
         "openvino_int8": "OpenVINO IR, NNCF int8"}


def check_serve_batch(serve_batch: object) -> int | None:
    """``serve_batch`` as given when it is None or a positive whole number; else ValueError naming it and the fix."""
    if serve_batch is None:
        return None
    if isinstance(serve_batch, bool) or not isinstance(serve_batch, int) or serve_batch < 1:
        raise ValueError(f"serve_batch must be a positive whole number (the batch size served, e.g. 16) or None (the "
                         f"best geometric mean over batch {', '.join(map(str, SERVE_BATCHES))}); got {serve_batch!r}")
    return serve_batch


def choose(times: dict[str, dict[int, float]], serve_batch: int | None = None) -> dict:
    """Of one runtime's forms timed at each batch size (``times``: {key: {batch: ms}}, every form at the same sizes),
    the one to serve: {"key", "chosen_by" (what decided), "fastest": {batch: key}, "ms": times}. ``serve_batch``: the
    fastest at that batch size (the nearest timed one at or above it, else the largest); None: the best geometric
    mean over the sizes timed."""
    sizes = sorted(set.intersection(*(set(t) for t in times.values())))
    if not sizes:
        raise ValueError(f"choose: the forms {sorted(times)} were not timed at a common batch size")
    fastest = {B: min(times, key=lambda k: times[k][B]) for B in sizes}
    if serve_batch is not None:
        B = min((b for b in sizes if b >= serve_batch), default=sizes[-1])
        key, why = fastest[B], f"the fastest at batch {B}" + (f" (the nearest timed to {serve_batch})"
                                                                  if B != serve_batch else "")
    else:
        key = min(times, key=lambda k: sum(math.log(times[k][B]) for B in sizes))
        why = f"the best geometric mean over batch {', '.join(map(str, sizes))}"
    return {"key": key, "chosen_by": why, "fastest": fastest, "ms": times}


def from_rows(rows: list[dict]) -> dict[str, dict[str, dict[int, float]]]:
    """{runtime: {key: {batch: median ms}}} of the pruned forms from the runtime table's rows
    (:func:`multihead.deploy.compare.compare`'s "forms")."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for r in rows:
        for key, t in (r.get("forms") or {}).items():
            out.setdefault(r["runtime"], {}).setdefault(key, {})[int(r["batch"])] = float(t["median_ms"])
    return out


def measure(files: dict[str, Path], batches: dict[int, list[dict]], *, max_seconds: float = 1.0,
            min_rounds: int = 5) -> dict[str, dict[str, dict[int, float]]]:
    """Each runtime's forms among ``files`` ({key: path}: :func:`multihead.deploy.folder.export`'s result) timed here,
    interleaved per batch size (each form's batches one after another, at least ``min_rounds`` rounds unless
    ``max_seconds`` runs out first) on ``batches`` ({batch size: batches} of {"input_ids", "attention_mask"[,
    "token_type_ids"]} (B, L)): {runtime: {key: {batch: median ms per batch}}}, runtimes with at least one form."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    opened = {(label, k): opener(label)(Path(files[k])) for label, (_, keys) in SERVE.items() for k in keys
              if k in files}
    for B, xs in batches.items():
        calls = {f"{label}, {k}": (lambda m=m, xs=xs: [m(*_args(b)) for b in xs]) for (label, k), m in opened.items()}
        t = timing.interleaved(calls, warmup=1, min_rounds=min_rounds, max_rounds=max(30, min_rounds),
                               max_seconds=max_seconds, late_rounds=3)
        for (label, k) in opened:
            out.setdefault(label, {}).setdefault(k, {})[B] = t[f"{label}, {k}"].median / len(xs)
    return out


def _args(b: dict) -> tuple:
    """A batch's tensors in the order the runtime models take them: (input_ids, attention_mask[, token_type_ids])."""
    return tuple(b[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in b)


def synthetic_batches(model, sizes: tuple[int, ...] = SERVE_BATCHES, length: int = 32) -> dict[int, list[dict]]:
    """{B: [one batch]}: ``length`` tokens (capped by the config's ``max_position_embeddings``) of random ids for each
    batch size, no padding: what the runtimes time is the shape (they compute padding as tokens), not the text."""
    from multihead.deploy.trace import input_names

    g = torch.Generator().manual_seed(0)
    L = min(length, int(getattr(model.config, "max_position_embeddings", length) or length))
    vocab = int(model.config.vocab_size)
    names = input_names(model)
    out = {}
    for B in sizes:
        b = {"input_ids": torch.randint(0, vocab, (B, L), generator=g),  # (B, L)
             "attention_mask": torch.ones(B, L, dtype=torch.long)}  # (B, L)
        if "token_type_ids" in names:
            b["token_type_ids"] = torch.zeros(B, L, dtype=torch.long)  # (B, L)
        out[B] = [b]
    return out


def write(folder: str | Path, files: dict[str, Path], times: dict[str, dict[str, dict[int, float]]],
          serve_batch: int | None = None, *, measured_on: str) -> dict:
    """For each runtime of ``times`` ({runtime: {key: {batch: ms}}}), its fastest form (:func:`choose`) written under
    the runtime's serving name (:data:`SERVE`, in ``folder``: a hard link where the file system allows it, else a
    copy; OpenVINO's weights file too), the others kept; the record {"cpu_flags", "serve_batch", "measured_on",
    runtime: {"file", "form", "key", "chosen_by", "fastest", "ms"}} added to ``folder``/onnx/export.json under "serve"
    and returned. ``measured_on``: what the times were measured on (the report's words). :func:`served` lists the
    files written."""
    check_serve_batch(serve_batch)
    folder = Path(folder)
    record: dict = {"cpu_flags": timing.cpu_flags(), "serve_batch": serve_batch, "measured_on": measured_on}
    for label, forms in times.items():
        if label not in SERVE or not forms:
            continue
        name, _ = SERVE[label]
        got = choose(forms, serve_batch)
        _link(Path(files[got["key"]]), folder / name)
        where = {k: Path(os.path.relpath(files[k], folder)).as_posix() for k in forms}  # onnx/model_int8.onnx, ...
        record[label] = {"file": name, "form": where[got["key"]], **got, "files": where,
                         "fastest": {str(B): k for B, k in got["fastest"].items()},
                         "ms": {k: {str(B): round(v, 3) for B, v in t.items()} for k, t in got["ms"].items()}}
    made = folder / ONNX_DIR / EXPORT_JSON
    if made.is_file():
        made.write_text(json.dumps(json.loads(made.read_text()) | {"serve": record}, indent=2))
    return record


def served(folder: str | Path, record: dict) -> dict[str, Path]:
    """{key (:data:`SERVE_KEYS`): path} of the serving files ``record`` (:func:`write`'s) names in ``folder``."""
    return {SERVE_KEYS[label]: Path(folder) / r["file"] for label, r in record.items()
            if label in SERVE_KEYS and isinstance(r, dict)}


def remove(folder: str | Path) -> None:
    """The serving files of ``folder`` removed (before its forms are written again: a hard link would share their
    new bytes before the choice is made)."""
    for name, _ in SERVE.values():
        f = Path(folder) / name
        for g in (f, f.with_suffix(".bin")) if f.suffix == ".xml" else (f,):
            g.unlink(missing_ok=True)


def _link(source: Path, dest: Path) -> None:
    """``dest`` the same file as ``source`` (a hard link, else a copy); an OpenVINO IR's ``.bin`` beside it too."""
    pairs = [(source, dest)] + ([(source.with_suffix(".bin"), dest.with_suffix(".bin"))] if source.suffix == ".xml"
                                else [])
    for s, d in pairs:
        d.unlink(missing_ok=True)
        try:
            os.link(s, d)
        except OSError:
            shutil.copyfile(s, d)


def lines(record: dict | None) -> list[str]:
    """The report's lines on the files to serve: per runtime, the file, which form it is and why; where the fastest
    form differs by batch size, which to use for which; the CPU's flags the choice was made on."""
    if not record:
        return []
    out = [f"Files to serve, chosen on this CPU (flags: {' '.join(record.get('cpu_flags') or []) or 'unknown'}; timed "
           f"on {record.get('measured_on', '?')}):", ""]
    for label, r in record.items():
        if not isinstance(r, dict) or "file" not in r:
            continue
        others = ", ".join(f"`{r['files'][k]}` ({FORMS.get(k, k)})" for k in r["ms"] if k != r["key"])
        out.append(f"- {label}: `{r['file']}` = `{r['form']}` ({FORMS.get(r['key'], r['key'])}), {r['chosen_by']}"
                   + (f"; kept beside it: {others}" if others else ""))
        if len(set(r["fastest"].values())) > 1:
            out.append("  - the fastest differs by batch size: " + "; ".join(
                f"batch {B}: `{r['file'] if k == r['key'] else r['files'][k]}`" for B, k in r["fastest"].items()))
    return out + [""]


def opener(label: str) -> Callable:
    """How the runtime ``label``'s files are opened (:func:`multihead.deploy.session.ort_session` or
    :func:`multihead.deploy.session.openvino_model`)."""
    from multihead.deploy import session

    return session.ort_session if label.startswith("ONNX") else session.openvino_model
