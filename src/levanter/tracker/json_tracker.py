"""A tracker that appends one JSON object per ``log`` call to ``<log_dir>/<run_id>/metrics.jsonl``.

Each line is ``{"step": s, "<metric>": value, ...}``: the step first, then the metrics in the order
given. It needs no service, no login and no extra dependency, and any tool reads it
(``pandas.read_json(path, lines=True)``, ``jq``), which makes it the tracker for tests and offline runs.

Format and guarantees:

* Floats are written by ``json.dumps``, i.e. with ``repr``, the shortest string that reads back as the
  same double; numpy/JAX scalars are converted with ``float()`` first, which is exact for float32 and
  bfloat16. So ``json.loads`` gives back bit-identical values. NaN and infinities are written as
  ``NaN``/``Infinity`` (Python's JSON extension, read back by ``json.loads`` and pandas) rather than
  being dropped: a NaN loss is exactly what one wants to see in the log.
* Several ``log`` calls for the same step (training metrics, then evaluation metrics) give several
  lines with the same ``"step"``. Readers that want one record per step merge lines by step.
* Each line is flushed as soon as it is written, so a crashed process loses at most the line it was
  writing. There is no per-line fsync (that would cost a disk round trip per step); an OS crash may
  lose the last few seconds.
* ``resume_step=k`` (restart at step ``k`` from a checkpoint): lines with ``step >= k`` were written by
  the failed attempt and will be logged again, so they are removed, together with any trailing partial
  line, by rewriting the file atomically (temporary file, fsync, ``os.replace``). Without
  ``resume_step`` the file is appended to; only a trailing partial line is removed, since otherwise the
  next line would be glued onto it. ``train_lm`` first makes sure the file was written by the same run
  (:mod:`levanter.tracker.lineage`): another run that reuses the id is refused rather than truncating it.
* ``log_hyperparameters`` writes ``config.json`` and ``log_summary`` writes ``summary.json`` next to the
  metrics, each atomically and each merging with what earlier calls wrote.

Object stores (``gs://``, ``s3://``, ``memory://`` log directories, through :mod:`levanter.utils.fs`) cannot
append to an object. There the tracker keeps the whole file in memory and uploads it whole, as one PUT
(atomic: readers see the previous upload or this one, never a part): at most every ``flush_secs``
seconds while logging, at every :meth:`JsonTracker.flush` (``train_lm`` flushes before each checkpoint
save, so the metrics of every step a checkpoint covers are stored before the checkpoint commits) and at
``finish``. A crashed process loses the lines since the last upload, which a run resuming from its
latest checkpoint logs again. The trade-off: each upload costs one request and sends the whole file,
so uploads are spaced in time rather than made per line. Resume truncation is the same as on a local
disk: the stored file is read, lines with ``step >= resume_step`` are dropped, and the result uploaded.

Registered as ``json`` and, for upstream configs, ``json_logger``. Upstream's ``json_logger`` wrote the
records through Python logging instead; its ``logger_name`` and ``level`` fields are accepted, and when
``logger_name`` is set each line is also sent to that logger.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import numpy as np

from levanter.errors import is_out_of_space, out_of_space_error
from levanter.tracker.tracker import Tracker, TrackerConfig, normalize_metrics, to_python
from levanter.utils import fs

__all__ = ["trim_metrics", "prepare_metrics_file", "JsonTracker", "JsonConfig", "JsonLoggerConfig"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"


def _json_default(obj: Any) -> Any:
    """Fallback for values json cannot encode: arrays become (nested) lists, anything else its str."""
    value = to_python(obj)
    if value is not obj:
        return value
    if hasattr(obj, "__array__"):
        return np.asarray(obj).tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    return str(obj)


def _dumps(obj: Any, **kwargs) -> str:
    return json.dumps(obj, default=_json_default, **kwargs)


def _line_step(line: bytes) -> Optional[int]:
    """The ``step`` of a complete metrics line, or None if the line is not one of ours."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record["step"]


def trim_metrics(data: bytes, resume_step: Optional[int], where: str) -> bytes:
    """``data`` (a metrics file) without a trailing partial line and, when ``resume_step`` is given,
    without the lines with ``step >= resume_step``; ``where`` names the file in log messages."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else a line cut off by a crash
    kept = []
    for line in lines:
        if not line.strip():
            continue
        step = _line_step(line)
        if step is None:
            # A complete but unparseable line is not something this tracker writes; keep it rather than
            # destroy data we do not understand, but say so.
            logger.warning("%s: keeping a line that is not a metrics record: %r", where, line[:200])
            kept.append(line)
        elif resume_step is None or step < resume_step:
            kept.append(line)
    new = b"".join(line + b"\n" for line in kept)
    if new != data:
        dropped = len([x for x in lines if x.strip()]) - len(kept)
        partial = " and a trailing partial line" if tail else ""
        if resume_step:
            logger.info("%s: removing %d line(s) with step >= %s%s before resuming", where, dropped, resume_step,
                        partial)
        else:  # a fresh start over the file of an attempt that left no checkpoint: nothing is resumed
            logger.info("%s: starting at step 0: removing %d line(s)%s logged by an earlier attempt that saved "
                        "no checkpoint", where, dropped, partial)
    return new


def prepare_metrics_file(path: str, resume_step: Optional[int]) -> None:
    """Make ``path`` ready for appending: drop a trailing partial line and, when ``resume_step`` is given,
    every line with ``step >= resume_step``. The file is rewritten atomically, and only if it changes."""
    try:
        data = fs.read_bytes(path)
    except FileNotFoundError:
        return
    new = trim_metrics(data, resume_step, path)
    if new != data:
        fs.atomic_write_bytes(path, new)


class JsonTracker(Tracker):
    """Writes ``metrics.jsonl`` (a line per ``log``), ``config.json`` and ``summary.json`` in ``run_dir``
    (a local directory or an object-store URL; see the module docstring for the difference)."""

    name = "json"

    def __init__(
        self,
        run_dir: str,
        *,
        resume_step: Optional[int] = None,
        mirror_logger: Optional[logging.Logger] = None,
        mirror_level: int = logging.INFO,
        flush_secs: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_dir = run_dir
        self.metrics_path = fs.join(run_dir, METRICS_FILE)
        self.config_path = fs.join(run_dir, CONFIG_FILE)
        self.summary_path = fs.join(run_dir, SUMMARY_FILE)
        self._mirror_logger = mirror_logger
        self._mirror_level = mirror_level
        self._remote = fs.is_url(run_dir)
        self._flush_secs = flush_secs
        self._clock = clock
        self._file = None
        # On an object store: the whole metrics file, and whether it holds lines not yet uploaded.
        self._buffer: Optional[bytearray] = None
        self._dirty = False
        self._closed = False
        if self._remote:
            try:
                stored = fs.read_bytes(self.metrics_path)
            except FileNotFoundError:
                stored = b""
            self._buffer = bytearray(trim_metrics(stored, resume_step, self.metrics_path))
            if bytes(self._buffer) != stored:
                self._upload()  # the earlier attempt's lines past the resume step are gone from the store
            self._last_upload = self._clock()
        else:
            os.makedirs(run_dir, exist_ok=True)
            for name in (METRICS_FILE, CONFIG_FILE, SUMMARY_FILE):
                fs.remove_stale_temporaries(run_dir, name)  # left by a run killed inside an atomic rewrite
            prepare_metrics_file(self.metrics_path, resume_step)
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        self._hparams = self._read_json(self.config_path)
        self._summary = self._read_json(self.summary_path)

    @staticmethod
    def _read_json(path: str) -> dict:
        # A resumed run merges into what the earlier attempt recorded.
        try:
            value = json.loads(fs.read_text(path))
            return value if isinstance(value, dict) else {}
        except (FileNotFoundError, ValueError):
            return {}

    def _upload(self) -> None:
        """Store the whole metrics file (one atomic PUT) on the object store."""
        assert self._buffer is not None
        try:
            fs.atomic_write_bytes(self.metrics_path, bytes(self._buffer))
        except OSError as e:
            raise self._write_failed(e, "logging metrics", self.metrics_path) from None
        self._dirty = False
        self._last_upload = self._clock()

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        if self._closed:
            raise RuntimeError("JsonTracker.log called after finish()")
        values = normalize_metrics(metrics)
        if "step" in values:
            raise ValueError("a metric may not be named 'step': the key holds the training step")
        line = _dumps({"step": int(step), **values})
        if self._buffer is not None:
            self._buffer += (line + "\n").encode("utf-8")
            self._dirty = True
            if self._clock() - self._last_upload >= self._flush_secs:
                self._upload()
        else:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except OSError as e:
                raise self._write_failed(e, "logging metrics", self.metrics_path) from None
        if self._mirror_logger is not None:
            self._mirror_logger.log(self._mirror_level, line)

    def flush(self) -> None:
        """Make every line logged so far durable where it is kept: uploaded (object store) or flushed to
        the operating system (local file; see the module docstring for fsync)."""
        if self._closed:
            return
        if self._buffer is not None:
            if self._dirty:
                self._upload()
            return
        try:
            self._file.flush()
        except OSError as e:
            raise self._write_failed(e, "logging metrics", self.metrics_path) from None

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        self._hparams.update(params)
        try:
            fs.atomic_write_text(self.config_path, _dumps(self._hparams, indent=2) + "\n")
        except OSError as e:
            raise self._write_failed(e, "writing the run's config", self.config_path) from None

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        self._summary.update(normalize_metrics(metrics))
        try:
            fs.atomic_write_text(self.summary_path, _dumps(self._summary, indent=2) + "\n")
        except OSError as e:
            raise self._write_failed(e, "writing the run's summary", self.summary_path) from None

    def _write_failed(self, err: OSError, what: str, path: str) -> OSError:
        """The error to raise for a failed write: a full disk becomes :class:`OutOfSpaceError` naming the
        file (its own exit status). The metrics file is closed without retrying the write, so that the
        caller's clean-up (``finish``) does not fail a second time over the same lost bytes; a partial last
        line is dropped when the run resumes."""
        self._closed = True
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        if is_out_of_space(err):
            return out_of_space_error(what, path)
        return err

    def finish(self) -> None:
        if self._closed:
            return
        if self._buffer is not None:
            if self._dirty:
                self._upload()
            self._closed = True
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise self._write_failed(e, "logging metrics", self.metrics_path) from None
        self._file.close()
        self._file = None
        self._closed = True


@TrackerConfig.register_subclass("json")
@dataclasses.dataclass(frozen=True)
class JsonConfig(TrackerConfig):
    """``{type: json}`` (alias ``json_logger``): metrics to ``<log_dir>/<run_id>/metrics.jsonl``."""

    log_dir: Optional[str] = None
    """Directory to use instead of the ``log_dir`` the trainer passes."""
    logger_name: Optional[str] = None
    """Also send each line to this Python logger (upstream ``json_logger`` behaviour); None: don't."""
    level: int = logging.INFO
    """Logging level for the mirrored lines."""
    flush_secs: float = 30.0
    """Object-store log directories only: upload the metrics file at most this often while logging (it is
    also uploaded before each checkpoint save and at the end). Local files are flushed at every line."""

    def local_dirs(self, run_id: str, log_dir: str) -> list[tuple[str, str]]:
        if self.log_dir is not None:
            return [("trainer.tracker.log_dir", fs.join(self.log_dir, run_id))]
        return [("trainer.log_dir", fs.join(log_dir, run_id))]

    def init(self, run_id: str, log_dir: str, *, resume_step: Optional[int] = None) -> JsonTracker:
        base = self.log_dir if self.log_dir is not None else log_dir
        mirror = logging.getLogger(self.logger_name) if self.logger_name else None
        if self.flush_secs < 0:
            raise ValueError(f"trainer.tracker.flush_secs must be >= 0, got {self.flush_secs}")
        return JsonTracker(
            fs.join(base, run_id), resume_step=resume_step, mirror_logger=mirror, mirror_level=self.level,
            flush_secs=self.flush_secs,
        )


# Upstream Levanter's name for its JSON tracker; registered as an alias so upstream configs parse.
# Encoding a JsonConfig writes `type: json`, the first name registered.
TrackerConfig.register_subclass("json_logger", JsonConfig)
JsonLoggerConfig = JsonConfig
