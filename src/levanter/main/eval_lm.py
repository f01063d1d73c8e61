"""Evaluate a language model on validation data: ``python -m levanter.main.eval_lm --config_path
config/gpt2_nano.yaml --checkpoint_path checkpoints/gpt2-nano`` (or ``--hf_checkpoint PATH_OR_ID``).

The config is a training config (:class:`levanter.lm_config.TrainLmConfig`, so the YAML a run was trained
with evaluates it as it is) plus ``checkpoint_path`` -- a ``step-N`` checkpoint directory, or a run's
checkpoint directory for its latest complete checkpoint -- or ``hf_checkpoint``, a Hugging Face checkpoint
(local directory or hub id). Keys about training (optimizer, schedules) are read but play no part.

For every validation source of ``data`` it reports what ``train_lm`` logs at its evals
(:mod:`levanter.training.eval`): loss and bits per byte per source and per tag, micro and macro averages, over the
first ``trainer.max_eval_batches`` batches of each source (all of them when null), in batches of
``trainer.per_device_eval_parallelism`` x data-parallel devices (else the first training batch size). The
batches are the same for any number of processes. It prints a table and writes the metrics to the
configured trackers under the run ``<trainer.id>-eval`` (appended to, one record per evaluation, at the
checkpoint's step; 0 for a Hugging Face checkpoint), and says where they went. Run from the command line,
it keeps a debug log of every record (third-party libraries' too) in ``<trainer.log_dir>/<trainer.id>-eval``.
``main(config)`` returns the metrics.

Without ``--config_path`` the model and the tokenizer come from the checkpoint's ``metadata.json`` (which
records both), unless the command line sets ``model`` or ``data.tokenizer``; the validation data must still
be named, with the run's config or ``--data.validation_urls``, and a command line naming none is refused
first, in one error saying so, before the accelerator is required or any tokenizer loaded.

Bad input (no checkpoint named, both named, a path without a complete checkpoint, a checkpoint that does
not fit ``model``, data without validation sources, a log directory that cannot be written) prints one ``error:``
paragraph and exits with status 2; a failed evaluation (unreadable data, a tracker that failed) exits with 1.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Optional

import levanter.config
from levanter.checkpoint import read_checkpoint_metadata
from levanter.lm_config import TrainLmConfig, with_hf_model

__all__ = ["EvalLmConfig", "from_checkpoint_record", "main", "cli_main", "cli"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalLmConfig(TrainLmConfig):
    # The checkpoint to evaluate: a step-N directory, or a run's checkpoint directory for its latest one.
    checkpoint_path: Optional[str] = None
    # A Hugging Face checkpoint to evaluate instead (a directory of config.json and safetensors, or a hub id).
    hf_checkpoint: Optional[str] = None


def from_checkpoint_record(config: EvalLmConfig, record: dict) -> EvalLmConfig:
    """``config`` with the model and tokenizer a checkpoint's metadata ``record`` names, where ``config`` has
    them at their defaults (a command line without ``--config_path`` that sets neither)."""
    import draccus

    from levanter.models import LmConfig

    defaults = EvalLmConfig()
    changed = {}
    if config.model == defaults.model and isinstance(record.get("model"), dict):
        changed["model"] = draccus.decode(LmConfig, record["model"])
    if config.data.tokenizer == defaults.data.tokenizer and isinstance(record.get("tokenizer"), str):
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=record["tokenizer"]))
    if changed:
        config = dataclasses.replace(config, **changed)
    return config


def _names_validation_data(data) -> bool:
    """Whether ``data`` names any validation files (a single source's ``validation_urls`` or a dataset id; a
    mixture, which only a config file gives, is judged when its caches are built)."""
    from levanter.data.config import UrlSingleDatasetLMConfig

    if isinstance(data, UrlSingleDatasetLMConfig):
        return bool(data.validation_urls) or data.id is not None
    return True


def main(config: EvalLmConfig, *, model_from_checkpoint: bool = False) -> dict:
    """Evaluate; returns ``{metric: value}`` (the ``eval/...`` metrics). ``model_from_checkpoint``: a command
    line without ``--config_path``, whose model and tokenizer come from the checkpoint's metadata."""
    import jax

    from levanter.training import check_eval_set_sizes, make_evaluator
    from levanter.progress import open_debug_log
    from levanter.run import eval_trainer, load_checkpoint_model, load_hf_model
    from levanter.tracker import check_trackers_writable
    from levanter.utils import fs

    tcfg = config.trainer
    tcfg.distributed.initialize()
    tcfg.apply_jax_config()
    config, path, meta = _checkpoint_to_evaluate(config, model_from_checkpoint)
    tcfg.validate()
    config.data.eval_tags()
    tokenizer = config.data.the_tokenizer()
    # A run that started from a Hugging Face checkpoint (initialize_from_hf) has that checkpoint's shape.
    config = with_hf_model(config)
    # One id for the debug log and the metrics (a generated one differs at every call).
    run_id = f"{tcfg.run_id()}-eval"
    opened_debug_log = None
    if jax.process_index() == 0:
        # A log directory that cannot be written fails here, naming trainer.log_dir, not after the evaluation.
        check_trackers_writable(tcfg.trackers(), run_id, tcfg.log_dir)
        # the console shows levanter's INFO; the debug log of the run <id>-eval keeps every record, third parties' too
        opened_debug_log = open_debug_log(fs.join(tcfg.log_dir, run_id))
    tcfg.use_compilation_cache()  # before the model and its evaluation compile; by default beside the checkpoints
    config.data.build_caches("validation")
    sets = config.data.validation_sets(config.model.seq_len)
    if not sets:
        raise ValueError("data has no validation_urls: there is nothing to evaluate on; list the validation files "
                         "in data.validation_urls (or a source's validation_urls)")
    check_eval_set_sizes(sets, tcfg, config.model.seq_len)
    trainer = eval_trainer(tcfg)
    # An fp8 run's checkpoint holds its layers' fp8 state, a lora_lm run's its adapters (each recorded with its
    # settings): the model is built with them, and evaluated through them (levanter.run.eval_model).
    if path is not None:
        loaded = load_checkpoint_model(config, trainer, path, meta or read_checkpoint_metadata(path), tokenizer,
                                       tokenizer_name="the data tokenizer")
    else:
        loaded = load_hf_model(config.hf_checkpoint, tokenizer, key="hf_checkpoint",
                               tokenizer_name="the data tokenizer")
    evaluator = make_evaluator(trainer, config.data, sets, tokenizer, loaded.vocab_size, config.model.Pos)
    result = evaluator.evaluate(loaded.model)
    metrics = result.metrics()
    _report(tcfg, run_id, loaded, result, metrics, opened_debug_log)
    return metrics


def _checkpoint_to_evaluate(config: EvalLmConfig, model_from_checkpoint: bool):
    """``(config, path, meta)``: the complete checkpoint ``checkpoint_path`` names (None for ``hf_checkpoint``)
    and, where the model and tokenizer come from it (``model_from_checkpoint``), its metadata, read once, and
    the config with them. Refuses no model or two, and a command line that names no validation data."""
    if (config.checkpoint_path is None) == (config.hf_checkpoint is None):
        raise ValueError(
            "eval_lm needs exactly one model to evaluate: --checkpoint_path (a step-N checkpoint directory "
            "or a run's checkpoint directory) or --hf_checkpoint (a Hugging Face checkpoint)"
            + (", not both" if config.checkpoint_path is not None else "")
        )
    from levanter.checkpoint import resolve_checkpoint

    path, meta = None, None
    if config.checkpoint_path is not None:
        path = resolve_checkpoint(config.checkpoint_path, "checkpoint_path")
        if model_from_checkpoint:
            meta = read_checkpoint_metadata(path)
            config = from_checkpoint_record(config, meta.get("metadata") or {})
    if model_from_checkpoint and not _names_validation_data(config.data):
        # Before the accelerator is required and the (default) tokenizer loaded: that is what the user lacks.
        origin = (" (the model and tokenizer come from the checkpoint's metadata.json; the data does not)"
                  if path is not None else "")
        raise ValueError(
            "eval_lm has no validation data to evaluate on: data.validation_urls is empty and no --config_path was "
            f"given{origin}. Give the run's config with --config_path (e.g. --config_path config/gpt2_nano.yaml, "
            "whose validation sources are evaluated), or name the files with --data.validation_urls"
        )
    return config, path, meta


def _report(tcfg, run_id: str, loaded, result, metrics: dict, opened_debug_log) -> None:
    """The table of ``result`` on stdout, its ``metrics`` to the trackers under ``run_id`` at the checkpoint's step, and where
    they went (on the first process; the others log to nothing)."""
    import jax

    from levanter.training import format_table
    from levanter.progress import DEBUG_LOG_NAME
    from levanter.tracker import NoopTracker, init_trackers, metrics_destinations
    from levanter.utils import fs

    step = loaded.step
    if jax.process_index() == 0:
        print(f"{loaded.where} (step {step})")
        print(format_table(result), flush=True)
        tracker = init_trackers(tcfg.trackers(), run_id, tcfg.log_dir)
    else:
        tracker = NoopTracker()
    try:
        tracker.log(metrics, step=step)
    finally:
        tracker.finish()
    if jax.process_index() == 0:
        lines = metrics_destinations(tcfg.trackers(), run_id, tcfg.log_dir)
        debug_log = fs.join(tcfg.log_dir, run_id, DEBUG_LOG_NAME)
        if opened_debug_log:
            lines.append(f"debug log: {debug_log}")
        print(f"metrics of run {run_id} at step {step}:" + "".join(f"\n  {line}" for line in lines), flush=True)


@levanter.config.main
def cli_main(config: EvalLmConfig):
    return main(config)


def cli(argv=None) -> None:
    """The command-line entry point: bad input prints one ``error:`` paragraph and exits with status 2, a
    failed evaluation (unreadable data, a coordinator that never answered, a tracker that failed) with 1,
    as ``train_lm`` does (:func:`levanter.run.cli_errors`); no traceback."""
    from levanter.run import cli_errors

    from levanter.config import split_config_path

    argv = sys.argv[1:] if argv is None else list(argv)
    with cli_errors(interrupted="interrupted: nothing was evaluated or logged"):
        if "--help" in argv or "-h" in argv or split_config_path(argv)[0] is not None:
            cli_main(argv=argv)
        else:  # no config: the model and tokenizer the checkpoint records
            _cli_main_bare(argv=argv)


@levanter.config.main
def _cli_main_bare(config: EvalLmConfig):
    return main(config, model_from_checkpoint=True)


if __name__ == "__main__":
    from levanter.progress import setup_console_logging

    setup_console_logging()  # levanter's INFO on the console; every record in the run's debug log
    cli()
