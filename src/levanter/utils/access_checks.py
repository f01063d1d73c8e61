"""Start-up checks of storage: a bucket or directory that cannot be used becomes one
:class:`~levanter.utils.storage_errors.StorageAccessError` naming the config key, before any work.

:func:`check_access` lists the bucket (and, with ``write``, writes and deletes a probe object);
:func:`probe_writable` does the write for a directory; :func:`bucket_missing` tells a read that found
nothing whether its bucket exists at all, for the message.

Trade-off: a check costs a request or two per configured URL at start-up, in exchange for a clear error
in seconds instead of a failure after a cache build or the first checkpoint.
"""

from __future__ import annotations

import os
import random
import tempfile

from .atomic_writes import atomic_write_bytes
from .files import remove
from .fs_clients import filesystem
from .paths import abspath, bucket_and_key, is_url, join, url_scheme
from .storage_errors import (
    StorageAccessError,
    access_error,
    is_permanent,
    is_transient,
    is_unreachable,
    redact,
    retry_transient,
)
from .ts_spec import endpoint_description

__all__ = ["probe_writable", "check_access", "bucket_missing"]


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
