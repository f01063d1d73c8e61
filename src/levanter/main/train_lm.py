"""Train a causal language model: ``python -m levanter.main.train_lm --config_path config/gpt2_nano.yaml``.

``main(config)`` is :func:`levanter.run.main`, re-exported here: a plain function (tests call it
directly) that validates the whole config before any expensive work, builds or finds the token caches,
initialises or restores the state and trains; :mod:`levanter.run`'s docstring says what a run refuses,
prints and logs (every metric's name), and how it resumes. This module adds the command line: ``--help``,
``--dry_run`` (the memory plan, nothing trained) and the mapping of failures to exit statuses.
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
    "HELP_FIRST",
]

# The keys --help (and docs/reference/config.md) list first: what almost every config sets -- the data, the
# model's type and size, the run's length, batch and learning rate, its id and where it writes.
HELP_FIRST = (
    "data.train_urls", "data.validation_urls", "data.cache_dir", "data.tokenizer",
    "model.type", "model.hidden_dim", "model.num_layers", "model.num_heads", "model.seq_len",
    "trainer.num_train_steps", "trainer.train_batch_size", "optimizer.learning_rate", "optimizer.warmup",
    "trainer.steps_per_eval", "trainer.max_eval_batches",
    "trainer.id", "trainer.log_dir", "trainer.checkpointer.base_path", "trainer.tracker.type",
    "initialize_from_hf", "hf_save_path",
)

if __name__ == "__main__":
    # Before the heavy imports, so that re-executing costs only an interpreter start-up.
    from levanter.utils.malloc import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
import logging
import sys
from typing import Optional

import levanter.config
from levanter.lm_config import SEED_LIMIT, TrainLmConfig, data_key, validate
from levanter.training import lm_loss_fn
from levanter.run import check_data_covers_run, check_data_schedule, cli_errors, main, make_evaluator, say_finished
from levanter.run import start_command
from levanter.memory import DOES_NOT_FIT_EXIT_CODE, FLAG_HELP, ModelCannotFitError, format_plan
from levanter.memory import format_slice_plan, make_plan, make_slice_plan, require_libtpu, split_plan_args
from levanter.memory import use_cpu_backend

logger = logging.getLogger(__name__)


@levanter.config.main
def cli_main(config: TrainLmConfig):
    return main(config)


def dry_run(config: TrainLmConfig, options, config_path: Optional[str] = None) -> Optional[bool]:
    """Print the memory plan of ``config`` (:mod:`levanter.memory.plan`): nothing is trained or read. With
    ``--slice``, the plan for that TPU slice, compiled on this machine (:mod:`levanter.memory.slice_plan`).
    Returns whether the step fits the device's memory (None: the memory is unknown)."""
    loss = lm_loss_fn(config.z_loss_weight, quantization=config.trainer.quantization)
    if options.slice is not None:
        config.trainer.apply_jax_config()
        plan = make_slice_plan(config, loss, options)
        print(format_slice_plan(plan, config_path))
        return plan.fits
    config.trainer.distributed.initialize()
    config.trainer.apply_jax_config()
    config.trainer.use_compilation_cache(default=False)  # a dry run writes nothing beside the checkpoints
    plan = make_plan(config, loss, options)
    print(format_plan(plan, config_path))
    return plan.fits


def cli(argv=None) -> None:
    """The command-line entry point: user errors (bad config values, missing or damaged files) print one
    paragraph and exit with status 2; run failures (see below) print one paragraph and exit with status 1.
    Neither prints a traceback. ``docs/reference/errors.md`` lists the cases. ``--dry_run`` prints the
    memory plan instead of training (:data:`levanter.memory.flags.FLAG_HELP`) and exits with
    :data:`~levanter.memory.flags.DOES_NOT_FIT_EXIT_CODE` (3) when the step does not fit the device's memory:
    the plan's verdict, or, for a model or batch that the shapes alone rule out, one ``error:`` paragraph
    before anything is compiled."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:  # the config's keys, then the memory-plan flags
        levanter.config.print_help(sys.modules[__name__])
        print(FLAG_HELP)
        sys.exit(0)
    with cli_errors():
        plan, argv = split_plan_args(argv)
        if plan is not None and plan.slice is not None:
            require_libtpu()
            use_cpu_backend()
        if plan is not None:
            path, rest = levanter.config.split_config_path(argv)
            config = levanter.config.parse_config(TrainLmConfig, path, rest)
            try:
                fits = dry_run(config, plan, path)
            except ModelCannotFitError as e:
                print(f"error: {e}", file=sys.stderr)
                sys.exit(DOES_NOT_FIT_EXIT_CODE)
            if fits is False:
                sys.exit(DOES_NOT_FIT_EXIT_CODE)
            return
        cli_main(argv=argv)

if __name__ == "__main__":
    start_command(cli)
