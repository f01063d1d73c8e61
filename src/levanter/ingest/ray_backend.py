"""The Ray side of a cache build: batches of documents tokenized by Ray tasks, on one machine or a cluster.

Only *who tokenizes a batch* differs from the process pool: the builder (:mod:`levanter.ingest.build`)
reads the shards, submits batches here, and commits the results to the store and the ledger in
submission order, exactly as with the pool -- so a Ray build is byte-identical to a process-pool build.
The driver reads every input file and ships documents to the tasks: files on the driver's disk (and the
embedded corpus) work on a cluster whose nodes cannot see them, at the price of the driver's bandwidth;
tokenizing, the CPU-heavy part, spreads over the cluster.

``ray.init(address=...)`` joins a running cluster; without an address a local Ray instance is started on
this machine with one CPU per worker. A Ray instance this process already joined (``ray.is_initialized()``)
is used as is, and one started here is left running for the next build of the same process (Ray shuts it
down at exit): starting Ray costs seconds, and ``cache_dataset`` builds two caches per source.

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

from ..utils import fs
from .errors import SourceError
from .tokenize_worker import encode

logger = logging.getLogger(__name__)

_FAULT_RAISE_ONCE = "LEVANTER_FAULT_RAISE_ONCE"
"""A path: the first task that creates this file raises (crash-safety tests; unset in production)."""

_TASK_RETRIES = 3
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
            kwargs: dict = {"include_dashboard": False, "log_to_driver": False}
            if address:
                kwargs["address"] = address
            else:
                kwargs["num_cpus"] = num_workers or os.cpu_count() or 1
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
                raise ValueError(
                    f"cache_options.ray_address: cannot start or join {where} ({fs.redact(str(e))}); "
                    "check the address (host:port of the head node, or 'auto' for the cluster this machine "
                    "belongs to), or leave it unset to start Ray on this machine"
                ) from None
            logger.info("cache build: started or joined Ray (%s)", address or "local instance")
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
