#!/usr/bin/env python
"""Attention backends: compiled temporaries and forward+backward time of blockwise (``jax_flash``)
against the materialised ``vanilla`` kernel, in one process, on this machine's JAX platform.

    .venv/bin/python scripts/bench/attention.py            # sequence 4,096, 8 heads, head size 64
    .venv/bin/python scripts/bench/attention.py --quick    # sequence 2,048

Each backend is one jitted ``value_and_grad`` of a scalar of the attention output over ``q``, ``k`` and
``v`` (packed documents via segment ids, as training sees them), built the way a model builds it: the
``vanilla`` mask is materialised inside the step. Temporaries are XLA's
``compile().memory_analysis().temp_size_in_bytes``; times are medians of interleaved repeats after a
warm-up. Goals: blockwise temporaries <= 0.25x vanilla, time <= 1.5x vanilla on CPU. Figures belong in
docs/bench/2026-12-03-attention-and-loss.md; ``run_all.py`` runs this as its ``attention`` section.
"""

from __future__ import annotations

import statistics
import time

from _common import note_load_average, parser, write_json

QUICK = dict(seq_len=2048, heads=8, head_size=64, batch=1, block=512, repeats=3)
FULL = dict(seq_len=4096, heads=8, head_size=64, batch=1, block=512, repeats=5)


def run(cfg: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import haliax as hax
    from haliax import Axis
    from levanter.models import attention_mask, dot_product_attention

    Batch, Pos = Axis("batch", cfg["batch"]), Axis("position", cfg["seq_len"])
    Heads, HeadSize = Axis("heads", cfg["heads"]), Axis("head_size", cfg["head_size"])
    rng = np.random.default_rng(0)
    shape = (Batch.size, Pos.size, Heads.size, HeadSize.size)
    q, k, v = (hax.named(jnp.asarray(rng.standard_normal(shape), jnp.float32), (Batch, Pos, Heads, HeadSize))
               for _ in range(3))
    # Documents of ~1,000 tokens packed into the row.
    seg = hax.named(jnp.asarray(np.arange(Pos.size)[None, :] // 1000, jnp.int32).repeat(Batch.size, 0), (Batch, Pos))

    def step(backend):
        def loss(qa, ka, va, seg):
            mask = attention_mask(Pos, seg, backend, cfg["block"])
            out = dot_product_attention(hax.named(qa, q.axes), hax.named(ka, k.axes), hax.named(va, v.axes), mask)
            return jnp.sum(jnp.sin(out.array))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    res: dict = {"config": cfg, "platform": jax.default_backend()}
    fns = {}
    for backend in ("vanilla", "jax_flash"):
        fn = step(backend)
        t0 = time.perf_counter()
        compiled = fn.lower(q.array, k.array, v.array, seg).compile()
        mem = compiled.memory_analysis()
        res[backend] = {"temp_bytes": int(mem.temp_size_in_bytes), "compile_s": time.perf_counter() - t0}
        jax.block_until_ready(compiled(q.array, k.array, v.array, seg))  # warm-up
        fns[backend] = compiled
    times = {b: [] for b in fns}
    for _ in range(cfg["repeats"]):
        for b, fn in fns.items():  # interleaved, so load changes hit both
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q.array, k.array, v.array, seg))
            times[b].append(time.perf_counter() - t0)
    for b in fns:
        res[b]["step_s"] = statistics.median(times[b])
        res[b]["step_s_all"] = times[b]
    res["temp_ratio"] = res["jax_flash"]["temp_bytes"] / res["vanilla"]["temp_bytes"]
    res["time_ratio"] = res["jax_flash"]["step_s"] / res["vanilla"]["step_s"]
    return res


def print_section(res: dict) -> None:
    c = res["config"]
    print(f"\nAttention: forward+backward, sequence {c['seq_len']}, {c['heads']} heads x {c['head_size']}, batch "
          f"{c['batch']}, block {c['block']}, platform {res['platform']}, median of {c['repeats']}")
    print(f"{'backend':<10} {'temporaries MiB':>16} {'step s':>8} {'compile s':>10}")
    for b in ("vanilla", "jax_flash"):
        r = res[b]
        print(f"{b:<10} {r['temp_bytes'] / 2**20:>16.1f} {r['step_s']:>8.3f} {r['compile_s']:>10.1f}")
    print(f"jax_flash / vanilla: temporaries {res['temp_ratio']:.3f}x (goal <= 0.25x), "
          f"time {res['time_ratio']:.2f}x (goal <= 1.5x on CPU)")


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="sequence 2,048 instead of 4,096")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    note_load_average()
    res = run(QUICK if args.quick else FULL)
    print_section(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
