"""What the TPU runtime reserves for a compiled program's temporaries, read from XLA's buffer assignment.

A TPU's ``memory_stats()`` counts a program's arguments and outputs as ``peak_bytes_in_use`` and holds its
temporaries apart, as ``peak_bytes_reserved``. What the runtime reserves is the program's one temporary
allocation in HBM, the ``preallocated-temp`` allocation of the default memory space (color 0) in the
buffer assignment that XLA:TPU computes after its HLO optimizations: every temporary buffer of the program
has a fixed offset inside it. The compiler's ``memory_analysis().temp_size_in_bytes`` is larger: it
counts more than that allocation, which the runtime does not reserve (what more, the compiler's reports
do not break down). On a v5e chip
(libtpu 0.0.42) the runtime reserved that allocation to within 0.1 % for the three shipped benchmark
configs, while the compiler's temporaries were 6 %, 14 % and 33 % above it
(docs/guides/planning-a-slice.md, "Plan against the chip").

The allocation is not in ``memory_analysis()``: its ``serialized_buffer_assignment_proto`` is empty for
the TPU compiler. It is read from the text dump XLA writes when a compile is given ``xla_dump_to``
(``*after_optimizations-buffer-assignment.txt``: one ``allocation N: size S, ...`` line per allocation,
with ``color C`` for memory spaces other than HBM's, ``preallocated-temp`` for the temporaries). The dump
(the program's HLO as text, tens of megabytes for a large step) goes to a temporary directory removed
after the compile; the compiled program is the same with or without it.

A compile served from JAX's persistent compilation cache writes no dump (the dump options are left out of
the cache's key, so the compile that wrote the dump is the entry the next launch loads). So a reserve read
from a dump is also recorded beside the cache (:func:`record_reserve`: one small JSON file per program under
``<cache>/levanter-tpu-reserve/``, keyed by the program's StableHLO without locations, the devices and the
compiler's version), and a compile that wrote none finds it there (:func:`recorded_reserve`). A record is
only ever read for the same program on the same compiler, which the cache would have served the same
executable for.

Trade-offs: parsing a debug dump's text, whose format XLA does not promise, rather than an API: where the
dump holds no such allocation (another compiler version), :meth:`ReserveDump.read` returns None, and the
checks weigh the compiler's temporaries (an upper bound), saying so. Where neither dump nor record says
(a cache filled by another program, a record that could not be written) the same holds: a missing record
costs headroom, never a step that does not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Any, Iterator, Optional, Sequence

from levanter.utils import fs

logger = logging.getLogger(__name__)

# One allocation's line of the text dump, e.g.
#   allocation 11: size 134431232, preallocated-temp:
#   allocation 12: size 109051904, color 1, preallocated-temp:
#   allocation 1: size 33554432, parameter 0, shape |f32[8,1024,1024]| at ShapeIndex {}, maybe-live-out:
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+)(.*)$", re.M)
_COLOR = re.compile(r"\bcolor (\d+)\b")
DUMP_SUFFIX = "after_optimizations-buffer-assignment.txt"


def preallocated_temp(text: str) -> Optional[int]:
    """The bytes of the temporary allocation in HBM (color 0) of a buffer-assignment dump, or None if the
    dump has none. Other memory spaces (VMEM, SMEM: the chip's on-core scratchpads) are not HBM."""
    found = None
    for m in _ALLOCATION.finditer(text):
        rest = m.group(2)
        # The attributes before the first "|" (a parameter's shape, which may contain anything).
        head = rest.split("|", 1)[0]
        color = _COLOR.search(head)
        if "preallocated-temp" in head and (color is None or color.group(1) == "0"):
            found = (found or 0) + int(m.group(1))
    return found


@dataclasses.dataclass
class ReserveDump:
    """A compile's buffer-assignment dump: pass :attr:`options` as the compile's ``compiler_options``, then
    :meth:`read` the runtime's reserve."""

    directory: str

    @property
    def options(self) -> dict:
        return {"xla_dump_to": self.directory, "xla_dump_hlo_as_text": True}

    def read(self) -> Optional[int]:
        """The HBM the TPU runtime reserves for the compiled program's temporaries; None where the dump has
        no one buffer assignment with a temporary allocation (a compiler that writes none)."""
        # One module per compile ("module_0000.jit_flat.cl_....after_optimizations-buffer-assignment.txt");
        # XLA's CPU compiler names its dumps "...cpu_after_optimizations-...", which the "." leaves out.
        paths = glob.glob(os.path.join(self.directory, f"*.{DUMP_SUFFIX}"))
        if len(paths) != 1:
            return None
        with open(paths[0]) as f:
            return preallocated_temp(f.read())


@contextlib.contextmanager
def reserve_dump() -> Iterator[ReserveDump]:
    """A :class:`ReserveDump` in a temporary directory, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="levanter-buffer-assignment-") as d:
        yield ReserveDump(d)


RECORDS = "levanter-tpu-reserve"  # the records' folder inside JAX's compilation cache directory


def program_key(lowered_text: str, devices: Sequence[Any]) -> str:
    """The record's key of a program: its StableHLO text (without locations: ``Lowered.as_text()``), the
    devices' kind and number, and the compiler's version (a new libtpu may assign buffers differently)."""
    h = hashlib.sha256()
    for part in (devices[0].client.platform_version, devices[0].device_kind, str(len(devices)), lowered_text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _record_path(cache_dir: str, key: str) -> str:
    return fs.join(cache_dir, RECORDS, f"{key}.json")


def record_reserve(cache_dir: str, key: str, reserved: int) -> None:
    """Record a program's reserve beside the compilation cache (best effort: a record that cannot be
    written only costs a later launch the compiler's larger figure)."""
    path = _record_path(cache_dir, key)
    try:
        fs.makedirs(fs.join(cache_dir, RECORDS))
        fs.atomic_write_text(path, json.dumps({"preallocated_temp_bytes": int(reserved)}))
    except Exception as e:  # noqa: BLE001 -- an optional record; the run goes on without it
        logger.info("could not record the TPU runtime's reserve at %s (%s); a launch served from the "
                    "compilation cache will weigh the compiler's figure", path, e)


def recorded_reserve(cache_dir: str, key: str) -> Optional[int]:
    """A program's reserve as :func:`record_reserve` recorded it; None where there is no (readable) record."""
    path = _record_path(cache_dir, key)
    try:
        value = json.loads(fs.read_text(path))["preallocated_temp_bytes"]
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 -- an unreadable record is no record
        logger.info("ignoring the TPU runtime's reserve recorded at %s: %s", path, e)
        return None
    return value if isinstance(value, int) and value > 0 else None


__all__ = ["DUMP_SUFFIX", "RECORDS", "ReserveDump", "preallocated_temp", "program_key", "record_reserve",
           "recorded_reserve", "reserve_dump"]
