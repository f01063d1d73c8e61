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

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
import os
import re
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Optional, Union

import numpy as np

from ..refused_keys import check_refused, refused
from ..errors import OutOfSpaceError, is_out_of_space, out_of_space_error
from ..store.cache import LOSS_MASK_DIR, TokenCache
from ..store.jagged_array import JaggedArrayStore
from ..store.ledger import CacheLedger
from ..utils.fault import fault_point
from ..utils import fs
from .build_lock import acquire_build_lock, clear_stale_build_lock
from .chat import ChatSpec, ChatTokenizer
from .embedded import corpus_fingerprint, is_embedded_url, parse_embedded_url
from .errors import SourceError
from .progress import BuildProgress
from .identity import VERIFY_MODES, file_identity, identity_change, is_partial
from .sources import check_embedded_url, expand_urls, iter_located_documents
from .tokenize_worker import encode, encode_in_worker, init_worker

__all__ = [
    "CacheMismatchError",
    "CacheOptions",
    "cache_metadata",
    "verify_inputs",
    "check_writable",
    "build_or_load_cache",
]

logger = logging.getLogger(__name__)

CACHE_FORMAT = "levanter-token-cache-v1"


class CacheMismatchError(ValueError):
    """A cache exists at the path but was built with other settings."""


BACKENDS = ("process", "ray")


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """How caches are built: the ``cache_options`` section of a data config.

    ``min_bytes_for_pool``: with the process backend, inputs smaller than this are tokenized in this
    process -- spawning workers costs about a second, more than a small corpus takes (HF tokenizers are
    multithreaded in-process anyway). Where a batch is encoded never changes what is written: every
    backend gives the same bytes.
    """

    # Tokenizer workers: processes or concurrent Ray tasks (None: one per core, or the Ray cluster's CPUs).
    num_workers: Optional[int] = None
    # Documents per tokenization task and per ledger commit.
    batch_size: int = 512
    # With backend process, inputs smaller than this many bytes are tokenized in the building process.
    min_bytes_for_pool: int = 64 * 2**20
    # Who tokenizes: 'process' (a process pool on this machine) or 'ray' (Ray tasks; needs levanter[ray]).
    backend: str = "process"
    # With backend ray: the cluster to join (host:port or 'auto'); unset starts a local Ray instance.
    ray_address: Optional[str] = None
    # How a cache's local input files are checked: 'metadata' (rehash a file only when its size, mtime,
    # ctime or inode changed) or 'full' (rehash every file whenever the cache is opened).
    verify_inputs: str = "metadata"
    # Upstream's CacheOptions keys below only shape how upstream's Ray builder parallelises and flushes,
    # never what is written; this builder has its own knobs (num_workers, batch_size) and ignores them.
    # Upstream: shards per build group (its unit of parallel work); accepted, no effect here.
    num_shard_groups: Optional[int] = 128
    # Upstream: bytes buffered before a write (an int or a size such as 512MB); accepted, no effect here.
    target_size_per_flush: Union[int, str] = "512MB"
    # Upstream: batches prefetched per build group; accepted, no effect here.
    prefetch_per_group: int = 4
    # Upstream: a key that shuffles the shards' order before the build, which changes the data's order;
    # refused if set (shards are read in the order configured here).
    shard_order_randomization_key: Optional[int] = refused(
        "shards are read in the configured order here; remove the key, or reorder the URLs yourself"
    )

    def resolved_workers(self) -> int:
        n = self.num_workers if self.num_workers is not None else (os.cpu_count() or 1)
        if n < 1:
            raise ValueError(f"cache_options.num_workers must be >= 1, got {n}")
        return n

    def check(self) -> None:
        """Refuse settings no build can use, naming the key."""
        check_refused(self, "cache_options")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"cache_options.backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"cache_options.num_workers must be >= 1, got {self.num_workers}")
        if self.batch_size < 1:
            raise ValueError(f"cache_options.batch_size must be >= 1, got {self.batch_size}")
        if self.verify_inputs not in VERIFY_MODES:
            raise ValueError(
                f"cache_options.verify_inputs: expected one of {', '.join(VERIFY_MODES)}, got "
                f"{self.verify_inputs!r}"
            )
        if self.num_shard_groups is not None and self.num_shard_groups < 1:
            raise ValueError(f"cache_options.num_shard_groups must be >= 1 or null, got {self.num_shard_groups}")
        if self.prefetch_per_group < 1:
            raise ValueError(f"cache_options.prefetch_per_group must be >= 1, got {self.prefetch_per_group}")
        size = self.target_size_per_flush
        if isinstance(size, bool) or (isinstance(size, int) and size < 1) or (
            isinstance(size, str) and not re.fullmatch(r"\s*\d+(\.\d*)?\s*[a-zA-Z]*\s*", size)
        ):
            raise ValueError(
                f"cache_options.target_size_per_flush must be a positive number of bytes or a size such as "
                f"512MB, got {size!r}"
            )
        if self.ray_address is not None and self.backend != "ray":
            raise ValueError(
                f"cache_options.ray_address is set ({self.ray_address!r}) but cache_options.backend is "
                f"{self.backend!r}; set backend: ray to build on that cluster"
            )


def cache_metadata(
    tokenizer, *, urls: Sequence[str], text_key: str, enforce_eos: bool, chat: ChatSpec | None = None
) -> dict:
    """Everything that determines a cache's content, compared before reuse.

    A chat cache (``chat``: :class:`~levanter.ingest.chat.ChatSpec`) records it under ``"chat"``; a text
    cache has no such key, so neither is ever reused as the other (and text caches are as they always were).

    Inputs are recorded as the configured URLs (plus a fingerprint of each embedded source, whose text
    depends on the Python version), so a finished cache serves training even where the raw files are
    gone; the expanded shard list is kept under ``"shards"`` and each file's identity under ``"inputs"``,
    both checked separately (:func:`verify_inputs`, and when an interrupted build resumes).
    """
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
        **({"chat": chat.record()} if chat is not None else {}),
    }


def _check_metadata(cache_dir: str, found: dict, wanted: dict) -> None:
    keys = (set(found) | set(wanted)) - {"shards", "inputs"}
    diffs = [k for k in sorted(keys) if found.get(k) != wanted.get(k)]
    if diffs:
        pairs = [(k, *_differing(found.get(k), wanted.get(k))) for k in diffs]
        detail = "; ".join(f"{k}: cache has {a!r}, config asks for {b!r}" for k, a, b in pairs)
        moved = ""
        if "urls" in diffs:
            # Resume and reuse go by input path (the ledger counts documents per shard file): the same
            # content under other paths, or cut into other shards, is another cache.
            moved = (" A cache is tied to the paths of its input files: inputs moved (to a bucket, another "
                     "directory) or re-split into other shards are not reused or resumed even when their "
                     "content is the same; point the URLs back at the original files to reuse it.")
        raise CacheMismatchError(
            f"the cache at {cache_dir!r} was built with different settings ({detail}).{moved} Use another "
            "cache_dir, or delete this one to rebuild it."
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


# -- input identities ------------------------------------------------------------------------------------
def _file_inputs(urls: Sequence[str], what: str) -> list[str]:
    """The files the non-embedded ``urls`` name now (missing files and empty globs skipped)."""
    return expand_urls([u for u in urls if not u.startswith("embedded://")], what=what, allow_empty=True,
                       missing_ok=True)


def _input_identities(urls: Sequence[str], shards: Sequence[str], what: str) -> dict:
    files = set(_file_inputs(urls, what))
    return {sh: file_identity(sh) for sh in shards if sh in files}


def _describe(items: list[str], limit: int = 3) -> str:
    shown = "; ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}; and {len(items) - limit} more"


# Caches (absolute paths, or URLs) already warned about as recorded without input identities.
_warned_unchecked: set[str] = set()


def _refuse_partial(cache_dir: str, recorded: dict, paths: Sequence[str], what: str) -> None:
    partial = [p for p in paths if p in recorded and is_partial(recorded[p])]
    if partial:
        raise CacheMismatchError(
            f"the token cache at {cache_dir!r} records only a partial content hash (first and last MiB) of "
            f"{_describe(partial)} ({what}), so an edit inside it cannot be detected: delete {cache_dir} to "
            "rebuild it (the rebuilt cache records a hash of the whole content)."
        )


def verify_inputs(
    cache_dir: str, ledger: CacheLedger, urls: Sequence[str], *, what: str = "train_urls", full: bool = False
) -> None:
    """Refuse (:class:`CacheMismatchError`) when the input files of the cache ``ledger`` describes differ
    from what ``urls`` name now: an edited file, a file added to or gone from the shard list.

    ``full`` hashes every local file (``cache_options.verify_inputs: full``); otherwise a file is hashed
    only when its metadata changed (:func:`~levanter.ingest.identity.identity_change`). Where none of the
    recorded files exists any more the cache is served unchecked (tokenized data needs no raw files); a
    cache recorded without identities gets a warning that it cannot be checked.
    """
    if "urls" in ledger.metadata:  # inputs moved to other paths: named as such, before their files
        _check_metadata(cache_dir, {"urls": ledger.metadata["urls"]}, {"urls": list(urls)})
    recorded = ledger.metadata.get("inputs")
    if recorded is None:
        # Once per cache and process: a run (or a benchmark) opens the same cache many times, and the
        # warning says nothing new after the first.
        key = fs.abspath(cache_dir)
        if key not in _warned_unchecked:
            _warned_unchecked.add(key)
            logger.warning(
                "the token cache at %s records no identities of its input files (an older cache): it cannot "
                "be checked against %s; delete it to rebuild if the files changed", cache_dir, what,
            )
        return
    current = _file_inputs(urls, what)
    if not current and recorded:
        logger.info("none of the input files of the token cache at %s exist here; serving it unchecked",
                    cache_dir)
        return
    changes = [f"new file {p}" for p in current if p not in recorded]
    changes += [f"{p} is gone" for p in recorded if p not in current]
    if not changes:
        _refuse_partial(cache_dir, recorded, current, what)
    changes += [c for p in current if p in recorded and not is_partial(recorded[p])
                and (c := identity_change(p, recorded[p], full=full))]
    if changes:
        raise CacheMismatchError(
            f"the input files of {what} changed since the token cache at {cache_dir!r} was built: "
            f"{_describe(changes)}. The cache holds the old data: delete {cache_dir} to rebuild it from the "
            "current files, or use another cache_dir."
        )


def check_writable(cache_dir: str, key: str = "cache_dir") -> None:
    """Fail before any tokenizing when ``cache_dir`` cannot be created or written; ``key`` names the config
    key in the message."""
    try:
        fs.probe_writable(cache_dir)
    except fs.StorageAccessError as e:
        raise fs.StorageAccessError(f"{key}: {e}; point {key} at a bucket and prefix this run can write") from None
    except OSError as e:
        if is_out_of_space(e):
            raise out_of_space_error("creating the token cache", cache_dir) from None
        raise ValueError(
            f"{key}: cannot write the token cache at {cache_dir} ({e.strerror or e}); point {key} at a "
            "writable directory"
        ) from None


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
        _check_metadata(cache_dir, ledger.metadata, wanted)
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
                _check_metadata(cache_dir, ledger.metadata, wanted)
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
    if ledger is not None:
        changed = _resume_mismatch(cache_dir, ledger, shards, what, full=options.verify_inputs == "full")
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
            metadata={**wanted, "shards": shards, "inputs": _input_identities(urls, shards, what)},
        )
        ledger.save(cache_dir)
    store = JaggedArrayStore.open(fs.join(cache_dir, "input_ids"), mode="a", num_rows=ledger.total_rows)
    # A chat cache's assistant mask: a second store aligned row for row with input_ids, appended in the same
    # commit (both before the ledger save), so the ledger's row count covers both.
    mask_store = None
    if chat is not None:
        mask_store = JaggedArrayStore.open(fs.join(cache_dir, LOSS_MASK_DIR), mode="a", dtype=np.uint8,
                                           num_rows=ledger.total_rows)
        tokenizer = ChatTokenizer(tokenizer, chat)
    eos = tokenizer.eos_token_id if enforce_eos else None
    todo = [sh for sh in shards if sh not in ledger.finished_shards]
    todo_bytes = {sh: int(fs.size(sh) or 0) for sh in todo}
    report: BuildProgress | None = None

    def commit(shard: str, flat: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        store.append_flat(flat, lengths)
        if mask_store is not None:
            mask_store.append_flat(mask, lengths)
        fault_point("cache_after_append")
        ledger.shard_docs[shard] = ledger.shard_docs.get(shard, 0) + len(lengths)
        ledger.shard_rows[shard] = ledger.shard_rows.get(shard, 0) + len(lengths)
        ledger.total_rows += len(lengths)
        ledger.total_tokens += int(lengths.sum())
        ledger.save(cache_dir)
        fault_point("cache_after_commit")
        if report is not None:
            report.committed(len(lengths), int(lengths.sum()))

    def finish_shard(shard: str) -> None:
        ledger.shard_docs.setdefault(shard, 0)
        ledger.shard_rows.setdefault(shard, 0)
        ledger.finished_shards.append(shard)
        ledger.save(cache_dir)
        if report is not None:
            report.shard_done(shard)

    def tasks():
        """``(shard, locations, docs)`` in commit order; ``docs`` None marks the end of a shard."""
        for shard in todo:
            skip = ledger.shard_docs.get(shard, 0)
            # A chat source's record field is its messages_field (so an SFT config and a chat format
            # section name it), a text source's its text_key.
            key_name = "messages_field" if chat is not None else "text_key"
            for where, docs in _doc_batches(shard, text_key, skip, options.batch_size, key_name):
                yield shard, where, docs
            yield shard, None, None

    finished = False
    encoder = None
    try:
        encoder = _encoder(options, tokenizer, eos, sum(todo_bytes.values()))
        # The clock starts once the workers exist: the throughput is the build's, not Ray's start-up.
        report = BuildProgress(
            cache_dir, shard_bytes=todo_bytes,  # the cache's path as given, where the user will look for it
            shards_total=len(shards), docs=ledger.total_rows, tokens=ledger.total_tokens,
            backend=options.backend, enabled=progress,
        )
        # Whoever tokenizes, results are committed here strictly in submission order, with at most
        # encoder.window batches in flight: the one place that decides what the cache holds.
        in_flight: deque = deque()
        pending = 0

        def drain_one():
            nonlocal pending
            shard, fut = in_flight.popleft()
            if fut is None:
                finish_shard(shard)
            else:
                pending -= 1
                commit(shard, *fut.result())

        for shard, where, docs in tasks():
            fut = None
            if docs is not None:
                fut = encoder.submit(docs, shard, where)
                pending += 1
            in_flight.append((shard, fut))
            while pending > encoder.window:
                drain_one()
        while in_flight:
            drain_one()
        if ledger.total_tokens == 0:
            # A finished empty cache would be reused as is after the files are fixed; left unfinished,
            # the next run restarts it from the current files.
            raise SourceError(
                f"{what}: no text in {_describe(list(shards))}: the cache build produced 0 tokens. Check "
                "the files (and text_key); the next run rebuilds the cache."
            )
        store.finalize()
        if mask_store is not None:
            mask_store.finalize()
        fault_point("cache_after_finalize")
        ledger.is_finished = True
        ledger.save(cache_dir)
        finished = True
    finally:
        if encoder is not None:
            encoder.close()
        if report is not None:
            report.close(finished=finished)
    return TokenCache.open(cache_dir)


# -- who tokenizes a batch ---------------------------------------------------------------------------------
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


def _encoder(options: CacheOptions, tokenizer, eos, todo_bytes: int):
    """The encoder ``options`` ask for: Ray tasks, a process pool, or (small inputs, one worker) this
    process. Every one gives the same bytes; they differ only in where tokenizing runs."""
    if options.backend == "ray":
        from .ray_backend import RayEncoder

        return RayEncoder(tokenizer, eos, address=options.ray_address, num_workers=options.num_workers)
    workers = options.resolved_workers()
    if workers > 1 and todo_bytes >= options.min_bytes_for_pool:
        return _PoolEncoder(tokenizer, eos, workers)
    return _InlineEncoder(tokenizer, eos)


def _resume_mismatch(cache_dir: str, ledger: CacheLedger, shards: list[str], what: str, *,
                     full: bool) -> str | None:
    """How the inputs of an interrupted build differ from ``shards`` (None: they match)."""
    before = ledger.metadata.get("shards") or []
    if before != shards:
        changes = [f"new file {p}" for p in shards if p not in before]
        changes += [f"{p} is gone" for p in before if p not in shards]
        return _describe(changes or [f"the shard order changed (was {before}, now {shards})"])
    recorded = ledger.metadata.get("inputs")
    if recorded is None:
        return None
    if ledger.total_tokens:
        _refuse_partial(cache_dir, recorded, shards, what)
    changes = [c for p, old in recorded.items() if p in shards and (c := identity_change(p, old, full=full))]
    return _describe(changes) if changes else None
