"""The on-disk layout of checkpoints: step directories, temporaries, ``metadata.json`` and discovery.

A run's checkpoints live in one base directory as ``step-<N>/`` directories. A checkpoint directory is
complete iff it contains ``metadata.json`` (step, timestamp, is_temporary, user metadata, format version
and every leaf's path, shape and dtype), which is written last.

Atomicity. Everything is written into ``<parent>/.tmp-<name>-<random>/`` and only then renamed to its
final name. ``.tmp-*`` directories are leftovers of interrupted saves (or deletions) and are ignored by
:func:`discover_latest_checkpoint` and removed by :func:`delete_stale_temporaries`. Deleting a checkpoint
(:func:`remove_dir`) renames it to a ``.tmp-`` name first, so a crash mid-delete never leaves a
half-deleted directory that still looks complete. The rename needs a POSIX filesystem (local disk, NFS,
a FUSE mount); object stores (``gs://``, ``s3://``) have no atomic rename and are refused with a clear
error (:func:`local_path`).

A ``step-N`` directory that holds files but no ``metadata.json`` cannot come from a save; it is a
checkpoint damaged after it was committed, listed by :func:`unreadable_checkpoints` so that a run does
not resume past it and overwrite its arrays.
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
from levanter.utils.fs import atomic_write_bytes, fsync_dir

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "METADATA_FILENAME",
    "TMP_PREFIX",
    "atomic_write_json",
    "delete_stale_temporaries",
    "discover_latest_checkpoint",
    "is_complete",
    "local_path",
    "read_checkpoint_metadata",
    "remove_dir",
    "step_dirs",
    "unreadable_checkpoints",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 1
METADATA_FILENAME = "metadata.json"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------------
# Paths and small filesystem helpers
# ---------------------------------------------------------------------------------------------------


def local_path(path: str | os.PathLike, what: str = "checkpoint path") -> str:
    """``path`` as an absolute local path (``file://`` accepted); ``what`` names it in the error for a URL."""
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path:
        raise ValueError(
            f"{what} {path!r}: only POSIX filesystem paths are supported (checkpoints are committed by an "
            "atomic directory rename, which object stores such as gs:// and s3:// do not have). Use a local "
            "or mounted path."
        )
    return os.path.abspath(path)


def atomic_write_json(path: str, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON, all or nothing (NaN and infinity refused)."""
    text = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    atomic_write_bytes(path, text.encode())


def is_complete(path: str) -> bool:
    """Whether ``path`` is a committed checkpoint (it holds ``metadata.json``)."""
    return os.path.isfile(os.path.join(path, METADATA_FILENAME))


def remove_dir(path: str) -> None:
    """Delete a directory so that a crash part-way never leaves something that looks complete."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f"{TMP_PREFIX}delete-{name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    fsync_dir(parent)
    shutil.rmtree(doomed)


# ---------------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------------


def read_checkpoint_metadata(checkpoint_path: str) -> dict:
    """The parsed ``metadata.json`` of a checkpoint (validated). Raises if absent or malformed."""
    path = local_path(checkpoint_path)
    meta_path = os.path.join(path, METADATA_FILENAME)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}")

    def fail(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {path} is corrupt or incomplete: {why}")

    try:
        with open(meta_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise fail(f"no {METADATA_FILENAME} (the save was interrupted before it committed)") from None
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


def step_dirs(base: str) -> list[tuple[int, str]]:
    """``(N, path)`` of every ``step-N`` directory under ``base``, complete or not, by ascending N."""
    try:
        entries = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in entries:
        m = _STEP_DIR.match(entry)
        path = os.path.join(base, entry)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def discover_latest_checkpoint(base_path: str) -> str | None:
    """The complete ``step-N`` checkpoint with the highest N under ``base_path``, or None.

    ``.tmp-*`` directories are skipped silently; ``step-N`` directories without ``metadata.json`` are
    skipped with a warning. If ``base_path`` is itself a complete checkpoint it is returned.
    """
    base = local_path(base_path, "checkpoint base path")
    if is_complete(base):
        return base
    best = None
    for step, path in step_dirs(base):
        if is_complete(path):
            best = path
        else:
            logger.warning("ignoring incomplete checkpoint %s (no %s)", path, METADATA_FILENAME)
    return best


def unreadable_checkpoints(base_path: str) -> list[str]:
    """The ``step-N`` directories under ``base_path`` that hold files but no ``metadata.json``.

    A save never leaves one (it writes into a ``.tmp-`` directory and renames it when complete, and a
    deletion renames it to a ``.tmp-`` name first), so such a directory is a checkpoint damaged after
    it was committed: its arrays may be intact, and a run that ignored it would overwrite them.
    """
    base = local_path(base_path, "checkpoint base path")
    out = []
    for _, path in step_dirs(base):
        if not is_complete(path):
            try:
                if os.listdir(path):
                    out.append(path)
            except OSError:
                out.append(path)
    return out


def delete_stale_temporaries(base_path: str) -> list[str]:
    """Remove ``.tmp-*`` directories (interrupted saves or deletions) under ``base_path``.

    Only safe while nothing is saving into ``base_path``: call it at startup, from one process.
    """
    base = local_path(base_path, "checkpoint base path")
    try:
        entries = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry in sorted(entries):
        path = os.path.join(base, entry)
        if entry.startswith(TMP_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
            logger.info("removing leftover temporary checkpoint directory %s", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed

