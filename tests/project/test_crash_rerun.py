"""tests/crash_rerun.py in a pytest of its own: a test that kills its xdist worker once passes on its rerun
and is named in the summary; one that kills it every time fails."""

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFTEST = f"""
import sys
sys.path.insert(0, {TESTS!r})
from crash_rerun import pytest_handlecrashitem, pytest_report_teststatus, summarize


def pytest_terminal_summary(terminalreporter):
    summarize(terminalreporter)
"""

TESTS_SOURCE = """
import faulthandler
import os
import pathlib


def test_dies_on_its_first_run():
    mark = pathlib.Path(os.environ["CRASH_MARKS"]) / "died"
    if not mark.exists():
        mark.touch()
        faulthandler._sigsegv()  # what a segmentation fault inside XLA does to the worker


def test_passes():
    pass


def test_dies_every_time():
    if os.environ.get("DIE_EVERY_TIME"):
        faulthandler._sigsegv()
"""


def _pytest(tmp_path, **env):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_workers.py").write_text(textwrap.dedent(TESTS_SOURCE))
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    environ.update(CRASH_MARKS=str(marks), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                           "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=300)


def test_a_test_that_kills_its_worker_once_passes_on_its_rerun_and_is_named(tmp_path):
    done = _pytest(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "3 passed, 1 rerun" in out, out
    summary = out.split("tests run again after their worker process died", 1)[1]
    assert "test_workers.py::test_dies_on_its_first_run: worker 'gw" in summary, out
    assert "test_passes" not in summary


def test_a_test_that_kills_its_worker_every_time_fails(tmp_path):
    done = _pytest(tmp_path, DIE_EVERY_TIME="1")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "FAILED test_workers.py::test_dies_every_time" in out, out
    assert "crashed while running 'test_workers.py::test_dies_every_time'" in out, out
    assert "2 passed" in out and "1 failed" in out, out
