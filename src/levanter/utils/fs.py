"""Paths and URLs: the one module that knows local directories, ``gs://``, ``s3://`` and ``memory://``.

Every other module calls the functions here instead of branching on URL schemes. Local paths (and
``file://`` URLs) go through ``os``; object stores go through fsspec (``s3fs``, ``gcsfs``) for small files,
listings and text, and through tensorstore kvstores (:func:`kvstore_spec`) for array data. ``memory://`` is
for tests: small files live in fsspec's process-wide memory filesystem, array data in tensorstore's
``memory`` kvstore, so the two do not see each other's keys (list array chunks through tensorstore).

Atomic writes. Locally, :func:`atomic_write_bytes` writes a temporary file in the target's directory,
fsyncs it, renames it over the target and fsyncs the directory, so readers see the old file or the whole
new one, even after a power loss. Object stores have no rename, but a single PUT is atomic there: readers
see the old object or the new one. :func:`supports_rename` tells callers which commit protocol to use
(rename a finished directory into place, or write a small commit record last).

Endpoints follow the ecosystem's conventions, so one config runs against the cloud or a local server:

* S3-compatible stores: ``AWS_ENDPOINT_URL`` (with ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_REGION``). s3fs is given ``endpoint_url`` explicitly. tensorstore's ``s3`` kvstore ignores
  ``AWS_ENDPOINT_URL`` (an open then hangs trying the real AWS endpoint), so :func:`kvstore_spec` puts
  ``endpoint`` and ``aws_region`` into the spec; tensorstore reads the keys from ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY``.
* GCS emulators: ``STORAGE_EMULATOR_HOST`` (what Google's client libraries and gcsfs use). tensorstore's
  ``gcs`` kvstore reads its endpoint from ``TENSORSTORE_GCS_HTTP_URL`` and its credentials from, in order,
  ``GOOGLE_AUTH_TOKEN_FOR_TESTING``, ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's well-known file and the
  GCE metadata server; without a token it would probe the metadata server, which hangs where there is no
  network. :func:`kvstore_spec` therefore sets ``TENSORSTORE_GCS_HTTP_URL`` from
  ``STORAGE_EMULATOR_HOST`` and, against an emulator only, a placeholder ``GOOGLE_AUTH_TOKEN_FOR_TESTING``
  (both in ``os.environ`` before the first gcs open, since tensorstore reads them from the process
  environment; both are taken back once ``STORAGE_EMULATOR_HOST`` is unset). gcsfs is given
  ``token="anon"`` against an emulator for the same reason, and its JSON-API class is used: the default
  class of current gcsfs first asks each bucket's layout over gRPC, which an emulator does not serve (a
  60 s timeout per bucket).

Errors. :func:`is_transient` recognises throttling, 5xx answers and dropped connections in the shapes
fsspec, botocore, aiohttp and tensorstore raise them; :func:`retry_transient` retries those with
exponential backoff and jitter (tensorstore retries its own requests through the
``s3_request_retries`` / ``gcs_request_retries`` context resources of :func:`tensorstore_context_spec`).
Permanent errors (access denied, missing bucket, bad credentials) become :class:`StorageAccessError`,
whose message names the URL and the config key and never a credential (:func:`redact`).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_OBJECT_SCHEMES = ("s3", "gs", "gcs", "memory")

# Retry policy for small-file operations (tensorstore has its own, see tensorstore_context_spec).
RETRY_ATTEMPTS = 8
RETRY_INITIAL_DELAY_S = 0.05
RETRY_MAX_DELAY_S = 2.0


class StorageAccessError(ValueError):
    """A permanent storage error (access denied, missing bucket, bad credentials). The message names the
    URL (and the config key, when known) and is safe to show: credentials are redacted."""


# ----------------------------------------------------------------------------------------------- paths


def _scheme(path: str) -> str:
    path = os.fspath(path)
    if "://" not in path:
        return ""
    return path.split("://", 1)[0].lower()


def is_url(path: str | os.PathLike) -> bool:
    """An object-store or memory URL (``s3://``, ``gs://``, ``memory://``); not a local path or ``file://``."""
    s = _scheme(os.fspath(path))
    return s != "" and s != "file"


def is_object_store(path: str | os.PathLike) -> bool:
    """A URL of a store this module reads and writes (``s3://``, ``gs://``, ``memory://``), as opposed to a
    local path or another scheme some reader understands (``embedded://``, ``http://``)."""
    return _scheme(os.fspath(path)) in _OBJECT_SCHEMES


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


def redact(text: str) -> str:
    """``text`` with the values of credential environment variables (and secrets embedded in URLs or
    query strings) replaced by ``***``."""
    text = str(text)
    for name in (
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ACCESS_KEY_ID",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING",
        "GCS_OAUTH_TOKEN",
    ):
        value = os.environ.get(name)
        if value and len(value) >= 4 and value in text:
            text = text.replace(value, "***")
    text = re.sub(r"(?i)(access_token|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature)=[^&\s\"']+",
                  r"\1=***", text)
    text = re.sub(r"(?i)(authorization:\s*)\S+(\s+\S+)?", r"\1***", text)
    text = re.sub(r"://[^/@\s:]+:[^/@\s]+@", "://***@", text)
    return text


# ------------------------------------------------------------------------------------------ endpoints


def _s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _s3_region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def _gcs_emulator() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return None
    return host if "://" in host else "http://" + host


_SET_FOR_EMULATOR: dict[str, str] = {}  # what _prepare_tensorstore_gcs put into os.environ


def _prepare_tensorstore_gcs() -> None:
    emulator = _gcs_emulator()
    if emulator is None:
        # The emulator is gone (e.g. a test server stopped): take back what was set for it, so that
        # tensorstore reaches real GCS with real credentials again.
        for name, value in list(_SET_FOR_EMULATOR.items()):
            if os.environ.get(name) == value:
                del os.environ[name]
            del _SET_FOR_EMULATOR[name]
        return
    wanted = {"TENSORSTORE_GCS_HTTP_URL": emulator.rstrip("/")}
    if "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in os.environ or "GOOGLE_AUTH_TOKEN_FOR_TESTING" in _SET_FOR_EMULATOR:
        wanted["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "emulator"
    for name, value in wanted.items():
        os.environ[name] = value
        _SET_FOR_EMULATOR[name] = value


def _bucket_and_key(path: str) -> tuple[str, str]:
    rest = abspath(path).split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key


def kvstore_spec(path: str | os.PathLike) -> dict[str, Any]:
    """The tensorstore kvstore JSON for the directory ``path`` (its ``path`` ends with ``/``), with the
    endpoint taken from the environment (see the module docstring)."""
    path = os.fspath(path)
    scheme = _scheme(path)
    if not is_url(path):
        return {"driver": "file", "path": abspath(path).rstrip("/") + "/"}
    if scheme == "memory":
        rest = abspath(path).split("://", 1)[1]
        return {"driver": "memory", "path": rest.strip("/") + "/"}
    bucket, key = _bucket_and_key(path)
    key = key.strip("/")
    key = key + "/" if key else ""
    if scheme == "s3":
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key, "aws_region": _s3_region()}
        endpoint = _s3_endpoint()
        if endpoint:
            spec["endpoint"] = endpoint
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            # Keys from the environment: without this, tensorstore first tries ~/.aws/{config,credentials}
            # and logs an error line for each missing file.
            spec["aws_credentials"] = {"type": "environment"}
        return spec
    if scheme in ("gs", "gcs"):
        _prepare_tensorstore_gcs()
        return {"driver": "gcs", "bucket": bucket, "path": key}
    raise ValueError(f"{path}: unsupported storage URL scheme {scheme!r} (use a local path, gs://, s3:// or memory://)")


def tensorstore_context_spec() -> dict[str, Any]:
    """Context resources for tensorstore: retry budgets for S3 and GCS requests, so that array reads and
    writes survive throttling and 5xx answers."""
    retries = {"max_retries": 32, "initial_delay": "20ms", "max_delay": "4s"}
    return {"s3_request_retries": dict(retries), "gcs_request_retries": dict(retries)}


# ---------------------------------------------------------------------------------------- filesystems

_FS_LOCK = threading.Lock()
_FS_CACHE: dict[tuple, Any] = {}
_MEMORY_LOCK = threading.Lock()


def _make_fs(scheme: str):
    import fsspec

    if scheme == "s3":
        endpoint = _s3_endpoint()
        key = ("s3", endpoint, _s3_region(), os.environ.get("AWS_ACCESS_KEY_ID"))
        make = lambda: fsspec.filesystem(  # noqa: E731
            "s3",
            endpoint_url=endpoint,
            client_kwargs={"region_name": _s3_region()},
            use_listings_cache=False,
            skip_instance_cache=True,
        )
    elif scheme in ("gs", "gcs"):
        emulator = _gcs_emulator()
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
    scheme = _scheme(path)
    fs = _make_fs(scheme)
    if scheme == "memory":
        return fs, "/" + abspath(path).split("://", 1)[1].lstrip("/")
    bucket, key = _bucket_and_key(path)
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


# ------------------------------------------------------------------------------------------- errors

_TRANSIENT_CODES = {408, 429, 500, 502, 503, 504}
_TRANSIENT_S3_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeoutException",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "503",
    "500",
    "429",
}
_TRANSIENT_TEXT = re.compile(
    r"\b(429|500|502|503|504)\b|Service ?Unavailable|SlowDown|Too Many Requests|Internal ?Error|"
    r"UNAVAILABLE|DEADLINE_EXCEEDED|Connection (?:reset|refused|aborted)|timed out|Server ?Disconnected|"
    r"ServerDisconnectedError|ClientConnectorError|ClientOSError|IncompleteRead|BrokenPipe",
    re.IGNORECASE,
)
_PERMANENT_S3_CODES = {
    "AccessDenied",
    "NoSuchBucket",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidBucketName",
    "403",
}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _http_status(exc: BaseException) -> int | None:
    for attr in ("status", "code", "status_code"):
        v = getattr(exc, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata") or {}
        v = meta.get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return (response.get("Error") or {}).get("Code")
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is worth retrying: HTTP 408/429/5xx, throttling,
    connection resets and timeouts. Access errors and missing objects are not."""
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError, StorageAccessError)):
            return False
        code = _s3_code(e)
        if code in _PERMANENT_S3_CODES:
            return False
        if code in _TRANSIENT_S3_CODES:
            return True
        status = _http_status(e)
        if status is not None:
            if status in _TRANSIENT_CODES:
                return True
            if 400 <= status < 500:
                return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if isinstance(e, OSError) and e.errno in (errno.ECONNRESET, errno.ETIMEDOUT, errno.ECONNREFUSED,
                                                  errno.EPIPE, errno.ECONNABORTED):
            return True
        name = type(e).__name__
        if name in ("ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
                    "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
                    "ResponseStreamingError", "IncompleteReadError"):
            return True
        if _TRANSIENT_TEXT.search(str(e)):
            return True
    return False


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is an access error that retrying cannot fix: 401/403,
    refused credentials, a missing bucket."""
    for e in _chain(exc):
        if isinstance(e, (PermissionError, StorageAccessError)):
            return True
        code = _s3_code(e)
        if code in _PERMANENT_S3_CODES:
            return True
        status = _http_status(e)
        if status in (401, 403):
            return True
        text = str(e)
        if re.search(r"\b(403|401)\b|Forbidden|AccessDenied|Access Denied|NoSuchBucket|"
                     r"InvalidAccessKeyId|SignatureDoesNotMatch|PERMISSION_DENIED|UNAUTHENTICATED", text):
            return True
    return False


def retry_transient(fn: Callable[..., T], *args, what: str = "storage operation", **kwargs) -> T:
    """Call ``fn(*args, **kwargs)``, retrying transient errors (:func:`is_transient`) with exponential
    backoff and full jitter, at most :data:`RETRY_ATTEMPTS` times; other errors propagate at once."""
    delay = RETRY_INITIAL_DELAY_S
    for attempt in range(RETRY_ATTEMPTS):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if attempt == RETRY_ATTEMPTS - 1 or not is_transient(e):
                raise
            sleep = random.uniform(0, delay)
            logger.debug("%s: transient error (%s); retrying in %.3fs", what, redact(str(e))[:200], sleep)
            time.sleep(sleep)
            delay = min(delay * 2, RETRY_MAX_DELAY_S)
    raise AssertionError("unreachable")


def access_error(url: str, key: str | None, exc: BaseException | str) -> StorageAccessError:
    """The one message for a permanent storage error: which URL, which config key, and why."""
    bucket = ""
    if is_url(url) and _scheme(url) != "memory":
        bucket, _ = _bucket_and_key(url)
    reason = redact(str(exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = str(exc)
    if isinstance(exc, BaseException):
        text = " ".join(redact(str(e)) for e in _chain(exc))
    if re.search(r"NoSuchBucket|bucket does not exist|specified bucket|Not Found|404", text, re.IGNORECASE) and bucket:
        why = f"the bucket {bucket!r} does not exist or is not visible with these credentials"
    elif re.search(r"AccessDenied|Access Denied|Forbidden|\b403\b|PERMISSION_DENIED|PermissionError", text) or (
        isinstance(exc, PermissionError)
    ):
        why = "access denied (check the credentials and the bucket's permissions)"
    elif re.search(r"InvalidAccessKeyId|SignatureDoesNotMatch|\b401\b|UNAUTHENTICATED|credentials", text):
        why = "the credentials were refused"
    else:
        why = reason
    where = f"{key}: " if key else ""
    return StorageAccessError(f"{where}cannot use {redact(url)}: {why}")


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
    directory = os.path.dirname(path)
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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _is_precondition_failure(exc: BaseException) -> bool:
    for e in _chain(exc):
        if isinstance(e, FileExistsError):
            return True
        if _s3_code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
            return True
        if _http_status(e) == 412:
            return True
        if re.search(r"\b412\b|PreconditionFailed|Precondition Failed|conditionNotMet", str(e)):
            return True
    return False


def create_exclusive(path: str | os.PathLike, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist: True if this call created it, False if
    it existed. Locally a hard link of a finished temporary file (so the file appears whole); on S3 a PUT
    with ``If-None-Match: *``; on GCS an upload with ``ifGenerationMatch=0``."""
    path = os.fspath(path)
    if not is_url(path):
        path = abspath(path)
        directory = os.path.dirname(path)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            fsync_dir(directory)
            return True
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    fs, p = filesystem(path)
    if _scheme(path) == "memory":
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
            if not _is_precondition_failure(e):
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
    scheme = _scheme(pattern) if is_url(pattern) else ""
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
    if _scheme(url) == "memory":
        return
    fs, p = filesystem(url)
    bucket, _ = _bucket_and_key(url)
    try:
        try:
            fs.ls(bucket, detail=False)
        except Exception as e:
            # An endpoint that cannot be reached at all (nothing listening, a wrong AWS_ENDPOINT_URL or
            # STORAGE_EMULATOR_HOST) is reported at once: the client library has already retried the
            # connection, and retrying it again for every URL of the config only delays the error.
            if _unreachable(e) or not is_transient(e):
                raise
            retry_transient(fs.ls, bucket, detail=False, what=f"list {url}")
    except Exception as e:
        if _unreachable(e):
            raise StorageAccessError(
                f"{key + ': ' if key else ''}cannot use {redact(url)}: the storage endpoint "
                f"{_endpoint_description(url)} cannot be reached ({type(e).__name__})"
            ) from None
        if isinstance(e, FileNotFoundError) or is_permanent(e):
            raise access_error(url, key, e if not isinstance(e, FileNotFoundError) else "NoSuchBucket") from None
        raise access_error(url, key, e) from None
    if write:
        try:
            probe_writable(url)
        except StorageAccessError as e:
            raise StorageAccessError(f"{key + ': ' if key else ''}{e}") from None


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says that no connection to the storage endpoint could be made at all."""
    for e in _chain(exc):
        if type(e).__name__ in ("EndpointConnectionError", "ClientConnectorError", "ConnectTimeoutError"):
            return True
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return True
    return False


def _endpoint_description(url: str) -> str:
    """Where requests for ``url`` go, for messages (no credentials)."""
    scheme = _scheme(url)
    if scheme == "s3":
        endpoint = _s3_endpoint()
        return f"{endpoint} (AWS_ENDPOINT_URL)" if endpoint else "of Amazon S3"
    if scheme in ("gs", "gcs"):
        emulator = _gcs_emulator()
        return f"{emulator} (STORAGE_EMULATOR_HOST)" if emulator else "of Google Cloud Storage"
    return scheme


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
