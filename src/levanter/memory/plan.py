"""A memory plan before launch: what one device needs to train a config, found without training it.

``python -m levanter.main.train_lm --config_path X --dry_run [--device_memory 16GiB] [--vocab_size N]
[--peak_flops 989e12] [--step_seconds S] [--slice v5e-256 [--num_slices 2]]`` builds the mesh the config asks for, traces the model and the
optimizer with ``jax.eval_shape`` (nothing is allocated, however large the model), compiles the train step
ahead of time for abstract inputs carrying the config's shardings (``jax.jit(...).lower(...).compile()``),
and prints per device: the parameters, the optimizer state, the averaged copy of the weights
(``trainer.model_averaging``, when set), the batch, the compiled step's temporaries
(XLA's ``memory_analysis()``: activations kept for the backward pass, gradients, logits, scratch) and the
total against the device memory; then the training FLOPs per token and what they mean for the step time
at a given peak. It reads no data, builds no cache, and needs no accelerator.

What it can and cannot know:

* The mesh is made of the devices JAX sees. To plan for a TPU slice from any machine, ``--slice v5e-256``
  (``--num_slices N`` for several) compiles with the TPU compiler for that slice's devices
  (:mod:`levanter.slice_plan`; the ``libtpu`` wheel, ``pip install -e '.[tpu]'``): the figures are then
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
  (:mod:`levanter.memory_fit`: a few more compiles, only then), all of them together where none alone
  fits, and how many devices would hold a state that no key lowers enough. Such a plan exits with
  :data:`DOES_NOT_FIT_EXIT_CODE` (3), so a script can gate a launch on it.
* A compiler that refuses the step for lack of memory (XLA:TPU's ``RESOURCE_EXHAUSTED`` at compile time)
  gives a figure in its message: the whole program's (arguments and outputs included) against what it had
  for it. The plan shows that figure as the total, that total less the arguments as the temporaries, and
  the shortfall against the compiler's capacity (a TPU keeps part of its HBM back); one without a figure
  is "?", never 0.
* Before any compile, the plan weighs what no key of the step lowers (parameters, gradients, optimizer
  state, the batch's tokens; :func:`check_memory` without the logits) against the devices' memory (the
  plan's device memory times the devices, else what a run would check against: for CPU devices the
  host's free memory). A model or batch that cannot fit is one :class:`ModelCannotFitError` in
  milliseconds, instead of a compile that runs for minutes.

Every run (not only ``--dry_run``) also takes the cheapest look first, :func:`check_memory`: a lower bound
from shapes alone (parameters, gradients, optimizer state, the averaged copy of ``trainer.model_averaging``,
the batch's tokens, one microbatch's logits) against what
the devices, or for CPU devices the host, have free. It compiles nothing, so it refuses a model that
cannot possibly fit before the caches are built or anything is allocated; the compiled check
(:func:`levanter.memory_fit.fit_trainer`) comes later and sees the rest.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from levanter.lm_config import TrainLmConfig
from levanter.memory import fit as memory_fit
from levanter.utils.flops import peak_flops_per_device

FLAG_HELP = """\
memory plan (no training):
  --dry_run              compile the train step ahead of time and print, per device, the memory of the
                         parameters, optimizer state, batch and the step's temporaries, the total, and
                         the FLOPs per token; reads no data, allocates no parameters. On CPU, simulate the
                         run's devices: XLA_FLAGS=--xla_force_host_platform_device_count=8
  --device_memory SIZE   device memory to compare the total against (e.g. 16GiB, 80GB); default:
                         LEVANTER_DEVICE_MEMORY, else what the device reports, if it does. With it, the
                         plan says what per_device_parallelism: auto picks and, for a step that does not
                         fit, what each key that lowers it would make of it (compiled the same way)
  --vocab_size N         vocabulary size when the tokenizer is not available locally
  --peak_flops F         peak FLOP/s of one device (e.g. 989e12); default: known accelerators only
  --step_seconds S       a measured or expected step time: the plan prints the MFU it means
  --slice NAME           plan for a TPU slice this machine does not have, compiled by the TPU compiler
                         on this machine's CPU (levanter.slice_plan; needs libtpu: pip install -e '.[tpu]'):
                         v5e-N / v6e-N count chips (v5e-8, v5e-256), v4-N / v5p-N count TensorCores, two
                         per chip (v4-64 is 32 chips). Prints per chip memory against the chip's HBM, FLOPs,
                         the bytes each kind of collective moves, and, for a step that does not fit, what
                         would (microbatch, remat, FSDP, a larger slice), each compiled
  --num_slices N         with --slice: N such slices over the data-center network (DCN), the data axis
                         across them; the collectives between slices are counted apart
exit status 3: the step does not fit the device's memory (0: it fits, or the memory is unknown)
"""

_VALUE_FLAGS = ("--device_memory", "--vocab_size", "--peak_flops", "--step_seconds", "--slice", "--num_slices")

# The exit status of a dry run whose plan does not fit the devices' memory (0: it fits, or the memory is
# unknown), so that a script can gate a launch on the plan; 2 stays a bad config, 1 a failure.
DOES_NOT_FIT_EXIT_CODE = 3


class PlanArgumentError(ValueError):
    """A bad ``--dry_run`` flag or value."""


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    device_memory: Optional[int] = None  # bytes
    vocab_size: Optional[int] = None
    peak_flops: Optional[float] = None  # per device
    step_seconds: Optional[float] = None
    slice: Optional[str] = None  # a TPU slice's name (levanter.tpu_slices), planned by levanter.slice_plan
    num_slices: Optional[int] = None  # with slice: that many slices over DCN


def split_plan_args(argv: Sequence[str]) -> tuple[Optional[PlanOptions], list[str]]:
    """The memory-plan flags out of ``argv``: ``(PlanOptions, the other arguments)`` with ``--dry_run``,
    ``(None, argv)`` without it. The value flags without ``--dry_run`` are an error (they do nothing else)."""
    rest: list[str] = []
    values: dict[str, str] = {}
    dry = False
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        name = a.split("=", 1)[0]
        if a == "--dry_run":
            dry = True
        elif name in _VALUE_FLAGS:
            if "=" in a:
                value = a.split("=", 1)[1]
            else:
                value = argv[i] if i < len(argv) else ""
                i += 1
            if not value or value.startswith("--"):
                raise PlanArgumentError(f"{name} needs a value (e.g. {name} {_EXAMPLES[name]})")
            values[name] = value
        else:
            rest.append(a)
    if not dry:
        if values:
            raise PlanArgumentError(f"{', '.join(values)} only applies to a memory plan: add --dry_run")
        return None, rest
    opts = PlanOptions(
        device_memory=_device_memory_flag(values["--device_memory"]) if "--device_memory" in values else None,
        vocab_size=_positive(values.get("--vocab_size"), "--vocab_size", int),
        peak_flops=_positive(values.get("--peak_flops"), "--peak_flops", float),
        step_seconds=_positive(values.get("--step_seconds"), "--step_seconds", float),
        slice=_slice_name(values.get("--slice")),
        num_slices=_positive(values.get("--num_slices"), "--num_slices", int),
    )
    if opts.num_slices is not None and opts.slice is None:
        raise PlanArgumentError("--num_slices applies to a slice plan: add --slice NAME (e.g. --slice v5e-256)")
    return opts, rest


def _slice_name(text: Optional[str]) -> Optional[str]:
    """The slice's name, checked against levanter.tpu_slices' table (an unknown one lists the known)."""
    if text is None:
        return None
    from levanter.memory.tpu_slices import parse_slice

    try:
        return parse_slice(text).name
    except ValueError as e:
        raise PlanArgumentError(str(e)) from None


_EXAMPLES = {
    "--device_memory": "16GiB", "--vocab_size": "128256", "--peak_flops": "989e12", "--step_seconds": "2.5",
    "--slice": "v5e-256", "--num_slices": "2",
}
def _device_memory_flag(text: str, flag: str = "--device_memory") -> int:
    """``--device_memory``'s bytes (:func:`levanter.memory.fit.parse_bytes`), a bad size a flag error."""
    try:
        return memory_fit.parse_bytes(text, flag)
    except ValueError as e:
        raise PlanArgumentError(str(e)) from None


def _positive(text: Optional[str], flag: str, kind: Callable[[str], Any]):
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0) or (kind is int and value != int(value)):
        what = "a positive integer" if kind is int else "a positive number"
        raise PlanArgumentError(f"{flag} must be {what}, got {text!r} (e.g. {flag} {_EXAMPLES[flag]})")
    return int(value) if kind is int else value


# -- vocabulary --------------------------------------------------------------------------------------------
def plan_vocab(config: TrainLmConfig, given: Optional[int]) -> tuple[int, str]:
    """``(vocabulary size, where it came from)``: the tokenizer if it loads without the network, else
    ``given`` (``--vocab_size``); neither is an error naming both."""
    from levanter.ingest import HfTokenizer, load_tokenizer

    spec = (config.data.tokenizer or "").strip()
    padded = config.data.vocab_size
    tok, why_not = None, ""
    try:
        if spec in ("byte", "passthrough") or os.path.exists(os.path.expanduser(spec)):
            tok = load_tokenizer(spec, vocab_size=padded)
        else:
            cached = _hub_cache_file(spec)
            if cached is not None:
                tok = HfTokenizer.from_path(cached)
            else:
                why_not = f"tokenizer {spec!r} is not a local path and not in the local Hugging Face cache"
    except ValueError as e:
        why_not = str(e)
    if tok is not None:
        size = max(tok.vocab_size, padded or 0)
        source = f"the tokenizer {spec!r}" + (f" (padded by data.vocab_size={padded})" if padded else "")
        if given is not None and given != size:
            source += f"; --vocab_size {given} ignored"
        return size, source
    if given is not None:
        return given, f"--vocab_size; {why_not}"
    raise PlanArgumentError(
        f"data.tokenizer: {why_not}, so the memory plan does not know the vocabulary size: pass "
        "--vocab_size N (e.g. 128256 for Llama 3), or point data.tokenizer at a local tokenizer.json"
    )


def _hub_cache_file(name: str) -> Optional[str]:
    """``tokenizer.json`` of hub tokenizer ``name`` if the local Hugging Face cache has it (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # noqa: BLE001 -- a name the hub would reject: not cached either
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


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


def _shard_bytes(leaves: Sequence[Any]) -> int:
    """Bytes one device holds of ``leaves`` (ShapeDtypeStructs with shardings): the largest shard."""
    total = 0
    for x in leaves:
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def make_plan(config: TrainLmConfig, loss_fn: Callable, options: PlanOptions) -> MemoryPlan:
    """Compile ``config``'s train step (with ``loss_fn``) ahead of time for abstract inputs and measure it;
    where the device's memory is known, also what ``per_device_parallelism: auto`` picks and, for a step
    that does not fit, what each key that lowers it would make of it (:mod:`levanter.memory_fit`)."""
    import jmp

    tcfg = dataclasses.replace(config.trainer, require_accelerator=False)  # a plan needs no accelerator
    tcfg.validate()  # the batch against the devices, among the rest
    config.optimizer.lr_scheduler(tcfg.num_train_steps)
    vocab_size, vocab_source = plan_vocab(config, options.vocab_size)
    device_memory, memory_source = memory_fit.device_memory(options.device_memory)
    # Shapes alone before any compile (milliseconds, however large the model or the batch): what no key of
    # the step lowers (parameters, gradients, optimizer state, the batch's tokens) against the devices.
    available, hint = _plan_available(device_memory, memory_source)
    if available is not None:
        check_memory(dataclasses.replace(config, trainer=tcfg), vocab_size, available, logits=False,
                     hint=hint)
    optimizer = config.optimizer.build(tcfg.num_train_steps)
    compiler = memory_fit.StepCompiler(config.model, tcfg, optimizer, loss_fn, vocab_size)
    cands = memory_fit.microbatch_candidates(tcfg)
    auto_note, lowers = "", ()
    memory = None
    if tcfg.per_device_parallelism == "auto":  # plan what the run would train with
        if device_memory is None:
            compiler = compiler.with_microbatch(-1)
            auto_note = "per_device_parallelism: auto: the device's memory is unknown, so the whole batch at once"
        else:
            memory = compiler.with_microbatch(cands[0]).compile()
            pick = cands[0]
            found = None
            if not memory.fits(device_memory, memory_fit.AUTO_HEADROOM):
                found, seen = memory_fit.auto_pick(compiler.with_microbatch(cands[0]), memory, device_memory)
                pick = found if found is not None else min(seen)
                memory = seen[pick]
            compiler = compiler.with_microbatch(pick)
            auto_note = f"per_device_parallelism: auto picks {pick} ({memory.describe()})"
            if found is None and not memory.fits(device_memory, memory_fit.AUTO_HEADROOM):
                auto_note = (f"per_device_parallelism: auto finds no microbatch that fits (planned: the smallest, "
                             f"{pick} per device)")
                lowers = tuple(x.line(device_memory) for x in memory_fit.suggestions(compiler, memory,
                                                                                      device_memory)[0])
    trainer = compiler.trainer()
    state, batch, batch_size = compiler.inputs(trainer)
    if memory is None:
        memory = memory_fit.measure(trainer, state, batch, batch_size)
    if device_memory is None and memory.capacity is not None:
        # The device does not say, but the compiler that refused the step did: the keys that lower it are
        # weighed against that.
        device_memory, memory_source = memory.capacity, "the compiler's capacity"
    if device_memory is not None and not auto_note:
        if memory.fits(device_memory):
            pick, seen = memory_fit.auto_pick(compiler, memory, device_memory)
        else:
            found, pick = memory_fit.suggestions(compiler, memory, device_memory)
            lowers = tuple(s.line(device_memory) for s in found)
        auto_note = (f"per_device_parallelism: auto would pick {pick}" if pick is not None else
                     "per_device_parallelism: auto finds no microbatch that fits")
    tokens = batch["tokens"].array

    floats = [x for x in jax.tree_util.tree_leaves(state.model) if jnp.issubdtype(x.dtype, jnp.inexact)]
    param_bytes = _shard_bytes(floats)
    opt_bytes = _shard_bytes(jax.tree_util.tree_leaves(state.opt_state))
    # trainer.model_averaging: the averaged copy of the weights, an argument of the step like the rest.
    averaged_bytes = _shard_bytes(jax.tree_util.tree_leaves(state.averaged_model))
    batch_bytes = _shard_bytes([tokens])
    # Live at the peak: the arguments (state and batch), the outputs that do not reuse a donated argument's
    # buffer, and the step's temporaries (memory_fit.measure). A step the compiler refused has its message's
    # figure for the whole program (arguments included: the outputs reuse the donated state's buffers), or
    # none.
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
    peak, peak_source = options.peak_flops, "--peak_flops"
    if peak is None:
        peak = peak_flops_per_device(jax.devices()[0])
        kind = jax.devices()[0].device_kind
        peak_source = f"{kind} (trainer's table)" if peak else "unknown (pass --peak_flops)"
    n_micro = _microbatches(trainer.config, batch_size)
    block = getattr(config.model, "cross_entropy_block_size", None)
    loss = "full logits" if block is None else f"blockwise, {block:,} vocabulary entries per block"
    return MemoryPlan(
        devices=jax.device_count(), platform=jax.devices()[0].platform,
        mesh_shape=dict(trainer.mesh.shape), vocab_size=vocab_size, vocab_source=vocab_source,
        batch_size=batch_size, seq_len=config.model.seq_len, microbatches=n_micro,
        param_count=sum(math.prod(x.shape) for x in floats), param_bytes=param_bytes,
        param_dtype=str(jnp.dtype(jmp.get_policy(tcfg.mp).param_dtype)),
        opt_bytes=opt_bytes, averaged_bytes=averaged_bytes, batch_bytes=batch_bytes, temp_bytes=temp, total_bytes=total,
        device_memory=device_memory, device_memory_source=memory_source,
        compiler_capacity=memory.capacity, state_bytes=state_bytes, whole_state_bytes=whole_state,
        flops_per_token=float(config.model.flops_per_token(vocab_size)),
        peak_flops=peak, peak_source=peak_source,
        step_seconds=options.step_seconds, loss=loss,
        compiler_oom=memory.oom, lowers=lowers, auto=auto_note,
    )


def _plan_available(device_memory: Optional[int], source: str) -> tuple[Optional[Tuple[int, str]], str]:
    """``((bytes, description), hint)`` of what this process's devices have for :func:`check_memory` in a
    plan: the device memory the plan compares with, else what a run would check against (for CPU devices,
    the host's free memory), with a hint on planning for an accelerator instead."""
    if device_memory is not None:
        n = jax.local_device_count()
        return (device_memory * n, f"{n} x {_size(device_memory)} ({source})"), ""
    found = available_memory()
    if found is not None and all(d.platform == "cpu" for d in jax.local_devices()):
        return found, (" To plan for an accelerator's memory instead of this host's, pass --device_memory "
                       "SIZE (e.g. 16GiB).")
    return found, ""


def _microbatches(tcfg, batch_size: int) -> int:
    micro = tcfg.microbatch_size
    return 1 if micro is None else batch_size // (micro * tcfg.data_axis_size)


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


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
        f"  parameters            {_size(plan.param_bytes):>14}   "
        f"({plan.param_count:,} in all, {plan.param_dtype})",
        f"  optimizer state       {_size(plan.opt_bytes):>14}",
        *([f"  averaged weights      {_size(plan.averaged_bytes):>14}   (trainer.model_averaging)"]
          if plan.averaged_bytes else []),
        f"  batch                 {_size(plan.batch_bytes):>14}",
    ]
    refused = plan.compiler_oom is not None
    if not refused and plan.total_bytes is None:  # a backend without XLA's memory analysis
        lines += [f"  compiled temporaries  {'?':>14}   (this backend's compiler does not report its memory)",
                  f"  total                 {'?':>14}"]
    elif not refused:
        lines += [f"  compiled temporaries  {_size(plan.temp_bytes):>14}   "
                  "(activations, gradients, logits, scratch)",
                  f"  total                 {_size(plan.total_bytes):>14}"]
    elif plan.total_bytes is not None:  # the compiler's own figure, from its refusal
        lines += [f"  compiled temporaries  {_size(plan.temp_bytes):>14}   "
                  "(the compiler's total less the arguments above: activations, gradients, logits, scratch)",
                  f"  total                 {_size(plan.total_bytes):>14}   "
                  "(the compiler's figure: it refused the step)"]
    else:
        lines += [f"  compiled temporaries  {'?':>14}   "
                  "(the compiler refused the step without saying how much it needs)",
                  f"  total                 {'?':>14}"]
    limit = plan.limit
    if limit is None:
        lines.append(f"  device memory         {'?':>14}   {plan.device_memory_source}")
    else:
        source = plan.device_memory_source
        if plan.compiler_capacity is not None:
            # What the compiler budgets the program against: a TPU keeps part of its HBM back.
            source = ("as the compiler counts it" if plan.device_memory in (None, plan.compiler_capacity) else
                      f"as the compiler counts it; {source}: {_size(plan.device_memory)}")
        if plan.total_bytes is None:
            verdict = "DOES NOT FIT (the compiler refused the step)" if refused else "no figure to compare"
        elif plan.fits:
            verdict = f"fits, {plan.total_bytes / limit:.0%} used"
        elif plan.total_bytes > limit:
            verdict = (f"DOES NOT FIT (short by {_size(plan.total_bytes - limit)}), "
                       f"{plan.total_bytes / limit:.0%} used")
        else:  # refused although its figure is within the capacity (fragmentation, reserved memory)
            verdict = f"DOES NOT FIT (the compiler refused the step), {plan.total_bytes / limit:.0%} used"
        lines.append(f"  device memory         {_size(limit):>14}   ({source}): {verdict}")
    if refused:
        lines.append(f"  the compiler refused the step: {plan.compiler_oom[:300]}")
    if plan.fits is False and limit is not None and plan.state_bytes > limit:
        # Nothing the step's keys do can help: the state itself must be spread wider, or be smaller.
        devices = max(-(-plan.whole_state_bytes // limit), plan.devices + 1)
        lines.append(f"  the parameters, their gradients, the optimizer state and the batch alone need "
                     f"{_size(plan.state_bytes)} per device: no microbatch, remat policy or loss lowers "
                     "that; "
                     f"at least {devices:,} devices of {_size(limit)} would hold them, or shrink the model "
                     "(model.hidden_dim, model.num_layers)")
    for i, line in enumerate(plan.lowers):  # each compiled ahead of time like the step itself
        lines.append(f"  {'what lowers it' if i == 0 else '':<21} {line}")
    if plan.auto:
        lines.append(f"  {plan.auto}")
    lines += [
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
    lines.append(
        "Figures from XLA's compile for these devices; an accelerator's own compile differs in fusion and "
        "buffer reuse. The step time is not measured: run to know it."
    )
    return "\n".join(lines)


# -- the run's estimate from shapes, before anything is allocated ------------------------------------------
class ModelCannotFitError(ValueError):
    """Training a config needs more memory than its devices have, from shapes alone (:func:`check_memory`):
    a run's user error (exit 2); the verdict of a ``--dry_run`` (:data:`DOES_NOT_FIT_EXIT_CODE`)."""


def check_memory(config: TrainLmConfig, vocab_size: int, available: Optional[Tuple[int, str]] = None, *,
                 adapt: Optional[Callable] = None, is_trainable: Optional[Callable] = None,
                 logits: bool = True, hint: str = "") -> None:
    """Refuse a model whose training state cannot fit, before anything is allocated
    (:class:`ModelCannotFitError`).

    The estimate is a lower bound from shapes alone (``jax.eval_shape``: nothing is allocated, and a model
    of 10^17 parameters is counted in milliseconds): parameters and their gradients at the parameter
    precision (and the averaged copy of ``trainer.model_averaging``), the optimizer's state, the int32
    tokens of the largest batch, and the
    logits of one (micro)batch that the loss holds at once: the whole vocabulary in the compute dtype (the
    full loss keeps the logits as the model computes them), or one float32 block of
    ``model.cross_entropy_block_size`` entries. Activations and XLA's temporaries come on top
    (``--dry_run`` compiles the step and measures them).
    ``available``: ``(bytes, description)``, by default what the devices (or, for CPU devices, the
    host) have free; no check where that cannot be known. Without this, a huge vocabulary failed with an
    out-of-memory traceback deep in the initialisation, or hung.
    ``adapt(model, key)`` and ``is_trainable``: the run's change to the built model and the trainer's filter of
    the leaves that train (a LoRA run's adapters): gradients, optimizer state and the average are counted for
    those leaves alone, the parameters for all.
    ``logits=False`` leaves the logits out (``--dry_run``: it measures them in the compile, and the keys that
    lower them are what its plan lists), so only what no key of the step lowers is counted; ``hint`` ends the
    message.
    """
    import equinox as eqx
    import jmp

    from levanter.models import parameter_shapes, tree_nbytes

    if available is None:
        available = available_memory()
        if available is None:
            return
    tcfg = config.trainer
    policy = jmp.get_policy(tcfg.mp)
    param_dtype = policy.param_dtype
    if adapt is None:
        shapes = parameter_shapes(config.model, vocab_size)
    else:
        import haliax as hax

        from levanter.models import VOCAB

        shapes = jax.eval_shape(lambda k: adapt(config.model.build(hax.Axis(VOCAB, vocab_size), key=k), k),
                                jax.random.PRNGKey(0))

    def is_float(x) -> bool:
        return isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)

    param_count = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes) if is_float(x))
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype) if is_float(x) else None,
        eqx.filter(shapes, is_float),
    )
    param_bytes = tree_nbytes(params)
    trained = params if is_trainable is None else eqx.filter(params, is_trainable(shapes))
    trained_bytes = tree_nbytes(trained)
    opt_bytes = tree_nbytes(jax.eval_shape(config.optimizer.build(tcfg.num_train_steps).init, trained))
    batch = max(seg.value for seg in tcfg.batch_schedule.segments)
    if tcfg.microbatch_size is not None or tcfg.per_device_parallelism == "auto":
        micro = (tcfg.microbatch_size or 1) * tcfg.data_axis_size  # auto: at least one sequence per device
    else:
        micro = batch
    seq = config.model.seq_len
    token_bytes = batch * seq * jnp.dtype(jnp.int32).itemsize  # the step's batch argument
    logit_entries = config.model.loss_logit_entries(vocab_size)
    blockwise = config.model.cross_entropy_block_size is not None
    logit_dtype = jnp.dtype(jnp.float32 if blockwise else policy.compute_dtype)
    logit_bytes = micro * seq * logit_entries * logit_dtype.itemsize if logits else 0
    # The gradients, and trainer.model_averaging's average, are copies of the trained parameters.
    copies = 3 if tcfg.model_averaging is not None else 2
    held = param_bytes + (copies - 1) * trained_bytes
    need = (held + opt_bytes + token_bytes + logit_bytes) // max(jax.process_count(), 1)
    have, where = available
    if need <= have:
        return
    vocab_key = "data.vocab_size" if config.data.vocab_size is not None else "the tokenizer's vocabulary"
    parts = [
        f"parameters and gradients"
        f"{' and the averaged copy (trainer.model_averaging)' if copies == 3 else ''} {_gib(held)}",
        f"optimizer state {_gib(opt_bytes)}",
    ]
    if logits:
        parts.append(f"{logit_dtype.name} logits of a batch of {micro} x {seq} positions x {logit_entries:,} "
                     f"vocabulary entries {_gib(logit_bytes)}")
    if token_bytes * 100 > need:  # the batch itself is a share of the need worth naming
        parts.append(f"the tokens of a batch of {batch:,} x {seq} {_gib(token_bytes)}")
    micro_key = ", trainer.per_device_parallelism" if logits else ""
    raise ModelCannotFitError(
        f"the model cannot fit: training needs at least {_gib(need)} ({', '.join(parts)}) but {where} has "
        f"{_gib(have)} free. Shrink the model ({param_count:,} parameters: {vocab_key}={vocab_size:,}, "
        f"model.hidden_dim, model.num_layers) or the batch (trainer.train_batch_size{micro_key}), or use more "
        f"devices.{hint}"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def available_memory() -> Optional[Tuple[int, str]]:
    """``(free bytes, description)`` of this process's devices: for CPU devices the host's available
    memory (capped by a cgroup limit), else the sum of the devices' free memory; None if unknown."""
    devices = jax.local_devices()
    if all(d.platform == "cpu" for d in devices):
        free = _host_available_bytes()
        return None if free is None else (free, f"the host ({len(devices)} CPU devices)")
    total = 0
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 -- a backend without memory statistics: no estimate
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        total += int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return total, f"{len(devices)} x {devices[0].device_kind}"


def _host_available_bytes() -> Optional[int]:
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a container's limit (cgroup v2) can be far below the host's memory
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


__all__ = [
    "DOES_NOT_FIT_EXIT_CODE",
    "FLAG_HELP",
    "MemoryPlan",
    "ModelCannotFitError",
    "PlanArgumentError",
    "PlanOptions",
    "available_memory",
    "check_memory",
    "format_plan",
    "make_plan",
    "plan_vocab",
    "split_plan_args",
]
