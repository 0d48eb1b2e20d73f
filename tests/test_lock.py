"""The locked test environment: constraints.txt pins every package of every extra at a version
pyproject.toml's ranges admit, the Makefile installs through it, and a lock that does not fit the
ranges (or a line that is not an exact pin) is caught."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lockfile", ROOT / "tools" / "lockfile.py")
lockfile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lockfile)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_lock_fits_every_range_of_pyproject():
    pins = lockfile.read_lock((ROOT / "constraints.txt").read_text())
    assert lockfile.mismatches(PYPROJECT, pins) == []  # every requirement of every extra pinned, in its range


def test_a_lock_outside_the_ranges_is_caught():
    pins = lockfile.read_lock((ROOT / "constraints.txt").read_text())
    old = dict(pins, transformers="4.57.0")  # below the hf extra's >=5.0
    assert lockfile.mismatches(PYPROJECT, old) == [
        "transformers==4.57.0 in constraints.txt is outside extra 'hf''s range 'transformers>=5.0,<6'"]
    missing = {k: v for k, v in pins.items() if k != "hypothesis"}
    assert lockfile.mismatches(PYPROJECT, missing) == [
        "hypothesis (extra 'dev': 'hypothesis>=6.100') is not in constraints.txt"]
    assert lockfile.mismatches(PYPROJECT, dict(pins, torch="2.13.0+cu126")) == []  # a local build label admits


@pytest.mark.parametrize("line, why", [("transformers>=5.0", "is not 'name==version'"),
                                       ("torch==2.13.0\ntorch==2.13.0", "pinned twice")])
def test_a_lock_line_that_is_not_an_exact_pin_is_refused(line, why):
    with pytest.raises(ValueError, match=why):
        lockfile.read_lock(line)


def test_the_makefile_installs_through_the_lock():
    make = (ROOT / "Makefile").read_text()
    installs = [ln.strip() for ln in make.splitlines() if "pip install" in ln or ln.strip().startswith("$(PIP)")]
    # the test venv: every install but torch's own spec (TORCH_SPEC, for CUDA users) and test-latest's goes through -c
    locked = [ln for ln in installs if "-c $(LOCK)" in ln or ln.startswith("$(PIP)")]
    assert "PIP = $(BIN)/uv pip install -q --python $(BIN)/python -c $(LOCK)" in make
    assert "pip install -q -c $(LOCK) pip setuptools uv" in make  # the installers themselves from the lock
    assert any("-e '.[$(EXTRAS)]'" in ln for ln in locked)
    extras = re.search(r"^EXTRAS := (.+)$", make, re.M).group(1).split(",")
    assert sorted(extras) == sorted(PYPROJECT["project"]["optional-dependencies"])  # make test installs every extra
