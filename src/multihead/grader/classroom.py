"""Grading learners' files: each in its own sandbox (:class:`~multihead.grader.runner.SandboxSubject`),
the verdict computed here; a row per file (``ok``, ``not ok``, ``error``, ``timeout``), points under a
scheme, a markdown feedback file per submission, a class summary (each mistake, how many made it,
most common first, as a table and a bar chart), and the table as CSV (safe to open in a spreadsheet)
or JSON. A class the size of a course online is graded in slices (:func:`shard`, one per machine) whose reports
:func:`merge` joins; each row says the seed its probes were drawn from and the points table it was scored on.
"""

from __future__ import annotations

import ast
import csv
import glob
import hashlib
import json
import os
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from multihead.grader.report import Report, points_scheme, safe
from multihead.grader.report import possible as report_points_possible
from multihead.grader.runner import Limits, SandboxError, SandboxSubject
from multihead.grader.subject import HOW, SELF_CALLS, forbidden
from multihead.grader.verdict import GradingOptions, grade_subject

__all__ = ["FIELDS", "GRADEBOOKS", "feedback_names", "grade_file", "grade_many", "gradebook", "kwargs_of",
           "load_points", "load_roster", "merge", "names_in_class", "out_of", "parse_shard", "read_report",
           "readable_by_its_user", "refused", "shard",
           "summary", "table", "targets", "write_feedback", "write_gradebook", "write_report", "write_summary"]

FIELDS = ("file", "ok", "status", "points", "possible", "failed", "mistakes", "finding", "seconds", "seed", "scheme",
          "shard", "name", "class", "layers")


def kwargs_of(text: str | None) -> dict:
    """'d_model=32, num_heads=4' -> {'d_model': 32, 'num_heads': 4} (literals only)."""
    if not text:
        return {}
    call = ast.parse(f"f({text})", mode="eval").body
    if call.args:
        raise ValueError("--init takes keyword arguments only, e.g. --init 'd_model=32, num_heads=4'")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def targets(items: list[str], name: str | None) -> list[tuple[Path, str | None]]:
    """(file, class name) for FILE.py:NAME (or a notebook, FILE.ipynb:NAME), FILE.py, a folder (its .py and .ipynb
    files, recursively; notebooks' checkpoint copies left out) or a glob."""
    out = []
    for item in items:
        path, _, nm = item.rpartition(":")
        if path.endswith(SOURCES) and nm.isidentifier():  # FILE.py:NAME (a missing file is reported when graded)
            out.append((Path(path), nm))
            continue
        p = Path(item)
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in SOURCES) if p.is_dir() else \
            sorted(Path(f) for f in glob.glob(item, recursive=True))
        # what is named as a submission but is no regular file (a folder named *.py, a device, a link) is kept: its
        # row says why it is refused (grade_file), where leaving it out would say nothing
        out += [(f, name) for f in files if (f.is_file() or f.is_symlink() or f.exists()) and f.suffix in SOURCES
                and ".ipynb_checkpoints" not in f.parts]
    return out


def refused(path: Path, folder: Path | None = None) -> str:
    """Why ``path`` is not graded, or '': a submission must be a regular file (not a folder, a device, a pipe) and,
    with ``folder`` (the class's), inside it once every link is followed -- a link out of the folder is refused,
    never read (the row would name the file it points to, and its grade would be another file's). The reason names
    the submission, never where a link points."""
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return f"{safe(path)} does not exist"
    if stat.S_ISLNK(st.st_mode):
        real = Path(os.path.realpath(path))
        inside = folder is None or real.is_relative_to(os.path.realpath(folder))
        if not inside:
            return (f"refused: {safe(path)} is a symbolic link to a file outside the class folder; a submission must "
                    "be a regular file inside it")
        try:
            st = os.stat(path)
        except OSError:
            return f"refused: {safe(path)} is a symbolic link to nothing"
    kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or
            stat.S_ISBLK(st.st_mode) else "a pipe" if stat.S_ISFIFO(st.st_mode) else "a socket"
            if stat.S_ISSOCK(st.st_mode) else "")
    if kind:
        return f"refused: {safe(path)} is {kind}, not a regular file; a submission must be a regular file"
    return ""


#: what a submission may be: a Python file, or a notebook (its definitions: :mod:`multihead.grader.notebook`)
SOURCES = (".py", ".ipynb")


def load_points(path: str | Path) -> dict[str, float]:
    """A points scheme from a JSON file {"check name": points, ...} (the others keep their defaults)."""
    p = Path(path)
    try:
        given = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--points {p} does not exist.") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--points {p} is not JSON ({e}); write {{\"check name\": points, ...}}.") from None
    if not isinstance(given, dict):
        raise ValueError(f"--points {p} must hold an object {{\"check name\": points, ...}}.")
    try:
        return points_scheme(given)
    except ValueError as e:  # the file named: the fix is in it
        raise ValueError(f"--points {p}: {str(e).removeprefix('points: ')}") from None


def scheme_id(scheme: dict | None) -> str:
    """A points table's fingerprint (the default's when None): two reports scored alike share it."""
    return hashlib.sha256(json.dumps(points_scheme(scheme), sort_keys=True).encode()).hexdigest()[:12]


def _row(path: Path, status: str, report: Report | None = None, finding: str = "", seconds: float = 0.0,
         scheme: dict | None = None, *, seed: int | None = None, checks: tuple[str, ...] = ()) -> dict:
    """One submission's row: its points out of the assignment's (``checks``,
    :func:`~multihead.grader.report.assignment`), the one denominator every row of the class shares, graded or not."""
    if report is None:
        earned, possible, failed, mistakes = 0.0, report_points_possible(scheme, checks), "", ""
    else:
        earned, possible = report.points(scheme)
        failed = "; ".join(c.name for c in report.failures + (report.warnings if report.strict else []))
        mistakes = "; ".join(f.name for f in report.diagnosis)
        finding = finding or report.summary()
    return {"file": str(path), "ok": status == "ok", "status": status, "points": round(earned, 2),
            "possible": round(possible, 2), "failed": failed, "mistakes": mistakes, "finding": finding,
            "seconds": round(seconds, 2), "seed": seed, "scheme": scheme_id(scheme), "shard": "", "name": Path(path).name,
            "class": "", "layers": ""}


def grade_file(path: Path, name: str | None, *, init: str | None = None, call: str = "qkv", mask: str | None = None,
               causal: bool = False, embed_dim: int | None = None, strict: bool = False, limits: Limits | None = None,
               seed: int | None = None, scheme: dict | None = None,
               scale: float | None = None, folder: Path | None = None,
               forbid: tuple = ()) -> tuple[dict, Report | None]:
    """Grade ``NAME(**init)`` from ``path`` in a sandbox: (its row, its report or None when it could not
    be graded -- status error or timeout, the reason in ``finding``). ``scale``: the score scale the course
    uses (default 1/sqrt(one head's size)); ``folder``: the class's folder, which the file must be inside
    (:func:`refused`); ``forbid``: torch functions and modules the course forbids
    (:func:`~multihead.grader.subject.forbidden`), refused when the module's forward uses one. A ValueError where a
    submission's user of its own could not read the Python this grader runs (:func:`readable_by_its_user`)."""
    t0 = time.perf_counter()
    readable_by_its_user()  # a ValueError where a submission's user of its own could not read this Python
    seed = secrets.randbits(31) if seed is None else seed  # the probes are drawn per run, never known in advance
    opts = GradingOptions(mask, causal, call in SELF_CALLS, embed_dim, None if scale is None else {"scale": float(scale)},
                   seed, strict, HOW[call], call, forbid=forbidden(forbid))
    kw = dict(scheme=scheme, seed=seed, checks=opts.checks)  # every row out of the assignment's points
    why = refused(Path(path), folder)
    if why:
        return _row(path, "error", finding=why, **kw), None
    if not name:
        return _row(path, "error", finding="no class name: give FILE.py:NAME or --name NAME", **kw), None
    try:
        with SandboxSubject(path, name, init=kwargs_of(init), call=call, seed=seed, limits=limits or Limits()) as subject:
            layers = "; ".join(subject.layers)  # what confined the submission's process (the row says it)
            report = grade_subject(subject, opts)
    except SandboxError as e:
        return _row(path, e.status, finding=e.finding, seconds=time.perf_counter() - t0, **kw), None
    except (TypeError, ValueError) as e:
        return _row(path, "error", finding=str(e), seconds=time.perf_counter() - t0, **kw), None
    first = report.checks[0] if report.checks else None
    if first is not None and first.name == "runs on probe inputs" and first.passed is False:
        row = _row(path, "error", report, f"the call raised: {first.detail}", time.perf_counter() - t0, **kw)
    else:
        row = _row(path, "ok" if report.ok else "not ok", report, seconds=time.perf_counter() - t0, **kw)
    return row | {"layers": layers}, report


def readable_by_its_user() -> bool:
    """Whether each submission runs as a user of its own here (the grader root, user namespaces refused:
    :func:`~multihead.grader.confine.confine`); where it does and that user cannot read the Python this grader runs
    (:func:`~multihead.grader.confine.unreadable`: a virtual environment under /root), a ValueError naming the path
    and the fix, before any grading."""
    from multihead.grader import confine

    if os.geteuid() != 0 or not any(g.startswith("the network") for g in confine.unconfined()):
        return False
    unread = confine.unreadable()
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise ValueError(f"each submission runs as a user of its own here (root without user namespaces), and that "
                         f"user cannot read the Python this grader runs: {unread[0]}{more}; install it where every "
                         "user can read it, e.g. python3 -m venv /opt/multihead && chmod -R a+rX /opt/multihead, from "
                         "a Python outside /root (the system's python3)")
    return True


def grade_many(files: list[tuple[Path, str | None]], *, timeout: float = 60.0, memory: int = 4 << 30,
               jobs: int | None = None, points: dict | None = None, feedback: str | Path | None = None,
               seed: int | None = None, names: dict[Path, Path] | None = None, reports: dict | None = None,
               **opts) -> list[dict]:
    """Each file graded in its own sandbox, ``jobs`` at a time (default: $MULTIHEAD_GRADER_JOBS, else the cores,
    at most 4); rows in the order of ``files``. ``feedback``:
    a folder that gets one markdown file per submission; ``points``: a scheme (see :func:`load_points`);
    ``reports``: a dict that gets {file: its Report, or None} (a platform's per-check points,
    :mod:`multihead.grader.platforms`).
    Warns (RuntimeWarning), in one line, where this machine cannot confine a sandbox (:mod:`multihead.grader.confine`:
    files, network, sockets, other processes) and says what is not confined. A ValueError, before any grading,
    where each submission would run as a user of its own that cannot read the Python this grader runs
    (:func:`readable_by_its_user`)."""
    import warnings

    from multihead.grader import confine

    opts["forbid"] = forbidden(opts.get("forbid") or ())  # a name torch does not have: refused before any grading
    own_user = readable_by_its_user()
    gaps = confine.unconfined()
    if gaps:
        user = (" Where user namespaces are refused (a Docker container's default) and the grader is root, each "
                "submission runs as a user of its own." if own_user else "")
        warnings.warn(f"this machine cannot confine a submission's process from: {'; '.join(gaps)}. Grade on Linux "
                      f"5.13 or later (Landlock; network namespaces; seccomp) to confine it.{user}", RuntimeWarning,
                      stacklevel=2)
    scheme = points_scheme(points)
    limits = Limits(wall=timeout, cpu=int(max(timeout * 2, 10)), memory=memory)

    names = names or feedback_names([p for p, _ in files])  # given: the whole class's, for a slice of it

    folder = _common_folder([p for p, _ in files]) if files else None  # a submission must be inside it

    def one(item):
        path, name = item
        row, report = grade_file(path, name, limits=limits, seed=seed, scheme=scheme, folder=folder, **opts)
        if reports is not None:
            reports[path] = report
        if feedback is not None:
            write_feedback(row, report, Path(feedback), names[path])
        return row

    jobs = jobs or int(os.environ.get("MULTIHEAD_GRADER_JOBS", 0)) or max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, files))


def out_of(rows: list[dict]) -> float | None:
    """The points the class's assignment is out of: the one denominator its rows share (None for no rows). A
    ValueError where rows of one table were scored out of different totals (reports of different assignments)."""
    totals = sorted({float(r["possible"]) for r in rows})
    if len(totals) > 1:
        raise ValueError(f"the rows are out of different totals ({', '.join(f'{t:g}' for t in totals)}): they were "
                         "graded as different assignments (--mask, --causal, --call, --forbid or --points); grade "
                         "the class with one set of options.")
    return totals[0] if totals else None


def table(rows: list[dict]) -> str:
    """The class table, each file named by its path under the submissions' common folder (``alice/mha.py``: the
    bare name told two learners' ``mha.py`` apart by nothing)."""
    shown = [safe(n, 300) for n in _under_common_folder([Path(r["file"]) for r in rows])]
    w = max([len(n) for n in shown] + [4])
    lines = [f"{'file':<{w}}  {'status':<7}  {'points':>9}  finding", "-" * (w + 50)]
    for r, name in zip(rows, shown, strict=True):
        pts = f"{r['points']:g}/{r['possible']:g}"
        lines.append(f"{name:<{w}}  {r['status']:<7}  {pts:>9}  {safe(r['finding'] or r['failed'])}")
    n_ok = sum(r["ok"] for r in rows)
    total = out_of(rows)
    lines.append(f"\n{n_ok} of {len(rows)} OK" + ("" if total is None else f"; points out of {total:g}"))
    return "\n".join(lines)


def _safe(value):
    """A spreadsheet cell that cannot run as a formula (text starting with = + - @ gets a leading apostrophe) and
    holds no control character (:func:`~multihead.grader.report.safe`)."""
    if isinstance(value, str):
        value = safe(value)
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


#: the gradebook files an LMS imports, by how the report's name ends: the roster's columns each needs (one of)
GRADEBOOKS = {".canvas.csv": ("Student", "ID"), ".moodle.csv": ("Email address", "Username", "ID number")}
#: the gradebook's column of points (Canvas creates an assignment of this name; Moodle maps it on import)
ASSIGNMENT = "Multi-head attention"


def gradebook(path: str | Path | None) -> str | None:
    """".canvas.csv" or ".moodle.csv" where the report ``path`` is one of those gradebooks, else None."""
    name = str(path or "").lower()
    return next((k for k in GRADEBOOKS if name.endswith(k)), None)


def load_roster(path: str | Path, files: list[tuple[Path, str | None]], kind: str) -> dict[str, dict]:
    """The roster (a CSV: a ``file`` column -- each submission's path under the class folder, as the class table
    names it -- and the students' columns the ``kind`` of gradebook needs, :data:`GRADEBOOKS`): {file: its row}. A
    ValueError naming what is wrong -- no such file, a column missing, a submission without a row -- before any
    grading."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--roster {p} does not exist.")
    with p.open(newline="") as f:
        rows = list(csv.DictReader(f))
    cols = list(rows[0]) if rows else []
    need = GRADEBOOKS[kind]
    if "file" not in cols or (kind == ".canvas.csv" and not all(c in cols for c in need)) or \
            (kind == ".moodle.csv" and not any(c in cols for c in need)):
        what = " and ".join(need) if kind == ".canvas.csv" else "one of " + ", ".join(need)
        raise ValueError(f"--roster {p} must have the columns file and {what} for a {kind} gradebook; it has "
                         f"{', '.join(cols) or 'none'}.")
    by_file = {r["file"]: r for r in rows}
    names, _ = names_in_class(files)
    missing = [n for n in names.values() if n not in by_file]
    if missing:
        raise ValueError(f"--roster {p} has no row for {missing[0]}" + (f" (and {len(missing) - 1} more submissions)"
                                                                       if len(missing) > 1 else "") +
                         ": add a row whose file column is that path under the class folder.")
    return by_file


def write_gradebook(rows: list[dict], path: Path, roster: dict[str, dict]) -> None:
    """A gradebook an LMS imports, by the name's ending (:func:`gradebook`): Canvas -- Student, ID (and SIS User ID,
    SIS Login ID, Section where the roster has them), then the points in a column :data:`ASSIGNMENT`; Moodle -- the
    roster's identifying columns, the points and the feedback line. One row a submission, its student found in the
    roster by its path under the class folder (``row["name"]``, else its path under the rows' common folder)."""
    kind = gradebook(path)
    shown = _under_common_folder([Path(r["file"]) for r in rows])
    ids = (["Student", "ID", "SIS User ID", "SIS Login ID", "Section"] if kind == ".canvas.csv" else
           list(GRADEBOOKS[kind]))
    first = next(iter(roster.values()), {})
    ids = [c for c in ids if c in first]
    head = ids + [ASSIGNMENT] + (["Feedback"] if kind == ".moodle.csv" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(head)
        if kind == ".canvas.csv":  # Canvas reads the points possible from this row: the assignment's, every row's
            total = out_of(rows)
            wr.writerow(["Points Possible"] + [""] * (len(ids) - 1) + [f"{total:g}" if total is not None else ""])
        for r, name in zip(rows, shown, strict=True):
            student = roster.get(r.get("name") or name) or roster[name]
            cells = [student[c] for c in ids] + [f"{r['points']:g}"]
            if kind == ".moodle.csv":
                cells.append(r["finding"] or r["status"])
            wr.writerow([_safe(c) for c in cells])


def write_report(rows: list[dict], path: Path, roster: dict[str, dict] | None = None) -> None:
    """CSV or JSON by the suffix; both load back (csv.DictReader, json.load) to the same rows (CSV cells
    that would start a formula are prefixed with an apostrophe); a name ending .canvas.csv or .moodle.csv: the
    gradebook that LMS imports (:func:`write_gradebook`, ``roster`` from :func:`load_roster`)."""
    path = Path(path)
    if gradebook(path):
        if roster is None:
            raise ValueError(f"--report {path} is a gradebook: give --roster FILE (file, and the students' columns).")
        write_gradebook(rows, path, roster)
        return
    if path.suffix.lower() not in (".json", ".csv"):
        raise ValueError(f"--report must end in .csv or .json (or .canvas.csv, .moodle.csv); got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(rows, indent=1))
        return
    with path.open("w", newline="") as f:
        wr = csv.DictWriter(f, FIELDS)
        wr.writeheader()
        wr.writerows({k: _safe(v) for k, v in r.items()} for r in rows)


def parse_shard(text: str) -> tuple[int, int]:
    """'2/3' -> (2, 3): slice K of N, 1 <= K <= N; a ValueError naming the text otherwise."""
    k, sep, n = str(text).partition("/")
    if not (sep and k.strip().isdigit() and n.strip().isdigit()):
        raise ValueError(f"--shard takes K/N, slice K of N (e.g. 2/3); got {text!r}.")
    k, n = int(k), int(n)
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text}: K must be between 1 and N ({n}); the slices of {n} are 1/{n} .. {n}/{n}.")
    return k, n


def names_in_class(files: list[tuple[Path, str | None]]) -> tuple[dict[str, str], str]:
    """({file: its path under the class's common folder}, the class's identity: how many files and a fingerprint of
    their names) -- the same on every machine that holds the class, wherever it is mounted."""
    names = dict(zip((str(f) for f, _ in files), _under_common_folder([f for f, _ in files]), strict=True))
    digest = hashlib.sha256("\n".join(sorted(names.values(), key=_parts)).encode()).hexdigest()[:12]
    return names, f"{len(names)}:{digest}"


def _parts(name: str) -> tuple[str, ...]:
    return PurePosixPath(name).parts  # the order targets() gives a folder's files (path by path, not text)


def shard(files: list[tuple[Path, str | None]], k: int, n: int) -> list[tuple[Path, str | None]]:
    """Slice ``k`` of ``n`` (1-based) of a class: the files in the order of their path under the class's common
    folder (the same on every machine that holds the class, wherever it is mounted), every n-th from the k-th. The
    n slices are disjoint and together the class."""
    names, _ = names_in_class(files)
    order = sorted(range(len(files)), key=lambda i: _parts(names[str(files[i][0])]))
    return [files[i] for j, i in enumerate(order) if j % n == k - 1]


_NUMBERS = {"points": float, "possible": float, "seconds": float}


def read_report(path: str | Path) -> list[dict]:
    """The rows of a report written by :func:`write_report` (CSV or JSON), typed as written; a ValueError naming
    the file where it is not one."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--merge {p}: no such report.")
    try:
        if p.suffix.lower() == ".json":
            rows = json.loads(p.read_text())
        else:
            with p.open(newline="") as f:
                rows = list(csv.DictReader(f))
        missing = [k for k in FIELDS if not rows or any(k not in r for r in rows)]
        if not isinstance(rows, list) or (rows and missing):
            raise ValueError(f"it lacks the columns {', '.join(missing)}")
        for r in rows:
            for k, cast in _NUMBERS.items():
                r[k] = cast(r[k])
            r["ok"] = r["ok"] in (True, "True", "true", "1")
            r["seed"] = None if r["seed"] in (None, "") else int(r["seed"])
            for k in ("failed", "mistakes", "finding"):  # a spreadsheet-safe cell back to its text
                if isinstance(r[k], str) and r[k][:2] in ("'=", "'+", "'-", "'@", "'\t", "'\r"):
                    r[k] = r[k][1:]
    except (ValueError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"--merge {p} is not a report written by multihead check --report ({e}).") from None
    return rows


def merge(paths: list[str | Path]) -> list[dict]:
    """The rows of a class's shard reports, joined into the one run's table (in the order of the files' paths under
    the class folder). Refused (ValueError, naming what differs) where they were graded on different seeds, points
    tables or classes, where a file is in two of them, or where rows of the class are missing (a slice not given)."""
    reports = [(Path(p), read_report(p)) for p in paths]
    rows = [r for _, rep in reports for r in rep]
    for key, what in (("seed", "seeds (the probes differ: grade every shard with one --seed)"),
                      ("scheme", "points tables (grade every shard with one --points file)")):
        seen: dict = {}
        for p, rep in reports:
            for r in rep:
                seen.setdefault(r[key], p)
        if len(seen) > 1:
            named = ", ".join(f"{v} ({k})" for k, v in seen.items())
            raise ValueError(f"--merge: the reports were graded on different {what}: {named}.")
    classes = {r["class"] for r in rows}
    if len(classes) > 1:
        raise ValueError(f"--merge: the reports are of different classes (files, fingerprint of their names): "
                         f"{', '.join(sorted(classes))}; grade every shard on the same folder.")
    names = [r["name"] for r in rows]
    twice = sorted({f for f in names if names.count(f) > 1})
    if twice:
        raise ValueError(f"--merge: {twice[0]} is in more than one report (give each shard's report once).")
    slices = {r["shard"] for r in rows if r["shard"]}
    if len({x.split("/")[1] for x in slices}) > 1:
        raise ValueError(f"--merge: the reports are slices of different counts: {', '.join(sorted(slices))}.")
    total = int(classes.pop().split(":")[0]) if classes and rows[0]["class"] else len(rows)
    if len(rows) != total:
        raise ValueError(f"--merge: the reports hold {len(rows)} of the class's {total} files: a slice is missing "
                         f"(give every shard's report).")
    return sorted(rows, key=lambda r: _parts(r["name"]))


def _under_common_folder(paths: list[Path]) -> list[str]:
    """Each path relative to the paths' common folder ("alice/mha.py"), as text."""
    if not paths:
        return []
    full = [Path(os.path.abspath(p)) for p in paths]  # links not followed: a link's row names the link
    root = _common_folder(paths)
    return [f.relative_to(root).as_posix() for f in full]


def _common_folder(paths: list[Path]) -> Path:
    """The folder holding every one of ``paths`` (absolute, links not followed): the class's folder."""
    return Path(os.path.commonpath([Path(os.path.abspath(p)).parent for p in paths]))


def feedback_names(paths: list[Path]) -> dict[Path, Path]:
    """Each submission's feedback file, relative to the feedback folder: its path under the submissions' common
    folder, .md for its suffix (``alice/mha.py`` -> ``alice/mha.md``: one folder a learner, each holding ``mha.py``,
    is a class's usual layout), or its whole name + .md where two would be one (``hw.py`` and ``hw.ipynb``). Every
    file wrote ``<stem>.md`` into one folder, so same-named submissions overwrote each other's feedback."""
    rel = [Path(r) for r in _under_common_folder(paths)]
    stems = Counter(r.with_suffix("") for r in rel)
    return {p: r.with_suffix(".md") if stems[r.with_suffix("")] == 1 else r.with_name(r.name + ".md")
            for p, r in zip(paths, rel, strict=True)}


def write_feedback(row: dict, report: Report | None, folder: Path, name: Path | None = None) -> Path:
    """FOLDER/``name`` (default ``<file stem>.md``; :func:`feedback_names` for a class): the learner's feedback
    (findings with stage, expected, found, fix; nothing of the reference solution), or why the file could not be
    graded."""
    out = folder / (name or f"{Path(row['file']).stem}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    title = f"{safe(Path(row['file']).name, 300)}: {row['points']:g} of {row['possible']:g} points"
    if report is None:
        out.write_text(f"# {title}\n\n**Could not be graded** ({row['status']}): {safe(row['finding'])}\n")
    else:
        out.write_text(report.feedback(title))
    return out


def summary(rows: list[dict]) -> list[tuple[str, int]]:
    """(mistake, submissions that made it), most common first: each submission's findings (or failed checks
    when nothing was located, or its status when it could not be graded), counted once per submission."""
    seen: Counter = Counter()
    for r in rows:
        if r["status"] in ("error", "timeout"):
            seen[f"could not be graded ({r['status']})"] += 1
            continue
        names = {n for n in (r.get("mistakes") or "").split("; ") if n}
        if not names and r["status"] == "not ok":
            names = {n for n in r["failed"].split("; ") if n} or {r["finding"]}
        for n in names:
            seen[n] += 1
    return seen.most_common()


def write_summary(rows: list[dict], folder: Path, extra: str = "") -> tuple[Path, Path]:
    """FOLDER/summary.md (a table) and FOLDER/summary.png (a bar chart) of :func:`summary`; ``extra``: a markdown
    section summary.md ends with (the similar submissions: :func:`multihead.grader.similarity.markdown`)."""
    folder.mkdir(parents=True, exist_ok=True)
    counts = summary(rows)
    n = len(rows)
    total = out_of(rows)
    md = [f"# Class summary: {sum(r['ok'] for r in rows)} of {n} OK", ""]
    if total is not None:
        mean = sum(float(r["points"]) for r in rows) / n
        md += [f"Points: {mean:.3g} of {total:g} on average (every submission out of {total:g}).", ""]
    md += ["| mistake | submissions |", "|---|---:|"]
    md += [f"| {safe(name).replace('|', chr(92) + '|')} | {k} |" for name, k in counts] or ["| (none) | 0 |"]
    if extra:
        md += ["", extra]
    (folder / "summary.md").write_text("\n".join(md).rstrip("\n") + "\n")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 0.45 * max(len(counts), 1) + 1.2))
    ax = fig.subplots()
    names = [safe(c[0], 120) for c in counts][::-1]
    ax.barh(range(len(names)), [c[1] for c in counts][::-1], color="#4c72b0")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel(f"submissions (of {n})")
    ax.set_title("mistakes, most common first")
    fig.tight_layout()
    png = folder / "summary.png"
    fig.savefig(png, dpi=100)
    return folder / "summary.md", png
