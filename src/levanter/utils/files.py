"""Files and small objects on local disk, ``gs://``, ``s3://`` and ``memory://``: read, list, delete.

Local paths (and ``file://`` URLs) go through ``os``; object stores through fsspec
(:mod:`levanter.utils.fs_clients`). Every object-store call is retried on transient errors
(:func:`levanter.utils.storage_errors.retry_transient`). Array data does not go through here but through
tensorstore (:mod:`levanter.utils.ts_spec`). ``memory://`` small files live in fsspec's process-wide
memory filesystem (tests).

Writes that readers see whole (:mod:`levanter.utils.atomic_writes`) and the start-up access checks
(:mod:`levanter.utils.access_checks`) are modules of their own.

Trade-off: listings and ``exists`` are not cached (``use_listings_cache=False``): a commit protocol that
reads back what another process just wrote must see it, at the cost of a request per call.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from typing import Any

from .fs_clients import filesystem
from .paths import abspath, is_url, url_scheme
from .storage_errors import retry_transient

__all__ = [
    "exists",
    "isfile",
    "isdir",
    "listdir",
    "read_bytes",
    "read_text",
    "remove",
    "remove_tree",
    "makedirs",
    "mtime",
    "glob_detail",
    "glob",
    "info",
    "size",
]


def _ask(path: str | os.PathLike, local: Callable[[str], Any], method: str, what: str) -> Any:
    """``local(absolute path)`` for a local ``path``; else the fsspec filesystem's ``method`` on it, retried
    on transient errors (``what`` names the call in an error)."""
    path = os.fspath(path)
    if not is_url(path):
        return local(abspath(path))
    fs, p = filesystem(path)
    return retry_transient(getattr(fs, method), p, what=f"{what} {path}")


def exists(path: str | os.PathLike) -> bool:
    return _ask(path, os.path.exists, "exists", "exists")


def isfile(path: str | os.PathLike) -> bool:
    return _ask(path, os.path.isfile, "isfile", "isfile")


def isdir(path: str | os.PathLike) -> bool:
    """Locally a directory; on object stores any key under ``path/``."""
    path = os.fspath(path)
    if not is_url(path):
        return os.path.isdir(abspath(path))
    try:
        return len(listdir(path)) > 0
    except FileNotFoundError:
        return False


def listdir(path: str | os.PathLike) -> list[str]:
    """Names of the files and "directories" directly under ``path``, sorted; ``FileNotFoundError`` when
    there are none (object stores have no empty directories)."""
    path = os.fspath(path)
    if not is_url(path):
        return sorted(os.listdir(abspath(path)))
    fs, p = filesystem(path)
    p = p.rstrip("/")
    try:
        entries = retry_transient(fs.ls, p, detail=False, what=f"list {path}")
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such directory", path) from None
    names = set()
    for e in entries:
        e = e.rstrip("/")
        if e == p:
            continue  # some filesystems list a file as itself
        name = e.rsplit("/", 1)[-1]
        if name:
            names.add(name)
    if not names:
        raise FileNotFoundError(errno.ENOENT, "no such directory", path)
    return sorted(names)


def read_bytes(path: str | os.PathLike) -> bytes:
    """The content of ``path``; ``FileNotFoundError`` when absent."""
    path = os.fspath(path)
    if not is_url(path):
        with open(abspath(path), "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    try:
        return retry_transient(fs.cat_file, p, what=f"read {path}")
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such file", path) from None


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode("utf-8")


def remove(path: str | os.PathLike, missing_ok: bool = True) -> None:
    path = os.fspath(path)
    if not is_url(path):
        try:
            os.unlink(abspath(path))
        except FileNotFoundError:
            if not missing_ok:
                raise
        return
    fs, p = filesystem(path)
    if not missing_ok and not exists(path):  # S3 answers a delete of a missing key with success
        raise FileNotFoundError(errno.ENOENT, "no such file", path)
    try:
        retry_transient(fs.rm_file, p, what=f"remove {path}")
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a local directory tree, or every object under the prefix ``path/`` (absent: nothing)."""
    path = os.fspath(path)
    if not is_url(path):
        if os.path.isdir(abspath(path)):
            shutil.rmtree(abspath(path))
        return
    fs, p = filesystem(path)
    p = p.rstrip("/")
    try:
        keys = retry_transient(fs.find, p + "/", what=f"list {path}")
    except FileNotFoundError:
        return
    if keys:
        retry_transient(fs.rm, keys, what=f"remove {path}")


def makedirs(path: str | os.PathLike) -> None:
    """Create a local directory and its parents; a no-op for URLs (object stores have no directories)."""
    path = os.fspath(path)
    if not is_url(path):
        os.makedirs(abspath(path), exist_ok=True)


def mtime(path: str | os.PathLike) -> float:
    """Modification time of ``path`` in seconds since the epoch."""
    path = os.fspath(path)
    if not is_url(path):
        return os.path.getmtime(abspath(path))
    fs, p = filesystem(path)
    info = retry_transient(fs.info, p, what=f"stat {path}")
    for k in ("LastModified", "updated", "mtime", "created"):
        v = info.get(k)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if hasattr(v, "timestamp"):
            return v.timestamp()
        if isinstance(v, str):
            from datetime import datetime

            return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
    return fs.modified(p).timestamp()


def _url_of(scheme: str, fs_path: str) -> str:
    if scheme == "memory":
        return f"memory://{fs_path.lstrip('/')}"
    return f"{scheme}://{fs_path}"


def glob_detail(pattern: str | os.PathLike) -> dict[str, bool]:
    """``{path or URL: is_directory}`` for everything matching the glob ``pattern``, in sorted order.
    Local matches are absolute paths; URL matches keep the pattern's scheme."""
    pattern = os.fspath(pattern)
    fsys, p = filesystem(pattern)
    matches = retry_transient(fsys.glob, p, detail=True, what=f"glob {pattern}")
    scheme = url_scheme(pattern) if is_url(pattern) else ""
    out = {}
    for m in sorted(matches):
        name = _url_of(scheme, m) if scheme else m
        out[name] = matches[m].get("type") == "directory"
    return out


def glob(pattern: str | os.PathLike) -> list[str]:
    """Paths/URLs matching ``pattern`` (with the pattern's scheme), sorted."""
    return list(glob_detail(pattern))


def info(path: str | os.PathLike) -> dict:
    """fsspec's ``info`` of ``path`` (``size``, ``type`` and the store's own fields such as ``mtime``,
    ``LastModified``, ``updated``, ``ETag``); ``FileNotFoundError`` when absent."""
    fsys, p = filesystem(path)
    return retry_transient(fsys.info, p, what=f"stat {path}")


def size(path: str | os.PathLike) -> int:
    return int(_ask(path, os.path.getsize, "size", "stat"))
