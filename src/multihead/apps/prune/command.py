"""``multihead prune``: the options checked and refused in one line each before any work, the set-up chosen
(toy, minilm, --hf encoder or causal LM), the plan costed against the time budget, the report printed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from multihead.apps.common.checkpoints import checkpoints


def _wide_text(args) -> list[str] | None:
    """``prune --hf``'s extra recovery text: the standard library's docstrings, 16 per recovery step (none when
    there is no recovery or ``--recover-text split``)."""
    from multihead.apps.common.data import docstring_sentences

    return docstring_sentences(16 * args.recover) if args.recover and args.recover_text == "wide" else None


def _unseen_text(args, corpus: list[str] | None) -> tuple[str, list[str]] | None:
    """``prune --hf``'s second kind of held-out text: the installed packages' descriptions, none of them in the
    corpus or the recovery text."""
    from multihead.apps.common.data import package_sentences, sentences

    if not args.unseen_sentences:
        return None
    known = set(corpus if corpus is not None else sentences()) | set(_wide_text(args) or ())
    return "the installed packages' descriptions", package_sentences(args.unseen_sentences, exclude=known)


#: what ``prune`` writes in --out (and the toy model's checkpoints); anything else there is the user's
PRUNE_WRITES = frozenset({"importance.json", "importance.png", "curve.json", "curve.png", "report.json", "report.md",
                          "model", "checkpoints"})


def _foreign_files(out: Path) -> str | None:
    """None when ``out`` is new, empty or holds only what ``prune`` writes; else the one line refusing it."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file: give a folder"
    other = sorted(p.name for p in out.iterdir() if p.name not in PRUNE_WRITES) if out.is_dir() else []
    if not other:
        return None
    return (f"--out {out} holds files prune did not write ({', '.join(other[:5])}{', ...' if len(other) > 5 else ''}): "
            "give a new or empty folder, or --force to write beside them")


def _said(refusal: str | None) -> bool:
    """Print ``refusal`` (a line of ``multihead prune``) on stderr when there is one; whether there was."""
    if refusal:
        print(f"multihead prune: {refusal}", file=sys.stderr)
    return bool(refusal)


def _hf_only(args) -> str | None:
    """The first option given that applies to transformers checkpoints only, refused without ``--hf`` (or to causal
    LMs only, refused for anything else), or None."""
    if _decoder_only(args):
        return _decoder_only(args)
    for given, option in ((args.quantize, "--quantize"), (args.ffn, "--ffn"), (args.no_runtime_files, "--no-runtime-files"),
                          (args.serve_batch, "--serve-batch"), (args.runtimes, "--runtimes")):
        if given and not args.hf:
            return f"{option} applies to transformers checkpoints: give --hf DIR"
    return _serving(args)


#: ``prune --runtimes``: each runtime's name, the modules its files need and the extra that installs them
RUNTIME_EXTRAS = {"onnx": (("onnxruntime", "onnxscript"), "onnx"), "openvino": (("openvino",), "openvino")}


def _serving(args) -> str | None:
    """The one line that refuses ``--serve-batch`` or ``--runtimes`` (a batch that is not a positive whole number, an
    unknown runtime, a runtime asked for -- ONNX Runtime's with --serve-batch too -- whose extra is missing), or None
    with ``args.serve_batch`` made a number and ``args.openvino`` set (OpenVINO's files: None where installed, True
    asked for, False left out)."""
    import importlib.util

    batch = None
    if args.serve_batch is not None:
        text = str(args.serve_batch).strip()
        if not text.isdigit() or int(text) < 1:
            return f"--serve-batch must be a positive whole number (the batch size served, e.g. 16); got {args.serve_batch!r}"
        batch = int(text)
    names = [x.strip() for x in (args.runtimes or "").split(",") if x.strip()]
    bad = [x for x in names if x not in RUNTIME_EXTRAS]
    if bad or (args.runtimes is not None and not names):
        return f"--runtimes: unknown runtime(s) {bad or [args.runtimes]}; choose from {','.join(RUNTIME_EXTRAS)}"
    if (names or batch is not None) and args.no_runtime_files:
        return "--runtimes and --serve-batch choose runtime files: they do not go with --no-runtime-files"
    for name in dict.fromkeys((["onnx"] if names or batch is not None else []) + names):
        modules, extra = RUNTIME_EXTRAS[name]
        missing = next((m for m in modules if importlib.util.find_spec(m) is None), None)
        if missing is not None:
            return (f"the {name} runtime needs {missing}, which is not installed: pip install 'multihead[{extra}]'")
    args.serve_batch, args.openvino = batch, ("openvino" in names) if names else None
    return None


def prune(args) -> int:
    started = time.monotonic()  # the time budget counts from here; the speed table gets what is left of it
    import matplotlib

    matplotlib.use("Agg")
    from multihead.apps.prune import pruning, target

    out = Path(args.out)
    if not args.force and _said(_foreign_files(out)):
        return 2
    if args.hf and _causal(args.hf):
        return _prune_decoder(args, out, started)
    goal = _goal(args)
    fraction = args.fraction if args.fraction is not None else 0.8 if goal is not None else 0.4
    if args.step > fraction:
        print(f"multihead prune: --step ({args.step}) must not exceed --fraction ({fraction})", file=sys.stderr)
        return 2
    if args.corpus and not Path(args.corpus).is_file():
        print(f"multihead prune: --corpus {args.corpus} does not exist", file=sys.stderr)
        return 2
    if _said(_hf_only(args)):
        return 2
    if goal is not None and not args.hf and args.model == "toy" and goal.kind != "accuracy":  # before any training
        print(f"multihead prune: {target.target_refused('toy', 'accuracy', pruning.TOY_METRIC, goal)}", file=sys.stderr)
        return 2
    if args.hf:
        from multihead.apps.prune import hf_models

        corpus = None
        if args.corpus:
            corpus = [line.strip() for line in Path(args.corpus).read_text().splitlines() if line.strip()]
        sizes = args.sentences or (128, None)
        setup = hf_models.hf_setup(args.hf, corpus, *sizes, n_recover=args.recover_sentences,
                                   recover_extra=_wide_text(args), held_out_extra=_unseen_text(args, corpus),
                                   n_passages=args.passages)
    elif args.model is None:
        print("multihead prune: give --model {toy,minilm} or --hf DIR", file=sys.stderr)
        return 2
    elif args.model == "toy":
        setup = pruning.toy_setup(Path(args.checkpoints) if args.checkpoints  # the toy model's own directory
                                  else checkpoints(None, out) / "transformer")
    else:
        try:
            setup = pruning.minilm_setup(*(args.sentences if args.sentences else ()))
        except FileNotFoundError as e:
            print(f"multihead prune: {e}", file=sys.stderr)
            return 2
    curve = bool(args.recover) and setup.name == "toy"  # the demo's model: every step recovered, both curves drawn
    options = pruning.Options(fraction, step=args.step, reestimate=not args.no_reestimate, recover=args.recover or 0,
                              quantize=args.quantize, target=goal, deadline=None,
                              max_seconds=args.max_seconds, runtime_peers=not args.no_runtime_peers, openvino=args.openvino,
                              runtime_files=not args.no_runtime_files, serve_batch=args.serve_batch,
                              ffn=args.ffn or 0.0, recover_curve=curve)
    try:  # what this model cannot do, or a plan the time budget cannot hold, refused before any work
        pruning.check_options(setup, options)
        options = _within_budget(setup, options, args.time_budget, started)
    except ValueError as e:
        print(f"multihead prune: {e}", file=sys.stderr)
        return 2
    return _report_and_exit(pruning.run(setup, out, options), out)


def _causal(folder: str) -> bool:
    """Whether ``folder``'s config.json names a causal LM (read as JSON: no torch, no transformers yet)."""
    import json

    cfg = Path(folder) / "config.json"
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False  # the encoder path says what is wrong with the folder
    return any(str(a).endswith("ForCausalLM") for a in archs)


#: options of ``prune --hf`` on encoders only, with their argparse defaults: given to a causal LM, refused
ENCODER_ONLY = (("quantize", "--quantize", None), ("ffn", "--ffn", None), ("corpus", "--corpus", None),
                ("recover_sentences", "--recover-sentences", None), ("sentences", "--sentences", None),
                ("target_cosine", "--target-cosine", None), ("target_accuracy", "--target-accuracy", None),
                ("no_runtime_files", "--no-runtime-files", False), ("no_runtime_peers", "--no-runtime-peers", False),
                ("no_reestimate", "--no-reestimate", False), ("recover_text", "--recover-text", "wide"),
                ("unseen_sentences", "--unseen-sentences", 300), ("passages", "--passages", 32),
                ("step", "--step", 0.1), ("max_seconds", "--max-seconds", 60.0), ("serve_batch", "--serve-batch", None),
                ("runtimes", "--runtimes", None))


#: options of causal LMs only: given to anything else, refused
DECODER_ONLY = (("target_perplexity", "--target-perplexity"), ("unit", "--unit"), ("behaviour", "--behaviour"),
                ("lr", "--lr"), ("formats", "--formats"), ("per_layer", "--per-layer"),
                ("fsdp", "--fsdp"), ("decode_contexts", "--decode-contexts"), ("decode_rounds", "--decode-rounds"))


#: a causal LM's time budget when none is given (its recovery is cut short to it)
DECODER_BUDGET_S = 900.0


def _decoder_only(args) -> str | None:
    for key, option in DECODER_ONLY:
        if getattr(args, key, None) is not None:
            return f"{option} applies to causal language models (--hf DIR of a *ForCausalLM)"
    return None


def _prune_decoder(args, out: Path, started: float) -> int:
    """``prune --hf DIR`` on a causal LM (:mod:`multihead.apps.prune.decoder`): options it does not take, a behaviour file
    and a plan the model cannot hold refused in one line each before any work; exit 1 when a target is missed."""
    from multihead.apps.prune import decoder

    given = [option for key, option, default in ENCODER_ONLY if getattr(args, key, default) != default]
    if _said(f"{given[0]} applies to encoders; a causal LM is cut by --fraction/--unit, judged by "
             "--target-perplexity/--target-kl and --behaviour" if given else None):
        return 2
    if _said(f"--behaviour {args.behaviour} does not exist" if args.behaviour and not Path(args.behaviour).is_file()
             else None):
        return 2
    target = (("perplexity", args.target_perplexity) if args.target_perplexity is not None else
              ("kl", args.target_kl) if args.target_kl is not None else None)
    budget = args.time_budget if args.time_budget is not None else DECODER_BUDGET_S
    o = decoder.DecoderOptions(fraction=args.fraction, unit=args.unit or "auto", target=target,
                        behaviour=Path(args.behaviour) if args.behaviour else None,
                        recover=400 if args.recover is None else args.recover, lr=args.lr or 3e-4,
                        deadline=started + budget, formats=args.formats or (), per_layer=bool(args.per_layer),
                        fsdp=bool(args.fsdp), decode_contexts=args.decode_contexts or (),
                        decode_rounds=args.decode_rounds or 3)
    command = "multihead " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["prune"] else ""
    try:
        report = decoder.run(args.hf, out, o, command=command)
    except ValueError as e:
        _said(str(e).splitlines()[0])
        return 2
    if report["rank"]:  # under torchrun: rank 0 says it and wrote the files
        return 0 if report["met"] else 1
    print("\n".join(decoder.summary(report)))
    print(f"report: {out / 'report.md'}")
    if not report["met"]:
        print("multihead prune: no cut tried meets the target (report.md lists each); nothing saved", file=sys.stderr)
        return 1
    for line in report["formats_failed"]:  # the folder is saved; a format that did not read back is a failure
        print(f"multihead prune: {line}", file=sys.stderr)
    return 1 if report["formats_failed"] else 0


def _report_and_exit(report: dict, out: Path) -> int:
    """Print the report's lines; the exit code: 1 when a target was asked and no model tried met it, else 0."""
    from multihead.apps.prune.target import not_met

    _print_report(report, out)
    search = report.get("target")
    if search is not None and not search["met"]:
        print(f"multihead prune: {not_met(search)}", file=sys.stderr)
        return 1
    return 0


#: the time budget when none is given: grown to the plan's cost when a default run needs more
DEFAULT_BUDGET_S = 270.0


def _goal(args):
    """The ``--target-*`` option given, as a :class:`multihead.apps.prune.target.Goal` (None without one)."""
    from multihead.apps.prune.target import Goal

    for kind in ("cosine", "kl", "accuracy"):
        value = getattr(args, f"target_{kind}", None)
        if value is not None:
            return Goal(kind, value)
    return None


def _within_budget(setup, options, budget: float | None, started: float):
    """``options`` with the command's deadline, the plan's estimate of one candidate and what was made ready before
    the search. The run is costed in two steps (:func:`multihead.apps.prune.pruning.plan`): the pruning from a few
    measured calls, a ``budget`` (seconds from ``started``) that cannot hold its least refused at once (ValueError,
    one line); then what follows the search, from the work it needs made before the search and timed (the runtime
    files' groundwork: :func:`multihead.apps.prune.runtimes.groundwork`), a budget that cannot hold the least run with
    it refused naming those figures. The plan is printed as one line; without a budget the default grows to it."""
    import dataclasses

    from multihead.apps.prune import pruning, runtimes
    from multihead.apps.prune.target import seconds_text

    p = pruning.plan(setup, options)
    spent = time.monotonic() - started
    if budget is not None and spent + p.least > budget:
        raise ValueError(f"--time-budget {seconds_text(budget)} cannot hold one candidate: {p} (loading took "
                         f"{seconds_text(spent)}); give --time-budget {seconds_text(spent + p.least)} or "
                         f"more ({seconds_text(spent + p.total)} for the whole plan, and what follows the search), or "
                         "fewer --recover steps")
    gw = runtimes.groundwork(setup, options)
    p = dataclasses.replace(p, after=gw.after)
    spent = time.monotonic() - started
    made = f"; made before the search: {gw}" if gw.made else ""
    if budget is None:
        budget = max(DEFAULT_BUDGET_S, spent + p.total)
        print(f"plan: {p}{made}; time budget {seconds_text(budget)} (the default, grown to the plan where it needs "
              "more; --time-budget sets another)")
    else:
        if spent + p.least > budget:
            fewer = ", --runtimes onnx, --no-runtime-peers or --no-runtime-files" if gw.own else ""
            raise ValueError(f"--time-budget {seconds_text(budget)} cannot hold one candidate and what follows the "
                             f"search: {p} (loading and costing took {seconds_text(spent)}{made}); give --time-budget "
                             f"{seconds_text(spent + p.least)} or more ({seconds_text(spent + p.total)} for the whole "
                             f"plan), or fewer --recover steps{fewer}")
        print(f"plan: {p}{made}; time budget {seconds_text(budget)}" + (
            "" if spent + p.total <= budget else
            f" (the whole plan needs {seconds_text(spent + p.total)}: the search may end before it is settled)"))
    return dataclasses.replace(options, deadline=started + budget, candidate_s=p.candidate_s, groundwork=gw,
                               started=started, planned=tuple(p.phases(options.target is not None).items()))


def _print_report(report: dict, out: Path) -> None:
    """What ``multihead prune`` prints at the end: the kept model, the speed table, the runtime files and table."""
    from multihead.apps.prune import pruning, runtimes
    from multihead.apps.prune.target import seconds_text

    t = report.get("time") or {}
    took = ([f"time: {seconds_text(t['seconds'])}" + (f" of a budget of {seconds_text(t['budget_s'])}"
                                                      if t.get("budget_s") is not None else "")
             + " (" + ", ".join(f"{k} {seconds_text(v)}" for k, v in t["phases"].items()) + ")"] if t else [])
    lines = [*pruning.summary(report), pruning.speed_table(report["speed"], report.get("bound")),
             *runtimes.runtime_section(report.get("runtimes"))[2:],  # the files and the runtime table
             *[f"note: {note}" for note in report["timing_notes"]], *took,
             f"report: {out / 'report.md'}; pruned model: {out / 'model'}"]
    print("\n".join(lines))

