"""The README's tour runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_quick_start_is_the_two_commands():
    text = README.read_text()
    block = re.search(r"## Quick start\s+```sh\n(.*?)```", text, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make demo", "make test"]


def test_readme_tour_runs(capsys):
    text = README.read_text()
    tour = re.search(r"## A short tour\s+```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(tour, "README tour", "exec"), ns)
    assert tuple(ns["out"].shape) == (2, 8, 7, 12) and tuple(ns["w"].shape) == (2, 8, 7, 9)
    assert "runs: sdpa" in capsys.readouterr().out
