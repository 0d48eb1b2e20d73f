"""A pytest plugin (loaded by conftest.py): under CI (.ci/run sets CI=true), where `make test` installed every extra,
a test skipped for a missing install is reported as failed -- such a skip turned a broken install step green (as
`make chromium` swallowing apt's failure did: the browser tests then skipped)."""

from __future__ import annotations

import os

import pytest

#: skip reasons that say something `make test` installs is missing (an extra, a registry wheel, Debian's chromium)
MISSING_INSTALL = ("not installed", "could not import", "No module named", "(make test downloads it)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (.ci/run, CI=true), where `make test` installed every extra, a skip for a missing install is a failure:
    such a skip turned a broken install step green (as `make chromium` swallowing apt's failure did)."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and isinstance(report.longrepr, tuple) \
            and any(m in report.longrepr[2] for m in MISSING_INSTALL):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where make test installs everything: {report.longrepr[2]}"
