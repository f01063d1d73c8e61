"""Restoring a checkpoint into the structure of a template tree (:func:`load_checkpoint`).

Only arrays come from storage; the tree structure and every non-array leaf come from the template.
Each process reads only the slices its own devices need (``async_deserialize`` with the target
sharding), with the host bytes held by reads in flight capped (:class:`_ByteLimiter`). Shapes and dtypes
must match the template (:class:`~levanter.checkpoint.errors.CheckpointMismatchError`); a missing,
truncated or damaged array is a :class:`~levanter.checkpoint.errors.CorruptCheckpointError` naming the
leaf. Typed PRNG key arrays are rewrapped from their stored ``key_data`` with the recorded implementation.

Trade-off: every leaf is opened without a prior existence check (one request fewer per leaf on object
stores); only a failed open asks whether the array is there, to tell "missing" from "damaged".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.experimental.array_serialization import serialization as jax_serialization

from levanter.checkpoint.errors import CheckpointMismatchError, CorruptCheckpointError
from levanter.checkpoint.layout import METADATA_FILENAME, read_checkpoint_metadata, resolve_path
from levanter.checkpoint.tree_format import (
    finish_all,
    is_template_leaf,
    leaf_name,
    one_line,
    read_spec,
    run_coroutine,
    shape_dtype,
    summarise,
    ts_context,
)
from levanter.utils import fs

__all__ = ["load_checkpoint"]

# Host memory one process may hold for reads in flight while loading (a soft cap, see _ByteLimiter).
_READ_BYTES_IN_FLIGHT = 16 * 1024**3


class _ByteLimiter:
    """Caps host bytes held by reads in flight (the interface ``async_deserialize`` expects)."""

    def __init__(self, limit: int):
        self._limit = limit
        self._available = limit
        self._cv = asyncio.Condition()

    async def wait_for_bytes(self, n: int) -> None:
        async with self._cv:
            # A single read larger than the cap waits for everything else to finish, then proceeds.
            await self._cv.wait_for(lambda: self._available >= min(n, self._limit))
            self._available -= n

    async def release_bytes(self, n: int) -> None:
        async with self._cv:
            self._available += n
            self._cv.notify_all()


def _key_data_sharding(
    sharding: jax.sharding.Sharding, ndim: int, extra: int
) -> jax.sharding.Sharding | None:
    """The sharding of ``key_data`` for a key array placed with ``sharding`` (trailing dims replicated)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec, *([None] * extra)))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


@dataclass
class _ToRead:
    record: dict
    keypath: str
    sharding: jax.sharding.Sharding | None  # None: return a numpy array
    numpy_scalar: bool


def _target_sharding(leaf: Any, explicit: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    if explicit is not None:
        return explicit
    if isinstance(leaf, jax.Array):
        return leaf.sharding
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return None  # numpy template leaf: restore on the host


async def _read_leaf(root: str, item: _ToRead, limiter: _ByteLimiter) -> Any:
    rec = item.record
    directory = fs.join(root, rec["name"])
    context = ts_context(root)

    def fail(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {root}: leaf {item.keypath} ({rec['name']}) {why}")

    spec = read_spec(directory)
    try:
        store = await ts.open(spec, open=True, context=context)
    except ValueError as e:
        # Asked only on failure: one existence check per leaf would cost a request each on object stores.
        zarr_json = fs.join(directory, "zarr.json")
        if not fs.retry_transient(fs.isfile, zarr_json, what=f"looking for {zarr_json}"):
            raise fail(f"is missing: there is no array at {directory}") from None
        raise fail(f"cannot be opened: {one_line(str(e))}") from e
    stored_shape = tuple(rec["stored_shape"])
    stored_dtype = np.dtype(rec["stored_dtype"])
    if tuple(store.shape) != stored_shape or store.dtype.numpy_dtype != stored_dtype:
        raise fail(
            f"holds {tuple(store.shape)} {store.dtype.numpy_dtype} but {METADATA_FILENAME} says "
            f"{stored_shape} {stored_dtype}"
        )
    try:
        if item.sharding is None:
            host = await store.read()
            return host[()] if item.numpy_scalar else host
        key_impl = rec.get("key_impl")
        if key_impl is None:
            return await jax_serialization.async_deserialize(
                item.sharding, spec, global_shape=stored_shape, dtype=stored_dtype, byte_limiter=limiter,
                context=context,
            )
        ndim = len(rec["shape"])
        data_sharding = _key_data_sharding(item.sharding, ndim, len(stored_shape) - ndim)
        if data_sharding is None:  # an exotic sharding: load on one device, then move the keys
            data_sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        data = await jax_serialization.async_deserialize(
            data_sharding, spec, global_shape=stored_shape, dtype=stored_dtype, byte_limiter=limiter,
            context=context,
        )
        keys = jax.random.wrap_key_data(data, impl=key_impl)
        if keys.sharding != item.sharding:
            keys = jax.device_put(keys, item.sharding)
        return keys
    except ValueError as e:  # tensorstore reports DATA_LOSS / NOT_FOUND chunk errors as ValueError
        raise fail(f"cannot be read (truncated or damaged chunk?): {one_line(str(e))}") from e


async def _read_all(root: str, items: list[_ToRead]) -> list[Any]:
    limiter = _ByteLimiter(_READ_BYTES_IN_FLIGHT)
    tasks = [asyncio.ensure_future(_read_leaf(root, it, limiter)) for it in items]
    results = await finish_all(tasks)
    for r in results:
        if isinstance(r, BaseException):
            raise r  # the first failing leaf in tree order
    return results


def _sharding_lookup(shardings: Any) -> Callable[[str], jax.sharding.Sharding | None]:
    if shardings is None:
        return lambda name: None
    if isinstance(shardings, jax.sharding.Sharding):
        return lambda name: shardings
    by_name = {
        leaf_name(path): s
        for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]
        if isinstance(s, jax.sharding.Sharding)
    }
    return by_name.get


def load_checkpoint(template_tree: Any, checkpoint_path: str, *, shardings: Any = None,
                    subpath: str | None = None) -> Any:
    """Restore a checkpoint into the structure of ``template_tree``.

    Array leaves of the template (``jax.Array``, numpy arrays/scalars, ``jax.ShapeDtypeStruct``) are
    replaced by the saved values; every other leaf and the tree structure are the template's. Each
    restored ``jax.Array`` gets the template leaf's sharding (a ``ShapeDtypeStruct`` without one: the
    first local device), unless ``shardings`` -- one ``Sharding`` for all leaves, or a pytree shaped
    like the template with ``Sharding`` leaves -- says otherwise. Numpy template leaves come back as
    numpy. Shapes and dtypes must match the template exactly (:class:`CheckpointMismatchError`);
    missing, truncated or damaged files raise :class:`CorruptCheckpointError`.

    ``subpath`` (upstream's name): restore only the subtree saved under that key (``"model"`` of a
    saved training state) into ``template_tree``; the checkpoint's other leaves are left alone.
    """
    root = resolve_path(checkpoint_path)
    doc = read_checkpoint_metadata(root)
    prefix = f"{subpath}/" if subpath else ""
    saved = {rec["name"][len(prefix):]: rec for rec in doc["leaves"] if rec["name"].startswith(prefix)}
    sharding_for = _sharding_lookup(shardings)

    flat, treedef = jax.tree_util.tree_flatten_with_path(template_tree)
    wanted: list[tuple[int, _ToRead]] = []
    names = []
    for i, (path, leaf) in enumerate(flat):
        if not is_template_leaf(leaf):
            continue
        name = leaf_name(path)
        names.append(name)
        if name not in saved:
            continue  # reported below, together with any others
        rec = saved[name]
        keypath = (subpath or "") + jax.tree_util.keystr(path)
        shape, dtype = shape_dtype(leaf)
        if list(shape) != rec["shape"] or str(dtype) != rec["dtype"]:
            raise CheckpointMismatchError(
                f"checkpoint {root}: leaf {keypath} is {tuple(rec['shape'])} {rec['dtype']} in the "
                f"checkpoint but {shape} {dtype} in the template"
            )
        target = _target_sharding(leaf, sharding_for(name))
        wanted.append((i, _ToRead(rec, keypath, target, isinstance(leaf, np.generic))))
    missing = sorted(set(names) - set(saved))
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {root} has no entry for template leaves {summarise([prefix + m for m in missing])} "
            "(was it saved from a different model or optimizer?)"
        )
    unexpected = sorted(set(saved) - set(names))
    if unexpected:
        raise CheckpointMismatchError(
            f"checkpoint {root} holds leaves {summarise([prefix + u for u in unexpected])} that the template "
            "does not have"
        )

    values = run_coroutine(_read_all(root, [item for _, item in wanted]))
    leaves = [leaf for _, leaf in flat]
    for (i, _), value in zip(wanted, values):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)
