"""What the platform the tests run on allows: float32 tolerances, device counts and local sockets.

The suite is written for CPU (8 simulated devices, the default tests/conftest.py sets). It also runs on one
TPU chip, in one process (``JAX_PLATFORMS=tpu python -m pytest -m "not slow" -p no:xdist``); there:

* float32 work rounds differently. conftest sets ``jax_default_matmul_precision`` to ``highest`` (the TPU
  default runs a float32 matmul as bfloat16 passes, about three digits), and even then the TPU's matmul
  accumulation order and transcendental functions (exp, log, tanh) differ from the CPU's in the last bits:
  relative errors of 3e-5 to 7e-5 were measured where the CPU agrees to 1e-6. :func:`tol` widens a CPU
  tolerance tenfold there;
* there is one device, so tests that build 8-device meshes skip (``@pytest.mark.devices(8)``);
* the local servers (moto S3, the GCS emulator, the fault proxy, Ray, a jax.distributed coordinator) are not
  started: TPU machines may refuse TCP sockets even on the loopback (``@pytest.mark.sockets``);
* subprocesses run JAX on the CPU (conftest sets ``JAX_PLATFORMS=cpu`` for them once this process holds
  the chip: one process at a time can open a TPU).

``ON_TPU`` is decided when this module is first imported (by conftest, before it points subprocesses at
the CPU): with ``JAX_PLATFORMS=cpu`` (the default) JAX is not touched, otherwise the backend is opened.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

import pytest


def _detect_tpu() -> bool:
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return False
    import jax

    return jax.default_backend() == "tpu"


ON_TPU: bool = _detect_tpu()

# A float32 tolerance written for the CPU is this many times wider on a TPU (see the module docstring).
TPU_TOLERANCE_FACTOR = 10.0


def tol(cpu_value: float) -> float:
    """``cpu_value`` on CPU (unchanged), ``TPU_TOLERANCE_FACTOR`` times it on a TPU, where float32
    matmuls and transcendentals round differently even at ``highest`` precision."""
    return cpu_value * TPU_TOLERANCE_FACTOR if ON_TPU else cpu_value


NO_SOCKETS_ENV = "LEVANTER_TEST_NO_SOCKETS"


def no_sockets_reason() -> Optional[str]:
    """Why tests that need local TCP servers cannot run here, or None when they can.

    ``LEVANTER_TEST_NO_SOCKETS=1`` turns them off, ``=0`` turns them on (also on a TPU); unset, they are
    off on a TPU and wherever a socket cannot be bound on 127.0.0.1."""
    setting = os.environ.get(NO_SOCKETS_ENV, "")
    if setting == "1":
        return f"{NO_SOCKETS_ENV}=1: tests that start local servers or open sockets are off"
    if ON_TPU and setting != "0":
        return (f"on a TPU the local servers are not started (TPU machines may refuse TCP sockets); "
                f"{NO_SOCKETS_ENV}=0 runs them")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"this machine refuses a TCP socket on 127.0.0.1 ({e})"
    return None


def require_sockets() -> None:
    """Skip the calling test (or fixture) when local TCP servers cannot run here."""
    reason = no_sockets_reason()
    if reason is not None:
        pytest.skip(reason)


def require_devices(n: int) -> None:
    """Skip the calling test when JAX has fewer than ``n`` devices."""
    import jax

    have = jax.device_count()
    if have < n:
        pytest.skip(f"needs {n} devices, the {jax.default_backend()} backend has {have} "
                    f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} simulates them)")
