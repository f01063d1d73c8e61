"""Storage through one door: the names every other module calls as ``fs.<name>`` instead of branching on
``gs://`` / ``s3://`` / ``memory://`` itself.

The implementation is split by concept; this module only gathers their public names, so that callers keep
one short, stable namespace (``fs.join``, ``fs.atomic_write_bytes``, ``fs.kvstore_spec``, ...):

* :mod:`levanter.utils.paths`: paths and URLs as strings (scheme, join, parent, ``~``), no I/O;
* :mod:`levanter.utils.storage_errors`: transient vs. permanent errors, the retry loop, the access-error
  message (credentials redacted);
* :mod:`levanter.utils.ts_spec`: endpoints from the environment and tensorstore's kvstore and context specs;
* :mod:`levanter.utils.files`: files and small objects (read, list, atomic and create-if-absent writes,
  deletes) and the start-up access checks.

Trade-off: a facade costs one indirection when reading the code, and patching ``fs.<name>`` does not
reach the modules that use it internally; in exchange the many call sites never change when a concept
moves, and a module needing only paths can import :mod:`levanter.utils.paths` without fsspec's clients.
"""

from __future__ import annotations

from .files import (
    atomic_write_bytes,
    atomic_write_text,
    check_access,
    create_exclusive,
    exists,
    filesystem,
    fsync_dir,
    glob,
    glob_detail,
    info,
    isdir,
    isfile,
    listdir,
    makedirs,
    mtime,
    open_file,
    probe_writable,
    read_bytes,
    read_text,
    remove,
    remove_stale_temporaries,
    remove_tree,
    size,
)
from .paths import abspath, basename, expand_user, is_object_store, is_url, join, parent, supports_rename
from .storage_errors import (
    RETRY_ATTEMPTS,
    RETRY_INITIAL_DELAY_S,
    RETRY_MAX_DELAY_S,
    StorageAccessError,
    access_error,
    is_permanent,
    is_transient,
    redact,
    retry_transient,
)
from .ts_spec import kvstore_spec, tensorstore_context_spec

__all__ = [
    "RETRY_ATTEMPTS",
    "RETRY_INITIAL_DELAY_S",
    "RETRY_MAX_DELAY_S",
    "StorageAccessError",
    "abspath",
    "access_error",
    "atomic_write_bytes",
    "atomic_write_text",
    "basename",
    "check_access",
    "create_exclusive",
    "exists",
    "expand_user",
    "filesystem",
    "fsync_dir",
    "glob",
    "glob_detail",
    "info",
    "is_object_store",
    "is_permanent",
    "is_transient",
    "is_url",
    "isdir",
    "isfile",
    "join",
    "kvstore_spec",
    "listdir",
    "makedirs",
    "mtime",
    "open_file",
    "parent",
    "probe_writable",
    "read_bytes",
    "read_text",
    "redact",
    "remove",
    "remove_stale_temporaries",
    "remove_tree",
    "retry_transient",
    "size",
    "supports_rename",
    "tensorstore_context_spec",
]
