"""Multi-process start-up: ``trainer.distributed`` and JAX's multi-controller runtime.

Every host runs the same command; ``jax.distributed.initialize`` connects them, after which
``jax.devices()`` lists every device of every process and the trainer builds one global mesh.

* **Automatic** (the default): initialise when the environment says this is one of several processes
  -- a multi-host TPU slice, a SLURM job step with several tasks, an Open MPI launch -- and let JAX read
  the coordinator address and process ids from that environment.
* **Explicit**: ``coordinator_address`` (``host:port`` of process 0), ``num_processes`` and
  ``process_id`` (and optionally ``local_device_ids``), for clusters JAX cannot detect or for tests on
  one machine (127.0.0.1).

Bad settings fail fast with the config key named: a process id out of range, an unreachable
coordinator (after ``initialization_timeout`` seconds, not a hang), and -- checked right after start-up --
processes launched with different configs (a digest of each process's config is compared).

Agreeing without stopping the devices. Two kinds of agreement between processes are offered here:

* :class:`KeyValueStore`, the coordinator's key-value store (``key_value_set``, ``blocking_key_value_get``),
  for threads other than the training thread: a background checkpoint write tells process 0 it is done
  through it, never through a device collective, which would have to be ordered with the train steps.
  JAX 0.10 exposes the store only as ``jax._src.distributed.global_state.client``; ``_runtime_client``
  here is the one place that reaches for it.
* :func:`start_process_sum` / :func:`read_process_sum`, a sum over processes computed on the devices,
  dispatched at one step and read at the next, for decisions every process must take at the same step
  (a save due by process 0's clock, a stop requested by a signal on any process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import List, Optional, Union

import jax
import numpy as np

__all__ = [
    "DistributedStartupError",
    "KeyValueStore",
    "detected_cluster",
    "DistributedConfig",
    "config_digest",
    "check_same_config_everywhere",
    "barrier",
    "key_value_store",
    "read_process_sum",
    "start_process_sum",
]

logger = logging.getLogger(__name__)


class DistributedStartupError(RuntimeError):
    """The multi-process runtime could not start (unreachable coordinator, missing processes)."""


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def detected_cluster() -> str | None:
    """The kind of multi-process launch this environment looks like, or None for a single process."""
    tpu_hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(tpu_hosts) > 1 or (_env_int("MEGASCALE_NUM_SLICES") or 1) > 1:
        return "tpu"
    if (_env_int("SLURM_NTASKS") or _env_int("SLURM_STEP_NUM_TASKS") or 1) > 1 and "SLURM_PROCID" in os.environ:
        return "slurm"
    if (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "mpi"
    return None


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start-up: explicit settings, or what a cluster launcher (SLURM, MPI, TPU) provides."""

    # host:port of process 0's coordinator; null: from the cluster launcher, if any.
    coordinator_address: Optional[str] = None
    # Processes in the run; null: from the cluster launcher.
    num_processes: Optional[int] = None
    # This process's index in [0, num_processes); null: from the cluster launcher.
    process_id: Optional[int] = None
    # Local devices this process uses (one id or a list); null: all of them.
    local_device_ids: Optional[Union[int, List[int]]] = None
    # None: initialise when explicit settings are given or a cluster launch is detected.
    initialize_jax_distributed: Optional[bool] = None
    # Seconds to wait for every process to join before giving up with an error.
    initialization_timeout: int = 300

    @property
    def explicit(self) -> bool:
        return any(v is not None for v in (self.coordinator_address, self.num_processes, self.process_id))

    def validate(self) -> None:
        if not self.explicit:
            return
        missing = [k for k in ("coordinator_address", "num_processes", "process_id") if getattr(self, k) is None]
        if missing:
            raise ValueError(
                f"trainer.distributed: explicit start-up needs coordinator_address, num_processes and process_id; "
                f"missing {', '.join(missing)}"
            )
        if self.num_processes < 1:
            raise ValueError(f"trainer.distributed.num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"trainer.distributed.process_id={self.process_id} is out of range for num_processes="
                f"{self.num_processes} (valid: 0..{self.num_processes - 1})"
            )
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"trainer.distributed.coordinator_address must be host:port, got {self.coordinator_address!r}"
            )
        if self.initialization_timeout < 1:
            raise ValueError(f"trainer.distributed.initialization_timeout must be >= 1, got {self.initialization_timeout}")

    def should_initialize(self) -> bool:
        if self.initialize_jax_distributed is not None:
            return self.initialize_jax_distributed
        return self.explicit or detected_cluster() is not None

    def initialize(self) -> None:
        """Start JAX's multi-process runtime if this is a multi-process launch (idempotent)."""
        self.validate()
        if not self.should_initialize() or _is_initialized():
            return
        kwargs = dict(initialization_timeout=self.initialization_timeout)
        if self.explicit:
            kwargs.update(
                coordinator_address=self.coordinator_address,
                num_processes=self.num_processes,
                process_id=self.process_id,
            )
        if self.local_device_ids is not None:
            kwargs["local_device_ids"] = self.local_device_ids
        where = self.coordinator_address or f"auto-detected ({detected_cluster() or 'jax'})"
        if self.explicit and self.process_id != 0:
            # JAX aborts the whole process (no exception) when the coordinator never answers; probe it first
            # so the user gets an error that names the address.
            _wait_for_coordinator(self.coordinator_address, self.initialization_timeout)
        logger.info("initializing jax.distributed: coordinator %s", where)
        try:
            jax.distributed.initialize(**kwargs)
        except Exception as e:  # noqa: BLE001 -- JAX raises several runtime error types here
            raise DistributedStartupError(
                f"trainer.distributed: could not start the multi-process runtime with coordinator {where} within "
                f"{self.initialization_timeout} s ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                "Check that every process was started, that the coordinator address is reachable from this host, "
                "and that all processes use the same num_processes."
            ) from None
        logger.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
                    jax.local_device_count(), jax.device_count())


def _wait_for_coordinator(address: str, timeout: float) -> None:
    import socket
    import time

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, timeout)):
                return
        except OSError as e:
            last = e
            time.sleep(0.25)
    raise DistributedStartupError(
        f"trainer.distributed: the coordinator {address} did not answer within {timeout:g} s "
        f"(trainer.distributed.initialization_timeout); last error: {last}. Start process 0 (which hosts the "
        "coordinator) and check trainer.distributed.coordinator_address."
    )


def _is_initialized() -> bool:
    return jax.distributed.is_initialized()


class KeyValueStore:
    """The multi-process runtime's key-value store (hosted by process 0's coordinator), usable from any
    thread. Keys are written once; a read waits for its key up to a timeout."""

    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def get(self, key: str, timeout_s: float) -> str:
        """The value of ``key``, once some process has set it; raises after ``timeout_s`` seconds (or when
        the coordinator is gone)."""
        return self._client.blocking_key_value_get(key, int(timeout_s * 1000))

    def delete(self, key: str) -> None:
        """Delete ``key`` (a directory of keys, with a trailing ``/``)."""
        self._client.key_value_delete(key)


def _runtime_client():
    """The client of the runtime's coordinator that ``jax.distributed.initialize`` made, or None.

    The one use of JAX's private API in the project: jax 0.10.2 has no public accessor for this client
    (``jax.distributed`` exports only ``initialize``, ``is_initialized`` and ``shutdown``; JAX's own
    ``multihost_utils`` and array serialization read the same private attribute). Replace it here when
    JAX makes the key-value store public."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def key_value_store() -> KeyValueStore | None:
    """The key-value store of the multi-process runtime; None in a single-process run (not initialised)."""
    if not jax.distributed.is_initialized():
        return None
    client = _runtime_client()
    return None if client is None else KeyValueStore(client)


_SUMS: dict = {}


def start_process_sum(value: int) -> jax.Array:
    """The sum over processes of each process's ``value``, as a device computation that is dispatched and
    not waited for (``multihost_utils`` helpers wait for their result): queued behind the step the trainer
    dispatched last, it is read at the next step boundary with :func:`read_process_sum` without waiting
    for the step queued since. Every process must call it, in the same order."""
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(devices, ("processes", "local_devices"))
    mine = np.array([int(value)], dtype=np.int32)
    spread = multihost_utils.host_local_array_to_global_array(mine, mesh, PartitionSpec("processes"))
    fn = _SUMS.get(mesh)
    if fn is None:  # traced once per mesh
        fn = _SUMS[mesh] = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))
    return fn(spread)


def read_process_sum(started: jax.Array) -> int:
    """The value of a :func:`start_process_sum` (waits for it)."""
    return int(np.asarray(started.addressable_data(0)))


def config_digest(encoded_config: dict) -> str:
    """A digest of a config as every process must agree on it (per-process start-up fields removed)."""
    cfg = json.loads(json.dumps(encoded_config, sort_keys=True, default=str))
    dist = cfg.get("trainer", {}).get("distributed")
    if isinstance(dist, dict):
        for k in ("process_id", "local_device_ids"):
            dist.pop(k, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def check_same_config_everywhere(encoded_config: dict) -> None:
    """Raise if any process was launched with a different config (multi-process only)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = config_digest(encoded_config)
    mine = np.frombuffer(bytes.fromhex(digest)[:16], dtype=np.uint32)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    differing = [p for p in range(everyone.shape[0]) if not np.array_equal(everyone[p], everyone[0])]
    if differing:
        raise ValueError(
            f"the processes were launched with different configs: processes {differing} differ from process 0 "
            f"(this is process {jax.process_index()}, config digest {digest[:16]}). Launch every process with the "
            "same config and overrides."
        )


def barrier(name: str) -> None:
    """Wait for every process (no-op for a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
