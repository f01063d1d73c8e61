"""Running lm-evaluation-harness tasks on a model and reporting the results.

:class:`HarnessEvaluator` is what a training run (every ``eval_harness_steps`` steps, at each curriculum
stage's start and at the end) and ``python -m levanter.main.eval_harness`` call: it loads the tasks of an
``eval_harness`` section once (:mod:`levanter.eval_harness.tasks`), and each :meth:`~HarnessEvaluator.evaluate`
answers their requests with :class:`levanter.eval_harness.lm.LevanterHarnessLM` through the harness's own
``lm_eval.evaluator.evaluate``, the same seeds as the harness's ``simple_evaluate`` (0 for Python's
``random``, 1234 for numpy's and for few-shot sampling; the process's own random states are put back
afterwards). Each ``task_spec`` entry is evaluated on its own, so one task can run twice under two
``task_alias`` names; its results are renamed to the alias (a group's subtasks too: ``mmlu_1shot`` turns
``mmlu_anatomy`` into ``mmlu_anatomy_1shot``, upstream Levanter's rule).

Reported metrics (upstream's names): ``lm_eval/<task>/<metric>`` for every number the harness reports per
task and group (its ``,none`` filter suffix dropped), and ``lm_eval/averages/macro_avg_<metric>`` /
``micro_avg_<metric>`` over the tasks with documents (micro: weighted by their documents). The whole
report (the harness's dict, with ``averages``) is written as JSON to the run's log directory,
``<trainer.log_dir>/<run id>/lm_eval_harness_results.<step>.json``.

Every process runs the harness on the same documents and takes part in every batch; process 0 logs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from levanter.eval_harness.config import LmEvalHarnessConfig, task_name

__all__ = ["HarnessEvaluator", "compute_averages", "harness_metrics", "results_path", "format_report",
           "write_report", "rename_results"]

logger = logging.getLogger(__name__)

RESULTS_NAME = "lm_eval_harness_results.{step}.json"


def results_path(log_dir: str, run_id: str, step: int) -> str:
    """Where the report of the evaluation at ``step`` is written: the run's log directory."""
    from levanter.utils import fs

    return fs.join(log_dir, run_id, RESULTS_NAME.format(step=step))


def _renamed(name: str, task: str, alias: str) -> str:
    """``name`` (a task, group or subtask of ``task``) as logged under ``alias``."""
    if alias == task:
        return name
    if alias.startswith(task):
        suffix = alias[len(task):]
        return (name + suffix) if task in name else f"{task}_{name}{suffix}"
    return name.replace(task, alias) if task in name else f"{alias}_{name}"


def rename_results(report: Dict[str, Any], task: str, alias: str) -> Dict[str, Any]:
    """The harness's report with every task and group name of ``task`` renamed for ``alias``."""
    if alias == task:
        return report
    out = dict(report)
    for section in ("results", "groups", "n-samples", "configs", "versions", "higher_is_better", "n-shot",
                    "samples"):
        if isinstance(report.get(section), dict):
            out[section] = {_renamed(k, task, alias): v for k, v in report[section].items()}
    if isinstance(report.get("group_subtasks"), dict):
        out["group_subtasks"] = {_renamed(k, task, alias): [_renamed(s, task, alias) for s in v]
                                 for k, v in report["group_subtasks"].items()}
    for k, v in out.get("results", {}).items():
        if isinstance(v, dict) and "alias" in v:
            out["results"][k] = {**v, "alias": _renamed(k, task, alias)}
    return out


def compute_averages(report: Dict[str, Any]) -> Dict[str, float]:
    """Macro (each task alike) and micro (weighted by documents) averages of every metric over the tasks
    with documents (``n-samples``: groups, which have none of their own, are left out)."""
    results, counts = report.get("results", {}), report.get("n-samples", {})
    metrics = sorted({m for name in counts for m, v in results.get(name, {}).items()
                      if "stderr" not in m and m not in ("alias", "sample_len") and isinstance(v, (int, float))})
    out: Dict[str, float] = {}
    for metric in metrics:
        pairs = [(float(results[name][metric]), int(counts[name].get("effective", 0))) for name in counts
                 if isinstance(results.get(name, {}).get(metric), (int, float))]
        if not pairs:
            continue
        values, weights = zip(*pairs)
        out[f"macro_avg_{metric}"] = float(np.mean(values))
        if sum(weights) > 0:
            out[f"micro_avg_{metric}"] = float(np.average(values, weights=weights))
    return out


def _metric_name(metric: str) -> str:
    return metric[: -len(",none")] if metric.endswith(",none") else metric


def harness_metrics(report: Dict[str, Any], prefix: str = "lm_eval") -> Dict[str, float]:
    """``{prefix/<task>/<metric>: value}`` of the report's numbers, and ``prefix/averages/<average>``."""
    out: Dict[str, float] = {}
    for name, values in report.get("results", {}).items():
        for metric, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
                out[f"{prefix}/{name}/{_metric_name(metric)}"] = float(value)
    for metric, value in report.get("averages", {}).items():
        out[f"{prefix}/averages/{_metric_name(metric)}"] = float(value)
    return out


def format_report(report: Dict[str, Any]) -> str:
    """The harness's own table of the report (and of its groups, where there are any)."""
    from lm_eval.utils import make_table

    text = make_table(report)
    if report.get("groups"):
        text += "\n" + make_table(report, "groups")
    return text


def write_report(report: Dict[str, Any], path: str) -> None:
    """The report as JSON at ``path``, written whole or not at all."""
    from levanter.utils import fs

    fs.atomic_write_bytes(path, json.dumps(report, indent=2, default=str, sort_keys=True).encode())


@contextlib.contextmanager
def _harness_seeds():
    """The harness's ``simple_evaluate`` seeds for the duration, the process's random states restored after."""
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(0)
    np.random.seed(1234)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


class HarnessEvaluator:
    """The tasks of ``config`` (an ``eval_harness`` section), loaded once, here (their documents read, so a
    task that cannot load fails before any other work); :meth:`evaluate` runs them on a model. ``prefix``
    is the section's config key, for errors."""

    def __init__(self, config: LmEvalHarnessConfig, *, prefix: str = "eval_harness"):
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise ValueError(
                f"{prefix} is set but lm-evaluation-harness is not installed: pip install -e '.[eval]' (or remove "
                f"{prefix})"
            ) from None
        from levanter.eval_harness.tasks import load_task, make_task_manager

        config.validate(prefix)
        self.config = config
        manager = make_task_manager(config.task_spec, config.include_path)
        self.tasks: List[Tuple[Any, Dict[str, Any]]] = [
            (t, load_task(manager, t, f"{prefix}.task_spec.{i}")) for i, t in enumerate(config.task_spec)
        ]

    def evaluate(self, model, trainer, tokenizer, *, length: int, batch_size: int) -> Dict[str, Any]:
        """The harness's report of every task on ``model`` (its ``results``, ``n-samples``, ... dicts, plus
        ``averages``): text tokenized by ``tokenizer``, requests packed into rows of ``length`` positions
        (``max_eval_length`` or the model's ``seq_len``), ``batch_size`` rows a batch, scored on ``trainer``'s
        mesh in its precision (:class:`levanter.eval_harness.scoring.RowScorer`)."""
        from levanter.eval_harness.lm import LevanterHarnessLM
        from levanter.eval_harness.scoring import RowScorer

        scorer = RowScorer(trainer, model, batch_size=batch_size, length=length,
                           batch_axis=trainer.config.batch_axis)
        lm = LevanterHarnessLM(scorer, tokenizer)
        merged: Dict[str, Any] = {}
        for task, loaded in self.tasks:
            report = self._evaluate_one(lm, loaded)
            name = task if isinstance(task, str) else task.task
            merged = _merge(merged, rename_results(report, name, task_name(task)))
        merged["averages"] = compute_averages(merged)
        return merged

    def _evaluate_one(self, lm, loaded: Dict[str, Any]) -> Dict[str, Any]:
        from lm_eval.evaluator import evaluate

        c = self.config
        for t in loaded["tasks"].values():
            if t.get_config("num_fewshot") is None:  # simple_evaluate's default
                t.set_config(key="num_fewshot", value=0)
            t.set_fewshot_seed(seed=1234)
        with _harness_seeds():
            report = evaluate(lm=lm, task_dict=loaded, limit=c.max_examples, bootstrap_iters=c.bootstrap_iters,
                              log_samples=c.log_samples, apply_chat_template=c.apply_chat_template)
        return dict(report or {})

    @staticmethod
    def log(report: Dict[str, Any], tracker, step: int, path: Optional[str]) -> Dict[str, float]:
        """Log the report's metrics (:func:`harness_metrics`) to ``tracker`` at ``step`` and, where ``path``
        is given (process 0), write the report there as JSON; returns the metrics."""
        metrics = harness_metrics(report)
        tracker.log(metrics, step=step)
        if path is not None:
            write_report(report, path)
        shown = ", ".join(f"{k[len('lm_eval/'):]} {v:.4g}" for k, v in metrics.items()
                          if "/averages/" not in k and not k.endswith(("/sample_len", "_stderr")))
        logger.info("lm_eval at step %d: %s", step, shown)
        return metrics


def _merge(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        elif k not in out:
            out[k] = v
    return out

