"""Copies of a checkpoint's arrays, so that the write can run after the training step has moved on.

The train step donates its state: once the next step starts, the device buffers of the state a save was
handed are reused. A background save therefore first takes a copy the step cannot touch, in one of two
ways:

* **On the devices** (:func:`device_snapshot`), where they have room for a second copy of the state: a
  device-to-device copy of every array, waited for (it reads HBM at hundreds of GB/s: milliseconds for a
  350 M model's 4.2 GB of parameters and Adam moments), and the slow part, the transfer to host memory,
  runs on the writer thread while the next steps train. The snapshot is deleted as soon as its host copy
  is complete, so the extra device memory is held for one transfer's time.
* **In host memory** (:func:`host_copies`) otherwise, on the training thread: the loop waits for the
  transfer (all of them started before the first is waited for, so they overlap).

Either way the write is from the host copies -- for each ``jax.Array`` its addressable replica-0 shards
(exactly the shards ``async_serialize`` would write), for each host value a private copy -- through
:func:`write_host_shards`, producing the same zarr3 arrays, chunk for chunk, as a synchronous save does.
On the CPU backend ``np.asarray`` of a device array is a view of the device buffer, not a copy, so there
the host copy is made explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts

__all__ = ["HostShards", "device_snapshot", "host_copies", "write_host_shards"]


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


# Of a device's memory, the share left free beside a snapshot and the peak use: the allocator's
# fragmentation must not turn the next step, which runs while the snapshot exists, into an out-of-memory.
_SNAPSHOT_MARGIN = 0.05


def _room_for_a_copy(arrays: list[jax.Array]) -> bool:
    """Whether every device holding part of ``arrays`` has room for a second copy of its part beside the
    peak use seen so far (buffers, plus the memory the runtime reserves for the compiled programs'
    temporaries) and a margin of ``_SNAPSHOT_MARGIN`` of
    its memory. Devices without memory statistics (the CPU backend, whose "device memory" is host memory)
    count as having room."""
    need: dict[Any, int] = {}
    for x in arrays:
        for s in x.addressable_shards:
            need[s.device] = need.get(s.device, 0) + s.data.nbytes
    for device, nbytes in need.items():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            continue
        # A TPU's runtime holds the compiled programs' temporaries apart from the buffers (bytes_reserved):
        # the next step needs them back, so they count as used.
        used = (max(stats.get("peak_bytes_in_use", 0), stats.get("bytes_in_use", 0))
                + max(stats.get("peak_bytes_reserved", 0), stats.get("bytes_reserved", 0)))
        if stats["bytes_limit"] * (1 - _SNAPSHOT_MARGIN) - used < nbytes:
            return False
    return True


def device_snapshot(values: list[Any]) -> list[Any] | None:
    """``values`` with every ``jax.Array`` replaced by a copy in new device buffers (same sharding), which a
    step that donates the originals leaves intact, and every host value by a private copy; returns once the
    device copies are made. None (nothing copied) where some device lacks the room
    (:func:`_room_for_a_copy`): the caller copies to host memory instead."""
    arrays = [v for v in values if isinstance(v, jax.Array)]
    if not _room_for_a_copy(arrays):
        return None
    # may_alias=False: a copy even where jax could hand back the same buffers.
    out = [jax.device_put(v, v.sharding, may_alias=False) if isinstance(v, jax.Array)
           else np.array(v, copy=True) for v in values]
    # Waited for: a device-to-device copy takes milliseconds (the step it copies has finished), and the next
    # step then donates buffers that nothing is still reading.
    jax.block_until_ready([v for v in out if isinstance(v, jax.Array)])
    return out


def host_copies(values: list[Any], *, private: bool = True) -> list[Any]:
    """``values`` with every array replaced by a host copy that the caller may keep after the device
    buffers are donated: a :class:`HostShards` for a ``jax.Array`` written shard by shard, a numpy array
    for everything else (a private copy unless ``private`` is False: values the caller owns already).
    Returns once every copy is complete."""
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
        else:  # the caller may change its numpy arrays in place
            out.append(np.array(payload, copy=True) if private else payload)
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
