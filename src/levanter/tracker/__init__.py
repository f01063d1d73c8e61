"""Metric trackers: the ``Tracker`` interface and its backends (JSON lines, wandb, TensorBoard, no-op).

Importing this package registers every backend with ``TrackerConfig``, so ``{type: json}``,
``{type: json_logger}``, ``{type: wandb}``, ``{type: tensorboard}`` and ``{type: noop}`` all parse.
Backends import their third-party libraries lazily, in ``init``. See ``tracker.py`` for the design.
"""

from levanter.tracker.json_tracker import JsonConfig as JsonConfig
from levanter.tracker.json_tracker import JsonLoggerConfig as JsonLoggerConfig
from levanter.tracker.json_tracker import JsonTracker as JsonTracker
from levanter.tracker.tensorboard_tracker import TensorboardConfig as TensorboardConfig
from levanter.tracker.tensorboard_tracker import TensorboardTracker as TensorboardTracker
from levanter.tracker.tracker import CompositeTracker as CompositeTracker
from levanter.tracker.tracker import DictTracker as DictTracker
from levanter.tracker.tracker import NoopConfig as NoopConfig
from levanter.tracker.tracker import NoopTracker as NoopTracker
from levanter.tracker.tracker import Tracker as Tracker
from levanter.tracker.tracker import TrackerConfig as TrackerConfig
from levanter.tracker.tracker import TrackerError as TrackerError
from levanter.tracker.tracker import TrackerStartError as TrackerStartError
from levanter.tracker.tracker import check_trackers_writable as check_trackers_writable
from levanter.tracker.tracker import init_trackers as init_trackers
from levanter.tracker.tracker import to_python as to_python
from levanter.tracker.wandb_tracker import WandbConfig as WandbConfig
from levanter.tracker.wandb_tracker import WandbTracker as WandbTracker

__all__ = [
    "CompositeTracker",
    "DictTracker",
    "JsonConfig",
    "JsonLoggerConfig",
    "JsonTracker",
    "NoopConfig",
    "NoopTracker",
    "TensorboardConfig",
    "TensorboardTracker",
    "Tracker",
    "TrackerConfig",
    "TrackerError",
    "TrackerStartError",
    "WandbConfig",
    "WandbTracker",
    "check_trackers_writable",
    "init_trackers",
    "metrics_destinations",
    "to_python",
]


def metrics_destinations(trackers, run_id: str, log_dir: str) -> list:
    """Lines saying where ``trackers`` (tracker configs) put the metrics of run ``run_id``: the file of the
    JSON tracker, the event directory of TensorBoard, the wandb run and its local files. Printed at the end of
    ``train_lm`` and ``eval_lm``."""
    import os

    from levanter.utils import fs

    out = []
    for c in trackers:
        for _, path in c.local_dirs(run_id, log_dir):
            if isinstance(c, JsonConfig):
                path = fs.join(path, "metrics.jsonl")
            out.append(f"{type(c).__name__.removesuffix('Config').lower()} metrics: {path}")
        if isinstance(c, WandbConfig):
            local = c.dir or c.log_dir or os.environ.get("WANDB_DIR") or log_dir
            out.append(f"wandb metrics: run {c.id or run_id} of project {c.project} (local files under "
                       f"{fs.join(local, 'wandb')})")
    return out
