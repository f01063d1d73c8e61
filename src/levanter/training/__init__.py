"""Training: the ``trainer:`` section (:mod:`.config`), the state and the compiled train step
(:mod:`.trainer`), how compiled programs are called (:mod:`.dispatch`), the language-model loss as the
trainer takes it (:mod:`.loss`), evaluation on the validation sources (:mod:`.eval`) and the profiler's
trace of a window of steps (:mod:`.profiler`).

Names load on first use (a lazy facade): the config is read by every entry point and by the memory plan,
which must not pay for the compiled step and the loop to parse it.
"""

from __future__ import annotations

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__, __package__, ("config", "trainer", "dispatch", "loss", "eval", "profiler"), lazy=True
)
