"""The trainer: configuration, mesh and shardings, one compiled train step, and the step loop.

The loop is where the fork's promise is enforced: the data loader is a component handed to the trainer,
it yields batches tagged with their step, and the trainer refuses (loudly) a batch whose step differs
from the number of updates its state has made. Resume is a pure function of the step: the state comes
from the latest complete checkpoint and the loader restarts at ``state.step``. An entry point calls
``Trainer.train(state, batches, to_named=..., checkpointer=..., hooks=...)`` and does its logging and
evaluation in the :class:`TrainHooks`; the loop itself owns the checks, checkpoints and exit paths.

Gradient accumulation (``per_device_parallelism``) splits the step's batch into microbatches *inside*
the compiled step; it never changes which indices a step reads. The loss is a token-weighted mean over
the whole step (sum of per-token losses / number of loss tokens), so accumulation changes only float
reduction order.

The train step is compiled once per distinct batch size of the schedule; a compile-count guard raises
if it ever recompiles for any other reason.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Dict, List, Optional, Tuple, Union

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from jax.sharding import Mesh

from .config import parse_timedelta
from .config_doc import check_refused, refused
from .checkpoint import (
    METADATA_FILENAME,
    CheckpointerConfig,
    CorruptCheckpointError,
    discover_latest_checkpoint,
    load_checkpoint,
    unreadable_checkpoints,
)
from .data.loader import Batch
from .distributed import DistributedConfig
from .schedule import BatchSchedule, ScheduleStep
from .tracker import JsonConfig, TrackerConfig, WandbConfig, init_trackers
from .utils import fs
from .utils.fault import fault_point

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: checkpointed after SIGTERM or SIGINT; relaunch to resume
INTERRUPTED_AGAIN_EXIT_CODE = 130  # 128 + SIGINT: a second Ctrl-C, nothing more saved

# Peak dense bf16 FLOP/s per device, for MFU. Unknown devices (e.g. CPUs) report no MFU.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100": 312e12,
}


def peak_flops_per_device(device) -> Optional[float]:
    kind = getattr(device, "device_kind", "")
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if kind.startswith(name):
            return PEAK_FLOPS[name]
    return None


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Upstream's Ray settings: training here needs no Ray cluster."""

    # Upstream's Ray cluster to connect to; refused if set (data.cache_options.ray_address builds on Ray).
    address: Optional[str] = refused(
        "training uses no Ray cluster; remove the key (data.cache_options.ray_address builds caches on Ray)"
    )
    # Upstream starts Ray workers on each host; training here never does.
    start_workers: bool = refused("training here starts no Ray workers; remove the key", default=True)
    # Upstream starts a local Ray cluster when none is found; training here never does.
    auto_start_cluster: bool = refused("training here starts no Ray cluster; remove the key", default=False)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The training loop: steps and batches, evaluation, checkpoints, trackers, devices and sharding."""

    # Seed of the model's initialisation (and of the data order when data_seed is null), in [0, 2**32).
    seed: int = 0
    # Mixed-precision policy (jmp): f32, bfloat16, or e.g. p=f32,c=bfloat16 (parameters, compute, output).
    mp: str = "f32"
    # Optimizer steps of the run (the learning-rate schedule spans them).
    num_train_steps: int = 400_000
    # Sequences per step: a number, or a schedule [{start: step, value: size}, ...] from step 0.
    train_batch_size: Union[int, List[ScheduleStep]] = 512
    # Sequences per device per microbatch (gradient accumulation); -1: the whole batch at once; auto: the
    # largest that fits the device's memory, found by compiling the step ahead of time (levanter.memory_fit).
    per_device_parallelism: Union[int, str] = -1
    # Sequences per device per evaluation batch; -1: the first training batch size in total.
    per_device_eval_parallelism: int = -1
    # Evaluate every this many steps (and at the end, and at each mixture stage's start).
    steps_per_eval: int = 1000
    # Batches per evaluation of each validation source; null: the whole validation set.
    max_eval_batches: Optional[int] = None
    # Where metrics go: one tracker section (type: json, tensorboard, wandb, noop) or a list of them.
    tracker: Union[TrackerConfig, Tuple[TrackerConfig, ...]] = dataclasses.field(default_factory=JsonConfig)
    # Upstream's older spelling of a wandb tracker (the fields of tracker: {type: wandb, ...}): it replaces
    # the default tracker, or joins the trackers given; refused together with a wandb entry in tracker.
    wandb: Optional[WandbConfig] = None
    # When checkpoints are saved and which are kept.
    checkpointer: CheckpointerConfig = dataclasses.field(default_factory=CheckpointerConfig)
    # null: resume from the run's latest checkpoint if there is one; true: require one; false: start fresh.
    load_checkpoint: Optional[bool] = None
    # Resume from this checkpoint (a step-N directory, or a directory of them) instead of the run's own.
    load_checkpoint_path: Optional[str] = None
    # Another run's checkpoint (a step-N directory, or a run directory for its latest) that starts this run:
    # its weights and optimizer state, at step 0 under this run's data and learning-rate schedules.
    initialize_from: Optional[str] = None
    # The run's id (names its checkpoint and log directories; the same id resumes); null: a generated one.
    id: Optional[str] = None
    # Directory of the trackers' local files (each run in a subdirectory named by its id).
    log_dir: str = "logs/"
    # Wall time between progress lines when the output is not a terminal (e.g. 30s, 5m; 0: every step).
    progress_interval: datetime.timedelta = datetime.timedelta(seconds=30)
    # Name of the batch axis, sharded over the mesh's data axis.
    batch_axis: str = "batch"
    # Parameter axes sharded over the data axis (fully sharded data parallelism); null: replicated.
    fsdp_axis: Optional[Union[str, List[str]]] = "embed"
    # Axes sharded over the mesh's model axis (tensor parallelism), e.g. [mlp, heads].
    tensor_parallel_axes: Optional[List[str]] = None
    # Devices on the model (tensor-parallel) axis; the others form the data axis. Must divide the devices.
    model_axis_size: int = 1
    # Extra axis -> mesh axis mappings for the computation (added to the ones above).
    axis_resources: Dict[str, Union[str, List[str]]] = dataclasses.field(default_factory=dict)
    # Extra axis -> mesh axis mappings for the parameters (added to the ones above).
    parameter_axis_resources: Dict[str, Union[str, List[str]]] = dataclasses.field(default_factory=dict)
    # Refuse to train on CPUs only (set false to train on CPU deliberately).
    require_accelerator: bool = True
    # Stop the run at a NaN loss, gradient norm or update (never applied); false: skip such steps.
    crash_on_nan: bool = True
    # Stop the run at an infinite loss or gradient norm (never applied); false: skip such steps.
    crash_on_inf: bool = True
    # Upstream pads a batch the data-parallel size does not divide; nothing is padded here, so such a batch
    # is refused whatever this says (a divisible one trains either way).
    allow_nondivisible_batch_size: bool = False
    # Multi-process start-up (jax.distributed): coordinator, process count and id.
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    # Upstream's Ray settings (training here starts no Ray).
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    # Write a jax.profiler trace of profiler_num_steps steps from profiler_start_step under
    # <log_dir>/<run id>/profiler (TensorBoard's profile plugin or Perfetto opens it; docs/performance.md).
    profiler: bool = False
    # The first step traced (the first steps compile; the default skips them).
    profiler_start_step: int = 5
    # How many steps the trace covers.
    profiler_num_steps: int = 100
    # Upstream opens the trace in Perfetto through a link it waits on; a run here never waits on a browser.
    profiler_perfetto_link: bool = refused(
        "the run never waits on a browser; open <log_dir>/<run id>/profiler in Perfetto or TensorBoard "
        "(docs/performance.md)", default=False
    )
    # Upstream shuts the machine down when the run ends; never done here.
    shutdown_at_exit: bool = refused("the machine is never shut down by a run; remove the key", default=False)
    # Upstream logs the train step's jaxpr to the tracker; not done here.
    log_jaxprs: bool = refused(
        "jaxprs are not logged; remove the key (XLA_FLAGS=--xla_dump_to=DIR dumps programs)", default=False
    )
    # Upstream logs the train step's compiled HLO to the tracker; not done here.
    log_xla_hlo: bool = refused(
        "HLO is not logged; remove the key (XLA_FLAGS=--xla_dump_to=DIR dumps it)", default=False
    )
    # JAX options set before the run ({option: value}, as jax.config.update takes them).
    jax_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # Directory of JAX's persistent compilation cache (a rerun skips compiles); null: none.
    jax_compilation_cache_dir: Optional[str] = None
    # Upstream's replica axis within a slice (hybrid sharding); refused unless 1.
    replica_ici_axis_size: int = refused("replica axes are not built here; leave it at 1", default=1)
    # Upstream's replica axis across slices (hybrid sharding); refused unless 1.
    replica_dcn_axis_size: int = refused("replica axes are not built here; leave it at 1", default=1)

    # -- derived -------------------------------------------------------------------------------------
    @property
    def batch_schedule(self) -> BatchSchedule:
        return BatchSchedule(self.train_batch_size)

    def run_id(self) -> str:
        return self.id if self.id else _generated_run_id()

    def trackers(self) -> Tuple[TrackerConfig, ...]:
        given = self.tracker if isinstance(self.tracker, tuple) else (self.tracker,)
        if self.wandb is None:
            return given
        return (self.wandb,) if given == (JsonConfig(),) else (*given, self.wandb)

    def validate(self) -> None:
        """Cheap checks that need no devices beyond counting them; errors name the config key."""
        check_refused(self, "trainer")  # upstream keys not built here (config_doc.refused)
        given = self.tracker if isinstance(self.tracker, tuple) else (self.tracker,)
        if self.wandb is not None and any(isinstance(t, WandbConfig) for t in given):
            raise ValueError(
                "trainer.wandb and a wandb entry in trainer.tracker both configure wandb; keep one (trainer.wandb "
                "is upstream's older spelling of trainer.tracker: {type: wandb, ...})"
            )
        check_run_id(self.id)
        if self.num_train_steps < 1:
            raise ValueError(f"trainer.num_train_steps must be >= 1, got {self.num_train_steps}")
        sched = self.batch_schedule  # validates the schedule itself
        if self.steps_per_eval < 1:
            raise ValueError(f"trainer.steps_per_eval must be >= 1, got {self.steps_per_eval}")
        try:
            parse_timedelta(self.progress_interval)
        except ValueError as e:
            raise ValueError(f"trainer.progress_interval: {e}") from None
        if self.max_eval_batches is not None and self.max_eval_batches < 1:
            raise ValueError(
                f"trainer.max_eval_batches must be >= 1, or null for the whole validation set, got "
                f"{self.max_eval_batches} (evaluation would silently do nothing). To evaluate less often, "
                "raise trainer.steps_per_eval; to skip evaluation, remove the validation_urls."
            )
        if not 0 <= self.seed < 2**32:
            raise ValueError(
                f"trainer.seed must be in [0, 2**32 - 1], got {self.seed}: JAX keeps the low 32 bits of a "
                "seed, so a larger or negative one would repeat the initialisation of another"
            )
        if self.model_axis_size < 1 or jax.device_count() % self.model_axis_size:
            raise ValueError(
                f"trainer.model_axis_size={self.model_axis_size} does not divide the {jax.device_count()} devices"
            )
        pdp = self.per_device_parallelism
        if isinstance(pdp, bool) or (isinstance(pdp, str) and pdp != "auto") or not isinstance(pdp, (int, str)):
            raise ValueError(
                f"trainer.per_device_parallelism must be a number of sequences per device, -1 (the whole batch) "
                f"or auto (the largest that fits the device's memory), got {pdp!r}"
            )
        dp = self.data_axis_size
        for seg in sched.segments:
            if seg.value % dp:
                padded = " (allow_nondivisible_batch_size is set, but no batch is padded here)"
                raise ValueError(
                    f"trainer.train_batch_size: batch size {seg.value} (from step {seg.start}) is not divisible by "
                    f"the data-parallel size {dp} ({jax.device_count()} devices / model_axis_size "
                    f"{self.model_axis_size}){padded if self.allow_nondivisible_batch_size else ''}"
                )
            if self.microbatch_size is not None:
                micro = self.microbatch_size * dp
                if seg.value % micro:
                    raise ValueError(
                        f"trainer.per_device_parallelism={self.per_device_parallelism}: the microbatch of {micro} "
                        f"examples does not divide batch size {seg.value} (from step {seg.start})"
                    )
        if self.profiler and (self.profiler_start_step < 0 or self.profiler_num_steps < 1):
            raise ValueError(
                f"trainer.profiler_start_step must be >= 0 and trainer.profiler_num_steps >= 1, got "
                f"{self.profiler_start_step} and {self.profiler_num_steps}"
            )
        try:
            jmp.get_policy(self.mp)
        except (ValueError, KeyError) as e:
            raise ValueError(f"trainer.mp: cannot parse mixed-precision policy {self.mp!r} ({e})") from None
        if self.require_accelerator and jax.default_backend() == "cpu":
            raise ValueError(
                "trainer.require_accelerator is true but JAX found only CPUs; set trainer.require_accelerator: "
                "false to train on CPU"
            )

    def apply_jax_config(self) -> None:
        """Apply ``jax_config`` (``{option: value}``) and the persistent ``jax_compilation_cache_dir``."""
        for name, value in self.jax_config.items():
            try:
                jax.config.update(name, value)
            except (AttributeError, KeyError, ValueError) as e:
                raise ValueError(f"trainer.jax_config: cannot set {name}={value!r} ({e})") from None
        if self.jax_compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", self.jax_compilation_cache_dir)

    @property
    def microbatch_size(self) -> Optional[int]:
        """Sequences per device per microbatch, or None for the whole batch at once (-1, and ``auto`` until
        :mod:`levanter.memory_fit` resolves it to a number)."""
        pdp = self.per_device_parallelism
        return pdp if isinstance(pdp, int) and not isinstance(pdp, bool) and pdp > 0 else None

    @property
    def data_axis_size(self) -> int:
        return jax.device_count() // self.model_axis_size

    @property
    def eval_batch_size(self) -> int:
        """Sequences per evaluation batch: ``per_device_eval_parallelism`` x the data-parallel size, else the
        first training batch size."""
        if self.per_device_eval_parallelism > 0:
            return self.per_device_eval_parallelism * self.data_axis_size
        return self.batch_schedule.batch_size_at_step(0)

    def make_mesh(self) -> Mesh:
        devices = np.asarray(jax.devices()).reshape(self.data_axis_size, self.model_axis_size)
        return Mesh(devices, ("data", "model"))

    @property
    def compute_axis_mapping(self) -> Dict[str, Any]:
        mapping: Dict[str, Any] = {self.batch_axis: "data"}
        for ax in self.tensor_parallel_axes or ():
            mapping[ax] = "model"
        mapping.update(self.axis_resources)
        return mapping

    @property
    def parameter_axis_mapping(self) -> Dict[str, Any]:
        mapping: Dict[str, Any] = {}
        fsdp = [self.fsdp_axis] if isinstance(self.fsdp_axis, str) else list(self.fsdp_axis or [])
        for ax in fsdp:
            mapping[ax] = "data"
        for ax in self.tensor_parallel_axes or ():
            mapping[ax] = "model"
        mapping.update(self.parameter_axis_resources)
        return mapping


def check_run_id(run_id: Optional[str]) -> None:
    """``trainer.id`` names a directory under the checkpoint ``base_path`` and under ``log_dir``: it must be
    one path component, or the run's checkpoints and logs would land outside them (``../../x``)."""
    if run_id is None:
        return
    if not isinstance(run_id, str) or run_id in ("", ".", "..") or any(c in run_id for c in "/\\\0"):
        raise ValueError(
            f"trainer.id={run_id!r} must be a single directory name (no '/', '\\', '.' or '..', not empty): "
            "it names the run's directories under trainer.checkpointer.base_path and trainer.log_dir"
        )


def _generated_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


class TrainerState(eqx.Module):
    """Everything a checkpoint holds: ``step`` updates done, the model, the optimizer state and a key."""

    step: jax.Array
    model: Any
    opt_state: Any
    training_key: jax.Array


class StepMismatchError(RuntimeError):
    """The loader handed the trainer a batch for a step other than the state's."""


def _init_compile_options(mesh) -> dict:
    """Compiler options for the one-off parameter-initialisation program.

    On CPU, XLA's LLVM pipeline spends seconds optimising the random-number code of a small model's init
    (threefry rounds and the normal transform for every parameter), to run it once in milliseconds; at
    backend optimisation level 0 it compiles several times faster (docs/performance.md). The values are
    deterministic either way, but not bit-identical between the two levels (LLVM compiles the float
    code of the normal transform differently), so the level is fixed here for every CPU run.
    Accelerators keep their defaults: their init is not this slow to compile, and large models' init is
    worth optimising.
    """
    if all(d.platform == "cpu" for d in np.asarray(mesh.devices).flat):
        return {"compiler_options": {"xla_backend_optimization_level": 0}}
    return {}


class _FlatStep:
    """The train step called as a ``jax.jit`` over the flat leaves of ``(state, batch)``.

    ``haliax.named_jit`` re-derives, on every call, which leaves are arrays, their shardings and the
    output's shardings: milliseconds of Python per call for a small model's state (docs/performance.md),
    during which the device waits (the loop fetches each step's loss before it dispatches the next).
    Those are fixed for a given structure of ``(state, batch)``, so they are worked out once per
    structure (the output shardings by the same ``infer_resource_partitions`` named_jit uses, from
    ``param_mapping``; inputs keep the shardings they have, as with named_jit) and a call is then a
    pytree flatten plus jax's C++ dispatch. A structure with a leaf that is not a ``jax.Array`` (or
    anything unusual) takes the named_jit path, which handles it.
    """

    def __init__(self, step: Callable, named: Callable, param_mapping):
        self._step = step
        self._named = named
        self._param_mapping = param_mapping
        self._by_structure: Dict[Any, Optional[Tuple[Callable, int, Any]]] = {}

    def __call__(self, state: TrainerState, batch):
        leaves, treedef = jax.tree_util.tree_flatten((state, batch))
        entry = self._by_structure.get(treedef, False)
        if entry is False:
            entry = self._by_structure[treedef] = self._build(state, batch, leaves)
        if entry is None:
            return self._named(state, batch)
        jitted, n_state, out_treedef = entry
        out = jitted(tuple(leaves[:n_state]), tuple(leaves[n_state:]))
        return jax.tree_util.tree_unflatten(out_treedef, out)

    def lower(self, state: TrainerState, batch) -> jax.stages.Lowered:
        """The step lowered for ``(state, batch)`` without running it; the leaves may be abstract
        (``jax.ShapeDtypeStruct`` with shardings), so nothing needs to be allocated."""
        leaves, _ = jax.tree_util.tree_flatten((state, batch))
        entry = self._build(state, batch, leaves, abstract=True)
        if entry is None:
            raise ValueError("the train step's outputs lack shardings: it cannot be lowered ahead of time")
        jitted, n_state, _ = entry
        return jitted.lower(tuple(leaves[:n_state]), tuple(leaves[n_state:]))

    def adopt(self, state: TrainerState, batch, compiled: jax.stages.Compiled) -> None:
        """Call ``compiled`` (this step compiled ahead of time for arguments like ``state`` and ``batch``)
        for arguments of their structure instead of compiling the jit for them."""
        leaves, treedef = jax.tree_util.tree_flatten((state, batch))
        entry = self._build(state, batch, leaves, abstract=True)
        if entry is not None:
            jitted, n_state, out_treedef = entry
            self._by_structure[treedef] = (_Precompiled(compiled, jitted), n_state, out_treedef)

    def _build(self, state, batch, leaves, abstract: bool = False):
        if not abstract and not all(isinstance(x, jax.Array) for x in leaves):
            return None
        n_state = len(jax.tree_util.tree_leaves(state))
        state_def = jax.tree_util.tree_structure(state)
        batch_def = jax.tree_util.tree_structure(batch)
        step = self._step
        traced_out = []

        def flat(state_leaves, batch_leaves):
            out = step(
                jax.tree_util.tree_unflatten(state_def, state_leaves),
                jax.tree_util.tree_unflatten(batch_def, batch_leaves),
            )
            traced_out.append(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out))
            return tuple(jax.tree_util.tree_leaves(out))

        # One trace gives the output's structure and named axes; jax reuses it when `flat` is jitted
        # below with the same arguments.
        jax.eval_shape(flat, tuple(leaves[:n_state]), tuple(leaves[n_state:]))
        out_shape = traced_out[-1]
        out_treedef = jax.tree_util.tree_structure(out_shape)
        shardings = hax.partitioning.infer_resource_partitions(
            out_shape, self._param_mapping, preserve_existing_shardings=False
        )
        is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
        out_shardings = jax.tree_util.tree_leaves(shardings, is_leaf=is_sharding)
        if len(out_shardings) != out_treedef.num_leaves or not all(map(is_sharding, out_shardings)):
            return None
        jitted = jax.jit(flat, out_shardings=tuple(out_shardings), donate_argnums=(0,))
        return jitted, n_state, out_treedef

    def _cache_size(self) -> int:
        """Compiled executables so far (named_jit fallbacks count as one each)."""
        total = 0
        for entry in self._by_structure.values():
            total += 1 if entry is None else entry[0]._cache_size()
        return total


class _Precompiled:
    """An ahead-of-time compiled step standing in for its jit; arguments it was not compiled for (another
    sharding, shape or dtype, which the executable refuses before running) go to the jit."""

    def __init__(self, compiled, jitted):
        self._compiled = compiled
        self._jitted = jitted
        self._ran = False

    def __call__(self, *args):
        if self._compiled is not None:
            try:
                out = self._compiled(*args)
                self._ran = True
                return out
            except (TypeError, ValueError) as e:
                logger.debug("the ahead-of-time compiled step does not take these arguments (%s): jit compiles", e)
                self._compiled = None
        return self._jitted(*args)

    def _cache_size(self) -> int:
        return int(self._ran) + self._jitted._cache_size()


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
    """

    def __init__(
        self,
        config: TrainerConfig,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable[[Any, Any], Tuple[jax.Array, jax.Array]],
    ):
        self.config = config
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.mesh = config.make_mesh()
        self.mp = jmp.get_policy(config.mp)
        self.compute_mapping = config.compute_axis_mapping
        self.param_mapping = config.parameter_axis_mapping
        self._step_fns: Dict[int, Callable] = {}
        self._eval_fn = None
        self._stop_requested = False
        self._stop_signal = "SIGTERM"

    # -- state ---------------------------------------------------------------------------------------
    def initial_state(self, model_init: Callable[[jax.Array], Any], *, key: jax.Array) -> TrainerState:
        model_key, train_key = jax.random.split(key)

        def init():
            model = self.mp.cast_to_param(model_init(model_key))
            opt_state = self.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
            return TrainerState(jnp.zeros((), jnp.int32), model, opt_state, train_key)

        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.param_mapping):
            options = _init_compile_options(self.mesh)
            return hax.named_jit(init, axis_resources=self.param_mapping, **options)()

    def maybe_restore(self, state: TrainerState, run_id: str) -> Tuple[TrainerState, Optional[str]]:
        """``(state, checkpoint path)`` from the latest complete checkpoint of this run (or
        ``load_checkpoint_path``); ``(state, None)`` when starting fresh.

        ``load_checkpoint: false`` starts fresh whatever is on disk. Otherwise a ``load_checkpoint_path``
        that holds no complete checkpoint is an error (a typo must not start a run from step 0), and so
        is a run directory holding checkpoint data that cannot be read: resuming past it would overwrite
        it, and the run's metrics with it.
        """
        cfg = self.config
        if cfg.load_checkpoint is False:
            return state, None
        run_dir = cfg.checkpointer.expanded_path(run_id)
        unreadable = unreadable_checkpoints(run_dir)
        if unreadable:
            raise CorruptCheckpointError(
                f"the run directory {run_dir} holds checkpoints that cannot be read (no {METADATA_FILENAME}): "
                f"{', '.join(unreadable[:4])}{' and more' if len(unreadable) > 4 else ''}. Training on would "
                "start before them and overwrite them and the run's metrics. Restore their metadata.json or move "
                "them away to resume, or set trainer.load_checkpoint: false to start this run from scratch."
            )
        path = cfg.load_checkpoint_path
        if path is None:
            path = discover_latest_checkpoint(run_dir)
        else:
            explicit = path
            if not fs.basename(fs.abspath(path)).startswith("step-"):
                path = discover_latest_checkpoint(path)
            if path is None or not fs.isdir(path):
                why = "does not exist" if not fs.exists(explicit) else "holds no complete checkpoint"
                raise FileNotFoundError(
                    f"trainer.load_checkpoint_path={explicit!r} {why} (expected a step-N checkpoint directory "
                    "or a directory of them). Fix the path, or remove the key to start from scratch."
                )
        if path is None:
            if cfg.load_checkpoint:
                raise FileNotFoundError(
                    f"trainer.load_checkpoint is true but no complete checkpoint exists under "
                    f"{cfg.load_checkpoint_path or cfg.checkpointer.expanded_path(run_id)!r}"
                )
            return state, None
        logger.info("resuming from checkpoint %s", path)
        return load_checkpoint(state, path), path

    def initialize_from_checkpoint(
        self, state: TrainerState, path: str, *, optimizer_state: bool, key: str
    ) -> TrainerState:
        """``state`` (a fresh initial state) with the weights -- and, if ``optimizer_state``, the optimizer
        state -- of the complete checkpoint ``path``, still at step 0: the start of a branch (a new run,
        e.g. the cooldown of a curriculum study, from another run's checkpoint).

        The optimizer state is taken as saved (Adam's moments and its bias-correction count go on)
        except the learning-rate schedule's count, which restarts at 0: the branch follows its own
        ``optimizer`` schedule from its step 0, not the origin's from the origin's step. The training key
        stays this run's. A checkpoint that does not fit the model (or optimizer) is a ``ValueError``
        naming ``key``, the array and both shapes."""
        from .checkpoint import CheckpointMismatchError

        try:
            model = load_checkpoint(state.model, path, subpath="model")
            opt_state = state.opt_state
            if optimizer_state:
                opt_state = restart_schedules(load_checkpoint(state.opt_state, path, subpath="opt_state"))
        except CheckpointMismatchError as e:
            what = "model and optimizer" if optimizer_state else "model"
            raise ValueError(
                f"{key}={path!r} does not fit this run's {what} ({e}): set model (and optimizer) as in the run "
                "that wrote it"
            ) from None
        logger.info("loaded the %s of checkpoint %s", "weights and optimizer state" if optimizer_state else "weights",
                    path)
        return TrainerState(state.step, model, opt_state, state.training_key)

    # -- compiled functions --------------------------------------------------------------------------
    def _microbatches(self, batch_size: int) -> int:
        micro = self.config.microbatch_size
        if micro is None:
            return 1
        return batch_size // (micro * self.config.data_axis_size)

    def _make_step(self, batch_size: int) -> Callable:
        n_micro = self._microbatches(batch_size)
        loss_fn, mp, optimizer = self.loss_fn, self.mp, self.optimizer
        batch_axis = self.config.batch_axis
        compute_mapping = self.compute_mapping

        def sum_loss(params, static, micro):
            model = mp.cast_to_compute(eqx.combine(params, static))
            total, count, extra = _loss_parts(loss_fn(model, micro))
            return total.astype(jnp.float32), (count, extra)

        grad_fn = eqx.filter_value_and_grad(sum_loss, has_aux=True)

        def step(state: TrainerState, batch):
            params, static = eqx.partition(state.model, eqx.is_inexact_array)
            if n_micro == 1:
                (total, (count, extra)), grads = grad_fn(params, static, batch)
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
                    acc_total, acc_count, acc_extra, acc_grads = carry
                    micro = jax.tree.map(
                        lambda x: hax.shard(x["microbatch", m], compute_mapping)
                        if isinstance(x, hax.NamedArray)
                        else x,
                        stacked,
                        is_leaf=lambda x: isinstance(x, hax.NamedArray),
                    )
                    (t, (c, e)), g = grad_fn(params, static, micro)
                    return (acc_total + t, acc_count + c, jax.tree.map(jnp.add, acc_extra, e),
                            jax.tree.map(jnp.add, acc_grads, g)), None

                zeros = jax.tree.map(jnp.zeros_like, params)
                first = jax.tree.map(lambda x: x["microbatch", 0] if isinstance(x, hax.NamedArray) else x, stacked,
                                     is_leaf=lambda x: isinstance(x, hax.NamedArray))
                # The extra metrics' structure (traced, not run) for the accumulator's zeros.
                extra_zeros = jax.tree.map(
                    lambda s: jnp.zeros(s.shape, jnp.float32),
                    jax.eval_shape(lambda p, b: sum_loss(p, static, b)[1][1], params, first),
                )
                (total, count, extra, grads), _ = jax.lax.scan(
                    body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), extra_zeros, zeros),
                    jnp.arange(n_micro),
                )
            denom = jnp.maximum(count, 1.0)
            grads = jax.tree.map(lambda g: g / denom, grads)
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, params)
            new_params = eqx.apply_updates(params, updates)
            # A finite loss and gradient can still give a non-finite update (a zero epsilon's 0/0, a learning
            # rate beyond float32's range): the new parameters and optimizer state are checked too, so that
            # no non-finite value is ever applied or checkpointed. One read of the state the step writes
            # anyway, a small share of the step (docs/performance.md).
            new_floats = [x for x in jax.tree.leaves((new_params, opt_state)) if eqx.is_inexact_array(x)]
            update_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in new_floats]))
            # A non-finite loss, gradient or update never reaches the parameters: the update is skipped (the
            # host then stops the run, or logs the skip, per crash_on_nan / crash_on_inf). Every leaf keeps
            # its dtype: with bfloat16 parameters (mp: bfloat16) the float32 updates would otherwise promote
            # the parameters and moments to float32 after the first step, and the step would compile again.
            finite = jnp.isfinite(total) & jnp.isfinite(grad_norm) & update_finite
            keep = lambda new, old: jnp.where(finite, new, old).astype(old.dtype)  # noqa: E731
            new_params = jax.tree.map(keep, new_params, params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
            model = eqx.combine(new_params, static)
            new_state = TrainerState(state.step + 1, model, opt_state, state.training_key)
            metrics = {"loss": total / denom, "loss_tokens": count, "grad_norm": grad_norm,
                       "update_finite": update_finite, "skipped": jnp.logical_not(finite),
                       "extra": {k: v.astype(jnp.float32) / denom for k, v in extra.items()}}
            return new_state, metrics

        named = hax.named_jit(
            step, axis_resources=self.compute_mapping, out_axis_resources=self.param_mapping, donate_args=(True, False)
        )
        return _FlatStep(step, named, self.param_mapping)

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

    def eval_loss(self, model, batch) -> Tuple[jax.Array, jax.Array]:
        if self._eval_fn is None:
            loss_fn, mp = self.loss_fn, self.mp

            def ev(model, batch):
                total, count, _ = _loss_parts(loss_fn(mp.cast_to_compute(model), batch))
                return total.astype(jnp.float32), count

            self._eval_fn = hax.named_jit(ev, axis_resources=self.compute_mapping)
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.compute_mapping):
            return self._eval_fn(model, batch)

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

        Each batch's step tag must equal ``state.step`` (:func:`check_step`); ``to_named`` turns its data
        into the loss's named arrays. After every step: the compile guard (one executable per batch size),
        the finite check (:func:`check_finite`), ``hooks.on_step``, an evaluation where
        ``hooks.is_eval_step`` says so, and ``checkpointer.on_step(state, step, force=...)`` (forced at the
        last step; a save returns once the state is copied to host memory and writes in the background, and
        a write that failed is raised by the next ``on_step``). On SIGTERM or SIGINT (Ctrl-C) the write in
        flight is waited for, the state after the current step is checkpointed and the
        process exits with :data:`PREEMPTED_EXIT_CODE`; batches that end before ``num_train_steps`` checkpoint the last state
        and raise :class:`DataEndedError` (a short run must not exit 0).
        """
        hooks = hooks if hooks is not None else TrainHooks()
        num_steps = self.config.num_train_steps
        previous_handler = self.install_sigterm_handler()
        seen_sizes: set[int] = set()
        try:
            start_step = int(state.step)
            if start_step > 0 and hooks.is_eval_step(start_step):
                # The earlier attempt's eval at this step was dropped with its other records of steps >= start.
                hooks.evaluate(state.model, start_step)
            t_prev = time.perf_counter()
            for batch in batches:
                step = int(state.step)
                check_step(batch, step)
                seen_sizes.add(batch.batch_size)
                state, metrics = self.train_step(state, to_named(batch.data), batch.batch_size)
                loss = float(metrics["loss"])
                if self.compile_count() > len(seen_sizes):
                    raise RuntimeError(
                        f"the train step recompiled at step {step} ({self.compile_count()} compiles for "
                        f"{len(seen_sizes)} batch sizes): an input changed shape or type unexpectedly"
                    )
                grad_norm = float(metrics["grad_norm"])
                update_finite = bool(metrics["update_finite"])
                check_finite(loss, step, self.config, grad_norm=grad_norm, update_finite=update_finite)
                now = time.perf_counter()
                dt, t_prev = now - t_prev, now
                extra = {k: float(v) for k, v in metrics["extra"].items()}
                hooks.on_step(StepReport(step, batch, loss, grad_norm, bool(metrics["skipped"]), dt, extra))

                done = step + 1
                if hooks.is_eval_step(done):
                    hooks.evaluate(state.model, done)
                    t_prev = time.perf_counter()  # the evaluation is not the next step's time
                checkpointer.on_step(state, done, force=done == num_steps)
                fault_point("train_after_step")
                if self.stop_requested and done < num_steps:
                    checkpointer.on_step(state, done, force=True)
                    checkpointer.wait_until_finished()
                    hooks.on_preempt()
                    logger.warning(
                        "%s: checkpointed step %d in %s; exiting with status %d. Rerun the same command to resume.",
                        self._stop_signal, done, getattr(checkpointer, "base_path", "the checkpoint directory"),
                        PREEMPTED_EXIT_CODE,
                    )
                    sys.exit(PREEMPTED_EXIT_CODE)
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
            # A run that fails (a non-finite loss, unreadable data) still commits the checkpoint whose
            # background write is in flight: the last good state is there to resume from. A failed write
            # is logged, not raised, so that the run's own error is the one reported.
            try:
                checkpointer.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                logger.error("the checkpoint being written when the run failed was not saved: %s", e)
            raise
        finally:
            self.restore_signal_handlers(previous_handler)

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


def restart_schedules(opt_state):
    """``opt_state`` with the count of every learning-rate schedule (``optax.ScaleByScheduleState``) set
    to 0, on the same devices; everything else unchanged."""

    def is_schedule(x) -> bool:
        return isinstance(x, optax.ScaleByScheduleState)

    def reset(x):
        return optax.ScaleByScheduleState(count=x.count - x.count) if is_schedule(x) else x

    return jax.tree.map(reset, opt_state, is_leaf=is_schedule)


def resolve_checkpoint(path: str, key: str) -> str:
    """The complete checkpoint ``path`` names: a ``step-N`` directory itself, else the latest complete one
    under it (a run directory). ``FileNotFoundError`` naming ``key`` when there is none."""
    from .checkpoint.layout import is_complete

    if fs.basename(fs.abspath(path)).startswith("step-") and is_complete(path):
        return path
    found = None if fs.basename(fs.abspath(path)).startswith("step-") else discover_latest_checkpoint(path)
    if found is None:
        why = "does not exist" if not fs.exists(path) else "holds no complete checkpoint"
        raise FileNotFoundError(
            f"{key}={path!r} {why} (expected a step-N checkpoint directory with its {METADATA_FILENAME}, or a run "
            "directory holding one)"
        )
    return found


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
    the update was skipped (non-finite and allowed to go on), and the seconds since the previous step."""

    step: int
    batch: Batch
    loss: float
    grad_norm: float
    skipped: bool
    seconds: float
    # The loss function's extra metrics (e.g. a mixture of experts' router_aux_loss), means over the step.
    extra: Dict[str, float] = dataclasses.field(default_factory=dict)


class TrainHooks:
    """What a run does around :meth:`Trainer.train`'s steps (logging, evaluation); no-ops by default."""

    def on_step(self, report: StepReport) -> None:
        """After each step's checks, before its evaluation and checkpoint."""

    def is_eval_step(self, step: int) -> bool:
        """Whether to evaluate the model after ``step`` updates."""
        return False

    def evaluate(self, model, step: int) -> None:
        """Evaluate ``model`` as it stands after ``step`` updates."""

    def on_preempt(self) -> None:
        """Before the process exits on SIGTERM (the state is already checkpointed)."""


def check_step(batch: Batch, state_step: int) -> None:
    if batch.step != state_step:
        raise StepMismatchError(
            f"the data loader yielded the batch of step {batch.step} but the trainer is at step {state_step}: "
            "data and updates are out of step"
        )


def check_finite(
    loss: float, step: int, config: TrainerConfig, *, grad_norm: float = 0.0, update_finite: bool = True
) -> None:
    """Stop on a NaN / infinite loss, gradient norm or update (the step's update was not applied), unless
    configured to go on. A non-finite update after a finite loss and gradient (a zero epsilon, a learning
    rate beyond float32's range) counts as NaN: it is almost always 0/0 or inf - inf."""
    if math.isfinite(loss) and not math.isfinite(grad_norm):
        what = "NaN" if math.isnan(grad_norm) else "infinite"
        flag = "crash_on_nan" if math.isnan(grad_norm) else "crash_on_inf"
        if getattr(config, flag):
            raise FloatingPointError(
                f"train/grad_norm is {what} at step {step} (the loss was finite); the update was not applied "
                f"and training stopped. Set trainer.{flag}: false to skip such steps instead."
            )
        logger.warning("train/grad_norm is %s at step %d: the update was skipped", grad_norm, step)
        return
    if math.isfinite(loss) and not update_finite:
        if config.crash_on_nan:
            raise FloatingPointError(
                f"the update at step {step} is not finite (loss and gradient norm were finite); it was not "
                "applied and training stopped. Check optimizer.learning_rate and optimizer.epsilon, or set "
                "trainer.crash_on_nan: false to skip such steps instead."
            )
        logger.warning("the update at step %d is not finite: it was skipped", step)
        return
    if math.isnan(loss) and config.crash_on_nan:
        raise FloatingPointError(
            f"train/loss is NaN at step {step}; the update was not applied and training stopped. Set "
            "trainer.crash_on_nan: false to skip such steps instead."
        )
    if math.isinf(loss) and config.crash_on_inf:
        raise FloatingPointError(
            f"train/loss is infinite at step {step}; the update was not applied and training stopped. Set "
            "trainer.crash_on_inf: false to skip such steps instead."
        )
    if not math.isfinite(loss):
        logger.warning("train/loss is %s at step %d: the update was skipped", loss, step)


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "DataEndedError",
    "StepMismatchError",
    "StepReport",
    "TrainHooks",
    "Trainer",
    "TrainerConfig",
    "TrainerState",
    "check_finite",
    "check_step",
    "init_trackers",
    "named_batch",
    "peak_flops_per_device",
    "resolve_checkpoint",
    "restart_schedules",
]

