"""The platforms courses grade on -- Gradescope, PrairieLearn, GitHub Classroom -- as thin layout adapters around
``multihead check``: the same grading (:func:`~multihead.grader.classroom.grade_many`, each submission in its own
sandboxed process), the same points and the same feedback, read from the platform's folders and written as the
platform's result file.

- :func:`write` makes the platform's package for an assignment (the options ``multihead check`` takes): Gradescope's
  autograder zip (``setup.sh``, ``run_autograder``), PrairieLearn's external-grader question folder (``info.json``,
  ``question.html``, ``tests/run.sh``, a ``Dockerfile`` for its image), GitHub Classroom's workflow
  (``.github/workflows/classroom.yml`` in the template repository).
- :func:`grade` is what those run on the platform: the submission found under the platform's root (Gradescope's
  ``/autograder``, PrairieLearn's ``/grade``, the repository's checkout), graded, the results file written.
- GitHub Classroom's per-check steps read the results file the grading step wrote (``multihead check --platform
  classroom --passed CHECK``, answered by :mod:`multihead_cli` without torch: one step a check, each a second).

The platforms run the grader as root in Docker, whose default seccomp profile refuses user namespaces; the sandbox
then keeps Landlock, its seccomp filter and its resource limits and runs the submission as a user of its own
(:mod:`multihead.grader.confine`); every results file says which layers were active.
"""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
import zipfile
from pathlib import Path

__all__ = ["PLATFORMS", "ROOTS", "grade", "repack", "results", "wheel", "write"]

PLATFORMS = ("gradescope", "prairielearn", "classroom")
#: where each platform lays a submission out (the root of :data:`LAYOUTS`; ``--root`` moves it)
ROOTS = {"gradescope": "/autograder", "prairielearn": "/grade", "classroom": "."}
#: under the root: (the submission's folder, the results file, the package's own files: the points table)
LAYOUTS = {"gradescope": ("submission", "results/results.json", "source"),
           "prairielearn": ("student", "results/results.json", "tests"),
           "classroom": (".", ".multihead/results.json", ".multihead")}
#: the environment variable a platform's script reads its root from (a test lays the platform out in a folder)
ROOT_VARIABLE = "MULTIHEAD_PLATFORM_ROOT"


#: where every package installs torch from: PyTorch's CPU index (a CPU-only torch, a fraction of the default build)
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


# --- the multihead a package installs -----------------------------------------------------------------------------

_WHEEL: list[Path] = []


def wheel() -> Path:
    """A wheel of the multihead running here -- the code that writes the package, which the package then installs
    (never a name looked up on an index): built from its source tree with ``pip wheel --no-deps`` where it runs from
    a checkout (``src/multihead`` beside ``pyproject.toml``), else repacked from its installed files
    (:func:`repack`). Made once per process, in a temporary folder removed at exit."""
    import atexit

    import multihead

    if not _WHEEL:
        here = Path(multihead.__file__).resolve().parent
        tmp = Path(tempfile.mkdtemp(prefix="multihead-wheel-"))
        atexit.register(shutil.rmtree, tmp, True)
        root = here.parents[1]
        if (root / "pyproject.toml").is_file() and here == root / "src" / "multihead":
            _WHEEL.append(_build(root, tmp))
        else:
            _WHEEL.append(repack(_installed(here), tmp))
    return _WHEEL[0]


def _build(root: Path, out: Path) -> Path:
    """``pip wheel --no-deps`` of a copy of the checkout ``root`` (its project files and ``src``: the checkout gets
    no build folder), with this environment's setuptools where it has one (no download)."""
    import importlib.util
    import subprocess
    import sys

    copy = out / "source"
    shutil.copytree(root / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    for f in root.iterdir():
        if f.is_file() and (f.name in ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in")
                            or f.name.startswith(("README", "LICENSE"))):
            shutil.copyfile(f, copy / f.name)
    own = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []  # else pip fetches setuptools
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *own, "-w", str(out), str(copy)]
    run = subprocess.run(argv, capture_output=True, text=True)
    built = sorted(out.glob("multihead-*.whl"))
    if run.returncode or len(built) != 1:
        said = (run.stderr or run.stdout).strip().splitlines()
        raise ValueError(f"could not build a wheel of the multihead in {root} for the package ({' '.join(argv[1:5])}: "
                         f"{said[-1] if said else run.returncode}): install pip and setuptools in this environment, "
                         "or install multihead from a wheel")
    shutil.rmtree(copy)
    return built[0]


def _installed(here: Path):
    """The installed distribution whose files hold the multihead package at ``here``; a ValueError where none does."""
    from importlib.metadata import distributions

    for dist in distributions():
        if (dist.metadata["Name"] or "").lower() == "multihead" and \
                Path(dist.locate_file("multihead/__init__.py")).resolve() == here / "__init__.py" and dist.files:
            return dist
    raise ValueError(f"the multihead running here ({here}) is neither a checkout (src/multihead beside "
                     "pyproject.toml) nor an installed distribution: install it (pip install) to write a package")


def repack(dist, out: Path) -> Path:
    """The wheel an installed distribution ``dist`` (:mod:`importlib.metadata`'s) was installed from, remade from the
    files its RECORD lists (scripts, caches and the installer's own records left out; the entry points make the
    scripts again) with a RECORD of their hashes, written into the folder ``out``."""
    import base64
    import hashlib

    info = next(f.parent for f in dist.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
    tags = [line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag:")]
    path = out / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tags[0]}.whl"
    skip = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    files = sorted((f for f in dist.files if f.parts[0] != ".." and "__pycache__" not in f.parts and f.suffix != ".pyc"
                    and not (f.parent == info and f.name in skip)), key=lambda f: (f.parent == info, f.as_posix()))
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            source = Path(dist.locate_file(f))
            data = source.read_bytes()
            entry = zipfile.ZipInfo.from_file(source, f.as_posix())  # its mode kept (an executable stays one)
            entry.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(entry, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{f.as_posix()},sha256={digest},{len(data)}")
        z.writestr(f"{info.as_posix()}/RECORD", "\n".join([*record, f"{info.as_posix()}/RECORD,,"]) + "\n")
    return path


# --- the package an assignment is graded by ----------------------------------------------------------------------


def write(platform: str, out: Path, options: dict, *, points: str | None = None, starter: str | None = None) -> Path:
    """The platform's package for an assignment graded with ``options`` (``multihead check``'s: {"--name": "MHA",
    "--init": "...", "--causal": True, ...}), the points table ``points`` (a JSON file) and ``starter`` (the file
    the learner is handed and hands back: its name is the file graded). A ValueError, naming the option and the
    fix, before anything is written: no ``--name``, points for a check that does not exist, a workflow without its
    template repository's file."""
    from multihead.grader import classroom

    if not options.get("--name"):
        raise ValueError(f"--platform {platform} --write: --name NAME is missing: the class each submission defines "
                         "(e.g. --name MultiHeadAttention)")
    if points:
        classroom.load_points(points)  # a check that does not exist: the ValueError names it, and the checks
    if starter and not Path(starter).is_file():
        raise ValueError(f"--starter {starter} does not exist: give the file the learners are handed")
    if platform == "classroom" and not starter:
        raise ValueError("--platform classroom --write needs --starter FILE: the template repository's file the "
                         "learner edits (the workflow grades it)")
    argv = _argv(options, points, starter)
    return {"gradescope": _gradescope, "prairielearn": _prairielearn, "classroom": _classroom}[platform](
        Path(out), argv, points=points, starter=starter, options=options)


def _argv(options: dict, points: str | None, starter: str | None) -> list[str]:
    """``multihead check``'s options as the platform's script passes them (the points table from the package's
    own folder, the starter by its name)."""
    out = []
    for flag, value in options.items():
        if value is None or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    if starter:
        out += ["--starter", Path(starter).name]
    return out + (["--points", "points.json"] if points else [])


def _command(platform: str, argv: list[str], root: str = '"$ROOT"', python: str = '"$PYTHON"') -> str:
    """The grading command a platform's script runs (the points file in the package's folder under the root)."""
    words = " ".join(shlex.quote(w) for w in argv)
    words = words.replace("--points points.json", f"--points {root}/{LAYOUTS[platform][2]}/points.json")
    return f"{python} -m multihead_cli check --platform {platform} --grade --root {root} {words}"


#: what installs a CPU torch and multihead on Gradescope's Ubuntu image: torch from PyTorch's CPU index
#: (TORCH_INDEX_URL, TORCH_SPEC: another index or version), multihead from the wheel beside this script -- the
#: multihead that wrote the zip (MULTIHEAD_SPEC: another wheel, version or source), into MULTIHEAD_VENV
SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, on its Ubuntu image: a CPU-only torch from PyTorch's CPU index and multihead
# from the wheel beside this script (the multihead that wrote the zip), in a virtual environment every user can
# read: where user namespaces are refused, each submission runs as a user of its own and imports from it.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
VENV="${{MULTIHEAD_VENV:-/opt/multihead}}"
if ! python3 -c "import ensurepip, venv" 2>/dev/null; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-pip
fi
umask 022
python3 -m venv "$VENV"
"$VENV/bin/pip" install --no-cache-dir --index-url "${{TORCH_INDEX_URL:-{torch_index}}}" "${{TORCH_SPEC:-torch}}"
"$VENV/bin/pip" install --no-cache-dir "${{MULTIHEAD_SPEC:-$HERE/{wheel}}}"
chmod -R a+rX "$VENV"
"$VENV/bin/python" -c "import torch, multihead_cli"
"""

_SCRIPT = """#!/usr/bin/env bash
# {what}: written by `multihead check --platform {platform} --write`; grades the submission under ROOT.
set -u
ROOT="${{{variable}:-{root}}}"
PYTHON="${{MULTIHEAD_PYTHON:-{python}}}"
{command}
"""


def _script(platform: str, argv: list[str], what: str, python: str) -> str:
    return _SCRIPT.format(what=what, platform=platform, variable=ROOT_VARIABLE, root=ROOTS[platform], python=python,
                          command=_command(platform, argv))




def _gradescope(out: Path, argv: list[str], *, points, starter, options) -> Path:
    """Gradescope's autograder zip: setup.sh, run_autograder (executable), points.json."""
    if out.suffix != ".zip":
        raise ValueError(f"--platform gradescope --write {out}: the autograder is a zip file: give OUT.zip")
    whl = wheel()
    out.parent.mkdir(parents=True, exist_ok=True)
    files = {"setup.sh": SETUP.format(torch_index=TORCH_INDEX, wheel=whl.name),
             "run_autograder": _script("gradescope", argv, "Gradescope's autograder",
                                       "${MULTIHEAD_VENV:-/opt/multihead}/bin/python"),
             whl.name: whl.read_bytes()}
    if points:
        files["points.json"] = Path(points).read_text()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100755 if name in ("setup.sh", "run_autograder") else 0o100644) << 16
            z.writestr(info, data)
    return out


#: the image PrairieLearn runs the grader in: its Python grader image with multihead and a CPU torch (built from the
#: question's Dockerfile and pushed under this name, or another given with --image in info.json)
IMAGE = "multihead-grader"
DOCKERFILE = """FROM prairielearn/grader-python
# a CPU-only torch from PyTorch's CPU index, then multihead from the wheel beside this file (the multihead that wrote
# the question; --build-arg MULTIHEAD_SPEC=... installs another)
COPY {wheel} /tmp/
ARG MULTIHEAD_SPEC=/tmp/{wheel}
RUN pip install --no-cache-dir --index-url {torch_index} torch \\
 && pip install --no-cache-dir "$MULTIHEAD_SPEC"
"""


def _prairielearn(out: Path, argv: list[str], *, points, starter, options) -> Path:
    """PrairieLearn's external-grader question folder."""
    name = Path(starter).name if starter else "mha.py"
    wall = float(options.get("--timeout") or 60)
    info = {"uuid": _uuid(argv), "title": f"Multi-head attention: {options['--name']}", "topic": "Attention",
            "type": "v3", "singleVariant": True, "gradingMethod": "External",
            "externalGradingOptions": {"enabled": True, "image": IMAGE, "entrypoint": "/grade/tests/run.sh",
                                       "timeout": int(wall * 2 + 60)}}
    (out / "tests").mkdir(parents=True, exist_ok=True)
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    editor = f'<pl-file-upload file-names="{name}"></pl-file-upload>'
    (out / "question.html").write_text(
        f"<pl-question-panel><p>Write <code>{options['--name']}</code> in <code>{name}</code>.</p>"
        f"</pl-question-panel>\n{editor}\n<pl-submission-panel><pl-external-grader-results>"
        "</pl-external-grader-results><pl-file-preview></pl-file-preview></pl-submission-panel>\n")
    run = out / "tests" / "run.sh"
    run.write_text(_script("prairielearn", argv, "PrairieLearn's external grader", "python3"))
    run.chmod(0o755)
    whl = wheel()
    shutil.copyfile(whl, out / whl.name)
    (out / "Dockerfile").write_text(DOCKERFILE.format(wheel=whl.name, torch_index=TORCH_INDEX))
    if points:
        shutil.copyfile(points, out / "tests" / "points.json")
    if starter:
        (out / "clientFilesQuestion").mkdir(exist_ok=True)
        shutil.copyfile(starter, out / "clientFilesQuestion" / name)
    return out


def _uuid(argv: list[str]) -> str:
    """A new question's uuid (PrairieLearn refuses two questions of one uuid, even of one assignment's options)."""
    import uuid

    return str(uuid.uuid4())


WORKFLOW = "GitHub Classroom Workflow"


def _classroom(out: Path, argv: list[str], *, points, starter, options) -> Path:
    """The template repository's workflow: one step grades (the results in .multihead/results.json), then one
    command-grader step per check worth points (its max-score those points, passed when the check earned them), and
    the reporter adds them up."""
    from multihead.grader import classroom

    scheme = classroom.load_points(points) if points else None
    checks = [(c, p) for c, p in _checks(options, scheme) if p > 0]
    wall = float(options.get("--timeout") or 60)
    grade = _command("classroom", argv, root=".", python="python")
    whl = wheel()
    (out / ".multihead").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(whl, out / ".multihead" / whl.name)
    steps = [{"uses": "actions/checkout@v4"}, {"uses": "actions/setup-python@v5", "with": {"python-version": "3.11"}},
             {"name": "Install multihead", "run": f"python -m pip install --index-url {TORCH_INDEX} torch && python -m "
              f'pip install "${{MULTIHEAD_SPEC:-.multihead/{whl.name}}}"'},
             {"name": "Grade", "run": grade}]
    ids = []
    for i, (check, pts) in enumerate(checks, 1):
        ids.append(f"check-{i}")
        steps.append({"name": check, "id": ids[-1], "uses": "classroom-resources/autograding-command-grader@v1",
                      "with": {"test-name": check, "command": "python -m multihead_cli check --platform classroom "
                               f"--passed {shlex.quote(check)}", "timeout": max(1, int(wall // 60) + 1),
                               "max-score": _number(pts)}})
    steps.append({"name": "Autograding Reporter", "uses": "classroom-resources/autograding-grading-reporter@v1",
                  "env": {f"{i.upper().replace('-', '_')}_RESULTS": "${{ steps." + i + ".outputs.result }}"
                          for i in ids},
                  "with": {"runners": ",".join(ids)}})
    flow = {"name": WORKFLOW, "on": ["push", "workflow_dispatch"],
            "permissions": {"checks": "write", "actions": "read", "contents": "read"},
            "jobs": {"run-autograding-tests": {"runs-on": "ubuntu-latest",
                                               "if": "github.actor != 'github-classroom[bot]'", "steps": steps}}}
    (out / ".github" / "workflows").mkdir(parents=True, exist_ok=True)
    # JSON is YAML: the workflow is written by the one library every Python has, and reads back the same
    (out / ".github" / "workflows" / "classroom.yml").write_text(json.dumps(flow, indent=2) + "\n")
    if points:
        shutil.copyfile(points, out / ".multihead" / "points.json")
    if not (out / Path(starter).name).exists():
        shutil.copyfile(starter, out / Path(starter).name)
    return out


def _number(x: float):
    return int(x) if float(x).is_integer() else float(x)


def _checks(options: dict, scheme: dict | None) -> list[tuple[str, float]]:
    """(check, its points) for every check the assignment of ``options`` (``multihead check``'s flags) makes."""
    mask = options.get("--mask")
    return _assignment(options.get("--call") or "qkv", None if mask == "none" else mask,
                       bool(options.get("--causal")), bool(options.get("--forbid")), scheme)


def _assignment(call: str, mask: str | None, causal: bool, forbid: bool, scheme: dict | None):
    """(check, its points) for every check an assignment makes (:func:`~multihead.grader.report.assignment`)."""
    from multihead.grader.report import POINTS, assignment
    from multihead.grader.subject import SELF_CALLS

    names = assignment(masked=mask is not None, causal=causal, self_attn=call in SELF_CALLS, forbid=forbid)
    scheme = POINTS if scheme is None else scheme
    return [(n, scheme.get(n, 0.0)) for n in names]


# --- grading on the platform --------------------------------------------------------------------------------------


def grade(platform: str, root: Path, name: str, *, starter: str | None = None, timeout: float = 60.0,
          memory: int = 4 << 30, points: dict | None = None, seed: int | None = None, **opts) -> tuple[dict, Path]:
    """Grade the submission the platform laid out under ``root`` (:data:`LAYOUTS`) as ``multihead check`` grades a
    class (:func:`~multihead.grader.classroom.grade_many`, ``opts`` its options), and write the platform's results
    file: (the class table's row, the results file). The submission is the file named like ``starter``, or the one
    .py or .ipynb file in the submission's folder. A ValueError where the layout has no submission folder."""
    from multihead.grader import classroom

    folder = Path(root) / LAYOUTS[platform][0]
    if not folder.is_dir():
        raise ValueError(f"--platform {platform} --grade: {folder} does not exist: {platform} lays the submission out "
                         f"in {ROOTS[platform]}/{LAYOUTS[platform][0]}; give --root DIR where it is elsewhere")
    out = Path(root) / LAYOUTS[platform][1]
    out.unlink(missing_ok=True)  # a results file the learner put there is never read as theirs
    out.parent.mkdir(parents=True, exist_ok=True)
    file, why = _submission(folder, starter, platform)
    scheme = classroom.points_scheme(points)
    checks = _assignment(opts.get("call") or "qkv", opts.get("mask"), bool(opts.get("causal")),
                         bool(opts.get("forbid")), scheme)
    if file is None:
        row = {"status": "error", "ok": False, "points": 0.0, "possible": sum(p for _, p in checks), "finding": why,
               "layers": "", "seed": seed, "gradable": False}
        out.write_text(json.dumps(results(platform, row, None, "", checks), indent=1) + "\n")
        return row, out
    reports: dict = {}
    with tempfile.TemporaryDirectory(prefix="multihead-platform-") as fb:
        [row] = classroom.grade_many([(file, name)], timeout=timeout, memory=memory, jobs=1, points=points,
                                     feedback=fb, seed=seed, reports=reports, **opts)
        feedback = next(Path(fb).rglob("*.md")).read_text()
    out.write_text(json.dumps(results(platform, row, reports[file], feedback, checks, scheme), indent=1) + "\n")
    return row, out


def _submission(folder: Path, starter: str | None, platform: str) -> tuple[Path | None, str]:
    """The file to grade in ``folder`` (named like ``starter``; else its one .py or .ipynb file), or (None, why)."""
    from multihead.grader import classroom

    if starter:
        f = folder / Path(starter).name
        return (f, "") if f.exists() or f.is_symlink() else (None, f"no {Path(starter).name} in the submission: "
                                                                    f"hand in the file {Path(starter).name}")
    if platform == "classroom":
        raise ValueError("--platform classroom --grade needs --starter FILE: the template repository's file")
    found = [f for f, _ in classroom.targets([str(folder)], None)]
    if len(found) == 1:
        return found[0], ""
    what = ", ".join(f.name for f in found[:5]) or "no .py or .ipynb file"
    return None, f"the submission holds {what}: hand in one .py or .ipynb file"


def results(platform: str, row: dict, report, feedback: str, checks: list[tuple[str, float]],
            scheme: dict | None = None) -> dict:
    """The platform's results for one graded ``row`` (its ``report`` or None, its ``feedback`` markdown), one test a
    check of the assignment (``checks``: (name, points)) with its points, its figure and what was found there."""
    from multihead.grader.report import safe

    if report is not None:
        tests = [(n, got, pts, _said(c, report)) for n, got, pts, c in report.scored(scheme)]
    else:  # not graded: every check 0, the reason in each
        tests = [(n, 0.0, pts, f"not graded ({row['status']}): {safe(row['finding'])}") for n, pts in checks]
    feedback = feedback or f"**Could not be graded** ({row['status']}): {safe(row['finding'])}\n"
    sandbox = {"layers": row.get("layers", ""), "seed": row.get("seed"), "status": row["status"]}
    if platform == "gradescope":
        return {"score": row["points"], "output": feedback, "output_format": "md", "visibility": "visible",
                "stdout_visibility": "hidden", "extra_data": sandbox,
                "tests": [{"name": n, "score": got, "max_score": pts, "status": "passed" if got >= pts else "failed",
                           "output": text, "visibility": "visible"} for n, got, pts, text in tests]}
    if platform == "prairielearn":
        possible = float(row["possible"])
        return {"gradable": row.get("gradable", True),  # False: no file to grade (the attempt is not counted)
                "score": round(float(row["points"]) / possible, 6) if possible else 0.0,
                "message": safe(row["finding"]) or "OK", "output": feedback, "sandbox": sandbox,
                "tests": [{"name": n, "points": got, "max_points": pts, "output": text,
                           "message": "" if got >= pts else text.split("\n")[0]} for n, got, pts, text in tests]}
    return {"points": row["points"], "possible": row["possible"], "output": feedback, "sandbox": sandbox,
            "tests": [{"name": n, "score": got, "max_score": pts, "output": text} for n, got, pts, text in tests]}


def _said(check, report) -> str:
    """What a check found, in words: its result and figure, and the findings it explains."""
    from multihead.grader.report import safe

    if check is None:
        return "not reached: the module failed an earlier check"
    mark = {True: "pass", None: "n/a"}.get(check.passed, "FAIL" if check.severity == "failure" else "warning")
    lines = [f"{mark}" + (f": {safe(check.figure)}" if check.figure else "") + (f" ({safe(check.detail)})"
                                                                                 if check.detail else "")]
    here = [f for f in report.diagnosis if f.check == check.name or
            (not f.check and check.name == "matches the float64 reference")]
    return "\n".join(lines + [safe(str(f)) for f in here])
