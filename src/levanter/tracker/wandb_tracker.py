"""Weights & Biases tracker: ``{type: wandb, project: ..., mode: online|offline|disabled}``.

The fields are upstream Levanter's, so upstream ``tracker: {type: wandb, ...}`` blocks parse unchanged.

* ``mode: offline`` (or ``WANDB_MODE=offline`` with ``mode`` unset) needs no login and no network: the
  run is written under ``<dir>/wandb/offline-run-<time>-<id>/`` and can be uploaded later with
  ``wandb sync``. ``mode: disabled`` writes nothing at all. An online run with no credentials
  (``WANDB_API_KEY``, a netrc entry from ``wandb login``) is refused before any work
  (:meth:`WandbConfig.check_can_start`), rather than failing in ``wandb.init`` after the model is built.
* Files go under ``dir``; when it is unset, under ``$WANDB_DIR`` if that is set (wandb's own convention)
  and otherwise under the trainer's ``log_dir``, so the run sits at ``<log_dir>/wandb/...`` next to
  the other local logs instead of in the current directory. wandb needs a local directory: with a
  ``gs://``/``s3://`` ``log_dir`` its files go to ``./wandb``, and a URL ``dir`` is refused.
* The wandb run id is the trainer's ``run_id`` unless ``id`` is set, so a restarted job with
  ``resume: allow`` (the default) continues the same wandb run. wandb ignores (with a warning) values
  logged at a step lower than the run's last step; so after a restart from step ``k`` the steps between
  ``k`` and the crash keep the values of the first attempt. Rewinding a run is an online-only wandb
  feature and is not used here.
* ``wandb`` is imported inside ``init``: the import is slow (docs/bench/2026-12-03-cpu-levers.md), and parsing
  a config, or a run using other trackers, should not pay for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

from levanter.refused_keys import refused
from levanter.tracker.tracker import Tracker, TrackerConfig, TrackerError, normalize_metrics
from levanter.utils import fs

__all__ = ["WandbTracker", "WandbConfig"]

logger = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled", "shared")


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    from urllib.parse import urlsplit

    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for path in candidates:
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            continue
        import netrc

        try:
            if netrc.netrc(path).authenticators(host):
                return True
        except (netrc.NetrcParseError, OSError):
            return True  # wandb will report the unreadable file itself
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb")
    try:
        with open(os.path.join(config_dir, "settings"), encoding="utf-8") as f:
            return any(line.split("=", 1)[0].strip() == "api_key" for line in f)
    except OSError:
        return False


class WandbTracker(Tracker):
    """Forwards to a ``wandb`` run: ``log`` -> ``run.log(metrics, step=step)``, hyperparameters -> the
    run config, summary -> ``run.summary``."""

    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run
        self._finished = False

    @staticmethod
    def _call(what: str, fn, *args, **kwargs):
        """``fn(...)``, with a failure of wandb's turned into one :class:`TrackerError` line."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- wandb's own exceptions, reported without their traceback
            logger.debug("wandb failed %s", what, exc_info=True)
            raise TrackerError(f"trainer.tracker (wandb) failed {what}: {type(e).__name__}: {e}") from None

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        self._call("logging metrics", self.run.log, normalize_metrics(metrics), step=int(step))

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        # A resumed run re-logs its config; allow_val_change lets a changed value replace the old one.
        self.run.config.update(dict(params), allow_val_change=True)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        self.run.summary.update(normalize_metrics(metrics))

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._call("finishing the run", self.run.finish)


@TrackerConfig.register_subclass("wandb")
@dataclasses.dataclass(frozen=True)
class WandbConfig(TrackerConfig):
    """Arguments of ``wandb.init``; see the module docstring for how ``dir``, ``id`` and ``mode`` resolve."""

    # The wandb user or team the run belongs to; null: your default entity.
    entity: Optional[str] = None
    # The wandb project.
    project: Optional[str] = "levanter"
    # The run's display name; null: wandb's generated name.
    name: Optional[str] = None
    # Labels attached to the wandb run.
    tags: list[str] = dataclasses.field(default_factory=list)
    id: Optional[str] = None
    """wandb run id; None: the trainer's run id."""
    # wandb group that gathers related runs; null: none.
    group: Optional[str] = None
    mode: Optional[str] = None
    """online, offline, disabled (or shared); None: wandb's default, which honours ``WANDB_MODE``."""
    # wandb's resume policy for a run id it has seen (allow, must, never, or true/false).
    resume: Optional[Union[bool, str]] = "allow"
    # Let wandb save the code of the running program with the run.
    save_code: bool = True
    # Upstream uploads XLA dumps to wandb; refused if set.
    save_xla_dumps: bool = refused("XLA dumps are not uploaded; remove the key", default=False)
    dir: Optional[str] = None
    """Where wandb writes (it adds a ``wandb/`` subdirectory); None: ``$WANDB_DIR``, else ``log_dir``."""
    # The same as dir (the name every tracker accepts); give one of the two.
    log_dir: Optional[str] = None

    def _dir(self) -> Optional[str]:
        if self.dir is not None and self.log_dir is not None and self.dir != self.log_dir:
            raise ValueError(
                f"trainer.tracker: dir={self.dir!r} and log_dir={self.log_dir!r} name the same setting; give one"
            )
        return self.dir if self.dir is not None else self.log_dir

    def _mode(self) -> Optional[str]:
        if self.mode is None and os.environ.get("WANDB_MODE") in WANDB_MODES:
            return os.environ["WANDB_MODE"]
        return self.mode

    def check_can_start(self) -> None:
        """An online run needs credentials; without them wandb would fail (or prompt) at ``init``, after
        the caches are built and the model initialised. Looks where wandb looks, without importing it:
        ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``), the netrc file (``$NETRC``, ``~/.netrc``,
        ``~/_netrc``) for the server's host, and ``api_key`` in wandb's settings file."""
        self._dir()
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"trainer.tracker.mode: expected one of {WANDB_MODES} or null, got {self.mode!r}")
        if self._mode() in ("offline", "disabled") or _has_credentials():
            return
        raise ValueError(
            "trainer.tracker: wandb is online but has no credentials (no WANDB_API_KEY, no entry in ~/.netrc). "
            "Run `wandb login` once, set WANDB_API_KEY, or log offline with WANDB_MODE=offline "
            "(or trainer.tracker.mode: offline) and upload later with `wandb sync`."
        )

    def init(self, run_id: str, log_dir: str, *, resume_step: Optional[int] = None) -> WandbTracker:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"tracker.mode: expected one of {WANDB_MODES} or null, got {self.mode!r}")
        # Read WANDB_MODE here rather than leaving it to wandb: wandb reads the environment once per
        # process (at its first setup), so a later change, or a second run in the same process, would
        # otherwise be ignored. Values this fork does not know (e.g. legacy "dryrun") go to wandb as-is.
        mode = self._mode()
        if mode == "disabled":
            directory = None  # wandb would create `dir` even though it writes nothing into it
        else:
            directory = self._dir() or os.environ.get("WANDB_DIR") or log_dir
            if fs.is_url(directory):
                if directory != log_dir:
                    raise ValueError(
                        f"trainer.tracker.dir={directory!r}: wandb writes its files to a local directory "
                        "before sending them to its server; give a local path"
                    )
                # An object-store log_dir holds the other trackers' files; wandb keeps its local staging
                # files where it would without a log_dir (./wandb).
                directory = "."
            # wandb falls back to a temporary directory when `dir` does not exist; create it so the run
            # lands where the config says.
            os.makedirs(directory, exist_ok=True)

        import wandb

        run = wandb.init(
            entity=self.entity,
            project=self.project,
            name=self.name,
            tags=list(self.tags) or None,
            id=self.id or run_id,
            group=self.group,
            mode=mode,
            resume=self.resume,
            save_code=self.save_code,
            dir=directory,
        )
        if resume_step:
            logger.info("wandb run %s resuming at step %d", run.id, resume_step)
        return WandbTracker(run)
