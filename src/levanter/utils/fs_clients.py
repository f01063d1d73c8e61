"""The fsspec clients behind object-store paths: one per scheme, endpoint and process.

``gs://``, ``s3://`` and ``memory://`` paths are served by fsspec (``gcsfs``, ``s3fs``, its memory
filesystem); :func:`filesystem` maps a path to its client and the path inside it, and :func:`open_file`
streams a file through it. Clients are made once per scheme, endpoint (``AWS_ENDPOINT_URL``,
``STORAGE_EMULATOR_HOST``) and process: async clients must not cross a fork. gcsfs is given
``token="anon"`` against an emulator, and its JSON-API class is used: the default class of current gcsfs
first asks each bucket's layout over gRPC, which an emulator does not serve (a 60 s timeout per bucket).

Trade-off: listings are not cached (``use_listings_cache=False``): a commit protocol that reads back what
another process just wrote must see it, at the cost of a request per call.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .paths import abspath, bucket_and_key, is_url, url_scheme
from .ts_spec import gcs_emulator, s3_endpoint, s3_region

__all__ = ["filesystem", "open_file"]

_FS_LOCK = threading.Lock()
_FS_CACHE: dict[tuple, Any] = {}


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
