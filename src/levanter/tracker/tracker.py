"""The tracker interface: where training metrics, hyperparameters and run summaries go.

A ``Tracker`` receives ``log(metrics, step=...)`` calls from the training loop and forwards them to a
backend (a JSON-lines file, Weights & Biases, TensorBoard, or memory for tests). ``TrackerConfig`` is a
draccus plugin registry, so a config file picks the backend by name::

    trainer:
      tracker: {type: json}                       # one tracker
      tracker: [{type: json}, {type: wandb, mode: offline}]   # several: a CompositeTracker

The field holding it should be typed ``Union[TrackerConfig, Tuple[TrackerConfig, ...]]`` and turned into
a tracker with :func:`init_trackers`. A mapping without ``type`` means ``wandb``, upstream Levanter's
default, so upstream configs that omit the type keep their meaning.

Design choices:

* Metric values are normalised once, here (:func:`to_python`): numpy and JAX 0-d arrays become Python
  ``float``/``int``/``bool``. ``float()`` of a float32 is exact, so nothing is rounded on the way to a
  backend; what each backend keeps is the backend's business.
* Trackers are not multi-host aware. The caller creates real trackers on process 0 only and a
  ``NoopTracker`` elsewhere; otherwise every host would write the same file or run.
* Backends with costly imports (wandb, tensorboardX) import them inside ``init`` so that parsing a
  config, or a run that logs to JSON only, never pays for them.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import draccus
import numpy as np

__all__ = [
    "to_python",
    "normalize_metrics",
    "Tracker",
    "NoopTracker",
    "DictTracker",
    "CompositeTracker",
    "TrackerConfig",
    "NoopConfig",
    "check_trackers_writable",
    "TrackerError",
    "TrackerStartError",
    "init_trackers",
]

logger = logging.getLogger(__name__)


def to_python(value: Any) -> Any:
    """``value`` with numpy/JAX scalars (0-d arrays and numpy scalar types) replaced by Python scalars.

    Floats go through ``float()``, which is exact for float16/bfloat16/float32/float64, so the value a
    backend receives is bit-for-bit the value computed. Anything else (strings, Python numbers, arrays
    with more than one element, backend-specific objects such as ``wandb.Histogram``) is returned
    unchanged; each backend decides what to do with it.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # Duck-typed so that jax need not be imported here: jax.Array, np.ndarray and np.generic all qualify.
    if isinstance(value, np.generic) or (
        hasattr(value, "__array__") and getattr(value, "shape", None) == () and hasattr(value, "dtype")
    ):
        arr = np.asarray(value)
        kind = arr.dtype.kind
        if kind == "b":
            return bool(arr)
        if kind in "iu":
            return int(arr)
        if kind in "US":
            return str(arr.item())
        if kind == "c":
            return complex(arr)
        # 'f', and ml_dtypes' bfloat16/float8 (which numpy reports as kind 'V').
        return float(arr)
    return value


def normalize_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A plain dict of ``metrics`` with every value passed through :func:`to_python`."""
    return {str(k): to_python(v) for k, v in metrics.items()}


class Tracker(abc.ABC):
    """A destination for metrics. Subclasses implement the four methods; all take plain mappings.

    ``log`` may be called more than once for the same step (e.g. training metrics and then evaluation
    metrics at the same step); steps passed to successive calls never decrease within one attempt of a
    run. Trackers are context managers: leaving the ``with`` block calls :meth:`finish`.
    """

    name: str = "tracker"

    @abc.abstractmethod
    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Record ``metrics`` (name -> value) as of training step ``step``."""

    @abc.abstractmethod
    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration. Later calls add to (and override keys of) earlier ones."""

    @abc.abstractmethod
    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Record step-less, end-of-run values (best loss, total tokens, ...)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Flush and close. Calling it twice is harmless."""

    def flush(self) -> None:
        """Make what was logged so far durable where the backend keeps it (a backend that buffers, such
        as the JSON tracker on an object store, uploads here). A run calls it before each checkpoint save,
        so that a run resumed from that checkpoint finds the metrics of every step before it."""

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.finish()


class NoopTracker(Tracker):
    """Discards everything (non-primary hosts, or runs that want no logging)."""

    name = "noop"

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        pass

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        pass

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


class DictTracker(Tracker):
    """Keeps everything in memory, for tests.

    ``metrics`` is the list of ``(step, metrics)`` pairs in call order, values normalised by
    :func:`to_python`; ``hyperparameters`` and ``summary`` are merged dicts.
    """

    name = "dict"

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, Any]]] = []
        self.hyperparameters: dict[str, Any] = {}
        self.summary: dict[str, Any] = {}
        self.finished = False

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        self.metrics.append((int(step), normalize_metrics(metrics)))

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        self.hyperparameters.update(params)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        self.summary.update(normalize_metrics(metrics))

    def finish(self) -> None:
        self.finished = True

    def history(self, key: str) -> list[tuple[int, Any]]:
        """``(step, value)`` for every logged value of ``key``, in call order."""
        return [(s, m[key]) for s, m in self.metrics if key in m]


class CompositeTracker(Tracker):
    """Forwards every call to each of ``trackers``, in order."""

    name = "composite"

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step=step)

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.log_hyperparameters(params)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.log_summary(metrics)

    def flush(self) -> None:
        for t in self.trackers:
            t.flush()

    def finish(self) -> None:
        # Finish every backend even if one fails, so a broken wandb never costs the JSON file its tail.
        errors = []
        for t in self.trackers:
            try:
                t.finish()
            except Exception as e:  # noqa: BLE001 -- re-raised below
                # one line on the console; the traceback goes to the debug log
                logger.error("tracker %s failed to finish: %s: %s", t.name, type(e).__name__, e)
                logger.debug("tracker %s failed to finish", t.name, exc_info=True)
                errors.append(e)
        if errors:
            raise errors[0]


@dataclasses.dataclass(frozen=True)
class TrackerConfig(draccus.PluginRegistry, abc.ABC, discover_packages_path="levanter.tracker"):
    """Choice of tracker backend: ``{type: json|json_logger|wandb|tensorboard|noop, ...}``."""

    @abc.abstractmethod
    def init(self, run_id: str, log_dir: str, *, resume_step: Optional[int] = None) -> Tracker:
        """Start a tracker for run ``run_id``.

        ``log_dir`` is the run-independent directory for local logs (each backend appends ``run_id`` or
        its own subdirectory). ``resume_step=k`` says the run is restarting at step ``k`` after a crash
        or preemption: backends that can, forget what the earlier attempt logged at steps ``>= k``.
        """

    def check_can_start(self) -> None:
        """Raise ``ValueError`` (one paragraph naming what to do) if this tracker cannot start, e.g. wandb
        online without credentials; called with the log directory checks, before any expensive work."""

    def local_dirs(self, run_id: str, log_dir: str) -> list[tuple[str, str]]:
        """``(config key, directory)`` for each directory ``init`` will write to (a local path or an
        object-store URL); checked for writability before any expensive work
        (see :func:`check_trackers_writable`)."""
        return []

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "wandb"  # upstream's default: a tracker mapping without `type` is a wandb config


# draccus 0.11.6 drops the `type` key when encoding a 2-element `Tuple[TrackerConfig, ...]` (its tuple
# encoder zips the elements with the type arguments `(TrackerConfig, Ellipsis)`, fails on Ellipsis and
# falls back to encoding without types), so a saved config with two trackers would re-parse as two
# wandb configs. Encoding every TrackerConfig subclass as a choice, whatever the declared type, fixes it.
@draccus.encode.register(TrackerConfig, include_subclasses=True)
def _encode_tracker_config(obj: TrackerConfig, declared_type: Any = None) -> dict:
    from draccus.parsers.encoding import encode_choice

    return encode_choice(obj, TrackerConfig)


@TrackerConfig.register_subclass("noop")
@dataclasses.dataclass(frozen=True)
class NoopConfig(TrackerConfig):
    """Log nothing."""

    def init(self, run_id: str, log_dir: str, *, resume_step: Optional[int] = None) -> Tracker:
        return NoopTracker()


def check_trackers_writable(
    config: TrackerConfig | Sequence[TrackerConfig], run_id: str, log_dir: str
) -> None:
    """Create each tracker's directory (local, or a prefix on an object store) and write and delete a
    probe file there, so that a log directory that cannot be written fails before caches are built and
    the model initialised, naming the key; a full disk raises :class:`~levanter.errors.OutOfSpaceError`,
    a bucket that is missing or refuses access a ``ValueError`` naming the URL and the key."""
    from levanter.errors import is_out_of_space, out_of_space_error
    from levanter.utils import fs

    configs = [config] if isinstance(config, TrackerConfig) else list(config)
    for c in configs:
        c.check_can_start()
        for key, path in c.local_dirs(run_id, log_dir):
            try:
                if fs.is_url(path):
                    fs.check_access(path, key, write=True)
                else:
                    fs.probe_writable(path)
            except fs.StorageAccessError as e:
                message = str(e)
                raise ValueError(message if message.startswith(key) else f"{key}: {message}") from None
            except OSError as e:
                if is_out_of_space(e):
                    raise out_of_space_error("checking the log directory", path) from None
                raise ValueError(
                    f"{key}: cannot write logs to {path} ({e.strerror or e}). Choose a writable directory."
                ) from None


class TrackerError(RuntimeError):
    """A tracker backend's library failed: reported as one line naming the tracker (the traceback goes to
    the debug log), never as a traceback on the console."""


class TrackerStartError(TrackerError):
    """A tracker backend failed to start."""


def _start(c: TrackerConfig, run_id: str, log_dir: str, resume_step: Optional[int]) -> Tracker:
    try:
        return c.init(run_id, log_dir, resume_step=resume_step)
    except (ValueError, OSError):  # user errors and full disks keep their own reports
        raise
    except Exception as e:  # noqa: BLE001 -- a backend library's failure, reported without its traceback
        logger.debug("tracker %s failed to start", type(c).__name__, exc_info=True)
        name = type(c).__name__.removesuffix("Config").lower()
        raise TrackerStartError(
            f"trainer.tracker ({name}) could not start: {type(e).__name__}: {e}. Fix it, or use another "
            "tracker (trainer.tracker: {type: json})."
        ) from None


def init_trackers(
    config: TrackerConfig | Sequence[TrackerConfig],
    run_id: str,
    log_dir: str,
    *,
    resume_step: Optional[int] = None,
) -> Tracker:
    """The tracker for ``config``: a single backend, a ``CompositeTracker`` for several, a
    ``NoopTracker`` for an empty sequence. If one backend fails to start, those already started are
    finished before the error propagates (no dangling wandb run); a backend library's own exception
    becomes a :class:`TrackerStartError` (one line, no traceback on the console)."""
    if isinstance(config, TrackerConfig):
        return _start(config, run_id, log_dir, resume_step)
    started: list[Tracker] = []
    try:
        for c in config:
            started.append(_start(c, run_id, log_dir, resume_step))
    except BaseException:
        for t in started:
            try:
                t.finish()
            except Exception:  # noqa: BLE001 -- the original error is the one to report
                logger.warning("tracker %s failed to finish after a failed start", t.name)
                logger.debug("tracker %s failed to finish after a failed start", t.name, exc_info=True)
        raise
    if not started:
        return NoopTracker()
    if len(started) == 1:
        return started[0]
    return CompositeTracker(started)
