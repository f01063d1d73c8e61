"""Atomic file replacement: nothing a user keeps (ledgers, metrics, checkpoint metadata, corpus files)
is ever left half-written.

``atomic_write_bytes`` writes a temporary file in the target's directory, fsyncs it, renames it over the
target (readers see the old file or the whole new one) and fsyncs the directory so that the rename
itself survives a power loss. A failure removes the temporary file and leaves the old one untouched.
"""

from __future__ import annotations

import os
import tempfile


def fsync_dir(path: str) -> None:
    """Make renames inside ``path`` durable (best effort: some filesystems refuse directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` by a file holding ``data``, atomically and durably."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # mkstemp creates 0600; give the permissions an ordinary write would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def probe_writable(directory: str) -> None:
    """Create ``directory`` (and its parents) and write and delete a probe file in it; raises the
    ``OSError`` of whichever step failed. Entry points call it before any work, so that a directory that
    cannot be written fails in seconds, naming its config key, instead of after a cache build."""
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as f:
        f.write(b"ok")
        f.flush()


def remove_stale_temporaries(directory: str, name: str) -> list[str]:
    """Delete what interrupted :func:`atomic_write_bytes` calls for ``name`` left in ``directory``
    (``.<name>.<random>.tmp``); returns the removed paths. Call it where a run resumes."""
    prefix = "." + name + "."
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        if entry.startswith(prefix) and entry.endswith(".tmp"):
            path = os.path.join(directory, entry)
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed
