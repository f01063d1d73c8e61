"""What a run's checkpoints record about it, and the checks of a resume against those records.

A checkpoint's ``metadata.json`` carries, beside the step, what the state in it was built with: the model
block and vocabulary (so ``export_lm_to_hf`` and ``eval_lm`` need nothing but the checkpoint), the fp8 and
LoRA settings, ``optimizer.skip_bad_steps``'s window, the data schedule and when the run evaluated. A
resumed run compares its config with them before any work (:func:`check_resume`,
:func:`check_data_schedule`) and refuses a disagreement by naming the key, where a restore would otherwise
fail with a list of missing arrays or, worse, succeed and train on other data than the checkpointed model saw.
"""

from __future__ import annotations

__all__ = [
    "check_data_schedule",
    "check_resume",
    "check_resume_optimizer",
    "eval_record",
    "evaluated_at",
    "model_record",
    "optimizer_record",
]

import logging
from typing import Dict, Optional

from levanter.checkpoint import ResumePoint
from levanter.data.dataset import AsyncDataset
from levanter.data.schedule_record import first_difference
from levanter.lm_config import TrainLmConfig
from levanter.lora import LoraConfig, check_checkpoint_lora
from levanter.quantization import check_checkpoint_fp8
from levanter.training import TrainerConfig, check_resume_averaging

logger = logging.getLogger(__name__)


def model_record(config: TrainLmConfig, vocab_size: int, lora=None) -> dict:
    """What a checkpoint records about its model, so that ``export_lm_to_hf`` needs nothing but the checkpoint:
    the model block (with its ``type``), the vocabulary size, ``data.tokenizer``, for an fp8 run the settings
    its layers' fp8 state was built with, and for a LoRA run (``lora``, a :class:`levanter.lora.LoraConfig`)
    the settings of its adapters."""
    import draccus

    from levanter.lora import lora_record
    from levanter.quantization import fp8_record

    name = config.model.get_choice_name(type(config.model))
    return {"model": {"type": name, **draccus.encode(config.model)}, "vocab_size": int(vocab_size),
            "tokenizer": config.data.tokenizer, **fp8_record(config.trainer.quantization), **lora_record(lora)}


def optimizer_record(config: TrainLmConfig) -> dict:
    """What a checkpoint records about its optimizer state: ``optimizer.skip_bad_steps``'s window, which the
    state holds (:func:`levanter.optim.skip_record`)."""
    from levanter.optim import skip_record

    return skip_record(config.optimizer.skip_bad_steps)


def check_resume_optimizer(config: TrainLmConfig, point) -> None:
    """Before any work: refuse to resume from ``point`` (a :class:`levanter.checkpoint.ResumePoint`) whose
    optimizer state was written with another ``optimizer.skip_bad_steps`` (on, off, or another window),
    naming the key and the fix, rather than fail the restore with a list of missing arrays."""
    from levanter.optim import WINDOW_LEAF, check_checkpoint_skip_bad_steps

    if point is not None:
        check_checkpoint_skip_bad_steps(point.records, point.holds(WINDOW_LEAF), config.optimizer.skip_bad_steps,
                                        point.path, point.step)


def check_resume(config: TrainLmConfig, point: Optional[ResumePoint], lora: Optional[LoraConfig]) -> None:
    """Before any work: the checkpoint the run resumes from (``point``; None: a fresh start) was written with
    this run's ``trainer.model_averaging``, ``trainer.quantization``'s fp8 state, LoRA adapters (``lora``)
    and ``optimizer.skip_bad_steps``."""
    tcfg = config.trainer
    check_resume_averaging(point, tcfg)  # trainer.model_averaging as the checkpoint was written
    if point is not None:  # and trainer.quantization's fp8 state, and the LoRA adapters
        where = f"the checkpoint {point.path} (step {point.step})"
        check_checkpoint_fp8(point.records, tcfg.quantization, where)
        check_checkpoint_lora(point.records, lora, where)
    check_resume_optimizer(config, point)  # optimizer.skip_bad_steps as the checkpoint was written


def check_data_schedule(point: ResumePoint, record: dict, *, allow: bool) -> None:
    """Refuse to resume from ``point`` if the data schedule changed before its step (unless ``allow``)."""
    checkpoint_path, start_step = point.path, point.step
    old = point.records.get("data_schedule")
    if old is None:
        logger.warning("checkpoint %s records no data schedule; cannot check the resumed data", checkpoint_path)
        return
    diff = first_difference(old, record)
    if diff is None:
        return
    step, what = diff
    if step < start_step and not allow:
        raise ValueError(
            f"the data schedule changed at step {step} ({what}), before the checkpoint at step {start_step} "
            f"({checkpoint_path}): the resumed run would disagree with the data the checkpointed model was trained "
            "on. Undo the edit, start a new run (another trainer.id), or set allow_data_schedule_change: true "
            "if you mean it."
        )
    logger.warning("data schedule edited from step %d: %s (checkpoint at step %d)", step, what, start_step)


def eval_record(tcfg: TrainerConfig, eval_sets: Dict[str, AsyncDataset]) -> dict:
    """What a checkpoint records of when its run evaluated (every ``steps_per_eval`` steps, at
    ``num_train_steps`` and at the mixture's stage starts, which the data schedule records): a resumed run
    redoes the eval of the step it resumes at where the run that wrote it evaluated there."""
    if not eval_sets:
        return {}
    return {"evals": {"steps_per_eval": tcfg.steps_per_eval, "num_train_steps": tcfg.num_train_steps}}


def evaluated_at(point: ResumePoint, step: int, stage_starts) -> bool:
    """Whether the run that wrote ``point`` evaluated the state after ``step`` updates (from its record; a
    checkpoint without one says nothing, and its run's evals at this step are redone only where this run
    evaluates anyway)."""
    evals = point.records.get("evals")
    if not isinstance(evals, dict):
        return False
    every, last = evals.get("steps_per_eval"), evals.get("num_train_steps")
    return step == last or step in stage_starts or (isinstance(every, int) and every > 0 and step % every == 0)
