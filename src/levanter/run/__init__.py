"""A language-model training run from a :class:`~levanter.lm_config.TrainLmConfig`: what ``python -m
levanter.main.train_lm``, ``python -m levanter.main.sft`` (which maps upstream's fine-tuning config onto a
``TrainLmConfig``) and ``python -m levanter.main.lora_lm`` (a :class:`LoraRun`) run, so that no entry point
imports another; and what the evaluation entry points share with them (the model a checkpoint records, the
command line).

``main(config)`` is a plain function (tests call it directly). It validates the whole config before any
expensive work, builds (or finds) the token caches, initialises or restores the state, and hands the
loader's batches (tagged with their step) to :meth:`levanter.training.Trainer.train`, which checks the
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
memory exceeds the device's (:mod:`levanter.memory.fit`, where the device's memory is known; that
compile is the run's step), log directories it cannot
write, training data too short for ``trainer.num_train_steps`` and validation sets smaller than one eval
batch; at run time, the state after a step whose loss, gradient norm or update is not finite is never
saved or evaluated, and data that still ends early is an error (exit 1), not a short run that exits 0.

Per step it logs ``train/loss`` (for a mixture of experts, with the weighted router loss, which is also
logged alone as ``train/router_aux_loss``), ``train/learning_rate``, ``train/grad_norm``,
``throughput/tokens_per_second``, ``throughput/step_seconds``, ``throughput/mfu`` (when the device's peak
FLOP/s is known), ``data/wait_seconds``, at a process's first step ``throughput/time_to_first_step_seconds``
(from the process's start: imports, caches, compiles or loads from the persistent compilation cache
(:mod:`levanter.utils.compile_cache`), the step itself) and, for mixtures, ``data/source_counts/<source>``; every
``steps_per_eval`` steps, before the first step of each mixture stage and at the end, for the validation
sources (:mod:`levanter.training.eval`): ``eval/<source>/loss`` and ``eval/<source>/bpb`` (bits per byte), the
micro averages ``eval/loss`` and ``eval/bpb``, the macro averages ``eval/macro_loss`` and
``eval/macro_bpb``, and per tag ``eval/<tag>/loss`` and ``eval/<tag>/bpb`` (plus ``macro_loss`` and
``macro_bpb`` for a tag on several sources). With ``trainer.model_averaging`` the averaged weights are
evaluated too, right after, under ``eval/ema/...`` (upstream's names), and ``hf_save_path`` exports them.

With ``eval_harness`` (:mod:`levanter.eval_harness`, the ``eval`` extra) the lm-evaluation-harness tasks run every
``eval_harness_steps`` steps, before the first step of each mixture stage and at the end: ``lm_eval/<task>/<metric>``
to the trackers, the report as JSON in the run's log directory; their tasks load before any other work.

With ``epoch: N`` a single source's training data repeats up to N times (the same order each time); a run
that needs more is refused with the other data-length checks, before the first step.

The run is built in phases, a module each, in the order :func:`main` runs them:

- :mod:`~levanter.run.train`: :func:`main` -- the checks that need no data, the run lock, the resume point --
  then the phases below and the step loop; :func:`say_finished`.
- :mod:`~levanter.run.data`: the caches, the training and validation sets, the checks of their lengths.
- :mod:`~levanter.run.state`: the trainer (its step compiled ahead of time and fitted to the device's memory)
  and the state it starts from: restored, a branch's start, a Hugging Face checkpoint's weights, or fresh.
- :mod:`~levanter.run.tracking`, :mod:`~levanter.run.exports`, :mod:`~levanter.run.hooks`: the trackers, the
  exports beside the checkpoints, the metrics and evaluations around each step.
- :mod:`~levanter.run.records`: what the checkpoints record of the run, and the checks of a resume against it.
- :mod:`~levanter.run.lora`: :class:`LoraRun`, a LoRA run's part in each phase.
- :mod:`~levanter.run.eval_model`: a checkpoint's model rebuilt from its record for ``eval_lm`` and
  ``eval_harness``.
- :mod:`~levanter.run.cli`: :func:`cli_errors`, the entry points' mapping of failures to exit statuses (see
  ``docs/reference/errors.md``), and their shared command line.

The facade is lazy: an entry point that only evaluates, or only needs :func:`cli_errors`, imports the
modules it uses and not the whole run builder.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    ("cli", "data", "eval_model", "exports", "hooks", "lora", "records", "state", "tracking", "train"),
    lazy=True,
)
