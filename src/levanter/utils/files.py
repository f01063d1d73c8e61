"""Files and small objects on local disk, ``gs://``, ``s3://`` and ``memory://``: read, list, write, delete.

Local paths (and ``file://`` URLs) go through ``os``; object stores through fsspec (``s3fs``, ``gcsfs``),
one client per scheme, endpoint and process (async clients must not cross a fork). Every object-store
call is retried on transient errors (:func:`levanter.utils.storage_errors.retry_transient`). Array data
does not go through here but through tensorstore (:mod:`levanter.utils.ts_spec`). ``memory://`` small
files live in fsspec's process-wide memory filesystem (tests).

Atomic writes. Locally, :func:`atomic_write_bytes` writes a temporary file in the target's directory,
fsyncs it, renames it over the target and fsyncs the directory, so readers see the old file or the whole
new one, even after a power loss. Object stores have no rename, but a single PUT is atomic there: readers
see the old object or the new one. :func:`create_exclusive` creates a file only if absent (a hard link
locally, a conditional PUT on object stores). gcsfs is given ``token="anon"`` against an emulator, and its
JSON-API class is used: the default class of current gcsfs first asks each bucket's layout over gRPC,
which an emulator does not serve (a 60 s timeout per bucket).

Start-up checks (:func:`check_access`, :func:`probe_writable`) turn a bucket or directory that cannot be
used into one :class:`~levanter.utils.storage_errors.StorageAccessError` naming the config key, before
any work.

Trade-off: listings and ``exists`` are not cached (``use_listings_cache=False``): a commit protocol that
reads back what another process just wrote must see it, at the cost of a request per call.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import tempfile
import threading
from typing import Any

from .paths import abspath, bucket_and_key, is_url, join, url_scheme
from .storage_errors import (
    StorageAccessError,
    access_error,
    is_permanent,
    is_precondition_failure,
    is_transient,
    is_unreachable,
    redact,
    retry_transient,
)
from .ts_spec import endpoint_description, gcs_emulator, s3_endpoint, s3_region

__all__ = [
    "filesystem",
    "open_file",
    "exists",
    "isfile",
    "isdir",
    "listdir",
    "read_bytes",
    "read_text",
    "fsync_dir",
    "atomic_write_bytes",
    "atomic_write_text",
    "create_exclusive",
    "remove",
    "remove_tree",
    "makedirs",
    "mtime",
    "glob_detail",
    "glob",
    "info",
    "size",
    "probe_writable",
    "check_access",
    "bucket_missing",
    "remove_stale_temporaries",
]

_FS_LOCK = threading.Lock()
_FS_CACHE: dict[tuple, Any] = {}
_MEMORY_LOCK = threading.Lock()


def _make_fs(scheme: str):
    import fsspec

    if scheme == "s3":
        endpoint = s3_endpoint()
        key = ("s3", endpoint, s3_region(), os.environ.get("AWS_ACCESS_KEY_ID"))
        make = lambda: fsspec.filesystem(  # noqa: E731
            "s3",
            endpoint_url=endpoint,
            client_kwargs={"region_name": s3_region()},
            use_listings_cache=False,
            skip_instance_cache=True,
        )
    elif scheme in ("gs", "gcs"):
        emulator = gcs_emulator()
        key = ("gs", emulator)
        kwargs: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
        if emulator:
            kwargs.update(endpoint_url=emulator, token="anon")
        _quiet_gcsfs_logger()
        make = lambda: _gcs_class()(**kwargs)  # noqa: E731
    elif scheme == "memory":
        key = ("memory",)
        make = lambda: fsspec.filesystem("memory")  # noqa: E731
    else:
        raise ValueError(f"unsupported storage URL scheme {scheme!r} (use a local path, gs://, s3:// or memory://)")
    key = (*key, os.getpid())  # async clients must not cross a fork
    with _FS_LOCK:
        fs = _FS_CACHE.get(key)
        if fs is None:
            fs = make()
            _FS_CACHE[key] = fs
        return fs


def _quiet_gcsfs_logger() -> None:
    # gcsfs logs every request that ran out of retries with its traceback (logger.exception) and then
    # raises; the error reaches the caller, which reports it once, so the log record is only noise.
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


def _gcs_class():
    # gcsfs's default class probes each bucket's layout over gRPC (a 60 s timeout against an emulator,
    # which has no gRPC endpoint); the JSON-API core class serves flat and hierarchical buckets alike.
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem


def filesystem(path: str | os.PathLike):
    """``(fsspec filesystem, path inside it)`` for ``path`` (a local filesystem for local paths)."""
    path = os.fspath(path)
    if not is_url(path):
        import fsspec

        return fsspec.filesystem("file"), abspath(path)
    scheme = url_scheme(path)
    fs = _make_fs(scheme)
    if scheme == "memory":
        return fs, "/" + abspath(path).split("://", 1)[1].lstrip("/")
    bucket, key = bucket_and_key(path)
    return fs, f"{bucket}/{key}" if key else bucket


def open_file(path: str | os.PathLike, mode: str = "rb", *, compression: str | None = None, **text_kwargs):
    """Open ``path`` (local or URL) for streaming, like ``fsspec.open(...).open()``: ``compression``
    (``"infer"`` from the suffix, a codec name, or None) and, in text modes, ``encoding`` / ``errors`` /
    ``newline``. Closing the returned object closes every layer."""
    import fsspec
    from fsspec.utils import infer_compression

    fsys, p = filesystem(path)
    if compression == "infer":
        compression = infer_compression(p)
    return fsspec.core.OpenFile(fsys, p, mode=mode, compression=compression, **text_kwargs).open()


# ------------------------------------------------------------------------------------ small-file API


def exists(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.exists(abspath(path))
    fs, p = filesystem(path)
    return retry_transient(fs.exists, p, what=f"exists {path}")


def isfile(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.isfile(abspath(path))
    fs, p = filesystem(path)
    return retry_transient(fs.isfile, p, what=f"isfile {path}")


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
    path = os.fspath(path)
    if not is_url(path):
        return os.path.getsize(abspath(path))
    fs, p = filesystem(path)
    return int(retry_transient(fs.size, p, what=f"stat {path}"))


# ---------------------------------------------------------------------------------- start-up checks


def probe_writable(directory: str | os.PathLike) -> None:
    """Create ``directory`` (locally, with its parents) and write and delete a probe file in it; raises the
    ``OSError`` of whichever step failed locally, :class:`StorageAccessError` for an object store that
    refuses the write. Entry points call it before any work, so that a directory that cannot be written
    fails in seconds, naming its config key, instead of after a cache build."""
    directory = os.fspath(directory)
    if not is_url(directory):
        directory = abspath(directory)
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as f:
            f.write(b"ok")
            f.flush()
        return
    probe = join(directory, f".write-probe-{os.getpid()}-{random.getrandbits(32):08x}")
    try:
        atomic_write_bytes(probe, b"ok")
        remove(probe)
    except StorageAccessError:
        raise
    except Exception as e:  # at start-up, any failure (even retried timeouts) is reported as one error
        raise access_error(directory, None, e) from None


def check_access(url: str | os.PathLike, key: str | None, *, write: bool = False) -> None:
    """Start-up check that ``url`` can be used: the bucket exists and can be listed (and, with ``write``,
    a probe object can be written and deleted). Raises :class:`StorageAccessError` naming ``url`` and the
    config ``key``. Local paths: with ``write``, :func:`probe_writable` (its ``OSError`` becomes a
    :class:`StorageAccessError`); without, nothing (missing local files are reported by their readers)."""
    url = os.fspath(url)
    if not is_url(url):
        if write:
            try:
                probe_writable(url)
            except OSError as e:
                raise StorageAccessError(f"{key + ': ' if key else ''}cannot write {url} ({e.strerror or e})") from None
        return
    if url_scheme(url) == "memory":
        return
    fs, p = filesystem(url)
    bucket, _ = bucket_and_key(url)
    try:
        try:
            fs.ls(bucket, detail=False)
        except Exception as e:
            # An endpoint that cannot be reached at all (nothing listening, a wrong AWS_ENDPOINT_URL or
            # STORAGE_EMULATOR_HOST) is reported at once: the client library has already retried the
            # connection, and retrying it again for every URL of the config only delays the error.
            if is_unreachable(e) or not is_transient(e):
                raise
            retry_transient(fs.ls, bucket, detail=False, what=f"list {url}")
    except Exception as e:
        if is_unreachable(e):
            raise StorageAccessError(
                f"{key + ': ' if key else ''}cannot use {redact(url)}: the storage endpoint "
                f"{endpoint_description(url)} cannot be reached ({type(e).__name__})"
            ) from None
        if isinstance(e, FileNotFoundError) or is_permanent(e):
            raise access_error(url, key, e if not isinstance(e, FileNotFoundError) else "NoSuchBucket") from None
        raise access_error(url, key, e) from None
    if write:
        try:
            probe_writable(url)
        except StorageAccessError as e:
            raise StorageAccessError(f"{key + ': ' if key else ''}{e}") from None


def bucket_missing(url: str | os.PathLike) -> bool:
    """Whether the bucket of the ``gs://`` / ``s3://`` URL ``url`` does not exist, asked afresh (not from
    a cache of listings): for a message about a read that found nothing. False when it exists, when the
    store cannot tell (the question fails for another reason), and for ``memory://`` and local paths."""
    url = os.fspath(url)
    if not is_url(url) or url_scheme(url) == "memory":
        return False
    bucket, _ = bucket_and_key(url)
    try:
        fs, _ = filesystem(url)
        fs.invalidate_cache(bucket)
        fs.ls(bucket, detail=False)
    except FileNotFoundError:
        return True
    except Exception:  # noqa: BLE001 -- unreachable, denied: not known to be missing
        return False
    return False


# --------------------------------------------------------------------------------- local leftovers


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
