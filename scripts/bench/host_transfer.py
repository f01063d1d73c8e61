#!/usr/bin/env python
"""How fast a training state moves from the devices to host memory, each way a checkpoint could copy it.

    .venv/bin/python scripts/bench/host_transfer.py                 # a 350M Llama's Adam state: 4.2 GB
    .venv/bin/python scripts/bench/host_transfer.py --gb 0.05 --repeats 2    # CPU: a quick run

A background save waits for the state's copy to host memory before the next step (which donates the
state's buffers) may run. On a TPU v5e chip (docs/bench/2026-12-07-checkpoints.md) the ``host`` way moved
4.2 GB in 0.29 s (14.5 GB/s) and every way into pinned host memory ran at about 0.33 GB/s. This separates
what the copy pays for. The state is float32 arrays on the first device, in the sizes of a Llama's
parameters and moments (``--gb`` in all); each way is timed ``--repeats`` times after a warm-up, and the
median reported in GB/s:

* ``host``: ``copy_to_host_async`` for every array, then ``np.asarray`` of each, in order: what
  ``checkpoint.host_copy.host_copies`` does today;
* ``host-threads-N``: the same, with the ``np.asarray`` calls spread over N threads;
* ``device-get``: ``jax.device_get`` of the whole list;
* ``pinned``: ``jax.device_put`` of every array into the device's ``pinned_host`` memory, waited for (where
  the backend has it), then ``pinned-again``: the same once more, to tell the first allocation of pinned
  memory from the transfer itself;
* ``jit-pinned``: one jitted program whose outputs are the arrays in ``pinned_host`` memory (XLA's own
  device-to-host copies inside a program, as host offloading does), waited for;
* ``compute`` and ``compute+jit-pinned``: a program of ``--compute-s`` seconds of bf16 matmuls alone, then
  the same program that also returns the arrays in ``pinned_host`` memory: whether the copies run beside the
  compute (the second close to the larger of ``compute`` and ``jit-pinned``) or after it (their sum);
* ``compute+pinned-async``: the compute program dispatched while ``pinned`` transfers are in flight (its
  inputs independent of them), both waited for;
* ``touch``: for scale, allocating and writing the same bytes in fresh numpy arrays (page faults, no
  transfer).

On the CPU backend the devices' memory is host memory and ``np.asarray`` returns a view: the figures there
only show that the script runs.

The last line is JSON: ``gb``, ``arrays``, ``device``, and per way ``{"seconds": median, "gb_per_s": ...}``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import _common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def state_shapes(total_bytes: float) -> list[tuple[int, ...]]:
    """Float32 shapes like a Llama's parameters (a 1024-wide model's matrices and norms), repeated three
    times (parameters and Adam's two moments) until ``total_bytes``."""
    layer = [(1024, 1024)] * 4 + [(1024, 2816)] * 3 + [(1024,)] * 2
    shapes, size = [], 0
    while size < total_bytes:
        for s in layer:
            shapes.append(s)
            size += 4 * int(np.prod(s))
    return shapes


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: compiles, first allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_program_ways(arrays, device, args) -> dict[str, float]:
    """The ``jit-pinned`` and ``compute...`` ways (the docstring's list): each timed ``args.repeats`` times
    on fresh device copies of ``arrays`` after a warm-up that compiles."""
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = SingleDeviceSharding(device)
    n = len(arrays)
    offload = jax.jit(lambda xs: xs, out_shardings=[pinned] * n)
    a = jax.device_put(jnp.ones((8192, 8192), jnp.bfloat16) / 8192, device)

    def chain(k):
        def f(x):
            for _ in range(k):
                x = (x @ a).astype(jnp.bfloat16)
            return x
        return f

    probe = jax.jit(chain(1))
    jax.block_until_ready(probe(a))
    start = time.perf_counter()
    jax.block_until_ready(probe(a))
    k = max(1, round(args.compute_s / max(time.perf_counter() - start, 1e-6)))
    compute = jax.jit(chain(k))
    both = jax.jit(lambda x, xs: (chain(k)(x), xs), out_shardings=(on_device, [pinned] * n))

    def fresh():
        copies = [x + 0 for x in arrays]
        jax.block_until_ready(copies)
        return copies

    def time_it(fn):
        fn(fresh())  # compiles
        times = []
        for _ in range(args.repeats):
            xs = fresh()
            start = time.perf_counter()
            fn(xs)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def pinned_async_beside_compute(xs):
        moving = jax.device_put(xs, [pinned] * n, may_alias=False)
        jax.block_until_ready((compute(a), moving))

    return {
        "jit-pinned": time_it(lambda xs: jax.block_until_ready(offload(xs))),
        "compute": time_it(lambda xs: jax.block_until_ready(compute(a))),
        "compute+jit-pinned": time_it(lambda xs: jax.block_until_ready(both(a, xs))),
        "compute+pinned-async": time_it(pinned_async_beside_compute),
    }


def main(argv=None) -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--gb", type=float, default=4.2, help="the state's size, in GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="4,8", help="thread counts for host-threads-N")
    parser.add_argument("--compute-s", type=float, default=0.8,
                        help="seconds of matmuls for the compute ways (about a 350M step)")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    shapes = state_shapes(args.gb * 1e9)
    arrays = [jax.device_put(jnp.full(s, i % 7, jnp.float32), device) for i, s in enumerate(shapes)]
    jax.block_until_ready(arrays)
    nbytes = sum(a.nbytes for a in arrays)

    def host():
        for a in arrays:
            a.copy_to_host_async()
        return [np.asarray(a) for a in arrays]

    def host_threads(n):
        def run():
            for a in arrays:
                a.copy_to_host_async()
            with ThreadPoolExecutor(n) as pool:
                return list(pool.map(np.asarray, arrays))
        return run

    def fresh_copies(fn):
        # A fresh device array each time: jax keeps an array's host value once fetched, so timing the same
        # arrays again would time nothing. The copies are made (at HBM speed) before the clock starts.
        def run():
            nonlocal arrays
            arrays = [a + 0 for a in arrays]
            jax.block_until_ready(arrays)
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return run

    def timed_fresh(fn):
        run = fresh_copies(fn)
        run()
        return statistics.median(run() for _ in range(args.repeats))

    ways = {"host": timed_fresh(host)}
    for n in (int(t) for t in args.threads.split(",") if t):
        ways[f"host-threads-{n}"] = timed_fresh(host_threads(n))
    ways["device-get"] = timed_fresh(lambda: jax.device_get(arrays))
    if "pinned_host" in [m.kind for m in device.addressable_memories()]:
        pinned = [SingleDeviceSharding(device, memory_kind="pinned_host")] * len(arrays)
        first = fresh_copies(lambda: jax.block_until_ready(jax.device_put(arrays, pinned, may_alias=False)))
        ways["pinned"] = first()
        ways["pinned-again"] = statistics.median(first() for _ in range(args.repeats))
        ways.update(in_program_ways(arrays, device, args))
    ways["touch"] = timed(lambda: [np.ones(a.shape, np.float32) for a in arrays], args.repeats)
    gb = nbytes / 1e9
    result = {"gb": gb, "arrays": len(arrays), "device": device.device_kind,
              "ways": {k: {"seconds": round(v, 4), "gb_per_s": round(gb / v, 3)} for k, v in ways.items()}}
    rows = [[k, f"{v['seconds']:.3f}", f"{v['gb_per_s']:.2f}"] for k, v in result["ways"].items()]
    _common.print_table(f"{gb:.2f} GB in {len(arrays)} float32 arrays, {device.device_kind}",
                        [("way", 20), ("seconds", 9), ("GB/s", 8)], rows)
    _common.write_json(args.json, result)
    print(json.dumps(result))


if __name__ == "__main__":
    _common.note_load_average()
    main(sys.argv[1:])
