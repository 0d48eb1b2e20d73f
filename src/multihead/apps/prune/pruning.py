"""The course's second exercise, end to end, on two models: measure every head's
importance, prune the least important step by step, and measure what it costs
(the metric) and what it buys (speed at batch 1, 16 and 64).

- ``toy``: the digit-reversing Transformer of the demo; metric = share of target
  digits right under greedy decoding; importance = Michel et al.'s gradient of
  the task loss.
- ``minilm``: the pretrained all-MiniLM-L6-v2; metric = fidelity (mean cosine of
  the sentence embeddings to the unpruned model's) on Python's own documentation
  sentences; importance = ablation of 1 - cosine, a pruned head replaced by its
  mean output (the gradient of a self-fidelity loss is zero at the unpruned model).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from multihead import heads, timing
from multihead.apps.prune import runtimes
from multihead.apps.prune.runtimes import Groundwork
from multihead.apps.prune.target import (
    RESERVE_S,
    TABLE_MIN_S,
    Budget,
    Goal,
    choose,
    search_length,
    search_line,
    seconds_text,
    wrong_target,
)


@dataclass
class Setup:
    name: str
    model: nn.Module
    batches: list  # for importance
    loss_fn: Callable
    metric_fn: Callable[[nn.Module], float]
    metric_name: str
    speed_inputs: dict[int, list]  # batch size -> list of inputs for run_fn
    run_fn: Callable  # run_fn(model, inputs) -> output
    method: str
    mean_replacement: bool
    save_fn: Callable[[nn.Module, Path], str | None]  # -> None, or a line on what the saved directory cannot do
    peer: tuple[str, nn.Module, Callable] | None = None  # (name, model, run_fn) timed beside ours
    notes: list[str] = field(default_factory=list)
    pruned: nn.Module | None = None  # after run(): the pruned model, as saved
    recover_fn: Callable | None = None  # recover_fn(model, steps, quantize=) -> losses: distil a pruned model to the unpruned
    quantize_fn: Callable | None = None  # quantize_fn(model, dtype) -> a quantized copy (save_fn takes quantize=)
    #: more_peers(openvino=True) -> [(name, model, run_fn)] timed beside the peer (e.g. ONNX Runtime int8; ``openvino``:
    #: False leaves OpenVINO's out)
    more_peers: Callable | None = None
    scores_fn: Callable | None = None  # scores_fn(model) -> (n,) per held-out item, metric = their mean (a cosine)
    held_out_kinds: tuple[tuple, ...] | None = None  # the held-out items' consecutive kinds (name, count[, unit])
    #: export_fn(model, folder, openvino) -> {key: path}: the kept model's runtime files (multihead.hf.export) in its
    #: folder, no file to serve yet (``openvino``: None where installed, True required, False left out)
    export_fn: Callable | None = None
    #: ({batch size: batches}, {kind of text: batches}): what the runtime files are timed and scored on
    runtime_texts: tuple[dict, dict] | None = None
    #: ffn_fn(model, fraction) -> {down: kept}: cut that share of every feed-forward block's neurons, verified
    ffn_fn: Callable | None = None
    #: serve_fn(model) -> the kept model rebuilt lean for prediction (multihead.hf.serve), timed beside it
    serve_fn: Callable | None = None
    #: standard_fn(openvino=True) -> {key: path}: the unpruned model made into each runtime's files as users make them
    #: (:func:`multihead.deploy.peers.standard_files`; ``openvino``: False leaves OpenVINO's out): the runtime table's
    #: peer
    standard_fn: Callable | None = None
    #: (clean inputs, corrupted inputs, metric(output) -> (B,)): the activation-patching experiment of the importance
    #: methods' comparison (:mod:`multihead.apps.prune.methods`)
    patch_pair: tuple | None = None
    #: how the recovery recovers, for the report ("distillation steps towards the unpruned model", ...)
    recovery_kind: str = "distillation steps towards the unpruned model"
    #: what the fidelity is, for a target (:class:`multihead.apps.prune.target.Goal`): "cosine", "kl" or "accuracy"
    metric_kind: str = "cosine"


@dataclass(frozen=True)
class Options:
    """What ``multihead prune`` asks of :func:`run`: prune up to ``fraction`` of all heads in steps of ``step``
    (re-ranking after every step when ``reestimate``), ``recover`` distillation steps and ``quantize`` on the
    kept model, ``target``: keep the furthest step whose fidelity's 95% interval starts at or above it (a
    cosine; None: the last step), ``deadline``: a ``time.monotonic()`` time the command keeps to (None: no
    limit), ``max_seconds``: at most this long per batch size of the speed table; ``progress``: bars;
    ``runtime_peers``: the setup's other runtimes (ONNX Runtime, OpenVINO: an export each) timed beside;
    ``runtime_files``: the kept model's ONNX Runtime and OpenVINO files written beside it (``setup.export_fn``; False:
    the model's own directory only, and so no runtime table; the report says so);
    ``ffn``: the share of every feed-forward block's neurons cut from each finished step before its recovery
    (:func:`multihead.heads.prune_neurons`); ``recover_curve``: every step of the curve recovered (``recover``
    steps each), the curve drawn with and without recovery; ``serve_batch``, ``openvino``: below."""

    fraction: float
    step: float = 0.1
    reestimate: bool = True
    recover: int = 0
    quantize: str | None = None
    target: Goal | float | None = None
    deadline: float | None = None
    max_seconds: float = 60.0
    progress: bool = True
    runtime_peers: bool = True
    runtime_files: bool = True
    ffn: float = 0.0
    recover_curve: bool = False
    #: the batch size the file to serve is chosen at (:mod:`multihead.deploy.serve`; None: the best geometric mean
    #: over batch 1, 16 and 64)
    serve_batch: int | None = None
    #: OpenVINO's files: None where the extra is installed, True required, False left out (``--runtimes``)
    openvino: bool | None = None
    #: the plan's estimate of one candidate of a target search, in seconds (:func:`plan`), until one is timed
    candidate_s: float = 0.0
    #: what was made and measured before the search (:func:`multihead.apps.prune.runtimes.groundwork`: the runtime
    #: files' groundwork, the phases after the search costed); None: :func:`run` makes it
    groundwork: Groundwork | None = None
    #: the command's start (``time.monotonic()``, loading included) and its plan's parts in seconds (:class:`RunPlan`):
    #: the report gives each phase's time beside them
    started: float | None = None
    planned: tuple[tuple[str, float], ...] = ()


#: how a transformers model's recovery recovers (the report's words)
RECOVERY_KIND = "distillation steps towards the unpruned model"

#: what the toy model is measured by (its fidelity is no cosine: ``--target-cosine`` is refused for it)
TOY_METRIC = "digits reversed right"


def goal(o: Options) -> Goal | None:
    """``o.target`` as a :class:`~multihead.apps.prune.target.Goal` (a float is a cosine)."""
    return o.target if o.target is None or isinstance(o.target, Goal) else Goal("cosine", float(o.target))


def toy_setup(ckpt: Path) -> Setup:
    from multihead.models import checkpoint
    from multihead.models.seq2seq import DIGIT0, PAD, digit_accuracy, load_or_train, reverse_batch

    model = load_or_train(ckpt)
    g = torch.Generator().manual_seed(7)
    batches = [reverse_batch(128, generator=g) for _ in range(4)]

    def loss_fn(m, b):
        src, lens, tgt_in, tgt_out = b
        return F.cross_entropy(m(src, lens, tgt_in).transpose(1, 2), tgt_out, ignore_index=PAD)

    speed = {n: [reverse_batch(n, generator=torch.Generator().manual_seed(n + i)) for i in range(4)]
             for n in (1, 16, 64)}

    def run_fn(m, b):
        src, lens, tgt_in, _ = b
        return m(src, lens, tgt_in)

    setup = Setup("toy", model, batches, loss_fn, digit_accuracy, TOY_METRIC, speed, run_fn,
                  "gradient", False, lambda m, p: checkpoint.save(m, p), metric_kind="accuracy")
    def recover(m, steps, quantize=None, until=None):  # its own batches, the same each call: never the metric's
        g = torch.Generator().manual_seed(11)
        return finetune(m, lambda: reverse_batch(64, generator=g), loss_fn, steps, until=until)

    setup.recover_fn = recover
    g_pair = torch.Generator().manual_seed(13)
    src, lens, tgt_in, tgt_out = reverse_batch(64, generator=g_pair)
    other = torch.where(src != PAD, torch.randint(0, 10, src.shape, generator=g_pair) + DIGIT0, PAD)

    def right(logits):  # (B,): the log-probability of the right reversal (its tokens after BOS), per string
        return -F.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=PAD, reduction="none").sum(-1) / (
            lens + 1)

    setup.patch_pair = ((src, lens, tgt_in), (other, lens, tgt_in), right)  # the same strings' lengths, other digits
    setup.recovery_kind = "fine-tuning steps on the reversal task (batches of 64 new strings)"
    return setup


#: what the digits ViT is measured by
VIT_METRIC = "test accuracy"


def vit_setup(ckpt: Path) -> Setup:
    """The demo's ViT on scikit-learn's 8x8 digits: importance on training batches, the metric on the test set,
    recovery by fine-tuning on the training set."""
    from multihead.models import checkpoint, digits
    from multihead.models.vit import accuracy, load_or_train

    model = load_or_train(ckpt)
    xtr, ytr, xte, yte = digits()
    batches = [(xtr[i:i + 128], ytr[i:i + 128]) for i in range(0, 512, 128)]

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    speed = {n: [xte[i * n:(i + 1) * n] for i in range(4)] for n in (1, 16, 64)}
    setup = Setup("vit", model, batches, loss_fn, lambda m: accuracy(m, xte, yte), VIT_METRIC, speed,
                  lambda m, x: m(x), "gradient", False, lambda m, p: checkpoint.save(m, p), metric_kind="accuracy")
    def recover(m, steps, quantize=None, until=None):  # its own batches, the same each call
        g = torch.Generator().manual_seed(11)

        def batch():
            idx = torch.randint(0, len(ytr), (64,), generator=g)
            return xtr[idx], ytr[idx]

        return finetune(m, batch, loss_fn, steps, until=until)

    setup.recover_fn = recover
    clean, label = xte[:128], yte[:128]
    setup.patch_pair = (clean, clean.roll(1, 0), lambda out: out.log_softmax(-1)[torch.arange(len(label)), label])
    setup.recovery_kind = "fine-tuning steps on the training digits (batches of 64)"
    return setup


def finetune(model: nn.Module, batch: Callable[[], object], loss_fn: Callable, steps: int, *, lr: float = 2e-3,
             until: float | None = None, seed: int = 0) -> list[float]:
    """Recovery of a pruned demo model: ``steps`` AdamW steps on the task (``batch()`` -> a batch, ``loss_fn(model,
    batch)``), fewer when ``until`` (a ``time.monotonic()`` time) comes first; dropout draws from ``seed`` (the same
    numbers every run, whatever ran before); the model left in eval mode. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    model.train()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            for _ in range(steps):
                if until is not None and time.monotonic() > until and losses:
                    break
                loss = loss_fn(model, batch())
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        finally:
            model.eval()
    return losses


def minilm_setup(n_importance: int = 256, n_held_out: int | None = None) -> Setup:
    """The pretrained MiniLM: importance on the first ``n_importance`` sentences, fidelity on
    the next ``n_held_out`` (default: all the others, at least 500)."""
    from multihead.apps.common.data import sentences
    from multihead.models import SentenceEncoder, minilm_path

    path = minilm_path()
    enc = SentenceEncoder.from_pretrained(path).eval()
    corpus = sentences()  # ~970 sentences from pydoc_data.topics
    head, held_out = corpus[:n_importance], corpus[n_importance:]  # importance on one part, fidelity on the rest
    if n_held_out is not None:
        held_out = held_out[:n_held_out]
    elif len(held_out) < 500:
        raise ValueError(f"fidelity needs >= 500 held-out sentences; this Python's docs give {len(held_out)}.")

    def tokenized(sents):
        return [enc.tokenize(sents[i:i + 32]) for i in range(0, len(sents), 32)]

    with torch.no_grad():
        imp = [(b, enc(*b)) for b in tokenized(head)]
        batches = tokenized(held_out)
        refs = [enc(i, a) for i, a in batches]

    def loss_fn(m, b):
        (ids, am), ref = b
        return 1 - (m(ids, am) * ref).sum(-1).mean()

    def scores_fn(m):  # (n,) each held-out sentence's cosine to the unpruned model (embeddings are normalised)
        with torch.no_grad():
            return torch.cat([(m(i, a) * r).sum(-1) for (i, a), r in zip(batches, refs)])

    def metric_fn(m):
        return scores_fn(m).mean().item()

    speed = {n: [enc.tokenize(held_out[i:i + n]) for i in range(0, min(len(held_out), 4 * n), n)]
             for n in (1, 16, 64)}
    peer = None
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import BertModel

        hf = BertModel.from_pretrained(str(path)).eval()
        peer = ("transformers.BertModel", hf, lambda m, x: m(input_ids=x[0], attention_mask=x[1]))
    except Exception:  # transformers is optional
        pass
    return Setup("minilm", enc, imp, loss_fn, metric_fn, "mean cosine to the unpruned model", speed,
                 lambda m, x: m(*x), "ablation", True, lambda m, p: m.bert.save_pretrained(p), peer,
                 [f"importance on the first {len(head)} sentences of pydoc_data.topics; fidelity on the other "
                  f"{len(held_out)}"], scores_fn=scores_fn)


def run(setup: Setup, out: Path, options: Options) -> dict:
    """Importance table and heatmap, the pruning curve (JSON + PNG) up to ``options.fraction``, the kept
    step finished (recovered, quantized: :mod:`multihead.apps.prune.target`; with a target, the furthest step that
    meets it), saved (safetensors; with ``quantize``, so that ``multihead.hf.load`` returns it quantized),
    a speed table and ``report.md`` in ``out``. Under a deadline the heads are ranked once when re-ranking
    would leave the speed table too little, recovery runs the steps that fit, and the speed table gets
    what is left (at least 3 rounds a batch size); the report says which medians did not settle. What follows the
    search is made ready and costed before it (``options.groundwork``, else made here:
    :func:`multihead.apps.prune.runtimes.groundwork`): the search leaves those phases their measured time, and the
    report gives each phase's time."""
    o = options
    check_options(setup, o)
    out.mkdir(parents=True, exist_ok=True)
    begun = time.monotonic()
    gw = o.groundwork if o.groundwork is not None else runtimes.groundwork(setup, o, measure=o.deadline is not None)
    budget = Budget(o.deadline, **({"after_s": gw.after_s} if gw.after else {}))
    phase = _Phases(begun)
    if o.groundwork is None:
        phase("what follows the search, made ready and costed")
    imp, reestimate, notes = _importance(setup, o, budget, out)
    phase("importance")
    snapshots: list[nn.Module] = []
    rows = heads.pruning_curve(setup.model, setup.batches, setup.loss_fn, budget.timed(setup.metric_fn), step=o.step,
                               max_fraction=o.fraction, method=setup.method, reestimate=reestimate,
                               mean_replacement=setup.mean_replacement, progress=o.progress,
                               on_step=lambda row, m: snapshots.append(copy.deepcopy(m).eval()), initial=imp)
    phase("the curve")
    kept, search = _keep(setup, rows, snapshots, o, budget)
    phase("the search" if search is not None else "the kept step finished")
    setup.pruned = kept.kept
    said = setup.save_fn(kept.model, out / "model", **({"quantize": o.quantize} if o.quantize else {}))
    model_note = said if isinstance(said, str) else None  # what the saved directory cannot do, in one line
    phase(runtimes.SAVING)
    deployed = runtimes.deployed(setup, kept.model, snapshots[0], out / "model", o=o, gw=gw, budget=budget,
                                 phase=phase)
    speeds, timing_notes, extra_metric = _speed_table(setup, o, rows, snapshots, kept)
    phase(runtimes.SPEED)
    heads.save_curve(rows, out / "curve.json")
    heads.plot_curve(rows, out / "curve.png", metric_name=setup.metric_name)
    report = {
        "model": setup.name, "metric": setup.metric_name, "method": setup.method,
        "mean_replacement": setup.mean_replacement, "reestimate": reestimate, "curve": rows,
        "speed_ms": {n: {b: round(v["median_ms"], 2) for b, v in per.items()} for n, per in speeds.items()},
        "speed": speeds, "timing_notes": timing_notes,
        "final": {"fraction": rows[kept.index]["fraction"], "heads_pruned": rows[kept.index]["heads_pruned"],
                  "metric": kept.fidelity.mean, "fidelity": kept.fidelity.to_json(),
                  "metric_unpruned": rows[0]["metric"], "quantize": o.quantize, "ffn": o.ffn,
                  "ffn_widths": {b.down: b.width for b in heads.ffn_blocks(kept.model)} if o.ffn else None},
        "recovery": kept.recovery, "target": search, "model_note": model_note,
        "peer_metrics": extra_metric, "runtimes": deployed, "bound": _bound(setup, snapshots[0], kept.model),
        "recovery_kind": setup.recovery_kind, "cpu_flags": timing.cpu_flags(), "threads": torch.get_num_threads(),
        "notes": notes,
    }
    phase(runtimes.REPORT)
    report["time"] = _time_record(o, gw, phase.seconds, begun)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(_markdown(report, imp))
    return report


def _speed_table(setup: Setup, o: Options, rows: list[dict], snapshots: list[nn.Module], kept) -> tuple[dict, list, dict]:
    """Every step of the curve, the kept model (as quantized or cut, and served) and the peers timed together
    (:func:`_timings`); each row of the curve given its speeds. ({model: {batch: timing}} as the report shows them: the
    unpruned and the kept model, then the peers; the timing notes; {peer: metric})."""
    names = [f"{r['fraction']:.0%} pruned" for r in rows]
    models = dict(zip(names, snapshots))
    kname = names[kept.index]  # recovery changes no shape: the step's own timing is the kept float model's
    suffix = (f" + {o.ffn:.0%} of neurons" if o.ffn else "") + (f" + {o.quantize}" if o.quantize else "")
    if suffix:  # the model with its neurons cut, or quantized, is timed beside the curve's
        kname += suffix
        models[kname] = kept.kept
    served = _served(setup, kept.kept)
    if served is not None:  # multihead's own runtime at its leanest: the row a batch-1 caller should read
        models[f"{kname} served"] = served
    timings, timing_notes, extra_metric = _timings(setup, models, o.max_seconds, o.deadline, o.progress,
                                                   runtime_peers=o.runtime_peers, openvino=o.openvino is not False)
    for row, n in zip(rows, names):
        row["speed_ms"] = {b: round(v["median_ms"], 2) for b, v in timings[n].items()}
    label = f"pruned {rows[kept.index]['fraction']:.0%}" + kname[len(names[kept.index]):]  # "pruned 50% + int8"
    speeds = {"unpruned (multihead)": timings[names[0]], f"{label} (multihead)": timings[kname]}
    if served is not None:
        speeds[f"{label} (multihead served)"] = timings[f"{kname} served"]
    speeds |= {n: timings[n] for n in timings if n not in models}  # the peers
    return speeds, timing_notes, extra_metric


def _keep(setup: Setup, rows: list[dict], snapshots: list[nn.Module], o: Options, budget: Budget):
    """The step kept and the target search (:func:`multihead.apps.prune.target.choose`); with ``o.recover_curve`` every
    step is recovered first (the curve with and without it) and the kept one's recovery is its own."""
    if not o.recover_curve:
        return choose(setup, rows, snapshots, target=goal(o), recover=o.recover, quantize=o.quantize,
                      budget=budget, ffn=o.ffn, candidate_s=o.candidate_s)
    recovered = _recover_curve(setup, rows, snapshots, o, budget)
    kept, search = choose(setup, rows, recovered, target=goal(o), recover=0, quantize=o.quantize, budget=budget,
                          ffn=o.ffn, candidate_s=o.candidate_s)
    return dataclasses.replace(kept, recovery={**(kept.recovery or {}), **(rows[kept.index].get("recovery") or {})}
                               or None), search


@dataclass(frozen=True)
class RunPlan:
    """What ``multihead prune`` will cost, costed before any work from a few measured calls (:func:`plan`): seconds
    per part up to the search (``parts``), the candidates a full target search evaluates and one candidate's seconds,
    and the phases after the search (``after``: saving, the runtime files and tables, the speed table, the report;
    measured on the unpruned model before the search, :func:`multihead.apps.prune.runtimes.after`; empty until then).
    ``least`` is the shortest run that finishes one candidate with its recovery (heads ranked once) and everything
    after it; ``total`` the whole plan."""

    parts: dict[str, float]
    candidates: int
    candidate_s: float
    after: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values()) + sum(self.after.values())

    @property
    def least(self) -> float:
        """No re-ranking, one candidate, the phases after the search at their least."""
        return (sum(v for k, v in self.parts.items() if k != "re-ranking" and "candidate" not in k) + self.candidate_s
                + sum(self.after.values()))

    def phases(self, search: bool) -> dict[str, float]:
        """The parts up to the search as :func:`run` names its phases (``search``: a target search, else the kept
        step finished), in seconds."""
        rest = {k: v for k, v in self.parts.items() if k not in ("importance", "curve", "re-ranking")}
        return {"importance": self.parts["importance"],
                "the curve": self.parts["curve"] + self.parts.get("re-ranking", 0.0),
                "the search" if search else "the kept step finished": sum(rest.values())}

    def __str__(self) -> str:
        then = f", then {_parts_text(self.after)}" if self.after else ""
        return (f"about {seconds_text(self.total)} in all ({_parts_text(self.parts)}{then}); the least that finishes "
                f"one candidate: {seconds_text(self.least)}")


def _parts_text(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {seconds_text(v)}" for k, v in parts.items())


def plan(setup: Setup, o: Options) -> RunPlan:
    """The run costed before any work: one fidelity evaluation, one pass of the importance loss and two recovery
    steps (on a copy) are timed, and every part of the run is counted from them -- importance (ablation: one pass
    per head; gradient: a forward and a backward), the curve (one evaluation per step, and the heads ranked again
    after each when ``o.reestimate``), the target search's candidates (:func:`multihead.apps.prune.target.search_length`;
    each ``o.recover`` recovery steps and its evaluations) or the one step kept. The phases after the search are
    costed apart, from work made before the search (:func:`multihead.apps.prune.runtimes.groundwork`: ``after``)."""
    from multihead.apps.prune.target import fidelity
    from multihead.heads.gates import attention_modules
    from multihead.layer.hooks import num_heads

    def timed(fn) -> float:
        t = time.monotonic()
        fn()
        return time.monotonic() - t

    model = setup.model
    with torch.no_grad():
        t_eval = timed(lambda: fidelity(setup, model))
        t_pass = timed(lambda: [setup.loss_fn(model, b) for b in setup.batches])
    n_heads = sum(num_heads(m) for m in attention_modules(model).values())
    t_imp = (n_heads + 1 + setup.mean_replacement) * t_pass if setup.method == "ablation" else 3 * t_pass
    steps = int(round(o.fraction / o.step))
    t_step = 0.0
    if o.recover and setup.recover_fn is not None:
        trial = copy.deepcopy(model)
        t_step = timed(lambda: setup.recover_fn(trial, 2)) / 2
    q = 1 if o.quantize else 0
    evals = (2 + q) if o.recover else (1 + q)
    candidate = o.recover * t_step + evals * t_eval
    parts = {"importance": t_imp, "curve": steps * t_eval}
    rerank = t_imp * sum(1 - s * o.step for s in range(1, steps)) if o.reestimate else 0.0
    if rerank:
        parts["re-ranking"] = rerank
    if o.recover_curve:
        parts["recovering the curve"] = steps * (o.recover * t_step + t_eval)
        candidate = (1 + q) * t_eval
    goal_ = goal(o)
    n = search_length(steps) - 1 if goal_ is not None else 1  # pruned candidates
    if goal_ is not None:
        parts["the unpruned model"] = (1 + q) * t_eval
    parts[f"{n} candidate{'s' if n > 1 else ''}"] = n * candidate
    return RunPlan(parts, n, candidate)  # a search tries a cut only while the phases after it keep their share


def recovery_too_long(setup: Setup, o: Options) -> str | None:
    """Why ``o.recover`` recovery steps after every step of the curve cannot fit ``o.deadline`` (two steps timed
    on a copy of the model, times the steps asked, plus the speed table's share), or None."""
    if not o.recover or o.deadline is None or setup.recover_fn is None:
        return None
    trial = copy.deepcopy(setup.model)
    started = time.monotonic()
    setup.recover_fn(trial, 2)
    per_step = (time.monotonic() - started) / 2
    steps = int(round(o.fraction / o.step)) * o.recover if o.recover_curve else o.recover
    need = per_step * steps + TABLE_MIN_S + RESERVE_S
    left = o.deadline - time.monotonic()
    if need <= left:
        return None
    return (f"--recover {o.recover} after each of the {int(round(o.fraction / o.step))} steps is about {need:.0f} s "
            f"of recovery and timing ({per_step * 1e3:.0f} ms a step); the time budget leaves {left:.0f} s: give fewer "
            "--recover steps or a longer --time-budget")


def _bound(setup: Setup, unpruned: nn.Module, kept: nn.Module) -> dict[str, float] | None:
    """{batch size: FLOPs of the unpruned model / the kept one's} on the speed table's first batch of each size
    (:func:`multihead.deploy.compare.flops`), or None for a setup whose models the counter cannot run (transformers
    checkpoints and MiniLM: their bound is the runtime table's)."""
    if setup.name not in ("toy", "vit"):
        return None
    from multihead.deploy.compare import flops

    out = {}
    for b, xs in setup.speed_inputs.items():
        x = xs[0]
        out[str(b)] = round(flops(lambda m=unpruned, x=x: setup.run_fn(m, x)) /
                            flops(lambda m=kept, x=x: setup.run_fn(m, x)), 3)
    return out


def _recover_curve(setup: Setup, rows: list[dict], snapshots: list[nn.Module], o: Options, budget: Budget
                   ) -> list[nn.Module]:
    """Each pruned step's copy recovered for ``o.recover`` steps (``setup.recover_fn``): its metric in the row as
    ``metric_recovered`` (and ``recovery``: steps run, losses); the unpruned step unchanged. Returns the copies."""
    out = [snapshots[0]]
    for row, snap in zip(rows[1:], snapshots[1:]):
        model = copy.deepcopy(snap)
        losses = setup.recover_fn(model, o.recover, until=budget.until(1))
        row["metric_recovered"] = float(setup.metric_fn(model))
        row["recovery"] = {"steps": len(losses), "steps_asked": o.recover, "metric_before": row["metric"],
                           "metric_after": row["metric_recovered"], "loss_first": losses[0], "loss_last": losses[-1]}
        out.append(model)
    rows[0]["metric_recovered"] = rows[0]["metric"]
    return out


def summary(report: dict) -> list[str]:
    """The lines ``multihead prune`` prints about the kept model: how much is pruned and its fidelity (with
    its interval), recovery (and whether the time budget shortened it), quantization, the target search."""
    f, r, t = report["final"], report.get("recovery") or {}, report.get("target")
    fid = f.get("fidelity") or {"mean": f["metric"], "ci95": None}
    ci = f" (95% interval {fid['ci95'][0]:.4f}-{fid['ci95'][1]:.4f})" if fid.get("ci95") else ""
    neurons = f" and {f['ffn']:.0%} of every feed-forward block's neurons" if f.get("ffn") else ""
    lines = [f"{report['model']}: {f['fraction']:.0%} of heads{neurons} pruned, {report['metric']} {f['metric']:.4f}"
             f"{ci} (unpruned {f['metric_unpruned']:.4f})"]
    if r.get("steps"):
        short = (f" ({r['steps']} of the {r['steps_asked']} asked: the time budget ended them; a longer "
                 "--time-budget runs them all)" if r.get("steps_asked", r["steps"]) > r["steps"] else "")
        lines.append(f"recovery: {r['steps']} steps took it from {r['metric_before']:.4f} to "
                     f"{r['metric_after']:.4f}{short}")
    if r.get("quantize"):
        lines.append(f"quantized to {r['quantize']}: {r['metric_quantized']:.4f}")
    if t is not None:
        lines.append(search_line(t))
    if report.get("model_note"):
        lines.append(f"note: {report['model_note']}")
    return lines


def check_options(setup: Setup, o: Options) -> None:
    """Refuse what this setup cannot do, before any work."""
    if o.quantize is not None:
        from multihead.quantize import check_dtype

        check_dtype(o.quantize)
        if setup.quantize_fn is None:
            raise ValueError(f"--quantize is not available for {setup.name} (transformers checkpoints: --hf DIR).")
    if o.recover and setup.recover_fn is None:
        raise ValueError(f"--recover is not available for {setup.name}.")
    if o.target is not None and (why := wrong_target(setup, goal(o))):
        raise ValueError(why)
    if o.ffn and setup.ffn_fn is None:
        raise ValueError(f"--ffn is not available for {setup.name} (transformers checkpoints: --hf DIR).")
    if o.recover_curve and not o.recover:
        raise ValueError("recover_curve recovers every step of the curve: give recover > 0 steps.")
    if o.recover_curve and (why := recovery_too_long(setup, o)):
        raise ValueError(why)


def _importance(setup: Setup, o: Options, budget: Budget, out: Path) -> tuple[heads.Importance, bool, list[str]]:
    """The unpruned model's head importance (table and heatmap written to ``out``), whether the curve
    re-ranks after every step (not when that would leave the speed table too little of the budget), and
    the run's notes."""
    base = setup.model
    started = time.monotonic()
    imp = heads.importance(base, setup.batches, setup.loss_fn, setup.method, progress=o.progress,
                           fill=heads.mean_head_outputs(base, setup.batches, setup.loss_fn)
                           if setup.mean_replacement else None)
    notes = list(setup.notes)
    reestimate = o.reestimate
    if reestimate and (why := _no_time_to_reestimate(time.monotonic() - started, o.fraction, o.step, o.deadline,
                                                     budget.after_s)):
        reestimate = False
        notes.append(why)
    (out / "importance.json").write_text(json.dumps(imp.to_json(), indent=2))
    _heatmap(imp, out / "importance.png")
    return imp, reestimate, notes


def _no_time_to_reestimate(took: float, fraction: float, step: float, deadline: float | None,
                           after_s: float = TABLE_MIN_S + RESERVE_S) -> str | None:
    """Why the heads are ranked once (the re-estimates after every step, each costing what the first
    importance ``took`` times the share of heads left, would leave the phases after the search less than
    their ``after_s`` before the deadline), or None."""
    if deadline is None:
        return None
    steps = int(round(fraction / step))
    cost = took * sum(1 - s * step for s in range(1, steps))
    if time.monotonic() + cost + after_s <= deadline:
        return None
    return (f"heads ranked once: re-ranking them after every step would take about {cost:.0f} s more, past the time "
            "budget (--time-budget; --no-reestimate says it at once)")


def _allowed(max_seconds: float, deadline: float | None, sizes_left: int) -> tuple[float, int]:
    """(seconds, rounds before the time may stop it) for the next batch size's timing: the time left
    before the deadline shared by the batch sizes left, at most ``max_seconds``; 7 rounds, 3 under a
    deadline."""
    if deadline is None:
        return max_seconds, 7
    left = deadline - time.monotonic() - RESERVE_S
    return max(0.0, min(max_seconds, left / sizes_left)), 3


def _timings(setup: Setup, models: dict[str, nn.Module], max_seconds: float, deadline: float | None = None,
             progress: bool = False, *, runtime_peers: bool = True, openvino: bool = True
             ) -> tuple[dict, list[str], dict]:
    """Every model and the peers timed together (interleaved rounds, per batch size; ``runtime_peers``: the setup's
    other runtimes too, OpenVINO's only with ``openvino``): ({name: {batch: timing}} per batch of b, the notes (a busy
    machine, medians that did not settle, the time budget), {peer: metric})."""
    models = dict(models)
    runs = {n: setup.run_fn for n in models}
    if setup.peer is not None:
        models[setup.peer[0]], runs[setup.peer[0]] = setup.peer[1], setup.peer[2]
    extra_metric = {}
    peers = setup.more_peers(openvino=openvino) if setup.more_peers is not None and runtime_peers else []
    for name, m, fn in peers:
        models[name], runs[name] = m, fn
        extra_metric[name] = float(setup.metric_fn(m))
    timings: dict[str, dict[str, dict]] = {n: {} for n in models}
    notes = []
    sizes = list(setup.speed_inputs.items())
    for i, (b, xs) in enumerate(sizes):
        calls = {n: (lambda m=m, f=runs[n], xs=xs: _run_all(m, f, xs)) for n, m in models.items()}
        allowed, late_rounds = _allowed(max_seconds, deadline, len(sizes) - i)
        with torch.no_grad():
            t = timing.interleaved(calls, max_seconds=allowed, late_rounds=late_rounds, warmup=1,
                                   progress=f"speed table, batch {b}" if progress else None)
        for n, tm in t.items():  # per batch of b: a call runs len(xs) batches
            timings[n][str(b)] = tm.scaled(1 / len(xs)).to_json()
        said = [n for n in (timing.busy_note(t),) if n is not None]
        if deadline is not None and allowed < max_seconds:  # the budget, not --max-seconds, set this batch's time
            said.append(f"the time budget left {allowed:.0f} s for this batch size ({t[next(iter(t))].n} rounds)")
        if said:
            notes.append(f"batch {b}: " + "; ".join(said))
    return timings, notes, extra_metric


def _run_all(model, run_fn, inputs: list) -> None:
    for x in inputs:
        run_fn(model, x)


class _Phases:
    """Each phase's seconds, in order (``seconds``): calling it with a phase's name ends that phase."""

    def __init__(self, since: float):
        self.seconds: dict[str, float] = {}
        self._since = since

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._since, 1)
        self._since = now


def _time_record(o: Options, gw: Groundwork, seconds: dict[str, float], begun: float) -> dict:
    """report.json's "time": the budget (seconds from the command's start, None without one), the seconds taken in
    all, each phase's seconds in order -- before :func:`run`, loading and costing the plan and what follows the search
    made ready (the groundwork's parts) -- and what the plan gave each (its least share, for the phases after the
    search)."""
    start = o.started if o.started is not None else begun
    before = {}
    if o.groundwork is not None:  # the command made it, after loading and costing the plan
        made = sum(gw.made.values())
        before = {"loading and costing the plan": round(max(0.0, begun - start - made), 1),
                  **{k: round(v, 1) for k, v in gw.made.items()}}
    return {"budget_s": None if o.deadline is None else round(o.deadline - start, 1),
            "seconds": round(time.monotonic() - start, 1), "phases": before | seconds,
            "planned": {k: round(v, 1) for k, v in o.planned} | {k: round(v, 1) for k, v in gw.after.items()}}


def time_lines(t: dict | None) -> list[str]:
    """report.md's lines on the command's time: the budget, the time taken, and each phase's seconds beside what the
    plan gave it (the phases after the search at their least: the search left them that)."""
    if not t:
        return []
    budget = f" of a budget of {seconds_text(t['budget_s'])}" if t.get("budget_s") is not None else ""
    lines = ["## Time", "", f"{seconds_text(t['seconds'])} in all{budget}; each phase, and what the plan gave it "
             "(costed before any work; the phases after the search at their least, measured on the unpruned model):",
             "", "| phase | planned | took |", "|---|---:|---:|"]
    for k, v in t["phases"].items():
        planned = t.get("planned", {}).get(k)
        lines.append(f"| {k} | {seconds_text(planned) if planned is not None else '-'} | {seconds_text(v)} |")
    return lines + [""]


def _heatmap(imp: heads.Importance, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = imp.table()
    fig, ax = plt.subplots(figsize=(1 + 0.45 * t.shape[1], 0.8 + 0.4 * t.shape[0]))
    im = ax.imshow(t.numpy(), cmap="viridis", aspect="auto")
    ax.set_yticks(range(len(imp.names)), imp.names, fontsize=7)
    ax.set_xticks(range(t.shape[1]), [str(h) for h in range(t.shape[1])], fontsize=7)
    ax.set_xlabel("head")
    ax.set_title(f"head importance ({imp.method})", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def settled(t: dict) -> bool:
    """Whether a timing (its JSON) settled: its median's 95% interval within ±5% of it."""
    lo, hi = t.get("ci95_ms", (t["median_ms"], t["median_ms"]))
    return t["median_ms"] > 0 and (hi - lo) <= 0.10 * t["median_ms"]


def speed_table(speeds: dict, bound: dict | None = None) -> str:
    """{model: {batch: timing json}} -> a markdown table: median ms per batch (min-max), speed-up
    against the first model; a median that did not settle is marked and footnoted. ``bound`` ({batch: ratio}):
    a last row with the arithmetic bound of the work removed, under the speed-ups."""
    sizes = sorted({b for v in speeds.values() for b in v}, key=int)
    ref = next(iter(speeds.values()))

    def cell(t: dict) -> str:
        return f"{t['median_ms']:.2f}{'' if settled(t) else ' †'} ({t['min_ms']:.2f}-{t['max_ms']:.2f})"

    lines = ["| model | " + " | ".join(f"batch {b}: ms (min-max)" for b in sizes) + " | " +
             " | ".join(f"speed-up @{b}" for b in sizes) + " |", "|---|" + "---:|" * (2 * len(sizes))]
    for name, v in speeds.items():
        lines.append(f"| {name} | " + " | ".join(cell(v[b]) for b in sizes) + " | " +
                     " | ".join(f"{ref[b]['median_ms'] / v[b]['median_ms']:.2f}x" for b in sizes) + " |")
    if bound:
        lines.append("| bound: the arithmetic removed |" + " |" * len(sizes) + " " +
                     " | ".join(f"{bound[b]:.2f}x" if b in bound else "" for b in sizes) + " |")
    if not all(settled(t) for v in speeds.values() for t in v.values()):
        lines += ["", "† median not settled to ±5% in the time allowed (its 95% interval is wider): read it as a "
                      "range, see min-max."]
    return "\n".join(lines)


def _markdown(r: dict, imp: heads.Importance) -> str:
    rows = r["curve"]
    rec = "metric_recovered" in rows[0]
    bound = r.get("bound") or {}
    curve = ["| heads pruned | " + r["metric"] + (" | after recovery" if rec else "") + " | " +
             " | ".join(f"ms @{b}" for b in rows[0].get("speed_ms", {})) + " |",
             "|---:|---:|" + ("---:|" if rec else "") + "---:|" * len(rows[0].get("speed_ms", {}))]
    for row in rows:
        curve.append(f"| {row['fraction']:.0%} ({row['heads_pruned']}) | {row['metric']:.4f} | " +
                     (f"{row['metric_recovered']:.4f} | " if rec else "") +
                     " | ".join(f"{v:.2f}" for v in row.get("speed_ms", {}).values()) + " |")
    return "\n".join([
        f"# Pruning {r['model']}",
        "",
        f"Importance: {r['method']}" + (" (a removed head is replaced by its mean output)" if r["mean_replacement"]
                                        else "") + f"; re-estimated after every step: {r['reestimate']}.",
        f"Measured on a CPU with {' '.join(r.get('cpu_flags') or []) or 'unknown flags'}, "
        f"{r.get('threads', '?')} thread(s).",
        *[f"- {n}" for n in r["notes"]],
        "",
        "![importance](importance.png)",
        "",
        imp.to_markdown(),
        "",
        "## The pruning curve",
        "",
        "![curve](curve.png)",
        "",
        *curve,
        "",
        "## The model kept",
        "",
        "Fidelity on the held-out sentences, with the 95% interval of the mean (normal approximation over "
        "sentences):" if (r["final"].get("fidelity") or {}).get("ci95") else "Fidelity on the held-out items:",
        "",
        *[f"- {line}" for line in summary(r)],
        "",
        "## Speed (ms per batch; speed-up against the first row)",
        "",
        "Every model of the curve and the peer timed together: interleaved rounds after a warm-up, until each "
        "median's 95% interval is within ±5% (or the time allowed runs out); median and min-max per batch.",
        *[f"- {n}" for n in r["timing_notes"]],
        "",
        speed_table(r["speed"], r.get("bound")),
        "",
        *([f"The bound: the kept model does {' / '.join(f'{v:.2f}x' for v in bound.values())} less arithmetic than "
           f"the unpruned one at batch {' / '.join(bound)} (FLOPs counted op by op, attention included): the "
           "most any runtime can gain from the cut.", ""] if bound else []),
        *([f"Recovery: {r['recovery']['steps']} {r.get('recovery_kind') or RECOVERY_KIND} took the metric from "
           f"{r['recovery']['metric_before']:.4f} to {r['recovery']['metric_after']:.4f}; the saved model is the "
           "recovered one.", ""] if (r.get("recovery") or {}).get("steps") else []),
        *([f"Quantized to {r['recovery']['quantize']} last (Linear layers: int8 weights per output row, activations "
           f"per call): metric {r['recovery']['metric_quantized']:.4f}; `multihead.hf.load` returns it quantized.", ""]
          if (r.get("recovery") or {}).get("quantize") else []),
        *[f"{n}: metric {v:.4f} (timed above)." for n, v in r.get("peer_metrics", {}).items()],
        "",
        "The pruned model is in `model/` (safetensors; it rebuilds itself from its config).",
        "",
        *runtimes.runtime_section(r.get("runtimes")), *time_lines(r.get("time")),
    ])


def _served(setup: Setup, model: nn.Module) -> nn.Module | None:
    """The kept model served (``setup.serve_fn``), or None where the setup has none or the model is not one it
    serves (e.g. not a BERT-family encoder: the speed table then has no served row)."""
    if setup.serve_fn is None:
        return None
    try:
        return setup.serve_fn(model)
    except (TypeError, ValueError):
        return None
