#!/usr/bin/env python
"""Benchmark: is resuming the data loader at a late step as cheap as starting at step 0?

Two measurements, both in one run on the same machine:

1. **Time to first batch** from ``DataLoader.iter_from_step(s)`` for s in {0, 1e3, 1e6, 1e9}: for every
   repeat a fresh set of dataset objects (sources, shuffles, mixture) and a fresh loader (prefetch
   depth 8) is built (untimed), then the clock runs from ``iter_from_step(s)`` until the first batch is
   returned and its arrays are ready. Repeats are interleaved across steps so that drift affects all
   steps alike. Reported: median, min and max over repeats and the median's ratio to step 0 (goal:
   step 1e9 within 1.2x of step 0, i.e. resume cost independent of the step).
   A second table times the index arithmetic alone (``indices_for_step`` + the mixture's
   ``source_indices``), without threads or array assembly, to show it does not grow with the step.
2. **Steady throughput**: batches/s and examples/s over ``--steps`` consecutive steps (after a short
   untimed warm-up) with prefetch depth 8, for batch sizes 8 and 64 and mixture block sizes None and
   2048.

The dataset is a 3-source, 2-stage :class:`MixtureDataset` (``stop_strategy="restart"``); each source is
a :class:`ListAsyncDataset` over an int32 numpy array of shape ``(N, 128)`` wrapped with
``.shuffle(key=...)``.

Usage::

    .venv/bin/python scripts/bench/loader_index.py            # ~1 minute or less on 2 cores
    .venv/bin/python scripts/bench/loader_index.py --quick    # a few seconds
"""

from __future__ import annotations

from _common import parser, print_table  # noqa: E402 -- scripts/bench is on sys.path
import argparse
import asyncio
import os
import platform
import statistics
import time

import jax
import numpy as np

from levanter.data.dataset import ListAsyncDataset
from levanter.data.loader import DataLoader
from levanter.data.mixture import MixtureDataset
from levanter.schedule import BatchSchedule

RESUME_STEPS = (0, 10**3, 10**6, 10**9)
SOURCE_ROWS = {"web": 40_000, "code": 25_000, "books": 15_000}
STAGE_SWITCH_STEP = 250


def make_source_arrays(seq_len: int, scale: float) -> dict[str, np.ndarray]:
    """One int32 array per source; row ``i`` of source ``k`` starts with ``k * 10**7 + i``."""
    arrays = {}
    for k, (name, n) in enumerate(SOURCE_ROWS.items()):
        n = max(1, int(n * scale))
        arr = np.empty((n, seq_len), dtype=np.int32)
        arr[:] = np.arange(seq_len, dtype=np.int32)
        arr[:, 0] = k * 10**7 + np.arange(n, dtype=np.int32)
        arrays[name] = arr
    return arrays


def make_mixture(arrays, schedule: BatchSchedule, block_size: int | None) -> MixtureDataset:
    sources = {
        name: ListAsyncDataset(arr).shuffle(key=100 + k) for k, (name, arr) in enumerate(arrays.items())
    }
    weights = [
        (0, {"web": 0.6, "code": 0.3, "books": 0.1}),
        (STAGE_SWITCH_STEP, {"web": 0.3, "code": 0.3, "books": 0.4}),
    ]
    return MixtureDataset(
        sources, weights, batch_schedule=schedule, block_size=block_size, key=0, stop_strategy="restart"
    )


def make_loader(arrays, batch_size: int, block_size: int | None, prefetch_depth: int) -> DataLoader:
    """Fresh dataset objects and a fresh loader (the arrays themselves are shared, read-only)."""
    schedule = BatchSchedule(batch_size)
    return DataLoader(make_mixture(arrays, schedule, block_size), schedule, prefetch_depth=prefetch_depth)


def index_lookup_seconds(arrays, step: int, batch_size: int, block_size: int | None, calls: int) -> float:
    """Mean seconds per (loader.indices_for_step + mixture.source_indices) for ``step``, no I/O, no threads.

    This isolates the index arithmetic that resuming at ``step`` costs from thread start-up and
    array assembly, which dominate (and add noise to) the time to first batch.
    """
    loader = make_loader(arrays, batch_size, block_size, prefetch_depth=0)
    mixture = loader.dataset

    async def run() -> float:
        await mixture.source_indices(step, loader.indices_for_step(step))  # builds caches, untimed
        t0 = time.perf_counter()
        for _ in range(calls):
            await mixture.source_indices(step, loader.indices_for_step(step))
        return (time.perf_counter() - t0) / calls

    return asyncio.run(run())


def time_to_first_batch(arrays, step: int, batch_size: int, block_size: int | None) -> float:
    loader = make_loader(arrays, batch_size, block_size, prefetch_depth=8)
    t0 = time.perf_counter()
    it = loader.iter_from_step(step)
    try:
        batch = next(it)
        jax.block_until_ready(batch.data)
        elapsed = time.perf_counter() - t0
    finally:
        it.close()
    if batch.step != step:
        raise AssertionError(f"asked for step {step}, got {batch.step}")
    return elapsed


def steady_throughput(arrays, batch_size: int, block_size: int | None, steps: int, warmup: int) -> float:
    """Seconds for ``steps`` consecutive batches after ``warmup`` untimed ones."""
    loader = make_loader(arrays, batch_size, block_size, prefetch_depth=8)
    it = loader.iter_from_step(0)
    try:
        for _ in range(warmup):
            jax.block_until_ready(next(it).data)
        t0 = time.perf_counter()
        for k in range(steps):
            batch = next(it)
            jax.block_until_ready(batch.data)
        elapsed = time.perf_counter() - t0
    finally:
        it.close()
    if batch.step != warmup + steps - 1:
        raise AssertionError(f"expected to end at step {warmup + steps - 1}, got {batch.step}")
    return elapsed


def fmt_block(block_size: int | None) -> str:
    return "None" if block_size is None else str(block_size)


def fmt_step(step: int) -> str:
    return "0" if step == 0 else f"1e{len(str(step)) - 1}"


def stats_rows(block_sizes, per_key: dict, scale: float, fmt: str) -> list[list[str]]:
    """Rows of block_size, step, median, min, max (times ``scale``) and the median's ratio to step 0."""
    rows = []
    for b in block_sizes:
        base = statistics.median(per_key[(b, 0)])
        for s in RESUME_STEPS:
            xs = per_key[(b, s)]
            med = statistics.median(xs)
            cells = [format(v * scale, fmt) for v in (med, min(xs), max(xs))]
            rows.append([fmt_block(b), fmt_step(s), *cells, f"{med / base:.2f}x"])
    return rows


def main(argv=None) -> None:
    p = parser(
        __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps (smoke run, a few seconds)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per resume step (21; --quick: 5)")
    p.add_argument("--steps", type=int, default=None, help="timed throughput steps (500; --quick: 100)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before timing throughput")
    p.add_argument("--ttfb-batch-size", type=int, default=64, help="batch size for the resume tables")
    p.add_argument("--lookup-calls", type=int, default=200, help="calls averaged per index-lookup sample")
    p.add_argument("--seq-len", type=int, default=128, help="row length of each source array")
    p.add_argument("--goal", type=float, default=1.2, help="target step-1e9 / step-0 time ratio")
    args = p.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 21)
    steps = args.steps if args.steps is not None else (100 if args.quick else 500)
    scale = 0.25 if args.quick else 1.0
    block_sizes = (None, 2048)
    bs = args.ttfb_batch_size

    t_start = time.perf_counter()
    arrays = make_source_arrays(args.seq_len, scale)
    print(
        f"# loader_index benchmark: python {platform.python_version()}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}, {os.cpu_count()} CPUs; sources "
        + ", ".join(f"{n}={a.shape}" for n, a in arrays.items())
        + f"; stages switch at step {STAGE_SWITCH_STEP}; prefetch_depth=8"
    )

    # Warm up jax (device init, first array creation) and the code paths, untimed.
    for b in block_sizes:
        time_to_first_batch(arrays, 0, bs, b)
        time_to_first_batch(arrays, RESUME_STEPS[-1], bs, b)

    # 1. time to first batch, repeats interleaved across steps so drift hits every step alike
    ttfb: dict[tuple[int | None, int], list[float]] = {(b, s): [] for b in block_sizes for s in RESUME_STEPS}
    for _ in range(repeats):
        for b in block_sizes:
            for s in RESUME_STEPS:
                ttfb[(b, s)].append(time_to_first_batch(arrays, s, bs, b))
    cols = [("block_size", 10), ("step", 6), ("median ms", 10), ("min ms", 8), ("max ms", 8)]
    cols.append(("vs step 0", 10))
    print_table(
        f"Time to first batch, iter_from_step(s), batch {bs}, median of {repeats} (fresh loader+datasets)",
        cols,
        stats_rows(block_sizes, ttfb, 1e3, ".2f"),
    )
    for b in block_sizes:
        r = statistics.median(ttfb[(b, RESUME_STEPS[-1])]) / statistics.median(ttfb[(b, 0)])
        verdict = "meets" if r <= args.goal else "MISSES"
        print(f"block_size={fmt_block(b)}: step 1e9 / step 0 = {r:.2f}x ({verdict} goal <= {args.goal}x)")

    # 1b. the index arithmetic alone
    lookup = {
        (b, s): [index_lookup_seconds(arrays, s, bs, b, args.lookup_calls) for _ in range(repeats)]
        for b in block_sizes
        for s in RESUME_STEPS
    }
    cols = [("block_size", 10), ("step", 6), ("median us", 10), ("min us", 8), ("max us", 8)]
    cols.append(("vs step 0", 10))
    print_table(
        f"Index lookup alone (indices_for_step + MixtureDataset.source_indices), batch {bs}, "
        f"mean of {args.lookup_calls} calls, median of {repeats}",
        cols,
        stats_rows(block_sizes, lookup, 1e6, ".1f"),
    )

    # 2. steady throughput
    rows = []
    for batch_size in (8, 64):
        for b in block_sizes:
            secs = steady_throughput(arrays, batch_size, b, steps, args.warmup)
            rate = steps / secs
            examples = f"{rate * batch_size:.0f}"
            rows.append([str(batch_size), fmt_block(b), f"{secs:.3f}", f"{rate:.1f}", examples])
    print_table(
        f"Steady throughput over {steps} steps (after {args.warmup} warm-up), prefetch_depth=8",
        [("batch", 6), ("block_size", 10), ("seconds", 8), ("batches/s", 10), ("examples/s", 11)],
        rows,
    )

    print()
    print(f"# total wall time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
