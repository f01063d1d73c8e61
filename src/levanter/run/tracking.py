"""Where a run's metrics go: the trackers opened on the first process (the others log to nothing: every
process computes the same global metrics), the log directories' lineage (:mod:`levanter.tracker.lineage`),
the config as the run's hyperparameters, and the end-of-run summary's lines saying where everything went.
"""

from __future__ import annotations

__all__ = ["check_log_dirs", "config_dict", "json_log_dirs", "open_tracker", "summary_lines"]

import os
from typing import Optional

import jax

from levanter.tracker import JsonConfig, NoopTracker, check_trackers_writable, init_trackers, metrics_destinations
from levanter.tracker.lineage import check_log_lineage, record_log_lineage
from levanter.training import TrainerConfig
from levanter.utils import compile_cache, fs


def json_log_dirs(tcfg: TrainerConfig, run_id: str) -> list:
    """``(config key, directory)`` of each JSON tracker's metrics: the log directories a resume rewrites."""
    return [d for c in tcfg.trackers() if isinstance(c, JsonConfig) for d in c.local_dirs(run_id, tcfg.log_dir)]


def config_dict(config) -> dict:
    """``config`` as plain data (the run's hyperparameters); empty where it cannot be encoded."""
    import draccus

    try:
        return draccus.encode(config)
    except Exception:  # noqa: BLE001 -- hyperparameters are best effort, never a reason to fail
        return {}


def check_log_dirs(tcfg: TrainerConfig, run_id: str) -> None:
    """Before any work, on the first process: the trackers can write, and the log directory holds no other
    run's metrics under this id (a run whose checkpoints are not the ones that wrote them)."""
    check_trackers_writable(tcfg.trackers(), run_id, tcfg.log_dir)
    check_log_lineage(json_log_dirs(tcfg, run_id), tcfg.checkpointer.expanded_path(run_id), run_id)


def open_tracker(config, run_id: str, start_step: int, origin: Optional[dict]):
    """The run's tracker, with the config (and where the run started from, ``origin``) as hyperparameters: the
    configured trackers on the first process, resumed at ``start_step`` (lines past it, logged by an attempt
    that never checkpointed them, are dropped); a :class:`levanter.tracker.NoopTracker` elsewhere."""
    tcfg = config.trainer
    if jax.process_index() == 0:
        record_log_lineage(json_log_dirs(tcfg, run_id), tcfg.checkpointer.expanded_path(run_id))
        # resume_step=0 on a fresh start too: lines an earlier attempt logged without checkpointing are dropped.
        tracker = init_trackers(tcfg.trackers(), run_id, tcfg.log_dir, resume_step=start_step)
    else:
        tracker = NoopTracker()  # one writer: every process computes the same (global) metrics
    tracker.log_hyperparameters({**config_dict(config), **({"initialized_from": origin} if origin else {})})
    return tracker


def summary_lines(tcfg: TrainerConfig, run_id: str, checkpoint_path: str) -> list:
    """Lines of the run summary saying where its metrics, checkpoints (``checkpoint_path``) and debug log went."""
    out = metrics_destinations(tcfg.trackers(), run_id, tcfg.log_dir)
    out.append(f"checkpoints: {checkpoint_path}")
    log = fs.join(tcfg.log_dir, run_id, "debug.log")
    if not fs.is_url(log) and os.path.exists(log):
        out.append(f"debug log: {log}")
    cache = compile_cache.cache_stats().summary()  # trainer.jax_compilation_cache_dir: what it held for this run
    if cache is not None:
        out.append(cache)
    return out
