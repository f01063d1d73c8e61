"""Compiling for a TPU slice this machine does not have: the slice's devices from the TPU compiler
(libtpu), the trainer's mesh over them, and JAX set up to compile for them without running on them.

With the TPU compiler (the ``libtpu`` wheel, ``pip install -e '.[tpu]'``) installed, JAX describes the
devices of a named TPU topology on any machine (``jax.experimental.topologies.get_topology_desc``), and
``jax.jit(...).lower(...).compile()`` compiles for them; nothing runs and nothing is allocated. The mesh is
the trainer's (``data`` x ``model``, :meth:`TrainerConfig.make_mesh`) over the slice's devices in JAX's
order: with several slices the ``data`` axis runs across them (slice-major). Used by ``--dry_run --slice``
(:mod:`levanter.memory.slice_plan`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from levanter.memory.flags import PlanArgumentError
from levanter.memory.tpu_slices import TpuSlice
from levanter.models import compiling_for
from levanter.training import TrainerConfig

LIBTPU_HINT = "pip install -e '.[tpu]' (or pip install 'libtpu==0.0.42.*', the version jax[tpu]==0.10.2 pins)"

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


def slice_devices(spec: TpuSlice, num_slices: int = 1) -> list:
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
    operations stay on this machine's CPU. Models build attention for the TPU
    (:func:`levanter.models.compiling_for`): ``default`` is the kernel a run on the slice resolves it to,
    splash's Pallas kernel where the sequence allows, lowered for the TPU by libtpu. JAX's persistent
    compilation cache is off inside. Restored on exit."""
    import warnings

    import haliax.partitioning

    @contextlib.contextmanager
    def as_resource_env(mesh):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:`: deprecated, still supported
            mesh.__enter__()
        try:
            # The abstract mesh (shapes and axis names, no devices) for what reads it while tracing: the splash
            # kernel's shard_map over a slice of several chips (levanter.models.attention.splash).
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
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
        with compiling_for("tpu"):
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


__all__ = ["LIBTPU_HINT", "compile_only", "on_slice", "require_libtpu", "slice_devices", "use_cpu_backend"]
