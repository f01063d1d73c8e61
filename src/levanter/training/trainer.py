"""The trainer: the state, one compiled train step, and the step loop.

The loop is where the fork's promise is enforced: the data loader is a component handed to the trainer,
it yields batches tagged with their step, and the trainer refuses (loudly) a batch whose step differs
from the number of updates its state has made. Resume is a pure function of the step: the state comes
from the latest complete checkpoint and the loader restarts at ``state.step``. An entry point calls
``Trainer.train(state, batches, to_named=..., checkpointer=..., hooks=...)`` and does its logging and
evaluation in the :class:`TrainHooks`; the loop itself owns the checks, checkpoints and exit paths. It
reads each step's metrics after dispatching the next step, so that the device never waits on the host's
per-step work (see :meth:`Trainer.train` for where it does not, and why nothing observable changes).

Gradient accumulation (``per_device_parallelism``) splits the step's batch into microbatches *inside*
the compiled step; it never changes which indices a step reads. The loss is a token-weighted mean over
the whole step (sum of per-token losses / number of loss tokens), so accumulation changes only float
reduction order.

What is not the loop lives elsewhere: the config in :mod:`levanter.training.config`, where a run starts
from in :mod:`levanter.checkpoint.resume`, the loss in :mod:`levanter.training.loss`, the memory checks in
:mod:`levanter.memory_plan` and :mod:`levanter.memory_fit`.

An optimizer that takes extra arguments (``optax.GradientTransformationExtraArgs``) gets two: ``loss``, the
step's mean loss, and ``obj_fn``, ``params -> mean loss`` of the step's first microbatch (Sophia-H
differentiates it twice for its Hessian estimate); a transformation that does not read one never traces it,
so Adam's compiled step is the same with or without them.

The train step is compiled once per distinct batch size of the schedule; a compile-count guard raises
if it ever recompiles for any other reason.

Each step also reports its update's global norm against the parameters' (:attr:`StepReport.update_ratio`):
an update too small to change float32 parameters means a run that trains nothing, and one larger than the
parameters a learning rate that throws them out of range, which a later non-finite loss's error names.
:class:`StepTally` counts what a run's steps did (skipped as non-finite or as spikes, updates that vanished)
for its end-of-run summary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, Dict, Optional, Tuple

import equinox as eqx
import haliax as hax
import haliax.quantization as hq
import jax
import jax.numpy as jnp
import jmp
import optax

from ..data.loader import Batch
from ..distributed import read_process_sum, start_process_sum
from ..optim.skip_steps import spike_skipped
from .dispatch import FlatStep, init_compile_options
from .config import TrainerConfig
from ..utils.fault import fault_point

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: checkpointed after SIGTERM or SIGINT; relaunch to resume
INTERRUPTED_AGAIN_EXIT_CODE = 130  # 128 + SIGINT: a second Ctrl-C, nothing more saved

class TrainerState(eqx.Module):
    """Everything a checkpoint holds: ``step`` updates done, the model, the optimizer state, a key and, with
    ``trainer.model_averaging``, the averaged copy of the weights (``averaged_model``: the model's float
    arrays that train, None elsewhere; None without averaging, so such a state and its checkpoints have no
    such leaves)."""

    step: jax.Array
    model: Any
    opt_state: Any
    training_key: jax.Array
    averaged_model: Any = None

    @property
    def eval_model(self) -> Any:
        """The weights evaluation and the Hugging Face exports see: the averaged copy, with the model's other
        leaves, when there is one (upstream's ``eval_model``); else the trained model."""
        if self.averaged_model is None:
            return self.model
        return eqx.combine(self.averaged_model, self.model)  # the averaged weights where there are some


class StepMismatchError(RuntimeError):
    """The loader handed the trainer a batch for a step other than the state's."""


def _loss_parts(out) -> tuple:
    """``(sum, count, extra metric sums)`` of a loss function's result, with or without the metrics."""
    if len(out) == 3:
        return out
    total, count = out
    return total, count, {}


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
        self._step_fns: Dict[int, Callable] = {}
        self._stop_requested = False
        self._stop_signal = "SIGTERM"

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
        opt_state = self.optimizer.init(_optimized(params))
        return TrainerState(jnp.zeros((), jnp.int32), model, opt_state, key, self._average_start(params))

    def _average_start(self, params: Any) -> Any:
        if self.config.model_averaging is None:
            return None
        # A copy, not the same arrays: the step donates both the model and the average.
        return jax.tree.map(jnp.copy, params)

    def restart_average(self, state: TrainerState) -> TrainerState:
        """``state`` with its average (if averaging is on) restarted at its current weights: a branch
        (``trainer.initialize_from``, ``initialize_from_hf``) averages from the weights it starts from."""
        if self.config.model_averaging is None:
            return state
        params = self.trained(state.model)
        return dataclasses.replace(state, averaged_model=self._average_start(params))

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
    def _microbatches(self, batch_size: int) -> int:
        micro = self.config.microbatch_size
        if micro is None:
            return 1
        return batch_size // (micro * self.config.data_axis_size)

    def _make_step(self, batch_size: int) -> Callable:
        n_micro = self._microbatches(batch_size)
        loss_fn, mp, optimizer = self.loss_fn, self.mp, self.optimizer
        averaging = self.config.model_averaging
        batch_axis = self.config.batch_axis
        compute_mapping = self.compute_mapping
        skips_non_finite = not (self.config.crash_on_nan and self.config.crash_on_inf)

        def sum_loss(params, static, micro):
            model = mp.cast_to_compute(eqx.combine(params, static))
            total, count, extra = _loss_parts(loss_fn(model, micro))
            return total.astype(jnp.float32), (count, extra)

        grad_fn = eqx.filter_value_and_grad(sum_loss, has_aux=True)

        def step(state: TrainerState, batch):
            params, static = self.split_trained(state.model)
            if n_micro == 1:
                (total, (count, extra)), grads = grad_fn(params, static, batch)
                hessian_batch = batch
            else:
                # Microbatch m takes rows m, m + n_micro, ...: each device keeps contributing its own rows.
                def split(x):
                    if isinstance(x, hax.NamedArray):
                        Batch = x.resolve_axis(batch_axis)
                        Micro = hax.Axis("microbatch", n_micro)
                        y = x.unflatten_axis(Batch, (Batch.resize(Batch.size // n_micro), Micro))
                        return y
                    return x

                stacked = jax.tree.map(split, batch, is_leaf=lambda x: isinstance(x, hax.NamedArray))

                def body(carry, m):
                    acc_total, acc_count, acc_extra, acc_grads, acc_ow = carry
                    micro = jax.tree.map(
                        lambda x: hax.shard(x["microbatch", m], compute_mapping)
                        if isinstance(x, hax.NamedArray)
                        else x,
                        stacked,
                        is_leaf=lambda x: isinstance(x, hax.NamedArray),
                    )
                    (t, (c, e)), g = grad_fn(params, static, micro)
                    # fp8's new scales and histories are values, not gradients. Every microbatch computes them
                    # from the same state: the scales alike, the histories alike but for their newest entry,
                    # this microbatch's absolute maximum. Their elementwise maximum is what the whole batch in
                    # one pass would give.
                    ow, g = hq.partition_for_grad_overwrite(g)
                    return (acc_total + t, acc_count + c, jax.tree.map(jnp.add, acc_extra, e),
                            jax.tree.map(jnp.add, acc_grads, g), jax.tree.map(jnp.maximum, acc_ow, ow)), None

                overwrites0, optimized0 = hq.partition_for_grad_overwrite(params)
                overwrites0 = jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), overwrites0)
                zeros = jax.tree.map(jnp.zeros_like, optimized0)
                first = jax.tree.map(lambda x: x["microbatch", 0] if isinstance(x, hax.NamedArray) else x, stacked,
                                     is_leaf=lambda x: isinstance(x, hax.NamedArray))
                hessian_batch = first
                # The extra metrics' structure (traced, not run) for the accumulator's zeros.
                extra_zeros = jax.tree.map(
                    lambda s: jnp.zeros(s.shape, jnp.float32),
                    jax.eval_shape(lambda p, b: sum_loss(p, static, b)[1][1], params, first),
                )
                (total, count, extra, grads, overwrites), _ = jax.lax.scan(
                    body,
                    (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), extra_zeros, zeros, overwrites0),
                    jnp.arange(n_micro),
                )
            if n_micro == 1:
                overwrites, grads = hq.partition_for_grad_overwrite(grads)
            denom = jnp.maximum(count, 1.0)
            grads = jax.tree.map(lambda g: g / denom, grads)
            grad_norm = optax.tree.norm(grads)
            # For optimizers that take extra arguments: the step's mean loss (optimizer.skip_bad_steps) and the
            # objective itself, params -> mean loss of one microbatch, for those that differentiate it again
            # (Sophia-H's Hessian-vector products). A transformation that does not read obj_fn never traces it.
            held = hq.partition_for_grad_overwrite(params)[0]  # fp8's state, which the optimizer does not see

            def objective(p):
                t, (c, _) = sum_loss(eqx.combine(p, held), static, hessian_batch)
                return t / jnp.maximum(c, 1.0)

            opt_args = (
                {"loss": total / denom, "obj_fn": objective}
                if isinstance(optimizer, optax.GradientTransformationExtraArgs)
                else {}
            )
            updates, opt_state = optimizer.update(grads, state.opt_state, _optimized(params), **opt_args)
            spike = spike_skipped(opt_state)  # skipped as an outlier (optimizer.skip_bad_steps); applies zero
            # The update's size against the parameters' (two global norms, fused into reads the step makes
            # anyway): an update far below float32's resolution of the parameters changes nothing, and one
            # many times their norm is a learning rate out of range (StepReport.update_ratio).
            update_norm = optax.tree.norm(updates)
            param_norm = optax.tree.norm(_optimized(params))
            # fp8's scales and histories take the values the backward pass computed for them (none without fp8).
            new_params = hq.apply_updates(params, updates, overwrites)
            # A finite loss and gradient can still give a non-finite update (a zero epsilon's 0/0, a learning
            # rate beyond float32's range): the new parameters and optimizer state are checked too, so that
            # no non-finite value is ever applied or checkpointed. One read of the state the step writes
            # anyway, a small share of the step (docs/performance.md).
            new_floats = [x for x in jax.tree.leaves((new_params, opt_state)) if eqx.is_inexact_array(x)]
            update_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in new_floats]))
            # The state after a non-finite loss, gradient or update is never evaluated or saved: where the config
            # skips such steps (crash_on_nan or crash_on_inf false) the old state is kept, else the host stops
            # the run when it reads the step's metrics. Every leaf keeps its dtype: with bfloat16 parameters
            # (mp: bfloat16) the float32 updates would otherwise promote the parameters and moments to float32
            # after the first step, and the step would compile again.
            finite = jnp.isfinite(total) & jnp.isfinite(grad_norm) & update_finite
            if skips_non_finite:
                keep = lambda new, old: jnp.where(finite, new, old).astype(old.dtype)  # noqa: E731
            else:
                # A run that stops at every non-finite step (crash_on_nan and crash_on_inf, the default) never
                # evaluates or saves the state after one, nor keeps anything computed from it: the host raises
                # when it reads the step's metrics, before any of that. Keeping the old state there would cost
                # a select over every parameter and moment (a read of both states and a write, each step).
                keep = lambda new, old: new.astype(old.dtype)  # noqa: E731
            new_params = jax.tree.map(keep, new_params, params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
            model = eqx.combine(new_params, static)
            averaged = state.averaged_model
            if averaging is not None:
                # After the step's update, from the parameters as kept: a step whose update was not applied
                # (non-finite) leaves the average as it was too.
                averaged = jax.tree.map(keep, averaging.update(averaged, new_params), averaged)
            new_state = TrainerState(state.step + 1, model, opt_state, state.training_key, averaged)
            metrics = {"loss": total / denom, "loss_tokens": count, "grad_norm": grad_norm,
                       "update_finite": update_finite, "skipped": jnp.logical_not(finite) | spike,
                       "update_norm": update_norm, "param_norm": param_norm,
                       "extra": {k: v.astype(jnp.float32) / denom for k, v in extra.items()}}
            return new_state, metrics

        named = hax.named_jit(
            step, axis_resources=self.compute_mapping, out_axis_resources=self.param_mapping, donate_args=(True, False)
        )
        return FlatStep(step, named, self.param_mapping)

    def train_step(self, state: TrainerState, batch, batch_size: int):
        fn = self._step_fns.get(batch_size)
        if fn is None:
            fn = self._step_fns[batch_size] = self._make_step(batch_size)
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
        check's compile (:mod:`levanter.memory_fit`) is then the run's, not one more. Arguments it was not
        compiled for go to the jit as before."""
        fn = self._step_fns.get(batch_size)
        if fn is None:
            fn = self._step_fns[batch_size] = self._make_step(batch_size)
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.compute_mapping):
            fn.adopt(state, batch, compiled)

    def compile_count(self) -> int:
        """Compiled executables of the train step so far (one per distinct batch size is expected)."""
        total = 0
        for fn in self._step_fns.values():
            size = getattr(fn, "_cache_size", None)
            total += size() if callable(size) else 1
        return total

    # -- the step loop -------------------------------------------------------------------------------
    def train(
        self,
        state: TrainerState,
        batches: Iterable[Batch],
        *,
        to_named: Callable[[Any], Any],
        checkpointer,
        hooks: Optional["TrainHooks"] = None,
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
        signal on any process stops every process at the same step, agreed by :class:`_StopAgreement`,
        and each exits once the checkpoint is committed); batches that end
        before ``num_train_steps`` checkpoint the last state and raise :class:`DataEndedError` (a short
        run must not exit 0).

        Metrics are read one step late. Reading a step's loss waits for the step to finish, and the host
        work before the next step (the next batch, ``to_named``, the hooks, the logging) would leave the
        device idle for as long as it takes. So step N+1 is dispatched first and step N's metrics are read
        (and checked, and reported) while it runs. The report is the same, only later; a non-finite step
        N still stops the run naming step N, and the state after it is never saved (step N+1's result is
        dropped with it). ``StepReport.seconds`` is the time between the reads of consecutive steps'
        metrics, i.e. between their completions as the host sees them.

        The state after step N cannot be read once step N+1 is dispatched (the step donates its input
        buffers), so where anything needs it the loop finishes step N first: an evaluation step, a save
        (``checkpointer.save_due(step, force=...)`` is asked before dispatching; a checkpointer without
        it counts as saving after every step), the last step, and a stop requested by a signal.
        """
        hooks = hooks if hooks is not None else TrainHooks()
        num_steps = self.config.num_train_steps
        previous_handler = self.install_sigterm_handler()
        seen_sizes: set[int] = set()
        save_due = getattr(checkpointer, "save_due", None)
        # Multi-process: a signal reaches each process at its own moment, but all must stop at the same step
        # (the save and the exit are collective), so the stop is agreed one step ahead (_StopAgreement).
        agree_stop = _StopAgreement() if jax.process_count() > 1 else None
        stopping = False
        t_prev = time.perf_counter()
        last_applied: Optional[Tuple[int, float]] = None  # (step, update ratio) of the last step applied

        def report(step: int, batch: Batch, metrics) -> None:
            """Read step ``step``'s metrics (waiting for it to finish), check them, tell the hooks."""
            nonlocal t_prev, last_applied
            host = jax.device_get(metrics)  # the step's scalars, fetched together
            loss = float(host["loss"])
            grad_norm = float(host["grad_norm"])
            update_finite = bool(host["update_finite"])
            check_finite(loss, step, self.config, grad_norm=grad_norm, update_finite=update_finite,
                         previous=last_applied)
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            extra = {k: float(v) for k, v in host["extra"].items()}
            non_finite = not (math.isfinite(loss) and math.isfinite(grad_norm) and update_finite)
            r = StepReport(step, batch, loss, grad_norm, bool(host["skipped"]), dt, extra,
                           update_norm=float(host["update_norm"]), param_norm=float(host["param_norm"]),
                           non_finite=non_finite)
            if not r.skipped:
                last_applied = (step, r.update_ratio)
            hooks.on_step(r)

        def needs_state(done: int) -> bool:
            """Whether the state after ``done`` updates is needed (so the step must finish before the next)."""
            nonlocal stopping
            force = done == num_steps
            # The checkpointer is asked first and at every step: in a multi-process job its time-based
            # answer is a broadcast that every process must join, whatever else this process knows; so is
            # the stop agreement.
            saving = save_due is None or save_due(done, force=force)
            stopping = self.stop_requested if agree_stop is None else agree_stop(done, self.stop_requested)
            return saving or force or stopping or hooks.is_eval_step(done)

        pending = None  # (step, batch, metrics): dispatched, its report not made yet (its state is gone)
        try:
            start_step = int(state.step)
            if start_step > 0 and hooks.is_eval_step(start_step):
                # The earlier attempt's eval at this step was dropped with its other records of steps >= start.
                self._evaluate(hooks, state, start_step)
                t_prev = time.perf_counter()
            step = start_step  # updates dispatched; counted here, since reading state.step would wait
            for batch in batches:
                check_step(batch, step)
                seen_sizes.add(batch.batch_size)
                state, metrics = self.train_step(state, to_named(batch.data), batch.batch_size)
                if pending is not None:  # the previous step's report, now that this one is queued
                    previous, pending = pending, None
                    report(*previous)
                    fault_point("train_after_step")
                if self.compile_count() > len(seen_sizes):
                    raise RuntimeError(
                        f"the train step recompiled at step {step} ({self.compile_count()} compiles for "
                        f"{len(seen_sizes)} batch sizes): an input changed shape or type unexpectedly"
                    )
                done = step + 1
                pending = (step, batch, metrics)
                step = done
                if not needs_state(done):
                    continue  # reported after the next step is dispatched
                previous, pending = pending, None
                report(*previous)
                if hooks.is_eval_step(done):
                    self._evaluate(hooks, state, done)
                    t_prev = time.perf_counter()  # the evaluation is not the next step's time
                checkpointer.on_step(state, done, force=done == num_steps)
                fault_point("train_after_step")
                if stopping and done < num_steps:
                    checkpointer.on_step(state, done, force=True)
                    checkpointer.wait_until_finished()
                    hooks.on_preempt()
                    logger.warning(
                        "%s: checkpointed step %d in %s; exiting with status %d. Rerun the same command to resume.",
                        self._stop_signal, done, getattr(checkpointer, "base_path", "the checkpoint directory"),
                        PREEMPTED_EXIT_CODE,
                    )
                    sys.exit(PREEMPTED_EXIT_CODE)
            if pending is not None:  # the batches ended after a step that needed no state
                previous, pending = pending, None
                report(*previous)
                fault_point("train_after_step")
            checkpointer.wait_until_finished()
            final_step = int(state.step)
            if final_step < num_steps:
                # Runs check up front that their data covers every step, which makes this rare; a run that
                # ends short of what the config asks must not exit 0, or every rerun "succeeds" again at the
                # same step.
                checkpointer.on_step(state, final_step, force=True)
                checkpointer.wait_until_finished()
                raise DataEndedError(
                    f"the training data ended at step {final_step} of trainer.num_train_steps="
                    f"{num_steps}: the loader had no batch for step {final_step} (the state after "
                    f"step {final_step - 1} was checkpointed). Add training data or lower "
                    "trainer.num_train_steps, then rerun."
                )
            return state
        except Exception:
            # A failure after a step was dispatched but before its report (unreadable data for the next
            # step, a failed background write) reports that step first, as a loop without the lag would
            # have: its metrics are logged, and a non-finite step is the error raised.
            try:
                if pending is not None:
                    previous, pending = pending, None
                    report(*previous)
            finally:
                # A run that fails (a non-finite loss, unreadable data) still commits the checkpoint whose
                # background write is in flight: the last good state is there to resume from. A failed
                # write is logged, not raised, so that the run's own error is the one reported.
                try:
                    checkpointer.wait_until_finished()
                except Exception as e:  # noqa: BLE001
                    logger.error("the checkpoint being written when the run failed was not saved: %s", e)
            raise
        finally:
            self.restore_signal_handlers(previous_handler)

    @staticmethod
    def _evaluate(hooks: "TrainHooks", state: TrainerState, step: int) -> None:
        hooks.evaluate(state.model, step)
        if state.averaged_model is not None:
            hooks.evaluate_averaged(state.eval_model, step)

    # -- signals -------------------------------------------------------------------------------------
    def install_sigterm_handler(self):
        """Make SIGTERM and SIGINT (Ctrl-C) request a checkpoint after the current step and an exit with
        :data:`PREEMPTED_EXIT_CODE`; a second SIGINT exits at once with status 130 (128 + SIGINT), saving
        nothing more. Returns the previous handlers (for :meth:`restore_signal_handlers`), or None off the
        main thread, where signals cannot be handled."""

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self._stop_requested and signum == signal.SIGINT:
                print(f"{name} again: exiting at once, without a checkpoint of the current step",
                      file=sys.stderr, flush=True)
                os._exit(INTERRUPTED_AGAIN_EXIT_CODE)
            self._stop_requested = True
            self._stop_signal = name
            hint = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
            logger.warning("%s received: will checkpoint after the current step and exit%s", name, hint)

        previous = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. some test runners)
            self.restore_signal_handlers(previous)
            return None
        return previous

    @staticmethod
    def restore_signal_handlers(previous) -> None:
        for sig, h in (previous or {}).items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested


def _optimized(params: Any) -> Any:
    """The parameters the optimizer updates: all but the state that the backward pass overwrites (fp8's
    scales and amax histories, haliax's ``OverwriteWithGradient``), which gets no moments, decay or clipping."""
    return hq.partition_for_grad_overwrite(params)[1]


def named_batch(data, Pos: hax.Axis, batch_axis: str = "batch") -> dict:
    """The loader's ``{column: [batch, position] array}`` as named arrays, the form a loss takes."""

    def name(x):
        return hax.named(x, (hax.Axis(batch_axis, x.shape[0]), Pos))

    return {k: name(v) for k, v in data.items()}


class DataEndedError(RuntimeError):
    """The training data ran out before ``trainer.num_train_steps``: the run did not do what was asked."""


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One step as the loop saw it: the batch trained on, its (global) loss and gradient norm, whether
    the update was skipped (non-finite and allowed to go on), and the seconds since the previous step's
    report (between the two steps' completions as the host sees them; an evaluation between them is not
    counted)."""

    step: int
    batch: Batch
    loss: float
    grad_norm: float
    skipped: bool
    seconds: float
    # The loss function's extra metrics (e.g. a mixture of experts' router_aux_loss), means over the step.
    extra: Dict[str, float] = dataclasses.field(default_factory=dict)
    # Global L2 norms of the step's update (what the optimizer returned, zero for a spike it skipped) and of
    # the parameters it applies to, before the step.
    update_norm: float = math.nan
    param_norm: float = math.nan
    # Whether the loss, gradient norm or update was not finite (the step was skipped for that, not as a spike).
    non_finite: bool = False

    @property
    def update_ratio(self) -> float:
        """The update's norm over the parameters' (inf for an update of parameters that are all zero)."""
        if self.param_norm > 0:
            return self.update_norm / self.param_norm
        return 0.0 if self.update_norm == 0 else math.inf

    @property
    def update_vanished(self) -> bool:
        """Whether the update was applied but too small to change float32 parameters (see
        :data:`VANISHING_UPDATE_RATIO`)."""
        return not self.skipped and self.update_ratio < VANISHING_UPDATE_RATIO


# An update below this fraction of the parameters' norm changes (almost) none of them: float32 rounds
# x + u back to x when |u| is under half a unit in the last place, 2^-24 (6e-8) of |x|. A sane step moves
# the parameters by 1e-5 to 1e-2 of their norm.
VANISHING_UPDATE_RATIO = 1e-9


class StepTally:
    """What a run's steps did, counted from their :class:`StepReport`s, for the end-of-run summary: a run
    that skipped steps says how many, and one that trained nothing says so (:meth:`failure`) rather than end
    like one that trained."""

    def __init__(self) -> None:
        self.steps = 0
        # skipped because the loss, gradient or update was not finite (trainer.crash_on_nan / crash_on_inf false)
        self.non_finite = 0
        self.spikes = 0  # skipped as spikes (optimizer.skip_bad_steps)
        # applied steps whose update was too small to change the parameters (StepReport.update_vanished)
        self.vanished = 0
        self.streak = 0  # non-finite steps in a row, up to the last step seen
        self.streak_start: Optional[int] = None
        self._last_applied: Optional[Tuple[int, float]] = None  # (step, update ratio)
        self.before_streak: Optional[Tuple[int, float]] = None  # the last applied step before the streak

    def add(self, r: StepReport) -> None:
        self.steps += 1
        if r.non_finite:
            self.non_finite += 1
            if self.streak == 0:
                self.streak_start, self.before_streak = r.step, self._last_applied
            self.streak += 1
            return
        self.streak = 0
        if r.skipped:
            self.spikes += 1
            return
        self._last_applied = (r.step, r.update_ratio)
        if r.update_vanished:
            self.vanished += 1

    def warnings(self) -> list:
        """Lines for the run summary (none for a run whose steps all applied an update that counted)."""
        out = []
        if self.non_finite:
            tail = f", the last {self.streak} in a row (from step {self.streak_start})" if self.streak > 1 else ""
            out.append(f"{self.non_finite} of {self.steps} steps were skipped: their loss, gradient or update was "
                       f"not finite (trainer.crash_on_nan / crash_on_inf: false){tail}")
        if self.spikes:
            out.append(f"{self.spikes} of {self.steps} steps were skipped as spikes (optimizer.skip_bad_steps)")
        if self.steps and self.vanished == self.steps:
            out.append(f"the parameters did not change: the update of every step ({self.steps}) was below "
                       f"{VANISHING_UPDATE_RATIO:g} of their norm (a learning rate of 0 at every step?)")
        return out

    def failure(self) -> Optional[str]:
        """The error of a run that did not train: at least half its steps skipped as non-finite (every one of
        them after a learning rate that threw the weights out of range, typically); None otherwise. A rare
        bad batch skipped is what ``crash_on_nan: false`` is for, and only counts in :meth:`warnings`."""
        if not self.non_finite or 2 * self.non_finite < self.steps:
            return None
        cause = "lower optimizer.learning_rate or check the data"
        if self.before_streak is not None and self.before_streak[1] >= DIVERGED_UPDATE_RATIO:
            p, ratio = self.before_streak
            cause = (f"step {p}'s update was {_times(ratio)} the parameters' norm, so optimizer.learning_rate is "
                     f"far too large: lower it and {_start_again(p)}")
        return (f"{self.non_finite} of the run's {self.steps} steps were skipped because their loss, gradient or "
                f"update was not finite (trainer.crash_on_nan / crash_on_inf: false); the run did not train. "
                f"The last series of skipped steps began at step {self.streak_start}: {cause}.")


class TrainHooks:
    """What a run does around :meth:`Trainer.train`'s steps (logging, evaluation); no-ops by default."""

    def on_step(self, report: StepReport) -> None:
        """After each step's checks, before its evaluation and checkpoint; usually while the next step
        runs (:meth:`Trainer.train` reads metrics one step late)."""

    def is_eval_step(self, step: int) -> bool:
        """Whether to evaluate the model after ``step`` updates."""
        return False

    def evaluate(self, model, step: int) -> None:
        """Evaluate ``model`` as it stands after ``step`` updates."""

    def evaluate_averaged(self, model, step: int) -> None:
        """With ``trainer.model_averaging``: evaluate the averaged weights after ``step`` updates (called
        right after :meth:`evaluate` of the trained ones)."""

    def on_preempt(self) -> None:
        """Before the process exits on SIGTERM (the state is already checkpointed)."""


AVERAGED_LEAVES = "averaged_model"  # where a checkpoint holds the averaged copy (TrainerState.averaged_model)


def check_resume_averaging(point, config: TrainerConfig) -> None:
    """Refuse to resume from ``point`` (a :class:`levanter.checkpoint.ResumePoint`) when it and
    ``trainer.model_averaging`` disagree on whether there is an averaged copy of the weights. Starting an
    average at a resumed step would make the run's average differ from an uninterrupted run's (resume is
    a pure function of the step), and dropping a saved one would lose it unasked; a branch
    (``trainer.initialize_from``) is the way to add or drop averaging from a checkpoint on."""
    if point is None:
        return
    holds = point.holds(AVERAGED_LEAVES)
    wanted = config.model_averaging is not None
    if wanted and not holds:
        raise ValueError(
            f"trainer.model_averaging is set but the checkpoint {point.path} (step {point.step}) holds no averaged "
            "copy of the weights (the run that wrote it kept none): starting the average at that step would not "
            "be the average of an uninterrupted run. Remove trainer.model_averaging to resume as the run was, or "
            f"start a new run (another trainer.id) with trainer.initialize_from: {point.path}, whose average "
            "starts from those weights."
        )
    if holds and not wanted:
        raise ValueError(
            f"the checkpoint {point.path} (step {point.step}) holds an averaged copy of the weights "
            "(trainer.model_averaging was set in the run that wrote it) but trainer.model_averaging is not set: "
            "set it as that run did to resume, or start a new run (another trainer.id) with "
            f"trainer.initialize_from: {point.path} to go on without the average."
        )


def check_step(batch: Batch, state_step: int) -> None:
    if batch.step != state_step:
        raise StepMismatchError(
            f"the data loader yielded the batch of step {batch.step} but the trainer is at step {state_step}: "
            "data and updates are out of step"
        )


def check_finite(
    loss: float, step: int, config: TrainerConfig, *, grad_norm: float = 0.0, update_finite: bool = True,
    previous: Optional[Tuple[int, float]] = None,
) -> None:
    """Stop on a NaN / infinite loss, gradient norm or update (the state after that step is never saved or
    evaluated), unless configured to skip such steps (then their update is not applied). A
    non-finite update after a finite loss and gradient (a zero epsilon, a learning rate beyond float32's
    range) counts as NaN: it is almost always 0/0 or inf - inf.

    The message says which value was not finite first, in the order the step computes them (the loss, the
    gradient from it, the update from that), and the likely key: ``previous`` is ``(step, update ratio)`` of
    the last step applied before this one (:attr:`StepReport.update_ratio`); an update larger than the
    parameters themselves there means the learning rate threw the weights out of range, which skipping
    later steps cannot undo."""
    stopped = "training stopped and the state after this step was not saved"
    if math.isfinite(loss) and not math.isfinite(grad_norm):
        what = "NaN" if math.isnan(grad_norm) else "infinite"
        flag = "crash_on_nan" if math.isnan(grad_norm) else "crash_on_inf"
        if getattr(config, flag):
            raise FloatingPointError(
                f"train/grad_norm is {what} at step {step} (the loss was finite); {stopped}. The gradient was the "
                f"first value not finite. {_likely_cause(previous, flag)}"
            )
        logger.warning("train/grad_norm is %s at step %d: the update was skipped", grad_norm, step)
        return
    if math.isfinite(loss) and not update_finite:
        if config.crash_on_nan:
            raise FloatingPointError(
                f"the update at step {step} is not finite (loss and gradient norm were finite: train/grad_norm "
                f"{grad_norm:.3g}); {stopped}. Check optimizer.learning_rate and optimizer.epsilon, or set "
                "trainer.crash_on_nan: false to skip such steps instead."
            )
        logger.warning("the update at step %d is not finite: it was skipped", step)
        return
    for bad, flag, what in ((math.isnan(loss), "crash_on_nan", "NaN"), (math.isinf(loss), "crash_on_inf", "infinite")):
        if bad and getattr(config, flag):
            raise FloatingPointError(
                f"train/loss is {what} at step {step}; {stopped}. The loss was the first value not finite "
                f"(train/grad_norm {grad_norm:.3g}). {_likely_cause(previous, flag)}"
            )
    if not math.isfinite(loss):
        logger.warning("train/loss is %s at step %d: the update was skipped", loss, step)


DIVERGED_UPDATE_RATIO = 1.0  # an update larger than the parameters it changes: the weights were thrown away


def _times(ratio: float) -> str:
    """An update's ratio to the parameters' norm, in words (its norm overflows float32 past ~1e19 a value)."""
    return f"{ratio:.1e} times" if math.isfinite(ratio) else "too large for float32 to measure against"


def _start_again(p: int) -> str:
    """Where a run whose update at step ``p`` threw the weights away starts again: the checkpoints after it
    (``step-{p+1}`` on) hold those weights."""
    if p == 0:
        return "start again under a new trainer.id (or delete the run's checkpoints)"
    return f"start again from checkpoint step-{p} or earlier (trainer.initialize_from) under a new trainer.id"


def _likely_cause(previous: Optional[Tuple[int, float]], flag: str) -> str:
    """The sentence after a non-finite value's message: what probably caused it, and the fix."""
    if previous is not None and previous[1] >= DIVERGED_UPDATE_RATIO:
        p, ratio = previous
        return (f"Step {p}'s update was {_times(ratio)} the parameters' norm: optimizer.learning_rate is far too "
                f"large (or the gradient needs optimizer.max_grad_norm). Lower it and {_start_again(p)}; "
                f"trainer.{flag}: false would skip every later step too, as each starts from the same weights.")
    last = "" if previous is None else f" (step {previous[0]}'s update was {previous[1]:.1e} of the parameters' norm)"
    return (f"If it is a rare bad batch, set trainer.{flag}: false to skip such steps instead{last}; if it recurs, "
            "lower optimizer.learning_rate.")


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "DataEndedError",
    "StepMismatchError",
    "StepReport",
    "StepTally",
    "TrainHooks",
    "VANISHING_UPDATE_RATIO",
    "Trainer",
    "TrainerState",
    "AVERAGED_LEAVES",
    "check_resume_averaging",
    "check_finite",
    "check_step",
    "named_batch",
]



class _StopAgreement:
    """Multi-process: whether any process has been asked to stop, the same answer on every process for the
    same step. The answer for step ``s`` is a sum over processes dispatched at step ``s - 1`` (behind the step
    queued then, finished by the time it is read), as the checkpointer's time-based decision is: reading it
    never waits for the step dispatched since. A stop requested on any process therefore takes effect on all
    of them at the next step boundary but one."""

    def __init__(self):
        self._ahead: tuple[int, Any] | None = None

    def __call__(self, step: int, requested: bool) -> bool:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            stop = read_process_sum(ahead[1]) > 0
        else:  # the first step of the loop: agreed at once
            stop = read_process_sum(start_process_sum(int(requested))) > 0
        self._ahead = (step + 1, start_process_sum(int(requested)))
        return stop
