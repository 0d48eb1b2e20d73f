"""The ``multihead`` command: demo, viz."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from multihead.apps.demo import format_weights  # noqa: F401  (kept importable from here)

DEMO_CHECKPOINTS = Path("out") / "checkpoints"  # where `make demo` (multihead demo --out out) keeps them


def _checkpoints(given: str | None, out: Path) -> Path:
    """The checkpoint folder: --checkpoints, else OUT/checkpoints or the demo's out/checkpoints,
    whichever holds a trained model; else the demo's (trained there, found by the next command)."""
    if given:
        return Path(given)
    for c in (out / "checkpoints", DEMO_CHECKPOINTS):
        if any((c / m / "model.safetensors").exists() for m in ("transformer", "vit")):
            return c
    return DEMO_CHECKPOINTS


def _demo(args) -> int:
    from multihead.apps import demo

    demo.run(Path(args.out), retrain=args.retrain, seed=args.seed, max_seconds=args.max_seconds, recover=args.recover)
    return 0


#: what viz draws a sentence model on when no --text is given
SENTENCE = "Multi-head attention lets the model look in several places."


def _text(args, default: str) -> str:
    """--text as given (an empty one included: it is what the user asked to see), or ``default`` when absent."""
    return default if args.text is None else args.text


def _viz(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from multihead.apps import demo

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.timm or args.torchvision:
        return _viz_vision(args, out)
    ckpts = _checkpoints(args.checkpoints, out)
    if args.hf:
        from multihead.apps import hf_models

        paths = hf_models.draw(args.hf, _text(args, SENTENCE), out, explain=args.explain)
    elif args.model is None:
        print("multihead viz: give --model {toy,vit,minilm} or --hf DIR", file=sys.stderr)
        return 2
    elif args.index is not None and args.model != "vit":
        print(f"multihead viz: --index picks a test image of --model vit; --model {args.model} draws --text",
              file=sys.stderr)
        return 2
    elif args.model == "toy":
        text = _text(args, "31415926")
        demo.toy_digits(text)  # checked before any training
        paths = demo.draw_reverser(demo.reverser(ckpts / "transformer", args.retrain), text, out)
    elif args.model == "vit":
        n_test = len(demo.digits()[2])
        if (args.index or 0) >= n_test:  # checked before any training
            print(f"multihead viz: --index must be in [0, {n_test - 1}] (the digits test images); got {args.index}",
                  file=sys.stderr)
            return 2
        paths = demo.draw_vit(demo.vit(ckpts / "vit", args.retrain), args.index or 0, out)
    else:
        try:
            paths = demo.draw_minilm(_text(args, SENTENCE), out)
        except FileNotFoundError as e:
            print(f"multihead viz: {e}", file=sys.stderr)
            return 2
    for p in paths:
        print(p)
    return 0


def _viz_vision(args, out: Path) -> int:
    """``multihead viz --timm NAME`` / ``--torchvision NAME``: every head of the model on ``--image``."""
    import json

    from multihead.apps import vision

    if args.timm and args.torchvision or not args.image or args.model or args.hf:
        print("multihead viz: --timm NAME or --torchvision NAME (one) takes --image FILE, with --checkpoint FILE "
              "and --model-args JSON if needed; not with --model or --hf", file=sys.stderr)
        return 2
    try:
        model_args = json.loads(args.model_args) if args.model_args else None
        if model_args is not None and not isinstance(model_args, dict):
            raise ValueError(f"--model-args must be a JSON object of the model's arguments; got {args.model_args}")
        package, name = ("timm", args.timm) if args.timm else ("torchvision", args.torchvision)
        model = vision.load_model(package, name, args.checkpoint, model_args)
        paths = vision.draw(model, args.image, out)
    except (ValueError, FileNotFoundError) as e:  # json's JSONDecodeError is a ValueError
        print(f"multihead viz: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def _wide_text(args) -> list[str] | None:
    """``prune --hf``'s extra recovery text: the standard library's docstrings, 16 per recovery step (none when
    there is no recovery or ``--recover-text split``)."""
    from multihead.apps.data import docstring_sentences

    return docstring_sentences(16 * args.recover) if args.recover and args.recover_text == "wide" else None


def _unseen_text(args, corpus: list[str] | None) -> tuple[str, list[str]] | None:
    """``prune --hf``'s second kind of held-out text: the installed packages' descriptions, none of them in the
    corpus or the recovery text."""
    from multihead.apps.data import package_sentences, sentences

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
    for given, option in ((args.quantize, "--quantize"), (args.ffn, "--ffn"), (args.no_runtime_files, "--no-runtime-files")):
        if given and not args.hf:
            return f"{option} applies to transformers checkpoints: give --hf DIR"
    return None


def _prune(args) -> int:
    started = time.monotonic()  # the time budget counts from here; the speed table gets what is left of it
    import matplotlib

    matplotlib.use("Agg")
    from multihead.apps import pruning

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
        print(f"multihead prune: {pruning.target_refused('toy', 'accuracy', pruning.TOY_METRIC, goal)}", file=sys.stderr)
        return 2
    if args.hf:
        from multihead.apps import hf_models

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
                                  else _checkpoints(None, out) / "transformer")
    else:
        try:
            setup = pruning.minilm_setup(*(args.sentences if args.sentences else ()))
        except FileNotFoundError as e:
            print(f"multihead prune: {e}", file=sys.stderr)
            return 2
    curve = bool(args.recover) and setup.name == "toy"  # the demo's model: every step recovered, both curves drawn
    options = pruning.Options(fraction, step=args.step, reestimate=not args.no_reestimate, recover=args.recover or 0,
                              quantize=args.quantize, target=goal, deadline=None,
                              max_seconds=args.max_seconds, runtime_peers=not args.no_runtime_peers,
                              runtime_files=not args.no_runtime_files,
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
                ("step", "--step", 0.1), ("max_seconds", "--max-seconds", 60.0))
#: options of causal LMs only: given to anything else, refused
DECODER_ONLY = (("target_perplexity", "--target-perplexity"), ("unit", "--unit"), ("behaviour", "--behaviour"),
                ("lr", "--lr"), ("formats", "--formats"), ("per_layer", "--per-layer"),
                ("fsdp", "--fsdp"))
#: a causal LM's time budget when none is given (its recovery is cut short to it)
DECODER_BUDGET_S = 900.0


def _decoder_only(args) -> str | None:
    for key, option in DECODER_ONLY:
        if getattr(args, key, None) is not None:
            return f"{option} applies to causal language models (--hf DIR of a *ForCausalLM)"
    return None


def _prune_decoder(args, out: Path, started: float) -> int:
    """``prune --hf DIR`` on a causal LM (:mod:`multihead.apps.decoder`): options it does not take, a behaviour file
    and a plan the model cannot hold refused in one line each before any work; exit 1 when a target is missed."""
    from multihead.apps import decoder

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
    o = decoder.Options(fraction=args.fraction, unit=args.unit or "auto", target=target,
                        behaviour=Path(args.behaviour) if args.behaviour else None,
                        recover=400 if args.recover is None else args.recover, lr=args.lr or 3e-4,
                        deadline=started + budget, formats=args.formats or (), per_layer=bool(args.per_layer),
                        fsdp=bool(args.fsdp))
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
    from multihead.apps import pruning

    _print_report(report, out)
    search = report.get("target")
    if search is not None and not search["met"]:
        print(f"multihead prune: {pruning.not_met(search)}", file=sys.stderr)
        return 1
    return 0


#: the time budget when none is given: grown to the plan's cost when a default run needs more
DEFAULT_BUDGET_S = 270.0


def _goal(args):
    """The ``--target-*`` option given, as a :class:`multihead.apps.target.Goal` (None without one)."""
    from multihead.apps.target import Goal

    for kind in ("cosine", "kl", "accuracy"):
        value = getattr(args, f"target_{kind}", None)
        if value is not None:
            return Goal(kind, value)
    return None


def _within_budget(setup, options, budget: float | None, started: float):
    """``options`` with the command's deadline and the plan's estimate of one candidate: the run is costed first
    (:func:`multihead.apps.pruning.plan`, printed as one line); a ``budget`` (seconds from ``started``) that cannot
    hold the least run is refused (ValueError, one line); without one the default grows to the whole plan."""
    import dataclasses

    from multihead.apps import pruning

    p = pruning.plan(setup, options)
    spent = time.monotonic() - started
    if budget is None:
        budget = max(DEFAULT_BUDGET_S, spent + p.total)
        print(f"plan: {p}; time budget {pruning.seconds_text(budget)} (the default, grown to the plan where it needs more; "
              "--time-budget sets another)")
    else:
        if spent + p.least > budget:
            raise ValueError(f"--time-budget {pruning.seconds_text(budget)} cannot hold one candidate: {p} (loading took "
                             f"{pruning.seconds_text(spent)}); give --time-budget {pruning.seconds_text(spent + p.least)} or "
                             f"more ({pruning.seconds_text(spent + p.total)} for the whole plan), or fewer --recover steps")
        print(f"plan: {p}; time budget {pruning.seconds_text(budget)}" + (
            "" if spent + p.total <= budget else
            f" (the whole plan needs {pruning.seconds_text(spent + p.total)}: the search may end before it is settled)"))
    return dataclasses.replace(options, deadline=started + budget, candidate_s=p.candidate_s)


def _print_report(report: dict, out: Path) -> None:
    """What ``multihead prune`` prints at the end: the kept model, the speed table, the runtime files and table."""
    from multihead.apps import pruning

    lines = [*pruning.summary(report), pruning.speed_table(report["speed"], report.get("bound")),
             *pruning.runtime_section(report.get("runtimes"))[2:],  # the files and the runtime table
             *[f"note: {note}" for note in report["timing_notes"]],
             f"report: {out / 'report.md'}; pruned model: {out / 'model'}"]
    print("\n".join(lines))


def _check(args) -> int:
    """multihead check FILE.py:NAME | FILE.ipynb:NAME | DIR | GLOB ...: grade one module (its whole report) or a class's
    submissions (a table; --report CSV/JSON), each in its own sandboxed process. Exit 0 OK, 1 not OK,
    2 cannot be graded."""
    from multihead.grader import classroom
    from multihead.grader.runner import Limits, parse_size
    from multihead.grader.subject import forbidden

    if args.merge:
        return _merge(args)
    if args.platform or args.write or args.grade or args.passed:
        return _platform(args)
    mask = None if args.mask == "none" else args.mask
    part = classroom.parse_shard(args.shard) if args.shard else None
    if part is not None and args.seed is None:
        raise ValueError("--shard needs --seed S: every slice of the class must be graded on the same probes")
    files = classroom.targets(args.target, args.name)
    if not files:
        print(f"multihead check: nothing matches {' '.join(args.target) or '(no target)'} (give FILE.py:NAME, a "
              "folder holding .py or .ipynb files, or a glob of them; or --merge REPORT...)", file=sys.stderr)
        return 2
    # the whole class's feedback names (a slice's among them), and each file's name in the class
    names, (in_class, class_id) = classroom.feedback_names([f for f, _ in files]), classroom.names_in_class(files)
    args.roster_rows = _roster(args, files)  # checked against the whole class, before any grading
    similar = _similar(args, files, part)  # the whole class's text compared (its starter checked), before any grading
    if part is not None:
        files = classroom.shard(files, *part)
    if _not_honoured(args, mask):
        return 2
    memory = parse_size(args.memory)  # a ValueError is one line and exit 2 (main)
    scheme = classroom.load_points(args.points) if args.points else None
    opts = dict(init=args.init, call=args.call, mask=mask, causal=args.causal, embed_dim=args.embed_dim,
                strict=args.strict, seed=args.seed, scale=args.scale,
                forbid=forbidden((args.forbid or "").split(",")))  # a name torch lacks: one line, exit 2 (main)
    one = args.target[0] if args.target else ""
    if part is None and len(args.target) == 1 and (one.rpartition(":")[0].endswith(classroom.SOURCES)
                                                   or Path(one).is_file()):
        path, name = files[0]
        limits = Limits(wall=args.timeout, cpu=int(max(args.timeout * 2, 10)), memory=memory)
        row, report = classroom.grade_file(path, name, limits=limits, scheme=scheme, **opts)
        if report is not None:
            print(report)
        if row["status"] in ("error", "timeout"):
            print(f"multihead check: {row['finding']}", file=sys.stderr)
            return 2
        if args.feedback:
            classroom.write_feedback(row, report, Path(args.feedback))
        rows = [row]
    else:
        if any(n is None for _, n in files):
            print("multihead check: grading a folder or a glob needs --name NAME (the class each file defines)",
                  file=sys.stderr)
            return 2
        rows = classroom.grade_many(files, timeout=args.timeout, memory=memory, jobs=args.jobs, points=scheme,
                                    feedback=args.feedback, names=names, **opts) if files else []
        for r in rows:
            r["shard"] = args.shard.replace(" ", "") if part is not None else ""
            r["name"], r["class"] = in_class[r["file"]], class_id  # which file of which class, wherever it is mounted
        _class_table(rows)
    return _written(args, rows, similar)


#: ``multihead check``'s options an assignment is graded with, as a platform's package passes them on
ASSIGNMENT = ("name", "init", "call", "mask", "causal", "embed_dim", "scale", "strict", "forbid", "timeout", "memory",
              "seed")


def _platform(args) -> int:
    """multihead check --platform P --write PATH | --grade [--root DIR] | --passed CHECK: the assignment's package
    for a course platform, or its grading there (:mod:`multihead.grader.platforms`): the same grading as a folder's."""
    from multihead.grader import classroom, platforms
    from multihead.grader.runner import parse_size
    from multihead.grader.subject import forbidden

    if not args.platform:
        raise ValueError("--write, --grade and --passed are for a course platform: add --platform gradescope, "
                         "prairielearn or classroom")
    if args.passed:  # with --platform classroom, answered by multihead_cli (no torch)
        raise ValueError("--passed is GitHub Classroom's per-check step: use it with --platform classroom")
    if bool(args.write) == bool(args.grade) or args.target or args.shard or args.merge or args.similarity:
        raise ValueError(f"--platform {args.platform} takes --write PATH (the assignment's package) or --grade (on the "
                         "platform), one of them, and no files to grade, --shard, --merge or --similarity")
    if _not_honoured(args, None if args.mask == "none" else args.mask):
        return 2
    forbid = forbidden((args.forbid or "").split(","))  # a name torch lacks: one line, exit 2 (main)
    memory = parse_size(args.memory)
    if args.write:
        options = {f"--{k.replace('_', '-')}": getattr(args, k) for k in ASSIGNMENT}
        options["--memory"] = None if args.memory == "4G" else args.memory
        options["--timeout"] = None if args.timeout == 60.0 else args.timeout
        out = platforms.write(args.platform, Path(args.write), options, points=args.points, starter=args.starter)
        print(f"{args.platform}: {out}")
        return 0
    if not args.name:
        raise ValueError("--name NAME is missing: the class each submission defines (e.g. --name MultiHeadAttention)")
    points = classroom.load_points(args.points) if args.points else None  # a check that does not exist: one line
    row, out = platforms.grade(args.platform, Path(args.root or platforms.ROOTS[args.platform]), args.name,
                               starter=args.starter, timeout=args.timeout, memory=memory, points=points,
                               seed=args.seed, init=args.init, call=args.call,
                               mask=None if args.mask == "none" else args.mask, causal=args.causal,
                               embed_dim=args.embed_dim, strict=args.strict, scale=args.scale, forbid=forbid)
    print(f"{row['status']}: {row['points']:g}/{row['possible']:g} {row['finding']}".rstrip())
    print(f"results: {out}")
    return 0


def _similar(args, files, part):
    """The class's similar submissions (:func:`multihead.grader.similarity.compare`) where --similarity asks, found
    before any grading: a starter missing or not parsing, a slice of the class or one file is a ValueError (one line,
    exit 2)."""
    if not args.similarity:
        if args.starter or args.similar_above is not None:
            raise ValueError("--starter and --similar-above are for --similarity: add --similarity (every pair of the "
                             "class's submissions compared, the starter's code left out)")
        return None
    if part is not None:
        raise ValueError("--similarity compares the whole class: give it on one machine without --shard (a slice "
                         "holds only some of the pairs)")
    if len(files) < 2:
        raise ValueError(f"--similarity compares a class: give a folder (or files) of two or more submissions; got "
                         f"{len(files)}")
    from multihead.grader import similarity

    threshold = similarity.THRESHOLD if args.similar_above is None else args.similar_above
    return similarity.compare([f for f, _ in files], starter=args.starter, threshold=threshold)


def _not_honoured(args, mask: str | None) -> bool:
    """Whether the options ask what cannot be done (said in one line on stderr): a mask the call cannot pass, an
    --init that is not keyword literals."""
    from multihead.grader import classroom

    if args.call in ("x", "qkv") and mask is not None:
        print(f"multihead check: --call {args.call} with --mask {mask} cannot be honoured: the call passes no mask to "
              f"the module; use --call {args.call}_mask, or --mask none", file=sys.stderr)
        return True
    try:
        classroom.kwargs_of(args.init)
    except (SyntaxError, ValueError) as e:
        print(f"multihead check: --init {args.init!r}: {e}", file=sys.stderr)
        return True
    return False


def _roster(args, files) -> dict | None:
    """The roster a gradebook report needs, read and checked against the class before any grading (a ValueError:
    one line, exit 2); None for another report."""
    from multihead.grader import classroom

    kind = classroom.gradebook(args.report)
    if kind is None:
        if args.roster:
            raise ValueError("--roster is for a gradebook report: give --report FILE.canvas.csv or FILE.moodle.csv")
        return None
    if not args.roster:
        raise ValueError(f"--report {args.report} is a gradebook: give --roster FILE (file, and the students' "
                         "columns)")
    return classroom.load_roster(args.roster, files, kind)


def _class_table(rows: list[dict]) -> None:
    from multihead.grader import classroom

    print(classroom.table(rows))
    counts = classroom.summary(rows)
    if counts:
        print("\nmistakes (submissions):\n" + "\n".join(f"  {k:>3}  {name}" for name, k in counts))


def _merge(args) -> int:
    """multihead check --merge REPORT...: the shards' reports joined into the class's table, report and summary."""
    from multihead.grader import classroom

    if args.target or args.shard or args.feedback or args.similarity:
        raise ValueError("--merge joins reports: give no files to grade, no --shard, no --feedback and no "
                         "--similarity with it")
    rows = classroom.merge(args.merge)
    args.roster_rows = _roster(args, [(Path(r["name"]), None) for r in rows])
    _class_table(rows)
    return _written(args, rows)


def _written(args, rows: list[dict], similar=None) -> int:
    """The report and summary the options ask for (``similar``: the class's similar pairs, printed and in the
    summary); the exit code (0 every row OK, 1 not)."""
    from multihead.grader import classroom, similarity

    if similar is not None:
        print("\n" + "\n".join(similarity.lines(similar)))
    if args.report:
        classroom.write_report(rows, Path(args.report), getattr(args, "roster_rows", None))
        print(f"report: {args.report}")
    if args.summary:
        md, png = classroom.write_summary(rows, Path(args.summary), similarity.markdown(similar) if similar else "")
        side = similarity.write_side_by_side(similar, Path(args.summary) / "similarity.md") if similar else None
        print(f"summary: {md}, {png}" + (f", {side} (the matching lines side by side)" if side else ""))
    elif similar is not None and similar.pairs:
        print("the matching lines side by side: add --summary DIR (DIR/similarity.md)")
    if args.feedback:
        print(f"feedback: {args.feedback}")
    return 0 if all(r["ok"] for r in rows) else 1


def _patch(args) -> int:
    """multihead patch --hf DIR --clean TEXT --corrupted TEXT --metric SPEC: activation patching of every head."""
    from multihead.apps import patching

    patching.run(args.hf, args.clean, args.corrupted, args.metric, args.out, positions=args.positions,
                 direction=args.direction, chunk=args.chunk)
    return 0


def _circuit(args) -> int:
    """multihead circuit --hf DIR --clean TEXT --corrupted TEXT --metric SPEC: the circuit, scored, kept and checked."""
    from multihead.apps import circuit

    circuit.run(args.hf, args.clean, args.corrupted, args.metric, args.out, method=args.method, steps=args.steps,
                budget=args.budget, mib=args.mib, pairs=args.pairs, batch_size=args.batch_size)
    return 0


def _bench(args) -> int:
    from multihead.apps import bench

    names = args.workloads  # checked by the parser (multihead_cli)
    peers = [p.strip() for p in args.peers.split(",")] if args.peers else None
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        print(f"multihead bench: --lengths takes comma-separated integers; got {args.lengths!r}", file=sys.stderr)
        return 2
    if args.memory_only:
        bench.remeasure_memory(Path(args.out), peers)
        return 0
    if args.pruned and not Path(args.pruned, "config.json").is_file():
        print(f"multihead bench: --pruned {args.pruned} has no config.json (give a directory written by "
              "multihead prune --hf ..., e.g. OUT/model)", file=sys.stderr)
        return 2
    if "W7" in names:  # a transformers sentence encoder: its own runner and table
        import json

        from multihead.apps import hf_bench

        r = hf_bench.run(args.pruned, max_seconds=args.max_seconds)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "minilm_hf.json").write_text(json.dumps(r, indent=2))
        (out / "minilm_hf.md").write_text(hf_bench.markdown(r))
        print(f"wrote {out / 'minilm_hf.md'}")
        names.remove("W7")
        if not names:
            return 0
    if "W6" in names:  # context parallel: its own processes
        from multihead.apps import cp_bench

        cp_bench.run(ranks=args.ranks, length=args.cp_length, reps=args.cp_reps,
                     out=Path(args.out) / "context_parallel")
        names.remove("W6")
        if not names:
            return 0
    bench.run(names, reps=args.reps, out=Path(args.out), memory=not args.no_memory, peers=peers, lengths=lengths,
              compile=args.compile, decode_steps=args.decode_steps,
              decode_batches=tuple(int(b) for b in args.decode_batches.split(",")), cpp_wrapper=args.cpp_wrapper,
              decode_rounds=args.decode_rounds, decode_recompute=not args.decode_no_recompute)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``multihead`` command (arguments parsed by :mod:`multihead_cli`, which needs no torch)."""
    from multihead_cli import main as run

    return run(argv)

if __name__ == "__main__":
    sys.exit(main())
