"""TensorBoard tracker: ``{type: tensorboard}`` writes event files to ``<trainer.log_dir>/<run_id>/tensorboard``
(next to the JSON tracker's ``metrics.jsonl``), or to ``<logdir>/<run_id>`` when ``logdir`` (or its
synonym ``log_dir``) is set.

Written with ``tensorboardX`` (small, pure Python, no TensorFlow or torch), imported inside ``init``.

How values map: numbers (and numpy/JAX scalars) become scalars, strings become text, numeric arrays
with more than one element become histograms; anything else (``None``, backend objects) is skipped
with one warning per metric name. Hyperparameters are written once as a JSON text block under
``hparams`` (TensorBoard's HParams plugin wants a fixed metric list up front, which a trainer does not
have); summary values become scalars under ``summary/`` at the last logged step.

A ``logdir`` that is set is taken as given, relative paths from the current directory as upstream
Levanter does. (Upstream's default is ``./tblogs``, outside the run's other logs; here the default keeps
every file of a run under ``trainer.log_dir``.) A ``gs://`` or ``s3://`` ``logdir`` (anything
:func:`levanter.utils.fs.is_url` accepts): event files are written to a local temporary directory and
uploaded whole (one atomic PUT per file, since object stores cannot append) at each ``flush`` -- before
each checkpoint save -- and at ``finish``; the temporary directory is removed at ``finish``.
On ``resume_step=k`` the writer is opened with ``purge_step=k``, which tells TensorBoard to discard the
earlier attempt's events at steps ``>= k`` when it reads the directory.

Fields other than ``logdir`` are ``tensorboardX.SummaryWriter`` arguments, kept for compatibility with
upstream configs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from levanter.refused_keys import refused
from levanter.tracker.tracker import Tracker, TrackerConfig, to_python
from levanter.utils import fs

__all__ = ["TensorboardTracker", "TensorboardConfig"]

logger = logging.getLogger(__name__)


class TensorboardTracker(Tracker):
    """Forwards to a ``tensorboardX.SummaryWriter``."""

    name = "tensorboard"

    def __init__(
        self, writer: Any, *, staging: Optional[str] = None, upload_to: Optional[str] = None
    ) -> None:
        """``staging``, ``upload_to``: the writer's local temporary directory and the object-store prefix
        its files are uploaded to; None when the writer writes where the files belong."""
        self.writer = writer
        self._staging = staging
        self._upload_to = upload_to
        self._last_step = 0
        self._warned: set[str] = set()
        self._closed = False

    def _skip(self, key: str, value: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("tensorboard: not logging %r of type %s", key, type(value).__name__)

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        step = int(step)
        self._last_step = step
        for key, raw in metrics.items():
            value = to_python(raw)
            if isinstance(value, bool):
                self.writer.add_scalar(key, int(value), step)
            elif isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
            elif isinstance(value, str):
                self.writer.add_text(key, value, step)
            elif hasattr(value, "__array__") and np.asarray(value).dtype.kind in "biuf":
                arr = np.asarray(value)
                if arr.size:
                    self.writer.add_histogram(key, arr.astype(np.float64), step)
            else:
                self._skip(key, value)

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        text = json.dumps(dict(params), indent=2, default=str)
        # Indented by four spaces so TensorBoard's markdown renders it as a code block.
        self.writer.add_text("hparams", "\n".join("    " + line for line in text.splitlines()), 0)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        self.log({f"summary/{k}": v for k, v in metrics.items()}, step=self._last_step)

    def _upload(self) -> None:
        staging = self._staging
        for root, _, files in os.walk(staging):
            for name in sorted(files):
                local = os.path.join(root, name)
                rel = os.path.relpath(local, staging).split(os.sep)
                with open(local, "rb") as f:
                    fs.atomic_write_bytes(fs.join(self._upload_to, *rel), f.read())

    def flush(self) -> None:
        if self._closed:
            return
        self.writer.flush()
        if self._staging is not None:
            self._upload()

    def finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.writer.close()
        if self._staging is not None:
            try:
                self._upload()
            finally:
                shutil.rmtree(self._staging, ignore_errors=True)


@TrackerConfig.register_subclass("tensorboard")
@dataclasses.dataclass(frozen=True)
class TensorboardConfig(TrackerConfig):
    """Event files in ``<logdir>/<run_id>``, by default ``<trainer.log_dir>/<run_id>/tensorboard``."""

    # Directory holding <run id>/ with the event files; null: <trainer.log_dir>/<run id>/tensorboard.
    logdir: Optional[str] = None
    # The same as logdir (the name every tracker accepts); give one of the two.
    log_dir: Optional[str] = None
    # SummaryWriter's suffix of a default directory name; refused if set (the directory is always given).
    comment: str = refused("the event files' directory is logdir/<run id>, which comment does not change; "
                           "remove the key", default="")
    purge_step: Optional[int] = None
    """Drop earlier events at steps >= this; None: the resume step, if any."""
    # Events held in memory before they are written.
    max_queue: int = 10
    # Seconds between writes of the held events to disk.
    flush_secs: int = 120
    # Suffix of the event files' names.
    filename_suffix: str = ""
    # Write the event files (false: log nothing to disk).
    write_to_disk: bool = True

    def _target(self, run_id: str, log_dir: str) -> tuple[str, str]:
        """``(config key, directory)`` of the event files."""
        if self.logdir is not None and self.log_dir is not None and self.logdir != self.log_dir:
            raise ValueError(
                f"trainer.tracker: logdir={self.logdir!r} and log_dir={self.log_dir!r} name the same setting; "
                "give one"
            )
        if self.logdir is not None:
            return "trainer.tracker.logdir", fs.join(self.logdir, run_id)
        if self.log_dir is not None:
            return "trainer.tracker.log_dir", fs.join(self.log_dir, run_id)
        return "trainer.log_dir", fs.join(log_dir, run_id, "tensorboard")

    def local_dirs(self, run_id: str, log_dir: str) -> list[tuple[str, str]]:
        return [self._target(run_id, log_dir)] if self.write_to_disk else []

    def init(self, run_id: str, log_dir: str, *, resume_step: Optional[int] = None) -> TensorboardTracker:
        from tensorboardX import SummaryWriter

        purge_step = self.purge_step if self.purge_step is not None else resume_step
        _, target = self._target(run_id, log_dir)
        upload_to = target if fs.is_url(target) and self.write_to_disk else None
        staging = tempfile.mkdtemp(prefix="levanter-tensorboard-") if upload_to is not None else None
        writer = SummaryWriter(
            logdir=staging if staging is not None else target,
            comment=self.comment,
            purge_step=purge_step,
            max_queue=self.max_queue,
            flush_secs=self.flush_secs,
            filename_suffix=self.filename_suffix,
            write_to_disk=self.write_to_disk,
        )
        return TensorboardTracker(writer, staging=staging, upload_to=upload_to)
