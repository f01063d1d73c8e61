"""Which run's checkpoints a log directory belongs to, so that another run never rewrites its metrics.

The JSON tracker drops the lines of ``metrics.jsonl`` at and after the step a run resumes from (or all of
them when a run finds no checkpoint of its own: an earlier attempt that saved none). That is right only when
the lines were written by the same lineage of checkpoints. A run that reuses a ``trainer.id`` with another
``trainer.checkpointer.base_path`` finds no checkpoint there and would throw away the whole history of the
earlier run that logged under that id.

So the log directory records the checkpoint directory of the run that writes it, in ``checkpoints.json``
beside ``metrics.jsonl``; a run whose checkpoint directory is another one, and finds metrics there, is
refused before any work with the run id, both checkpoint directories and the fix. A log directory written
before the record existed is recognised from the ``trainer.checkpointer`` the JSON tracker stored in its
``config.json``.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional

from levanter.utils import fs

__all__ = ["LINEAGE_FILE", "LineageError", "check_log_lineage", "record_log_lineage"]

LINEAGE_FILE = "checkpoints.json"
_METRICS = "metrics.jsonl"
_CONFIG = "config.json"


class LineageError(ValueError):
    """A log directory holds the metrics of a run whose checkpoints are elsewhere."""


def _norm(path: str) -> str:
    return fs.abspath(path).rstrip("/")


def _read_json(path: str) -> Optional[dict]:
    try:
        doc = json.loads(fs.read_bytes(path))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _recorded(log_run_dir: str, run_id: str) -> Optional[str]:
    """The checkpoint directory that wrote ``log_run_dir``: its record, else what the run's logged config says."""
    doc = _read_json(fs.join(log_run_dir, LINEAGE_FILE))
    if doc is not None and isinstance(doc.get("checkpoints"), str):
        return doc["checkpoints"]
    config = _read_json(fs.join(log_run_dir, _CONFIG))
    ckpt = ((config or {}).get("trainer") or {}).get("checkpointer") or {}
    base = ckpt.get("base_path") if isinstance(ckpt, dict) else None
    if not isinstance(base, str) or not base:
        return None
    return _norm(fs.join(base, run_id) if ckpt.get("append_run_id_to_base_path", True) else base)


def _has_metrics(log_run_dir: str) -> bool:
    try:
        return len(fs.read_bytes(fs.join(log_run_dir, _METRICS)).strip()) > 0
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False


def check_log_lineage(log_run_dirs: Iterable[tuple[str, str]], checkpoint_dir: str, run_id: str) -> None:
    """Refuse (:class:`LineageError`) a run whose checkpoint directory ``checkpoint_dir`` is not the one that
    wrote the metrics in one of ``log_run_dirs`` (``(config key, <log dir>/<run id>)``). Reads only."""
    mine = _norm(checkpoint_dir)
    for key, log_run_dir in log_run_dirs:
        theirs = _recorded(log_run_dir, run_id)
        if theirs is None or _norm(theirs) == mine or not _has_metrics(log_run_dir):
            continue
        raise LineageError(
            f"trainer.id={run_id}: {fs.join(log_run_dir, _METRICS)} ({key}) holds the metrics of the run whose "
            f"checkpoints are in {theirs}, but this run checkpoints to {mine}; reusing the id would rewrite that "
            "run's metrics. Give this run a new trainer.id (e.g. --trainer.id "
            f"{run_id}-2), or another {key}. If you moved that run's checkpoints to {mine}, delete "
            f"{fs.join(log_run_dir, LINEAGE_FILE)} to continue its log there."
        )


def record_log_lineage(log_run_dirs: Iterable[tuple[str, str]], checkpoint_dir: str) -> None:
    """Record in each of ``log_run_dirs`` that the run checkpointing to ``checkpoint_dir`` writes it."""
    doc = {"checkpoints": _norm(checkpoint_dir)}
    for _, log_run_dir in log_run_dirs:
        path = fs.join(log_run_dir, LINEAGE_FILE)
        if _read_json(path) == doc:
            continue
        if not fs.is_url(log_run_dir):
            fs.makedirs(log_run_dir)
        fs.atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
