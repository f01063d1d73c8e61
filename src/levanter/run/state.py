"""The state phase of a run: the trainer, its step compiled ahead of time and fitted to the device's memory,
and the state the first step starts from.

That state is one of four, decided before any of them is built: restored from the run's own checkpoint
(a resume); a branch's start from another run's checkpoint (``trainer.initialize_from``,
``initialize_from_checkpoint_path``); a Hugging Face checkpoint's weights (``initialize_from_hf``, beneath a
LoRA run's adapters); or freshly initialised. All four begin as the same freshly built state, so that the
structure a checkpoint is restored into (fp8 state, adapters, the averaged copy) is the one a fresh run
would save.
"""

from __future__ import annotations

__all__ = ["fit_run_trainer", "start_state"]

import logging
from typing import Callable, Optional

import equinox as eqx
import haliax as hax
import jax

from levanter.checkpoint import ResumePoint, initialize_from, read_checkpoint_metadata, restore
from levanter.lm_config import BranchOrigin, TrainLmConfig, hf_init_path
from levanter.training import lm_loss_fn
from levanter.lora import join_adapters, lora_trainable, split_adapters
from levanter.memory import RECORD_KEY, StepCompiler, fit_trainer, recorded_pick
from levanter.quantization import with_fp8
from levanter.run.lora import LoraRun
from levanter.training import Trainer, TrainerState

logger = logging.getLogger(__name__)


def fit_run_trainer(config: TrainLmConfig, vocab_size: int, eos_id: Optional[int], point: Optional[ResumePoint],
                    lora: Optional[LoraRun]) -> tuple[Trainer, dict]:
    """The run's trainer and what its checkpoints record of it: the step for the largest batch, compiled ahead
    of time and checked against the device's memory (it is the run's step then), ``per_device_parallelism:
    auto`` resolved (as ``point``, the checkpoint resumed from, recorded it) (:mod:`levanter.memory.fit`).
    ``eos_id``: the loader ships tokens alone (:class:`levanter.run.data.RunData`)."""
    tcfg = config.trainer
    optimizer = config.optimizer.build(tcfg.num_train_steps)
    # A LoRA run: the adapters, which alone train.
    compiler = StepCompiler(config.model, tcfg, optimizer,
                            lm_loss_fn(config.z_loss_weight, eos_id, tcfg.quantization), vocab_size,
                            adapt=lora.adapt if lora is not None else None,
                            is_trainable=lora_trainable if lora is not None else None)
    trainer = fit_trainer(compiler, recorded=recorded_pick(tcfg, point))
    picked = {RECORD_KEY: trainer.config.per_device_parallelism} if tcfg.per_device_parallelism == "auto" else {}
    return trainer, picked


def start_state(config: TrainLmConfig, trainer: Trainer, vocab: hax.Axis, model_key: jax.Array,
                point: Optional[ResumePoint], branch: Optional[BranchOrigin], fresh_model: Optional[Callable],
                lora: Optional[LoraRun]) -> tuple[TrainerState, Optional[dict]]:
    """``(state, origin)``: the state the run's first step starts from -- restored from ``point``, else a branch's
    start from ``branch``, else the ``initialize_from_hf`` checkpoint's weights, else fresh, and then (at step 0
    only) rewritten by ``fresh_model(model, key)`` -- and what its checkpoints record of where it started
    (``initialized_from``; None for a fresh start)."""
    tcfg = config.trainer

    # trainer.quantization.fp8: the layers' scales and histories are part of the model from the start.
    def build(k):
        model = with_fp8(config.model.build(vocab, key=k), tcfg.quantization)
        return lora.adapt(model, k) if lora is not None else model

    state = trainer.initial_state(build, key=jax.random.fold_in(model_key, 0))
    state = restore(state, point)
    if point is not None:
        return state, point.records.get("initialized_from")
    # A branch (trainer.initialize_from / initialize_from_checkpoint_path) starts from another run's checkpoint
    # at step 0, once: rerun, it resumes from its own checkpoints, which carry the record of its origin. Its
    # data schedule is its own, so the origin's is not checked against it.
    origin = None
    if branch is not None:
        state = initialize_from(state, branch.path, optimizer_state=branch.optimizer_state, key=branch.key)
        origin = {"path": branch.path, "step": int(read_checkpoint_metadata(branch.path)["step"]),
                  "optimizer_state": branch.optimizer_state}
    elif hf_init_path(config) is not None:  # weights from a Hugging Face checkpoint; the optimizer's are fresh
        state = eqx.tree_at(lambda s: s.model, state, _hf_weights(state.model, hf_init_path(config), lora))
        logger.info("loaded the weights of Hugging Face checkpoint %s (the optimizer starts fresh)",
                    hf_init_path(config))
        origin = {"hf_checkpoint": hf_init_path(config)}
    if fresh_model is not None:
        state = eqx.tree_at(lambda s: s.model, state, fresh_model(state.model, jax.random.fold_in(model_key, 1)))
    if origin is not None:  # trainer.model_averaging: averaged from the weights the branch starts from
        state = trainer.restart_average(state)
    return state, origin


def _hf_weights(model, path: str, lora: Optional[LoraRun]):
    """``model`` with the weights of the Hugging Face checkpoint ``path``; a LoRA run's adapters, which are new,
    stay as built, the checkpoint's tensors going beneath them."""
    from levanter.compat import load_hf_weights

    if lora is None:
        return load_hf_weights(model, path)
    adapters, base = split_adapters(model)
    return join_adapters(load_hf_weights(base, path), adapters)
