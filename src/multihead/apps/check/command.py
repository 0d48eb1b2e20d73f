"""``multihead check``: one module graded, a class's submissions graded (sharded, merged, compared), or an
assignment packaged and graded on a course platform; the work is :mod:`multihead.grader`'s."""

from __future__ import annotations

import sys
from pathlib import Path


def check(args) -> int:
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

