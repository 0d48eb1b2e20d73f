"""Course platforms (issue 82): Gradescope's autograder zip, PrairieLearn's external-grader question and GitHub
Classroom's workflow, each run here on the platform's own layout under a folder of the test's (the root the scripts
read from MULTIHEAD_PLATFORM_ROOT), from this project's environment. Each gives the points and feedback `multihead
check` gives the same class; where user namespaces are refused (Docker's default seccomp profile, reproduced here by
a seccomp filter on the grader's own process), hostile submissions read, send, forge and leak nothing, and the rows
and results files say which layers confined them."""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from multihead.grader import confine, platforms
from multihead_cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_grader import HONEST, HOSTILE, THIEF, _listeners  # noqa: E402


def _submission(**mistake) -> str:
    """A learner's file of the documentation's class (tools/docs_pictures.py's ``submission``)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "docs_pictures.py"
    spec = importlib.util.spec_from_file_location("docs_pictures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.submission(**mistake)


SRC = str(Path(__file__).resolve().parents[1] / "src")
#: the assignment: the documentation's class (tools/docs_pictures.py), graded as docs/how-to/grade-a-class.md does
OPTIONS = ["--name", "MultiHeadAttention", "--init", "d_model=32, num_heads=4", "--call", "qkv_mask", "--mask", "keep",
           "--seed", "3"]
CLASS = {"ada": _submission(), "ben": _submission(scale="self.d")}  # right; scores divided by d_k


def _env(root: Path | None = None, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC, MULTIHEAD_PYTHON=sys.executable, KERAS_BACKEND="torch", **extra)
    if root is not None:
        env["MULTIHEAD_PLATFORM_ROOT"] = str(root)
    return env


@pytest.fixture(scope="module")
def by_check(tmp_path_factory):
    """`multihead check` on the class's folder: {learner: (row, feedback markdown)}."""
    tmp = tmp_path_factory.mktemp("check")
    for who, text in CLASS.items():
        (tmp / "class" / who).mkdir(parents=True)
        (tmp / "class" / who / "mha.py").write_text(text)
    assert main(["check", str(tmp / "class"), *OPTIONS, "--report", str(tmp / "r.json"), "--feedback",
                 str(tmp / "fb")]) == 1
    rows = {Path(r["file"]).parent.name: r for r in json.loads((tmp / "r.json").read_text())}
    return {who: (rows[who], (tmp / "fb" / who / "mha.md").read_text()) for who in CLASS}


def _same_as_check(by_check, who: str, points: float, possible: float, tests: list[tuple[float, float]], output: str):
    row, feedback = by_check[who]
    assert (points, possible) == (row["points"], row["possible"]), (who, points, row)
    assert sum(t[0] for t in tests) == pytest.approx(row["points"]) and \
        sum(t[1] for t in tests) == pytest.approx(row["possible"])
    assert output == feedback


def test_gradescope_autograder_grades_as_check_does(tmp_path, by_check):
    starter = tmp_path / "mha.py"
    starter.write_text(CLASS["ada"])
    zipped = tmp_path / "autograder.zip"
    assert main(["check", "--platform", "gradescope", "--write", str(zipped), *OPTIONS, "--starter", str(starter)]) == 0
    whl = platforms.wheel().name
    with zipfile.ZipFile(zipped) as z:
        assert sorted(z.namelist()) == sorted(["run_autograder", "setup.sh", whl])
        assert z.getinfo("run_autograder").external_attr >> 16 & 0o111
        assert z.read(whl) == platforms.wheel().read_bytes()
        setup = z.read("setup.sh").decode()
    # torch from PyTorch's CPU index, multihead from the zip's own wheel (no name looked up on PyPI), every user reads
    assert '--index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "${TORCH_SPEC:-torch}"' in setup
    assert f'install --no-cache-dir "${{MULTIHEAD_SPEC:-$HERE/{whl}}}"' in setup and "multihead==" not in setup
    assert "python3 -m venv" in setup and 'chmod -R a+rX "$VENV"' in setup
    assert subprocess.run(["bash", "-n", "-c", setup]).returncode == 0
    for who in CLASS:
        root = tmp_path / who
        (root / "submission").mkdir(parents=True)
        (root / "results").mkdir()
        with zipfile.ZipFile(zipped) as z:
            z.extractall(root / "source")
        (root / "submission" / "mha.py").write_text(CLASS[who])
        run = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=_env(root), capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        res = json.loads((root / "results" / "results.json").read_text())
        tests = [(t["score"], t["max_score"]) for t in res["tests"]]
        assert all(t["visibility"] == "visible" and t["name"] and "output" in t for t in res["tests"])
        _same_as_check(by_check, who, res["score"], sum(t[1] for t in tests), tests, res["output"])
        assert res["extra_data"]["layers"] == by_check[who][0]["layers"] != ""
    bad = [t for t in json.loads((tmp_path / "ben" / "results" / "results.json").read_text())["tests"]
           if t["score"] < t["max_score"]]
    assert [t["name"] for t in bad] == ["matches the float64 reference"] and "scores divided by d_k" in bad[0]["output"]


def test_prairielearn_question_grades_as_check_does(tmp_path, by_check):
    starter = tmp_path / "mha.py"
    starter.write_text(CLASS["ada"])
    points = tmp_path / "points.json"
    points.write_text(json.dumps({"matches the float64 reference": 4}))  # the default: the same points as check's
    question = tmp_path / "question"
    assert main(["check", "--platform", "prairielearn", "--write", str(question), *OPTIONS, "--starter", str(starter),
                 "--points", str(points), "--timeout", "50"]) == 0
    info = json.loads((question / "info.json").read_text())
    grading = info["externalGradingOptions"]
    assert info["gradingMethod"] == "External" and grading["entrypoint"] == "/grade/tests/run.sh"
    assert grading["timeout"] >= 100 and grading["image"] and (question / "Dockerfile").is_file()
    whl = platforms.wheel()
    docker = (question / "Dockerfile").read_text()
    assert (question / whl.name).read_bytes() == whl.read_bytes() and f"COPY {whl.name} /tmp/" in docker
    assert f"ARG MULTIHEAD_SPEC=/tmp/{whl.name}" in docker and 'pip install --no-cache-dir "$MULTIHEAD_SPEC"' in docker
    assert (question / "clientFilesQuestion" / "mha.py").read_text() == CLASS["ada"]
    for who in CLASS:
        root = tmp_path / who
        (root / "student").mkdir(parents=True)
        (root / "results").mkdir()
        (root / "tests").symlink_to(question / "tests")
        (root / "student" / "mha.py").write_text(CLASS[who])
        run = subprocess.run([str(root / "tests" / "run.sh")], env=_env(root), capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        res = json.loads((root / "results" / "results.json").read_text())
        tests = [(t["points"], t["max_points"]) for t in res["tests"]]
        assert res["gradable"] is True and 0 <= res["score"] <= 1
        possible = sum(t[1] for t in tests)  # PrairieLearn's score is a share (rounded to 6 places)
        _same_as_check(by_check, who, round(res["score"] * possible, 4), possible, tests, res["output"])
        assert res["message"] == (by_check[who][0]["finding"] or "OK")
    assert json.loads((tmp_path / "ada" / "results" / "results.json").read_text())["score"] == 1.0


def _workflow_steps(repo: Path) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((repo / ".github" / "workflows" / "classroom.yml").read_text())
    assert set(flow["on"]) == {"push", "workflow_dispatch"}
    return flow["jobs"]["run-autograding-tests"]["steps"]


def test_github_classroom_workflow_reports_the_points_check_gives(tmp_path, by_check):
    for who in CLASS:
        repo = tmp_path / who
        repo.mkdir()
        (repo / "mha.py").write_text(CLASS[who])  # the learner's push: their file where the template's was
        assert main(["check", "--platform", "classroom", "--write", str(repo), *OPTIONS, "--starter",
                     str(repo / "mha.py")]) == 0
        steps = _workflow_steps(repo)
        graders = [s for s in steps if s.get("uses", "").startswith("classroom-resources/autograding-command-grader")]
        reporter = steps[-1]
        assert reporter["uses"].startswith("classroom-resources/autograding-grading-reporter")
        assert reporter["with"]["runners"].split(",") == [s["id"] for s in graders]
        assert all(f"steps.{s['id']}.outputs.result" in reporter["env"][f"{s['id'].upper().replace('-', '_')}_RESULTS"]
                   for s in graders)
        whl = platforms.wheel().name
        install = next(s for s in steps if s.get("name") == "Install multihead")["run"]
        assert f'pip install "${{MULTIHEAD_SPEC:-.multihead/{whl}}}"' in install and "multihead==" not in install
        assert (repo / ".multihead" / whl).read_bytes() == platforms.wheel().read_bytes()
        env = _env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        grade = next(s for s in steps if s.get("name") == "Grade")
        run = subprocess.run(grade["run"], shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        scores = []
        for s in graders:
            assert s["with"]["timeout"] >= 1 and s["with"]["test-name"] == s["name"]
            ok = subprocess.run(s["with"]["command"], shell=True, cwd=repo, env=env, timeout=60).returncode == 0
            scores.append((s["with"]["max-score"] * ok, s["with"]["max-score"]))
        res = json.loads((repo / ".multihead" / "results.json").read_text())
        _same_as_check(by_check, who, sum(s for s, _ in scores), sum(m for _, m in scores), scores, res["output"])


def test_each_package_installs_the_multihead_that_wrote_it(tmp_path):
    """The packages carry a wheel of the running multihead (built from this checkout) instead of naming a version on
    PyPI: installed (pip, no index, no dependencies) it is this source, file for file, with its command; a wheel
    repacked from that installed copy (how a multihead installed from a wheel makes its own) holds the same files."""
    from importlib.metadata import distributions

    whl = platforms.wheel()
    assert whl.name == "multihead-0.1.0-py3-none-any.whl" and platforms.wheel() == whl  # made once per process
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                          str(target), str(whl)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    src = Path(SRC)
    ours = {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and p.suffix in (".py", ".html")}
    installed = {p.relative_to(target).as_posix() for p in target.glob("multihead*/**/*") if p.is_file() and
                 "__pycache__" not in p.parts and ".dist-info" not in p.parent.as_posix()}
    assert installed == ours
    assert all((target / f).read_bytes() == (src / f).read_bytes() for f in ours)
    [dist] = [d for d in distributions(path=[str(target)]) if d.metadata["Name"] == "multihead"]
    assert any(e.name == "multihead" and e.value == "multihead_cli:main" for e in dist.entry_points)
    again = platforms.repack(dist, tmp_path)
    with zipfile.ZipFile(whl) as a, zipfile.ZipFile(again) as b:
        assert a.namelist() and sorted(a.namelist()) == sorted(b.namelist())
        assert all(a.read(n) == b.read(n) for n in a.namelist() if not n.endswith("/RECORD"))
        record = b.read("multihead-0.1.0.dist-info/RECORD").decode().splitlines()
    assert len(record) == len(a.namelist()) and all(r.count(",") == 2 for r in record)


def test_the_fork_server_started_before_torch_keeps_nothing_of_the_graders_environment(tmp_path, monkeypatch):
    """`multihead check` grading in a fresh process (each platform submission) starts its fork server before it
    imports torch, so the two load side by side: started by path with the grader's environment, the server replaces
    itself at once, and its environment is the sandbox's, built (no token of the grader's). The grader adopts it as
    its fork server; one of another multihead's, or a second, is refused and closed."""
    import socket
    import tempfile

    from multihead.grader import runner, zygote

    code = textwrap.dedent("""
        import json, sys, time, multihead_cli
        args = multihead_cli.build_parser().parse_args(["check", "--platform", "gradescope", "--grade", "--name", "M"])
        sock, proc, home, script = multihead_cli._fork_server(args)
        end = time.monotonic() + 60
        while b"multihead.grader.zygote" not in open(f"/proc/{proc.pid}/cmdline", "rb").read():  # replaced itself
            assert time.monotonic() < end and proc.poll() is None
            time.sleep(0.02)
        env = dict(e.split("=", 1) for e in open(f"/proc/{proc.pid}/environ").read().split("\\0") if e)
        proc.kill()
        print(json.dumps([env, home, script, "torch" in sys.modules]))
        """)
    token = f"tok-{os.getpid()}"
    grader_env = _env(MULTIHEAD_TEST_SECRET_TOKEN=token)
    run = subprocess.run([sys.executable, "-c", code], env=grader_env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    env, home, script, torch_imported = json.loads(run.stdout)
    assert env == zygote.environment(home, grader_env) and token not in json.dumps(env), env
    assert os.path.realpath(script) == os.path.realpath(zygote.__file__) and not torch_imported
    os.rmdir(home)

    def server():
        ours, theirs = socket.socketpair()
        return ours, theirs, subprocess.Popen(["sleep", "30"]), tempfile.mkdtemp()

    monkeypatch.setattr(runner, "_ZYGOTE", [])  # a grader that has none yet
    for script, taken in ((str(tmp_path / "zygote.py"), False), (zygote.__file__, True), (zygote.__file__, False)):
        ours, theirs, proc, home = server()
        try:
            assert runner.adopt(ours, proc, home, script) is taken
            assert (runner._zygote().proc is proc) if taken else (ours.fileno() == -1 and not os.path.exists(home))
        finally:
            proc.kill()
            proc.wait()
            theirs.close()
            ours.close()
    monkeypatch.setattr(runner, "_ZYGOTE", [])


def test_bad_platform_input_is_one_line_before_any_grading(tmp_path, capsys):
    starter = tmp_path / "mha.py"
    starter.write_text(HONEST)
    points = tmp_path / "points.json"
    points.write_text(json.dumps({"matches the reference": 3}))
    cases = [
        (["--platform", "gradescope", "--write", str(tmp_path / "a.zip"), "--call", "qkv"], "--name NAME is missing"),
        (["--platform", "prairielearn", "--write", str(tmp_path / "q"), "--name", "MHA", "--points", str(points)],
         "'matches the reference' is not a check"),
        (["--platform", "gradescope", "--grade", "--root", str(tmp_path / "empty"), "--name", "MHA"],
         f"{tmp_path / 'empty' / 'submission'} does not exist"),
        (["--platform", "prairielearn", "--grade", "--root", str(tmp_path), "--name", "MHA"],
         f"{tmp_path / 'student'} does not exist"),
        (["--platform", "classroom", "--write", str(tmp_path / "repo"), "--name", "MHA"],
         "--platform classroom --write needs --starter FILE"),
        (["--platform", "gradescope", "--write", str(tmp_path / "a.tar"), "--name", "MHA"], "give OUT.zip"),
        (["--write", str(tmp_path / "a.zip"), "--name", "MHA"], "add --platform gradescope"),
        (["--platform", "gradescope", str(starter), "--grade", "--name", "MHA"], "one of them, and no files"),
    ]
    for argv, said in cases:
        assert main(["check", *argv]) == 2, argv
        out, err = capsys.readouterr()
        assert said in err and len(err.strip().splitlines()) == 1 and out == "", (argv, err)
    assert not (tmp_path / "a.zip").exists() and not (tmp_path / "q").exists() and not (tmp_path / "repo").exists()


def test_a_submission_missing_from_the_layout_is_said_in_the_results(tmp_path, capsys):
    for plat, folder in (("gradescope", "submission"), ("prairielearn", "student")):
        root = tmp_path / plat
        (root / folder).mkdir(parents=True)
        (root / folder / "notes.txt").write_text("no code")
        assert main(["check", "--platform", plat, "--grade", "--root", str(root), "--name", "MHA", "--starter",
                     "mha.py"]) == 0
        res = json.loads((root / "results" / "results.json").read_text())
        said = json.dumps(res)
        assert "no mha.py in the submission: hand in the file mha.py" in said, said
        if plat == "prairielearn":
            assert res["gradable"] is False and res["score"] == 0
        else:
            assert res["score"] == 0 and sum(t["max_score"] for t in res["tests"]) == 16
    capsys.readouterr()


# --- where user namespaces are refused --------------------------------------------------------------------------

#: run the `multihead` command after refusing `unshare` to this process and all it starts (EPERM), as Docker's
#: default seccomp profile does: the grader then runs as the platforms run it
DENIED = textwrap.dedent('''
    import ctypes, platform, struct, sys
    nr = {"x86_64": 272, "aarch64": 97}[platform.machine()]
    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
    op = lambda code, k, jt=0, jf=0: struct.pack("=HBBI", code, jt, jf, k)
    prog = b"".join([op(0x20, 4), op(0x15, arch, 0, 3), op(0x20, 0), op(0x15, nr, 0, 1), op(0x06, 0x50001),
                     op(0x06, 0x7FFF0000)])
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(prog, len(prog))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(Prog(len(prog) // 8, ctypes.cast(
        buf, ctypes.c_void_p))), 0, 0) == 0
    assert libc.unshare(0x10000000) == -1 and ctypes.get_errno() == 1  # user namespaces refused
    from multihead_cli import main
    sys.exit(main(sys.argv[1:]))
    ''')


def _denied(python: str, argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", DENIED, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=400)


@pytest.fixture(scope="module")
def shared_python():
    """A Python every user can read, as on the platforms' images (a submission's user of its own imports from it):
    this one where it is so, else -- this project's environment may be made from a Python under /root, which the
    grader then refuses -- a virtual environment of the system's Python of this version over this one's
    site-packages."""
    import shutil
    import sysconfig
    import tempfile

    if not confine.unreadable():
        yield sys.executable
        return
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = Path(f"/usr/bin/python{version}")
    if not system.is_file():
        pytest.skip(f"this Python is not readable by every user ({confine.unreadable()[0]}) and there is no {system}")
    top = Path(tempfile.mkdtemp(prefix="multihead-python-"))
    try:
        top.chmod(0o755)
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(top / "venv")], check=True, timeout=60)
        site = top / "venv" / "lib" / f"python{version}" / "site-packages"
        site.rmdir()
        site.symlink_to(sysconfig.get_paths()["purelib"])
        yield str(top / "venv" / "bin" / "python")
    finally:
        shutil.rmtree(top)


#: a submission that, at import, writes a results file of its own where each platform reads one, and prints one
FORGER = textwrap.dedent('''
    import json, os
    for path in FORGE:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump({"score": 99, "gradable": True, "tests": []}, f)
            print("forged", path)
        except OSError as e:
            print("refused: forge", path, e)
    print(json.dumps({"score": 99}))
    ''')


needs_landlock = pytest.mark.skipif(platform.system() != "Linux" or confine.abi() == 0 or os.geteuid() != 0,
                                    reason="Landlock and a grader running as root (as the platforms run it)")


@needs_landlock
def test_without_user_namespaces_the_hostile_class_gets_nothing_more(tmp_path, shared_python):
    """The hostile class of tests/test_grader.py (a thief of a classmate's file by every path, a sender over UDP and
    a Unix socket, the grader's environment and escape sequences put into its error) graded by `multihead check`
    with user namespaces refused: each submission runs as a user of its own under Landlock and the seccomp filter,
    and the thief is graded on its own code, nothing arrives, no token or escape reaches the report."""
    port, unix, received = _listeners(tmp_path)
    subs = tmp_path / "class"
    for who in ("alice", "mallory", "environ", "escapes"):
        (subs / who).mkdir(parents=True)
    alice = subs / "alice" / "mha.py"
    alice.write_text(HONEST)
    (subs / "mallory" / "mha.py").write_text(f"CLASSMATE, UDP_PORT, UNIX = {str(alice)!r}, {port}, {unix!r}\n" + THIEF)
    for who in ("environ", "escapes"):
        (subs / who / "mha.py").write_text(HOSTILE[who])
    token = f"tok-{os.getpid()}"
    mode = alice.stat().st_mode
    run = _denied(shared_python, ["check", "class", "--name", "MHA", "--call", "qkv", "--seed", "3", "--timeout", "90",
                                  "--report", str(tmp_path / "grades.csv")], tmp_path,
                  _env(MULTIHEAD_TEST_SECRET_TOKEN=token))
    rows = {Path(r["file"]).parent.name: r for r in csv.DictReader((tmp_path / "grades.csv").open())}
    assert rows["alice"]["status"] == "ok", (rows, run.stderr)
    assert rows["mallory"]["status"] == "not ok" and rows["mallory"]["finding"].startswith("scores divided by d_k")
    assert rows["environ"]["status"] == "error" and "env: {" in rows["environ"]["finding"]
    assert received() == [] and alice.stat().st_mode == mode and alice.read_text() == HONEST
    for text in (run.stdout, run.stderr, (tmp_path / "grades.csv").read_text()):
        assert token not in text and "\x1b" not in text and "\u202e" not in text
    for r in rows.values():
        assert "a user of its own" in r["layers"] and "Landlock" in r["layers"] and "seccomp" in r["layers"], r
        assert "namespaces" not in r["layers"]
    assert "cannot confine a submission's process from: the network" in run.stderr  # said once, as before


@needs_landlock
def test_without_user_namespaces_a_platform_submission_cannot_forge_its_results(tmp_path, shared_python):
    """Through Gradescope's and PrairieLearn's layouts with user namespaces refused: a submission that writes a
    results file where the platform reads it, reads the teacher's source folder and sends what it read is graded on
    its own code; the results file is the grader's and says which layers were active."""
    port, unix, received = _listeners(tmp_path)
    for plat, folder, package in (("gradescope", "submission", "source"), ("prairielearn", "student", "tests")):
        root = tmp_path / plat
        (root / folder).mkdir(parents=True)
        (root / package).mkdir()
        secret = root / package / "solution.py"
        secret.write_text(HONEST)
        forge = [str(root / "results" / "results.json"), str(root / folder / "results.json")]
        (root / folder / "mha.py").write_text(f"CLASSMATE, UDP_PORT, UNIX = {str(secret)!r}, {port}, {unix!r}\n"
                                              f"FORGE = {forge!r}\n" + FORGER + THIEF)
        run = _denied(shared_python, ["check", "--platform", plat, "--grade", "--root", str(root), "--name", "MHA",
                                      "--call", "qkv", "--seed", "3", "--starter", "mha.py"], tmp_path, _env())
        assert run.returncode == 0, run.stdout + run.stderr
        res = json.loads((root / "results" / "results.json").read_text())
        said = res.get("extra_data") or res["sandbox"]
        assert said["status"] == "not ok" and "a user of its own" in said["layers"], (res, run.stderr)
        assert "scores divided by d_k" in res["output"] and res["tests"], res
        score = res["score"] if plat == "gradescope" else res["score"] * 16
        assert score == 12 and not (root / folder / "results.json").exists()
        assert received() == [] and secret.read_text() == HONEST


def test_what_another_user_cannot_read_is_named_by_its_mode():
    """confine.unreadable on a tree of the test's: a folder above the Python that others cannot pass through (a
    virtual environment under /root), the folder itself or an entry inside it that others cannot read, each named
    with its mode; none once every user can read them (the modes a world-readable /opt/multihead has)."""
    import tempfile

    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)
        home, venv = Path(top) / "root", Path(top) / "root" / "venv"
        (venv / "lib" / "torch").mkdir(parents=True)
        (venv / "lib" / "torch" / "__init__.py").write_text("")
        (venv / "lib" / "numpy.py").write_text("")
        (venv / "lib" / "loose").symlink_to(Path(top) / "nowhere")  # a link: its target is checked where used
        for d in (home, venv, venv / "lib", venv / "lib" / "torch"):
            d.chmod(0o755)
        (venv / "lib" / "numpy.py").chmod(0o644)
        assert confine.unreadable([str(venv / "lib")]) == []
        home.chmod(0o700)
        assert confine.unreadable([str(venv / "lib"), str(venv)]) == [
            f"{home} (mode 0700: others cannot pass through it)"]
        home.chmod(0o711)  # passed through, not listed: enough
        (venv / "lib" / "numpy.py").chmod(0o600)
        (venv / "lib" / "torch").chmod(0o750)
        assert sorted(confine.unreadable([str(venv / "lib")])) == [
            f"{venv / 'lib' / 'numpy.py'} (mode 0600: others cannot read it)",
            f"{venv / 'lib' / 'torch'} (mode 0750: others cannot list it or pass through it)"]
        (venv / "lib").chmod(0o700)
        assert confine.unreadable([str(venv / "lib")]) == [
            f"{venv / 'lib'} (mode 0700: others cannot list it or pass through it)"]
    assert all(p.startswith("/") for p in confine.installation()) and \
        os.path.realpath(sys.prefix) in confine.installation()


def test_a_python_no_other_user_can_read_is_refused_before_any_grading(tmp_path, monkeypatch, capsys):
    """Where each submission would run as a user of its own (the grader root, user namespaces refused) and that user
    cannot read the Python the grader runs, the grader says so in one line, naming the path and the fix, and grades
    nothing."""
    from multihead.grader import classroom

    monkeypatch.setattr(confine, "unconfined", lambda: (confine._GAPS["network"],))
    monkeypatch.setattr(confine, "unreadable", lambda paths=None: ["/root (mode 0700: others cannot pass through it)",
                                                                    "/root/x (mode 0600: others cannot read it)"])
    monkeypatch.setattr(classroom.os, "geteuid", lambda: 0)
    (tmp_path / "class").mkdir()
    (tmp_path / "class" / "mha.py").write_text(HONEST)
    for target in ("class/mha.py", "class"):  # one file (its report), a class (its table)
        assert main(["check", str(tmp_path / target), "--name", "MHA", "--call", "qkv"]) == 2
        out, err = capsys.readouterr()
        assert err.strip() == (
            "multihead check: each submission runs as a user of its own here (root without user namespaces), and "
            "that user cannot read the Python this grader runs: /root (mode 0700: others cannot pass through it) "
            "(and 1 more); install it where every user can read it, e.g. python3 -m venv /opt/multihead && chmod -R "
            "a+rX /opt/multihead, from a Python outside /root (the system's python3)"), err
        assert out == ""  # no report, no row: nothing was graded


def test_per_check_points_add_up_to_the_reports_points():
    """Report.scored is the breakdown Report.points sums (every platform's tests are its rows)."""
    from multihead.grader.report import Check, Finding, Report, assignment

    names = assignment(masked=False, causal=False, self_attn=False, forbid=False)
    checks = [Check(n, n != "matches the float64 reference") for n in names[:-3]] + \
        [Check("matches the float64 reference", False)]
    rep = Report(checks, [Finding("scores divided by d_k", "fix")], assignment=names)
    rows = rep.scored()
    assert [n for n, *_ in rows] == list(names)
    assert (sum(r[1] for r in rows), sum(r[2] for r in rows)) == rep.points()
    assert [n for n, got, pts, c in rows if got < pts] == [*names[-3:-1], "matches the float64 reference"]


def test_the_forged_results_file_of_a_previous_push_is_never_read(tmp_path):
    import multihead_cli
    from multihead.grader import platforms

    assert multihead_cli.CLASSROOM_RESULTS == platforms.LAYOUTS["classroom"][1]
    (tmp_path / ".multihead").mkdir()
    (tmp_path / ".multihead" / "results.json").write_text(json.dumps(
        {"tests": [{"name": "matches the float64 reference", "score": 4, "max_score": 4}]}))
    check = ["check", "--platform", "classroom", "--root", str(tmp_path), "--passed"]
    assert main([*check, "matches the float64 reference"]) == 0  # what a step reads, after the grading step
    (tmp_path / "mha.py").write_text("raise SystemExit('no')\n")
    platforms.grade("classroom", tmp_path, "MHA", starter="mha.py", call="qkv", seed=1, timeout=30)
    assert main([*check, "matches the float64 reference"]) == 1
    assert main([*check, "no such check"]) == 2
    with pytest.raises(ValueError, match="'no such check' is not a check of this assignment"):
        multihead_cli.earned(str(tmp_path), "no such check")
    code = "import sys, multihead_cli; multihead_cli.main(sys.argv[1:]); print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code, *check, "matches the float64 reference"], env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stdout + run.stderr  # a step's command: no torch, no second


def test_the_how_to_pages_commands_write_the_packages(tmp_path, monkeypatch, capsys):
    """docs/how-to/grade-on-a-platform.md's command lines, as written (the grading they set up: the tests above)."""
    import re
    import shlex

    page = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "grade-on-a-platform.md").read_text()
    lines = [b.replace("\\\n", " ").strip() for b in re.findall(r"```sh\n(.*?)```", page, re.S)]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mha.py").write_text(CLASS["ada"])
    (tmp_path / "points.json").write_text(json.dumps({"matches the float64 reference": 4}))
    (tmp_path / "questions").mkdir()
    written = []
    for line in lines:
        words = shlex.split(line)
        assert words[:3] == [".venv/bin/multihead", "check", "--platform"], line
        assert main(words[1:]) == 0, line
        written.append(capsys.readouterr().out.strip())
    assert written == ["gradescope: autograder.zip", "prairielearn: questions/mha", "classroom: template"]
    assert zipfile.is_zipfile(tmp_path / "autograder.zip") and (tmp_path / "questions" / "mha" / "info.json").is_file()
    assert (tmp_path / "template" / ".github" / "workflows" / "classroom.yml").is_file()
    assert (tmp_path / "template" / "mha.py").read_text() == CLASS["ada"]
