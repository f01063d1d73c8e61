"""The core every memory check shares: the train step compiled ahead of time on abstract inputs, measured.

The step is the trainer's own (:class:`StepCompiler` builds the :class:`levanter.training.Trainer` a run
would, with its mesh, shardings and microbatches), compiled for abstract inputs (``jax.ShapeDtypeStruct``
leaves with the run's shardings: nothing is allocated, however large the model) and XLA's
``memory_analysis()`` says what one device needs at the step's peak: its arguments (parameters, optimizer
state, batch), the outputs that do not reuse a donated argument's buffer, and the temporaries (activations
kept for the backward pass, gradients, logits). Compiles for TPUs also read what the TPU runtime will
reserve for the temporaries (:mod:`levanter.memory.tpu_reserve`: the compiler's buffer assignment, or its
record beside the compilation cache for a compile the cache served), less than the compiler's
``temp_size_in_bytes``: :attr:`StepMemory.runtime_total` is what the chip will report, and where it is
known it is what every check and search weighs (:attr:`StepMemory.need`: a run's check before its first
step, ``auto``, the levers, the plans). Where it is not (other accelerators, a compiler whose dump says
nothing) they weigh the compiler's figure, an upper bound. An accelerator's compiler may refuse a program
that cannot fit (``RESOURCE_EXHAUSTED`` at compile time: XLA:TPU's "the total memory required for HLO
temporaries (X) exceeds available HBM (Y)", or "Used X of Y hbm"): that counts as a measurement too, with
the figures from its message (:func:`oom_figures`).

The device's memory (:func:`device_memory`): ``--device_memory`` for a plan, else the environment variable
``LEVANTER_DEVICE_MEMORY`` (e.g. ``512MiB``: for tests on CPU, or to keep headroom for something else on
the device), else what the device reports (``memory_stats()["bytes_limit"]`` on TPUs and GPUs). CPUs
report nothing: there is then no check, no extra compile, and ``auto`` trains the whole batch at once.

Its users: the run's check before the first step (:mod:`levanter.memory.fit`), the levers and the
microbatch search (:mod:`levanter.memory.levers`), ``--dry_run`` (:mod:`levanter.memory.plan`) and
``--dry_run --slice`` (:mod:`levanter.memory.slice_plan`, which compiles the same step for a TPU slice's
devices).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, Optional, Sequence

import haliax as hax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from levanter.memory.tpu_reserve import (ReserveDump, program_key, record_reserve, recorded_reserve,
                                        reserve_dump)
from levanter.quantization import with_fp8
from levanter.training import Trainer, TrainerState
from levanter.training import TrainerConfig

ENV_DEVICE_MEMORY = "LEVANTER_DEVICE_MEMORY"

# -- the device's memory ------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, what: str = "--device_memory") -> int:
    """``16GiB`` -> 17179869184; decimal (GB) and binary (GiB) units, or a plain number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e(\d+))?\s*([a-zA-Z]*)\s*", text)
    unit = m.group(3).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{what} {text!r} is not a size: give a number with a unit, e.g. 16GiB, 80GB or 512MiB"
        )
    value = float(m.group(1)) * (10 ** int(m.group(2)) if m.group(2) else 1) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return int(value)


def device_memory(override: Optional[int] = None) -> tuple[Optional[int], str]:
    """``(bytes one device has, where the figure comes from)``; ``(None, why)`` when unknown (CPUs)."""
    if override is not None:
        return override, "--device_memory"
    env = os.environ.get(ENV_DEVICE_MEMORY, "").strip()
    if env:
        return parse_bytes(env, ENV_DEVICE_MEMORY), f"{ENV_DEVICE_MEMORY}={env}"
    d = jax.devices()[0]
    try:
        stats = d.memory_stats() or {}
    except Exception:  # noqa: BLE001 -- backends without statistics (CPU)
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"reported by {d.device_kind}"
    return None, f"unknown (pass --device_memory, or set {ENV_DEVICE_MEMORY})"


def size(n: float) -> str:
    """Bytes for people: ``12.34 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def shard_bytes(leaves: Sequence[Any]) -> int:
    """Bytes one device holds of ``leaves`` (ShapeDtypeStructs with shardings): the largest shard."""
    total = 0
    for x in leaves:
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


# -- the compiler's out-of-memory errors ---------------------------------------------------------------------
# XLA:TPU's two refusals (libtpu 0.0.42 has both): the one a program gets whose buffers cannot fit at all,
#   "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (48.00G)
#   exceeds available HBM (15.75G)."  -- the figure counts the arguments and outputs too: the program's total;
# and the one from the detailed buffer assignment,
#   "... Ran out of memory in memory space hbm. Used 20.50G of 15.48G hbm. Exceeded hbm capacity by 5.02G."
# Only HBM counts: "memory space vmem" is a kernel's scratchpad, not the device's memory.
_SIZE = r"([\d.]+)\s?([KMGT]?)i?B?"
_OOM_FORMS = (
    re.compile(rf"Used {_SIZE} of {_SIZE} hbm\b", re.I),
    re.compile(rf"required for HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)", re.I),
)
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def is_resource_exhausted(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is XLA running out of device memory: a
    ``JaxRuntimeError`` saying ``RESOURCE_EXHAUSTED``. Tensorstore reports a full disk with the same status
    code (as a ``ValueError``); that is :func:`levanter.errors.is_out_of_space`'s, never this."""
    from levanter.errors import is_out_of_space

    if is_out_of_space(err):
        return False
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def is_vector_memory_refusal(text: str) -> bool:
    """Whether XLA:TPU's out-of-memory message is about a core's vector memory (VMEM: "E1001:
    CompileTimeScopedVmemOom", "memory space vmem"), which a kernel's tiles fill, and not the device's HBM."""
    return re.search(r"ScopedVmemOom|memory space vmem", text, re.I) is not None


def oom_figures(text: str) -> Optional[tuple[int, int]]:
    """``(bytes the program needs, bytes the compiler has for it)`` from an XLA:TPU refusal ("Used 20.5G of
    15.48G hbm", or "the total memory required for HLO temporaries (48.00G) exceeds available HBM (15.75G)"),
    if it says so."""
    for form in _OOM_FORMS:
        m = form.search(text)
        if m is not None:
            return (int(float(m.group(1)) * _SCALE[m.group(2).upper()]),
                    int(float(m.group(3)) * _SCALE[m.group(4).upper()]))
    return None


# -- measuring a compiled step -------------------------------------------------------------------------------
@dataclasses.dataclass
class StepMemory:
    """One device's figures (bytes) of one compiled train step: ``total`` is the arguments, the outputs
    that do not reuse a donated argument's buffer, and the compiler's temporaries; None when the compiler
    ran out of memory without saying how much it needed."""

    total: Optional[int]
    temp: int = 0  # the compiler's temporaries (memory_analysis().temp_size_in_bytes)
    compiled: Any = None  # the executable; None when the compiler refused it
    oom: Optional[str] = None  # the compiler's out-of-memory message
    capacity: Optional[int] = None  # what the compiler said it had for the program, when it refused it
    # What the TPU runtime reserves for the temporaries (levanter.memory.tpu_reserve), where asked for and
    # the TPU compiler's buffer assignment says; None elsewhere.
    reserved: Optional[int] = None

    @property
    def runtime_total(self) -> Optional[int]:
        """``total`` with what the TPU runtime reserves in place of the compiler's temporaries: what the
        chip's ``peak_bytes_in_use + peak_bytes_reserved`` will be; None where the reserve is not known."""
        if self.reserved is None or self.total is None or self.compiled is None:
            return None
        return self.total - self.temp + self.reserved

    @property
    def need(self) -> Optional[int]:
        """What the checks weigh: :attr:`runtime_total` where known, else the compiler's ``total``."""
        runtime = self.runtime_total
        return self.total if runtime is None else runtime

    @property
    def basis(self) -> str:
        """Where :attr:`need` comes from, for the logs."""
        if self.runtime_total is not None:
            return "the TPU runtime's reserve for its temporaries"
        return "the compiler's memory analysis"

    def fits(self, limit: Optional[int], headroom: float = 0.0) -> bool:
        if limit is None:
            return self.oom is None
        return self.oom is None and self.need is not None and self.need <= limit * (1 - headroom)

    @property
    def vector_memory(self) -> bool:
        """Whether the compiler refused the step for a core's vector memory (a TPU's VMEM, which a Pallas
        kernel's tiles fill), not for the device's HBM."""
        return self.oom is not None and is_vector_memory_refusal(self.oom)

    def describe(self) -> str:
        if self.vector_memory:
            return "more vector memory (VMEM) than a core has for a kernel's tiles"
        return "more than the device has" if self.need is None else size(self.need)


def abstract_state(trainer: Trainer, model_config, vocab_size: int, adapt: Optional[Callable] = None) -> TrainerState:
    """The trainer state as ShapeDtypeStructs with the shardings the run gives it (nothing allocated).
    ``adapt(model, key)``: the run's change to the built model (a LoRA run's adapters)."""
    Vocab = hax.Axis("vocab", vocab_size)

    def init(key):
        # The trainer's own step-0 state (with the averaged copy of trainer.model_averaging, if set), optimizer
        # state and average for the leaves the trainer trains alone.
        model = with_fp8(model_config.build(Vocab, key=key), trainer.config.quantization)
        if adapt is not None:
            model = adapt(model, key)
        return trainer.fresh_state(trainer.mp.cast_to_param(model), key)

    mapping = trainer.param_mapping
    # The key is made before the mesh is entered: a mesh of devices this machine only compiles for (a TPU
    # slice's, levanter.memory.slice_plan) cannot run the key's creation.
    key = jax.random.PRNGKey(0)
    with hax.partitioning.set_mesh(trainer.mesh), hax.axis_mapping(mapping):
        shapes = jax.eval_shape(init, key)
        shardings = hax.partitioning.infer_resource_partitions(
            shapes, mapping, preserve_existing_shardings=False
        )
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    sh_leaves = jax.tree_util.tree_leaves(shardings, is_leaf=is_sharding)
    if len(sh_leaves) != len(leaves):
        # Not expected (every leaf gets a sharding, replicated when it has no mapped axis); replicating
        # everything would over-count, never under-count, what a device holds.
        sh_leaves = [NamedSharding(trainer.mesh, PartitionSpec())] * len(leaves)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, sh_leaves)]
    return jax.tree_util.tree_unflatten(treedef, abstract)


def abstract_batch(trainer: Trainer, Pos: hax.Axis, batch_size: int) -> dict:
    """``{"tokens": [batch, position]}`` as the loader ships it (int32, sharded over the data axis), as the
    named array :func:`levanter.training.named_batch` makes of it (built directly: ``hax.named`` would
    convert the struct)."""
    tokens = jax.ShapeDtypeStruct((batch_size, Pos.size), jnp.int32,
                                  sharding=NamedSharding(trainer.mesh, PartitionSpec("data")))
    return {"tokens": hax.NamedArray(tokens, (hax.Axis(trainer.config.batch_axis, batch_size), Pos))}


def largest_batch(tcfg: TrainerConfig) -> int:
    """The schedule's largest batch: the step that needs the most memory."""
    return max(seg.value for seg in tcfg.batch_schedule.segments)


def measure(trainer: Trainer, state, batch, batch_size: int) -> StepMemory:
    """Compile ``trainer``'s step for ``(state, batch)`` ahead of time and read its memory; on TPU devices,
    also what the runtime reserves for its temporaries (from the compiler's dump, or, for a compile that
    JAX's persistent cache served, from the record the compile that filled it left)."""
    lowered = trainer.lower_train_step(state, batch, batch_size)
    devices = list(trainer.mesh.devices.flat)
    if devices[0].platform != "tpu":
        return compile_memory(lowered.compile)
    if "--xla_dump_to" in os.environ.get("XLA_FLAGS", ""):
        # The user's own dump of every program (XLA_FLAGS) keeps the step's: the compile's options would send
        # it elsewhere. The reserve then comes from a record, if any.
        return with_recorded_reserve(compile_memory(lowered.compile), lowered, devices)
    with reserve_dump() as dump:
        memory = compile_memory(lambda: lowered.compile(compiler_options=dump.options), reserve=dump)
    return with_recorded_reserve(memory, lowered, devices)


def with_recorded_reserve(memory: StepMemory, lowered: Any, devices: Sequence[Any],
                          cache_dir: Optional[str] = None) -> StepMemory:
    """``memory`` of the compile of ``lowered`` for ``devices``, its reserve recorded beside JAX's compilation
    cache (``cache_dir``; None: the one in use) where the compile read it, or taken from the record where
    the compile did not (:mod:`levanter.memory.tpu_reserve`). Without a cache, nothing is recorded or read."""
    if cache_dir is None and jax.config.jax_enable_compilation_cache:
        cache_dir = jax.config.jax_compilation_cache_dir
    if not cache_dir or memory.compiled is None:
        return memory
    if memory.reserved is not None:
        # The processes compile one program: process 0 records it; the others have nothing to key.
        if jax.process_index() == 0:
            record_reserve(cache_dir, program_key(lowered.as_text(), devices), memory.reserved)
        return memory
    recorded = recorded_reserve(cache_dir, program_key(lowered.as_text(), devices))
    return memory if recorded is None else dataclasses.replace(memory, reserved=recorded)


def compile_memory(compile_: Callable[[], Any], reserve: Optional[ReserveDump] = None) -> StepMemory:
    """What one device needs for the program ``compile_()`` compiles: XLA's ``memory_analysis()`` of the
    executable, or, where the compiler refuses it for lack of memory, the figures of its message. With
    ``reserve`` (the dump ``compile_`` passes to the TPU compiler), also what the TPU runtime reserves for
    the temporaries (:mod:`levanter.memory.tpu_reserve`), where the dump says."""
    try:
        compiled = compile_()
    except Exception as e:  # noqa: BLE001 -- only the compiler's out-of-memory refusal is a measurement
        if not is_resource_exhausted(e):
            raise
        figures = oom_figures(str(e))
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "RESOURCE_EXHAUSTED")
        if is_vector_memory_refusal(str(e)):
            figures = None  # a core's vector memory: no figure of the device's HBM
        return StepMemory(total=figures[0] if figures else None, oom=first,
                          capacity=figures[1] if figures else None)
    mem = compiled.memory_analysis()
    if mem is None:  # a backend without the analysis: nothing to compare
        return StepMemory(total=None, compiled=compiled)
    args, outs, aliased = (int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                           int(mem.alias_size_in_bytes))
    temp = int(mem.temp_size_in_bytes)
    reserved = reserve.read() if reserve is not None else None
    return StepMemory(total=args + outs - aliased + temp, temp=temp, compiled=compiled, reserved=reserved)


@dataclasses.dataclass
class StepCompiler:
    """Compiles a config's train step (or a variant's) for abstract inputs and measures it."""

    model_config: Any
    trainer_config: TrainerConfig
    optimizer: Any
    loss_fn: Callable
    vocab_size: int
    # adapt(model, key): the run's change to the built model (a LoRA run's adapters); None: none.
    adapt: Optional[Callable] = None
    # The trainer's is_trainable (the leaves that train, with gradients and optimizer state); None: all.
    is_trainable: Optional[Callable] = None

    def trainer(self, tcfg: Optional[TrainerConfig] = None) -> Trainer:
        return Trainer(tcfg or self.trainer_config, self.optimizer, self.loss_fn, is_trainable=self.is_trainable)

    def inputs(self, trainer: Trainer, model_config=None) -> tuple[Any, Any, int]:
        """``(abstract state, abstract batch, batch size)`` of ``trainer``'s step for the largest batch."""
        model_config = model_config or self.model_config
        batch_size = largest_batch(trainer.config)
        state = abstract_state(trainer, model_config, self.vocab_size, self.adapt)
        return state, abstract_batch(trainer, model_config.Pos, batch_size), batch_size

    def with_microbatch(self, per_device_parallelism: int) -> "StepCompiler":
        tcfg = dataclasses.replace(self.trainer_config, per_device_parallelism=per_device_parallelism)
        return dataclasses.replace(self, trainer_config=tcfg)

    def compile(self, *, model_config=None, per_device_parallelism: Optional[int] = None) -> StepMemory:
        """The step for the largest batch, with ``model_config`` and ``per_device_parallelism`` (-1: the
        whole batch) in place of the config's, compiled and measured."""
        compiler = self if per_device_parallelism is None else self.with_microbatch(per_device_parallelism)
        trainer = compiler.trainer()
        return measure(trainer, *compiler.inputs(trainer, model_config))


__all__ = [
    "ENV_DEVICE_MEMORY",
    "StepCompiler",
    "StepMemory",
    "abstract_batch",
    "abstract_state",
    "compile_memory",
    "device_memory",
    "is_resource_exhausted",
    "is_vector_memory_refusal",
    "largest_batch",
    "measure",
    "oom_figures",
    "parse_bytes",
    "shard_bytes",
    "size",
    "with_recorded_reserve",
]
