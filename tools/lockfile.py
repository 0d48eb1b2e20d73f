"""The test environment's lock: ``constraints.txt`` pins every package ``make test`` installs.

    python tools/lockfile.py check               # the lock against pyproject.toml's ranges (exit 1 on a mismatch)
    python tools/lockfile.py write .venv-latest  # freeze a green environment into constraints.txt

Users of the library get the ranges in ``pyproject.toml``; ``make test`` installs with
``pip install -c constraints.txt``, so a fresh clone next month installs what CI tested.
``make test-latest`` runs the suite on the newest releases the ranges allow; when it passes,
``make lock`` writes its environment here (see the README, "Refreshing the lock").

Only the standard library and ``packaging`` (which pip vendors, and the test extra installs).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
PYPROJECT = ROOT / "pyproject.toml"
#: installed by the Makefile before the project (the build backend and the installer itself)
TOOLS = ("pip", "setuptools", "uv")
HEADER = """\
# The test environment, locked: every package `make test` installs, at the version the suite was
# last green with (torch's local build label dropped: `torch==2.14.1` admits the CPU and CUDA builds).
# `make test` installs with `pip install -c constraints.txt`; the library's users get pyproject.toml's
# ranges. Refresh: `make test-latest` (the newest releases the ranges allow); when it passes, `make lock`.
# Checked against pyproject.toml by tests/test_lock.py (python tools/lockfile.py check).
"""


def canonical(name: str) -> str:
    """PEP 503 normalised name: 'Jinja2' -> 'jinja2', 'typing_extensions' -> 'typing-extensions'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(text: str) -> dict[str, str]:
    """{canonical name: version} from a constraints file; every line must be ``name==version``."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if m is None:
            raise ValueError(f"constraints line {n}: {raw!r} is not 'name==version'; a lock pins exact versions.")
        name = canonical(m.group(1))
        if name in pins:
            raise ValueError(f"constraints line {n}: {m.group(1)} is pinned twice.")
        pins[name] = m.group(2)
    return pins


def requirements(pyproject: dict) -> dict[str, list[str]]:
    """{where: [requirement strings]}: 'dependencies' and each extra of ``[project.optional-dependencies]``."""
    project = pyproject["project"]
    out = {"dependencies": list(project.get("dependencies", []))}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        out[f"extra {extra!r}"] = list(reqs)
    return out


def mismatches(pyproject: dict, pins: dict[str, str]) -> list[str]:
    """Why the lock does not fit the ranges, one line each (empty: it fits). Every requirement of
    every extra must be pinned to a version its specifier admits (markers that do not apply to this
    interpreter are skipped; local build labels such as '+cpu' are ignored, as pip ignores them)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    out = []
    for where, reqs in requirements(pyproject).items():
        for text in reqs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = canonical(req.name)
            if name not in pins:
                out.append(f"{req.name} ({where}: {text!r}) is not in constraints.txt")
                continue
            version = Version(pins[name])
            if not req.specifier.contains(Version(version.public), prereleases=True):
                out.append(f"{req.name}=={pins[name]} in constraints.txt is outside {where}'s range {text!r}")
    for tool in TOOLS:
        if tool not in pins:
            out.append(f"{tool} is not in constraints.txt (the Makefile installs it from the lock first)")
    return out


def freeze(venv: Path) -> dict[str, str]:
    """{name: version} of every package installed in ``venv`` except the project itself."""
    py = venv / "bin" / "python"
    text = subprocess.run([str(py), "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                          capture_output=True, text=True).stdout
    pins = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line.strip())
        if m is None or canonical(m.group(1)) == "multihead":
            continue
        pins[m.group(1)] = m.group(2).split("+", 1)[0]  # torch==2.13.0+cpu -> torch==2.13.0
    return pins


def write(venv: Path) -> None:
    pins = freeze(venv)
    body = "".join(f"{n}=={v}\n" for n, v in sorted(pins.items(), key=lambda kv: canonical(kv[0])))
    bad = mismatches(tomllib.loads(PYPROJECT.read_text()), read_lock(body))
    if bad:
        raise SystemExit("not written: the environment does not fit pyproject.toml:\n  " + "\n  ".join(bad))
    LOCK.write_text(HEADER + body)
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pins)} packages from {venv}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) == 1:
        bad = mismatches(tomllib.loads(PYPROJECT.read_text()), read_lock(LOCK.read_text()))
        for line in bad:
            print(line)
        return 1 if bad else 0
    if argv[:1] == ["write"] and len(argv) == 2:
        write(Path(argv[1]))
        return 0
    print("usage: python tools/lockfile.py check | write VENV", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
