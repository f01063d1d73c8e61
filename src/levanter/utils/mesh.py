"""How many devices the program being traced is partitioned over: what a Pallas kernel's caller needs to know,
since XLA does not partition a kernel (over several devices it would need a ``shard_map``), so the kernels'
callers (grouped expert products, int8 products) keep them to one device."""

from __future__ import annotations

import warnings

import jax


def mesh_size() -> int:
    """Devices of the mesh the program is traced for (``jax.set_mesh``, or ``with mesh:`` as the slice plan
    enters it); 1 without one."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and not abstract.empty:
        return abstract.size
    # The slice plan enters its mesh as ``with mesh:`` (levanter.memory.tpu_compile.compile_only), which JAX
    # records only here; JAX marks the name deprecated in favour of jax.set_mesh, which the check above reads.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.interpreters.pxla import thread_resources

    physical = thread_resources.env.physical_mesh
    return 1 if physical is None or physical.empty else physical.size


__all__ = ["mesh_size"]
