"""The ``cache_options`` section of a data config: how token caches are built (workers, batch size, the
tokenizing backend, how input files are checked), and its checks.

None of these settings changes what a cache holds: every backend and worker count writes the same bytes.
Upstream's keys that only shaped upstream's Ray builder are accepted and ignored; the one that would
reorder the data is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Union

from ..refused_keys import check_refused, refused
from .identity import VERIFY_MODES

__all__ = ["BACKENDS", "CacheOptions"]

# Who may tokenize a cache's batches: a process pool on this machine, or Ray tasks.
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
