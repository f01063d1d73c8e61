"""The Ray side of a cache build: batches of documents tokenized by Ray tasks, on one machine or a cluster.

Only *who tokenizes a batch* differs from the process pool (:mod:`levanter.ingest.encoders`): the
builder (:mod:`levanter.ingest.build`) reads the shards, submits batches here, and commits the results to the store and the ledger in
submission order, exactly as with the pool -- so a Ray build is byte-identical to a process-pool build.
The driver reads every input file and ships documents to the tasks: files on the driver's disk (and the
embedded corpus) work on a cluster whose nodes cannot see them, at the price of the driver's bandwidth;
tokenizing, the CPU-heavy part, spreads over the cluster.

``ray.init(address=...)`` joins a running cluster; without an address a local Ray instance is started on
this machine with one CPU per worker. A Ray instance this process already joined (``ray.is_initialized()``)
is used as is, and one started here is left running for the next build of the same process (Ray shuts it
down at exit): starting Ray costs seconds, and ``cache_dataset`` builds two caches per source. A Ray that
will not start (whatever the exception) or a ``host:port`` that refuses connections (checked first: Ray
itself retries one for minutes) is one error naming the key and the way to build without Ray
(``cache_options.backend: process``).

Failures: Ray retries a task whose worker died (``max_retries``) and one that raised a runtime, I/O or
memory error (``retry_exceptions``); a :class:`~levanter.ingest.errors.SourceError` (bad input) is
re-raised as is, not wrapped in Ray's task error. Each worker process keeps the tokenizer it was sent
once: tasks carry an object reference to it, resolved on first use, not the tokenizer itself.

Ray is an optional dependency (``pip install 'levanter[ray]'``): this module imports it only when a Ray
build starts.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile

from ..errors import is_out_of_space, out_of_space_error
from ..utils import fs
from .errors import SourceError
from .tokenize_worker import encode

__all__ = ["RayEncoder"]

logger = logging.getLogger(__name__)

_FAULT_RAISE_ONCE = "LEVANTER_FAULT_RAISE_ONCE"
"""A path: the first task that creates this file raises (crash-safety tests; unset in production)."""

_TASK_RETRIES = 3
_CONNECT_TIMEOUT_S = 10.0  # a head node that takes longer to accept a TCP connection is not usable
# Exceptions a task is retried on; a SourceError (a ValueError: the input is bad) would only fail again.
_RETRIED = [RuntimeError, OSError, MemoryError]

# Tokenizers held by this worker process, by (fingerprint, eos).
_TOKENIZERS: dict = {}


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "cache_options.backend: 'ray' needs Ray, which is not installed; install it with "
            "pip install 'levanter[ray]' or use backend: process"
        ) from None
    return ray


_NO_RAY = "or build without Ray: set cache_options.backend: process (the default, a process pool on this machine)"


def _start_error(address: str | None, e: BaseException) -> Exception:
    """The one-paragraph error for a Ray that would not start (or a cluster that would not answer)."""
    if is_out_of_space(e):
        where = getattr(e, "filename", None) or os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        return out_of_space_error("starting Ray (its session files)", str(where))
    why = " ".join(f"{type(e).__name__}: {fs.redact(str(e))}".split())
    if len(why) > 300:
        why = why[:300] + " ..."
    if address:
        return ValueError(
            f"cache_options.ray_address: cannot join the Ray cluster at {address!r} ({why}); check the address "
            f"(host:port of the head node, or 'auto' for the cluster this machine belongs to), {_NO_RAY}"
        )
    return ValueError(
        f"cache_options.backend: ray could not start a local Ray instance ({why}); check RAY_TMPDIR / "
        f"TMPDIR and free space under them, {_NO_RAY}"
    )


def _check_reachable(address: str) -> None:
    """Refuse a ``host:port`` (or ``ray://host:port``) that does not accept connections at once: Ray
    itself retries such an address for minutes before it gives up."""
    rest = address.split("://", 1)[1] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or "://" in address and not address.startswith("ray://"):
        return  # 'auto', 'local' or another form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise _start_error(address, ConnectionError(f"{host}:{port}: {e.strerror or e}")) from None


def _encode_task(key, tokenizer_box: list, eos, docs, shard, where, fault_marker):
    if fault_marker is not None:
        try:
            with open(fault_marker, "x"):
                pass
        except FileExistsError:
            pass
        else:
            raise RuntimeError(f"injected task failure ({_FAULT_RAISE_ONCE})")
    tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None:
        import ray

        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per CPU: Ray provides the parallelism
        tokenizer = _TOKENIZERS[key] = ray.get(tokenizer_box[0])
    return encode(tokenizer, eos, docs, shard, where)


_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _drop_default_auth_notice(record: logging.LogRecord) -> bool:
    """A logging filter: Ray's notice that a local instance chose token authentication by default."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


class _RayResult:
    def __init__(self, ray, ref):
        self._ray, self._ref = ray, ref

    def result(self):
        try:
            return self._ray.get(self._ref)
        except self._ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, SourceError):
                raise SourceError(str(cause)) from None
            raise


class RayEncoder:
    """Submits tokenization tasks to Ray; ``window``: how many may be in flight (twice the CPUs used)."""

    def __init__(self, tokenizer, eos: int | None, *, address: str | None, num_workers: int | None):
        ray = _import_ray()
        self._ray = ray
        if not ray.is_initialized():
            # Ray's own INFO lines ("Started a local Ray instance.") stay off the console; its warnings show.
            kwargs: dict = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
            if address:
                kwargs["address"] = address
            else:
                kwargs["num_cpus"] = num_workers or os.cpu_count() or 1
                # Ray warns that a local instance uses token authentication, its default, whenever
                # RAY_AUTH_MODE is unset; the line below says so once instead. (Setting RAY_AUTH_MODE here
                # would not do: Ray's core reads it when ray is imported, and a mismatch fails the start.)
                logging.getLogger(_RAY_AUTH_LOGGER).addFilter(_drop_default_auth_notice)
            if address:
                _check_reachable(address)
            try:
                ray.init(**kwargs)
            except Exception as e:  # noqa: BLE001 -- whatever stopped Ray from starting is reported alike
                raise _start_error(address, e) from None
            if address:
                logger.info("cache build: joined Ray at %s", address)
            else:
                logger.info("cache build: started a local Ray instance (token authentication unless "
                            "RAY_AUTH_MODE=disabled)")
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.workers = min(num_workers, cpus) if num_workers else cpus
        self.window = 2 * max(self.workers, 1)
        self._key = json.dumps([tokenizer.fingerprint(), eos], sort_keys=True)
        self._box = [ray.put(tokenizer)]
        self._eos = eos
        self._fault = os.environ.get(_FAULT_RAISE_ONCE)
        remote = ray.remote(num_cpus=1, max_retries=_TASK_RETRIES, retry_exceptions=_RETRIED)
        self._remote = remote(_encode_task)

    def submit(self, docs: list, shard: str, where: list[str]) -> _RayResult:
        ref = self._remote.remote(self._key, self._box, self._eos, docs, shard, where, self._fault)
        return _RayResult(self._ray, ref)

    def close(self) -> None:
        pass
