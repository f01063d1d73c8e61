"""Whether a process on this host still runs: what the run lock and the cache build lock ask of a holder
they find, before taking its lock over."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["proc_stat", "pid_alive"]


def proc_stat(pid: int) -> Optional[list[str]]:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    if ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def pid_alive(pid: int) -> bool:
    """True unless process ``pid`` is known to be gone (no such process, or a zombie that has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return True  # cannot tell: assume it lives
    fields = proc_stat(pid)
    return not (fields and fields[0] == "Z")
