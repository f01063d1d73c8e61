"""Peak dense bf16 FLOP/s per device, by JAX's ``device_kind``: the denominator of MFU.

The figures are the vendors' published dense (not sparse) bf16 peaks, one per chip (per GPU). A run's
MFU and the memory plan's step-time estimates divide by them; a device not in the table (CPUs, unknown
accelerators) gets no figure rather than a guess, so no MFU is reported for it.
"""

from __future__ import annotations

from typing import Optional

PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100": 312e12,
}


def peak_flops_per_device(device) -> Optional[float]:
    """The peak FLOP/s of ``device`` (anything with a ``device_kind``), or None when it is not in the
    table. The longest matching prefix wins, so ``TPU v5 lite`` is not read as ``TPU v5``."""
    kind = getattr(device, "device_kind", "")
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if kind.startswith(name):
            return PEAK_FLOPS[name]
    return None


__all__ = ["PEAK_FLOPS", "peak_flops_per_device"]
