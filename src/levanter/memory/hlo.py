"""The collectives of a compiled train step, read from its optimized HLO text: the bytes each kind moves
per chip per step, inside a TPU slice (ICI) and between slices (DCN).

A collective's bytes are the larger of its input and output buffer on one chip (the data it gathers,
reduces or exchanges), times the times it runs in a step (the trip counts of the loops around it). Wire
bytes depend on the algorithm (a ring sends about (n-1)/n of them); the figures are for comparing configs
and slices, not for a network model. The text format is XLA's; a form this parser does not know counts as
nothing rather than as a guess. Read by ``--dry_run --slice`` (:mod:`levanter.memory.slice_plan`).
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\b(?:calls|body|to_apply|branch_computations|true_computation|false_computation)="
                    r"\{?%?([\w.\-, %]+)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _bytes_of(types: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY.findall(types):
        if dtype not in _DTYPE_BYTES:
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
    return int(total)


@dataclasses.dataclass
class Collectives:
    """Bytes (per chip, per step) and counts of each kind of collective, inside a slice and between slices."""

    ici: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    dcn: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    ici_count: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    dcn_count: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})


def collectives(hlo: str) -> Collectives:
    """The collectives of a compiled (optimized) HLO module, each weighted by how often it runs in a step.

    A computation runs as often as the instructions that call it: the entry once, a while loop's body its
    ``known_trip_count`` times per run of the loop. The TPU compiler's asynchronous collective fusions copy
    one collective into its start, its continuations and its done; only the start counts (the copies whose
    ``async_collective_fusion_config`` starts at -1, or that have none). ``-done`` halves of async pairs
    are skipped. Transfers between slices are the ``send``s the compiler marks for the megascale runtime
    (``_xla_megascale_transfer_type``), sized by the larger of the send's and the matching receive's data.
    """
    comps, entry = _computations(hlo)
    if entry is None:
        return Collectives()
    runs = _runs(comps, entry)
    out = Collectives()
    recv_bytes: dict[str, int] = {}
    sends: list[tuple[str, str, int, int]] = []
    for name, lines in comps.items():
        times = runs.get(name, 0)
        if not times:
            continue
        for line in lines:
            m = _INSTR.match(line)
            if m is None:
                continue
            result_type, op, rest = m.group(2), m.group(3), m.group(4)
            if op in ("send", "recv") and "_xla_megascale_transfer_type" in line:
                rv = re.search(r'_xla_host_transfer_rendezvous="([^"]+)"', line)
                key = rv.group(1) if rv else m.group(1)
                data = _bytes_of(result_type.split("u32[]")[0])
                if op == "recv":
                    recv_bytes[key] = max(recv_bytes.get(key, 0), data)
                else:
                    kind = re.search(r'_xla_megascale_transfer_type="([A-Z_]+)"', line).group(1)
                    sends.append((key, kind.lower().replace("_", "-"), data, times))
                continue
            base = op[:-len("-start")] if op.endswith("-start") else op
            if base not in KINDS:
                continue
            if base == "all-reduce" and name.startswith("all-reduce-scatter"):
                base = "reduce-scatter"  # the TPU's fused all-reduce + slice: a reduce-scatter
            flag = re.search(r'"async_collective_fusion_config":\{"flag_start":"(-?\d+)"', line)
            if flag is not None and flag.group(1) != "-1":
                continue
            operands = rest.split("), ")[0]
            size = max(_bytes_of(result_type), _operand_bytes(operands, lines))
            out.ici[base] += size * times
            out.ici_count[base] += times
    _add_transfers(out, sends, recv_bytes)
    return out


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """``(computation name -> its instruction lines, the entry computation's name)`` of an HLO module."""
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo.splitlines():
        if current is None:
            m = _COMP_HEAD.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        comps[current].append(line)
    return comps, entry


def _runs(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per run of ``entry``: the callers' counts times a while loop's
    trip count for its body."""
    # Calls: computation -> [(callee, times per run of the caller)].
    calls: dict[str, list[tuple[str, int]]] = {}
    for name, lines in comps.items():
        out = []
        for line in lines:
            m = _INSTR.match(line)
            if m is None:
                continue
            trip = 1
            if m.group(3) == "while":
                t = _TRIP.search(line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                body = comps.get(cond.group(1), []) if cond else []
                trip = int(t.group(1)) if t else _trip_from_condition(body)
            for cm in _CALLS.finditer(line):
                key = cm.group(0).split("=")[0]
                for callee in re.split(r"[,\s]+", cm.group(1)):
                    callee = callee.strip().lstrip("%")
                    if callee in comps:
                        out.append((callee, trip if key == "body" else 1))
        calls[name] = out
    runs: dict[str, int] = {}

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        runs[name] = runs.get(name, 0) + times
        for callee, k in calls.get(name, ()):
            visit(callee, times * k, depth + 1)

    visit(entry, 1)
    return runs


def _add_transfers(out: Collectives, sends: list[tuple[str, str, int, int]],
                   recv_bytes: dict[str, int]) -> None:
    """The transfers between slices (``(rendezvous key, kind, bytes, times)`` of each send) into ``out.dcn``,
    each sized by the larger of its send's and its receive's data."""
    for key, kind, data, times in sends:
        if kind not in out.dcn:
            kind = {"allgather": "all-gather", "allreduce": "all-reduce"}.get(kind.replace("-", ""), kind)
        if kind not in out.dcn:
            out.dcn[kind] = 0
            out.dcn_count[kind] = 0
        out.dcn[kind] += max(data, recv_bytes.get(key, 0)) * times
        out.dcn_count[kind] += times


def _trip_from_condition(lines: list[str]) -> int:
    """A loop's trip count from its condition, ``counter < constant(N)`` (the form scans compile to);
    1 when the bound is not a constant (the figures are then lower bounds)."""
    constants = {}
    for line in lines:
        m = _INSTR.match(line)
        if m is not None and m.group(3) == "constant":
            value = re.match(r"\s*(-?\d+)\)", m.group(4))
            if value:
                constants[m.group(1)] = int(value.group(1))
    for line in lines:
        if "ROOT" in line and " compare(" in line and "direction=LT" in line:
            args = re.findall(r"%([\w.\-]+)", line.split(" compare(", 1)[1].split(")", 1)[0])
            bound = [constants[a] for a in args[1:] if a in constants]
            if bound:
                return max(bound[0], 1)
    return 1


def _operand_bytes(operands: str, lines: list[str]) -> int:
    """Bytes of an instruction's operands, from their types when printed inline, else their definitions."""
    inline = _bytes_of(operands)
    if inline:
        return inline
    total = 0
    for name in re.findall(r"%([\w.\-]+)", operands):
        for line in lines:
            m = _INSTR.match(line)
            if m is not None and m.group(1) == name:
                total += _bytes_of(m.group(2))
                break
    return total


__all__ = ["KINDS", "Collectives", "collectives"]
