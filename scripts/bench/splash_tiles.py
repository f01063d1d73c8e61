#!/usr/bin/env python
"""Splash attention's tiles on this TPU: forward and forward+backward time of the kernel alone, per tile setting.

The training step runs splash's forward kernel once per layer (its residuals are saved by the shipped remat
policies) and its fused backward kernel once; this times exactly that pair (``jax.vjp`` of the attention
output against a fixed cotangent) on the shapes of the benchmark configs, for each setting of
``model.splash_block_sizes`` listed below, in one process (each setting compiles in seconds, where a whole
training run per setting costs a minute or more of the chip). The forward and backward tiles are independent,
so the forward tiles are varied with the backward ones at their default and the other way round.

    python scripts/bench/splash_tiles.py [--shape llama_350m|gpt2_small|llama_350m_8k] [--repeats 20]

Prints one line per setting: forward ms, forward+backward ms, and the backward by difference, per layer call
(one microbatch of the shipped config). Needs a TPU (``--interpret`` runs the kernel in Pallas's interpreter
on any platform, at a tiny shape, to check the script).
"""

from __future__ import annotations

import argparse
import statistics
import time

# (batch per microbatch, kv heads, query heads per kv head, sequence, head size, default block)
SHAPES = {
    "llama_350m": (4, 8, 2, 2048, 64, 1024),
    "gpt2_small": (16, 12, 1, 1024, 64, 512),
    "llama_350m_8k": (1, 8, 2, 8192, 64, 512),
}


# (query block, key block, keys per inner step) settings, tried for the forward and for the backward kernel.
TILES = [(512, 512, 512), (512, 1024, 512), (512, 1024, 1024), (1024, 512, 512), (1024, 1024, 512),
         (1024, 1024, 1024), (2048, 512, 512), (256, 1024, 1024), (1024, 2048, 1024), (2048, 1024, 512)]


def settings(seq: int) -> list:
    """``(label, SplashBlockSizes fields)``: the default, then the forward tiles, then the backward tiles."""
    fits = [t for t in TILES if t[0] <= seq and t[1] <= seq]
    return (
        [("default", {})]
        + [(f"fwd q{q} kv{kv} c{c}", dict(block_q=q, block_kv=kv, block_kv_compute=c)) for q, kv, c in fits]
        + [(f"bwd q{q} kv{kv} c{c}", dict(block_q_dkv=q, block_kv_dkv=kv, block_kv_dkv_compute=c)) for q, kv, c in fits]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama_350m", choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from levanter.models.attention import SplashBlockSizes, splash_attention

    b, kvh, group, seq, hd, default = SHAPES[args.shape]
    if args.interpret:
        b, kvh, group, seq, hd, default = 1, 2, 2, 256, 64, 128
    elif jax.default_backend() != "tpu":
        raise SystemExit(f"error: splash runs on a TPU; jax's backend here is {jax.default_backend()!r} (--interpret)")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, kvh, group, seq, hd)) * hd**-0.5, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, kvh, seq, hd)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, kvh, seq, hd)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((b, kvh, group, seq, hd)), jnp.bfloat16)
    # Packed documents of random lengths (as the training data has them).
    seg = np.zeros((b, seq), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=max(1, seq // 700), replace=False))
        seg[i] = np.searchsorted(cuts, np.arange(seq), side="right")
    seg = jnp.asarray(seg)

    def timed(fn, *xs) -> float:
        jax.block_until_ready(fn(*xs))
        times = []
        for _ in range(args.repeats if not args.interpret else 1):
            t = time.perf_counter()
            jax.block_until_ready(fn(*xs))
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    print(f"shape {args.shape}: batch {b}, kv heads {kvh}, group {group}, sequence {seq}, head {hd}; "
          f"default block {default}; ms per call (one layer, one microbatch)")
    print(f"{'setting':<26}{'fwd':>9}{'fwd+bwd':>10}{'bwd':>9}")
    for label, fields in settings(seq):
        sizes = SplashBlockSizes(**fields) if fields else None
        attend = lambda q, k, v, sizes=sizes: splash_attention(  # noqa: E731
            q, k, v, seg, block_size=default, block_sizes=sizes, interpret=args.interpret)
        try:
            fwd = timed(jax.jit(attend), q, k, v)
            both = timed(jax.jit(lambda q, k, v, attend=attend: jax.vjp(attend, q, k, v)[1](ct)), q, k, v)
            print(f"{label:<26}{fwd:9.3f}{both:10.3f}{both - fwd:9.3f}", flush=True)
        except Exception as e:  # noqa: BLE001 -- a tile the kernel refuses is a result, not a stop
            print(f"{label:<26}  refused: {str(e).splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
    main()
