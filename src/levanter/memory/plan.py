"""A memory plan before launch: what one device needs to train a config, found without training it.

``python -m levanter.main.train_lm --config_path X --dry_run [--device_memory 16GiB] [--vocab_size N]
[--peak_flops 989e12] [--step_seconds S] [--slice v5e-256 [--num_slices 2]]`` builds the mesh the config
asks for, traces the model and the optimizer with ``jax.eval_shape`` (nothing is allocated, however large
the model), compiles the train step ahead of time for abstract inputs carrying the config's shardings
(``jax.jit(...).lower(...).compile()``), and prints per device: the parameters, the optimizer state, the
averaged copy of the weights (``trainer.model_averaging``, when set), the batch, the compiled step's
temporaries (XLA's ``memory_analysis()``: activations kept for the backward pass, gradients, logits,
scratch) and the total against the device memory; then the training FLOPs per token and what they mean for
the step time at a given peak. It reads no data, builds no cache, and needs no accelerator.

What it can and cannot know:

* The mesh is made of the devices JAX sees. To plan for a TPU slice from any machine, ``--slice v5e-256``
  (``--num_slices N`` for several) compiles with the TPU compiler for that slice's devices
  (:mod:`levanter.memory.slice_plan`; the ``libtpu`` wheel, ``pip install -e '.[tpu]'``): the figures are then
  the TPU's own. Without it, simulate the device count on CPU:
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu``; the figures are then XLA's CPU
  compiler's: the same shardings, shapes and remat policy, but another backend's fusion and buffer
  assignment, so accelerator temporaries differ (typically by tens of percent, not by factors).
* The step is compiled for the largest batch of the schedule (the one that needs the most memory).
* The vocabulary size comes from the tokenizer when it is at hand without the network (``byte``,
  ``passthrough``, a local ``tokenizer.json``, or a hub tokenizer already in the local Hugging Face
  cache), else from ``--vocab_size``; the output says which.
* FLOPs per token are the model config's count (``flops_per_token``: 3 x the forward matmuls, lm head
  included, attention over the full ``seq_len`` map). The step time cannot be known without running, so
  the plan prints the step time and tokens/s that given MFUs would mean, and the MFU of a given
  ``--step_seconds``. The peak FLOP/s per device comes from ``--peak_flops`` or, for a known accelerator,
  the trainer's table (none for CPUs).
* Where the device's memory is known (``--device_memory``, ``LEVANTER_DEVICE_MEMORY``, or the device's
  report), the plan also says what ``trainer.per_device_parallelism: auto`` picks, and, for a step that
  does not fit, what each key that lowers it would make of it, each compiled the same way
  (:mod:`levanter.memory.levers`: a few more compiles, only then), all of them together where none alone
  fits, and how many devices would hold a state that no key lowers enough. Such a plan exits with
  :data:`levanter.memory.flags.DOES_NOT_FIT_EXIT_CODE` (3), so a script can gate a launch on it.
* A compiler that refuses the step for lack of memory (XLA:TPU's ``RESOURCE_EXHAUSTED`` at compile time)
  gives a figure in its message: the whole program's (arguments and outputs included) against what it had
  for it. The plan shows that figure as the total, that total less the arguments as the temporaries, and
  the shortfall against the compiler's capacity (a TPU keeps part of its HBM back); one without a figure
  is "?", never 0.
* Before any compile, the plan weighs what no key of the step lowers (parameters, gradients, optimizer
  state, the batch's tokens; :func:`levanter.memory.shapes.check_memory` without the logits) against the
  devices' memory (the plan's device memory times the devices, else what a run would check against: for
  CPU devices the host's free memory). A model or batch that cannot fit is one
  :class:`levanter.memory.shapes.ModelCannotFitError` in milliseconds, instead of a compile that runs for
  minutes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from levanter.lm_config import TrainLmConfig
from levanter.memory.flags import PlanOptions, plan_vocab
from levanter.memory.levers import AUTO_HEADROOM, auto_pick, microbatch_candidates, suggestions
from levanter.memory.shapes import available_memory, check_memory
from levanter.memory.step import StepCompiler, StepMemory, device_memory, measure, shard_bytes, size
from levanter.utils.flops import peak_flops_per_device
from levanter.training import num_microbatches


# -- the plan ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device figures in bytes (FLOPs in FLOPs) of one compiled train step."""

    devices: int
    platform: str
    mesh_shape: dict
    vocab_size: int
    vocab_source: str
    batch_size: int
    seq_len: int
    microbatches: int
    param_count: int
    param_bytes: int
    param_dtype: str
    opt_bytes: int
    batch_bytes: int
    temp_bytes: Optional[int]  # None: the compiler refused the step without saying how much it needs
    total_bytes: Optional[int]  # likewise
    device_memory: Optional[int]
    device_memory_source: str
    flops_per_token: float
    peak_flops: Optional[float]
    peak_source: str
    step_seconds: Optional[float]
    loss: str
    averaged_bytes: int = 0  # trainer.model_averaging's copy of the weights (0 without it)
    compiler_oom: Optional[str] = None  # the compiler refused the step for lack of memory (its message)
    lowers: tuple = ()  # "key: value -> figure" of each key that lowers a step that does not fit
    auto: str = ""  # what per_device_parallelism: auto picks (where the device's memory is known)
    compiler_capacity: Optional[int] = None  # what the compiler said it had for the step, when it refused it
    # A TPU's: what its runtime reserves for the temporaries (total_bytes then counts it in their place).
    reserved_bytes: Optional[int] = None
    # parameters, gradients, optimizer state, average and batch: what no key of the step lowers
    state_bytes: int = 0
    whole_state_bytes: int = 0  # the same over all devices together (the batch aside)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def flops_per_device_step(self) -> float:
        return self.flops_per_token * self.tokens_per_step / self.devices

    @property
    def limit(self) -> Optional[int]:
        """The memory the step is compared with: the compiler's own capacity where it refused the step
        (a TPU keeps part of its HBM back), else the device's."""
        return self.compiler_capacity if self.compiler_capacity is not None else self.device_memory

    @property
    def fits(self) -> Optional[bool]:
        if self.compiler_oom is not None:
            return False
        if self.device_memory is None or self.total_bytes is None:
            return None
        return self.total_bytes <= self.device_memory


def make_plan(config: TrainLmConfig, loss_fn: Callable, options: PlanOptions) -> MemoryPlan:
    """Compile ``config``'s train step (with ``loss_fn``) ahead of time for abstract inputs and measure it;
    where the device's memory is known, also what ``per_device_parallelism: auto`` picks and, for a step
    that does not fit, what each key that lowers it would make of it (:mod:`levanter.memory.levers`)."""
    import jmp

    tcfg = dataclasses.replace(config.trainer, require_accelerator=False)  # a plan needs no accelerator
    tcfg.validate()  # the batch against the devices, among the rest
    config.optimizer.lr_scheduler(tcfg.num_train_steps)
    vocab_size, vocab_source = plan_vocab(config, options.vocab_size)
    limit, memory_source = device_memory(options.device_memory)
    # Shapes alone before any compile (milliseconds, however large the model or the batch): what no key of
    # the step lowers (parameters, gradients, optimizer state, the batch's tokens) against the devices.
    available, hint = _plan_available(limit, memory_source)
    if available is not None:
        check_memory(dataclasses.replace(config, trainer=tcfg), vocab_size, available, logits=False,
                     hint=hint)
    optimizer = config.optimizer.build(tcfg.num_train_steps)
    compiler = StepCompiler(config.model, tcfg, optimizer, loss_fn, vocab_size)
    auto_note, lowers, memory = "", (), None
    if tcfg.per_device_parallelism == "auto":  # plan what the run would train with
        compiler, memory, auto_note, lowers = _plan_auto(compiler, limit)
    trainer = compiler.trainer()
    state, batch, batch_size = compiler.inputs(trainer)
    if memory is None:
        memory = measure(trainer, state, batch, batch_size)
    if limit is None and memory.capacity is not None:
        # The device does not say, but the compiler that refused the step did: the keys that lower it are
        # weighed against that.
        limit, memory_source = memory.capacity, "the compiler's capacity"
    if limit is not None and not auto_note:
        auto_note, lowers = _plan_levers(compiler, memory, limit)
    figures = _state_figures(state, batch["tokens"].array, memory)
    peak, peak_source = _peak_flops(options.peak_flops)
    block = config.model.cross_entropy_block_size
    loss = "full logits" if block is None else f"blockwise, {block:,} vocabulary entries per block"
    return MemoryPlan(
        devices=jax.device_count(), platform=jax.devices()[0].platform,
        mesh_shape=dict(trainer.mesh.shape), vocab_size=vocab_size, vocab_source=vocab_source,
        batch_size=batch_size, seq_len=config.model.seq_len,
        microbatches=num_microbatches(trainer.config, batch_size),
        param_dtype=str(jnp.dtype(jmp.get_policy(tcfg.mp).param_dtype)), **figures,
        total_bytes=memory.need, reserved_bytes=memory.reserved if memory.runtime_total is not None else None,
        device_memory=limit, device_memory_source=memory_source,
        compiler_capacity=memory.capacity,
        flops_per_token=float(config.model.flops_per_token(vocab_size)),
        peak_flops=peak, peak_source=peak_source,
        step_seconds=options.step_seconds, loss=loss,
        compiler_oom=memory.oom, lowers=lowers, auto=auto_note,
    )


def _plan_auto(compiler: StepCompiler, limit: Optional[int]
               ) -> tuple[StepCompiler, Optional[StepMemory], str, tuple]:
    """``per_device_parallelism: auto`` planned as the run would resolve it: ``(the compiler of the
    microbatch planned, its figures or None, what auto picks, the keys that lower a step nothing fits)``."""
    if limit is None:
        note = "per_device_parallelism: auto: the device's memory is unknown, so the whole batch at once"
        return compiler.with_microbatch(-1), None, note, ()
    cands = microbatch_candidates(compiler.trainer_config)
    memory = compiler.with_microbatch(cands[0]).compile()
    pick, found = cands[0], None
    if not memory.fits(limit, AUTO_HEADROOM):
        found, seen = auto_pick(compiler.with_microbatch(cands[0]), memory, limit)
        pick = found if found is not None else min(seen)
        memory = seen[pick]
    compiler = compiler.with_microbatch(pick)
    if found is None and not memory.fits(limit, AUTO_HEADROOM):
        note = (f"per_device_parallelism: auto finds no microbatch that fits (planned: the smallest, "
                f"{pick} per device)")
        return compiler, memory, note, tuple(x.line(limit) for x in suggestions(compiler, memory, limit)[0])
    return compiler, memory, f"per_device_parallelism: auto picks {pick} ({memory.describe()})", ()


def _plan_levers(compiler: StepCompiler, memory: StepMemory, limit: int) -> tuple[str, tuple]:
    """``(what auto would pick, the keys that lower a step that does not fit)`` of a configured microbatch."""
    lowers: tuple = ()
    if memory.fits(limit):
        pick, _ = auto_pick(compiler, memory, limit)
    else:
        found, pick = suggestions(compiler, memory, limit)
        lowers = tuple(s.line(limit) for s in found)
    note = (f"per_device_parallelism: auto would pick {pick}" if pick is not None else
            "per_device_parallelism: auto finds no microbatch that fits")
    return note, lowers


def _state_figures(state, tokens, memory: StepMemory) -> dict:
    """The plan's per-device bytes of the step's arguments (``state`` and the batch's ``tokens``, abstract,
    with their shardings), its temporaries, and what no key of the step lowers."""
    floats = [x for x in jax.tree_util.tree_leaves(state.model) if jnp.issubdtype(x.dtype, jnp.inexact)]
    param_bytes = shard_bytes(floats)
    opt_bytes = shard_bytes(jax.tree_util.tree_leaves(state.opt_state))
    # trainer.model_averaging: the averaged copy of the weights, an argument of the step like the rest.
    averaged_bytes = shard_bytes(jax.tree_util.tree_leaves(state.averaged_model))
    batch_bytes = shard_bytes([tokens])
    # Live at the peak: the arguments (state and batch), the outputs that do not reuse a donated argument's
    # buffer, and the step's temporaries (levanter.memory.step.measure). A step the compiler refused has its
    # message's figure for the whole program (arguments included: the outputs reuse the donated state's
    # buffers), or none.
    total = memory.total
    arguments = param_bytes + opt_bytes + averaged_bytes + batch_bytes
    if memory.compiled is not None:
        temp = memory.temp
    else:
        temp = max(total - arguments, 0) if total is not None else None
    # The parameters, their gradients (as large, sharded alike), the optimizer state and the average, with
    # the batch: what no microbatch, remat policy or loss lowers.
    state_bytes = 2 * param_bytes + opt_bytes + averaged_bytes + batch_bytes
    whole_state = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in floats) * 2 + sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves((state.opt_state, state.averaged_model)))
    return dict(param_count=sum(math.prod(x.shape) for x in floats), param_bytes=param_bytes,
                opt_bytes=opt_bytes, averaged_bytes=averaged_bytes, batch_bytes=batch_bytes, temp_bytes=temp,
                state_bytes=state_bytes, whole_state_bytes=whole_state)


def _peak_flops(given: Optional[float]) -> tuple[Optional[float], str]:
    """``(peak FLOP/s of one device, where the figure comes from)``: ``--peak_flops``, else the table."""
    if given is not None:
        return given, "--peak_flops"
    peak = peak_flops_per_device(jax.devices()[0])
    kind = jax.devices()[0].device_kind
    return peak, f"{kind} (trainer's table)" if peak else "unknown (pass --peak_flops)"


def _plan_available(device_memory: Optional[int], source: str) -> tuple[Optional[Tuple[int, str]], str]:
    """``((bytes, description), hint)`` of what this process's devices have for :func:`check_memory` in a
    plan: the device memory the plan compares with, else what a run would check against (for CPU devices,
    the host's free memory), with a hint on planning for an accelerator instead."""
    if device_memory is not None:
        n = jax.local_device_count()
        return (device_memory * n, f"{n} x {size(device_memory)} ({source})"), ""
    found = available_memory()
    if found is not None and all(d.platform == "cpu" for d in jax.local_devices()):
        return found, (" To plan for an accelerator's memory instead of this host's, pass --device_memory "
                       "SIZE (e.g. 16GiB).")
    return found, ""


def format_plan(plan: MemoryPlan, config_path: Optional[str] = None) -> str:
    """The plan as the table ``--dry_run`` prints."""
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    lines = [
        f"memory plan{f' for {config_path}' if config_path else ''}: {plan.devices} {plan.platform} devices, "
        f"mesh {mesh}",
        f"  vocabulary        {plan.vocab_size:,} (from {plan.vocab_source})",
        f"  step compiled for a batch of {plan.batch_size} x {plan.seq_len} tokens (the schedule's largest), "
        f"{plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''}; loss: {plan.loss}",
        "per device:",
        f"  parameters            {size(plan.param_bytes):>14}   "
        f"({plan.param_count:,} in all, {plan.param_dtype})",
        f"  optimizer state       {size(plan.opt_bytes):>14}",
        *([f"  averaged weights      {size(plan.averaged_bytes):>14}   (trainer.model_averaging)"]
          if plan.averaged_bytes else []),
        f"  batch                 {size(plan.batch_bytes):>14}",
    ]
    lines += _step_lines(plan)
    lines += _device_lines(plan)
    lines += _compute_lines(plan)
    lines.append(
        "Figures from XLA's compile for these devices; an accelerator's own compile differs in fusion and "
        "buffer reuse. The step time is not measured: run to know it."
    )
    return "\n".join(lines)


def _step_lines(plan: MemoryPlan) -> list[str]:
    """The compiled step's temporaries and total (``?`` where no figure is known)."""
    refused = plan.compiler_oom is not None
    if not refused and plan.total_bytes is None:  # a backend without XLA's memory analysis
        return [f"  compiled temporaries  {'?':>14}   (this backend's compiler does not report its memory)",
                f"  total                 {'?':>14}"]
    if not refused and plan.reserved_bytes is not None:  # a TPU's: what its runtime will reserve
        return [f"  compiled temporaries  {size(plan.temp_bytes):>14}   "
                "(activations, gradients, logits, scratch: the compiler's memory_analysis)",
                f"  runtime reserve       {size(plan.reserved_bytes):>14}   (the HBM the TPU runtime sets aside "
                "for the temporaries: the buffer assignment's allocation)",
                f"  total                 {size(plan.total_bytes):>14}   (arguments + reserve: the device's "
                "peak_bytes_in_use + peak_bytes_reserved)"]
    if not refused:
        return [f"  compiled temporaries  {size(plan.temp_bytes):>14}   "
                "(activations, gradients, logits, scratch)",
                f"  total                 {size(plan.total_bytes):>14}"]
    if plan.total_bytes is not None:  # the compiler's own figure, from its refusal
        return [f"  compiled temporaries  {size(plan.temp_bytes):>14}   "
                "(the compiler's total less the arguments above: activations, gradients, logits, scratch)",
                f"  total                 {size(plan.total_bytes):>14}   "
                "(the compiler's figure: it refused the step)"]
    return [f"  compiled temporaries  {'?':>14}   "
            "(the compiler refused the step without saying how much it needs)",
            f"  total                 {'?':>14}"]


def _device_lines(plan: MemoryPlan) -> list[str]:
    """The device's memory and the verdict, the compiler's refusal, and what lowers a step that does not
    fit (or what auto picks)."""
    lines: list[str] = []
    refused = plan.compiler_oom is not None
    limit = plan.limit
    if limit is None:
        lines.append(f"  device memory         {'?':>14}   {plan.device_memory_source}")
    else:
        source = plan.device_memory_source
        if plan.compiler_capacity is not None:
            # What the compiler budgets the program against: a TPU keeps part of its HBM back.
            source = ("as the compiler counts it" if plan.device_memory in (None, plan.compiler_capacity) else
                      f"as the compiler counts it; {source}: {size(plan.device_memory)}")
        if plan.total_bytes is None:
            verdict = "DOES NOT FIT (the compiler refused the step)" if refused else "no figure to compare"
        elif plan.fits:
            verdict = f"fits, {plan.total_bytes / limit:.0%} used"
        elif plan.total_bytes > limit:
            verdict = (f"DOES NOT FIT (short by {size(plan.total_bytes - limit)}), "
                       f"{plan.total_bytes / limit:.0%} used")
        else:  # refused although its figure is within the capacity (fragmentation, reserved memory)
            verdict = f"DOES NOT FIT (the compiler refused the step), {plan.total_bytes / limit:.0%} used"
        lines.append(f"  device memory         {size(limit):>14}   ({source}): {verdict}")
    if refused:
        lines.append(f"  the compiler refused the step: {plan.compiler_oom[:300]}")
    if plan.fits is False and limit is not None and plan.state_bytes > limit:
        # Nothing the step's keys do can help: the state itself must be spread wider, or be smaller.
        devices = max(-(-plan.whole_state_bytes // limit), plan.devices + 1)
        lines.append(f"  the parameters, their gradients, the optimizer state and the batch alone need "
                     f"{size(plan.state_bytes)} per device: no microbatch, remat policy or loss lowers "
                     "that; "
                     f"at least {devices:,} devices of {size(limit)} would hold them, or shrink the model "
                     "(model.hidden_dim, model.num_layers)")
    for i, line in enumerate(plan.lowers):  # each compiled ahead of time like the step itself
        lines.append(f"  {'what lowers it' if i == 0 else '':<21} {line}")
    if plan.auto:
        lines.append(f"  {plan.auto}")
    return lines


def _compute_lines(plan: MemoryPlan) -> list[str]:
    """FLOPs per token and per step, and what given MFUs (or a given step time) would mean."""
    lines = [
        "compute:",
        f"  FLOPs per token       {plan.flops_per_token:,.4g}   (model.flops_per_token: 3 x forward)",
        f"  FLOPs per step        {plan.flops_per_device_step:,.4g} per device "
        f"({plan.tokens_per_step:,} tokens)",
    ]
    if plan.peak_flops is None:
        lines.append(f"  peak FLOP/s           {'?':>14}   {plan.peak_source}: no step-time or MFU estimate")
    else:
        lines.append(f"  peak FLOP/s           {plan.peak_flops:,.4g} per device ({plan.peak_source})")
        for mfu in (0.3, 0.5):
            seconds = plan.flops_per_device_step / (mfu * plan.peak_flops)
            lines.append(f"  at {mfu:.0%} MFU           a step takes {seconds:,.3g} s, "
                         f"{plan.tokens_per_step / seconds:,.0f} tokens/s")
        if plan.step_seconds is not None:
            mfu = plan.flops_per_device_step / (plan.step_seconds * plan.peak_flops)
            lines.append(f"  at {plan.step_seconds:g} s per step   MFU {mfu:.1%}")
    return lines


__all__ = ["MemoryPlan", "format_plan", "make_plan"]
