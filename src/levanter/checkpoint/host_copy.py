"""Host copies of a checkpoint's arrays, so that the write can run after the training step has moved on.

The train step donates its state: once the next step starts, the device buffers of the state a save was
handed are reused. A background save therefore first copies what this process will write to host
memory -- for each ``jax.Array`` its addressable replica-0 shards (exactly the shards
``async_serialize`` would write), for each host value a private copy -- and then writes from those
copies (:func:`write_host_shards`), producing the same zarr3 arrays, chunk for chunk, as a synchronous
save does.

All transfers are started before the first one is waited for (``copy_to_host_async``), so the device
copies overlap. On the CPU backend ``np.asarray`` of a device array is a view of the device buffer, not
a copy, so there the host copy is made explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts

__all__ = ["HostShards", "host_copies", "write_host_shards"]


@dataclass
class HostShards:
    """The replica-0 shards of a ``jax.Array`` that this process addresses, copied to host memory."""

    shape: tuple[int, ...]
    dtype: np.dtype
    shard_shape: tuple[int, ...]
    shards: list[tuple[tuple[slice, ...], np.ndarray]]  # (index into the global array, data)

    @property
    def nbytes(self) -> int:
        return sum(int(d.nbytes) for _, d in self.shards)


def _is_view_of_device_memory(x: jax.Array) -> bool:
    return any(d.platform == "cpu" for d in x.devices())


def _to_host(x: jax.Array) -> np.ndarray:
    host = np.asarray(x)
    return host.copy() if _is_view_of_device_memory(x) else host


def host_copies(values: list[Any]) -> list[Any]:
    """``values`` with every array replaced by a host copy that the caller may keep after the device
    buffers are donated: a :class:`HostShards` for a ``jax.Array`` written shard by shard, a numpy array
    for everything else. Returns once every copy is complete."""
    multi = jax.process_count() > 1
    started: list[tuple[str, Any]] = []
    for value in values:
        if isinstance(value, jax.Array) and not (multi and value.is_fully_addressable):
            shards = [s for s in value.addressable_shards if s.replica_id == 0]
            for s in shards:
                s.data.copy_to_host_async()
            started.append(("shards", (value, shards)))
        elif isinstance(value, jax.Array):  # a process-local array in a multi-process job: a host value
            value.copy_to_host_async()
            started.append(("array", value))
        else:
            started.append(("numpy", value))
    out: list[Any] = []
    for kind, payload in started:
        if kind == "shards":
            value, shards = payload
            out.append(HostShards(
                shape=tuple(int(d) for d in value.shape),
                dtype=np.dtype(value.dtype),
                shard_shape=tuple(int(d) for d in value.sharding.shard_shape(value.shape)),
                shards=[(s.index, _to_host(s.data)) for s in shards],
            ))
        elif kind == "array":
            out.append(_to_host(payload))
        else:
            out.append(np.array(payload, copy=True))  # the caller may change its numpy arrays in place
    return out


async def write_host_shards(value: HostShards, spec: dict, context: ts.Context, *,
                            creates_metadata: bool) -> None:
    """Write ``value``'s shards into the zarr3 array ``spec``; ``creates_metadata``: this process writes
    ``zarr.json`` (the others open the array assuming it, as ``async_serialize(primary_host=0)`` does)."""
    if creates_metadata:
        await ts.open(ts.Spec(spec), create=True, open=True, context=context)
    store = await ts.open(ts.Spec(spec), open=True, assume_metadata=True, context=context)
    for index, data in value.shards:
        # One shard at a time: chunks of different shards are disjoint files, and writing them in sequence
        # keeps TensorStore from staging a second copy of every shard at once.
        await store[index].write(data, can_reference_source_data_indefinitely=True)
