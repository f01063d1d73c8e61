"""Metric trackers: the ``Tracker`` interface and its backends (JSON lines, wandb, TensorBoard, no-op).

Importing this package registers every backend with ``TrackerConfig``, so ``{type: json}``,
``{type: json_logger}``, ``{type: wandb}``, ``{type: tensorboard}`` and ``{type: noop}`` all parse.
Backends import their third-party libraries lazily, in ``init``. See ``tracker.py`` for the design.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__, __package__, ("json_tracker", "tensorboard_tracker", "tracker", "wandb_tracker", "destinations")
)
