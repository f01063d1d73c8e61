#!/usr/bin/env python
"""Grouped matrix products at the Mixtral row's shapes, one at a time: XLA's ragged dot against megablox's
Pallas kernels (``gmm``, ``tgmm``) over a range of tile sizes, with a dense product of the same work as the
yardstick.

The products of one mixture-of-experts layer's training step (``config/bench/mixtral_tpu.yaml``: 8 experts,
2 per token, width 1,024, experts 1,536 wide, 8,192 tokens a microbatch (4 sequences), so 16,384 rows sorted
by expert; ``--tokens`` for another microbatch):

* **forward** ``rows [m, k] @ w[g] -> [m, n]``: the gate and up projections (k 1,024, n 1,536, or both at
  once, n 3,072) and the down projection (k 1,536, n 1,024);
* **input gradient** ``g [m, n] @ w[g].T -> [m, k]`` (``gmm``'s ``transpose_rhs``; the ragged dot reads a
  transposed copy of the weights);
* **weight gradient** ``rows[group].T @ g[group] -> [groups, k, n]`` (``tgmm``).

Each way is timed as the median of ``--repeats`` calls dispatched back to back (the dispatch hidden behind the
device's work), after one call that compiles; a tiling the kernel refuses (too large for the core's vector
memory, or not dividing a dimension) is reported as such. Prints ms per call, TFLOP/s and the share of the
dense product's rate for every way, and the best tiling of each product.

    python scripts/bench/grouped_matmul.py [--chosen] [--repeats 20] [--json out.json]

About 5 minutes on a TPU v5e (a compile of a second or two per tiling); ``--chosen``, only the tilings that
``levanter.models.grouped_matmul`` picks, about 2 minutes. ``--allow-cpu`` runs a tiny size in
Pallas's interpreter (to check the script; it measures nothing).
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402 -- after the path insert above

GROUPS, TOKENS, TOP_K, WIDTH, EXPERT = 8, 8192, 2, 1024, 1536


def group_sizes(rows: int, groups: int):
    """An uneven split of ``rows`` over ``groups`` as a router trained with a load-balancing loss gives (each
    group within about 30 % of the mean), fixed by the seed."""
    import numpy as np

    rng = np.random.default_rng(0)
    share = rng.uniform(0.7, 1.3, groups)
    sizes = np.floor(share / share.sum() * rows).astype(np.int32)
    sizes[-1] += rows - sizes.sum()
    return sizes


def timed(fn, args, repeats: int) -> float:
    """Median seconds a call of ``fn(*args)``: ``repeats`` calls dispatched back to back, three times."""
    import jax

    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = [fn(*args) for _ in range(repeats)]
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / repeats)
    return statistics.median(runs)


def tilings(m: int, k: int, n: int, vmem_bytes: int):
    """Candidate (tm, tk, tn) for an ``[m, k] x [k, n]`` product: each dividing its dimension, their double-
    buffered bf16 tiles plus a float32 accumulator within ``vmem_bytes``."""
    out = []
    for tm, tk, tn in itertools.product((256, 512, 1024), (512, 1024, k), (512, 768, 1024, n)):
        if m % tm or k % tk or n % tn or tk > k or tn > n:
            continue
        need = 2 * 2 * (tm * tk + tk * tn + tm * tn) + 4 * tm * tn
        if need <= vmem_bytes and (tm, tk, tn) not in out:
            out.append((tm, tk, tn))
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--vmem-mib", type=float, default=14.0,
                    help="skip tilings needing more than this much of the core's vector memory")
    ap.add_argument("--chosen", action="store_true",
                    help="only the tilings levanter.models.grouped_matmul picks (gmm_tiling, tgmm_tiling)")
    ap.add_argument("--kinds", nargs="+", default=["forward", "input grad", "weight grad"],
                    help="the products to time (forward, 'input grad', 'weight grad')")
    ap.add_argument("--tokens", type=int, default=TOKENS,
                    help="tokens a microbatch (the row's 4 sequences of 2,048: 8,192; rows are twice that)")
    ap.add_argument("--tgmm-out", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"],
                    help="tgmm's output dtype(s) to time (it accumulates in float32 either way)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--allow-cpu", action="store_true", help="a tiny size in Pallas's interpreter (checks the script)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

    from levanter.models.grouped_matmul import gmm_tiling, tgmm_tiling

    on_cpu = jax.devices()[0].platform != "tpu"
    if on_cpu and not args.allow_cpu:
        sys.exit("grouped_matmul.py measures a TPU; pass --allow-cpu to check the script on this machine")
    scale = 16 if on_cpu else 1
    m, d, f = args.tokens * TOP_K // scale, WIDTH // scale, EXPERT // scale
    if on_cpu:
        args.repeats = 2
    sizes = jnp.asarray(group_sizes(m, GROUPS))
    key = jax.random.PRNGKey(0)

    def rand(*shape):
        nonlocal key
        key, sub = jax.random.split(key)
        return (jax.random.normal(sub, shape, jnp.float32) * 0.05).astype(jnp.bfloat16)

    rows_d, rows_f = rand(m, d), rand(m, f)
    w_df, w_dff, w_fd = rand(GROUPS, d, f), rand(GROUPS, d, 2 * f), rand(GROUPS, f, d)
    g_f, g_ff, g_d = rand(m, f), rand(m, 2 * f), rand(m, d)
    vmem = int(args.vmem_mib * 2**20)
    interpret = on_cpu

    # (product, kind, k, n, lhs, rhs) with rhs [groups, k, n] for the forward, [groups, n, k] for the input
    # gradient (read transposed), and the [m, n] cotangent for the weights' gradient.
    cases = [
        ("gate/up", "forward", d, f, rows_d, w_df),
        ("gate+up fused", "forward", d, 2 * f, rows_d, w_dff),
        ("down", "forward", f, d, rows_f, w_fd),
        ("gate/up", "input grad", f, d, g_f, w_df),
        ("gate+up fused", "input grad", 2 * f, d, g_ff, w_dff),
        ("down", "input grad", d, f, g_d, w_fd),
        ("gate/up", "weight grad", d, f, rows_d, g_f),
        ("gate+up fused", "weight grad", d, 2 * f, rows_d, g_ff),
        ("down", "weight grad", f, d, rows_f, g_d),
    ]
    results, best = [], {}
    for product, kind, k, n, lhs, rhs in cases:
        if kind not in args.kinds:
            continue
        flops = 2.0 * m * k * n
        dense_w = jnp.ones((k, n), jnp.bfloat16)
        dense_in = lhs if kind != "weight grad" else jnp.ones((m, k), jnp.bfloat16)
        ways = {"dense (same work)": (jax.jit(lambda a, b: a @ b), (dense_in, dense_w))}
        if kind == "forward":
            ways["ragged_dot"] = (jax.jit(lambda a, b: jax.lax.ragged_dot(a, b, sizes)), (lhs, rhs))
        elif kind == "input grad":
            ways["ragged_dot"] = (jax.jit(lambda a, b: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), sizes)),
                                  (lhs, rhs))
        chosen = (tgmm_tiling if kind == "weight grad" else gmm_tiling)(m, k, n)
        for tiling in [chosen] if args.chosen else tilings(m, k, n, vmem):
            if kind == "weight grad":
                for out in args.tgmm_out:
                    fn = jax.jit(lambda a, b, t=tiling, o=jnp.dtype(out): tgmm(
                        a.T, b, sizes, o, t, num_actual_groups=GROUPS, interpret=interpret).astype(jnp.bfloat16))
                    ways["tgmm %d,%d,%d" % tiling + ("" if out == "bfloat16" else " f32 out")] = (fn, (lhs, rhs))
            else:
                fn = jax.jit(lambda a, b, t=tiling: gmm(a, b, sizes, jnp.bfloat16, t,
                                                        transpose_rhs=kind == "input grad", interpret=interpret))
                ways["gmm %d,%d,%d" % tiling] = (fn, (lhs, rhs))
        dense_s = None
        for way, (fn, fargs) in ways.items():
            try:
                s = timed(fn, fargs, args.repeats)
            except Exception as e:  # a tiling the kernel or the compiler refuses
                results.append({"product": product, "kind": kind, "way": way, "ms": None,
                                "error": str(e).splitlines()[0][:120]})
                continue
            dense_s = s if dense_s is None else dense_s
            row = {"product": product, "kind": kind, "way": way, "ms": s * 1e3, "tflops": flops / s / 1e12,
                   "of_dense": dense_s / s, "m": m, "k": k, "n": n}
            results.append(row)
            print(f"  {product} {kind} {way}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s, "
                  f"{row['of_dense']:.2f} of dense", flush=True)
            if way != "dense (same work)":
                if (product, kind) not in best or s * 1e3 < best[product, kind]["ms"]:
                    best[product, kind] = row
        print(f"{product} {kind}: done ({len(ways)} ways)", flush=True)

    cols = [("product", 14), ("kind", 12), ("way", 20), ("ms", 8), ("TFLOP/s", 8), ("of dense", 8)]

    def cells(r):
        if r["ms"] is None:
            return [r["product"], r["kind"], r["way"], "refused", "", r["error"][:40]]
        return [r["product"], r["kind"], r["way"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", f"{r['of_dense']:.2f}"]

    print_table(f"every way (m {m}, groups {[int(s) for s in sizes]})", cols, [cells(r) for r in results])
    print_table("the fastest way of each product", cols, [cells(r) for r in best.values()])
    if args.json:
        write_json(args.json, {"group_sizes": [int(s) for s in sizes], "results": results,
                               "best": list(best.values())})


if __name__ == "__main__":
    main()
