"""The trainer: the state it starts from, the compiled train step per batch size, and the step loop.

An entry point builds a :class:`Trainer` from the ``trainer:`` section, an optimizer and a loss, asks it for
the initial state, and calls ``Trainer.train(state, batches, to_named=..., checkpointer=..., hooks=...)``;
it does its logging and evaluation in the :class:`TrainHooks`, while the loop (:mod:`.loop`) owns the
checks, checkpoints and exit paths. Resume is a pure function of the step: the state comes from the latest
complete checkpoint and the loader restarts at ``state.step``.

Gradient accumulation (``per_device_parallelism``) splits the step's batch into microbatches *inside*
the compiled step (:mod:`.microbatch`); it never changes which indices a step reads. The loss is a
token-weighted mean over the whole step (sum of per-token losses / number of loss tokens), so accumulation
changes only float reduction order. What the step does is :mod:`.step`; how it is called, :mod:`.dispatch`.

The train step is compiled once per distinct batch size of the schedule; a compile-count guard raises
if it ever recompiles for any other reason.

What is not the loop lives elsewhere: the config in :mod:`levanter.training.config`, where a run starts
from in :mod:`levanter.checkpoint.resume`, the loss in :mod:`levanter.training.loss`, the memory checks in
:mod:`levanter.memory.plan` and :mod:`levanter.memory.fit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Dict, Optional, Tuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import optax

from ..data.loader import Batch
from .config import TrainerConfig
from .dispatch import FlatStep, init_compile_options
from .fp8 import optimized_params
from .loop import Checkpointing, StepLoop, TrainHooks
from .microbatch import num_microbatches
from .signals import StopSignals
from .state import TrainerState, average_start
from .step import train_step_fn


class Trainer:
    """Runs the step loop for a loss ``loss_fn(model, batch) -> (sum_of_losses, num_loss_tokens)``.

    ``batch`` is the loader's pytree converted to named arrays by ``to_named(data)``; the loss must be a
    *sum* (with its token count) so that microbatches combine into the exact step-wide mean. A loss may
    return a third item, a dict of metric sums (e.g. an auxiliary loss times the token count): they are
    summed over microbatches, divided by the step's count and reported in :attr:`StepReport.extra`.

    ``is_trainable(model)``, if given, is an equinox filter spec of the model's leaves that train (a pytree
    prefix of bools or callables): the others stay fixed, get no gradient and no optimizer state, and are
    neither averaged nor checked (they still belong to the model and its checkpoints). Default: every float
    array trains.
    """

    def __init__(
        self,
        config: TrainerConfig,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable[[Any, Any], Tuple[jax.Array, jax.Array]],
        is_trainable: Optional[Callable[[Any], Any]] = None,
    ):
        self.config = config
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.is_trainable = is_trainable
        self.mesh = config.make_mesh()
        self.mp = jmp.get_policy(config.mp)
        self.compute_mapping = config.compute_axis_mapping
        self.param_mapping = config.parameter_axis_mapping
        self._step_fns: Dict[int, FlatStep] = {}
        self.signals = StopSignals()  # SIGTERM / Ctrl-C: checkpoint after the current step and exit

    # -- state ---------------------------------------------------------------------------------------
    def initial_state(self, model_init: Callable[[jax.Array], Any], *, key: jax.Array) -> TrainerState:
        model_key, train_key = jax.random.split(key)

        def init():
            return self.fresh_state(self.mp.cast_to_param(model_init(model_key)), train_key)

        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.param_mapping):
            options = init_compile_options(self.mesh)
            return hax.named_jit(init, axis_resources=self.param_mapping, **options)()

    def fresh_state(self, model: Any, key: jax.Array) -> TrainerState:
        """The state at step 0 around ``model`` (already in the parameter dtype): a fresh optimizer state
        and, with ``trainer.model_averaging``, the average starting at ``model``'s weights. Traceable (the
        initialisation and the memory plan's ``jax.eval_shape`` call it)."""
        params = self.trained(model)
        opt_state = self.optimizer.init(optimized_params(params))
        return TrainerState(jnp.zeros((), jnp.int32), model, opt_state, key,
                            average_start(self.config.model_averaging, params))

    def restart_average(self, state: TrainerState) -> TrainerState:
        """``state`` with its average (if averaging is on) restarted at its current weights: a branch
        (``trainer.initialize_from``, ``initialize_from_hf``) averages from the weights it starts from."""
        if self.config.model_averaging is None:
            return state
        params = self.trained(state.model)
        return dataclasses.replace(state, averaged_model=average_start(self.config.model_averaging, params))

    def split_trained(self, model: Any) -> tuple[Any, Any]:
        """``(trained, rest)``: the model's float arrays that train (see ``is_trainable``), and everything else
        (frozen arrays, integer arrays, structure), each with None in the other's places."""
        floats, rest = eqx.partition(model, eqx.is_inexact_array)
        if self.is_trainable is None:
            return floats, rest
        trained, frozen = eqx.partition(floats, self.is_trainable(model))
        return trained, eqx.combine(frozen, rest)

    def trained(self, model: Any) -> Any:
        """The model's float arrays that train, None elsewhere (see :meth:`split_trained`)."""
        return self.split_trained(model)[0]

    # -- compiled functions --------------------------------------------------------------------------
    def _make_step(self, batch_size: int) -> FlatStep:
        step = train_step_fn(loss_fn=self.loss_fn, optimizer=self.optimizer, mp=self.mp,
                             split_trained=self.split_trained, config=self.config,
                             n_micro=num_microbatches(self.config, batch_size),
                             compute_mapping=self.compute_mapping)
        named = hax.named_jit(step, axis_resources=self.compute_mapping, out_axis_resources=self.param_mapping,
                              donate_args=(True, False))
        return FlatStep(step, named, self.param_mapping)

    def _step_fn(self, batch_size: int) -> FlatStep:
        fn = self._step_fns.get(batch_size)
        if fn is None:
            fn = self._step_fns[batch_size] = self._make_step(batch_size)
        return fn

    def train_step(self, state: TrainerState, batch, batch_size: int):
        fn = self._step_fn(batch_size)
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.compute_mapping):
            return fn(state, batch)

    def lower_train_step(self, state: TrainerState, batch, batch_size: int) -> jax.stages.Lowered:
        """The train step for a batch of ``batch_size``, traced and lowered but not run: ``state`` and
        ``batch`` may be ``jax.ShapeDtypeStruct`` leaves carrying their shardings, so the compiled step's
        memory needs can be read (``.compile().memory_analysis()``) before anything is allocated."""
        fn = self._make_step(batch_size)
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.compute_mapping):
            return fn.lower(state, batch)

    def use_compiled(self, batch_size: int, state: TrainerState, batch, compiled: jax.stages.Compiled) -> None:
        """Run the steps of ``batch_size`` with ``compiled``, this trainer's step compiled ahead of time
        (:meth:`lower_train_step`) for arguments shaped and sharded like ``state`` and ``batch``: the memory
        check's compile (:mod:`levanter.memory.fit`) is then the run's, not one more. Arguments it was not
        compiled for go to the jit as before."""
        fn = self._step_fn(batch_size)
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.compute_mapping):
            fn.adopt(state, batch, compiled)

    def compile_count(self) -> int:
        """Compiled executables of the train step so far (one per distinct batch size is expected)."""
        return sum(fn.compile_count() for fn in self._step_fns.values())

    # -- the step loop -------------------------------------------------------------------------------
    def train(
        self,
        state: TrainerState,
        batches: Iterable[Batch],
        *,
        to_named: Callable[[Any], Any],
        checkpointer: Checkpointing,
        hooks: Optional[TrainHooks] = None,
    ) -> TrainerState:
        """Train from ``state`` on ``batches`` until they end or ``num_train_steps`` is reached; returns the
        final state.

        Each batch's step tag must equal the number of updates made (:func:`check_step`); ``to_named``
        turns its data into the loss's named arrays. After every step, in step order: the compile guard
        (one executable per batch size), the finite check (:func:`check_finite`), ``hooks.on_step``, an
        evaluation where ``hooks.is_eval_step`` says so, and ``checkpointer.on_step(state, step,
        force=...)`` (forced at the last step; a save returns once the state is copied to host memory and
        writes in the background, and a write that failed is raised by the next ``save_due``/``on_step``).
        On SIGTERM or SIGINT (Ctrl-C) the write in flight is waited for, the state after the step in
        flight is checkpointed and the process exits with :data:`PREEMPTED_EXIT_CODE` (multi-process: a
        signal on any process stops every process at the same step, agreed by :class:`StopAgreement`,
        and each exits once the checkpoint is committed); batches that end
        before ``num_train_steps`` checkpoint the last state and raise :class:`DataEndedError` (a short
        run must not exit 0). Metrics are read one step late (:class:`StepLoop` says why and where not).
        """
        previous_handlers = self.signals.install()
        try:
            loop = StepLoop(self, self.config, to_named=to_named, checkpointer=checkpointer,
                            hooks=hooks if hooks is not None else TrainHooks(), signals=self.signals)
            return loop.run(state, batches)
        finally:
            self.signals.restore(previous_handlers)


def named_batch(data, Pos: hax.Axis, batch_axis: str = "batch") -> dict:
    """The loader's ``{column: [batch, position] array}`` as named arrays, the form a loss takes."""

    def name(x):
        return hax.named(x, (hax.Axis(batch_axis, x.shape[0]), Pos))

    return {k: name(v) for k, v in data.items()}


__all__ = ["Trainer", "named_batch"]
