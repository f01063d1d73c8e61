"""Train a causal language model: ``python -m levanter.main.train_lm --config_path config/gpt2_nano.yaml``.

``main(config)`` (:mod:`levanter.lm_run`, re-exported here) is a plain function (tests call it directly).
It validates the whole config before any expensive work, builds (or finds) the token caches, initialises or restores the state, and hands the
loader's batches (tagged with their step) to :meth:`levanter.trainer.Trainer.train`, which checks the
tags and checkpoints; the hooks given to it log the metrics and evaluate. Re-running the same command
with the same ``trainer.id`` resumes from the latest complete checkpoint and reproduces the same data and
losses; re-running a run that already reached ``trainer.num_train_steps`` says so and exits 0. A run
without ``trainer.id`` prints the id it generated, with the command that resumes it. A run whose checkpoint
directory is not the one that wrote the metrics in its log directory (another run that used the id) is
refused before any work (:mod:`levanter.tracker.lineage`), and so are ``hf_save_path`` exports that would
replace anything but earlier exports (:mod:`levanter.compat.export_guard`).

What it prints (:mod:`levanter.progress`, docs/guides/trackers.md): a bar on a terminal, else a line
every ``trainer.progress_interval``; every evaluation's losses and an end-of-run summary on stdout; the
details in ``<trainer.log_dir>/<run id>/debug.log``. Ctrl-C (SIGINT) or SIGTERM checkpoints the current
step and exits with status 75; a second Ctrl-C exits at once with 130.

A run either does what its config asks or fails: besides the values themselves, it refuses up front a
model whose training state cannot fit in memory (estimated from shapes), a train step whose compiled
memory exceeds the device's (:mod:`levanter.memory_fit`, where the device's memory is known; that
compile is the run's step), log directories it cannot
write, training data too short for ``trainer.num_train_steps`` and validation sets smaller than one eval
batch; at run time, a step whose loss, gradient norm or update is not finite is never applied, and data
that still ends early is an error (exit 1), not a short run that exits 0.

Per step it logs ``train/loss`` (for a mixture of experts, with the weighted router loss, which is also
logged alone as ``train/router_aux_loss``), ``train/learning_rate``, ``train/grad_norm``,
``throughput/tokens_per_second``, ``throughput/step_seconds``, ``throughput/mfu`` (when the device's peak
FLOP/s is known), ``data/wait_seconds`` and, for mixtures, ``data/source_counts/<source>``; every
``steps_per_eval`` steps, before the first step of each mixture stage and at the end, for the validation
sources (:mod:`levanter.eval`): ``eval/<source>/loss`` and ``eval/<source>/bpb`` (bits per byte), the
micro averages ``eval/loss`` and ``eval/bpb``, the macro averages ``eval/macro_loss`` and
``eval/macro_bpb``, and per tag ``eval/<tag>/loss`` and ``eval/<tag>/bpb`` (plus ``macro_loss`` and
``macro_bpb`` for a tag on several sources). With ``trainer.model_averaging`` the averaged weights are
evaluated too, right after, under ``eval/ema/...`` (upstream's names), and ``hf_save_path`` exports them.

With ``epoch: N`` a single source's training data repeats up to N times (the same order each time); a run
that needs more is refused with the other data-length checks, before the first step.
"""

from __future__ import annotations

__all__ = [
    "check_data_covers_run",
    "check_data_schedule",
    "make_evaluator",
    "main",
    "say_finished",
    "cli_main",
    "dry_run",
    "cli",
    "SEED_LIMIT",
    "TrainLmConfig",
    "data_key",
    "validate",
]

if __name__ == "__main__":
    # Before the heavy imports, so that re-executing costs only an interpreter start-up.
    from levanter.utils.malloc import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
import logging
import os
import sys
from typing import Optional

import levanter.config
from levanter.lm_config import SEED_LIMIT, TrainLmConfig, data_key, validate
from levanter.lm_loss import lm_loss_fn
from levanter.lm_run import check_data_covers_run, check_data_schedule, cli_errors, main, make_evaluator, say_finished
from levanter.memory_plan import FLAG_HELP, format_plan, make_plan, split_plan_args
from levanter.progress import setup_console_logging

logger = logging.getLogger(__name__)


@levanter.config.main
def cli_main(config: TrainLmConfig):
    return main(config)


def dry_run(config: TrainLmConfig, options, config_path: Optional[str] = None) -> None:
    """Print the memory plan of ``config`` (:mod:`levanter.memory_plan`): nothing is trained or read."""
    config.trainer.distributed.initialize()
    config.trainer.apply_jax_config()
    loss = lm_loss_fn(config.z_loss_weight, quantization=config.trainer.quantization)
    print(format_plan(make_plan(config, loss, options), config_path))


def cli(argv=None) -> None:
    """The command-line entry point: user errors (bad config values, missing or damaged files) print one
    paragraph and exit with status 2; run failures (see below) print one paragraph and exit with status 1.
    Neither prints a traceback. ``docs/reference/errors.md`` lists the cases. ``--dry_run`` prints the
    memory plan instead of training (:data:`levanter.memory_plan.FLAG_HELP`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:  # the config's keys, then the memory-plan flags
        levanter.config.print_help(sys.modules[__name__])
        print(FLAG_HELP)
        sys.exit(0)
    with cli_errors():
        plan, argv = split_plan_args(argv)
        if plan is not None:
            path, rest = levanter.config.split_config_path(argv)
            dry_run(levanter.config.parse_config(TrainLmConfig, path, rest), plan, path)
            return
        cli_main(argv=argv)

if __name__ == "__main__":
    setup_console_logging()
    if os.environ.get("LEVANTER_MALLOC_REEXEC") == "1":
        logger.debug("re-executed with GLIBC_TUNABLES=%s (levanter/utils/malloc.py; LEVANTER_MALLOC_HUGETLB=0 "
                    "turns this off)", os.environ.get("GLIBC_TUNABLES"))
    cli()
