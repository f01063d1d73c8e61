"""A ``jax.profiler`` trace of a window of training steps (upstream's ``trainer.profiler`` keys).

``trainer.profiler: true`` traces steps ``profiler_start_step`` .. ``profiler_start_step +
profiler_num_steps - 1`` (step numbers as the run counts them, from 0) into ``<log_dir>/<run id>/profiler``:
JAX writes ``plugins/profile/<date_time>/<host>.xplane.pb`` (and a ``.trace.json.gz``) there, which
TensorBoard's profile plugin and Perfetto open (docs/performance.md). The default start skips the first
steps, whose time is mostly compilation. A resumed run that starts inside the window traces the rest of
it; one that starts after it traces nothing. The trace stops at the window's end, or when the run ends or
fails before that, so a short run still leaves a complete trace. Each process writes its own. The
trainer reads a step's metrics after dispatching the next step (:meth:`levanter.training.Trainer.train`),
so the window is shifted by about one step's dispatch: it opens while step ``profiler_start_step`` is
already queued and closes while the step after the window runs. Steady-state steps look alike, so the
trace shows the same thing.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import jax

from levanter.utils import fs

logger = logging.getLogger(__name__)


class StepProfiler:
    """Starts and stops the trace around the steps of the window; every call is a no-op without
    ``trainer.profiler``."""

    def __init__(self, tcfg, run_id: str):
        self.enabled = bool(tcfg.profiler)
        self.start = int(tcfg.profiler_start_step)
        self.end = self.start + int(tcfg.profiler_num_steps)
        self.path = fs.join(tcfg.log_dir, run_id, "profiler")
        self.active = False
        self.done = False

    def before_step(self, step: int) -> None:
        """Start tracing if ``step`` (about to run) is in the window and no trace was taken yet."""
        if not self.enabled or self.active or self.done or not self.start <= step < self.end:
            return
        if not fs.is_url(self.path):
            os.makedirs(self.path, exist_ok=True)
        try:
            jax.profiler.start_trace(self.path)
        except RuntimeError as e:  # another trace already running (e.g. started by the user's own code)
            logger.warning("trainer.profiler: could not start a trace (%s); training goes on without one", e)
            self.done = True
            return
        self.active = True
        logger.info("profiling steps %d to %d into %s", step, self.end - 1, self.path)

    def after_step(self, step: int) -> None:
        """After ``step`` (its results fetched): stop at the window's end, else start before the next."""
        if self.active and step + 1 >= self.end:
            self.stop()
        else:
            self.before_step(step + 1)

    def stop(self) -> Optional[str]:
        """Stop and write the trace (if one is running); returns its directory."""
        if not self.active:
            return None
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        logger.warning("profile written under %s (open it with TensorBoard's profile plugin or Perfetto: "
                       "docs/performance.md)", self.path)
        return self.path


__all__ = ["StepProfiler"]
