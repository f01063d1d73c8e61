#!/usr/bin/env python
"""How long a checkpoint save stops the training loop: synchronous against background saves.

    .venv/bin/python scripts/bench/checkpoint_block.py --quick                 # CPU, 2 M parameters
    .venv/bin/python scripts/bench/checkpoint_block.py --params 350e6          # a 350 M model + Adam: 4.2 GB
    .venv/bin/python scripts/bench/checkpoint_block.py --params 350e6 --dir gs://bucket/tmp/ckpt-bench

The state is a training state of ``--params`` float32 parameters and Adam's two moments (12 bytes per
parameter), in leaves of at most 16 M elements (the big ones sharded over every device, as FSDP does),
made on the devices. After one untimed save per mode, a jitted step that donates the state stands in for the train step. For each mode,
interleaved over ``--repeats``: ``Checkpointer.on_step`` is timed (what the loop waits for: the whole save
when synchronous; the checks and the copy to host memory when in the background), then, for a background
save, the loop keeps stepping until the write commits (the step time while a write is in flight says how
much the write slows training down), then the save's total time from the call to the commit. Each
checkpoint is deleted afterwards. ``--verify`` loads the last background checkpoint and compares it with
the state it was taken from, bit for bit.

The table goes to stdout, followed by one line of JSON (the last line) with the medians:
``sync_block_s``, ``async_block_s``, ``async_total_s``, ``block_ratio`` (background over synchronous;
goal <= 0.1). ``run_all.py`` runs this as its ``checkpoint`` section. Figures belong in
docs/performance.md ("Checkpoints").
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import tempfile
import time

from _common import note_load_average, parser, write_json

QUICK = dict(params=2e6, repeats=3)
FULL = dict(params=2e7, repeats=3)
_LEAF_ELEMENTS = 16 * 2**20


def _leaf_shapes(params: int) -> list[tuple[int, int]]:
    """Shapes of the parameter leaves: rows of 1,024, at most _LEAF_ELEMENTS each, summing to ``params``."""
    cols = 1024
    rows_total = max(1, math.ceil(params / cols))
    per_leaf = max(1, _LEAF_ELEMENTS // cols)
    shapes = []
    while rows_total > 0:
        rows = min(per_leaf, rows_total)
        shapes.append((rows, cols))
        rows_total -= rows
    return shapes


def make_state(params: int):
    """``{"params", "mu", "nu"}`` (float32 leaves on the devices) and a donating step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    n = len(jax.devices())

    def sharding(shape):
        return NamedSharding(mesh, P("data") if shape[0] % n == 0 else P())

    shapes = _leaf_shapes(params)
    state = {}
    for group, seed in (("params", 0), ("mu", 1), ("nu", 2)):
        leaves = {}
        for i, shape in enumerate(shapes):
            make = jax.jit(lambda k, shape=shape: jax.random.normal(k, shape, jnp.float32),
                           out_shardings=sharding(shape))
            leaves[f"w{i}"] = make(jax.random.PRNGKey(seed * 10_000 + i))
        state[group] = leaves
    state["step"] = jnp.zeros((), jnp.int32)

    @jax.jit
    def _step(s):
        out = jax.tree.map(lambda x: x * jnp.float32(0.999) + jnp.float32(1e-3), s)
        out["step"] = s["step"] + 1
        return out

    step = jax.jit(_step, donate_argnums=(0,))
    return jax.block_until_ready(state), step


def _remove(path: str) -> None:
    from levanter.checkpoint.layout import remove_dir
    from levanter.utils import fs

    if fs.is_url(path):
        remove_dir(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def run(cfg: dict, directory: str | None = None, verify: bool = False) -> dict:
    import jax
    import numpy as np

    from levanter.checkpoint import Checkpointer, CheckpointInterval, load_checkpoint
    from levanter.utils import fs

    params = int(float(cfg["params"]))
    state, step_fn = make_state(params)
    nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(state))
    own_dir = directory is None
    base = tempfile.mkdtemp(prefix="levanter-ckpt-bench-") if own_dir else directory
    results = {"sync": {"block": []}, "async": {"block": [], "total": [], "step_during": [], "steps_during": []}}
    step_times = []
    try:
        for _ in range(8):  # compile the step, and a free-running step time to compare against
            t0 = time.perf_counter()
            state = jax.block_until_ready(step_fn(state))
            step_times.append(time.perf_counter() - t0)
        free_step = statistics.median(step_times[3:])
        checkpointers = {mode: Checkpointer(fs.join(base, mode), save_interval=None, keep=[CheckpointInterval(1)],
                                            asynchronous=mode == "async") for mode in ("sync", "async")}
        step = 0
        for mode, ck in checkpointers.items():  # untimed: compiles the finite check, warms the storage
            step += 1
            ck.on_step(state, step)
            ck.wait_until_finished()
            _remove(ck.path_for_step(step))
        last_async = None
        for r in range(cfg["repeats"]):
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                ck = checkpointers[mode]
                state = jax.block_until_ready(step_fn(state))
                step += 1
                t0 = time.perf_counter()
                ck.on_step(state, step)
                blocked = time.perf_counter() - t0
                results[mode]["block"].append(blocked)
                if mode == "async":
                    during = []
                    expected = jax.tree.map(lambda x: np.array(x, copy=True), state) if verify else None
                    while ck.writing:  # the loop trains on while the write is in flight
                        t1 = time.perf_counter()
                        state = jax.block_until_ready(step_fn(state))
                        during.append(time.perf_counter() - t1)
                    ck.wait_until_finished()
                    results[mode]["total"].append(ck.last_save_s)
                    results[mode]["steps_during"].append(len(during))
                    if during:
                        results[mode]["step_during"].append(statistics.median(during))
                    if verify:
                        last_async = (ck.path_for_step(step), expected)
                if not (verify and mode == "async" and r == cfg["repeats"] - 1):
                    _remove(ck.path_for_step(step))
        verified = None
        if verify and last_async is not None:
            path, expected = last_async
            template = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), expected)
            got = load_checkpoint(template, path)
            verified = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                           for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)))
            _remove(path)
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)

    def med(xs):
        return statistics.median(xs) if xs else None

    out = {
        "bench": "checkpoint_block", "platform": jax.default_backend(), "devices": jax.device_count(),
        "params": params, "state_bytes": nbytes, "leaves": len(jax.tree.leaves(state)), "repeats": cfg["repeats"],
        "storage": "object store" if fs.is_url(base) else "local disk",
        "sync_block_s": med(results["sync"]["block"]), "async_block_s": med(results["async"]["block"]),
        "async_total_s": med(results["async"]["total"]), "free_step_s": free_step,
        "step_during_write_s": med(results["async"]["step_during"]),
        "steps_during_write": med(results["async"]["steps_during"]),
        "all": results,
    }
    out["block_ratio"] = out["async_block_s"] / out["sync_block_s"]
    if verify:
        out["verified_bit_for_bit"] = verified
    return out


def print_section(r: dict) -> None:
    print(f"\nCheckpoint save: {r['params'] / 1e6:,.0f} M parameters + Adam = {r['state_bytes'] / 2**30:.2f} GiB in "
          f"{r['leaves']} leaves, {r['devices']} {r['platform']} device(s), {r['storage']}, median of {r['repeats']}")
    print(f"{'mode':<12} {'loop blocked s':>15} {'save total s':>13}")
    print(f"{'synchronous':<12} {r['sync_block_s']:>15.3f} {r['sync_block_s']:>13.3f}")
    print(f"{'background':<12} {r['async_block_s']:>15.3f} {r['async_total_s']:>13.3f}")
    during = r["step_during_write_s"]
    print(f"background / synchronous blocking: {r['block_ratio']:.3f}x (goal <= 0.1x); step "
          f"{r['free_step_s'] * 1e3:.1f} ms free, "
          + (f"{during * 1e3:.1f} ms while a write is in flight" if during is not None else "no step during the write"))
    if "verified_bit_for_bit" in r:
        print(f"the background checkpoint reloads bit for bit: {r['verified_bit_for_bit']}")


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help=f"{QUICK['params']:.0e} parameters (CPU, seconds)")
    p.add_argument("--params", type=float, default=None, help="parameters (the state is 12 bytes per parameter)")
    p.add_argument("--repeats", type=int, default=None, help="saves per mode")
    p.add_argument("--dir", default=None, help="where to save (a local directory or gs:// / s3:// URL); "
                                               "default a temporary directory")
    p.add_argument("--verify", action="store_true", help="reload the last background save and compare")
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    note_load_average()
    cfg = dict(QUICK if args.quick else FULL)
    if args.params is not None:
        cfg["params"] = args.params
    if args.repeats is not None:
        cfg["repeats"] = args.repeats
    res = run(cfg, args.dir, args.verify)
    print_section(res)
    write_json(args.json, res)
    print(json.dumps({k: v for k, v in res.items() if k != "all"}))


if __name__ == "__main__":
    main()
