"""The layout of checkpoints in a run directory: step directories, ``metadata.json``, the commit and
discovery.

A run's checkpoints live under one base path -- a local directory, ``gs://bucket/...``,
``s3://bucket/...`` or ``memory://...`` (all paths go through :mod:`levanter.utils.fs`) -- as
``step-<N>/`` directories (prefixes on an object store). A checkpoint is complete iff it holds
``metadata.json`` (step, timestamp, is_temporary, user metadata, format version and every leaf's path,
shape and dtype), which is written last.

How a save commits depends on what the storage offers (:func:`levanter.utils.fs.supports_rename`):

* **Rename commit** (POSIX filesystems: local disk, NFS, a FUSE mount). Everything is written into
  ``<base>/.tmp-<name>-<random>/`` and then renamed to its final name. ``.tmp-*`` directories are
  leftovers of interrupted saves (or deletions): ignored by :func:`discover_latest_checkpoint` and
  removed by :func:`delete_stale_temporaries`. Deleting a checkpoint (:func:`remove_dir`) renames it to a
  ``.tmp-`` name first. A ``step-N`` directory that holds files but no ``metadata.json`` cannot come from
  a save or a deletion: it is a checkpoint damaged after it was committed, listed by
  :func:`unreadable_checkpoints` so that a run does not resume past it and overwrite its arrays.
* **Commit record** (object stores, which have no rename). The arrays are written under the final prefix
  ``step-N/`` and ``metadata.json`` -- one PUT, atomic on the store -- is written last: it is the commit
  record. A ``step-N/`` prefix without it is an uncommitted save (killed, or failed): discovery and
  :func:`step_dirs` ignore it, the next save of that step removes it before writing, and
  :func:`delete_stale_temporaries` removes it at start-up. Deleting a checkpoint removes ``metadata.json``
  first and the arrays after, so a deletion cut short leaves an uncommitted prefix, never something that
  looks complete. The trade-off: damage after the commit that takes ``metadata.json`` away cannot be
  told from an interrupted save, so :func:`unreadable_checkpoints` reports nothing on object stores.

Discovery on an object store costs one listing of the base path and a metadata lookup per step prefix;
temporary checkpoints are deleted as they are superseded, so a run directory holds few of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from typing import Any

from levanter.checkpoint.errors import CorruptCheckpointError
from levanter.utils import fs

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "METADATA_FILENAME",
    "TMP_PREFIX",
    "atomic_write_json",
    "commits_by_rename",
    "delete_stale_temporaries",
    "discover_latest_checkpoint",
    "is_complete",
    "read_checkpoint_metadata",
    "remove_dir",
    "resolve_path",
    "step_dirs",
    "unreadable_checkpoints",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 1
METADATA_FILENAME = "metadata.json"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------------
# Paths and small storage helpers
# ---------------------------------------------------------------------------------------------------


def resolve_path(path: str | os.PathLike) -> str:
    """``path`` in canonical form: an absolute local path (``file://`` stripped), or the URL itself."""
    return fs.abspath(os.fspath(path))


def commits_by_rename(path: str) -> bool:
    """Whether saves under ``path`` commit by renaming a temporary directory (POSIX storage) rather than
    by writing ``metadata.json`` last under the final prefix (object stores)."""
    return fs.supports_rename(path)


def atomic_write_json(path: str, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON, all or nothing (NaN and infinity refused); transient
    storage errors are retried."""
    text = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    fs.retry_transient(fs.atomic_write_bytes, path, text.encode(), what=f"writing {path}")


def is_complete(path: str) -> bool:
    """Whether ``path`` is a committed checkpoint (it holds ``metadata.json``)."""
    return fs.retry_transient(fs.isfile, fs.join(path, METADATA_FILENAME), what=f"looking for {path}")


def remove_dir(path: str) -> None:
    """Delete a checkpoint so that a crash part-way never leaves something that looks complete.

    Rename commit: renamed to a ``.tmp-`` name, then removed. Commit record: ``metadata.json`` first,
    then the rest of the prefix.
    """
    if commits_by_rename(path):
        parent, name = os.path.split(path)
        doomed = os.path.join(parent, f"{TMP_PREFIX}delete-{name}-{secrets.token_hex(4)}")
        os.rename(path, doomed)
        fs.fsync_dir(parent)
        shutil.rmtree(doomed)
        return
    fs.retry_transient(fs.remove, fs.join(path, METADATA_FILENAME), what=f"deleting {path}")
    fs.retry_transient(fs.remove_tree, path, what=f"deleting {path}")


# ---------------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------------


def read_checkpoint_metadata(checkpoint_path: str) -> dict:
    """The parsed ``metadata.json`` of a checkpoint (validated). Raises if absent or malformed."""
    path = resolve_path(checkpoint_path)
    meta_path = fs.join(path, METADATA_FILENAME)

    def fail(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {path} is corrupt or incomplete: {why}")

    try:
        raw = fs.retry_transient(fs.read_bytes, meta_path, what=f"reading {meta_path}")
    except (FileNotFoundError, NotADirectoryError):
        if not fs.isdir(path):
            raise FileNotFoundError(f"no checkpoint at {path}") from None
        raise fail(f"no {METADATA_FILENAME} (the save was interrupted before it committed)") from None
    except IsADirectoryError:
        raise fail(f"{METADATA_FILENAME} is a directory") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"{METADATA_FILENAME} is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise fail(f"{METADATA_FILENAME} is not a JSON object")
    version = doc.get("format_version")
    if version != CHECKPOINT_FORMAT_VERSION:
        raise fail(f"format_version {version!r} is not the supported version {CHECKPOINT_FORMAT_VERSION}")
    for key, typ in (("step", int), ("is_temporary", bool), ("leaves", list), ("metadata", dict)):
        if not isinstance(doc.get(key), typ):
            raise fail(f"{METADATA_FILENAME} field {key!r} is missing or not a {typ.__name__}")
    for rec in doc["leaves"]:
        if not (
            isinstance(rec, dict)
            and isinstance(rec.get("name"), str)
            and all(isinstance(rec.get(k), list) for k in ("shape", "stored_shape"))
            and all(isinstance(rec.get(k), str) for k in ("dtype", "stored_dtype"))
        ):
            raise fail(f"malformed leaf entry {rec!r} in {METADATA_FILENAME}")
    return doc


# ---------------------------------------------------------------------------------------------------
# Discovery and cleanup
# ---------------------------------------------------------------------------------------------------


def _list(base: str) -> list[str]:
    try:
        return fs.retry_transient(fs.listdir, base, what=f"listing {base}")
    except (FileNotFoundError, NotADirectoryError):
        return []


def _all_step_dirs(base: str) -> list[tuple[int, str]]:
    """``(N, path)`` of every ``step-N`` directory (or prefix) under ``base``, committed or not."""
    out = []
    for entry in _list(base):
        m = _STEP_DIR.match(entry)
        if m:
            path = fs.join(base, entry)
            if fs.isdir(path):
                out.append((int(m.group(1)), path))
    return sorted(out)


def step_dirs(base: str) -> list[tuple[int, str]]:
    """``(N, path)`` of the ``step-N`` checkpoints under ``base`` by ascending N.

    Rename commit: every ``step-N`` directory, complete or not (an incomplete one is damage, see
    :func:`unreadable_checkpoints`). Commit record: only those holding ``metadata.json`` (a prefix
    without it is an uncommitted save, not a checkpoint).
    """
    base = resolve_path(base)
    found = _all_step_dirs(base)
    if commits_by_rename(base):
        return found
    return [(step, path) for step, path in found if is_complete(path)]


def discover_latest_checkpoint(base_path: str) -> str | None:
    """The complete ``step-N`` checkpoint with the highest N under ``base_path``, or None.

    ``.tmp-*`` directories and uncommitted ``step-N/`` prefixes of object stores are skipped silently;
    ``step-N`` directories without ``metadata.json`` on POSIX storage are skipped with a warning. If
    ``base_path`` is itself a complete checkpoint it is returned.
    """
    base = resolve_path(base_path)
    if is_complete(base):
        return base
    best = None
    for _, path in step_dirs(base):
        if is_complete(path):
            best = path
        else:
            logger.warning("ignoring incomplete checkpoint %s (no %s)", path, METADATA_FILENAME)
    return best


def unreadable_checkpoints(base_path: str) -> list[str]:
    """The ``step-N`` directories under ``base_path`` that hold files but no ``metadata.json``.

    With the rename commit a save never leaves one (it writes into a ``.tmp-`` directory and renames it
    when complete, and a deletion renames it to a ``.tmp-`` name first), so such a directory is a
    checkpoint damaged after it was committed: its arrays may be intact, and a run that ignored it would
    overwrite them. On object stores such a prefix is an uncommitted save, so the list is empty there.
    """
    base = resolve_path(base_path)
    if not commits_by_rename(base):
        return []
    out = []
    for _, path in _all_step_dirs(base):
        if not is_complete(path):
            try:
                if os.listdir(path):
                    out.append(path)
            except OSError:
                out.append(path)
    return out


def delete_stale_temporaries(base_path: str) -> list[str]:
    """Remove what interrupted saves and deletions left under ``base_path``: ``.tmp-*`` directories,
    and on object stores ``step-N/`` prefixes without ``metadata.json``. Returns the removed paths.

    Only safe while nothing is saving into ``base_path``: call it at startup, from one process.
    """
    base = resolve_path(base_path)
    removed = []
    if commits_by_rename(base):
        for entry in sorted(_list(base)):
            path = os.path.join(base, entry)
            if entry.startswith(TMP_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
                logger.info("removing leftover temporary checkpoint directory %s", path)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed
    for _, path in _all_step_dirs(base):
        if not is_complete(path):
            logger.info("removing the uncommitted checkpoint save %s (no %s)", path, METADATA_FILENAME)
            fs.retry_transient(fs.remove_tree, path, what=f"deleting {path}")
            removed.append(path)
    return removed
