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

Trade-offs: parsing a debug dump's text, whose format XLA does not promise, rather than an API: where the
dump holds no such allocation (another compiler version), :meth:`ReserveDump.read` returns None and the
slice plan totals the compiler's temporaries, saying so. And a compile served from JAX's persistent
compilation cache writes no dump, so only compiles that bypass it (a slice plan's) read the reserve; a
run's check before its first step weighs the compiler's figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile
from typing import Iterator, Optional

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


__all__ = ["DUMP_SUFFIX", "ReserveDump", "preallocated_temp", "reserve_dump"]
