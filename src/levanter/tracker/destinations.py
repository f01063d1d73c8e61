"""Where a run's metrics went, one line per tracker, printed at the end of ``train_lm`` and ``eval_lm``.

A module of its own because it reads the configs of two backends (JSON, wandb), which import the
interface in ``tracker.py``, not each other.
"""

from __future__ import annotations

import os

from levanter.tracker.json_tracker import JsonConfig
from levanter.tracker.wandb_tracker import WandbConfig
from levanter.utils import fs

__all__ = ["metrics_destinations"]


def metrics_destinations(trackers, run_id: str, log_dir: str) -> list:
    """Lines saying where ``trackers`` (tracker configs) put the metrics of run ``run_id``: the file of the
    JSON tracker, the event directory of TensorBoard, the wandb run and its local files. Printed at the end of
    ``train_lm`` and ``eval_lm``."""
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
