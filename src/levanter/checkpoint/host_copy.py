"""Copies of a checkpoint's arrays, so that the write can run after the training step has moved on.

The train step donates its state: once the next step starts, the device buffers of the state a save was
handed are reused. A background save therefore first takes copies the step cannot touch
(:func:`take_snapshot`), leaf by leaf, in one of three ways:

* **On the devices**, for the leaves the devices have room for beside the step's peak use (buffers plus
  the memory the runtime reserves for the compiled programs' temporaries, and a margin): a
  device-to-device copy, waited for (it runs at HBM bandwidth: milliseconds). The writer thread moves it
  to host memory while the next steps train, then frees it.
* **Into the host's pinned memory** (``policy="pinned"`` or ``"pinned-async"``; not by default, see below),
  where the devices have a ``pinned_host`` memory: a transfer (a DMA straight into memory the device can write) started for every leaf at once,
  then waited for together; the result is an array of its own, which the next step cannot change, and the
  writer thread turns it into numpy without another transfer. The loop is held for the transfers, not for
  a conversion and copy of each array into new host memory. With ``policy="pinned-async"`` (every array
  transferred) the transfers are not waited for: the next step, which donates the source buffers, is
  dispatched at once and the runtime has to run it after the transfers that read them (whether a runtime
  orders a donation after pending reads is what ``scripts/bench/checkpoint_loop.py --verify`` checks on an
  accelerator; the CPU backend does).
* **In host memory, waited for** (:func:`host_copies`): the leaves the devices have no room for (by
  default), or every leaf (``policy="host"``): the loop waits for each array's conversion.

On a TPU v5e chip the transfer into pinned host memory ran at 0.3-0.6 GB/s, against 14.5 GB/s for the
waited host copy (a 350 M model's 4.2 GB state in 0.29 s; docs/bench/2026-12-07-checkpoints.md): the
default (``"auto"``) copies on the devices what fits and the rest to host memory. GPT-2 small's state fits
and is copied on the device; most of the 350 M model's goes to host memory.

Every way, the write is from host copies -- for each ``jax.Array`` its addressable replica-0 shards
(exactly the shards ``async_serialize`` would write), for each host value a private copy -- through
:func:`write_host_shards`, producing the same zarr3 arrays, chunk for chunk, as a synchronous save does.
On the CPU backend ``np.asarray`` of a device array is a view of the device buffer, not a copy, so there
the host copy is made explicitly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.sharding import SingleDeviceSharding

__all__ = [
    "SNAPSHOT_POLICIES",
    "HostShards",
    "PendingShards",
    "finish_snapshot",
    "host_copies",
    "plan_snapshot",
    "take_snapshot",
    "write_host_shards",
]

logger = logging.getLogger(__name__)

PINNED_HOST = "pinned_host"


@dataclass
class HostShards:
    """The replica-0 shards of a ``jax.Array`` that this process addresses, copied to host memory."""

    shape: tuple[int, ...]
    dtype: np.dtype
    shard_shape: tuple[int, ...]
    shards: list[tuple[tuple[slice, ...], np.ndarray]]  # (index into the global array, data)
    # Arrays in host memory that ``shards`` may be views of (pinned copies): kept alive until written.
    keep: list = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(int(d.nbytes) for _, d in self.shards)


@dataclass
class PendingShards:
    """The replica-0 shards of a ``jax.Array`` on their way to host memory (:func:`finish_snapshot`)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    shard_shape: tuple[int, ...]
    shards: list[tuple[tuple[slice, ...], jax.Array]]  # (index into the global array, copy)
    # True: device copies the save owns (freed once on the host); False: copies in pinned host memory.
    on_device: bool


def _is_view_of_device_memory(x: jax.Array) -> bool:
    return any(d.platform == "cpu" for d in x.devices())


def _to_host(x: jax.Array) -> np.ndarray:
    host = np.asarray(x)
    return host.copy() if _is_view_of_device_memory(x) else host


# Of a device's memory, the share left free beside a snapshot and the peak use: the allocator's
# fragmentation must not turn the next step, which runs while the snapshot exists, into an out-of-memory.
_SNAPSHOT_MARGIN = 0.05


def _room(devices) -> dict[Any, float]:
    """Bytes each device can give a snapshot beside the peak use seen so far (buffers, plus the memory the
    runtime reserves for the compiled programs' temporaries) and a margin of ``_SNAPSHOT_MARGIN`` of its
    memory. Devices without memory statistics (the CPU backend, whose "device memory" is host memory) have
    unlimited room."""
    room: dict[Any, float] = {}
    for device in devices:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            room[device] = float("inf")
            continue
        # A TPU's runtime holds the compiled programs' temporaries apart from the buffers (bytes_reserved):
        # the next step needs them back, so they count as used.
        used = (max(stats.get("peak_bytes_in_use", 0), stats.get("bytes_in_use", 0))
                + max(stats.get("peak_bytes_reserved", 0), stats.get("bytes_reserved", 0)))
        room[device] = stats["bytes_limit"] * (1 - _SNAPSHOT_MARGIN) - used
    return room


def _has_pinned_host(device) -> bool:
    try:
        return any(m.kind == PINNED_HOST for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 -- a backend without memory spaces
        return False


def _written_shards(value: jax.Array) -> list:
    return [s for s in value.addressable_shards if s.replica_id == 0]


def _is_global(value: Any) -> bool:
    """A ``jax.Array`` written shard by shard (not a process-local array of a multi-process job, which is
    written as a host value)."""
    return isinstance(value, jax.Array) and not (jax.process_count() > 1 and value.is_fully_addressable)


SNAPSHOT_POLICIES = ("auto", "pinned", "pinned-async", "host")


def take_snapshot(values: list[Any], *, policy: str = "auto",
                  room: dict[Any, float] | None = None) -> tuple[list[Any], str]:
    """``values`` made independent of the device buffers the next step donates; returns them and how:
    ``"device"``, ``"pinned"``, ``"device+pinned"`` (the leaves split between the two),
    ``"pinned-async"`` or ``"host"``.

    ``policy="auto"``: each ``jax.Array`` copied on its devices where they have room, else to host memory
    (:func:`plan_snapshot`), all waited for;
    ``"pinned"``: every array into pinned host memory where the devices have it, waited for;
    ``"pinned-async"``: the same, not waited for; ``"host"``: every array to host memory, waited for.
    Arrays not yet on the host come back as :class:`PendingShards`, which :func:`finish_snapshot` (on the
    writer thread) turns into :class:`HostShards`; host values are copied at once. ``room``: bytes per
    device free for device copies (default: measured, :func:`_room`)."""
    if policy not in SNAPSHOT_POLICIES:
        raise ValueError(f"snapshot policy must be one of {SNAPSHOT_POLICIES}, got {policy!r}")
    devices = {s.device for v in values if _is_global(v) for s in _written_shards(v)}
    # auto leaves pinned memory out: on a TPU v5e host the transfer into it ran at about 0.6 GB/s, slower
    # than the waited host copy (docs/bench/2026-12-07-checkpoints.md); "pinned" and "pinned-async" still
    # take it, for the benchmark.
    pinned = policy in ("pinned", "pinned-async") and all(_has_pinned_host(d) for d in devices)
    if policy != "auto":
        room = {d: 0.0 for d in devices}
    plan = plan_snapshot(values, _room(devices) if room is None else room, pinned=pinned)
    # Device copies first (each takes milliseconds), then every pinned transfer, all in flight together.
    copies = _copy_shards({i: values[i] for i, how in enumerate(plan) if how == "device"}, None)
    to_pin = [i for i, how in enumerate(plan) if how == "pinned"]
    wait = policy != "pinned-async"
    try:
        transfers = _copy_shards({i: values[i] for i in to_pin}, PINNED_HOST)
        if wait:  # nothing reads the state's buffers when the next step donates them
            jax.block_until_ready([x for p in transfers.values() for _, x in p.shards])
        copies.update(transfers)
    except Exception as e:  # noqa: BLE001 -- e.g. pinned memory exhausted: the sources are still intact
        logger.warning("checkpoint: the transfers into pinned host memory failed (%s); copying those arrays "
                       "to host memory instead", e)
        for i in to_pin:
            plan[i] = "host"
    jax.block_until_ready([x for p in copies.values() if p.on_device for _, x in p.shards])
    waited = iter(host_copies([v for v, how in zip(values, plan) if how == "host"]))
    out = [copies[i] if i in copies else next(waited) for i in range(len(values))]
    kinds = sorted({how for how, v in zip(plan, values) if isinstance(v, jax.Array)})
    if not wait:
        kinds = [k + "-async" if k == "pinned" else k for k in kinds]
    return out, "+".join(kinds) if kinds else "host"


def plan_snapshot(values: list[Any], room: dict[Any, float], *, pinned: bool) -> list[str]:
    """How :func:`take_snapshot` copies each value: ``"device"`` for a ``jax.Array`` whose replica-0 shards
    fit in what is left of ``room`` (bytes per device, taken in order), else ``"pinned"`` where ``pinned``
    (the devices have pinned host memory), else ``"host"``; host values (and process-local arrays of a
    multi-process job) ``"host"``."""
    room = dict(room)
    plan: list[str] = []
    for v in values:
        if not _is_global(v):
            plan.append("host")
            continue
        need: dict[Any, int] = {}
        for s in _written_shards(v):
            need[s.device] = need.get(s.device, 0) + s.data.nbytes
        if all(room.get(d, 0.0) >= n for d, n in need.items()):
            for d, n in need.items():
                room[d] -= n
            plan.append("device")
        else:
            plan.append("pinned" if pinned else "host")
    return plan


def _copy_shards(values: dict[int, jax.Array], memory_kind: str | None) -> dict[int, PendingShards]:
    """Start copying the replica-0 shards of ``values``: on their devices (``memory_kind`` None) or into that
    memory of their devices; one batched call for all."""
    if not values:
        return {}
    shards = {i: _written_shards(v) for i, v in values.items()}
    flat = [s for i in values for s in shards[i]]
    # may_alias=False: a copy even where jax could hand back the same buffers.
    copied = iter(jax.device_put([s.data for s in flat],
                                 [SingleDeviceSharding(s.device, memory_kind=memory_kind) for s in flat],
                                 may_alias=False))
    return {i: PendingShards(
        shape=tuple(int(d) for d in v.shape),
        dtype=np.dtype(v.dtype),
        shard_shape=tuple(int(d) for d in v.sharding.shard_shape(v.shape)),
        shards=[(s.index, next(copied)) for s in shards[i]],
        on_device=memory_kind is None,
    ) for i, v in values.items()}


def finish_snapshot(values: list[Any]) -> list[Any]:
    """``values`` with every :class:`PendingShards` replaced by its :class:`HostShards` once on the host
    (device copies are transferred, all at once, then freed; pinned transfers are waited for)."""
    for v in values:
        if isinstance(v, PendingShards) and v.on_device:
            for _, x in v.shards:
                x.copy_to_host_async()
    out = []
    for v in values:
        if not isinstance(v, PendingShards):
            out.append(v)
            continue
        if v.on_device:
            host = HostShards(v.shape, v.dtype, v.shard_shape, [(i, _to_host(x)) for i, x in v.shards])
            for _, x in v.shards:
                x.delete()
        else:  # already private host memory: a view of it is enough, kept alive with it
            host = HostShards(v.shape, v.dtype, v.shard_shape, [(i, np.asarray(x)) for i, x in v.shards],
                              keep=[x for _, x in v.shards])
        out.append(host)
    return out


def host_copies(values: list[Any]) -> list[Any]:
    """``values`` with every array replaced by a host copy that the caller may keep after the device
    buffers are donated: a :class:`HostShards` for a ``jax.Array`` written shard by shard, a numpy array
    for everything else (a private copy). Returns once every copy is complete."""
    started: list[tuple[str, Any]] = []
    for value in values:
        if _is_global(value):
            shards = _written_shards(value)
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
            out.append(np.array(payload, copy=True))
    return out


async def write_host_shards(value: HostShards, spec: dict, context: ts.Context, *,
                            creates_metadata: bool) -> None:
    """Write ``value``'s shards into the zarr3 array ``spec``; ``creates_metadata``: this process writes
    ``zarr.json`` (the others open the array assuming it, as ``async_serialize(primary_host=0)`` does)."""
    if creates_metadata:  # one open: the writer thread's Python work runs beside the loop's
        store = await ts.open(ts.Spec(spec), create=True, open=True, context=context)
    else:
        store = await ts.open(ts.Spec(spec), open=True, assume_metadata=True, context=context)
    for index, data in value.shards:
        # One shard at a time: chunks of different shards are disjoint files, and writing them in sequence
        # keeps TensorStore from staging a second copy of every shard at once.
        await store[index].write(data, can_reference_source_data_indefinitely=True)
