"""``train_lm --dry_run --slice v5e-256 [--num_slices 2]``: the memory plan for a TPU slice this machine
does not have, from the TPU compiler itself.

With the TPU compiler (the ``libtpu`` wheel, ``pip install -e '.[tpu]'``) installed, JAX describes the
devices of a named TPU topology on any machine (``jax.experimental.topologies.get_topology_desc``), and
``jax.jit(...).lower(...).compile()`` compiles for them; nothing runs and nothing is allocated. The plan
compiles the real train step (:class:`levanter.memory_fit.StepCompiler`, the trainer's own step, shardings
and mesh) over those devices and reads, per chip: the memory of the parameters, optimizer state, batch
and the compiler's temporaries against the chip's HBM (:mod:`levanter.tpu_slices`); the FLOPs; and the
bytes each kind of collective moves in a step, parsed from the compiled HLO, with the transfers between
slices (DCN) apart from those inside a slice (ICI).

The mesh is the trainer's (``data`` x ``model``, :meth:`TrainerConfig.make_mesh`) over the slice's devices
in JAX's order: with several slices the ``data`` axis runs across them (slice-major), so the parameters'
FSDP all-gathers and the gradients' reductions cross the data-center network where they span slices. The
compiler splits each such collective into its part inside a slice and a transfer between slices; the plan
counts the two apart.

What the figures are: memory is what the TPU compiler reports for this program on that chip
(``memory_analysis()``); FLOPs are the model's count (``flops_per_token``); a collective's bytes are the larger of its input and output
buffer on one chip (the data it gathers, reduces or exchanges), times the times it runs in a step (the
trip counts of the loops around it). Wire bytes depend on the algorithm (a ring sends about (n-1)/n of
them); the figures are for comparing configs and slices, not for a network model.

Where a step does not fit, the plan compiles what would: ``per_device_parallelism`` (the search
:func:`levanter.memory_fit.auto_pick` runs), the model keys :func:`levanter.memory_fit.suggestions`
knows (remat, the blockwise loss, blockwise attention), ``trainer.fsdp_axis`` where the parameters are not
sharded, and the next larger slices of the same generation (up to :data:`LARGER_SLICES` of them): each
figure from a compile, never an estimate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from levanter import memory_fit, tpu_slices
from levanter.lm_config import TrainLmConfig
from levanter.memory_plan import PlanArgumentError, PlanOptions, plan_vocab
from levanter.training import TrainerConfig
from levanter.utils.flops import peak_flops_per_device

LIBTPU_HINT = "pip install -e '.[tpu]' (or pip install 'libtpu==0.0.42.*', the version jax[tpu]==0.10.2 pins)"
LARGER_SLICES = 2  # larger slices a plan that does not fit compiles, at most
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


# -- the slice's devices ----------------------------------------------------------------------------------
def require_libtpu() -> None:
    """The TPU compiler must be importable; otherwise one error saying how to install it (exit 2)."""
    try:
        import libtpu  # noqa: F401 -- a small wrapper; the compiler itself loads when a topology is asked for
    except ImportError:
        raise PlanArgumentError(
            f"--slice compiles the train step with the TPU compiler, the libtpu package, which is not "
            f"installed: {LIBTPU_HINT}; the plan then runs on this machine's CPU"
        ) from None


def use_cpu_backend() -> None:
    """Run everything but the slice's compiles on this machine's CPU (unless ``JAX_PLATFORMS`` says
    otherwise): with libtpu installed, JAX would otherwise look for a local TPU first, and on a machine
    without one print libtpu's start-up errors. Must run before JAX's backends start."""
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def _quiet_stderr():
    """Keep libtpu's start-up chatter on a machine without TPUs (its missing worker hostnames and
    accelerator type, harmless for compiling) off the terminal; shown with the error if the call fails."""
    with tempfile.TemporaryFile() as buf:
        saved = os.dup(2)
        os.dup2(buf.fileno(), 2)
        try:
            yield
        except BaseException as e:
            os.dup2(saved, 2)
            buf.seek(0)
            said = buf.read().decode(errors="replace").strip()
            if said:
                e.add_note(f"libtpu said: {said[-2000:]}")
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def slice_devices(spec: tpu_slices.TpuSlice, num_slices: int = 1) -> list:
    """The devices of ``num_slices`` slices of ``spec``, in JAX's order (slice-major), for compiling only."""
    from jax.experimental import topologies

    require_libtpu()
    # Compiling opens no TPU: the plan may run beside a training job that holds this host's chips, or
    # beside another plan, which libtpu's one-process lock (/tmp/libtpu_lockfile) would otherwise refuse.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with _quiet_stderr():
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=spec.topology, chip_config_name=spec.chip_config,
            chips_per_host_bounds=spec.chips_per_host_bounds(), num_slices=num_slices, wrap=spec.wrap,
        )
    devices = sorted(topo.devices, key=lambda d: (getattr(d, "slice_index", 0), d.id))
    if len(devices) != spec.chips * num_slices:
        raise RuntimeError(f"libtpu described {len(devices)} devices for {num_slices} x {spec.topology}, "
                           f"expected {spec.chips * num_slices} (one per chip)")
    return devices


@contextlib.contextmanager
def compile_only():
    """Inside: the trainer's mesh context makes JAX compile for the mesh without running on it.

    ``jax.set_mesh`` (what ``haliax.partitioning.set_mesh`` enters) also makes the mesh the place where
    eager operations run, and a trace runs some eagerly (haliax's check whether it is being traced, the
    rotary tables' ``ensure_compile_time_eval``). A slice's devices can be compiled for but not run on, so
    for the plan's compiles the mesh is entered as JAX's resource environment instead (``with mesh:``):
    haliax finds it there, inside and outside a trace, shardings and compiles are the same, and eager
    operations stay on this machine's CPU. JAX's persistent compilation cache is off inside. Restored on exit."""
    import warnings

    import haliax.partitioning

    @contextlib.contextmanager
    def as_resource_env(mesh):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:`: deprecated, still supported
            mesh.__enter__()
        try:
            yield
        finally:
            mesh.__exit__(None, None, None)

    saved = haliax.partitioning.set_mesh
    # JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR, trainer.jax_compilation_cache_dir) would
    # store these executables, which no client here can load back: the next plan warned on reading them.
    cache = jax.config.jax_enable_compilation_cache
    haliax.partitioning.set_mesh = as_resource_env
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        haliax.partitioning.set_mesh = saved
        jax.config.update("jax_enable_compilation_cache", cache)


class _TrainerOnSlice(TrainerConfig):
    """The trainer's config with its mesh over a TPU slice's devices instead of this machine's; the same
    keys, axes and mappings (``make_mesh``'s shape, ``data_axis_size``), only the devices differ."""

    slice_devices: tuple = ()

    @property
    def data_axis_size(self) -> int:
        return len(self.slice_devices) // self.model_axis_size

    def make_mesh(self) -> Mesh:
        devices = np.empty(len(self.slice_devices), dtype=object)
        devices[:] = self.slice_devices
        return Mesh(devices.reshape(self.data_axis_size, self.model_axis_size), ("data", "model"))

    def validate(self) -> None:
        n = len(self.slice_devices)
        if self.model_axis_size < 1 or n % self.model_axis_size:
            raise ValueError(f"trainer.model_axis_size={self.model_axis_size} does not divide the slice's "
                             f"{n} chips")
        # The base checks with the same data axis over a model axis of 1 (they count this machine's devices
        # for the model axis only, checked above against the slice's).
        TrainerConfig.validate(on_slice(self, self.slice_devices[: self.data_axis_size], model_axis_size=1))


def on_slice(tcfg: TrainerConfig, devices: Sequence[Any], **changes) -> TrainerConfig:
    """``tcfg`` (with ``changes``) whose trainer builds its mesh over ``devices``."""
    base = {f.name: getattr(tcfg, f.name) for f in dataclasses.fields(TrainerConfig)}
    base.update(changes)
    cls = type("TrainerConfigOnSlice", (_TrainerOnSlice,), {"slice_devices": tuple(devices)})
    return cls(**base)


# -- collectives in the compiled HLO -------------------------------------------------------------------------
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\b(?:calls|body|to_apply|branch_computations|true_computation|false_computation)="
                    r"\{?%?([\w.\-, %]+)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _bytes_of(types: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY.findall(types):
        if dtype not in _DTYPE_BYTES:
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
    return int(total)


@dataclasses.dataclass
class Collectives:
    """Bytes (per chip, per step) and counts of each kind of collective, inside a slice and between slices."""

    ici: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    dcn: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    ici_count: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    dcn_count: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})


def collectives(hlo: str) -> Collectives:
    """The collectives of a compiled (optimized) HLO module, each weighted by how often it runs in a step.

    A computation runs as often as the instructions that call it: the entry once, a while loop's body its
    ``known_trip_count`` times per run of the loop. The TPU compiler's asynchronous collective fusions copy
    one collective into its start, its continuations and its done; only the start counts (the copies whose
    ``async_collective_fusion_config`` starts at -1, or that have none). ``-done`` halves of async pairs
    are skipped. Transfers between slices are the ``send``s the compiler marks for the megascale runtime
    (``_xla_megascale_transfer_type``), sized by the larger of the send's and the matching receive's data.
    """
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo.splitlines():
        if current is None:
            m = _COMP_HEAD.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        comps[current].append(line)
    if entry is None:
        return Collectives()
    # Calls: computation -> [(callee, times per run of the caller)].
    calls: dict[str, list[tuple[str, int]]] = {}
    for name, lines in comps.items():
        out = []
        for line in lines:
            m = _INSTR.match(line)
            if m is None:
                continue
            op = m.group(3)
            trip = 1
            if op == "while":
                t = _TRIP.search(line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                trip = int(t.group(1)) if t else _trip_from_condition(comps.get(cond.group(1), []) if cond else [])
            for cm in _CALLS.finditer(line):
                key = cm.group(0).split("=")[0]
                for callee in re.split(r"[,\s]+", cm.group(1)):
                    callee = callee.strip().lstrip("%")
                    if callee in comps:
                        out.append((callee, trip if key == "body" else 1))
        calls[name] = out
    runs: dict[str, int] = {}

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        runs[name] = runs.get(name, 0) + times
        for callee, k in calls.get(name, ()):
            visit(callee, times * k, depth + 1)

    visit(entry, 1)
    out = Collectives()
    recv_bytes: dict[str, int] = {}
    sends: list[tuple[str, str, int, int]] = []
    for name, lines in comps.items():
        times = runs.get(name, 0)
        if not times:
            continue
        for line in lines:
            m = _INSTR.match(line)
            if m is None:
                continue
            result_type, op, rest = m.group(2), m.group(3), m.group(4)
            if op in ("send", "recv") and "_xla_megascale_transfer_type" in line:
                rv = re.search(r'_xla_host_transfer_rendezvous="([^"]+)"', line)
                key = rv.group(1) if rv else m.group(1)
                data = _bytes_of(result_type.split("u32[]")[0])
                if op == "recv":
                    recv_bytes[key] = max(recv_bytes.get(key, 0), data)
                else:
                    kind = re.search(r'_xla_megascale_transfer_type="([A-Z_]+)"', line).group(1)
                    sends.append((key, kind.lower().replace("_", "-"), data, times))
                continue
            base = op[:-len("-start")] if op.endswith("-start") else op
            if base not in KINDS:
                continue
            if base == "all-reduce" and name.startswith("all-reduce-scatter"):
                base = "reduce-scatter"  # the TPU's fused all-reduce + slice: a reduce-scatter
            flag = re.search(r'"async_collective_fusion_config":\{"flag_start":"(-?\d+)"', line)
            if flag is not None and flag.group(1) != "-1":
                continue
            operands = rest.split("), ")[0]
            size = max(_bytes_of(result_type), _operand_bytes(operands, lines))
            out.ici[base] += size * times
            out.ici_count[base] += times
    for key, kind, data, times in sends:
        if kind not in out.dcn:
            kind = {"allgather": "all-gather", "allreduce": "all-reduce"}.get(kind.replace("-", ""), kind)
        if kind not in out.dcn:
            out.dcn[kind] = 0
            out.dcn_count[kind] = 0
        out.dcn[kind] += max(data, recv_bytes.get(key, 0)) * times
        out.dcn_count[kind] += times
    return out


def _trip_from_condition(lines: list[str]) -> int:
    """A loop's trip count from its condition, ``counter < constant(N)`` (the form scans compile to);
    1 when the bound is not a constant (the figures are then lower bounds)."""
    constants = {}
    for line in lines:
        m = _INSTR.match(line)
        if m is not None and m.group(3) == "constant":
            value = re.match(r"\s*(-?\d+)\)", m.group(4))
            if value:
                constants[m.group(1)] = int(value.group(1))
    for line in lines:
        if "ROOT" in line and " compare(" in line and "direction=LT" in line:
            args = re.findall(r"%([\w.\-]+)", line.split(" compare(", 1)[1].split(")", 1)[0])
            bound = [constants[a] for a in args[1:] if a in constants]
            if bound:
                return max(bound[0], 1)
    return 1


def _operand_bytes(operands: str, lines: list[str]) -> int:
    """Bytes of an instruction's operands, from their types when printed inline, else their definitions."""
    inline = _bytes_of(operands)
    if inline:
        return inline
    total = 0
    for name in re.findall(r"%([\w.\-]+)", operands):
        for line in lines:
            m = _INSTR.match(line)
            if m is not None and m.group(1) == name:
                total += _bytes_of(m.group(2))
                break
    return total


# -- the plan ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """Per-chip figures (bytes, FLOPs) of the train step compiled for a TPU slice."""

    slice: tpu_slices.TpuSlice
    num_slices: int
    device_kind: str
    mesh_shape: dict
    vocab_size: int
    vocab_source: str
    batch_size: int
    seq_len: int
    microbatches: int
    per_device: int  # sequences per chip per microbatch
    param_count: int
    param_bytes: int
    opt_bytes: int
    averaged_bytes: int
    batch_bytes: int
    temp_bytes: int
    total_bytes: Optional[int]
    hbm: int
    hbm_source: str
    compiler_oom: Optional[str]
    flops_per_token: float  # the model's count (3 x forward)
    peak_flops: Optional[float]
    collectives: Optional[Collectives]
    attention: str
    auto: str
    lowers: tuple = ()
    compiles: int = 0
    seconds: float = 0.0

    @property
    def chips(self) -> int:
        return self.slice.chips * self.num_slices

    @property
    def fits(self) -> bool:
        return self.compiler_oom is None and self.total_bytes is not None and self.total_bytes <= self.hbm

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


class _CountingCompiler(memory_fit.StepCompiler):
    """:class:`levanter.memory_fit.StepCompiler` that counts its compiles (the plan prints how many)."""

    counter: list = []

    def compile(self, **kwargs) -> memory_fit.StepMemory:
        self.counter.append(1)
        return super().compile(**kwargs)


def _shard_bytes(leaves: Sequence[Any]) -> int:
    total = 0
    for x in leaves:
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def make_slice_plan(config: TrainLmConfig, loss_fn: Callable, options: PlanOptions) -> SlicePlan:
    """Compile ``config``'s train step for ``options.slice`` (``options.num_slices`` of them) and measure it;
    for a step that does not fit, compile the keys and slices that would (see the module's docstring)."""
    import time

    start = time.perf_counter()
    spec = tpu_slices.parse_slice(options.slice)
    num_slices = options.num_slices or 1
    devices = slice_devices(spec, num_slices)
    tcfg = on_slice(dataclasses.replace(config.trainer, require_accelerator=False), devices)
    tcfg.validate()
    config.optimizer.lr_scheduler(tcfg.num_train_steps)
    vocab_size, vocab_source = plan_vocab(config, options.vocab_size)
    optimizer = config.optimizer.build(tcfg.num_train_steps)
    counter: list = []
    counting = type("StepCompilerCounted", (_CountingCompiler,), {"counter": counter})
    compiler = counting(config.model, tcfg, optimizer, loss_fn, vocab_size)
    limit = options.device_memory or spec.hbm
    limit_source = "--device_memory" if options.device_memory else f"{spec.generation} HBM per chip"
    lowers: list = []
    with compile_only():
        memory, compiler, auto = _fit(compiler, limit)
        if not memory.fits(limit):
            found, pick = memory_fit.suggestions(compiler, memory, limit)
            lowers = [s.line(limit) for s in found] + _more_levers(compiler, limit, spec, num_slices)
            if not auto:
                auto = (f"per_device_parallelism: auto would pick {pick}" if pick is not None else
                        "per_device_parallelism: auto finds no microbatch that fits")
        trainer = compiler.trainer()
        state, batch, batch_size = compiler.inputs(trainer)
    compiled = memory.compiled
    floats = [x for x in jax.tree_util.tree_leaves(state.model) if jnp.issubdtype(x.dtype, jnp.inexact)]
    per_device = trainer.config.microbatch_size or batch_size // trainer.config.data_axis_size
    requested = getattr(config.model, "attention_backend", None)
    attention = ""
    if requested is not None:
        from levanter.models import resolve_attn_backend

        here = resolve_attn_backend(requested, platform="cpu", seq_len=config.model.seq_len,
                                    dropout=getattr(config.model, "attn_pdrop", 0.0))
        on_tpu = resolve_attn_backend(requested, platform="tpu", seq_len=config.model.seq_len,
                                      dropout=getattr(config.model, "attn_pdrop", 0.0))
        attention = here if here == on_tpu else (
            f"{here} (model.attn_backend {requested!r}: this machine resolves it to {here}, a TPU run to "
            f"{on_tpu}; attention's temporaries differ between the two)")
    return SlicePlan(
        slice=spec, num_slices=num_slices, device_kind=devices[0].device_kind,
        mesh_shape=dict(trainer.mesh.shape), vocab_size=vocab_size, vocab_source=vocab_source,
        batch_size=batch_size, seq_len=config.model.seq_len,
        microbatches=batch_size // (per_device * trainer.config.data_axis_size), per_device=per_device,
        param_count=sum(math.prod(x.shape) for x in floats), param_bytes=_shard_bytes(floats),
        opt_bytes=_shard_bytes(jax.tree_util.tree_leaves(state.opt_state)),
        averaged_bytes=_shard_bytes(jax.tree_util.tree_leaves(state.averaged_model)),
        batch_bytes=_shard_bytes([batch["tokens"].array]), temp_bytes=memory.temp, total_bytes=memory.total,
        hbm=limit, hbm_source=limit_source, compiler_oom=memory.oom,
        flops_per_token=float(config.model.flops_per_token(vocab_size)),
        peak_flops=options.peak_flops or peak_flops_per_device(devices[0]),
        collectives=collectives(compiled.as_text()) if compiled is not None else None,
        attention=attention, auto=auto, lowers=tuple(lowers), compiles=len(counter),
        seconds=time.perf_counter() - start,
    )


def _fit(compiler, limit: int) -> tuple[memory_fit.StepMemory, Any, str]:
    """``(the step's figures, the compiler of the microbatch planned, what auto picks)``: as
    :func:`levanter.memory_plan.make_plan` decides them, against the chip's memory."""
    tcfg = compiler.trainer_config
    if tcfg.per_device_parallelism == "auto":
        cands = memory_fit.microbatch_candidates(tcfg)
        memory = compiler.with_microbatch(cands[0]).compile()
        pick, found = cands[0], cands[0]
        if not memory.fits(limit, memory_fit.AUTO_HEADROOM):
            found, seen = memory_fit.auto_pick(compiler.with_microbatch(cands[0]), memory, limit)
            pick = found if found is not None else min(seen)
            memory = seen[pick]
        compiler = compiler.with_microbatch(pick)
        if found is None:
            return memory, compiler, (f"per_device_parallelism: auto finds no microbatch that fits (planned: "
                                      f"the smallest, {pick} per chip)")
        return memory, compiler, f"per_device_parallelism: auto picks {pick} ({memory.describe()} per chip)"
    memory = compiler.compile()
    if not memory.fits(limit):
        return memory, compiler, ""  # memory_fit.suggestions searches the microbatch with the other levers
    pick, _ = memory_fit.auto_pick(compiler, memory, limit)
    note = (f"per_device_parallelism: auto would pick {pick}" if pick is not None else
            "per_device_parallelism: auto finds no microbatch that fits")
    return memory, compiler, note


def _more_levers(compiler, limit: int, spec: tpu_slices.TpuSlice, num_slices: int) -> list[str]:
    """What the slice adds to :func:`levanter.memory_fit.suggestions`: FSDP where the parameters are not
    sharded, and the next larger slices (each compiled; the first that fits ends the search)."""
    out = []
    tcfg = compiler.trainer_config
    if not tcfg.fsdp_axis:
        sharded = dataclasses.replace(tcfg, fsdp_axis="embed")
        figure = dataclasses.replace(compiler, trainer_config=sharded).compile()
        out.append(memory_fit.Suggestion("trainer.fsdp_axis", "embed", figure).line(limit))
    gen = tpu_slices.GENERATIONS[spec.generation]
    larger = [c for c in sorted(gen.shapes) if c > spec.chips][:LARGER_SLICES]
    for chips in larger:
        name = f"{spec.generation}-{chips * 2 if gen.counts_cores else chips}"
        bigger = tpu_slices.parse_slice(name)
        devices = slice_devices(bigger, num_slices)
        moved = on_slice(tcfg, devices)
        try:
            moved.validate()
        except ValueError as e:
            out.append(f"--slice {name}: not with this batch ({e})")
            break
        per_device = tcfg.microbatch_size
        if per_device is not None:
            cands = memory_fit.microbatch_candidates(moved)
            per_device = max((d for d in cands if d <= per_device), default=cands[-1])
            moved = dataclasses.replace(moved, per_device_parallelism=per_device)
        figure = dataclasses.replace(compiler, trainer_config=moved).compile()
        what = f"{per_device} per chip" if per_device else "the whole batch"
        line = memory_fit.Suggestion("--slice", name, figure).line(limit)
        out.append(f"{line} ({what}, {bigger.chips * num_slices} chips)")
        if figure.fits(limit):
            break
    return out


def _gib(n: Optional[float]) -> str:
    return "?" if n is None else memory_fit.size(n)


def format_slice_plan(plan: SlicePlan, config_path: Optional[str] = None) -> str:
    """The plan as ``--dry_run --slice`` prints it."""
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    where = plan.slice.name if plan.num_slices == 1 else f"{plan.num_slices} x {plan.slice.name}"
    dcn = (f"; the data axis spans the {plan.num_slices} slices ({plan.slice.chips} chips each), over DCN"
           if plan.num_slices > 1 else "")
    lines = [
        f"slice plan{f' for {config_path}' if config_path else ''}: {where} ({plan.slice.topology}, "
        f"{plan.chips} chips of {plan.device_kind}), mesh {mesh}{dcn}",
        f"  vocabulary        {plan.vocab_size:,} (from {plan.vocab_source})",
        f"  step compiled by the TPU compiler for a batch of {plan.batch_size} x {plan.seq_len} tokens (the "
        f"schedule's largest): {plan.per_device} sequence{'s' if plan.per_device != 1 else ''} per chip per "
        f"microbatch, {plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''}",
    ]
    if plan.attention:
        lines.append(f"  attention         {plan.attention}")
    lines += [
        "per chip:",
        f"  parameters            {_gib(plan.param_bytes):>14}   ({plan.param_count:,} in all)",
        f"  optimizer state       {_gib(plan.opt_bytes):>14}",
        *([f"  averaged weights      {_gib(plan.averaged_bytes):>14}   (trainer.model_averaging)"]
          if plan.averaged_bytes else []),
        f"  batch                 {_gib(plan.batch_bytes):>14}",
        f"  compiled temporaries  {_gib(None if plan.compiler_oom else plan.temp_bytes):>14}   "
        "(activations, gradients, logits, scratch)",
        f"  total                 {_gib(plan.total_bytes):>14}",
    ]
    if plan.fits:
        verdict = f"fits, {plan.total_bytes / plan.hbm:.0%} used"
    elif plan.total_bytes is not None:
        verdict = f"DOES NOT FIT (short by {memory_fit.size(plan.total_bytes - plan.hbm)})"
    else:
        verdict = "DOES NOT FIT"
    lines.append(f"  HBM                   {_gib(plan.hbm):>14}   ({plan.hbm_source}): {verdict}")
    if plan.compiler_oom:
        lines.append(f"  the compiler refused the step: {plan.compiler_oom[:300]}")
    for i, line in enumerate(plan.lowers):
        lines.append(f"  {'levers (compiled)' if i == 0 else '':<21} {line}")
    if plan.auto:
        lines.append(f"  {plan.auto}")
    per_chip = plan.flops_per_token * plan.tokens_per_step / plan.chips
    lines += [
        "compute:",
        f"  FLOPs per token       {plan.flops_per_token:,.4g}   (model.flops_per_token: 3 x forward)",
        f"  FLOPs per step        {plan.flops_per_token * plan.tokens_per_step:,.4g} in all, "
        f"{per_chip:,.4g} per chip",
    ]
    if plan.peak_flops:
        for mfu in (0.4, 0.6):
            seconds = per_chip / (mfu * plan.peak_flops)
            lines.append(f"  at {mfu:.0%} MFU           a step takes {seconds:,.3g} s "
                         f"({plan.peak_flops:,.4g} FLOP/s per chip)")
    c = plan.collectives
    if c is not None:
        head = "inside a slice (ICI)" if plan.num_slices > 1 else "(ICI)"
        lines.append(f"collectives per step, per chip {head}:")
        for kind in KINDS:
            if c.ici_count[kind]:
                lines.append(f"  {kind:<21} {_gib(c.ici[kind]):>14}   ({c.ici_count[kind]:,} ops)")
        if not any(c.ici_count.values()):
            lines.append("  none")
        if plan.num_slices > 1:
            lines.append("collectives per step, per chip between slices (DCN):")
            for kind in c.dcn:
                if c.dcn_count[kind]:
                    lines.append(f"  {kind:<21} {_gib(c.dcn[kind]):>14}   ({c.dcn_count[kind]:,} transfers)")
            if not any(c.dcn_count.values()):
                lines.append("  none")
    lines.append(
        f"Figures from the TPU compiler ({plan.compiles} compile{'s' if plan.compiles != 1 else ''}, "
        f"{plan.seconds:,.0f} s); a collective's bytes are the larger of its input and output on one chip, "
        "times the times it runs. The step time is not measured: run to know it."
    )
    return "\n".join(lines)


__all__ = [
    "KINDS",
    "LARGER_SLICES",
    "LIBTPU_HINT",
    "Collectives",
    "SlicePlan",
    "collectives",
    "compile_only",
    "format_slice_plan",
    "make_slice_plan",
    "on_slice",
    "require_libtpu",
    "slice_devices",
    "use_cpu_backend",
]
