"""What a checkpoint save writes: the stored leaves of a tree, their finite check, and their writes.

A stored leaf is an array of the tree (``jax.Array``, a numpy array or scalar; a typed PRNG key array as
its ``key_data``, its implementation recorded) with the record ``metadata.json`` keeps of it. Each
process writes only its own replica-0 shards of a device array (or, for a background save, the host copy
of them, :mod:`levanter.checkpoint.host_copy`); a host value is written by process 0 alone. The finite
check reduces device arrays on their devices (one compiled all-finite reduction per group of leaves on
the same devices, one small transfer back), so a save never copies the state to look for a NaN.

Trade-off: the leaves are written concurrently in one event loop (TensorStore's asynchronous writes),
which is fastest on object stores but means a failure is raised only once the other writes have settled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.experimental.array_serialization import serialization as jax_serialization

from levanter.checkpoint.host_copy import HostShards, write_host_shards
from levanter.checkpoint.tree_format import (
    chunk_shape,
    finish_all,
    is_key_dtype,
    is_stored_leaf,
    leaf_name,
    shape_dtype,
    ts_context,
    write_spec,
)
from levanter.utils import fs
from levanter.utils.fault import fault_point

__all__ = ["LeafToWrite", "non_finite_leaves", "prepare_leaves", "write_all", "write_leaf"]


@dataclass
class LeafToWrite:
    """One stored leaf of a save: its ``metadata.json`` record (name, key path, shape, dtype...) and the
    value that goes on disk."""

    record: dict
    value: Any  # what goes on disk: the array, or a typed key array's key_data


def prepare_leaves(tree: Any) -> list[LeafToWrite]:
    """The stored leaves of ``tree`` (arrays only; a typed PRNG key array as its ``key_data``), in tree order."""
    out = []
    seen: set[str] = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_stored_leaf(leaf):
            continue
        name = leaf_name(path)
        if name in seen:  # cannot happen with injective names; a guard against silent overwrites
            raise ValueError(f"two leaves map to the same checkpoint entry {name!r}")
        seen.add(name)
        shape, dtype = shape_dtype(leaf)
        record: dict[str, Any] = {
            "name": name,
            "keypath": jax.tree_util.keystr(path),
            "shape": list(shape),
            "dtype": str(dtype),
            "kind": "numpy" if not isinstance(leaf, jax.Array) else "jax",
        }
        value = leaf
        if isinstance(leaf, jax.Array) and is_key_dtype(dtype):
            value = jax.random.key_data(leaf)
            record["key_impl"] = str(jax.random.key_impl(leaf))
        elif isinstance(leaf, np.generic):
            value = np.asarray(leaf)
        record["stored_shape"] = [int(d) for d in value.shape]
        record["stored_dtype"] = np.dtype(value.dtype).name
        out.append(LeafToWrite(record, value))
    return out


async def write_leaf(root: str, item: LeafToWrite, process_index: int) -> None:
    """Write one leaf under ``root``: this process's replica-0 shards, or a host value (process 0 only)."""
    directory = fs.join(root, item.record["name"])
    context = ts_context(root)
    value = item.value
    multi = jax.process_count() > 1
    if isinstance(value, HostShards):  # a device array copied to the host before a background save
        chunk = chunk_shape(value.shard_shape, value.dtype.itemsize)
        spec = write_spec(directory, value.shape, value.dtype, chunk)
        await write_host_shards(value, spec, context, creates_metadata=jax.process_index() == 0)
        return
    if isinstance(value, jax.Array) and not (multi and value.is_fully_addressable):
        shard_shape = value.sharding.shard_shape(value.shape)
        chunk = chunk_shape(shard_shape, value.dtype.itemsize)
        spec = write_spec(directory, value.shape, value.dtype, chunk)
        # primary_host=0: only process 0 creates zarr.json; every process writes its own replica-0 shards.
        await jax_serialization.async_serialize(value, spec, primary_host=0, context=context)
        return
    # A host value (numpy leaf, or a process-local jax array in a multi-process job): each process
    # may hold its own copy, so process 0's is the one written.
    if process_index != 0:
        return
    host = np.asarray(value)
    spec = write_spec(directory, host.shape, host.dtype, chunk_shape(host.shape, host.dtype.itemsize))
    store = await ts.open(spec, create=True, open=True, context=context)
    await store.write(host)


async def write_all(root: str, items: list[LeafToWrite], process_index: int) -> None:
    """Write every leaf under ``root`` concurrently; on a failure the other writes settle first (a
    cancellation cancels them), then the failure is raised."""
    tasks = [asyncio.ensure_future(write_leaf(root, it, process_index)) for it in items]
    try:
        for i, done in enumerate(asyncio.as_completed(tasks)):
            await done
            if i < len(tasks) - 1:
                fault_point("checkpoint_mid_write")
    except Exception:
        await finish_all(tasks)  # let the other writes settle, then report this failure
        raise
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@jax.jit
def _all_finite_flags(xs: list) -> jax.Array:
    return jax.numpy.stack([jax.numpy.all(jax.numpy.isfinite(x)) for x in xs])


def non_finite_leaves(items: list[LeafToWrite]) -> list[str]:
    """Key paths of the floating-point leaves that hold a NaN or an infinity.

    Device arrays are reduced on their devices (one compiled all-finite reduction per group of leaves on
    the same devices, one small transfer back); host values on the host.
    """
    multi = jax.process_count() > 1
    bad: list[str] = []
    groups: dict[Any, list[LeafToWrite]] = {}
    for it in items:
        if not jax.dtypes.issubdtype(it.value.dtype, np.inexact):
            continue
        value = it.value
        if isinstance(value, jax.Array) and not (multi and value.is_fully_addressable):
            groups.setdefault(frozenset(value.sharding.device_set), []).append(it)
        elif not np.all(np.isfinite(np.asarray(value))):
            bad.append(it.record["keypath"] or it.record["name"])
    for group in groups.values():
        flags = _all_finite_flags([it.value for it in group])
        flags = np.asarray(flags.addressable_data(0))
        bad += [it.record["keypath"] or it.record["name"] for it, ok in zip(group, flags) if not ok]
    return bad
