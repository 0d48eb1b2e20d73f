"""What follows a ``prune`` run's search, costed before the search from work measured on the unpruned model.

After the search a run saves the kept model, writes its runtime files (``prune --hf`` on an encoder: the ONNX forms,
OpenVINO's two, each checked), times them against the unpruned model's standard files (the runtime table), scores them
on every kind of held-out text and times every model of the curve (the speed table). On all-MiniLM-L6-v2 with
``--time-budget 20m`` that took 15 of the command's 32 minutes (issue 80), when it was counted as 25 s a model. Now
:func:`groundwork` makes, before any pruning, what the runtime table needs whatever the cut -- the standard files
and multihead's export of the unpruned model through the kept model's recipe -- and times each; then runs each of
those files and the speed table's models once on the text the phases after the search run them on. :func:`after`
turns these measurements into the least seconds each phase after the search takes (the timing tables at their fewest
rounds: a warm-up and three), which the search leaves them (:class:`multihead.apps.prune.target.Budget`'s
``after_s``). The unpruned model's files are the measure of the pruned model's: the same forms, more heads.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from multihead import timing
from multihead.apps.prune.target import RESERVE_S

#: a timing table's fewest rounds under a deadline: the warm-up and three (the tables' ``late_rounds``)
LEAST_ROUNDS = 1 + 3

#: the phases before the search that :func:`groundwork` times (the run's report names them so)
STANDARD, OWN, PROBE = ("the standard files of the unpruned model", "multihead's export of the unpruned model",
                        "one call of each file and model")
#: the phases after the search that :func:`after` costs (the run's report names them so)
SAVING, KEPT_FILES, TABLE, FORMS_ALONE, FIDELITY, SPEED, REPORT = (
    "saving", "the kept model's runtime files", "the runtime table", "its forms timed alone", "the files' fidelity",
    "the speed table", "the report")


@dataclass(frozen=True)
class Groundwork:
    """What a run makes and measures before any pruning so that the phases after the search are costed, not guessed.

    ``standard``: the unpruned model's standard files (the runtime table's peers: :func:`multihead.deploy.peers.
    standard_files`), None without a runtime table; ``own``: multihead's export of the unpruned model through the kept
    model's recipe (the table's "unpruned" column; the measure of the kept model's export), None without runtime files;
    ``made``: the seconds each part took (spent before the search); ``after``: the least seconds each phase after the
    search takes (:func:`after`; empty when nothing was measured); ``note``: why no runtime files (a missing extra)."""

    standard: dict[str, Path] | None
    own: dict[str, Path] | None
    made: dict[str, float]
    after: dict[str, float]
    note: str | None = None

    @property
    def after_s(self) -> float:
        """The phases after the search, in seconds, at least."""
        return sum(self.after.values())

    def __str__(self) -> str:
        return ", ".join(f"{k} {_seconds(v)}" for k, v in self.made.items()) or "nothing"


def groundwork(setup, o, *, measure: bool = True) -> Groundwork:
    """Before any pruning: the standard files of the unpruned model where the runtime peers are timed
    (``o.runtime_peers``: the runtime table's peers, the speed table's), and with runtime files asked
    (``setup.export_fn``, ``o.runtime_files``) multihead's export of the unpruned model (``setup.export_fn`` on
    ``setup.model``, the kept model's recipe), each made and timed; with ``measure``, the phases after the search costed
    from one call of each file and of the speed table's models (:func:`after`). A missing extra (the onnx one) leaves
    no runtime files, said in ``note``."""
    made: dict[str, float] = {}

    def timed(name: str, fn: Callable):
        started = time.monotonic()
        try:
            return fn()
        finally:
            made[name] = time.monotonic() - started

    standard = own = note = None
    files = setup.export_fn is not None and o.runtime_files
    try:
        if o.runtime_peers and setup.standard_fn is not None and (files or setup.more_peers is not None):
            standard = timed(STANDARD, lambda: setup.standard_fn(openvino=o.openvino is not False)) or None
        if files:
            from multihead.deploy.session import scratch

            own = timed(OWN, lambda: setup.export_fn(setup.model, scratch(), o.openvino))
    except ImportError as e:  # the onnx extra
        standard, own, note = None, None, f"no runtime files written: {e}"
    costs = timed(PROBE, lambda: after(setup, o, standard, own, made.get(OWN, 0.0))) if measure else {}
    return Groundwork(standard, own, made, costs, note)


def _table(setup, o) -> bool:
    """Whether the run makes a runtime table (the kept model's files against the standard files); else the kept
    model's forms are timed alone."""
    return bool(o.runtime_peers and setup.runtime_texts is not None)


def after(setup, o, standard: dict[str, Path] | None, own: dict[str, Path] | None, export_s: float
          ) -> dict[str, float]:
    """{phase: least seconds} of the phases after the search, from one call of each of the unpruned model's files
    (``standard``, ``own``: the pruned files are ``own``'s forms at fewer heads) and of the speed table's models:

    - saving: the unpruned model saved as the kept one will be (timed here);
    - the kept model's runtime files: ``export_s``, the same recipe's time on the unpruned model;
    - the runtime table: every file (the standard ones, ``own``'s, the pruned ones) opened and run a warm-up and
      three rounds on the table's text, and the bound's operations counted on the unpruned and the pruned model
      (:func:`multihead.deploy.compare.compare`) -- without a table, the pruned forms timed alone instead;
    - the files' fidelity: each pruned file and the torch model once over every kind of held-out text;
    - the speed table: a warm-up and three rounds of the curve's models (each no slower than the unpruned one), the
      kept one and its served form, the transformers peer and the runtime peers (the standard int8 and OpenVINO
      files, each scored once too: :mod:`multihead.apps.prune.pruning`'s ``_timings``);
    - the report: :data:`multihead.apps.prune.target.RESERVE_S`."""
    out = {SAVING: _saving(setup, o)}
    inputs, kinds, probe = {}, {}, {}
    if own or standard:  # the pruned files are own's forms; without them, the peers are probed
        inputs, kinds = setup.runtime_texts if setup.runtime_texts is not None else (_synthetic(setup.model), {})
        probe = _probe(own or standard, inputs, kinds)
    if own:
        out[KEPT_FILES] = export_s
        if not _table(setup, o):  # serve.measure: a warm-up and three rounds, or a second a batch size
            out[FORMS_ALONE] = sum(_count(own, label) * _pass(probe[label], LEAST_ROUNDS) for label in probe) + len(inputs)
        elif standard:
            counts = {label: (_count(standard, label), _count(own, label)) for label in probe}  # rows both have
            out[TABLE] = (sum((n_std + 2 * n_own) * _pass(probe[label], LEAST_ROUNDS)
                              for label, (n_std, n_own) in counts.items() if n_std) + 2 * _work(setup.model, inputs))
            out[FIDELITY] = (sum(n_own * (probe[label]["open"] + _over(probe[label]["kinds"], kinds))
                                 for label, (_, n_own) in counts.items()) + _torch_kinds(setup.model, kinds))
    peers = 0.0
    if standard and probe and setup.more_peers is not None:  # the speed table's runtime peers: int8 and OpenVINO's
        peers = sum(_count(standard, label) * _peer(probe.get(label) or _slowest(probe), kinds, setup)
                    for label in _labels(standard) if label != "ONNX Runtime fp32")
    out[SPEED] = _speed(setup, o) + peers
    out[REPORT] = RESERVE_S
    return out


def _peer(p: dict, kinds: dict[str, list[dict]], setup) -> float:
    """A runtime peer of the speed table (a file of the probed runtime ``p``): opened, scored once over every kind of
    held-out text, timed a warm-up and three rounds over the speed table's rows."""
    return p["open"] + _over(p["kinds"], kinds) + LEAST_ROUNDS * _speed_items(setup) * _per_item(p)


def _labels(files: dict[str, Path]) -> list[str]:
    """The runtimes (:data:`multihead.deploy.compare.RUNTIMES`' labels) some of ``files`` run in."""
    from multihead.deploy.compare import RUNTIMES

    return [label for label, keys, _ in RUNTIMES if any(k in files for k in keys)]


def _slowest(probe: dict[str, dict]) -> dict:
    """The probed runtime whose files took longest (the measure of a runtime none of the probed files runs in)."""
    return max(probe.values(), key=lambda p: _pass(p, 1))


def _saving(setup, o) -> float:
    """Seconds ``setup.save_fn`` takes on the unpruned model (quantized as asked), in a folder removed after."""
    with tempfile.TemporaryDirectory(prefix="multihead-plan-") as d:
        started = time.monotonic()
        setup.save_fn(setup.model, Path(d) / "model", **({"quantize": o.quantize} if o.quantize else {}))
        return time.monotonic() - started


def _probe(files: dict[str, Path], inputs: dict[int, list[dict]], kinds: dict[str, list[dict]]) -> dict[str, dict]:
    """Each runtime's files among ``files`` opened and run once on every batch of ``inputs`` ({batch size: batches})
    and on the first batch of every kind of ``kinds``: {runtime: {"open": s, "call": {B: s over its batches},
    "kinds": {kind: s a batch}, "items": {kind: rows of that batch}}}, each the mean over the runtime's files."""
    from multihead.deploy.compare import RUNTIMES

    out = {}
    for label, keys, make in RUNTIMES:
        got = [k for k in keys if k in files]
        if not got:
            continue
        opened, calls, per_kind = [], {B: [] for B in inputs}, {kind: [] for kind in kinds}
        for key in got:
            started = time.monotonic()
            m = make(files[key])
            opened.append(time.monotonic() - started)
            for B, xs in inputs.items():
                calls[B].append(_clock(lambda m=m, xs=xs: [m(b["input_ids"], b["attention_mask"]) for b in xs]))
            for kind, batches in kinds.items():
                b = batches[0]
                per_kind[kind].append(_clock(lambda m=m, b=b: m(b["input_ids"], b["attention_mask"])))
            del m
        out[label] = {"open": statistics.mean(opened), "call": {B: statistics.mean(v) for B, v in calls.items()},
                      "kinds": {k: statistics.mean(v) for k, v in per_kind.items()},
                      "items": {k: int(b[0]["input_ids"].shape[0]) for k, b in kinds.items()}}
    return out


def _clock(fn: Callable) -> float:
    started = time.monotonic()
    with torch.no_grad():
        fn()
    return time.monotonic() - started


def _count(files: dict[str, Path], label: str) -> int:
    """How many of ``files`` run in the runtime ``label`` (:data:`multihead.deploy.compare.RUNTIMES`)."""
    from multihead.deploy.compare import RUNTIMES

    return sum(k in files for name, keys, _ in RUNTIMES if name == label for k in keys)


def _pass(p: dict, rounds: int) -> float:
    """One file of a probed runtime ``p`` opened and timed ``rounds`` rounds over every batch size."""
    return p["open"] + rounds * sum(p["call"].values())


def _over(per_batch: dict[str, float], kinds: dict[str, list[dict]]) -> float:
    """Seconds over every batch of every kind, from a kind's first batch's seconds."""
    return sum(per_batch[kind] * len(batches) for kind, batches in kinds.items())


def _per_item(p: dict) -> float:
    """Seconds a row of the probed runtime ``p`` takes, on its first kind of text (the held-out sentences)."""
    kind = next(iter(p["kinds"]), None)
    return p["kinds"][kind] / max(1, p["items"][kind]) if kind is not None else 0.0


def _speed_items(setup) -> int:
    """Rows in one round of the speed table, every batch size."""
    return sum(_rows(x) for xs in setup.speed_inputs.values() for x in xs)


def _rows(x) -> int:
    first = x[0] if isinstance(x, (tuple, list)) else x
    return int(first.shape[0]) if isinstance(first, torch.Tensor) else 1


def _work(model, inputs: dict[int, list[dict]]) -> float:
    """Seconds the runtime table's bound takes to count the unpruned model's operations on its text (the pruned
    model's count costs no more)."""
    from multihead.deploy.compare import work

    return _clock(lambda: [work(model, b) for xs in inputs.values() for b in xs])


def _torch_kinds(model, kinds: dict[str, list[dict]]) -> float:
    """Seconds the torch model takes over every kind of held-out text, from each kind's first batch."""
    from multihead.deploy.compare import pooled

    return _over({k: _clock(lambda b=b[0]: pooled(model, b["input_ids"], b["attention_mask"]))
                  for k, b in kinds.items()}, kinds)


def _speed(setup, o) -> float:
    """The speed table's torch models at their fewest rounds: the curve's steps, the kept model and its served form
    (each timed as the unpruned model, which is the slowest of them), and the transformers peer."""
    def run(model, fn) -> float:
        return _clock(lambda: [fn(model, x) for xs in setup.speed_inputs.values() for x in xs])

    steps = int(round(o.fraction / o.step)) + 1 + 2  # the curve, the kept model as quantized or cut, served
    peer = run(setup.peer[1], setup.peer[2]) if setup.peer is not None else 0.0
    return LEAST_ROUNDS * (steps * run(setup.model, setup.run_fn) + peer)


def _synthetic(model) -> dict[int, list[dict]]:
    from multihead.deploy.serve import synthetic_batches

    return synthetic_batches(model)


def _seconds(s: float) -> str:
    from multihead.apps.prune.target import seconds_text

    return seconds_text(s)


#: the report's note when the runtime files were not asked for (``Options.runtime_files``)
NO_RUNTIME_FILES = ("no runtime files written, as asked (--no-runtime-files): `model/` holds the model's own directory "
                    "only, and there is no runtime table")


def deployed(setup, kept, unpruned, folder: Path, *, o, gw: Groundwork, budget, phase: Callable[[str], None]
             ) -> dict | None:
    """The kept float model written where users run it (``setup.export_fn``: ``folder``/onnx, ``folder``/openvino)
    and, with the runtime peers on, its files timed in each runtime against the unpruned model's standard files
    (``gw.standard``: exported as users export it; the faster way of making each is the peer) with multihead's own
    export of the unpruned model as a row (``gw.own``; :func:`multihead.deploy.compare.compare`, each speed-up beside
    its bound) -- for at most half the time the budget leaves beyond the phases after it, at their least -- and scored
    per kind of text: {"files", "rows", "fidelity", "optimizer"} or {"note"} (a missing extra), None when the setup
    exports nothing. "optimizer" says what ONNX Runtime's optimizer fused in the pruned file, and what it could not.
    ``phase(name)`` ends each phase (:data:`KEPT_FILES`, :data:`TABLE` or :data:`FORMS_ALONE`, :data:`FIDELITY`)."""
    if setup.export_fn is None:
        return None
    if not o.runtime_files:
        return {"note": NO_RUNTIME_FILES}
    if gw.note is not None:
        return {"note": gw.note}
    from multihead.deploy import compare, serve

    try:
        files = setup.export_fn(kept, folder, o.openvino)
    except ImportError as e:  # the onnx extra
        return {"note": f"no runtime files written: {e}"}
    phase(KEPT_FILES)
    out = {"files": {k: str(Path(v).relative_to(folder)) for k, v in files.items()}, "cpu_flags": timing.cpu_flags()}
    if not _table(setup, o):  # no table: the forms timed alone, briefly
        inputs = setup.runtime_texts[0] if setup.runtime_texts is not None else serve.synthetic_batches(kept)
        out["serve"] = serve.write(folder, files, serve.measure(files, inputs), o.serve_batch,
                                   measured_on="the held-out text, the forms alone (no runtime table)")
        phase(FORMS_ALONE)
        return _with_served(out, folder)
    from multihead.deploy.onnx import EXPORT_JSON, ONNX_DIR

    exported = folder / ONNX_DIR / EXPORT_JSON
    if exported.is_file():
        out["optimizer"] = json.loads(exported.read_text()).get("optimizer")
    inputs, kinds = setup.runtime_texts
    if not gw.standard:
        out["note"] = "no standard export of the unpruned model to time against (setup.standard_fn)"
        return out
    later = sum(gw.after.get(k, 0.0) for k in (FIDELITY, SPEED, REPORT))  # what must follow the table
    out["rows"] = compare.compare(unpruned, kept, gw.standard, gw.own, files, inputs,
                                 max_seconds=min(o.max_seconds, budget.spare(later) / 2 / len(inputs)),
                                 log=print if o.progress else None, serve_batch=o.serve_batch)
    out["serve"] = serve.write(folder, files, serve.from_rows(out["rows"]), o.serve_batch,
                               measured_on="the runtime table's held-out text")
    phase(TABLE)
    out["fidelity"] = compare.fidelity(unpruned, files, kinds)
    phase(FIDELITY)
    return _with_served(out, folder)


def _with_served(out: dict, folder: Path) -> dict:
    """``out`` (:func:`deployed`'s) with the files to serve listed among its files."""
    from multihead.deploy import serve

    out["files"] |= {k: str(p.relative_to(folder)) for k, p in serve.served(folder, out["serve"]).items()}
    return out


def runtime_section(d: dict | None) -> list[str]:
    """report.md's lines on the runtime files (``report["runtimes"]``): where they are, the table of each runtime's
    pruned file against its unpruned one beside the bound, the pruned files' fidelity per kind of text."""
    if not d:
        return []
    if "note" in d:
        return [f"Note: {d['note']}", ""]
    from multihead.deploy import compare

    lines = ["## Where prediction happens", "", "The kept model written for other runtimes, in `model/`: " +
             ", ".join(f"`{p}`" for p in d["files"].values()) + " (inputs `input_ids`, `attention_mask`"
             " and the token types where the model has them; output `last_hidden_state`).", ""]
    if (d.get("optimizer") or {}).get("note"):
        lines += [f"Note: {d['optimizer']['note']} (the table is measured all the same).", ""]
    from multihead.deploy import serve

    lines += serve.lines(d.get("serve"))
    if d.get("rows"):
        lines += ["Each runtime's pruned file to serve against the peer: the unpruned transformers model made into that "
                  "runtime's file as its documentation does it (`torch.onnx.export` of the SDPA and of the eager model, "
                  "ONNX Runtime's `quantize_dynamic` per channel, its transformer optimizer; OpenVINO's `convert_model`, "
                  "NNCF), the fastest way being the peer; multihead's own export of the unpruned model is a column, "
                  "never the baseline. Timed in the same interleaved rounds on the held-out text of every kind (ms per "
                  "batch, median and min-max) on a CPU with "
                  f"{' '.join(d.get('cpu_flags') or []) or 'unknown flags'}; the bound is the ratio of the "
                  "floating-point work of the padded call (what these runtimes compute), the most a cut of that work "
                  "could give.", "", compare.markdown(d["rows"], d.get("fidelity"))]
    return lines
