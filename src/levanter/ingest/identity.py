"""Input-file identities: what a token cache records about each input file, and how a change is detected.

A local file's identity is its ``size``, modification time (``mtime``), status-change time (``ctime``),
``inode`` and the SHA-256 of its whole content (``sha256``), streamed in large blocks (about 1 GB/s with
the SHA extensions of current x86 and ARM processors; ``scripts/bench/input_hash.py``). A remote object
(``gs://``, ``s3://``) is identified by its size and the store's modification stamp, which every upload
sets and no client can set back; reading it whole to hash it would cost a download per shard and run.

Checking a recorded identity (:func:`identity_change`) has two modes, ``cache_options.verify_inputs``:

* ``metadata`` (the default): when size, mtime, ctime and inode are all unchanged the file is taken as
  unchanged without reading it. That is the one shortcut. Restoring the mtime after an edit (``cp -p``,
  ``rsync -t``, ``git checkout``, ``touch -d``) does not get past it: writing a file sets its ctime to the
  current time and no tool sets it back. What does get past it is an edit whose ctime is also restored
  (setting the system clock back, or writing the disk below the filesystem). Whenever any of the four
  differs, the whole file is hashed and compared; a touched but identical file passes.
* ``full``: every local file is hashed whenever a cache is opened, whatever its metadata says.

Hashes are remembered per process, keyed by path and all four metadata values, so a run that checks its
inputs twice (once up front, once when it opens the cache) reads each file once.

Timestamps are coarse (one clock tick, a few milliseconds on Linux): a file written again within the tick
of its previous write keeps its ctime. So a local file is identified (and its hash remembered) only once
its ctime is ``SETTLE_SECONDS`` old -- identifying a file written a moment ago waits that long -- and its
metadata is read again after hashing: a file that changed meanwhile is hashed again. The record then holds
nothing that depends on when it was made, so two builds of the same files record the same bytes.
Filesystems with coarser timestamps (FAT, some network filesystems: one or two seconds) leave a window that
long after each write; ``verify_inputs: full`` closes it.

Caches written when files over 4 MiB were identified by their first and last MiB only (``sampled``)
cannot tell an edit in the middle from no edit: they are refused with a message saying to rebuild them.
"""

from __future__ import annotations

import hashlib
import os
import time

from ..utils import fs
from .errors import SourceError

__all__ = ["VERIFY_MODES", "file_identity", "hash_file", "identity_change", "is_partial"]

VERIFY_MODES = ("metadata", "full")
# Read size when hashing: large enough that hashlib (which releases the GIL) dominates the Python loop.
_BLOCK = 8 * 2**20
_METADATA_KEYS = ("size", "mtime", "ctime", "inode")
SETTLE_SECONDS = 0.05
# (local path, size, mtime_ns, ctime_ns, inode) -> sha256 hex digest, for this process.
_hashes: dict[tuple, str] = {}


def _is_local(path: str) -> bool:
    return not fs.is_url(path)


def hash_file(path: str) -> str:
    """SHA-256 of the whole content of the local file ``path``, streamed in 8 MiB blocks."""
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(fs.abspath(path), "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _stat_identity(path: str) -> dict:
    if _is_local(path):
        st = os.stat(fs.abspath(path))
        return {"size": int(st.st_size), "mtime": str(st.st_mtime_ns), "ctime": str(st.st_ctime_ns),
                "inode": int(st.st_ino)}
    info = fs.info(path)
    stamp = next((info[k] for k in ("mtime", "updated", "LastModified", "last_modified", "ETag", "etag")
                  if info.get(k) is not None), None)
    return {"size": int(info.get("size") or 0), "mtime": None if stamp is None else str(stamp)}


def _settled(path: str) -> dict:
    """The metadata of ``path`` once its ctime is at least ``SETTLE_SECONDS`` old (see above)."""
    while True:
        ident = _stat_identity(path)
        if "ctime" not in ident:
            return ident
        wait = SETTLE_SECONDS - (time.time_ns() - int(ident["ctime"])) / 1e9
        if wait <= 0:
            return ident
        time.sleep(wait)


def _content_hash(path: str, ident: dict) -> tuple[dict, str]:
    """``(metadata, sha256)`` of ``path``, consistent with each other: hashed again if the file changed while
    it was read. ``ident`` is its metadata as last read."""
    while True:
        key = (fs.abspath(path), *(ident[k] for k in _METADATA_KEYS))
        digest = _hashes.get(key)
        if digest is not None:
            return ident, digest
        ident = _settled(path)
        digest = hash_file(path)
        after = _stat_identity(path)
        if after == ident:
            _hashes[(fs.abspath(path), *(ident[k] for k in _METADATA_KEYS))] = digest
            return ident, digest
        ident = after


def file_identity(path: str, *, content_hash: bool = True) -> dict:
    """What identifies the content of input file ``path`` (see the module docstring): for a local file
    ``size``, ``mtime``, ``ctime``, ``inode`` and (unless ``content_hash`` is false) ``sha256`` of the
    whole file; for a remote object its ``size`` and ``mtime`` (the store's modification stamp)."""
    try:
        ident = _stat_identity(path)
        if content_hash and _is_local(path):
            ident, digest = _content_hash(path, ident)
            ident = {**ident, "sha256": digest}
        return ident
    except FileNotFoundError:
        raise SourceError(f"file not found: {path!r}") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot read the file ({e.strerror or e})") from None


def is_partial(recorded: dict) -> bool:
    """Whether a recorded identity holds only a hash of part of the file (caches of older versions)."""
    return bool(recorded.get("sampled"))


def identity_change(path: str, old: dict, *, full: bool = False) -> str | None:
    """How ``path`` differs from its recorded identity ``old`` (None: unchanged). With ``full`` a local
    file is hashed whatever its metadata; otherwise only when its size, mtime, ctime or inode changed."""
    try:
        now = _stat_identity(path)
    except FileNotFoundError:
        return f"{path} is gone"
    except OSError as e:
        raise SourceError(f"{path}: cannot read the file ({e.strerror or e})") from None
    if now.get("size") != old.get("size"):
        return f"{path} changed size ({old.get('size')} -> {now.get('size')} bytes)"
    if not _is_local(path) or "sha256" not in old:
        # Remote objects (and records without a hash): the modification stamp is all there is.
        if now.get("mtime") != old.get("mtime"):
            return f"{path} was modified (modification time {old.get('mtime')} -> {now.get('mtime')})"
        return None
    if not full and all(now.get(k) == old.get(k) for k in _METADATA_KEYS):
        return None
    try:
        _, digest = _content_hash(path, now)
    except OSError as e:
        raise SourceError(f"{path}: cannot read the file ({e.strerror or e})") from None
    if digest != old["sha256"]:
        return f"{path} was modified (same size, different content)"
    return None
