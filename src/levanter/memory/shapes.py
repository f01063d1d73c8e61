"""The cheapest look at a run's memory, before anything is compiled or allocated: a lower bound from shapes.

Every run (not only ``--dry_run``) takes it first, :func:`check_memory`: parameters, gradients, optimizer
state, the averaged copy of ``trainer.model_averaging``, the batch's tokens and one microbatch's logits,
from ``jax.eval_shape`` alone (milliseconds, however large the model), against what the devices, or for CPU
devices the host, have free (:func:`available_memory`). It refuses a model that cannot possibly fit before
the caches are built or anything is allocated; the compiled check (:func:`levanter.memory.fit.fit_trainer`)
comes later and sees the rest. ``--dry_run`` runs it without the logits (its compile measures those)
before compiling, so a model or batch that shapes alone rule out is one error in milliseconds instead of a
compile that runs for minutes.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from levanter.lm_config import TrainLmConfig

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
    import jmp

    if available is None:
        available = available_memory()
        if available is None:
            return
    tcfg = config.trainer
    policy = jmp.get_policy(tcfg.mp)
    param_count, param_bytes, trained_bytes, opt_bytes = _state_shapes(config, vocab_size, policy.param_dtype,
                                                                       adapt, is_trainable)
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


def _state_shapes(config: TrainLmConfig, vocab_size: int, param_dtype, adapt: Optional[Callable],
                  is_trainable: Optional[Callable]) -> tuple[int, int, int, int]:
    """``(parameters, their bytes at param_dtype, the trained ones' bytes, the optimizer state's bytes)``
    of ``config``'s model, from ``jax.eval_shape`` alone; gradients and optimizer state cover the leaves
    ``is_trainable`` keeps (all without it)."""
    import equinox as eqx

    from levanter.models import parameter_shapes, tree_nbytes

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
    optimizer = config.optimizer.build(config.trainer.num_train_steps)
    opt_bytes = tree_nbytes(jax.eval_shape(optimizer.init, trained))
    return param_count, param_bytes, tree_nbytes(trained), opt_bytes


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


__all__ = ["ModelCannotFitError", "available_memory", "check_memory"]
