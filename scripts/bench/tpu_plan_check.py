#!/usr/bin/env python
"""Benchmark check: a config's train step compiled on this TPU host's chip and, with the same libtpu, for
the named slice ``v5e-1`` (what ``train_lm --dry_run --slice v5e-1`` compiles on a machine without a TPU),
with the compiler's ``memory_analysis()`` of both and the chip's ``memory_stats()`` once the chip's
executable is loaded. Nothing runs and no parameters are allocated.

It separates the two ways a slice plan's figure can differ from what a run's chip reports: the compile
(the chip's against the named slice's: the same program and compiler, a different target description) and
the runtime's accounting (``peak_bytes_reserved`` against the compiler's temporaries and the reserve). Usage, on the TPU
host from the project root::

    python scripts/bench/tpu_plan_check.py config/bench/llama_350m_8k_tpu.yaml   # ~1-2 minutes
    python scripts/bench/tpu_plan_check.py CONFIG --no-slice                        # the chip's compile only

Prints one JSON object: per compile, the arguments, outputs, aliased and temporary bytes, their total
(arguments + outputs - aliased + temporaries), what the TPU runtime reserves for the temporaries
(``reserved``: the buffer assignment's allocation, which the chip's ``peak_bytes_reserved`` reports once
the step runs) and the total with it (``runtime_total``, the slice plan's ``total``), the compile's
seconds; and the chip's ``memory_stats()`` after its compile. JAX's persistent compilation cache is off:
a compile served from it writes no buffer assignment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def figures(memory, seconds: float) -> dict:
    compiled = memory.compiled
    if compiled is None:
        return {"oom": memory.oom, "total": memory.total, "seconds": seconds}
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    # What the TPU runtime reserves for the temporaries (levanter.memory.tpu_reserve): the figure to hold
    # against the chip's peak_bytes_reserved; runtime_total counts it in place of temp.
    out.update(reserved=memory.reserved, total=memory.total, runtime_total=memory.runtime_total,
               seconds=round(seconds, 1),
               tpu_custom_calls=compiled.as_text().count('custom_call_target="tpu_custom_call"'))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--vocab_size", type=int, default=32768)
    parser.add_argument("--slice", default="v5e-1")
    parser.add_argument("--no-slice", action="store_true", help="only the chip's compile")
    args, overrides = parser.parse_known_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import dataclasses

    import jax

    import levanter.config
    from levanter.lm_config import TrainLmConfig
    from levanter.memory import StepCompiler
    from levanter.memory.tpu_compile import compile_only, on_slice, slice_devices
    from levanter.memory.tpu_slices import parse_slice
    from levanter.training import lm_loss_fn

    config = levanter.config.parse_config(TrainLmConfig, args.config, overrides)
    config.trainer.apply_jax_config()
    jax.config.update("jax_enable_compilation_cache", False)
    tcfg = dataclasses.replace(config.trainer, require_accelerator=False)
    optimizer = config.optimizer.build(tcfg.num_train_steps)
    loss = lm_loss_fn(config.z_loss_weight, quantization=tcfg.quantization)
    result = {"config": args.config, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:
        import libtpu

        result["libtpu"] = getattr(libtpu, "__version__", None)
    except ImportError:
        result["libtpu"] = None
    start = time.perf_counter()
    chip = StepCompiler(config.model, tcfg, optimizer, loss, args.vocab_size).compile()
    result["chip"] = figures(chip, time.perf_counter() - start)
    try:
        result["chip_memory_stats"] = jax.devices()[0].memory_stats()
    except Exception as e:  # noqa: BLE001 -- CPU: none
        result["chip_memory_stats"] = repr(e)
    if not args.no_slice:
        devices = slice_devices(parse_slice(args.slice))
        start = time.perf_counter()
        with compile_only():
            planned = StepCompiler(config.model, on_slice(tcfg, devices), optimizer, loss, args.vocab_size).compile()
        result[args.slice] = figures(planned, time.perf_counter() - start)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
