"""Gradescope's autograder set up and run as Gradescope runs it (issue 82: setup and grading of 30 submissions inside
the Gradescope layout in under 5 minutes on 2 cores, from a clean virtual environment), and the results file of each
platform path for one correct and one buggy submission, beside `multihead check`'s row for the same files.

A thin caller of the packages `multihead check --platform P --write` makes: the autograder zip unpacked into a folder
laid out as Gradescope lays it out (``autograder/source`` the zip's contents, ``autograder/run_autograder`` copied
from it, ``autograder/submission``, ``autograder/results``; ``MULTIHEAD_PLATFORM_ROOT`` points the scripts there),
its ``setup.sh`` run as root against a virtual environment that does not exist yet (``MULTIHEAD_VENV``; the system's
``python3``), then ``run_autograder`` once per submission -- each a cold start, as each Gradescope submission is a
fresh container -- with ``unshare`` refused to it and everything it starts (EPERM, as Docker's default seccomp
profile refuses it), so each submission runs as a user of its own, as on the platform. The 30 submissions are the
tests' own (tests/test_grader.py: the honest class ``MHA``, one-mistake versions of it, the hostile ones: a forger,
a thief of the teacher's source, a vandal, an endless loop, a fork bomb, ...). Setup and the 30 gradings are timed
each under ``/usr/bin/time -v``, and the two together under another.

Writes bench/results/platforms_gradescope/: README.md (the tables), timing.json, the per-submission results files
(gradescope_30/), and note/ (each platform's results.json for the correct and the buggy file, and check's rows).

    PYTHONPATH=src .venv/bin/python bench/platforms_gradescope.py [--torch-spec torch==2.13.0+cpu]
        [--torch-index https://pypi.org/simple]

``--torch-spec``/``--torch-index`` reach setup.sh as TORCH_SPEC/TORCH_INDEX_URL (default: torch from PyTorch's CPU
index); pip's own PIP_FIND_LINKS (a folder of wheels) is passed through.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "platforms_gradescope"
#: the assignment: tests/test_grader.py's class, its mistakes one at a time (a seed: the same probes everywhere)
ASSIGNMENT = ["--name", "MHA", "--call", "qkv", "--seed", "3", "--timeout", "30"]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # Gradescope's image: the system's python3

#: run a command with `unshare` refused (EPERM) to it and all it starts, as Docker's default seccomp profile does
DENY = textwrap.dedent('''
    import ctypes, os, platform, struct, sys
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
    os.execvp(sys.argv[1], sys.argv[1:])
    ''')


def _class(work: Path, port: int, unix: str) -> list[tuple[str, str, str]]:
    """(name, kind, source) for the 30 submissions: 10 correct, 10 with one mistake, 10 hostile."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_grader import ADVERSARIES, HONEST, HOSTILE, THIEF, VANDAL
    from test_platforms import FORGER

    scores = "torch.softmax(Q @ K.transpose(-1, -2) / self.scale_by, -1)"
    correct = {
        "honest": HONEST,
        "functional softmax": HONEST.replace("torch.softmax(", "torch.nn.functional.softmax("),
        "multiplied scale": HONEST.replace("/ self.scale_by", "* (1.0 / self.scale_by)"),
        "power scale": HONEST.replace("math.sqrt(self.d)", "self.d ** 0.5"),
        "transpose(-2, -1)": HONEST.replace("K.transpose(-1, -2)", "K.transpose(-2, -1)"),
        "einsum scores": HONEST.replace("Q @ K.transpose(-1, -2)", 'torch.einsum("bhqd,bhkd->bhqk", Q, K)'),
        "einsum values": HONEST.replace("(w @ V)", '(torch.einsum("bhqk,bhkd->bhqd", w, V))'),
        "contiguous view": HONEST.replace(".reshape(B, Lq, E)", ".contiguous().view(B, Lq, E)"),
        "renamed": HONEST.replace("W_q", "q_proj").replace("W_k", "k_proj").replace("W_v", "v_proj")
                         .replace("W_o", "out_proj"),
        "chatty": ADVERSARIES["chatty"],
    }
    buggy = {
        "scores divided by d_k": ADVERSARIES["wrong"],
        "no scaling": HONEST.replace(" / self.scale_by", ""),
        "softmax over queries": HONEST.replace(scores, scores[:-3] + "-2)"),
        "scaled by d_model": HONEST.replace("math.sqrt(self.d)", "math.sqrt(d_model)"),
        "no softmax": HONEST.replace(scores, "Q @ K.transpose(-1, -2) / self.scale_by"),
        "W_q for keys": HONEST.replace("self.W_k(k)", "self.W_q(k)"),
        "values from keys' projection": HONEST.replace("self.W_v(v)", "self.W_k(v)"),
        "no output projection": HONEST.replace("return self.W_o(", "return ("),
        "merge without transpose": HONEST.replace(".transpose(1, 2).reshape(B, Lq, E)", ".reshape(B, Lq, E)"),
        "softmax without the maximum": HONEST.replace(
            scores, "(lambda s: s.exp() / s.exp().sum(-1, keepdim=True))(Q @ K.transpose(-1, -2) / self.scale_by)"),
    }
    for name, text in {**correct, **buggy}.items():
        assert text != HONEST or name == "honest", name  # each mutation applied
    solution = work / "autograder" / "source" / "solution.py"  # the teacher's, beside the package
    forge = [str(work / "autograder" / "results" / "results.json"), str(work / "autograder" / "submission" /
                                                                         "results.json")]
    hostile = {
        "forger (row, atexit, torch.allclose)": ADVERSARIES["forger"],
        "exits at import": ADVERSARIES["exits"],
        "exits in forward": ADVERSARIES["exits in forward"],
        "6 GiB allocation": ADVERSARIES["greedy"],
        "fork bomb": ADVERSARIES["fork bomb"],
        "endless loop": ADVERSARIES["loops"],
        "environment into its error": HOSTILE["environ"],
        "escape sequences": HOSTILE["escapes"],
        "thief and results forger": f"CLASSMATE, UDP_PORT, UNIX = {str(solution)!r}, {port}, {unix!r}\n"
                                    f"FORGE = {forge!r}\n" + FORGER + THIEF,
        "vandal (teacher's files)": f"TARGETS = {[str(solution), str(work / 'autograder' / 'run_autograder')]!r}\n"
                                    + VANDAL,
    }
    return [(n, "correct", t) for n, t in correct.items()] + [(n, "buggy", t) for n, t in buggy.items()] + \
        [(n, "hostile", t) for n, t in hostile.items()]


def _time_v(path: Path) -> dict:
    """/usr/bin/time -v's figures: wall seconds, user and system CPU seconds, CPU share, peak RSS (MiB)."""
    text = path.read_text()

    def field(name):
        return re.search(rf"{re.escape(name)}: (.+)", text).group(1).strip()

    wall = 0.0
    for part in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":"):
        wall = wall * 60 + float(part)
    return {"wall_s": round(wall, 2), "user_s": float(field("User time (seconds)")),
            "system_s": float(field("System time (seconds)")), "cpu": field("Percent of CPU this job got"),
            "max_rss_mib": round(int(field("Maximum resident set size (kbytes)")) / 1024, 1),
            "exit": int(field("Exit status"))}


def _listeners(tmp: Path):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.2)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(tmp / "listener.sock"))
    unix.listen(4)
    unix.settimeout(0.2)

    def received() -> list[bytes]:
        got = []
        for listener in (udp, unix):
            try:
                got.append(listener.recv(4096) if listener is udp else listener.accept()[0].recv(4096))
            except (TimeoutError, OSError):
                pass
        return got

    return udp.getsockname()[1], str(tmp / "listener.sock"), received


def _write(platform_: str, out: Path, starter: Path) -> None:
    """`multihead check --platform P --write OUT` of this checkout (the package carries a wheel of it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    run = subprocess.run([sys.executable, "-m", "multihead_cli", "check", "--platform", platform_, "--write", str(out),
                          *ASSIGNMENT, "--starter", str(starter)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-spec", default=None, help="TORCH_SPEC for setup.sh (default: torch)")
    ap.add_argument("--torch-index", default=None, help="TORCH_INDEX_URL for setup.sh (default: PyTorch's CPU index)")
    ap.add_argument("--keep", action="store_true", help="keep the working folder (its path is printed)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="multihead-gradescope-"))
    work.chmod(0o755)  # the virtual environment inside must be readable by the submissions' users of their own
    print(f"working in {work}", flush=True)
    port, unix, received = _listeners(work)
    grader = work / "autograder"
    for d in ("source", "submission", "results"):
        (grader / d).mkdir(parents=True)
    starter = work / "mha.py"
    (work / "deny_unshare.py").write_text(DENY)
    subs = _class(work, port, unix)
    starter.write_text(subs[0][2])
    _write("gradescope", work / "autograder.zip", starter)
    with zipfile.ZipFile(work / "autograder.zip") as z:
        z.extractall(grader / "source")
        members = z.namelist()
    for name in ("setup.sh", "run_autograder"):  # zipfile drops the modes: as Gradescope's unzip keeps them
        (grader / "source" / name).chmod(0o755)
    shutil.copyfile(grader / "source" / "run_autograder", grader / "run_autograder")  # as Gradescope does
    (grader / "run_autograder").chmod(0o755)
    solution = grader / "source" / "solution.py"
    solution.write_text(subs[0][2])
    (work / "class").mkdir()
    for i, (_, _, text) in enumerate(subs):
        (work / "class" / f"{i:02d}.py").write_text(text)
    (work / "out").mkdir()

    venv = work / "opt" / "multihead"
    env = {k: v for k, v in os.environ.items() if k.startswith(("PIP_", "LANG", "LC_", "TZ", "HOME", "TERM"))}
    env |= {"PATH": PATH, "MULTIHEAD_VENV": str(venv), "MULTIHEAD_PLATFORM_ROOT": str(grader)}
    if args.torch_spec:
        env["TORCH_SPEC"] = args.torch_spec
    if args.torch_index:
        env["TORCH_INDEX_URL"] = args.torch_index
    grade_all = textwrap.dedent(f'''
        set -u
        for f in {work}/class/*.py; do
          n=$(basename "$f" .py)
          rm -rf {grader}/submission/* {grader}/results/*
          cp "$f" {grader}/submission/mha.py
          t0=$(date +%s.%N)
          /usr/bin/python3 {work}/deny_unshare.py bash {grader}/run_autograder > {work}/out/$n.log 2>&1
          echo "$n $? $t0 $(date +%s.%N)" >> {work}/out/seconds.txt
          cp {grader}/results/results.json {work}/out/$n.json 2>/dev/null || true
          ls {grader}/submission > {work}/out/$n.left
        done
        ''')
    (work / "grade_all.sh").write_text(grade_all)
    (work / "all.sh").write_text(f"set -e\ncd {grader}/source\n"
                                 f"/usr/bin/time -v -o {work}/setup.time bash {grader}/source/setup.sh > "
                                 f"{work}/setup.log 2>&1\n"
                                 f"/usr/bin/time -v -o {work}/grading.time bash {work}/grade_all.sh\n")
    load = [Path("/proc/loadavg").read_text().split()[0]]
    t0 = time.monotonic()
    run = subprocess.run(["/usr/bin/time", "-v", "-o", str(work / "total.time"), "bash", str(work / "all.sh")],
                         env=env, cwd=work)
    took = time.monotonic() - t0
    load.append(Path("/proc/loadavg").read_text().split()[0])
    args.load = load  # the machine's load average (1 min) before and after: other work shares the 2 cores
    args.python3 = subprocess.run(["python3", "--version"], env=env, capture_output=True, text=True).stdout.split()[-1]
    if run.returncode:
        print((work / "setup.log").read_text()[-3000:])
        raise SystemExit(f"setup or grading failed (exit {run.returncode}); see {work}")
    timing = {k: _time_v(work / f"{k}.time") for k in ("setup", "grading", "total")}
    print(json.dumps(timing, indent=1), flush=True)

    # each submission: what its results file says, and what the hostile ones could not do
    seconds = {line.split()[0]: (int(line.split()[1]), float(line.split()[3]) - float(line.split()[2]))
               for line in (work / "out" / "seconds.txt").read_text().splitlines()}
    rows = []
    (OUT / "gradescope_30").mkdir(parents=True, exist_ok=True)
    for i, (name, kind, _) in enumerate(subs):
        n = f"{i:02d}"
        res = json.loads((work / "out" / f"{n}.json").read_text())
        shutil.copyfile(work / "out" / f"{n}.json", OUT / "gradescope_30" / f"{n}.json")
        possible = sum(t["max_score"] for t in res["tests"])
        rows.append({"n": n, "submission": name, "kind": kind, "exit": seconds[n][0], "seconds": round(seconds[n][1], 2),
                     "status": res["extra_data"]["status"], "score": res["score"], "possible": possible,
                     "finding": res["tests"] and next((t["output"].split("\n")[-1] for t in res["tests"]
                                                       if t["score"] < t["max_score"]), ""),
                     "layers": res["extra_data"]["layers"],
                     "left in submission/": (work / "out" / f"{n}.left").read_text().split()})
    leaks = {"received over UDP or a Unix socket": received(),
             "the teacher's solution.py changed": solution.read_text() != subs[0][2],
             "run_autograder changed": (grader / "run_autograder").read_bytes() !=
             (grader / "source" / "run_autograder").read_bytes()}
    note = _note(work, subs, venv)
    _report(args, members, timing, took, rows, leaks, note)
    if not args.keep:
        shutil.rmtree(work)


def _note(work: Path, subs, venv: Path) -> list[dict]:
    """Each platform path's results.json for the correct and the buggy file (the class's first two), under the same
    refused namespaces, beside `multihead check`'s row and feedback on the folder holding both."""
    python = str(venv / "bin" / "python")
    deny = ["/usr/bin/python3", str(work / "deny_unshare.py")]
    files = {"correct": subs[0][2], "buggy": subs[10][2]}
    note = OUT / "note"
    note.mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{venv / 'bin'}:{PATH}", "MULTIHEAD_VENV": str(venv), "MULTIHEAD_PYTHON": python,
           "LANG": os.environ.get("LANG", "C.UTF-8")}
    folder = work / "note" / "class"
    for who, text in files.items():
        (folder / who).mkdir(parents=True)
        (folder / who / "mha.py").write_text(text)
    run = subprocess.run([*deny, python, "-m", "multihead_cli", "check", str(folder), *ASSIGNMENT, "--report",
                          str(work / "note" / "check.json"), "--feedback", str(work / "note" / "fb")],
                         env=env, capture_output=True, text=True, cwd=work / "note")
    assert run.returncode in (0, 1), run.stdout + run.stderr
    check = {Path(r["file"]).parent.name: r for r in json.loads((work / "note" / "check.json").read_text())}
    out = []
    for who, text in files.items():
        feedback = (work / "note" / "fb" / who / "mha.md").read_text()
        row = check[who]
        (note / f"check_{who}.json").write_text(json.dumps({k: row[k] for k in ("status", "points", "possible",
                                                                                 "finding", "layers")}, indent=1) + "\n")
        # Gradescope: the zip's layout; PrairieLearn: the question's tests/ under /grade; Classroom: the repository
        for plat in ("gradescope", "prairielearn", "classroom"):
            root = work / "note" / plat / who
            if plat == "gradescope":
                (root / "submission").mkdir(parents=True)
                (root / "results").mkdir()
                shutil.copytree(work / "autograder" / "source", root / "source")
                shutil.copyfile(root / "source" / "run_autograder", root / "run_autograder")
                (root / "submission" / "mha.py").write_text(text)
                cmd, cwd, result = ["bash", str(root / "run_autograder")], root, root / "results" / "results.json"
            elif plat == "prairielearn":
                question = work / "note" / "question"
                if not question.exists():
                    _write("prairielearn", question, work / "mha.py")
                (root / "student").mkdir(parents=True)
                (root / "results").mkdir()
                shutil.copytree(question / "tests", root / "tests")
                (root / "student" / "mha.py").write_text(text)
                cmd, cwd, result = ["bash", str(root / "tests" / "run.sh")], root, root / "results" / "results.json"
            else:
                root.mkdir(parents=True)
                (root / "mha.py").write_text(text)
                _write("classroom", root, root / "mha.py")
                steps = json.loads((root / ".github" / "workflows" / "classroom.yml").read_text())[
                    "jobs"]["run-autograding-tests"]["steps"]
                grade = next(s for s in steps if s.get("name") == "Grade")["run"]
                cmd, cwd, result = ["bash", "-c", grade], root, root / ".multihead" / "results.json"
            r = subprocess.run([*deny, *cmd], cwd=cwd, env=dict(env, MULTIHEAD_PLATFORM_ROOT=str(root)),
                               capture_output=True, text=True)
            assert r.returncode == 0, (plat, r.stdout + r.stderr)
            res = json.loads(result.read_text())
            if plat == "classroom":  # the reporter adds up the per-check steps' max-score where the step passed
                passed = []
                for s in steps:
                    if s.get("uses", "").startswith("classroom-resources/autograding-command-grader"):
                        ok = subprocess.run(["bash", "-c", s["with"]["command"]], cwd=root, env=env).returncode == 0
                        passed.append((s["with"]["max-score"] * ok, s["with"]["max-score"]))
                points, possible = sum(p for p, _ in passed), sum(m for _, m in passed)
            elif plat == "prairielearn":
                possible = sum(t["max_points"] for t in res["tests"])
                points = round(res["score"] * possible, 4)
            else:
                points, possible = res["score"], sum(t["max_score"] for t in res["tests"])
            (note / f"{plat}_{who}.results.json").write_text(json.dumps(res, indent=1) + "\n")
            out.append({"platform": plat, "file": who, "points": points, "possible": possible,
                        "check": (row["points"], row["possible"]), "same points": (points, possible) ==
                        (row["points"], row["possible"]), "same feedback": res["output"] == feedback})
    return out


def _report(args, members, timing, took, rows, leaks, note) -> None:
    flags = sorted(set(re.findall(r"\b(avx2|avx512_vnni|amx_int8)\b", Path("/proc/cpuinfo").read_text())))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = ["# Gradescope's autograder: setup and 30 submissions, as Gradescope runs them", "",
             "`PYTHONPATH=src .venv/bin/python bench/platforms_gradescope.py"
             + (f" --torch-spec {args.torch_spec}" if args.torch_spec else "")
             + (f" --torch-index {args.torch_index}" if args.torch_index else "") + "`", "",
             f"{cpu}, {os.cpu_count()} cores, flags {' '.join(flags) or '-'}; kernel {platform.release()}; the zip: "
             f"{', '.join(sorted(members))}; `python3` {args.python3} (the system's); pip's "
             f"PIP_FIND_LINKS={os.environ.get('PIP_FIND_LINKS', '-')}; each run_autograder with `unshare` refused "
             "(Docker's default seccomp profile), as root: each submission a user of its own. The machine's load "
             f"average (1 min) {args.load[0]} before, {args.load[1]} after (other work on the machine counts in it).", "",
             "| phase (`/usr/bin/time -v`) | wall s | user s | system s | CPU | peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for k, what in (("setup", "setup.sh: venv, torch, multihead's wheel"), ("grading", "30 × run_autograder"),
                    ("total", "both")):
        t = timing[k]
        lines.append(f"| {what} | {t['wall_s']:.1f} | {t['user_s']:.1f} | {t['system_s']:.1f} | {t['cpu']} | "
                     f"{t['max_rss_mib']:.0f} |")
    per = [r["seconds"] for r in rows]
    goal = "under" if timing["total"]["wall_s"] < 300 else "OVER"
    lines += ["", f"Total {timing['total']['wall_s']:.0f} s: {goal} the 5 minutes (300 s). Per submission: median "
              f"{sorted(per)[len(per) // 2]:.1f} s, min {min(per):.1f} s, max {max(per):.1f} s (the endless loop: "
              "the assignment's --timeout 30).", "",
              "| # | submission | kind | status | points | run_autograder s | the first failing check's last line |",
              "|---|---|---|---|---:|---:|---|"]
    for r in rows:
        finding = str(r["finding"]).replace("|", "\\|")[:110]
        lines.append(f"| {r['n']} | {r['submission']} | {r['kind']} | {r['status']} | {r['score']:g}/{r['possible']:g} "
                     f"| {r['seconds']:.1f} | {finding} |")
    layers = sorted({re.sub(r"uid \d+", "uid 1900000000+pid", r["layers"]) for r in rows if r["layers"]})
    lines += ["", "Layers the results files state: " + "; ".join(f"`{x}`" for x in layers) + ".", "",
              "| what a hostile submission could have done | happened |", "|---|---|"]
    for k, v in leaks.items():
        lines.append(f"| {k} | {v if v else 'no'} |")
    left = sorted({x for r in rows for x in r["left in submission/"]} - {"mha.py"})
    lines.append(f"| a file left in `submission/` (a forged results.json) | {', '.join(left) or 'no'} |")
    lines += ["", "## Each platform path against `multihead check` (note/)", "",
              "The correct file (`honest`) and the buggy one (`scores divided by d_k`), graded through each platform's "
              "script in its layout (user namespaces refused) and by `multihead check` on a folder holding both "
              "(also refused): the results files are in note/.", "",
              "| platform | file | points | check's points | same points | same feedback text |", "|---|---|---:|---:|---|---|"]
    for n in note:
        lines.append(f"| {n['platform']} | {n['file']} | {n['points']:g}/{n['possible']:g} | "
                     f"{n['check'][0]:g}/{n['check'][1]:g} | {n['same points']} | {n['same feedback']} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "README.md").write_text("\n".join(lines) + "\n")
    (OUT / "timing.json").write_text(json.dumps({"timing": timing, "driver_wall_s": round(took, 1), "rows": rows,
                                                 "leaks": {k: str(v) for k, v in leaks.items()}, "note": note},
                                                indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
