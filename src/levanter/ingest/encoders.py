"""Who tokenizes a cache's batches: this process, a process pool on this machine, or Ray tasks.

Each encoder takes a batch with ``submit`` and returns a future-like object whose ``result()`` is the
batch's tokens; ``window`` says how many batches may be in flight. The builder
(:mod:`levanter.ingest.build`) commits results strictly in submission order whatever the encoder, so
every one gives the same bytes; they differ only in where tokenizing runs.

Trade-off: small inputs are tokenized in this process (``cache_options.min_bytes_for_pool``): spawning
workers costs about a second, more than a small corpus takes.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os

from .cache_options import CacheOptions
from .tokenize_worker import encode, encode_in_worker, init_worker

__all__ = ["make_encoder"]


class _Done:
    """A result computed already (the in-process encoder's "future")."""

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value


class _InlineEncoder:
    """Tokenizes each batch in this process when it is submitted."""

    window = 0

    def __init__(self, tokenizer, eos):
        self._tokenizer, self._eos = tokenizer, eos

    def submit(self, docs, shard, where):
        return _Done(encode(self._tokenizer, self._eos, docs, shard, where))

    def close(self) -> None:
        pass


class _PoolEncoder:
    """A process pool on this machine (``spawn``: safe when the parent has started JAX)."""

    def __init__(self, tokenizer, eos, workers: int):
        self.window = 2 * workers
        self._pool = cf.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init_worker,
            initargs=(tokenizer, eos, os.getpid()),
        )

    def submit(self, docs, shard, where):
        return self._pool.submit(encode_in_worker, docs, shard, where)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def make_encoder(options: CacheOptions, tokenizer, eos, todo_bytes: int):
    """The encoder ``options`` ask for: Ray tasks, a process pool, or (small inputs, one worker) this
    process. Every one gives the same bytes; they differ only in where tokenizing runs."""
    if options.backend == "ray":
        from .ray_backend import RayEncoder

        return RayEncoder(tokenizer, eos, address=options.ray_address, num_workers=options.num_workers)
    workers = options.resolved_workers()
    if workers > 1 and todo_bytes >= options.min_bytes_for_pool:
        return _PoolEncoder(tokenizer, eos, workers)
    return _InlineEncoder(tokenizer, eos)
