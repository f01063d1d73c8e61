"""Stopping a run on SIGTERM or Ctrl-C: the request, and on several processes the step they all stop at.

A signal only records the request (:class:`StopSignals`); the step loop checkpoints the state after the
step in flight and exits with :data:`PREEMPTED_EXIT_CODE`, so a relaunch of the same command resumes. A
second Ctrl-C exits at once with status 130 (128 + SIGINT), saving nothing more. With several processes a
signal reaches each at its own moment, but the save and the exit are collective, so the stop is agreed over
the devices one step ahead (:class:`StopAgreement`): every process stops at the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Optional

from ..distributed import read_process_sum, start_process_sum

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: checkpointed after SIGTERM or SIGINT; relaunch to resume
INTERRUPTED_AGAIN_EXIT_CODE = 130  # 128 + SIGINT: a second Ctrl-C, nothing more saved


class StopSignals:
    """Whether SIGTERM or SIGINT asked the run to stop, and which one (for the exit's message)."""

    def __init__(self) -> None:
        self.requested = False
        self.name = "SIGTERM"

    def install(self) -> Optional[dict]:
        """Make SIGTERM and SIGINT (Ctrl-C) request a checkpoint after the current step and an exit with
        :data:`PREEMPTED_EXIT_CODE`; a second SIGINT exits at once with :data:`INTERRUPTED_AGAIN_EXIT_CODE`.
        Returns the previous handlers (for :meth:`restore`), or None off the main thread, where signals
        cannot be handled."""

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.requested and signum == signal.SIGINT:
                print(f"{name} again: exiting at once, without a checkpoint of the current step",
                      file=sys.stderr, flush=True)
                os._exit(INTERRUPTED_AGAIN_EXIT_CODE)
            self.requested = True
            self.name = name
            hint = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
            logger.warning("%s received: will checkpoint after the current step and exit%s", name, hint)

        previous = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. some test runners)
            self.restore(previous)
            return None
        return previous

    @staticmethod
    def restore(previous: Optional[dict]) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, h in (previous or {}).items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)


class StopAgreement:
    """Multi-process: whether any process has been asked to stop, the same answer on every process for the
    same step. The answer for step ``s`` is a sum over processes dispatched at step ``s - 1`` (behind the step
    queued then, finished by the time it is read), as the checkpointer's time-based decision is: reading it
    never waits for the step dispatched since. A stop requested on any process therefore takes effect on all
    of them at the next step boundary but one."""

    def __init__(self):
        self._ahead: tuple[int, Any] | None = None

    def __call__(self, step: int, requested: bool) -> bool:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            stop = read_process_sum(ahead[1]) > 0
        else:  # the first step of the loop: agreed at once
            stop = read_process_sum(start_process_sum(int(requested))) > 0
        self._ahead = (step + 1, start_process_sum(int(requested)))
        return stop


__all__ = ["INTERRUPTED_AGAIN_EXIT_CODE", "PREEMPTED_EXIT_CODE", "StopAgreement", "StopSignals"]
