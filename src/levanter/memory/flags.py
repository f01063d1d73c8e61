"""The flags of ``train_lm --dry_run`` (the memory plan, :mod:`levanter.memory.plan`; with ``--slice``, the
slice plan, :mod:`levanter.memory.slice_plan`), split from the config's own arguments before draccus sees
them, and the vocabulary size a plan compiles for.

The flags are not config keys: they say what to compare the plan with (``--device_memory``,
``--peak_flops``, ``--step_seconds``), what to plan for (``--slice``, ``--num_slices``), and what the plan
cannot find on its own (``--vocab_size``, where the tokenizer is not at hand without the network). A value
flag without ``--dry_run`` is an error, since it does nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Optional, Sequence

from levanter.lm_config import TrainLmConfig
from levanter.memory.step import parse_bytes

FLAG_HELP = """\
memory plan (no training):
  --dry_run              compile the train step ahead of time and print, per device, the memory of the
                         parameters, optimizer state, batch and the step's temporaries, the total, and
                         the FLOPs per token; reads no data, allocates no parameters. On CPU, simulate the
                         run's devices: XLA_FLAGS=--xla_force_host_platform_device_count=8
  --device_memory SIZE   device memory to compare the total against (e.g. 16GiB, 80GB); default:
                         LEVANTER_DEVICE_MEMORY, else what the device reports, if it does. With it, the
                         plan says what per_device_parallelism: auto picks and, for a step that does not
                         fit, what each key that lowers it would make of it (compiled the same way)
  --vocab_size N         vocabulary size when the tokenizer is not available locally
  --peak_flops F         peak FLOP/s of one device (e.g. 989e12); default: known accelerators only
  --step_seconds S       a measured or expected step time: the plan prints the MFU it means
  --slice NAME           plan for a TPU slice this machine does not have, compiled by the TPU compiler
                         on this machine's CPU (levanter.memory.slice_plan; needs libtpu: pip install -e '.[tpu]'):
                         v5e-N / v6e-N count chips (v5e-8, v5e-256), v4-N / v5p-N count TensorCores, two
                         per chip (v4-64 is 32 chips). Prints per chip memory against the chip's HBM, FLOPs,
                         the bytes each kind of collective moves, and, for a step that does not fit, what
                         would (microbatch, remat, FSDP, a larger slice), each compiled
  --num_slices N         with --slice: N such slices over the data-center network (DCN), the data axis
                         across them; the collectives between slices are counted apart
exit status 3: the step does not fit the device's memory (0: it fits, or the memory is unknown)
"""

_VALUE_FLAGS = ("--device_memory", "--vocab_size", "--peak_flops", "--step_seconds", "--slice", "--num_slices")

# The exit status of a dry run whose plan does not fit the devices' memory (0: it fits, or the memory is
# unknown), so that a script can gate a launch on the plan; 2 stays a bad config, 1 a failure.
DOES_NOT_FIT_EXIT_CODE = 3


class PlanArgumentError(ValueError):
    """A bad ``--dry_run`` flag or value."""


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    device_memory: Optional[int] = None  # bytes
    vocab_size: Optional[int] = None
    peak_flops: Optional[float] = None  # per device
    step_seconds: Optional[float] = None
    # A TPU slice's name (levanter.memory.tpu_slices), planned by levanter.memory.slice_plan.
    slice: Optional[str] = None
    num_slices: Optional[int] = None  # with slice: that many slices over DCN


def split_plan_args(argv: Sequence[str]) -> tuple[Optional[PlanOptions], list[str]]:
    """The memory-plan flags out of ``argv``: ``(PlanOptions, the other arguments)`` with ``--dry_run``,
    ``(None, argv)`` without it. The value flags without ``--dry_run`` are an error (they do nothing else)."""
    rest: list[str] = []
    values: dict[str, str] = {}
    dry = False
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        name = a.split("=", 1)[0]
        if a == "--dry_run":
            dry = True
        elif name in _VALUE_FLAGS:
            if "=" in a:
                value = a.split("=", 1)[1]
            else:
                value = argv[i] if i < len(argv) else ""
                i += 1
            if not value or value.startswith("--"):
                raise PlanArgumentError(f"{name} needs a value (e.g. {name} {_EXAMPLES[name]})")
            values[name] = value
        else:
            rest.append(a)
    if not dry:
        if values:
            raise PlanArgumentError(f"{', '.join(values)} only applies to a memory plan: add --dry_run")
        return None, rest
    opts = PlanOptions(
        device_memory=_device_memory_flag(values["--device_memory"]) if "--device_memory" in values else None,
        vocab_size=_positive(values.get("--vocab_size"), "--vocab_size", int),
        peak_flops=_positive(values.get("--peak_flops"), "--peak_flops", float),
        step_seconds=_positive(values.get("--step_seconds"), "--step_seconds", float),
        slice=_slice_name(values.get("--slice")),
        num_slices=_positive(values.get("--num_slices"), "--num_slices", int),
    )
    if opts.num_slices is not None and opts.slice is None:
        raise PlanArgumentError("--num_slices applies to a slice plan: add --slice NAME (e.g. --slice v5e-256)")
    return opts, rest


def _slice_name(text: Optional[str]) -> Optional[str]:
    """The slice's name, checked against the table of levanter.memory.tpu_slices (an unknown one lists
    the known)."""
    if text is None:
        return None
    from levanter.memory.tpu_slices import parse_slice

    try:
        return parse_slice(text).name
    except ValueError as e:
        raise PlanArgumentError(str(e)) from None


_EXAMPLES = {
    "--device_memory": "16GiB", "--vocab_size": "128256", "--peak_flops": "989e12", "--step_seconds": "2.5",
    "--slice": "v5e-256", "--num_slices": "2",
}


def _device_memory_flag(text: str) -> int:
    """``--device_memory``'s bytes (:func:`levanter.memory.step.parse_bytes`), a bad size a flag error."""
    try:
        return parse_bytes(text, "--device_memory")
    except ValueError as e:
        raise PlanArgumentError(str(e)) from None

def _positive(text: Optional[str], flag: str, kind: Callable[[str], Any]):
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0) or (kind is int and value != int(value)):
        what = "a positive integer" if kind is int else "a positive number"
        raise PlanArgumentError(f"{flag} must be {what}, got {text!r} (e.g. {flag} {_EXAMPLES[flag]})")
    return int(value) if kind is int else value


# -- vocabulary --------------------------------------------------------------------------------------------
def plan_vocab(config: TrainLmConfig, given: Optional[int]) -> tuple[int, str]:
    """``(vocabulary size, where it came from)``: the tokenizer if it loads without the network, else
    ``given`` (``--vocab_size``); neither is an error naming both."""
    from levanter.ingest import HfTokenizer, load_tokenizer

    spec = (config.data.tokenizer or "").strip()
    padded = config.data.vocab_size
    tok, why_not = None, ""
    try:
        if spec in ("byte", "passthrough") or os.path.exists(os.path.expanduser(spec)):
            tok = load_tokenizer(spec, vocab_size=padded)
        else:
            cached = _hub_cache_file(spec)
            if cached is not None:
                tok = HfTokenizer.from_path(cached)
            else:
                why_not = f"tokenizer {spec!r} is not a local path and not in the local Hugging Face cache"
    except ValueError as e:
        why_not = str(e)
    if tok is not None:
        size = max(tok.vocab_size, padded or 0)
        source = f"the tokenizer {spec!r}" + (f" (padded by data.vocab_size={padded})" if padded else "")
        if given is not None and given != size:
            source += f"; --vocab_size {given} ignored"
        return size, source
    if given is not None:
        return given, f"--vocab_size; {why_not}"
    raise PlanArgumentError(
        f"data.tokenizer: {why_not}, so the memory plan does not know the vocabulary size: pass "
        "--vocab_size N (e.g. 128256 for Llama 3), or point data.tokenizer at a local tokenizer.json"
    )


def _hub_cache_file(name: str) -> Optional[str]:
    """``tokenizer.json`` of hub tokenizer ``name`` if the local Hugging Face cache has it (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # noqa: BLE001 -- a name the hub would reject: not cached either
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


__all__ = [
    "DOES_NOT_FIT_EXIT_CODE",
    "FLAG_HELP",
    "PlanArgumentError",
    "PlanOptions",
    "plan_vocab",
    "split_plan_args",
]
