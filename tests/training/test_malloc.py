"""train_lm's re-execution with huge-page malloc (levanter/utils/malloc.py)."""

import os
import subprocess
import sys

import pytest

from levanter.utils.malloc import _thp_possible, hugepage_tunables


@pytest.mark.parametrize(
    "current,libc,expected",
    [
        (None, "glibc 2.36", "glibc.malloc.hugetlb=1"),
        ("", "glibc 2.35", "glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2", "glibc 2.39", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2:", "glibc 3.0", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.hugetlb=0", "glibc 2.36", None),  # the user's value wins
        ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "glibc 2.36", None),  # already re-executed
        (None, "glibc 2.34", None),  # no such tunable before 2.35
        (None, "glibc 2.x", None),
        (None, "musl 1.2", None),
        (None, None, None),
        (None, "", None),
    ],
)
def test_hugepage_tunables(current, libc, expected):
    assert hugepage_tunables(current, libc) == expected


SCRIPT = (
    "import os; from levanter.utils.malloc import reexec_with_hugepage_malloc as r; "
    "print('run', os.getpid(), os.environ.get('GLIBC_TUNABLES'), flush=True); r()"
)


def _runs(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LEVANTER_MALLOC_HUGETLB")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line.split(" ", 2) for line in out.stdout.splitlines()]


def test_the_process_reexecutes_itself_once_with_the_tunable():
    applies = (
        sys.platform == "linux"
        and hugepage_tunables(None, os.confstr("CS_GNU_LIBC_VERSION")) is not None
        and _thp_possible()
    )
    runs = _runs({})
    if not applies:
        assert [r[2] for r in runs] == ["None"]
        return
    # the same process (exec keeps the pid), a second time with the tunable, and no third time
    assert [r[2] for r in runs] == ["None", "glibc.malloc.hugetlb=1"]
    assert runs[0][1] == runs[1][1]
    # opted out, or the user's own value: no re-execution
    assert [r[2] for r in _runs({"LEVANTER_MALLOC_HUGETLB": "0"})] == ["None"]
    assert [r[2] for r in _runs({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})] == ["glibc.malloc.hugetlb=0"]
