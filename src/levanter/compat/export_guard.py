"""Where a Hugging Face export may go: never over a directory that holds anything but an earlier export.

An export replaces its output directory whole: locally the finished directory is renamed over it, on an
object store the old files are deleted. That is safe only for a directory that holds nothing the user
owns. So every export writes a marker, ``.levanter-export.json``, beside its files: which files it wrote
and what was exported. Before anything is loaded or computed, an output directory is accepted only if it

* does not exist, or is empty (an object-store prefix with no objects under it), or
* holds the marker and only the files the marker lists (exactly an earlier export),

and if it neither is nor contains a location the run uses: the working directory, a checkpoint
directory (not inside one either), the log directory, a cache directory. Anything else is refused with
one paragraph naming the directory, what it holds and the fix; nothing is touched. A directory exported
before exports carried the marker is refused too: only its owner can tell it holds nothing else.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Optional, Sequence

from levanter.utils import fs

__all__ = ["MARKER", "ExportTargetError", "check_export_dir", "check_export_steps", "marker_bytes"]

MARKER = ".levanter-export.json"
_FORMAT = "levanter-hf-export"


class ExportTargetError(ValueError):
    """An export's output directory would replace or overlap something that is not an earlier export."""


def marker_bytes(files: Iterable[str], source: Optional[dict] = None) -> bytes:
    """The marker's content: the files the export writes (the marker itself included) and what it exported."""
    names = sorted(set(files) | {MARKER})
    return json.dumps({"format": _FORMAT, "files": names, "source": source or {}}, indent=2, sort_keys=True).encode()


def _norm(path: str) -> str:
    """A comparable form: URLs normalised, local paths absolute with symbolic links resolved."""
    if fs.is_url(path):
        return fs.abspath(path)
    return os.path.realpath(fs.abspath(path))


def _within(inner: str, outer: str) -> bool:
    """Whether ``inner`` is ``outer`` or lies under it (both normalised)."""
    if fs.is_url(inner) != fs.is_url(outer):
        return False
    sep = "/" if fs.is_url(outer) else os.sep
    return inner == outer or inner.startswith(outer.rstrip(sep) + sep)


def _check_not_protected(output_dir: str, label: str, protected: Sequence[tuple[str, str, bool]]) -> None:
    out = _norm(output_dir)
    places = list(protected)
    if not fs.is_url(output_dir):
        places.insert(0, ("the working directory", os.getcwd(), False))
    for what, path, no_inside in places:
        if not path:
            continue
        p = _norm(path)
        if _within(p, out):
            relation = "is" if p == out else "contains"
            raise ExportTargetError(
                f"{label} {relation} {what} ({p}): an export replaces its directory whole, so it "
                f"would delete {'it' if p == out else 'everything there'}. Choose a new or empty directory of its "
                "own (e.g. hf/<run id>), outside the run's checkpoint, log and cache directories."
            )
        if no_inside and _within(out, p):
            raise ExportTargetError(
                f"{label} lies inside {what} ({p}): an export there would mix with the checkpoints. "
                "Choose a new or empty directory of its own (e.g. hf/<run id>), outside the run's checkpoint, log "
                "and cache directories."
            )


def _entries(path: str) -> Optional[list[str]]:
    """The names directly under ``path``; None when there is nothing there (absent, or an empty prefix)."""
    if not fs.is_url(path):
        local = fs.abspath(path)
        if not os.path.lexists(local):
            return None
        if not os.path.isdir(local):
            return [os.path.basename(local)]  # a file: never an export directory
        names = os.listdir(local)
        return names or None
    try:
        return fs.listdir(path)
    except FileNotFoundError:
        return None


def _listed_files(path: str) -> Optional[set[str]]:
    """The files an earlier export's marker in ``path`` lists, or None when there is no readable marker."""
    try:
        doc = json.loads(fs.read_bytes(fs.join(path, MARKER)))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("files"), list):
        return None
    return {str(n) for n in doc["files"]} | {MARKER}


def _sample(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_replaceable(path: str, label: Optional[str] = None) -> None:
    """Refuse ``path`` unless it is absent, empty, or exactly an earlier export (marker and its files only).
    ``label`` names it in the message (default: ``output_dir='<path>'``)."""
    label = label or f"output_dir={path!r}"
    names = _entries(path)
    if names is None:
        return
    if not fs.is_url(path) and not os.path.isdir(fs.abspath(path)):
        raise ExportTargetError(f"{label} is a file, not a directory: choose a new or empty directory")
    listed = _listed_files(path) if MARKER in names else None
    if listed is None:
        raise ExportTargetError(
            f"{label} is not empty and is not an earlier export (it holds {_sample(names)}, and no "
            f"{MARKER}, which every export writes beside its files): an export replaces its directory whole, "
            "so it would delete them. Choose a new or empty directory; if it is an export you no longer need "
            "(one written before exports carried the marker), delete it yourself first."
        )
    extra = set(names) - listed
    if not fs.is_url(path):  # an export writes files only: a subdirectory is the user's
        local = fs.abspath(path)
        extra |= {n for n in names if os.path.isdir(os.path.join(local, n))}
    if extra:
        raise ExportTargetError(
            f"{label} holds an earlier export and also {_sample(extra)}, which the export did not "
            f"write (its {MARKER} lists the files it wrote): replacing the export would delete them. Move them "
            "out, or choose a new or empty directory."
        )


def check_export_dir(output_dir: str, key: str, protected: Sequence[tuple[str, str, bool]] = ()) -> None:
    """Refuse (:class:`ExportTargetError`, one paragraph naming the config ``key``) an export to ``output_dir``
    that would replace anything but an earlier export. ``protected``: ``(what, path, no_inside)`` for the locations the
    output may neither be nor contain (and, with ``no_inside``, not lie inside); the working directory always
    is one for a local output."""
    label = f"{key}={output_dir!r}"
    _check_not_protected(output_dir, label, protected)
    check_replaceable(output_dir, label)


_STEP = re.compile(r"step-(\d+)")


def check_export_steps(base: str, key: str, will_export, protected: Sequence[tuple[str, str, bool]] = ()) -> None:
    """For exports to ``<base>/step-N`` during training (``key``: the config key and value ``base`` comes
    from): ``base`` may neither be nor contain a protected location, and every ``step-N`` already under it
    that ``will_export(N)`` would replace must be exactly an earlier export. Other entries of ``base`` are
    left alone, so they are not checked."""
    _check_not_protected(base, f"{key}: the export directory {base!r}", protected)
    names = _entries(base) or []
    for name in names:
        m = _STEP.fullmatch(name)
        if m and will_export(int(m.group(1))):
            path = fs.join(base, name)
            check_replaceable(path, f"{key}: the export directory {path!r}")
