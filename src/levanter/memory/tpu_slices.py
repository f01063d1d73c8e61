"""TPU slices by the names users type (``v5e-256``, ``v4-64``, ``v5p-128``, ``v6e-8``): the topology the TPU
compiler takes, the chips per host, the torus wrap, and each chip's memory.

One table, read by ``train_lm --dry_run --slice NAME`` (:mod:`levanter.memory.slice_plan`), which compiles the
train step for a slice the machine it runs on does not have. The names follow Google Cloud's accelerator
types: ``v5e-N`` and ``v6e-N`` count chips (``v5litepod-N`` and ``v6e-N`` are the same slices), ``v4-N`` and
``v5p-N`` count TensorCores, two per chip, so ``v4-64`` is 32 chips (``v4:2x4x4``). Only the shapes Cloud
offers are listed; an unknown name is refused with the list of known ones rather than guessed at.

Torus wrap: v4 and v5p slices of a whole 4x4x4 cube or more have wraparound links in every dimension;
smaller ones, and every v5e and v6e slice, are meshes without them. The wrap changes the compiler's
collective algorithms, not the memory a chip needs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
    # The topology prefix libtpu takes: "v5e" in "v5e:16x16".
    prefix: str
    # High-bandwidth memory of one chip, in bytes.
    hbm: int
    # Whether the name's number counts TensorCores (two per chip: v4, v5p) rather than chips.
    counts_cores: bool
    # Chip count -> the topology's shape ("16x16"), for the slices Cloud offers.
    shapes: dict
    # Chips per host, as libtpu's chips_per_host_bounds (x, y, z).
    host_bounds: tuple
    # libtpu's chip_config_name: "megacore" makes a v4 chip's two TensorCores one JAX device, as a v4 run
    # sees them ("default" there would give one device per core); v5p's default is one device per chip.
    chip_config: str = "default"


_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
       512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}

GENERATIONS = {
    "v4": Generation("v4", 32 * GIB, True, _3D, (2, 2, 1), "megacore"),
    "v5p": Generation("v5p", 95 * GIB, True, _3D, (2, 2, 1)),
    "v5e": Generation("v5e", 16 * GIB, False, _2D, (2, 2, 1)),
    "v6e": Generation("v6e", 32 * GIB, False, _2D, (2, 2, 1)),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """One slice: ``name`` as given (normalised), its chips and topology, its chip's memory."""

    name: str
    generation: str
    chips: int
    shape: str  # "16x16", "2x4x4"
    hbm: int  # bytes per chip
    host_bounds: tuple
    wrap: tuple
    chip_config: str = "default"

    @property
    def topology(self) -> str:
        """The topology name libtpu takes: ``v5e:16x16``."""
        return f"{self.generation}:{self.shape}"

    @property
    def dims(self) -> tuple:
        return tuple(int(x) for x in self.shape.split("x"))

    def chips_per_host_bounds(self) -> tuple:
        """libtpu's bounds for this slice: the generation's hosts, cut down to a slice smaller than one."""
        dims = self.dims + (1,) * (3 - len(self.dims))
        return tuple(min(b, d) for b, d in zip(self.host_bounds, dims))


def slice_names() -> list[str]:
    """Every name :func:`parse_slice` knows, by generation, smallest first."""
    out = []
    for gen, g in GENERATIONS.items():
        out += [f"{gen}-{chips * 2 if g.counts_cores else chips}" for chips in sorted(g.shapes)]
    return out


def _names_text() -> str:
    parts = []
    for gen, g in GENERATIONS.items():
        sizes = [str(c * 2 if g.counts_cores else c) for c in sorted(g.shapes)]
        what = "TensorCores, 2 per chip" if g.counts_cores else "chips"
        parts.append(f"{gen}-{{{','.join(sizes)}}} ({what})")
    return "; ".join(parts)


def parse_slice(name: str, flag: str = "--slice") -> TpuSlice:
    """``v5e-256`` -> the slice; an unknown or impossible name is a ``ValueError`` listing the known ones."""
    m = re.fullmatch(r"\s*([a-zA-Z0-9]+?)-(\d+)\s*", name or "")
    gen = m.group(1).lower() if m else ""
    gen = _ALIASES.get(gen, gen)
    g = GENERATIONS.get(gen)
    count = int(m.group(2)) if m else 0
    chips: Optional[int] = None
    if g is not None:
        chips = count // 2 if g.counts_cores and count % 2 == 0 else (None if g.counts_cores else count)
    if g is None or chips not in g.shapes:
        raise ValueError(
            f"{flag} {name!r} is not a TPU slice this plan knows; valid names: {_names_text()}; "
            f"e.g. {flag} v5e-256 or {flag} v4-64"
        )
    shape = g.shapes[chips]
    dims = tuple(int(x) for x in shape.split("x"))
    torus = g.counts_cores and chips >= 64  # v4 / v5p: a whole 4x4x4 cube or more wraps around
    wrap = tuple([torus] * 3)
    canonical = f"{gen}-{count}"
    return TpuSlice(canonical, gen, chips, shape, g.hbm, g.host_bounds, wrap if len(dims) == 3 else (False,) * 3,
                    g.chip_config)


__all__ = ["GENERATIONS", "Generation", "TpuSlice", "parse_slice", "slice_names"]
