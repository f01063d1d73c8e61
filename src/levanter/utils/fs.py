"""Storage through one door: the names every other module calls as ``fs.<name>`` instead of branching on
``gs://`` / ``s3://`` / ``memory://`` itself.

The implementation is split by concept; this module only gathers their public names, so that callers keep
one short, stable namespace (``fs.join``, ``fs.atomic_write_bytes``, ``fs.kvstore_spec``, ...):

* :mod:`levanter.utils.paths`: paths and URLs as strings (scheme, join, parent, ``~``), no I/O;
* :mod:`levanter.utils.storage_errors`: transient vs. permanent errors, the retry loop, the access-error
  message (credentials redacted);
* :mod:`levanter.utils.ts_spec`: endpoints from the environment and tensorstore's kvstore and context specs;
* :mod:`levanter.utils.fs_clients`: the fsspec client of an object-store path, and streaming opens;
* :mod:`levanter.utils.files`: files and small objects (read, list, stat, delete);
* :mod:`levanter.utils.atomic_writes`: atomic replacement, create-if-absent, leftovers of interrupted writes;
* :mod:`levanter.utils.access_checks`: the start-up access checks.

Trade-off: a facade costs one indirection when reading the code, and patching ``fs.<name>`` does not
reach the modules that use it internally; in exchange the many call sites never change when a concept
moves, and a module needing only paths can import :mod:`levanter.utils.paths` without fsspec's clients.
"""

from __future__ import annotations

from .facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    ("paths", "storage_errors", "ts_spec", "fs_clients", "files", "atomic_writes", "access_checks"),
)
