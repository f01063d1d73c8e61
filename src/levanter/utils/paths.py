"""Paths and URLs as strings: which scheme a path has, and joining, splitting and normalising it.

Local paths (and ``file://`` URLs, and ``~``) go through ``os.path``; ``s3://``, ``gs://`` and ``memory://``
URLs are joined with ``/`` and keep their scheme. Nothing here touches storage, so these functions are
cheap and safe to call anywhere (config parsing included). Part of :mod:`levanter.utils.fs`, the one door
to storage: callers use ``fs.join`` and the like, not this module directly.

Trade-off: a URL is never normalised beyond stripping trailing slashes (no ``..`` resolution), because
an object store's keys are plain strings where ``a/../b`` is a key of its own.
"""

from __future__ import annotations

import os

__all__ = [
    "url_scheme",
    "is_url",
    "is_object_store",
    "expand_user",
    "abspath",
    "join",
    "parent",
    "basename",
    "supports_rename",
    "bucket_and_key",
    "is_in_process_store",
]

_OBJECT_SCHEMES = ("s3", "gs", "gcs", "memory")


def url_scheme(path: str) -> str:
    """The lower-cased scheme of ``path`` (``"s3"``, ``"gs"``, ``"memory"``, ``"file"``), ``""`` for a plain path."""
    path = os.fspath(path)
    if "://" not in path:
        return ""
    return path.split("://", 1)[0].lower()


def is_url(path: str | os.PathLike) -> bool:
    """An object-store or memory URL (``s3://``, ``gs://``, ``memory://``); not a local path or ``file://``."""
    s = url_scheme(os.fspath(path))
    return s != "" and s != "file"


def is_object_store(path: str | os.PathLike) -> bool:
    """A URL of a store this module reads and writes (``s3://``, ``gs://``, ``memory://``), as opposed to a
    local path or another scheme some reader understands (``embedded://``, ``http://``)."""
    return url_scheme(os.fspath(path)) in _OBJECT_SCHEMES


def is_in_process_store(path: str | os.PathLike) -> bool:
    """A store that lives inside this process (``memory://``): another process cannot read or write it."""
    return url_scheme(os.fspath(path)) == "memory"


def expand_user(path: str | os.PathLike) -> str:
    """``path`` with a leading ``~`` (or ``~user``) expanded when it is a local path (``file://`` kept);
    URLs and other strings unchanged. Every local path a config names goes through here (the helpers
    below, and :func:`levanter.config.expand_user_paths` for code that opens files itself), so
    ``cache_dir: ~/x`` means the home directory's ``x``, never a folder named ``~``."""
    path = os.fspath(path)
    if path.lower().startswith("file://"):
        rest = path[len("file://") :]
        return "file://" + os.path.expanduser(rest) if rest.startswith("~") else path
    if path.startswith("~") and not is_url(path):
        return os.path.expanduser(path)
    return path


def _strip_file(path: str) -> str:
    path = expand_user(path)
    if path.lower().startswith("file://"):
        return path[len("file://") :] or "/"
    return path


def abspath(path: str | os.PathLike) -> str:
    """A local path made absolute (``file://`` stripped, ``~`` expanded); URLs unchanged, without a trailing
    ``/``."""
    path = os.fspath(path)
    if is_url(path):
        scheme, rest = path.split("://", 1)
        rest = rest.rstrip("/")
        return f"{scheme.lower()}://{rest}"
    return os.path.abspath(os.path.expanduser(_strip_file(path)))


def join(base: str | os.PathLike, *parts: str) -> str:
    """``os.path.join`` for local paths, ``/``-joining for URLs."""
    base = os.fspath(base)
    if not is_url(base):
        return os.path.join(_strip_file(base), *parts)
    out = base.rstrip("/")
    for p in parts:
        p = os.fspath(p).strip("/")
        if p:
            out = out + "/" + p
    return out


def parent(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.dirname(_strip_file(path).rstrip(os.sep) or os.sep)
    scheme, rest = abspath(path).split("://", 1)
    head = rest.rsplit("/", 1)[0] if "/" in rest else rest
    return f"{scheme}://{head}"


def basename(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.basename(_strip_file(path).rstrip(os.sep))
    return abspath(path).split("://", 1)[1].rsplit("/", 1)[-1]


def supports_rename(path: str | os.PathLike) -> bool:
    """True for POSIX paths (commit by renaming a finished directory); False for object stores (commit by
    writing a small record last)."""
    return not is_url(path)


def bucket_and_key(path: str) -> tuple[str, str]:
    """``("bucket", "key/inside")`` of an object-store URL."""
    rest = abspath(path).split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key
