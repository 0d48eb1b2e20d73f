"""tests/ci_skips.py, run by pytest on tests written here: under CI a skip for a missing install fails and says
why; a skip for what the machine is (it cannot confine) stays a skip; outside CI nothing changes."""

from __future__ import annotations

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_package_missing():
    pytest.skip("the pretrained MiniLM package is not installed")

def test_module_missing():
    pytest.importorskip("no_such_module_for_multihead")

def test_the_machine():
    pytest.skip("this machine cannot confine")
"""


def test_a_skip_for_a_missing_install_fails_under_ci(pytester, monkeypatch):
    pytester.makepyfile(TESTS)
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_inprocess("-p", "ci_skips", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, skipped=1)
    result.stdout.fnmatch_lines(["*skipped under CI, where make test installs everything*not installed*"])
    monkeypatch.delenv("CI")
    pytester.runpytest_inprocess("-p", "ci_skips", "-p", "no:cacheprovider").assert_outcomes(skipped=3)
