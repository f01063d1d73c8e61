"""lm-evaluation-harness tasks on levanter models, during training and after.

* :mod:`~levanter.eval_harness.config`: the ``eval_harness:`` section (upstream Levanter's keys).
* :mod:`~levanter.eval_harness.packing`: the harness's requests packed into fixed rows, a pure function of
  the set of requests (so every process builds the same batches).
* :mod:`~levanter.eval_harness.scoring`: :func:`score_requests`, token requests packed and scored in JAX on
  the run's mesh (:class:`RowScorer`), bit for bit the same however the processes split the devices; no
  harness needed (``scripts/bench/eval_harness.py`` times it).
* :mod:`~levanter.eval_harness.lm`: :class:`LevanterHarnessLM`, the harness's ``LM`` answering
  ``loglikelihood`` and ``loglikelihood_rolling`` through :func:`score_requests`.
* :mod:`~levanter.eval_harness.tasks` and :mod:`~levanter.eval_harness.local_data`: task lookup (local
  YAMLs, the tasks shipped in ``tasks/``, the harness's own) and the errors of tasks that cannot load.
* :mod:`~levanter.eval_harness.run`: :class:`HarnessEvaluator`, the report, its metrics and its JSON.

The harness (``lm-eval``, the ``eval`` extra) is imported only when an evaluation runs: names load on first
use, and the config parses without it.
"""

from __future__ import annotations

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__, __package__, ("config", "packing", "scoring", "lm", "tasks", "local_data", "run"), lazy=True
)
