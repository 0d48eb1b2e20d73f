"""``multihead check``: grade one learner's file, or a whole class's folder.

One file (``FILE.py:NAME``, or ``FILE.py --name NAME``) is graded in this process and its
whole report printed; exit 0 (OK), 1 (not OK), 2 (it cannot be graded: no such file or
class, an import or build that raises, a call that raises or cannot pass the mask, no
answer within ``--timeout`` seconds).

Several files (a folder, a glob, or many paths, with ``--name``) are each graded in a
process of their own with a time limit, so a submission that hangs, crashes or calls
``sys.exit`` gets its line and the others go on. A table is printed, and ``--report
FILE.csv`` / ``FILE.json`` keeps it: file, ok, status, failed checks, finding, seconds.
Exit 0 when every submission is OK, 1 otherwise, 2 when nothing matches.
"""

from __future__ import annotations

import ast
import csv
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["grade_file", "grade_many", "targets", "write_report"]

FIELDS = ("file", "ok", "status", "failed", "finding", "seconds")


class _Timeout(BaseException):  # noqa: N818 - not an Exception: the checker's own except clauses let it through
    """Raised by SIGALRM when a submission takes too long."""


def kwargs_of(text: str | None) -> dict:
    """'d_model=32, num_heads=4' -> {'d_model': 32, 'num_heads': 4} (literals only)."""
    if not text:
        return {}
    call = ast.parse(f"f({text})", mode="eval").body
    if call.args:
        raise ValueError("--init takes keyword arguments only, e.g. --init 'd_model=32, num_heads=4'")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def targets(items: list[str], name: str | None) -> list[tuple[Path, str | None]]:
    """(file, class name) for FILE.py:NAME, FILE.py, a folder (its .py files, recursively) or a glob."""
    out = []
    for item in items:
        path, _, nm = item.rpartition(":")
        if path.endswith(".py") and nm.isidentifier():  # FILE.py:NAME (a missing file is reported when graded)
            out.append((Path(path), nm))
            continue
        p = Path(item)
        files = [p] if p.is_file() else sorted(p.rglob("*.py")) if p.is_dir() else sorted(Path(f) for f in
                                                                                         glob.glob(item, recursive=True))
        out += [(f, name) for f in files if f.is_file() and f.suffix == ".py"]
    return out


def _row(path: Path, status: str, ok: bool = False, failed: str = "", finding: str = "", seconds: float = 0.0):
    return {"file": str(path), "ok": ok, "status": status, "failed": failed, "finding": finding,
            "seconds": round(seconds, 2)}


def grade_file(path: Path, name: str, *, init: str | None = None, call: str = "qkv", mask: str | None = None,
               causal: bool = False, embed_dim: int | None = None, strict: bool = False,
               timeout: float | None = None, show=None) -> dict:
    """Grade ``NAME(**init)`` from ``path`` in this process; ``show(report)`` sees the whole report.
    Returns the row (status: ok, not ok, error, timeout). ``timeout`` uses SIGALRM (main thread)."""
    import torch

    import multihead

    t0 = time.perf_counter()
    if not path.is_file():
        return _row(path, "error", finding=f"{path} does not exist")
    if not name:
        return _row(path, "error", finding="no class name: give FILE.py:NAME or --name NAME")
    alarm = timeout is not None and hasattr(signal, "SIGALRM")
    if alarm:
        def on_alarm(*_):
            raise _Timeout

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        spec = importlib.util.spec_from_file_location(f"_multihead_check_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except _Timeout:
            raise
        except BaseException as e:  # noqa: BLE001 - the learner's file (SystemExit included)
            return _row(path, "error", finding=f"importing {path} failed: {type(e).__name__}: {e}")
        if not hasattr(mod, name):
            names = [n for n in vars(mod) if not n.startswith("_") and isinstance(vars(mod)[n], type)]
            return _row(path, "error", finding=f"{path} has no {name!r}; it defines {', '.join(names) or 'no class'}")
        try:
            kwargs = kwargs_of(init)
            torch.manual_seed(0)
            module = getattr(mod, name)(**kwargs)
        except _Timeout:
            raise
        except BaseException as e:  # noqa: BLE001
            return _row(path, "error", finding=f"building {name}({init or ''}) failed: {type(e).__name__}: {e}")
        torch.manual_seed(0)
        try:
            report = multihead.check(module, call=call, mask=mask, causal=causal, embed_dim=embed_dim, strict=strict)
        except (TypeError, ValueError) as e:
            return _row(path, "error", finding=str(e), seconds=time.perf_counter() - t0)
        if show is not None:
            show(report)
        if report.checks and report.checks[0].name == "runs on probe inputs" and report.checks[0].passed is False:
            return _row(path, "error", finding=f"the call raised: {report.checks[0].detail}",
                        seconds=time.perf_counter() - t0)
        failed = [c.name for c in report.failures] + ([c.name for c in report.warnings] if strict else [])
        return _row(path, "ok" if report.ok else "not ok", report.ok, "; ".join(failed), report.summary(),
                    time.perf_counter() - t0)
    except _Timeout:
        return _row(path, "timeout", finding=f"no answer within {timeout:g} s (an endless loop?)",
                    seconds=time.perf_counter() - t0)
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _worker_argv(path: Path, name: str | None, opts: dict) -> list[str]:
    argv = [sys.executable, "-m", "multihead.apps.grade", str(path), "--name", name or "", "--call", opts["call"]]
    for k in ("init", "mask", "embed_dim"):
        if opts.get(k) is not None:
            argv += [f"--{k.replace('_', '-')}", str(opts[k])]
    argv += ["--timeout", str(opts.get("timeout", 60.0))]
    argv += ["--causal"] * bool(opts.get("causal")) + ["--strict"] * bool(opts.get("strict"))
    return argv


def grade_many(files: list[tuple[Path, str | None]], *, timeout: float = 60.0, jobs: int | None = None,
               **opts) -> list[dict]:
    """Each file graded in its own process (1 thread each) with ``timeout`` seconds; rows in order."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    def one(item):
        path, name = item
        t0 = time.perf_counter()
        try:
            r = subprocess.run(_worker_argv(path, name, opts), capture_output=True, text=True, timeout=timeout + 30,
                               env=env)
        except subprocess.TimeoutExpired:
            return _row(path, "timeout", finding=f"no answer within {timeout:g} s (an endless loop?)",
                        seconds=time.perf_counter() - t0)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            return _row(path, "error", finding=f"the grading process ended with code {r.returncode}: {tail}",
                        seconds=time.perf_counter() - t0)
        return json.loads(lines[-1])

    opts = {**opts, "timeout": timeout}
    with ThreadPoolExecutor(max_workers=jobs or max(1, min(4, os.cpu_count() or 1))) as pool:
        return list(pool.map(one, files))


def table(rows: list[dict]) -> str:
    w = max([len(Path(r["file"]).name) for r in rows] + [4])
    lines = [f"{'file':<{w}}  {'status':<7}  finding", "-" * (w + 40)]
    for r in rows:
        lines.append(f"{Path(r['file']).name:<{w}}  {r['status']:<7}  {r['finding'] or r['failed']}")
    n_ok = sum(r["ok"] for r in rows)
    lines.append(f"\n{n_ok} of {len(rows)} OK")
    return "\n".join(lines)


def write_report(rows: list[dict], path: Path) -> None:
    """CSV or JSON by the suffix; both load back (csv.DictReader, json.load) to the same rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(rows, indent=1))
        return
    if path.suffix.lower() != ".csv":
        raise ValueError(f"--report must end in .csv or .json; got {path}")
    with path.open("w", newline="") as f:
        wr = csv.DictWriter(f, FIELDS)
        wr.writeheader()
        wr.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    """The per-file worker: grades one file and prints its row as one JSON line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m multihead.apps.grade")
    p.add_argument("file")
    p.add_argument("--name", default="")
    p.add_argument("--init", default=None)
    p.add_argument("--call", default="qkv")
    p.add_argument("--mask", default=None)
    p.add_argument("--embed-dim", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--strict", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    row = grade_file(Path(a.file), a.name, init=a.init, call=a.call, mask=None if a.mask in (None, "none") else a.mask,
                     causal=a.causal, embed_dim=a.embed_dim, strict=a.strict, timeout=a.timeout)
    sys.stdout.flush()
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
