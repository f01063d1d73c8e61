"""Batch fingerprints: a short hex digest of exactly what a step trained on.

The digest covers the step's global indices and, for a mixture, each example's source and source
index (after the stop strategy's wrap); optionally the token content too. It is computed from the
*global* batch -- the schedule and the index maps, not the rows a process happens to hold -- so it is the
same whatever the number of hosts, devices, the prefetch depth or microbatching. Logged per step as
``data/fingerprint``, it makes cross-run, cross-topology and resume equivalence checkable from
``metrics.jsonl`` alone. The loader computes each step's provenance with its reads
(:attr:`~levanter.data.loader.Batch.provenance`).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["fingerprint_arrays", "batch_fingerprint"]


def fingerprint_arrays(*arrays: np.ndarray | None) -> str:
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        if a is None:
            h.update(b"\x00none")
            continue
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def batch_fingerprint(provenance: dict[str, np.ndarray], tokens: np.ndarray | None = None) -> str:
    return fingerprint_arrays(
        provenance["global_index"], provenance.get("source"), provenance.get("source_index"),
        None if tokens is None else np.asarray(tokens, dtype=np.int32),
    )
