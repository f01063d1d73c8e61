"""A test whose pytest-xdist worker process dies runs once more, in a fresh worker; a second death fails it.

The suite compiles thousands of XLA:CPU programs per worker, and on rare runs a worker that had run
hundreds of tests has died inside XLA itself (a segmentation fault or an abort in the compiler, or in
serializing an executable for the persistent compilation cache), mostly while compiling the first program
of ``tests/models/test_quantization.py``'s fp8 resume test; that test alone, its file alone, and the slice
plans (which load libtpu into the worker) followed by it never crashed in repeated runs. A dead worker
fails the test it was running with no Python traceback to act on, so one such crash in XLA turned a whole
CI run red. Here the controller reschedules that test once (xdist's
``pytest_handlecrashitem``); the crash still prints its native stack (faulthandler) where it happened, the
test is reported as ``rerun`` (letter ``R``), and the summary names it with the worker that died. A test
that kills its worker twice fails as before, so a crash this project's code causes every time is still
caught. ``tests/conftest.py`` registers these hooks; ``tests/project/test_crash_rerun.py`` runs a pytest
with a test that crashes once and one that always does.
"""

from __future__ import annotations

import pytest

__all__ = ["RERUN", "pytest_handlecrashitem", "pytest_report_teststatus", "summarize"]

RERUN = "rerun"  # the outcome of a crashed test's first report
# The tests rescheduled after a crash, and the worker that died running each (the controller's).
_rerun: dict[str, str] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist's controller, after a worker died running ``crashitem``: run it again once."""
    if crashitem in _rerun:
        return None  # the second crash: reported as the failure xdist made of it
    _rerun[crashitem] = str(getattr(report, "longrepr", ""))
    sched.mark_test_pending(crashitem)
    report.outcome = RERUN
    return True


def pytest_report_teststatus(report, config):
    if report.outcome == RERUN:
        return RERUN, "R", ("RERUN", {"yellow": True})
    return None


def summarize(terminalreporter) -> None:
    """The summary's list of the tests that were run again after their worker died."""
    if not _rerun:
        return
    terminalreporter.write_sep("=", "tests run again after their worker process died", yellow=True)
    for nodeid, why in _rerun.items():
        terminalreporter.write_line(f"{nodeid}: {why}; the worker's native stack is printed above")
