"""What a failed read says about the storage, and the error for a damaged cache.

tensorstore reports a storage failure as a ``ValueError`` whose text starts with an absl status code
(``NOT_FOUND``, ``DATA_LOSS``, ``UNAVAILABLE``, ...) and names the chunk file. :func:`storage_fault` reads
that text (or an ``OSError``) into a :class:`StorageFault`: which chunk, which cache holds it
(:func:`cache_root`, the directory to delete to rebuild), whether it is damage (missing or corrupt) or
may pass (unavailable), and the advice for the user. The loader retries what may pass and names the
damaged cache otherwise; opening a store reports damage as :class:`DamagedStoreError`.

On an object store tensorstore names a chunk by its key inside the bucket (``cache/train/input_ids/...``),
which reads like a local path. Every store opened in this process is noted (:func:`note_store`), and a
chunk key under one of them is named by its full URL (``s3://bucket/cache/train/...``). A missing chunk of
a bucket that no longer exists is reported as that, not as a damaged cache.

Trade-off: parsing error text depends on tensorstore's wording, which is not an API; the status code at
the start is stable, the chunk name is best effort (a message without it names "a chunk"), and an
unrecognised message is treated as a bug (``None``), never as damage, so no cache is condemned by a
misread.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

from ..utils import fs

__all__ = [
    "DamagedStoreError",
    "cache_root",
    "note_store",
    "damaged_error",
    "status_text",
    "StorageFault",
    "storage_fault",
    "MISSING",
]


class DamagedStoreError(ValueError):
    """A store (or the cache holding it) is missing files or holds unreadable ones: delete it to rebuild."""


# The stores opened in this process on an object store or in memory: their key inside the bucket (what
# tensorstore's messages name) -> their URL. A handful per run; never pruned.
_KEY_TO_URL: dict[str, str] = {}


def note_store(path: str | os.PathLike) -> None:
    """Remember the store at ``path`` so that failures naming its chunks by their keys inside the bucket
    name them by their full URL (see :func:`storage_fault`). Local paths need nothing."""
    path = os.fspath(path).rstrip("/")
    if fs.is_url(path):
        _KEY_TO_URL[fs.kvstore_key(path)] = path


def _full_url(chunk: str) -> str:
    """``chunk`` (a key as tensorstore names it) as the URL of a noted store's object, when it is one."""
    if "://" in chunk or os.path.isabs(chunk):
        return chunk
    best = ""
    for key in _KEY_TO_URL:
        if (chunk == key or chunk.startswith(key + "/")) and len(key) > len(best):
            best = key
    return _KEY_TO_URL[best] + chunk[len(best):] if best else chunk


def cache_root(store_path: str) -> str:
    """The directory to delete to rebuild the store at ``store_path``: the token cache holding it (the
    nearest directory up to two levels above with a ``shard_ledger.json``), else the store itself."""
    p = os.fspath(store_path).rstrip("/")
    up = p
    for _ in range(3):
        try:
            if fs.isfile(fs.join(up, "shard_ledger.json")):
                return up
        except Exception:  # an unreachable store: name the store itself
            return p
        up = fs.parent(up)
    return p


def damaged_error(store_path: str, what: str) -> DamagedStoreError:
    """The error for the store at ``store_path`` missing or holding unreadable files (``what``): it names
    the cache to delete."""
    root = cache_root(store_path)
    return DamagedStoreError(f"the cache at {root} is damaged ({what}); delete it to rebuild")


# -- storage errors ----------------------------------------------------------------------------------
# tensorstore's status codes that mean "the storage did not deliver this chunk", as opposed to a bad
# request (INVALID_ARGUMENT, OUT_OF_RANGE: a bug). On object storage every one of them may pass, so a
# reader retries them all; a chunk that stays missing or corrupt means the cache is damaged.
MISSING = "NOT_FOUND"
_CORRUPT = ("DATA_LOSS", "FAILED_PRECONDITION")
_UNREADABLE = ("PERMISSION_DENIED",)
_UNAVAILABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED", "CANCELLED", "UNKNOWN",
                "INTERNAL")
_STORAGE_CODES = (MISSING, *_CORRUPT, *_UNREADABLE, *_UNAVAILABLE)
_STATUS = re.compile(r"^([A-Z][A-Z_]+): ")
_QUOTED = re.compile(r'"([^"]+)"')
_CHUNK_INDEX = re.compile(r"chunk \{([\d, ]+)\}")


_PAYLOAD = re.compile(r" \[[A-Za-z_ ]+='")


def status_text(err: BaseException) -> str:
    """tensorstore's message without its trailing payloads (``[tensorstore_spec='...']``, source
    locations), which repeat the open spec in JSON."""
    return _PAYLOAD.split(str(err), 1)[0].strip()


@dataclasses.dataclass(frozen=True)
class StorageFault:
    """What a failed read says about the storage: see :func:`storage_fault`."""

    code: str  # tensorstore's status code ("NOT_FOUND", "DATA_LOSS", ...), or "OS_ERROR"
    chunk: str | None  # the chunk's file or key, when the message names it
    store: str | None  # the store holding the chunk (from the chunk's path), when it looks like one
    detail: str  # the message

    @property
    def cache(self) -> str | None:
        """The directory to delete to rebuild (see :func:`cache_root`). Found on demand, for a message:
        it reads the storage, and classifying a failure (which the loader does for every retry, often
        while that storage is not answering) must not."""
        return cache_root(self.store) if self.store else None

    @functools.cached_property
    def gone_bucket(self) -> str | None:
        """``scheme://bucket`` when the chunk is missing because its whole bucket no longer exists (asked of
        the store on demand, for a message), else None."""
        if self.code != MISSING or not self.store or not fs.bucket_missing(self.store):
            return None
        return self.store[: self.store.index("://") + 3] + fs.bucket_and_key(self.store)[0]

    @property
    def damaged(self) -> bool:
        """A missing or corrupt chunk: if it outlasts the retries, the cache must be rebuilt."""
        return self.code == MISSING or self.code in _CORRUPT

    def what(self) -> str:
        """``chunk <file> is missing`` and the like, for a message."""
        chunk = f"chunk {self.chunk}" if self.chunk else "a chunk"
        if self.code == MISSING:
            return f"{chunk} is missing"
        if "Digest mismatch" in self.detail:
            return f"{chunk} is corrupt (checksum mismatch)"
        if self.code in _CORRUPT:
            return f"{chunk} is corrupt ({self.detail})"
        if self.code in _UNREADABLE:
            return f"{chunk} cannot be read (permission denied)"
        return f"{chunk} cannot be read ({self.detail})"

    def advice(self) -> str:
        where = self.cache or "the cache"
        gone = self.gone_bucket
        if gone:
            return (f"the bucket {gone} no longer exists (deleted, or not visible with these credentials): "
                    "recreate it and rerun, which rebuilds the cache, or point data.cache_dir at a bucket that "
                    "exists")
        if self.damaged:
            return f"the cache is damaged: delete {where} to rebuild it"
        if self.code in _UNREADABLE:
            return f"give the run read access to {where}, or delete it to rebuild it"
        return "the storage did not answer; rerun once it does (the run resumes from its last checkpoint)"


def storage_fault(err: BaseException) -> StorageFault | None:
    """The storage failure behind ``err`` (a tensorstore ``ValueError`` or an ``OSError``), or None when
    ``err`` is not one (a bug or a bad request, which retrying cannot fix)."""
    if isinstance(err, OSError):
        name = getattr(err, "filename", None)
        chunk = os.fspath(name) if name else None
        code = {2: MISSING, 13: "PERMISSION_DENIED"}.get(err.errno or 0, "UNAVAILABLE")
        return StorageFault(code, chunk, _store_of(chunk), err.strerror or str(err))
    if not isinstance(err, ValueError):
        return None
    text = status_text(err)
    m = _STATUS.match(text)
    if m is None or m.group(1) not in _STORAGE_CODES:
        return None
    code = m.group(1)
    raw = str(err)
    if code in ("UNKNOWN", "INTERNAL") and "os_error" not in raw and "OS error" not in raw:
        return None  # an internal failure without an OS error behind it: a bug, not the storage
    quoted = _QUOTED.search(text)
    chunk = _full_url(quoted.group(1)) if quoted else None
    if chunk is None:
        idx = _CHUNK_INDEX.search(text)
        chunk = f"{{{idx.group(1)}}}" if idx else None
    detail = text[m.end():]
    if quoted is not None and '": ' in detail:  # 'Error reading local file "...": <the reason>'
        detail = detail.rsplit('": ', 1)[-1]
    return StorageFault(code, chunk, _store_of(chunk), detail)


def _store_of(chunk: str | None) -> str | None:
    """The store holding ``chunk`` (``<store>/<array>/c/<key>``), or None if it does not look like one.
    A string operation: it reads nothing."""
    if not chunk or "/c/" not in chunk:
        return None
    array_dir = chunk.rsplit("/c/", 1)[0]
    return array_dir.rsplit("/", 1)[0] if "/" in array_dir else array_dir
