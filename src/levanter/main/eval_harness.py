"""Run lm-evaluation-harness tasks on a checkpoint: ``python -m levanter.main.eval_harness --config_path
run.yaml --checkpoint_path checkpoints/<run id>`` (a levanter checkpoint), or ``--initialize_from_hf DIR_OR_ID``
(a Hugging Face checkpoint; upstream's spelling, ``checkpoint_path`` with ``checkpoint_is_hf: true``, works too).

The config is a training config (:class:`levanter.lm_config.TrainLmConfig`: the YAML a run was trained with
evaluates its checkpoints as it is, its ``eval_harness:`` section naming the tasks) plus ``checkpoint_path``,
``checkpoint_is_hf`` and ``apply_chat_template`` (upstream's ``EvalHarnessMainConfig`` keys). Tasks are
names the harness knows, tasks in ``eval_harness.include_path`` directories, or the ones shipped with
levanter (``levanter_mc``, ``levanter_ppl``: offline); see docs/guides/evaluation.md.

The tasks are loaded before the model (a task that cannot load is one error, before any other work). The
harness's table is printed; the metrics (``lm_eval/<task>/<metric>``, ``lm_eval/averages/...``) go to the
configured trackers under the run ``<trainer.id>-eval_harness`` at the checkpoint's step (0 for a Hugging Face
checkpoint), and the whole report to ``<trainer.log_dir>/<trainer.id>-eval_harness/
lm_eval_harness_results.<step>.json``. ``main(config)`` returns the report.

The tokenizer is ``tokenizer`` / ``data.tokenizer`` when set; else the one the checkpoint records (levanter),
or the checkpoint directory's own (Hugging Face). Bad input (no tasks, no checkpoint or two, a path
without a complete checkpoint, an unknown task, a task that generates text, a task on the Hub while
offline) prints one ``error:`` paragraph and exits with status 2; a failed evaluation exits with 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Optional

import levanter.config
from levanter.checkpoint import read_checkpoint_metadata
from levanter.lm_config import TrainLmConfig, check_eval_harness, with_hf_model
from levanter.lora import loraize, lora_from_record
from levanter.quantization import fp8_from_record, with_fp8

__all__ = ["EvalHarnessMainConfig", "main", "cli_main", "cli"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalHarnessMainConfig(TrainLmConfig):
    # The checkpoint to evaluate: a step-N directory, or a run's checkpoint directory for its latest one.
    checkpoint_path: Optional[str] = None
    # checkpoint_path is a Hugging Face checkpoint (upstream's key; initialize_from_hf says the same).
    checkpoint_is_hf: bool = False
    # Put each prompt through the tokenizer's chat template (upstream's top-level key; the same as
    # eval_harness.apply_chat_template).
    apply_chat_template: bool = False


def _default_tokenizer(config: TrainLmConfig) -> bool:
    """Whether the config names no tokenizer (``tokenizer`` unset and ``data.tokenizer`` at its default)."""
    default = next(f.default for f in dataclasses.fields(config.data) if f.name == "tokenizer")
    return config.tokenizer is None and config.data.tokenizer == default


def _with_tokenizer(config, tokenizer: str):
    return dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=tokenizer))


def main(config: EvalHarnessMainConfig) -> dict:
    """Evaluate; returns the harness's report (``results``, ``n-samples``, ..., ``averages``)."""
    import haliax as hax
    import jax
    import optax

    from levanter.checkpoint import initialize_from, resolve_checkpoint
    from levanter.eval_harness import HarnessEvaluator, format_report, results_path
    from levanter.progress import open_debug_log
    from levanter.tracker import NoopTracker, check_trackers_writable, init_trackers, metrics_destinations
    from levanter.training import Trainer
    from levanter.utils import fs

    tcfg = config.trainer
    tcfg.distributed.initialize()
    tcfg.apply_jax_config()
    if config.eval_harness is None or not config.eval_harness.task_spec:
        raise ValueError("eval_harness.task_spec names no task: list the tasks to run (e.g. eval_harness: "
                         "{task_spec: [levanter_mc]})")
    if config.checkpoint_is_hf:  # upstream's spelling of initialize_from_hf
        if not config.checkpoint_path:
            raise ValueError("checkpoint_is_hf is set but checkpoint_path is not: name the Hugging Face checkpoint")
        config = dataclasses.replace(config, initialize_from_hf=config.checkpoint_path, checkpoint_path=None,
                                     checkpoint_is_hf=False, use_hf_model_config=True)
    hf_path = config.initialize_from_hf if isinstance(config.initialize_from_hf, str) else None
    if (config.checkpoint_path is None) == (hf_path is None):
        raise ValueError(
            "eval_harness needs exactly one model to evaluate: --checkpoint_path (a step-N checkpoint directory "
            "or a run's checkpoint directory) or --initialize_from_hf (a Hugging Face checkpoint)"
            + (", not both" if config.checkpoint_path is not None else "")
        )
    if config.apply_chat_template and not config.eval_harness.apply_chat_template:
        config = dataclasses.replace(config, eval_harness=dataclasses.replace(config.eval_harness,
                                                                              apply_chat_template=True))
    tcfg.validate()
    harness = HarnessEvaluator(config.eval_harness)  # the tasks, loaded before the model
    path, record = None, {}
    if config.checkpoint_path is not None:
        path = resolve_checkpoint(config.checkpoint_path, "checkpoint_path")
        meta = read_checkpoint_metadata(path)
        record = meta.get("metadata") or {}
        if _default_tokenizer(config) and record.get("tokenizer"):
            config = _with_tokenizer(config, record["tokenizer"])  # the tokenizer the run trained with
    elif _default_tokenizer(config) and not fs.is_url(hf_path) and os.path.isfile(os.path.join(hf_path, "tokenizer.json")):
        config = _with_tokenizer(config, hf_path)  # the checkpoint directory's own tokenizer
    # A Hugging Face checkpoint (or a run that started from one) has that checkpoint's shape.
    config = with_hf_model(config)
    check_eval_harness(config)
    tokenizer = config.data.the_tokenizer()
    length = config.eval_harness.max_eval_length or config.model.seq_len
    run_id = f"{tcfg.run_id()}-eval_harness"
    if jax.process_index() == 0:
        check_trackers_writable(tcfg.trackers(), run_id, tcfg.log_dir)
        open_debug_log(fs.join(tcfg.log_dir, run_id))

    def loss_fn(model, batch):  # never called: the harness computes its own scores
        raise NotImplementedError

    trainer = Trainer(dataclasses.replace(tcfg, model_averaging=None), optax.identity(), loss_fn)
    if path is not None:
        vocab_size = int(record["vocab_size"]) if record.get("vocab_size") else tokenizer.vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"checkpoint_path={path!r} has a vocabulary of {vocab_size}, smaller than the tokenizer's "
                f"({tokenizer.vocab_size}): set data.tokenizer as in the run that wrote it"
            )
        fp8, lora = fp8_from_record(record), lora_from_record(record)

        def build(k):
            model = with_fp8(config.model.build(hax.Axis("vocab", vocab_size), key=k), fp8)
            return model if lora is None else loraize(model, lora, key=k)

        state = trainer.initial_state(build, key=jax.random.PRNGKey(0))
        model = initialize_from(state, path, optimizer_state=False, key="checkpoint_path").model
        step, where = int(meta["step"]), path
    else:
        from levanter.compat.hf_checkpoints import load_hf_checkpoint

        _, model = load_hf_checkpoint(hf_path, config.model)
        if model.Vocab.size < tokenizer.vocab_size:
            raise ValueError(f"initialize_from_hf={hf_path!r} has a vocabulary of {model.Vocab.size}, smaller than "
                             f"the tokenizer's ({tokenizer.vocab_size})")
        step, where = 0, hf_path
    report = harness.evaluate(model, trainer, tokenizer, length=length, batch_size=tcfg.eval_batch_size)
    if jax.process_index() == 0:
        print(f"{where} (step {step})")
        print(format_report(report), flush=True)
        tracker = init_trackers(tcfg.trackers(), run_id, tcfg.log_dir)
        out = results_path(tcfg.log_dir, run_id, step)
    else:
        tracker, out = NoopTracker(), None
    try:
        harness.log(report, tracker, step, out)
    finally:
        tracker.finish()
    if jax.process_index() == 0:
        lines = metrics_destinations(tcfg.trackers(), run_id, tcfg.log_dir) + [f"report: {out}"]
        print(f"lm_eval metrics of run {run_id} at step {step}:" + "".join(f"\n  {line}" for line in lines), flush=True)
    return report


@levanter.config.main
def cli_main(config: EvalHarnessMainConfig):
    return main(config)


def cli(argv=None) -> None:
    """The command-line entry point: bad input prints one ``error:`` paragraph and exits with status 2, a
    failed evaluation with 1 (:func:`levanter.lm_run.cli_errors`); no traceback."""
    from levanter.lm_run import run_config_command

    run_config_command(__name__, cli_main, argv)


if __name__ == "__main__":
    from levanter.lm_run import start_command

    start_command(cli)
