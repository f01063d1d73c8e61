"""``train_lm --dry_run --slice v5e-256 [--num_slices 2]``: the memory plan for a TPU slice this machine
does not have, from the TPU compiler itself.

The plan compiles the real train step (:class:`levanter.memory.step.StepCompiler`, the trainer's own step,
shardings and mesh) for the slice's devices, described by the TPU compiler (libtpu) on this machine's CPU
(:mod:`levanter.memory.tpu_compile`: nothing runs and nothing is allocated), and reads, per chip: the
memory of the parameters, optimizer state, batch and the compiler's temporaries against the chip's HBM
(:mod:`levanter.memory.tpu_slices`); the FLOPs; and the bytes each kind of collective moves in a step,
parsed from the compiled HLO (:mod:`levanter.memory.hlo`), with the transfers between slices (DCN) apart
from those inside a slice (ICI).

The mesh is the trainer's (``data`` x ``model``, :meth:`TrainerConfig.make_mesh`) over the slice's devices
in JAX's order: with several slices the ``data`` axis runs across them (slice-major), so the parameters'
FSDP all-gathers and the gradients' reductions cross the data-center network where they span slices. The
compiler splits each such collective into its part inside a slice and a transfer between slices; the plan
counts the two apart.

What the figures are: memory is what the TPU compiler reports for this program on that chip
(``memory_analysis()``); FLOPs are the model's count (``flops_per_token``); a collective's bytes are the
larger of its input and output buffer on one chip, times the times it runs in a step, for comparing
configs and slices, not a network model.

Where a step does not fit, the plan compiles what would: ``per_device_parallelism`` (the search
:func:`levanter.memory.levers.auto_pick` runs), the model keys :func:`levanter.memory.levers.suggestions`
knows (remat, the blockwise loss, blockwise attention), ``trainer.fsdp_axis`` where the parameters are not
sharded, and the next larger slices of the same generation (up to :data:`LARGER_SLICES` of them): each
figure from a compile, never an estimate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from levanter.lm_config import TrainLmConfig
from levanter.memory.flags import PlanOptions, plan_vocab
from levanter.memory.hlo import KINDS, Collectives, collectives
from levanter.memory.levers import AUTO_HEADROOM, Suggestion, attention_dropout, auto_pick, current_microbatch
from levanter.memory.levers import microbatch_candidates, suggestions
from levanter.memory.step import StepCompiler, StepMemory, shard_bytes, size
from levanter.memory.tpu_compile import compile_only, on_slice, slice_devices
from levanter.memory.tpu_slices import GENERATIONS, TpuSlice, parse_slice
from levanter.models import resolve_attn_backend
from levanter.utils.flops import peak_flops_per_device

logger = logging.getLogger(__name__)

LARGER_SLICES = 2  # larger slices a plan that does not fit compiles, at most


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """Per-chip figures (bytes, FLOPs) of the train step compiled for a TPU slice."""

    slice: TpuSlice
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
    temp_bytes: int  # the compiler's temporaries (memory_analysis)
    reserved_bytes: Optional[int]  # what the runtime reserves for them (None: the dump did not say)
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


class _CountingCompiler(StepCompiler):
    """:class:`levanter.StepCompiler` that counts its compiles (the plan prints how many)."""

    counter: list = []

    def compile(self, **kwargs) -> StepMemory:
        self.counter.append(1)
        return super().compile(**kwargs)


def make_slice_plan(config: TrainLmConfig, loss_fn: Callable, options: PlanOptions) -> SlicePlan:
    """Compile ``config``'s train step for ``options.slice`` (``options.num_slices`` of them) and measure it;
    for a step that does not fit, compile the keys and slices that would (see the module's docstring)."""
    import time

    start = time.perf_counter()
    spec = parse_slice(options.slice)
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
            found, pick = suggestions(compiler, memory, limit)
            lowers = [s.line(limit) for s in found] + _more_levers(compiler, limit, spec, num_slices)
            if not auto:
                auto = (f"per_device_parallelism: auto would pick {pick}" if pick is not None else
                        "per_device_parallelism: auto finds no microbatch that fits")
        trainer = compiler.trainer()
        state, batch, batch_size = compiler.inputs(trainer)
    compiled = memory.compiled
    floats = [x for x in jax.tree_util.tree_leaves(state.model) if jnp.issubdtype(x.dtype, jnp.inexact)]
    per_device = trainer.config.microbatch_size or batch_size // trainer.config.data_axis_size
    requested = config.model.attention_backend
    dropout = attention_dropout(config.model)
    on_tpu = resolve_attn_backend(requested, platform="tpu", seq_len=config.model.seq_len, dropout=dropout)
    attention = on_tpu if requested == on_tpu else f"{on_tpu} (model.attn_backend {requested!r} on a TPU)"
    if on_tpu == "splash" and compiled is not None:
        calls = compiled.as_text().count('custom_call_target="tpu_custom_call"')
        where = "on each chip's shard (shard_map)" if len(devices) > 1 else "on the chip"
        attention += f": the Pallas kernel {where}, {calls} kernel calls in the compiled step"
    return SlicePlan(
        slice=spec, num_slices=num_slices, device_kind=devices[0].device_kind,
        mesh_shape=dict(trainer.mesh.shape), vocab_size=vocab_size, vocab_source=vocab_source,
        batch_size=batch_size, seq_len=config.model.seq_len,
        microbatches=batch_size // (per_device * trainer.config.data_axis_size), per_device=per_device,
        param_count=sum(math.prod(x.shape) for x in floats), param_bytes=shard_bytes(floats),
        opt_bytes=shard_bytes(jax.tree_util.tree_leaves(state.opt_state)),
        averaged_bytes=shard_bytes(jax.tree_util.tree_leaves(state.averaged_model)),
        batch_bytes=shard_bytes([batch["tokens"].array]), temp_bytes=memory.temp,
        reserved_bytes=memory.reserved,
        total_bytes=memory.need,
        hbm=limit, hbm_source=limit_source, compiler_oom=memory.oom,
        flops_per_token=float(config.model.flops_per_token(vocab_size)),
        peak_flops=options.peak_flops or peak_flops_per_device(devices[0]),
        collectives=collectives(compiled.as_text()) if compiled is not None else None,
        attention=attention, auto=auto, lowers=tuple(lowers), compiles=len(counter),
        seconds=time.perf_counter() - start,
    )


def _fit(compiler, limit: int) -> tuple[StepMemory, Any, str]:
    """``(the step's figures, the compiler of the microbatch planned, what auto picks)``: as
    :func:`levanter.memory.plan.make_plan` decides them, against the chip's memory."""
    tcfg = compiler.trainer_config
    if tcfg.per_device_parallelism == "auto":
        cands = microbatch_candidates(tcfg)
        memory = compiler.with_microbatch(cands[0]).compile()
        # The search logs the microbatches it compiles; this one (the whole batch) is said here, so that a plan
        # whose auto picks less shows what the whole batch needed against auto's headroom.
        logger.info("per_device_parallelism %d: the step needs %s per device", cands[0], memory.describe())
        pick, found = cands[0], cands[0]
        if not memory.fits(limit, AUTO_HEADROOM):
            found, seen = auto_pick(compiler.with_microbatch(cands[0]), memory, limit)
            pick = found if found is not None else min(seen)
            memory = seen[pick]
        compiler = compiler.with_microbatch(pick)
        if found is None:
            return memory, compiler, (f"per_device_parallelism: auto finds no microbatch that fits (planned: "
                                      f"the smallest, {pick} per chip)")
        # auto weighs what the chip will report where the compiler's buffer assignment says (as a run's check
        # does), else the compiler's own figure: say which.
        return memory, compiler, (f"per_device_parallelism: auto picks {pick} ({memory.describe()} per chip "
                                  f"by {memory.basis})")
    memory = compiler.compile()
    if not memory.fits(limit):
        return memory, compiler, ""  # suggestions searches the microbatch with the other levers
    current = current_microbatch(tcfg)
    if current != microbatch_candidates(tcfg)[0]:
        # A microbatch the config fixes below the whole batch: what auto would pick takes more compiles of
        # the step (each as long as this one), which a plan of a fitting config does not spend.
        return memory, compiler, (f"per_device_parallelism: {current} as configured (what auto would pick is "
                                  "not compiled: plan with trainer.per_device_parallelism: auto to see it)")
    pick, _ = auto_pick(compiler, memory, limit)  # the whole batch: no compile unless it misses auto's headroom
    note = (f"per_device_parallelism: auto would pick {pick}" if pick is not None else
            "per_device_parallelism: auto finds no microbatch that fits")
    return memory, compiler, note


def _more_levers(compiler, limit: int, spec: TpuSlice, num_slices: int) -> list[str]:
    """What the slice adds to :func:`levanter.suggestions`: FSDP where the parameters are not
    sharded, and the next larger slices (each compiled; the first that fits ends the search)."""
    out = []
    tcfg = compiler.trainer_config
    if not tcfg.fsdp_axis:
        sharded = dataclasses.replace(tcfg, fsdp_axis="embed")
        figure = dataclasses.replace(compiler, trainer_config=sharded).compile()
        out.append(Suggestion("trainer.fsdp_axis", "embed", figure).line(limit))
    gen = GENERATIONS[spec.generation]
    larger = [c for c in sorted(gen.shapes) if c > spec.chips][:LARGER_SLICES]
    for chips in larger:
        name = f"{spec.generation}-{chips * 2 if gen.counts_cores else chips}"
        bigger = parse_slice(name)
        devices = slice_devices(bigger, num_slices)
        moved = on_slice(tcfg, devices)
        try:
            moved.validate()
        except ValueError as e:
            out.append(f"--slice {name}: not with this batch ({e})")
            break
        per_device = tcfg.microbatch_size
        if per_device is not None:
            cands = microbatch_candidates(moved)
            per_device = max((d for d in cands if d <= per_device), default=cands[-1])
            moved = dataclasses.replace(moved, per_device_parallelism=per_device)
        figure = dataclasses.replace(compiler, trainer_config=moved).compile()
        what = f"{per_device} per chip" if per_device else "the whole batch"
        line = Suggestion("--slice", name, figure).line(limit)
        out.append(f"{line} ({what}, {bigger.chips * num_slices} chips)")
        if figure.fits(limit):
            break
    return out


def _gib(n: Optional[float]) -> str:
    return "?" if n is None else size(n)


def _reserve_lines(plan: SlicePlan) -> list[str]:
    """The runtime's reserve and the total: what the chip's ``memory_stats()`` will report."""
    total = f"  total                 {_gib(plan.total_bytes):>14}   "
    if plan.compiler_oom:
        return [total + "(the compiler's figure: it refused the step)"]
    if plan.reserved_bytes is None:
        return [f"  runtime reserve       {'?':>14}   (the compiler's buffer assignment did not say: the "
                "total counts the compiled temporaries, an upper bound)",
                total + "(at most the chip's peak_bytes_in_use + peak_bytes_reserved)"]
    return [f"  runtime reserve       {_gib(plan.reserved_bytes):>14}   (the HBM the TPU runtime sets aside "
            "for the temporaries: the buffer assignment's allocation)",
            total + "(arguments + reserve: the chip's peak_bytes_in_use + peak_bytes_reserved)"]


def format_slice_plan(plan: SlicePlan, config_path: Optional[str] = None) -> str:
    """The plan as ``--dry_run --slice`` prints it."""
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    where = plan.slice.name if plan.num_slices == 1 else f"{plan.num_slices} x {plan.slice.name}"
    dcn = (f"; the data axis spans the {plan.num_slices} slices ({plan.slice.chips} chips each), over DCN"
           if plan.num_slices > 1 else "")
    lines = [
        f"slice plan{f' for {config_path}' if config_path else ''}: {where} ({plan.slice.topology}, "
        f"{plan.chips} chip{'s' if plan.chips != 1 else ''} of {plan.device_kind}), mesh {mesh}{dcn}",
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
        "(activations, gradients, logits, scratch: the compiler's memory_analysis)",
        *_reserve_lines(plan),
    ]
    if plan.fits:
        verdict = f"fits, {plan.total_bytes / plan.hbm:.0%} used"
    elif plan.total_bytes is not None:
        verdict = f"DOES NOT FIT (short by {size(plan.total_bytes - plan.hbm)})"
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


__all__ = ["LARGER_SLICES", "SlicePlan", "format_slice_plan", "make_slice_plan"]
