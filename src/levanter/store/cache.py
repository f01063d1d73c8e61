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
import itertools
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from ..data.sources import SourceError, expand_urls, iter_documents
from ..utils.fault import fault_point
from .jagged_array import JaggedArrayStore
from .ledger import CacheLedger

logger = logging.getLogger(__name__)

CACHE_FORMAT = "levanter-token-cache-v1"


class CacheMismatchError(ValueError):
    """A cache exists at the path but was built with other settings."""


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """How caches are built. ``num_workers`` None means one tokenizer process per core;
    ``batch_size`` is documents per task (and per ledger commit)."""

    num_workers: int | None = None
    batch_size: int = 512

    def resolved_workers(self) -> int:
        n = self.num_workers if self.num_workers is not None else (os.cpu_count() or 1)
        if n < 1:
            raise ValueError(f"cache_options.num_workers must be >= 1, got {n}")
        return n


# -- worker side (runs in pool processes; keep imports light) ------------------------------------------
_WORKER_TOKENIZER = None
_WORKER_EOS: int | None = None


def _init_worker(tokenizer, eos_to_append: int | None) -> None:
    global _WORKER_TOKENIZER, _WORKER_EOS
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_TOKENIZER, _WORKER_EOS = tokenizer, eos_to_append


def _encode(tokenizer, eos: int | None, docs: list, shard: str, first_doc: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``docs`` as (flat ids, per-document lengths), EOS appended when ``eos`` is set."""
    if getattr(tokenizer, "name", None) == "passthrough":
        rows = []
        for k, doc in enumerate(docs):
            if not isinstance(doc, list) or not all(isinstance(t, int) for t in doc):
                raise SourceError(
                    f"{shard}, document {first_doc + k}: the passthrough tokenizer expects a list of token ids"
                )
            arr = np.asarray(doc, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
                raise SourceError(
                    f"{shard}, document {first_doc + k}: token id out of range [0, {tokenizer.vocab_size}) (vocab_size)"
                )
            rows.append(arr)
    else:
        for k, doc in enumerate(docs):
            if not isinstance(doc, str):
                raise SourceError(f"{shard}, document {first_doc + k}: expected text, got {type(doc).__name__}")
        rows = [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(docs)]
    if eos is not None:
        rows = [np.append(r, eos) for r in rows]
    lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
    flat = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    return flat, lengths


def _encode_in_worker(docs: list, shard: str, first_doc: int):
    return _encode(_WORKER_TOKENIZER, _WORKER_EOS, docs, shard, first_doc)


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
        raise ValueError(f"enforce_eos: the tokenizer {tokenizer.name!r} has no EOS token")
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
        detail = "; ".join(f"{k}: cache has {found.get(k)!r}, config asks for {wanted.get(k)!r}" for k in diffs)
        raise CacheMismatchError(
            f"the cache at {cache_dir!r} was built with different settings ({detail}). Use another cache_dir, "
            "or delete this one to rebuild it."
        )


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
    wanted = cache_metadata(tokenizer, urls=urls, text_key=text_key, enforce_eos=enforce_eos)
    ledger = CacheLedger.load(cache_dir)
    if ledger is not None:
        _check_metadata(cache_dir, ledger.metadata, wanted)
        if ledger.is_finished:
            return TokenCache.open(cache_dir)
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
        store.append(np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else [])
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

    pool = None

    def get_pool():
        # Started on the first shard with more than one batch: a small cache is not worth the ~1 s it
        # takes to spawn workers. Which process encodes a batch never changes what is written.
        nonlocal pool
        if pool is None:
            pool = cf.ProcessPoolExecutor(
                max_workers=workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tokenizer, eos),
            )
        return pool

    try:
        for shard in shards:
            if shard in ledger.finished_shards:
                continue
            skip = ledger.shard_docs.get(shard, 0)
            batches = _doc_batches(shard, text_key, skip, options.batch_size)
            first_batch = next(batches, None)
            second_batch = next(batches, None)
            if workers == 1 or second_batch is None:
                for first, docs in filter(None, (first_batch, second_batch)):
                    commit(shard, *_encode(tokenizer, eos, docs, shard, first))
                for first, docs in batches:
                    commit(shard, *_encode(tokenizer, eos, docs, shard, first))
            else:
                # Bounded in-flight window, committed strictly in submission order.
                in_flight: deque = deque()
                for first, docs in itertools.chain([first_batch, second_batch], batches):
                    in_flight.append(get_pool().submit(_encode_in_worker, docs, shard, first))
                    if len(in_flight) >= 2 * workers:
                        commit(shard, *in_flight.popleft().result())
                while in_flight:
                    commit(shard, *in_flight.popleft().result())
            ledger.shard_docs.setdefault(shard, 0)
            ledger.shard_rows.setdefault(shard, 0)
            ledger.finished_shards.append(shard)
            ledger.save(cache_dir)
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
