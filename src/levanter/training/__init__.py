"""Training: the ``trainer:`` section (:mod:`.config`); the state and its averaged weights (:mod:`.state`);
the train step (:mod:`.step`) and its parts, gradients over microbatches (:mod:`.microbatch`) and fp8's
state (:mod:`.fp8`); how compiled programs are called (:mod:`.dispatch`); the trainer (:mod:`.trainer`) and
its step loop (:mod:`.loop`), what a step's metrics say (:mod:`.report`) and stopping on a signal
(:mod:`.signals`); the language-model loss as the trainer takes it (:mod:`.loss`), evaluation on the
validation sources (:mod:`.eval`) and the profiler's trace of a window of steps (:mod:`.profiler`).

Layers inside the package: the config, the loss, dispatch and the profiler import nothing of the step or
the loop (tests/project/test_architecture.py checks it), so that reading a config or building a loss does not
import them. Names load on first use (a lazy facade), for the same reason.
"""

from __future__ import annotations

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "config",
        "state",
        "fp8",
        "microbatch",
        "step",
        "dispatch",
        "report",
        "signals",
        "loop",
        "trainer",
        "loss",
        "eval",
        "profiler",
    ),
    lazy=True,
)
