"""Errors every entry point reports the same way, and their exit statuses.

A user error (a bad config value or input file) is a ``ValueError`` or ``FileNotFoundError`` and exits
with 2; a run that failed (unreadable data, a NaN, a failed save) exits with 1; a preempted run that
checkpointed exits with 75. Running out of disk space is neither the user's config nor a bug in the run:
it gets its own status, 74 (``EX_IOERR``), and a message saying which path filled up, so that a launcher
can tell "free space and rerun" apart from "fix the config". Storage that turned read-only under a run (a
filesystem remounted read-only after an I/O error, a snapshot mount) is the same kind of trouble and gets
the same status: :class:`ReadOnlyStorageError`, naming the directory.

Storage errors reach us in two shapes: ``OSError`` from Python's own I/O, and ``ValueError`` from
tensorstore whose text carries the errno (``[OS error 28: ...]`` in older releases,
``[os_error_code='28']`` in current ones). :func:`is_out_of_space` recognises every shape.
"""

from __future__ import annotations

import errno
import re

__all__ = ["OUT_OF_SPACE_EXIT_CODE", "OutOfSpaceError", "ReadOnlyStorageError", "is_out_of_space",
           "is_read_only_storage", "out_of_space_error", "read_only_storage_error"]

OUT_OF_SPACE_EXIT_CODE = 74  # EX_IOERR


class OutOfSpaceError(OSError):
    """A write failed because the filesystem (or quota) is full. Its message names the path."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ReadOnlyStorageError(OSError):
    """A write failed because the filesystem holding the path is read-only. Its message names the directory."""

    def __init__(self, message: str):
        super().__init__(errno.EROFS, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


_TS_ERRNO = re.compile(r"os_error_code='?(\d+)'?|\[OS error (\d+)")


def _has_errno(err: BaseException | None, codes: tuple[int, ...], texts: tuple[str, ...], kind: type) -> bool:
    """Whether ``err`` or an exception it was raised from is ``kind``, an ``OSError`` with one of ``codes``,
    or a tensorstore error whose text carries one of them (or one of ``texts``)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, kind):
            return True
        if isinstance(err, OSError) and err.errno in codes:
            return True
        text = str(err)
        for m in _TS_ERRNO.finditer(text):
            if int(m.group(1) or m.group(2)) in codes:
                return True
        if any(t in text for t in texts):
            return True
        err = err.__cause__ or err.__context__
    return False


def is_out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a full disk or an exceeded quota."""
    return _has_errno(err, (errno.ENOSPC, errno.EDQUOT), ("No space left on device", "Disk quota exceeded"),
                      OutOfSpaceError)


def is_read_only_storage(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a write refused by a read-only filesystem."""
    return _has_errno(err, (errno.EROFS,), ("Read-only file system",), ReadOnlyStorageError)


def out_of_space_error(what: str, path: str) -> OutOfSpaceError:
    """The one message for a full disk: what was being written, where, and what to do."""
    return OutOfSpaceError(
        f"out of disk space while {what} at {path}: No space left on device. Nothing half-written is kept; "
        "free space (or point the run elsewhere) and rerun."
    )


def read_only_storage_error(what: str, path: str, directory: str) -> ReadOnlyStorageError:
    """The one message for a read-only filesystem: the directory, what was being written there, what to do."""
    return ReadOnlyStorageError(
        f"{directory} is on a read-only filesystem (Read-only file system) while {what} at {path}. Nothing "
        f"half-written is kept; make {directory} writable again (or point the run elsewhere) and rerun."
    )
