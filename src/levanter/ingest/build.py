"""Building token caches: documents -> token ids in a tensorstore jagged array + a ledger.

A cache directory holds ``input_ids/`` (a :class:`~levanter.store.jagged_array.JaggedArrayStore`, one
row per document) and ``shard_ledger.json`` (a :class:`~levanter.store.ledger.CacheLedger`). This module
writes them; :class:`~levanter.store.cache.TokenCache` opens a finished one for reading.

Determinism: shards are processed in the given order and documents in file order. Tokenization runs
in this process, in a process pool (``spawn``, so a parent that has started JAX is safe) or in Ray tasks
(``cache_options.backend: ray``, :mod:`levanter.ingest.ray_backend`), but this module reads the shards,
cuts the batches and commits the results in submission order in every case -- one code path above "who
tokenizes this batch" -- so the cache is byte-identical whatever the backend and worker count. Progress
is reported by :class:`~levanter.ingest.progress.BuildProgress` (a bar on a terminal, log lines elsewhere,
a summary at the end).

Crash safety: a batch of documents is appended to the store *first* and committed to the ledger
*second* (an atomic rename locally, one PUT on an object store: the ledger write is the commit). The ledger is the authority: rows past ``ledger.total_rows`` are garbage from
a killed writer and are overwritten on the next run, which skips the documents the ledger already
counts. A killed build therefore resumes and ends byte-identical to an uninterrupted one. A finished
cache is never rewritten, and a cache whose recorded settings (tokenizer, text key, EOS, shard list)
differ from the requested ones is refused, never silently reused.

Stale inputs: the ledger records each input file's identity
(:func:`~levanter.ingest.identity.file_identity`: size, modification and status-change times, inode, a hash
of the whole content). Before a finished cache is served, or an interrupted build resumed, the configured
URLs are expanded again and compared: a file that was edited, added to a glob or removed is refused with one
error naming it. A finished cache whose input files are all gone still serves (the files are not needed once
tokenized); a cache recorded without identities is served with a warning that it cannot be checked.
``embedded://`` sources are identified by their corpus fingerprint instead.

Concurrent builders: a build holds ``<cache_dir>/build.lock`` (:mod:`levanter.ingest.build_lock`) while it
writes; a second run building the same cache waits for it and then serves (or resumes) what it left.

A build that produced no tokens is never marked finished, and one that committed no tokens restarts
from scratch when its inputs changed. A full disk is reported as
:class:`~levanter.errors.OutOfSpaceError` naming the cache; the ledger only ever counts rows whose writes
landed, so the next run resumes from the last commit.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ..errors import OutOfSpaceError, is_out_of_space, out_of_space_error
from ..store.cache import LOSS_MASK_DIR, TokenCache
from ..store.jagged_array import JaggedArrayStore
from ..store.ledger import CacheLedger
from ..utils import fs
from ..utils.fault import fault_point
from .build_lock import acquire_build_lock, clear_stale_build_lock
from .cache_check import (
    CacheMismatchError,
    cache_metadata,
    check_metadata,
    check_writable,
    describe_items,
    input_identities,
    resume_mismatch,
    verify_inputs,
)
from .cache_options import CacheOptions
from .chat import ChatSpec, ChatTokenizer
from .encoders import make_encoder
from .errors import SourceError
from .progress import BuildProgress
from .sources import check_embedded_url, expand_urls, iter_located_documents

__all__ = ["build_or_load_cache"]

logger = logging.getLogger(__name__)


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
    cache_key: str = "cache_dir",
    progress: bool = True,
    chat: ChatSpec | None = None,
) -> TokenCache:
    """Open the finished cache at ``cache_dir``, or build (or resume building) it from ``urls``.

    ``urls`` are expanded by :func:`~levanter.ingest.sources.expand_urls` (``embedded://`` sources are
    materialised under ``embedded_dir``); ``what`` names the config key of the inputs in errors and
    ``cache_key`` that of the cache directory. ``chat``: the documents are conversations (``text_key`` is the
    messages field), tokenized with their assistant mask into a second store, ``loss_mask/``
    (:mod:`levanter.ingest.chat`).
    """
    options.check()
    for u in urls:
        if u.startswith("embedded://"):
            check_embedded_url(u, what=what)
    wanted = cache_metadata(tokenizer, urls=urls, text_key=text_key, enforce_eos=enforce_eos, chat=chat)
    try:
        ledger = CacheLedger.load(cache_dir)
    except fs.StorageAccessError as e:
        raise fs.StorageAccessError(f"{cache_key}: {e}") from None
    full = options.verify_inputs == "full"
    if ledger is not None:
        check_metadata(cache_dir, ledger.metadata, wanted)
        if ledger.is_finished:
            verify_inputs(cache_dir, ledger, urls, what=what, full=full)
            clear_stale_build_lock(cache_dir, ledger_path=CacheLedger.path_in(cache_dir))
            return TokenCache.open(cache_dir)
    check_writable(cache_dir, cache_key)
    try:
        # One builder at a time: another run building this cache now is waited for, and what it finished
        # is served (levanter.ingest.build_lock).
        lock = acquire_build_lock(cache_dir, ledger_path=CacheLedger.path_in(cache_dir))
        try:
            ledger = CacheLedger.load(cache_dir)
            if ledger is not None:
                check_metadata(cache_dir, ledger.metadata, wanted)
                if ledger.is_finished:
                    verify_inputs(cache_dir, ledger, urls, what=what, full=full)
                    return TokenCache.open(cache_dir)
            return _build(urls, cache_dir, tokenizer, ledger, wanted, text_key=text_key,
                          enforce_eos=enforce_eos, options=options, embedded_dir=embedded_dir, what=what,
                          progress=progress, chat=chat)
        finally:
            lock.release()
    except OutOfSpaceError:
        raise
    except Exception as e:
        # tensorstore reports a full disk as a ValueError; neither it nor the OSError of a ledger save is
        # the config's fault, and the ledger never counts rows whose writes failed.
        if is_out_of_space(e):
            raise out_of_space_error("building the token cache", cache_dir) from None
        raise


def _build(urls, cache_dir, tokenizer, ledger, wanted, *, text_key, enforce_eos, options, embedded_dir, what,
           progress, chat=None) -> TokenCache:
    # A build killed inside a ledger save leaves its temporary file behind; the resumed build must end
    # byte-identical to an uninterrupted one, so clear it.
    fs.remove_stale_temporaries(cache_dir, "shard_ledger.json")
    shards = expand_urls(urls, embedded_dir=embedded_dir, what=what)
    ledger = _start_or_resume(urls, cache_dir, ledger, wanted, shards, what, full=options.verify_inputs == "full")
    writer = _CacheWriter(cache_dir, ledger, chat=chat is not None)
    if chat is not None:
        tokenizer = ChatTokenizer(tokenizer, chat)
    eos = tokenizer.eos_token_id if enforce_eos else None
    todo = [sh for sh in shards if sh not in ledger.finished_shards]
    todo_bytes = {sh: int(fs.size(sh) or 0) for sh in todo}
    # A chat source's record field is its messages_field (so an SFT config and a chat format section name
    # it), a text source's its text_key.
    key_name = "messages_field" if chat is not None else "text_key"
    finished = False
    encoder = None
    try:
        encoder = make_encoder(options, tokenizer, eos, sum(todo_bytes.values()))
        # The clock starts once the workers exist: the throughput is the build's, not Ray's start-up.
        writer.report = BuildProgress(
            cache_dir, shard_bytes=todo_bytes,  # the cache's path as given, where the user will look for it
            shards_total=len(shards), docs=ledger.total_rows, tokens=ledger.total_tokens,
            backend=options.backend, enabled=progress,
        )
        _commit_in_order(encoder, _tasks(todo, ledger, text_key, options.batch_size, key_name), writer)
        if ledger.total_tokens == 0:
            # A finished empty cache would be reused as is after the files are fixed; left unfinished,
            # the next run restarts it from the current files.
            raise SourceError(
                f"{what}: no text in {describe_items(list(shards))}: the cache build produced 0 tokens. Check "
                "the files (and text_key); the next run rebuilds the cache."
            )
        writer.finalize()
        finished = True
    finally:
        if encoder is not None:
            encoder.close()
        if writer.report is not None:
            writer.report.close(finished=finished)
    return TokenCache.open(cache_dir)


def _start_or_resume(urls, cache_dir: str, ledger: CacheLedger | None, wanted: dict, shards: list[str],
                     what: str, *, full: bool) -> CacheLedger:
    """The ledger the build continues: the interrupted build's where its inputs are unchanged, else a new,
    empty one (saved) where the interrupted build committed no tokens; inputs changed under committed tokens
    are refused."""
    if ledger is not None:
        changed = resume_mismatch(cache_dir, ledger, shards, what, full=full)
        if changed is not None and ledger.total_tokens == 0:
            # Nothing of value was committed (e.g. a build that found no text): start again from the
            # current files rather than make the user delete the directory.
            logger.info("restarting the cache build at %s: %s", cache_dir, changed)
            ledger = None
        elif changed is not None:
            raise CacheMismatchError(
                f"the input files of {what} changed since the interrupted cache build at {cache_dir!r}: "
                f"{changed}. Delete {cache_dir} to rebuild it from the current files."
            )
        else:
            logger.info("resuming the cache build at %s from %d documents", cache_dir, ledger.total_rows)
    if ledger is None:
        fs.makedirs(cache_dir)
        ledger = CacheLedger(
            shard_rows={}, shard_docs={}, finished_shards=[], total_rows=0, total_tokens=0, is_finished=False,
            metadata={**wanted, "shards": shards, "inputs": input_identities(urls, shards, what)},
        )
        ledger.save(cache_dir)
    return ledger


class _CacheWriter:
    """The cache's stores and its ledger: a batch is appended to the stores *first* and committed to the
    ledger *second*, so the ledger never counts rows whose writes did not land."""

    def __init__(self, cache_dir: str, ledger: CacheLedger, *, chat: bool):
        self.cache_dir, self.ledger = cache_dir, ledger
        self.store = JaggedArrayStore.open(fs.join(cache_dir, "input_ids"), mode="a", num_rows=ledger.total_rows)
        # A chat cache's assistant mask: a second store aligned row for row with input_ids, appended in the
        # same commit (both before the ledger save), so the ledger's row count covers both.
        self.mask_store = None
        if chat:
            self.mask_store = JaggedArrayStore.open(fs.join(cache_dir, LOSS_MASK_DIR), mode="a", dtype=np.uint8,
                                                    num_rows=ledger.total_rows)
        self.report: BuildProgress | None = None

    def commit(self, shard: str, flat: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        ledger = self.ledger
        self.store.append_flat(flat, lengths)
        if self.mask_store is not None:
            self.mask_store.append_flat(mask, lengths)
        fault_point("cache_after_append")
        ledger.shard_docs[shard] = ledger.shard_docs.get(shard, 0) + len(lengths)
        ledger.shard_rows[shard] = ledger.shard_rows.get(shard, 0) + len(lengths)
        ledger.total_rows += len(lengths)
        ledger.total_tokens += int(lengths.sum())
        ledger.save(self.cache_dir)
        fault_point("cache_after_commit")
        if self.report is not None:
            self.report.committed(len(lengths), int(lengths.sum()))

    def finish_shard(self, shard: str) -> None:
        self.ledger.shard_docs.setdefault(shard, 0)
        self.ledger.shard_rows.setdefault(shard, 0)
        self.ledger.finished_shards.append(shard)
        self.ledger.save(self.cache_dir)
        if self.report is not None:
            self.report.shard_done(shard)

    def finalize(self) -> None:
        """Mark the cache finished: the stores finalised, then the ledger saved with ``is_finished``."""
        self.store.finalize()
        if self.mask_store is not None:
            self.mask_store.finalize()
        fault_point("cache_after_finalize")
        self.ledger.is_finished = True
        self.ledger.save(self.cache_dir)


def _tasks(todo: list[str], ledger: CacheLedger, text_key: str, batch_size: int,
           key_name: str) -> Iterator[tuple]:
    """``(shard, locations, docs)`` in commit order; ``docs`` None marks the end of a shard. Each shard skips
    the documents the ledger already counts (read when the shard is reached)."""
    for shard in todo:
        skip = ledger.shard_docs.get(shard, 0)
        for where, docs in _doc_batches(shard, text_key, skip, batch_size, key_name):
            yield shard, where, docs
        yield shard, None, None


def _commit_in_order(encoder, tasks: Iterable[tuple], writer: _CacheWriter) -> None:
    """Submit every task's batch to ``encoder`` and commit the results strictly in submission order, with at
    most ``encoder.window`` batches in flight: whoever tokenizes, the one place that decides what the cache
    holds."""
    in_flight: deque = deque()
    pending = 0
    for shard, where, docs in tasks:
        fut = None
        if docs is not None:
            fut = encoder.submit(docs, shard, where)
            pending += 1
        in_flight.append((shard, fut))
        while pending > encoder.window:
            pending -= _drain_one(in_flight, writer)
    while in_flight:
        _drain_one(in_flight, writer)


def _drain_one(in_flight: deque, writer: _CacheWriter) -> int:
    """Commit (or finish the shard of) the oldest entry in flight; 1 where it was a batch, else 0."""
    shard, fut = in_flight.popleft()
    if fut is None:
        writer.finish_shard(shard)
        return 0
    writer.commit(shard, *fut.result())
    return 1


def _doc_batches(shard: str, text_key: str, skip: int, batch_size: int,
                 key_name: str = "text_key") -> Iterator[tuple[list, list]]:
    """``(locations, documents)`` batches of one shard, after skipping ``skip`` documents; a location is
    what errors call the document (``"line 6"``). ``key_name``: the config key that chose ``text_key``."""
    docs: list = []
    where: list = []
    for k, (loc, doc) in enumerate(iter_located_documents(shard, text_key=text_key, key_name=key_name)):
        if k < skip:
            continue
        docs.append(doc)
        where.append(loc)
        if len(docs) == batch_size:
            yield where, docs
            docs, where = [], []
    if docs:
        yield where, docs
