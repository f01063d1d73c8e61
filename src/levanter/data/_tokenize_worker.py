"""The tokenizer side of a cache build, importable without tensorstore or JAX.

Pool workers are started with ``spawn`` (safe when the parent has started JAX or tensorstore threads),
so each one imports this module afresh: it must stay light -- numpy and the tokenizer only.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import SourceError

_TOKENIZER = None
_EOS: int | None = None


def init_worker(tokenizer, eos_to_append: int | None) -> None:
    global _TOKENIZER, _EOS
    # One single-threaded tokenizer per process: the pool provides the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER, _EOS = tokenizer, eos_to_append


def encode(tokenizer, eos: int | None, docs: list, shard: str, first_doc: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``docs`` as ``(flat int32 ids, int64 per-document lengths)``, with ``eos`` appended to
    every document when it is not None."""
    if getattr(tokenizer, "name", None) == "passthrough":
        rows = []
        for k, doc in enumerate(docs):
            if not isinstance(doc, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in doc):
                raise SourceError(
                    f"{shard}, document {first_doc + k}: the passthrough tokenizer expects a list of token ids"
                )
            arr = np.asarray(doc, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
                raise SourceError(
                    f"{shard}, document {first_doc + k}: token id out of range [0, {tokenizer.vocab_size}) (vocab_size)"
                )
            rows.append(arr)
        lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
        flat = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    else:
        for k, doc in enumerate(docs):
            if not isinstance(doc, str):
                raise SourceError(f"{shard}, document {first_doc + k}: expected text, got {type(doc).__name__}")
        flat, lengths = tokenizer.encode_batch_flat(docs)
    if eos is not None:
        flat = np.insert(flat, np.cumsum(lengths), np.int32(eos))
        lengths = lengths + 1
    return flat.astype(np.int32, copy=False), lengths


def encode_in_worker(docs: list, shard: str, first_doc: int):
    return encode(_TOKENIZER, _EOS, docs, shard, first_doc)
