"""Errors every entry point reports the same way, and their exit statuses.

A user error (a bad config value or input file) is a ``ValueError`` or ``FileNotFoundError`` and exits
with 2; a run that failed (unreadable data, a NaN, a failed save) exits with 1; a preempted run that
checkpointed exits with 75. Running out of disk space is neither the user's config nor a bug in the run:
it gets its own status, 74 (``EX_IOERR``), and a message saying which path filled up, so that a launcher
can tell "free space and rerun" apart from "fix the config".

Storage errors reach us in two shapes: ``OSError`` from Python's own I/O, and ``ValueError`` from
tensorstore whose text carries the errno (``[OS error 28: ...]`` in older releases,
``[os_error_code='28']`` in current ones). :func:`is_out_of_space` recognises every shape.
"""

from __future__ import annotations

import errno
import re

__all__ = ["OUT_OF_SPACE_EXIT_CODE", "OutOfSpaceError", "is_out_of_space", "out_of_space_error"]

OUT_OF_SPACE_EXIT_CODE = 74  # EX_IOERR


class OutOfSpaceError(OSError):
    """A write failed because the filesystem (or quota) is full. Its message names the path."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


_TS_ERRNO = re.compile(r"os_error_code='?(\d+)'?|\[OS error (\d+)")


def is_out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a full disk or an exceeded quota."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OutOfSpaceError):
            return True
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        for m in _TS_ERRNO.finditer(text):
            code = int(m.group(1) or m.group(2))
            if code in (errno.ENOSPC, errno.EDQUOT):
                return True
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


def out_of_space_error(what: str, path: str) -> OutOfSpaceError:
    """The one message for a full disk: what was being written, where, and what to do."""
    return OutOfSpaceError(
        f"out of disk space while {what} at {path}: No space left on device. Nothing half-written is kept; "
        "free space (or point the run elsewhere) and rerun."
    )
