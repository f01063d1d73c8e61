"""Where storage requests go: endpoints from the environment, and tensorstore's kvstore and context specs.

Endpoints follow the ecosystem's conventions, so one config runs against the cloud or a local server:

* S3-compatible stores: ``AWS_ENDPOINT_URL`` (with ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_REGION``). s3fs is given ``endpoint_url`` explicitly (:mod:`levanter.utils.fs_clients`). tensorstore's
  ``s3`` kvstore ignores ``AWS_ENDPOINT_URL`` (an open then hangs trying the real AWS endpoint), so
  :func:`kvstore_spec` puts ``endpoint`` and ``aws_region`` into the spec; tensorstore reads the keys from
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``.
* GCS emulators: ``STORAGE_EMULATOR_HOST`` (what Google's client libraries and gcsfs use). tensorstore's
  ``gcs`` kvstore reads its endpoint from ``TENSORSTORE_GCS_HTTP_URL`` and its credentials from, in order,
  ``GOOGLE_AUTH_TOKEN_FOR_TESTING``, ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's well-known file and the
  GCE metadata server; without a token it would probe the metadata server, which hangs where there is no
  network. :func:`kvstore_spec` therefore sets ``TENSORSTORE_GCS_HTTP_URL`` from
  ``STORAGE_EMULATOR_HOST`` and, against an emulator only, a placeholder ``GOOGLE_AUTH_TOKEN_FOR_TESTING``
  (both in ``os.environ`` before the first gcs open, since tensorstore reads them from the process
  environment; both are taken back once ``STORAGE_EMULATOR_HOST`` is unset).

``memory://`` maps to tensorstore's ``memory`` kvstore, which does not share keys with fsspec's memory
filesystem: list array chunks through tensorstore.

Trade-off: setting process environment variables from a spec builder is a side effect, but tensorstore
offers no per-spec way to point ``gcs`` at an emulator; it is confined to emulator runs (tests).
"""

from __future__ import annotations

import os
from typing import Any

from .paths import abspath, bucket_and_key, is_url, url_scheme

__all__ = [
    "s3_endpoint",
    "s3_region",
    "gcs_emulator",
    "kvstore_spec",
    "kvstore_key",
    "tensorstore_context_spec",
    "endpoint_description",
]

def s3_endpoint() -> str | None:
    """The S3 endpoint the environment names (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``), or None."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_region() -> str:
    """``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else ``us-east-1``."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def gcs_emulator() -> str | None:
    """The GCS emulator's URL from ``STORAGE_EMULATOR_HOST``, or None."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return None
    return host if "://" in host else "http://" + host


_SET_FOR_EMULATOR: dict[str, str] = {}  # what _prepare_tensorstore_gcs put into os.environ


def _prepare_tensorstore_gcs() -> None:
    emulator = gcs_emulator()
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


def kvstore_spec(path: str | os.PathLike) -> dict[str, Any]:
    """The tensorstore kvstore JSON for the directory ``path`` (its ``path`` ends with ``/``), with the
    endpoint taken from the environment (see the module docstring)."""
    path = os.fspath(path)
    scheme = url_scheme(path)
    if not is_url(path):
        return {"driver": "file", "path": abspath(path).rstrip("/") + "/"}
    if scheme == "memory":
        rest = abspath(path).split("://", 1)[1]
        return {"driver": "memory", "path": rest.strip("/") + "/"}
    bucket, key = bucket_and_key(path)
    key = key.strip("/")
    key = key + "/" if key else ""
    if scheme == "s3":
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key, "aws_region": s3_region()}
        endpoint = s3_endpoint()
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


def kvstore_key(path: str | os.PathLike) -> str:
    """The key by which tensorstore's messages name ``path`` (no trailing ``/``): for a bucket the key
    inside it (``s3://b/cache/x`` -> ``cache/x``), for ``memory://`` the path after the scheme, locally
    the absolute path."""
    spec = kvstore_spec(path) if is_url(path) else {"path": abspath(os.fspath(path))}
    return spec["path"].rstrip("/")


def tensorstore_context_spec() -> dict[str, Any]:
    """Context resources for tensorstore: retry budgets for S3 and GCS requests, so that array reads and
    writes survive throttling and 5xx answers."""
    retries = {"max_retries": 32, "initial_delay": "20ms", "max_delay": "4s"}
    return {"s3_request_retries": dict(retries), "gcs_request_retries": dict(retries)}


def endpoint_description(url: str) -> str:
    """Where requests for ``url`` go, for messages (no credentials)."""
    scheme = url_scheme(url)
    if scheme == "s3":
        endpoint = s3_endpoint()
        return f"{endpoint} (AWS_ENDPOINT_URL)" if endpoint else "of Amazon S3"
    if scheme in ("gs", "gcs"):
        emulator = gcs_emulator()
        return f"{emulator} (STORAGE_EMULATOR_HOST)" if emulator else "of Google Cloud Storage"
    return scheme
