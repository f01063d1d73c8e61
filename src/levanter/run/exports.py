"""Where a run's model exports go, the check that they replace nothing but earlier exports, and the
checkpointer that writes them.

``hf_save_path`` (and a LoRA run's ``peft_save_path`` and ``merged_hf_save_path``) export the model every
N steps and at the end, beside the checkpoints, in upstream's layout ``<path>/<run id>/step-N``. Each export
is checked before any work (:func:`check_export_path`): a mistyped path that points at the checkpoints, the
logs, a cache or an unrelated directory is refused up front, rather than overwritten at the first export.
"""

from __future__ import annotations

__all__ = ["check_export_path", "check_hf_save_path", "export_base", "hf_exporter", "with_exporters"]

from levanter.lm_config import TrainLmConfig, config_locations
from levanter.utils import fs


def hf_exporter(config: TrainLmConfig, run_id: str):
    """The :class:`levanter.compat.HfExporter` of ``hf_save_path`` (upstream's layout: ``<hf_save_path>/<run
    id>/step-N``, without the run id when ``trainer.checkpointer.append_run_id_to_base_path`` is false), or None."""
    if not config.hf_save_path:
        return None
    from levanter.compat import HfExporter

    return HfExporter(export_base(config, config.hf_save_path, run_id), every=config.hf_save_steps,
                      last_step=config.trainer.num_train_steps, config=config.model, tokenizer=config.data.tokenizer,
                      dtype=config.hf_save_dtype)


def export_base(config: TrainLmConfig, path: str, run_id: str) -> str:
    """Where a run's step-N exports to ``path`` go: ``<path>/<run id>`` (upstream's layout), or ``path`` itself
    when ``trainer.checkpointer.append_run_id_to_base_path`` is false."""
    if config.trainer.checkpointer.append_run_id_to_base_path:
        return fs.join(path, run_id)
    return path


def check_hf_save_path(config: TrainLmConfig, run_id: str) -> None:
    """Before any work: the exports of ``hf_save_path`` (``<hf_save_path>/<run id>/step-N``) may replace only
    earlier exports (:mod:`levanter.compat.export_guard`): their directory may neither be nor contain the
    working directory, the run's checkpoint, log or cache directories (nor lie inside the checkpoints), and
    every ``step-N`` already there that this run would export must be exactly an earlier export."""
    if config.hf_save_path:
        check_export_path(config, run_id, config.hf_save_path, "hf_save_path", config.hf_save_steps)


def check_export_path(config: TrainLmConfig, run_id: str, path: str, key: str, every: int) -> None:
    """:func:`check_hf_save_path` for exports every ``every`` steps (and at the end) to ``path``, the value of
    the config key ``key`` (also a LoRA run's ``peft_save_path`` and ``merged_hf_save_path``)."""
    from levanter.compat.export_guard import check_export_steps

    tcfg, ckpt = config.trainer, config.trainer.checkpointer
    protected = [
        ("the run's checkpoint directory", ckpt.expanded_path(run_id), True),
        ("trainer.checkpointer.base_path", ckpt.base_path, False),
        ("trainer.log_dir", tcfg.log_dir, False),
        ("the run's log directory", fs.join(tcfg.log_dir, run_id), False),
    ]
    for c in tcfg.trackers():
        protected += [(key, path, False) for key, path in c.local_dirs(run_id, tcfg.log_dir)]
    for name, where in (("trainer.load_checkpoint_path", tcfg.load_checkpoint_path),
                        ("trainer.initialize_from", tcfg.initialize_from),
                        ("initialize_from_checkpoint_path", config.initialize_from_checkpoint_path)):
        if where:
            protected.append((name, where, True))
    protected += [(key, url, False) for key, url, written in config_locations(config) if written and "cache" in key]
    last = tcfg.num_train_steps
    check_export_steps(export_base(config, path, run_id), f"{key}={path!r}",
                       lambda n: 0 < n <= last and (n % every == 0 or n == last), protected)


def with_exporters(checkpointer, exporters: list):
    """``checkpointer`` behind each of ``exporters`` (:meth:`levanter.compat.HfExporter.wrap`), the first
    innermost: every export of a step is written before that step's checkpoint."""
    for exporter in exporters:
        checkpointer = exporter.wrap(checkpointer)
    return checkpointer
