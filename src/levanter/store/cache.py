"""Building and opening token caches: documents -> token ids in a tensorstore jagged array + a ledger.

A cache directory holds ``input_ids/`` (a :class:`~levanter.store.jagged_array.JaggedArrayStore`, one
row per document) and ``shard_ledger.json`` (a :class:`~levanter.store.ledger.CacheLedger`).

Determinism: shards are processed in the given order and documents in file order; tokenization runs
in a process pool (``spawn``, so a parent that has started JAX is safe) but results are committed in
submission order, so the cache is byte-identical whatever the worker count.

Crash safety: a batch of documents is appended to the store *first* and committed to the ledger
*second* (atomic rename). The ledger is the authority: rows past ``ledger.total_rows`` are garbage from
a killed writer and are overwritten on the next run, which skips the documents the ledger already
counts. A killed build therefore resumes and ends byte-identical to an uninterrupted one. A finished
cache is never rewritten, and a cache whose recorded settings (tokenizer, text key, EOS, shard list)
differ from the requested ones is refused, never silently reused.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from ..data._tokenize_worker import encode as _encode
from ..data._tokenize_worker import encode_in_worker as _encode_in_worker
from ..data._tokenize_worker import init_worker as _init_worker
from ..data.sources import check_embedded_url, expand_urls, iter_documents
from ..utils.fault import fault_point
from ..utils.fs import remove_stale_temporaries
from .jagged_array import JaggedArrayStore
from .ledger import CacheLedger

logger = logging.getLogger(__name__)

CACHE_FORMAT = "levanter-token-cache-v1"


class CacheMismatchError(ValueError):
    """A cache exists at the path but was built with other settings."""


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """How caches are built.

    ``num_workers``: tokenizer processes (None: one per core). ``batch_size``: documents per task and per
    ledger commit. ``min_bytes_for_pool``: inputs smaller than this are tokenized in this process --
    spawning workers costs about a second, more than a small corpus takes (HF tokenizers are
    multithreaded in-process anyway). Where a batch is encoded never changes what is written.
    """

    num_workers: int | None = None
    batch_size: int = 512
    min_bytes_for_pool: int = 64 * 2**20

    def resolved_workers(self) -> int:
        n = self.num_workers if self.num_workers is not None else (os.cpu_count() or 1)
        if n < 1:
            raise ValueError(f"cache_options.num_workers must be >= 1, got {n}")
        return n


# -- parent side ---------------------------------------------------------------------------------------
class TokenCache:
    """A finished cache: ``store`` (token ids, one row per document), ``ledger`` and its metadata."""

    def __init__(self, cache_dir: str, store: JaggedArrayStore, ledger: CacheLedger):
        self.cache_dir = cache_dir
        self.store = store
        self.ledger = ledger

    @property
    def metadata(self) -> dict:
        return self.ledger.metadata

    @property
    def eos_id(self) -> int | None:
        return self.ledger.metadata.get("eos_id")

    @staticmethod
    def open(cache_dir: str) -> "TokenCache":
        ledger = CacheLedger.load(cache_dir)
        if ledger is None:
            raise FileNotFoundError(f"no token cache at {cache_dir!r} (missing shard_ledger.json)")
        if not ledger.is_finished:
            raise ValueError(f"the token cache at {cache_dir!r} is unfinished; rerun the build to complete it")
        store = JaggedArrayStore.open(os.path.join(cache_dir, "input_ids"), mode="r", num_rows=ledger.total_rows)
        return TokenCache(cache_dir, store, ledger)


def cache_metadata(tokenizer, *, urls: Sequence[str], text_key: str, enforce_eos: bool) -> dict:
    """Everything that determines a cache's content, compared before reuse.

    Inputs are recorded as the configured URLs (plus a fingerprint of each embedded source, whose text
    depends on the Python version), so a finished cache serves training even where the raw files are
    gone; the expanded shard list is kept under ``"shards"`` and checked when an interrupted build
    resumes.
    """
    from ..data.embedded import corpus_fingerprint, is_embedded_url, parse_embedded_url

    eos = tokenizer.eos_token_id if enforce_eos else None
    if enforce_eos and eos is None:
        raise ValueError(
            f"enforce_eos is true but the tokenizer {tokenizer.name!r} has no EOS token to append; set "
            "data.enforce_eos: false (pre-tokenized data usually carries its own separators)"
        )
    embedded = {u: corpus_fingerprint(parse_embedded_url(u)[0]) for u in urls if is_embedded_url(u)}
    return {
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer.fingerprint(),
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": tokenizer.eos_token_id,
        "enforce_eos": bool(enforce_eos),
        "text_key": text_key,
        "urls": list(urls),
        "embedded": embedded,
    }


def _check_metadata(cache_dir: str, found: dict, wanted: dict) -> None:
    keys = (set(found) | set(wanted)) - {"shards"}
    diffs = [k for k in sorted(keys) if found.get(k) != wanted.get(k)]
    if diffs:
        pairs = [(k, *_differing(found.get(k), wanted.get(k))) for k in diffs]
        detail = "; ".join(f"{k}: cache has {a!r}, config asks for {b!r}" for k, a, b in pairs)
        raise CacheMismatchError(
            f"the cache at {cache_dir!r} was built with different settings ({detail}). Use another cache_dir, "
            "or delete this one to rebuild it."
        )


def _differing(a, b):
    """``(a, b)``, or for two mappings only their differing entries (a content hash only if nothing else
    differs)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a, b
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if len(keys) > 1 and "hash" in keys:
        keys.remove("hash")
    return {k: a.get(k) for k in keys}, {k: b.get(k) for k in keys}


def _total_bytes(paths: Sequence[str]) -> int:
    import fsspec

    total = 0
    for p in paths:
        fs, _, (path,) = fsspec.core.get_fs_token_paths(p)
        total += int(fs.size(path) or 0)
    return total


def _doc_batches(shard: str, text_key: str, skip: int, batch_size: int) -> Iterator[tuple[int, list]]:
    """``(index of first document, documents)`` batches of one shard, after skipping ``skip`` documents."""
    batch: list = []
    first = skip
    for k, doc in enumerate(iter_documents(shard, text_key=text_key)):
        if k < skip:
            continue
        if not batch:
            first = k
        batch.append(doc)
        if len(batch) == batch_size:
            yield first, batch
            batch = []
    if batch:
        yield first, batch


def build_or_load_cache(
    urls: Sequence[str],
    cache_dir: str,
    tokenizer,
    *,
    text_key: str = "text",
    enforce_eos: bool = True,
    options: CacheOptions = CacheOptions(),
    embedded_dir: str | None = None,
    what: str = "train_urls",
    progress: bool = True,
) -> TokenCache:
    """Open the finished cache at ``cache_dir``, or build (or resume building) it from ``urls``.

    ``urls`` are expanded by :func:`~levanter.data.sources.expand_urls` (``embedded://`` sources are
    materialised under ``embedded_dir``); ``what`` names the config key in errors.
    """
    for u in urls:
        if u.startswith("embedded://"):
            check_embedded_url(u, what=what)
    wanted = cache_metadata(tokenizer, urls=urls, text_key=text_key, enforce_eos=enforce_eos)
    ledger = CacheLedger.load(cache_dir)
    if ledger is not None:
        _check_metadata(cache_dir, ledger.metadata, wanted)
        if ledger.is_finished:
            return TokenCache.open(cache_dir)
    # A build killed inside a ledger save leaves its temporary file behind; the resumed build must end
    # byte-identical to an uninterrupted one, so clear it.
    remove_stale_temporaries(cache_dir, "shard_ledger.json")
    shards = expand_urls(urls, embedded_dir=embedded_dir, what=what)
    if ledger is not None:
        if ledger.metadata.get("shards") != shards:
            raise CacheMismatchError(
                f"the input files of {what} changed since the interrupted cache build at {cache_dir!r} "
                f"(was {ledger.metadata.get('shards')}, now {shards}); delete the cache directory to rebuild"
            )
        logger.info("resuming the cache build at %s from %d documents", cache_dir, ledger.total_rows)
    else:
        os.makedirs(cache_dir, exist_ok=True)
        ledger = CacheLedger(
            shard_rows={}, shard_docs={}, finished_shards=[], total_rows=0, total_tokens=0, is_finished=False,
            metadata={**wanted, "shards": shards},
        )
        ledger.save(cache_dir)
    store = JaggedArrayStore.open(os.path.join(cache_dir, "input_ids"), mode="a", num_rows=ledger.total_rows)
    eos = tokenizer.eos_token_id if enforce_eos else None
    workers = options.resolved_workers()

    bar = None
    if progress:
        from tqdm.auto import tqdm

        label = "/".join(os.path.normpath(cache_dir).split(os.sep)[-2:])
        bar = tqdm(desc=f"caching {label}", unit=" docs", initial=ledger.total_rows)
    t0, tokens_at_start = time.perf_counter(), ledger.total_tokens

    def commit(shard: str, flat: np.ndarray, lengths: np.ndarray) -> None:
        store.append_flat(flat, lengths)
        fault_point("cache_after_append")
        ledger.shard_docs[shard] = ledger.shard_docs.get(shard, 0) + len(lengths)
        ledger.shard_rows[shard] = ledger.shard_rows.get(shard, 0) + len(lengths)
        ledger.total_rows += len(lengths)
        ledger.total_tokens += int(lengths.sum())
        ledger.save(cache_dir)
        fault_point("cache_after_commit")
        if bar is not None:
            bar.update(len(lengths))
            rate = (ledger.total_tokens - tokens_at_start) / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tokens=f"{ledger.total_tokens:,}", tok_per_s=f"{rate:,.0f}", refresh=False)

    todo = [sh for sh in shards if sh not in ledger.finished_shards]
    use_pool = workers > 1 and _total_bytes(todo) >= options.min_bytes_for_pool

    def tasks():
        """``(shard, first_doc, docs)`` in commit order; ``docs`` None marks the end of a shard."""
        for shard in todo:
            for first, docs in _doc_batches(shard, text_key, ledger.shard_docs.get(shard, 0), options.batch_size):
                yield shard, first, docs
            yield shard, None, None

    def finish_shard(shard: str) -> None:
        ledger.shard_docs.setdefault(shard, 0)
        ledger.shard_rows.setdefault(shard, 0)
        ledger.finished_shards.append(shard)
        ledger.save(cache_dir)

    pool = None
    try:
        if not use_pool:
            for shard, first, docs in tasks():
                if docs is None:
                    finish_shard(shard)
                else:
                    commit(shard, *_encode(tokenizer, eos, docs, shard, first))
        else:
            pool = cf.ProcessPoolExecutor(
                max_workers=workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tokenizer, eos),
            )
            # One pool for all shards and a bounded window of tasks, committed strictly in order.
            in_flight: deque = deque()

            def drain_one():
                shard, fut = in_flight.popleft()
                if fut is None:
                    finish_shard(shard)
                else:
                    commit(shard, *fut.result())

            for shard, first, docs in tasks():
                fut = None if docs is None else pool.submit(_encode_in_worker, docs, shard, first)
                in_flight.append((shard, fut))
                while sum(f is not None for _, f in in_flight) > 2 * workers:
                    drain_one()
            while in_flight:
                drain_one()
        store.finalize()
        fault_point("cache_after_finalize")
        ledger.is_finished = True
        ledger.save(cache_dir)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    return TokenCache.open(cache_dir)
