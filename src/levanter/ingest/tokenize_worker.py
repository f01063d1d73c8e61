"""The tokenizer side of a cache build, importable without tensorstore or JAX.

Pool workers are started with ``spawn`` (safe when the parent has started JAX or tensorstore threads),
so each one imports this module afresh: it must stay light -- numpy and the tokenizer only.

Workers die with their parent: a build killed with SIGKILL runs no clean-up, and an orphaned worker
(hundreds of MB with a tokenizer loaded) would otherwise wait forever on a queue nobody writes to. On
Linux the kernel delivers SIGKILL to the worker when the parent goes (``PR_SET_PDEATHSIG``); everywhere, a
watchdog thread exits the worker once its parent process id changes (it has been re-parented).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

from .chat import ChatTokenizer
from .errors import SourceError

__all__ = ["die_with_parent", "init_worker", "encode", "encode_in_worker"]

_TOKENIZER = None
_EOS: int | None = None


_PR_SET_PDEATHSIG = 1
_WATCHDOG_INTERVAL_S = 0.5


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watchdog still covers it


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(_WATCHDOG_INTERVAL_S)


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when process ``parent_pid`` (its parent) does.

    The death signal is tied to the parent *thread* that started the worker: the cache builder's pool
    lives and dies within the one call that submits to it, so that thread outlives the workers.
    """
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def init_worker(tokenizer, eos_to_append: int | None, parent_pid: int | None = None) -> None:
    global _TOKENIZER, _EOS
    if parent_pid is not None:
        die_with_parent(parent_pid)
    # One single-threaded tokenizer per process: the pool provides the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER, _EOS = tokenizer, eos_to_append


def encode(tokenizer, eos: int | None, docs: list, shard: str, where: list[str]) -> tuple:
    """Token ids of ``docs`` as ``(flat int32 ids, int64 per-document lengths)``, with ``eos`` appended to
    every document when it is not None. ``where[k]`` locates ``docs[k]`` in ``shard`` (``"line 6"``) for
    error messages. A chat tokenizer (:class:`levanter.ingest.chat.ChatTokenizer`, which has
    ``encode_chats``) adds a third array, the flat ``uint8`` assistant mask (0 on the appended EOS)."""
    if isinstance(tokenizer, ChatTokenizer):
        flat, lengths, mask = tokenizer.encode_chats(docs, shard, where)
        if eos is not None:
            ends = np.cumsum(lengths)
            flat = np.insert(flat, ends, np.int32(eos))
            mask = np.insert(mask, ends, np.uint8(0))
            lengths = lengths + 1
        return flat.astype(np.int32, copy=False), lengths, mask
    if tokenizer.name == "passthrough":
        rows = []
        for k, doc in enumerate(docs):
            ids = isinstance(doc, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in doc)
            if not ids:
                raise SourceError(
                    f"{shard}, {where[k]}: the passthrough tokenizer expects a list of token ids"
                )
            arr = np.asarray(doc, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
                raise SourceError(
                    f"{shard}, {where[k]}: token id out of range [0, {tokenizer.vocab_size}) (vocab_size)"
                )
            rows.append(arr)
        lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
        flat = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    else:
        for k, doc in enumerate(docs):
            if not isinstance(doc, str):
                raise SourceError(f"{shard}, {where[k]}: expected text, got {type(doc).__name__}")
        flat, lengths = tokenizer.encode_batch_flat(docs)
    if eos is not None:
        flat = np.insert(flat, np.cumsum(lengths), np.int32(eos))
        lengths = lengths + 1
    return flat.astype(np.int32, copy=False), lengths


def encode_in_worker(docs: list, shard: str, where: list[str]):
    return encode(_TOKENIZER, _EOS, docs, shard, where)
