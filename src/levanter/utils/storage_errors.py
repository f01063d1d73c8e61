"""Storage errors: which ones are worth retrying, the retry loop, and the message for the others.

:func:`is_transient` recognises throttling, 5xx answers and dropped connections in the shapes fsspec,
botocore, aiohttp and tensorstore raise them; :func:`retry_transient` retries those with exponential
backoff and full jitter (tensorstore retries its own requests through the ``s3_request_retries`` /
``gcs_request_retries`` context resources of :func:`levanter.utils.ts_spec.tensorstore_context_spec`).
Permanent errors (access denied, missing bucket, bad credentials) become :class:`StorageAccessError`,
whose message names the URL and the config key and never a credential (:func:`redact`).

Trade-off: classification reads exception types, status codes and, last, the message text, because the
libraries involved wrap each other's errors; a text match can misjudge an unusual message, and then errs
towards retrying (a few seconds lost) rather than towards stopping a run for a passing fault.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import time
from typing import Callable, TypeVar

from .paths import bucket_and_key, is_url, url_scheme

__all__ = [
    "StorageAccessError",
    "redact",
    "exception_chain",
    "is_transient",
    "is_permanent",
    "retry_transient",
    "access_error",
    "is_precondition_failure",
    "is_unreachable",
    "RETRY_ATTEMPTS",
    "RETRY_INITIAL_DELAY_S",
    "RETRY_MAX_DELAY_S",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Retry policy for small-file operations (tensorstore has its own, see tensorstore_context_spec).
RETRY_ATTEMPTS = 8
RETRY_INITIAL_DELAY_S = 0.05
RETRY_MAX_DELAY_S = 2.0


class StorageAccessError(ValueError):
    """A permanent storage error (access denied, missing bucket, bad credentials). The message names the
    URL (and the config key, when known) and is safe to show: credentials are redacted."""


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


def exception_chain(exc: BaseException):
    """``exc`` and what it was raised from (``__cause__``, else ``__context__``), each once."""
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
    for e in exception_chain(exc):
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
    for e in exception_chain(exc):
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
    if is_url(url) and url_scheme(url) != "memory":
        bucket, _ = bucket_and_key(url)
    reason = redact(str(exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = str(exc)
    if isinstance(exc, BaseException):
        text = " ".join(redact(str(e)) for e in exception_chain(exc))
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


def is_precondition_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a create-if-absent write found the object already there."""
    for e in exception_chain(exc):
        if isinstance(e, FileExistsError):
            return True
        if _s3_code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
            return True
        if _http_status(e) == 412:
            return True
        if re.search(r"\b412\b|PreconditionFailed|Precondition Failed|conditionNotMet", str(e)):
            return True
    return False


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says that no connection to the storage endpoint could be made at all."""
    for e in exception_chain(exc):
        if type(e).__name__ in ("EndpointConnectionError", "ClientConnectorError", "ConnectTimeoutError"):
            return True
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return True
    return False
