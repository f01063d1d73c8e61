"""Writes that readers see whole: atomic replacement, create-if-absent, and the leftovers of interrupted
local writes.

Locally, :func:`atomic_write_bytes` writes a temporary file in the target's directory, fsyncs it, renames
it over the target and fsyncs the directory, so readers see the old file or the whole new one, even after
a power loss. Object stores have no rename, but a single PUT is atomic there: readers see the old object
or the new one. :func:`create_exclusive` creates a file only if absent (a hard link locally, a
conditional PUT on object stores): the primitive of the run lock and the build lock.

Trade-off: every local write pays two fsyncs (the file and its directory); the files written this way
are small (ledgers, metadata, locks), where durability matters more than the milliseconds.
"""

from __future__ import annotations

import os
import tempfile
import threading

from .fs_clients import filesystem
from .paths import abspath, is_url, url_scheme
from .storage_errors import is_precondition_failure, retry_transient

__all__ = [
    "fsync_dir",
    "atomic_write_bytes",
    "atomic_write_text",
    "create_exclusive",
    "remove_stale_temporaries",
]

_MEMORY_LOCK = threading.Lock()


def fsync_dir(path: str) -> None:
    """Make renames inside the local directory ``path`` durable (best effort: some filesystems refuse
    directory fsync; a no-op for URLs)."""
    if is_url(path):
        return
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


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` by an object/file holding ``data``, atomically (and durably, locally)."""
    path = os.fspath(path)
    if is_url(path):
        fs, p = filesystem(path)
        retry_transient(fs.pipe_file, p, bytes(data), what=f"write {path}")
        return
    path = abspath(path)
    tmp = _durable_temporary(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_if_present(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def _durable_temporary(path: str, data: bytes, mode: int) -> str:
    """A temporary file ``.<name>.<random>.tmp`` beside the local ``path``, holding ``data``, fsynced, with
    permissions ``mode``: what a rename or a hard link then puts in place whole. Removed if writing fails."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # mkstemp creates 0600; give the permissions an ordinary write would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_if_present(tmp)
        raise
    return tmp


def _unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def create_exclusive(path: str | os.PathLike, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist: True if this call created it, False if
    it existed. Locally a hard link of a finished temporary file (so the file appears whole); on S3 a PUT
    with ``If-None-Match: *``; on GCS an upload with ``ifGenerationMatch=0``."""
    path = os.fspath(path)
    if not is_url(path):
        path = abspath(path)
        tmp = _durable_temporary(path, data, 0o644)
        try:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            fsync_dir(os.path.dirname(path))
            return True
        finally:
            _unlink_if_present(tmp)
    fs, p = filesystem(path)
    if url_scheme(path) == "memory":
        with _MEMORY_LOCK:
            if fs.exists(p):
                return False
            fs.pipe_file(p, bytes(data))
            return True

    tries = []

    def attempt() -> bool:
        tries.append(1)
        try:
            fs.pipe_file(p, bytes(data), mode="create")
            return True
        except Exception as e:
            if not is_precondition_failure(e):
                raise
            # A retry after an answer that was lost (a timeout, a dropped connection) can find the object
            # this call created: the content tells (callers write something unique, such as a run id).
            if len(tries) > 1:
                try:
                    return fs.cat_file(p) == bytes(data)
                except FileNotFoundError:
                    return False
            return False

    return retry_transient(attempt, what=f"create {path}")


def remove_stale_temporaries(directory: str, name: str) -> list[str]:
    """Delete what interrupted local :func:`atomic_write_bytes` calls for ``name`` left in ``directory``
    (``.<name>.<random>.tmp``); returns the removed paths. Call it where a run resumes. Object stores
    leave no temporaries (a PUT is all or nothing): nothing to do there."""
    if is_url(directory):
        return []
    directory = abspath(directory)
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
