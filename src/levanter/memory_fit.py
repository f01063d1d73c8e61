"""Whether the compiled train step fits a device's memory, what lowers it when it does not, and
``trainer.per_device_parallelism: auto``.

The step is compiled ahead of time for abstract inputs (``jax.ShapeDtypeStruct`` leaves with the run's
shardings: nothing is allocated) and XLA's ``memory_analysis()`` says what one device needs at the
step's peak: its arguments (parameters, optimizer state, batch), the outputs that do not reuse a donated
argument's buffer, and the temporaries (activations kept for the backward pass, gradients, logits). An
accelerator's compiler may refuse a program that cannot fit (``RESOURCE_EXHAUSTED`` at compile time:
XLA:TPU's "the total memory required for HLO temporaries (X) exceeds available HBM (Y)", or "Used X of Y
hbm"): that counts as a measurement too, with the figures from its message (:func:`oom_figures`).

The device's memory (:func:`device_memory`): ``--device_memory`` for a plan, else the environment variable
``LEVANTER_DEVICE_MEMORY`` (e.g. ``512MiB``: for tests on CPU, or to keep headroom for something else on
the device), else what the device reports (``memory_stats()["bytes_limit"]`` on TPUs and GPUs). CPUs
report nothing: there is then no check, no extra compile, and ``auto`` trains the whole batch at once.

A run (:func:`fit_trainer`) compiles its step for the schedule's largest batch before the first step and
reuses that executable for the run (:meth:`levanter.training.Trainer.use_compiled`), so the check costs no
extra compile where it passes. A step that cannot fit is one :class:`StepDoesNotFitError` (exit 2) saying
what it needs and what the device has, and the keys that lower it with the figure each alone would give,
each compiled the same way: ``trainer.per_device_parallelism`` (the largest that fits),
``model.gradient_checkpointing: true``, ``model.cross_entropy_block_size`` and ``model.attn_backend:
jax_flash`` where the model does not use them yet, and, where none alone fits, all of them together. Those
extra compiles happen only on that error path.

``auto`` picks the largest per-device microbatch that divides every per-device batch of the schedule (the
divisors, found up to the square root: a batch of 10^12 costs a million trials) and
whose step needs at most ``1 - AUTO_HEADROOM`` of the device's memory (room for the allocator's
fragmentation and the loader's next batch). The search (:func:`search_microbatch`) compiles the whole batch
first, then a candidate halfway down; with two figures it predicts the largest candidate that fits
(memory grows about linearly with the microbatch) and compiles that; it stops once the largest fitting
candidate is bracketed by a measured one that does not fit. Compiles are deterministic, so the same
config on the same device picks the same number; the run also records the pick in its checkpoints and a
resumed run takes it from there (re-checked with one compile, searched again only if it no longer fits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
from typing import Any, Callable, Optional, Sequence

import haliax as hax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from levanter.checkpoint import ResumePoint
from levanter.quantization import with_fp8
from levanter.training import Trainer, TrainerState
from levanter.training import TrainerConfig

logger = logging.getLogger(__name__)

ENV_DEVICE_MEMORY = "LEVANTER_DEVICE_MEMORY"
AUTO_HEADROOM = 0.05  # auto leaves this share of the device's memory unplanned
RECORD_KEY = "per_device_parallelism"  # the checkpoint metadata key of auto's pick


class StepDoesNotFitError(ValueError):
    """The compiled train step needs more memory than a device has (a user error: exit 2)."""


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
    """One device's figures (bytes) of one compiled train step. ``total`` is None when the compiler ran
    out of memory without saying how much it needed."""

    total: Optional[int]
    temp: int = 0
    compiled: Any = None  # the executable; None when the compiler refused it
    oom: Optional[str] = None  # the compiler's out-of-memory message
    capacity: Optional[int] = None  # what the compiler said it had for the program, when it refused it

    def fits(self, limit: Optional[int], headroom: float = 0.0) -> bool:
        if limit is None:
            return self.oom is None
        return self.oom is None and self.total is not None and self.total <= limit * (1 - headroom)

    def describe(self) -> str:
        return "more than the device has" if self.total is None else size(self.total)


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
    # slice's, levanter.slice_plan) cannot run the key's creation.
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
    """Compile ``trainer``'s step for ``(state, batch)`` ahead of time and read its memory."""
    return compile_memory(lambda: trainer.lower_train_step(state, batch, batch_size).compile())


def compile_memory(compile_: Callable[[], Any]) -> StepMemory:
    """What one device needs for the program ``compile_()`` compiles: XLA's ``memory_analysis()`` of the
    executable, or, where the compiler refuses it for lack of memory, the figures of its message."""
    try:
        compiled = compile_()
    except Exception as e:  # noqa: BLE001 -- only the compiler's out-of-memory refusal is a measurement
        if not is_resource_exhausted(e):
            raise
        figures = oom_figures(str(e))
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "RESOURCE_EXHAUSTED")
        return StepMemory(total=figures[0] if figures else None, oom=first,
                          capacity=figures[1] if figures else None)
    mem = compiled.memory_analysis()
    if mem is None:  # a backend without the analysis: nothing to compare
        return StepMemory(total=None, compiled=compiled)
    args, outs, aliased = (int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                           int(mem.alias_size_in_bytes))
    temp = int(mem.temp_size_in_bytes)
    return StepMemory(total=args + outs - aliased + temp, temp=temp, compiled=compiled)


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


# -- per_device_parallelism ------------------------------------------------------------------------------
def current_microbatch(tcfg: TrainerConfig) -> int:
    """Sequences per device per microbatch of the schedule's largest step as the config has it."""
    return tcfg.microbatch_size or largest_batch(tcfg) // tcfg.data_axis_size


def microbatch_candidates(tcfg: TrainerConfig) -> list[int]:
    """Per-device microbatches that divide every per-device batch of the schedule, largest first."""
    dp = tcfg.data_axis_size
    g = 0
    for seg in tcfg.batch_schedule.segments:
        g = math.gcd(g, seg.value // dp)
    return divisors(g)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (>= 1), largest first. Found in pairs up to the square root, so a batch of
    10^12 sequences costs a million trials, not 10^12."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def search_microbatch(measure_at: Callable[[int], StepMemory], candidates: Sequence[int], budget: int,
                      known: Optional[dict[int, StepMemory]] = None
                      ) -> tuple[Optional[int], dict[int, StepMemory]]:
    """``(the largest candidate whose step needs at most budget bytes, or None; every figure measured)``.

    ``measure_at(d)`` compiles the step at per-device microbatch ``d``; ``known`` are figures already
    measured. Memory is taken to grow with ``d``: a fitting ``d`` rules out nothing above it only until a
    larger one is measured not to fit, so the search ends when every candidate between the largest
    fitting one and the smallest non-fitting one has been decided.
    """
    seen: dict[int, StepMemory] = dict(known or {})
    cands = sorted(set(candidates), reverse=True)

    def ok(d):
        return seen[d].total is not None and seen[d].oom is None and seen[d].total <= budget

    while True:  # a measured non-candidate (the whole batch of a ramp's largest step) still bounds the search
        fit = max((d for d in seen if d in cands and ok(d)), default=None)
        fail = min((d for d in seen if not ok(d)), default=None)
        open_ = [d for d in cands
                 if d not in seen and (fail is None or d < fail) and (fit is None or d > fit)]
        if not open_:
            return fit, seen
        pick = _predict(seen, open_, budget)
        if pick is None:  # no figures to extrapolate from: halve from the smallest that does not fit
            half = (fail if fail is not None else 2 * open_[0]) // 2
            pick = max((d for d in open_ if d <= half), default=open_[-1])
        seen[pick] = measure_at(pick)
        logger.info("per_device_parallelism %d: the step needs %s per device", pick, seen[pick].describe())


def _predict(seen: dict[int, StepMemory], open_: list[int], budget: int) -> Optional[int]:
    """The largest open candidate a straight line through the two smallest measured figures puts within
    ``budget`` (memory = fixed state + a share per sequence); None without two figures."""
    points = sorted((d, m.total) for d, m in seen.items() if m.total is not None)[:2]
    if len(points) < 2 or points[1][1] <= points[0][1]:
        return None
    (d0, m0), (d1, m1) = points
    slope = (m1 - m0) / (d1 - d0)
    reach = d0 + (budget - m0) / slope
    within = [d for d in open_ if d <= reach]
    return max(within) if within else min(open_)


# -- what lowers the step --------------------------------------------------------------------------------
TOGETHER = "all of these together"  # the key of the suggestion that combines the others


@dataclasses.dataclass(frozen=True)
class Suggestion:
    key: str
    value: Any
    memory: StepMemory

    @property
    def value_text(self) -> str:
        return str(self.value).lower() if isinstance(self.value, bool) else str(self.value)

    def line(self, limit: Optional[int]) -> str:
        verdict = " (fits)" if limit is not None and self.memory.fits(limit) else ""
        value = f"({self.value})" if self.key == TOGETHER else self.value_text
        return f"{self.key}: {value} -> {self.memory.describe()}{verdict}"


# Remat policies that keep more than each layer's input on the device: full remat (true) keeps less.
_SAVING_POLICIES = ("dots_saveable", "save_dots", "save_all")


def model_alternatives(model_config, vocab_size: int) -> list[tuple[str, Any, Any]]:
    """``(key, value, model config)`` for each model key that lowers the step's memory and that the model
    does not use yet: full remat (for no remat, or a policy that saves activations), the blockwise loss,
    blockwise attention. A change the architecture refuses (Gemma 2 has no blockwise attention, and no
    blockwise loss with its logit cap) is not suggested."""
    return _alternatives(model_config, vocab_size)[0]


def _alternatives(model_config, vocab_size: int) -> tuple[list[tuple[str, Any, Any]], Any]:
    """:func:`model_alternatives`, and the model config with all of them at once."""
    from levanter.models.layers import SAVED_NAMES

    out = []
    together: dict = {}

    def offer(key: str, value: Any, **changes) -> None:
        try:
            out.append((key, value, dataclasses.replace(model_config, **changes)))
        except ValueError:
            return  # the model's own check refuses this key; suggesting it would only lead to that error
        together.update(changes)

    remat = getattr(model_config, "gradient_checkpointing", True)
    if remat is False or remat in _SAVING_POLICIES or remat in SAVED_NAMES:
        offer("model.gradient_checkpointing", True, gradient_checkpointing=True)
    if getattr(model_config, "cross_entropy_block_size", 0) is None and vocab_size >= 4096:
        block = min(8192, 1 << int(math.log2(vocab_size // 4)))
        offer("model.cross_entropy_block_size", block, cross_entropy_block_size=block)
    requested = getattr(model_config, "attention_backend", None)
    if requested is not None:
        from levanter.models import resolve_attn_backend

        dropout = getattr(model_config, "attn_pdrop", 0.0)
        resolved = resolve_attn_backend(requested, platform=jax.default_backend(), seq_len=model_config.seq_len,
                                        dropout=dropout)
        if resolved == "vanilla" and dropout == 0.0 and model_config.seq_len >= 256:
            changes = {"attn_backend": "jax_flash"}
            if getattr(model_config, "use_flash_attention", None) is not None:
                changes["use_flash_attention"] = None
            offer("model.attn_backend", "jax_flash", **changes)
    try:
        combined = dataclasses.replace(model_config, **together)
    except ValueError:  # each alone is accepted, not all at once: no combined figure
        combined = None
    return out, combined


def suggestions(compiler: StepCompiler, base: StepMemory, limit: int
                ) -> tuple[list[Suggestion], Optional[int]]:
    """What each key alone makes of a step that does not fit, compiled ahead of time; where none alone
    fits, what all of them together make of it (one more compile); and the ``per_device_parallelism``
    auto would pick (None: none fits)."""
    out = []
    pick, seen = auto_pick(compiler, base, limit)
    current = current_microbatch(compiler.trainer_config)
    smaller = pick if pick is not None else min(seen, default=None)
    if smaller is not None and smaller < current:
        out.append(Suggestion("trainer.per_device_parallelism", smaller, seen[smaller]))
    alternatives, combined = _alternatives(compiler.model_config, compiler.vocab_size)
    for key, value, model_config in alternatives:
        memory = compiler.compile(model_config=model_config)
        logger.info("%s: %s: the step needs %s per device", key, value, memory.describe())
        out.append(Suggestion(key, value, memory))
    if len(out) >= 2 and combined is not None and not any(s.memory.fits(limit) for s in out):
        # No key alone fits: the smallest microbatch and every model key at once, the most the step's keys do.
        micro = out[0].value if out[0].key == "trainer.per_device_parallelism" else None
        at = compiler if micro is None else compiler.with_microbatch(micro)
        memory = at.compile(model_config=combined)
        parts = ", ".join(f"{s.key}: {s.value_text}" for s in out)
        logger.info("%s together: the step needs %s per device", parts, memory.describe())
        out.append(Suggestion(TOGETHER, parts, memory))
    return out, pick


def auto_pick(compiler: StepCompiler, base: Optional[StepMemory], limit: int) -> tuple[Optional[int], dict]:
    """``(the per-device microbatch auto picks, or None; the figures measured)``. ``base``: the step as
    the config has it, already measured (it counts for its own microbatch)."""
    tcfg = compiler.trainer_config
    cands = microbatch_candidates(tcfg)
    known = {}
    if base is not None:
        known[current_microbatch(tcfg)] = base

    def at(d: int) -> StepMemory:
        return compiler.compile(per_device_parallelism=d)

    budget = int(limit * (1 - AUTO_HEADROOM))
    return search_microbatch(at, cands, budget, known)


def does_not_fit(base: StepMemory, limit: int, source: str, batch: str, found: Sequence[Suggestion],
                 auto: bool = False, splittable: bool = True) -> str:
    """The one-paragraph error of a step that cannot fit."""
    figures = oom_figures(base.oom) if base.oom else None
    if figures is not None and size(figures[1]) != size(limit):
        # The compiler's capacity is what it budgets the program against (a TPU keeps part of its HBM back),
        # so that is the figure the need is compared with.
        source = f"as the compiler counts it; {source} reports {size(limit)}"
        limit = figures[1]
    what = f"the train step needs {base.describe()} per device but a device has {size(limit)} ({source})"
    why = f"measured by compiling it ahead of time for a batch of {batch}"
    if base.oom:
        why += f"; the compiler said: {base.oom[:200]}"
    lowers = "; ".join(s.line(limit) for s in found) if found else "none of the keys it knows of"
    if auto:
        tail = "use more devices (trainer.per_device_parallelism: auto found no microbatch that fits)"
    elif not splittable:
        tail = "use more devices (one sequence per device is already the smallest microbatch)"
    else:
        tail = ("set trainer.per_device_parallelism: auto to train with the largest microbatch that fits, or "
                "use more devices")
    return (
        f"{what}: it cannot fit ({why}). What each key alone makes of it (compiled the same way): {lowers}. "
        f"Change one of them, or {tail}; --dry_run prints the whole memory plan."
    )


# -- the run's check ----------------------------------------------------------------------------------------
def fit_trainer(compiler: StepCompiler, *, recorded: Optional[int] = None) -> Trainer:
    """The run's trainer, its step for the largest batch compiled ahead of time and checked against the
    device's memory (:class:`StepDoesNotFitError` when it cannot fit), with ``per_device_parallelism:
    auto`` resolved (``recorded``: the pick a checkpoint of the run recorded). Where the device's memory
    is unknown nothing is compiled here and ``auto`` means the whole batch at once."""
    tcfg = compiler.trainer_config
    limit, source = device_memory()
    auto = tcfg.per_device_parallelism == "auto"
    if limit is None:
        if auto:
            logger.info("per_device_parallelism: auto: the device's memory is %s; the whole batch at once",
                        source)
            return compiler.with_microbatch(-1).trainer()
        return compiler.trainer()
    batch = f"{largest_batch(tcfg)} x {compiler.model_config.seq_len} tokens"
    if auto:
        cands = microbatch_candidates(tcfg)
        first = recorded if recorded in cands else cands[0]
        compiler = compiler.with_microbatch(first)
        memory = compiler.compile()
        seen = {first: memory}
        pick = first if memory.fits(limit, AUTO_HEADROOM if recorded is None else 0.0) else None
        if pick is None:
            pick, seen = auto_pick(compiler, memory, limit)
        agreed = _agree(pick or 0)  # every process trains with process 0's pick (one program)
        if agreed and agreed not in seen:
            seen[agreed] = compiler.with_microbatch(agreed).compile()
        pick = agreed or None
        if pick is None:
            smallest = min(seen)
            found, _ = suggestions(compiler.with_microbatch(smallest), seen[smallest], limit)
            raise StepDoesNotFitError(does_not_fit(seen[smallest], limit, source, batch, found, auto=True))
        compiler, memory = compiler.with_microbatch(pick), seen[pick]
        how = "recorded in the run's checkpoint" if recorded == pick else (
            f"the largest that leaves {AUTO_HEADROOM:.0%} of the device's {size(limit)} ({source}) free")
        logger.warning("per_device_parallelism: auto -> %d sequences per device per microbatch (%s; the step "
                       "needs %s per device)", pick, how, memory.describe())
    else:
        memory = compiler.compile()
        if not memory.fits(limit):
            found, _ = suggestions(compiler, memory, limit)
            splittable = min(microbatch_candidates(tcfg)) < current_microbatch(tcfg)
            raise StepDoesNotFitError(
                does_not_fit(memory, limit, source, batch, found, splittable=splittable))
        logger.info("the train step needs %s per device of %s (%s)", memory.describe(), size(limit), source)
    trainer = compiler.trainer()
    if memory.compiled is not None:
        state, abatch, batch_size = compiler.inputs(trainer)
        trainer.use_compiled(batch_size, state, abatch, memory.compiled)
    return trainer


def _agree(value: int) -> int:
    """Process 0's ``value`` on every process (the processes' devices may report different memory)."""
    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def recorded_pick(tcfg: TrainerConfig, point: Optional[ResumePoint]) -> Optional[int]:
    """The ``per_device_parallelism`` that ``auto`` picked, as the checkpoint the run resumes from
    (``point``, :meth:`TrainerConfig.resume_point`) records it (None: not ``auto``, a fresh start, or
    nothing recorded)."""
    if tcfg.per_device_parallelism != "auto" or point is None:
        return None
    value = point.records.get(RECORD_KEY)
    return value if isinstance(value, int) and value > 0 else None


@contextlib.contextmanager
def device_oom_as_error():
    """Turn XLA's ``RESOURCE_EXHAUSTED`` (a compile or a step that ran out of device memory) into a
    :class:`StepDoesNotFitError` whose message says what lowers it, instead of a traceback."""
    try:
        yield
    except StepDoesNotFitError:
        raise
    except Exception as e:  # noqa: BLE001 -- only device out-of-memory errors are translated
        if not is_resource_exhausted(e):
            raise
        raise StepDoesNotFitError(out_of_memory_message(e)) from None


def out_of_memory_message(err: BaseException) -> str:
    """The ``error:`` paragraph of a device running out of memory that the check did not foresee (a
    backend without memory statistics, fragmentation): what XLA said it needed and had, and what lowers
    it."""
    figures = oom_figures(str(err))
    first = next((line.strip() for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line or
                  "memory" in line.lower()), str(err).strip()[:200])
    need = (f"the train step needs {size(figures[0])} per device but a device has {size(figures[1])}"
            if figures else "a device ran out of memory")
    return (
        f"{need} (XLA: {first[:240]}). Lower it with trainer.per_device_parallelism (a smaller microbatch; "
        "auto picks the largest that fits), model.gradient_checkpointing: true, "
        "model.cross_entropy_block_size (e.g. 8192) or model.attn_backend: jax_flash; --dry_run "
        "--device_memory SIZE prints what each needs without running."
    )


__all__ = [
    "AUTO_HEADROOM",
    "ENV_DEVICE_MEMORY",
    "RECORD_KEY",
    "StepCompiler",
    "StepDoesNotFitError",
    "StepMemory",
    "Suggestion",
    "abstract_batch",
    "abstract_state",
    "auto_pick",
    "device_memory",
    "current_microbatch",
    "device_oom_as_error",
    "divisors",
    "does_not_fit",
    "fit_trainer",
    "is_resource_exhausted",
    "largest_batch",
    "measure",
    "microbatch_candidates",
    "oom_figures",
    "out_of_memory_message",
    "parse_bytes",
    "recorded_pick",
    "search_microbatch",
    "size",
]
