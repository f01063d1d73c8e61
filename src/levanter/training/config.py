"""The trainer's configuration: the ``trainer:`` section of every run config.

:class:`TrainerConfig` holds what the step loop, its checkpoints, trackers, devices and sharding need,
and derives from it what needs no devices beyond counting them (the mesh shape, the axis mappings, the
batch schedule, the run id), plus :meth:`TrainerConfig.validate`, the up-front checks whose errors name
the config key. It imports nothing of the step or the loop, so that the config, which every entry point
and the memory plan read, does not carry them with it (``levanter.training``'s facade is lazy, and
tests/project/test_architecture.py checks that this module stays apart).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

import jax
import jmp
import numpy as np
from jax.sharding import Mesh

from ..checkpoint import CheckpointerConfig
from ..checkpoint.resume import ResumePoint, find_resume_point
from ..config import parse_timedelta
from ..refused_keys import check_refused, refused
from ..distributed import DistributedConfig
from ..optim.model_averaging import ModelAveragingConfig
from ..quantization import QuantizationConfig
from ..schedule import BatchSchedule, ScheduleStep
from ..tracker import JsonConfig, TrackerConfig, WandbConfig
from ..utils import compile_cache

@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Upstream's Ray settings: training here needs no Ray cluster."""

    # Upstream's Ray cluster to connect to; refused if set (data.cache_options.ray_address builds on Ray).
    address: Optional[str] = refused(
        "training uses no Ray cluster; remove the key (data.cache_options.ray_address builds caches on Ray)"
    )
    # Upstream starts Ray workers on each host; training here starts none (false, as upstream's exported
    # configs write it, is what happens); refused if true.
    start_workers: bool = refused("training here starts no Ray workers; remove the key or set it false",
                                  default=False)
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
    # largest that fits the device's memory, found by compiling the step ahead of time (levanter.memory.fit).
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
    # Stop the run at a NaN loss, gradient norm or update (the state after it is never evaluated or saved);
    # false: skip such steps (their update is not applied).
    crash_on_nan: bool = True
    # Stop the run at an infinite loss or gradient norm, as crash_on_nan; false: skip such steps.
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
    # JAX's persistent compilation cache (a directory or gs:// URL), from which a relaunch loads its compiled
    # programs; null: $JAX_COMPILATION_CACHE_DIR if set, else <checkpointer.base_path>/jax-cache; off: none.
    jax_compilation_cache_dir: Optional[str] = None
    # Upstream's replica axis within a slice (hybrid sharding); refused unless 1.
    replica_ici_axis_size: int = refused("replica axes are not built here; leave it at 1", default=1)
    # Upstream's replica axis across slices (hybrid sharding); refused unless 1.
    replica_dcn_axis_size: int = refused("replica axes are not built here; leave it at 1", default=1)
    # int8 training of the linear layers ({int8: true, targets: ...}; levanter.quantization); null: none.
    quantization: Optional[QuantizationConfig] = None
    # An averaged copy of the weights ({type: ema, beta: 0.999}), updated after every step, checkpointed,
    # evaluated beside the trained weights (eval/ema/...) and exported by hf_save_path; null: none.
    model_averaging: Optional[ModelAveragingConfig] = None

    # -- derived -------------------------------------------------------------------------------------
    @property
    def batch_schedule(self) -> BatchSchedule:
        return BatchSchedule(self.train_batch_size)

    def run_id(self) -> str:
        return self.id if self.id else _generated_run_id()

    def resume_point(self, run_id: str) -> Optional[ResumePoint]:
        """The checkpoint run ``run_id`` resumes from (``load_checkpoint``, ``load_checkpoint_path``), its
        metadata read once; None to start fresh (:func:`levanter.checkpoint.resume.find_resume_point`)."""
        return find_resume_point(
            self.checkpointer.expanded_path(run_id),
            load_checkpoint=self.load_checkpoint,
            load_checkpoint_path=self.load_checkpoint_path,
            num_train_steps=self.num_train_steps,
        )

    def trackers(self) -> Tuple[TrackerConfig, ...]:
        given = self.tracker if isinstance(self.tracker, tuple) else (self.tracker,)
        if self.wandb is None:
            return given
        return (self.wandb,) if given == (JsonConfig(),) else (*given, self.wandb)

    def validate(self) -> None:
        """Cheap checks that need no devices beyond counting them; errors name the config key."""
        check_refused(self, "trainer")  # upstream keys not built here (refused_keys.refused)
        if self.quantization is not None:
            self.quantization.check(jax.default_backend())
        if self.model_averaging is not None:
            self.model_averaging.check()
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
        """Apply ``jax_config`` (``{option: value}``)."""
        for name, value in self.jax_config.items():
            try:
                jax.config.update(name, value)
            except (AttributeError, KeyError, ValueError) as e:
                raise ValueError(f"trainer.jax_config: cannot set {name}={value!r} ({e})") from None

    def use_compilation_cache(self, *, default: bool = True) -> Optional[str]:
        """Point JAX's persistent compilation cache where ``jax_compilation_cache_dir`` says, before the run
        compiles its programs (:mod:`levanter.utils.compile_cache`); a directory that cannot be written is a
        ``ValueError`` naming the key. Returns the directory, None when off. ``default=False`` (``train_lm
        --dry_run``, which writes nothing of its own): only a directory the key names."""
        if not default and not self.jax_compilation_cache_dir:
            return None
        return compile_cache.use_compilation_cache(self.jax_compilation_cache_dir, self.checkpointer.base_path)

    @property
    def microbatch_size(self) -> Optional[int]:
        """Sequences per device per microbatch, or None for the whole batch at once (-1, and ``auto`` until
        :mod:`levanter.memory.fit` resolves it to a number)."""
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


__all__ = ["RayConfig", "TrainerConfig", "check_run_id"]
