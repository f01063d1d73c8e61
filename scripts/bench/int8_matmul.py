#!/usr/bin/env python
"""int8 against bf16 for the linear layers' products of the TPU benchmark models, alone, forward and backward.

For each weight shape of ``gpt2_small``, ``llama_350m`` and ``llama_600m`` (config/bench/, tokens of one microbatch), times
``jax.vjp`` of the layer's product against a fixed cotangent (the output, the input's gradient and the weight's
gradient: what a training step computes per layer, the remat policy aside), with the forward product and the
input's gradient both computed one way (:data:`levanter.quantization.int8.WAYS`):

* **bf16**: ``jax.lax.dot_general`` of bfloat16 operands (the shipped path);
* **int8 xla**: ``trainer.quantization.int8``'s kernel through XLA: per-row / per-column absolute-max scales
  and the rounding as XLA's own passes over memory, then an s8 x s8 -> s32 product;
* **int8 fused**: the same numerics with the quantizing inside a Pallas kernel, on the way into the product;
* **int8 fused x3**: the weight's gradient in int8 too, through its fused kernel (per block of 512 tokens,
  both operands quantized by columns);
* **ceiling**: the three products with operands already int8 (no quantizing at all): what int8 could give.

The weight's gradient is bf16 in every way but the ceiling's and fused x3's. Each operand has an element-wise
producer in the timed function (``x = gelu(h)``; the cotangent scaled by a vector), so that XLA can fuse into
it as in a step. Then, per layer, the choice of ``trainer.quantization.int8``'s start-up plan, which times the
layer forward and backward each of its ways (:func:`levanter.quantization.int8.product_plan`), with its
figures. Prints ms per call and the speedups over bf16.

    python scripts/bench/int8_matmul.py [--models gpt2_small llama_350m] [--repeats 20] [--json out.json]
    python scripts/bench/int8_matmul.py --raw   # the matrix units alone: one product of given operands

``--raw`` times one product of operands already in their dtype at a few shapes (the square 8,192^3, the 600M
row's products and weight gradient, GPT-2 small's ``c_fc``): bf16 -> bf16, s8 -> s32, and s8 -> s32 scaled
back to bf16 in the same fusion: the int8 rate with nothing to quantize and the output at 2 bytes.

About 40 s on a TPU v5e (a compile of a few seconds per shape and way). ``--allow-cpu`` runs it on CPU at a
tiny size (to check the script: CPUs have no int8 matrix units, and the fused kernel runs in Pallas's
interpreter there).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402 -- after the path insert above

# model -> (tokens per microbatch, [(layer, in, out)]): the shipped configs' shapes.
MODELS = {
    "gpt2_small": (16 * 1024, [("c_attn", 768, 2304), ("attn.c_proj", 768, 768), ("c_fc", 768, 3072),
                               ("mlp.c_proj", 3072, 768)]),
    "llama_350m": (4 * 2048, [("q_proj", 1024, 1024), ("k_proj", 1024, 512), ("gate_proj", 1024, 2816),
                              ("down_proj", 2816, 1024)]),
    "llama_600m": (4 * 2048, [("q_proj", 1536, 1536), ("k_proj", 1536, 512), ("gate_proj", 1536, 4096),
                              ("down_proj", 4096, 1536)]),
}


def ways():
    import jax
    import jax.numpy as jnp

    from levanter.quantization.int8 import int8_matmul

    def through(way):
        def run(h, w, g, v):
            y, vjp = jax.vjp(lambda h, w: int8_matmul(jax.nn.gelu(h), w, *way), h, w)
            return (y,) + vjp(g * v)
        return jax.jit(run)

    def products(x8, w8, g8, x, g):
        y = jax.lax.dot_general(x8, w8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        dx = jax.lax.dot_general(g8, w8, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        dw = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())))
        return y.astype(jnp.bfloat16), dx.astype(jnp.bfloat16), dw

    return {"bf16": through(("float",) * 3), "int8 xla": through(("xla", "xla", "float")),
            "int8 fused": through(("fused", "fused", "float")), "int8 fused x3": through(("fused",) * 3)}, \
        jax.jit(products)


RAW_SHAPES = [(8192, 8192, 8192), (32768, 1536, 4096), (32768, 4096, 1536), (1536, 32768, 4096),
              (8192, 1536, 4096), (16384, 768, 3072)]


def raw(repeats: int, scale: int = 1) -> list:
    """``[{m, k, n, ms: {way: ms}}]`` of one product of given operands at :data:`RAW_SHAPES` (``m`` divided
    by ``scale``)."""
    import jax
    import jax.numpy as jnp

    ways = {
        "bf16": jax.jit(lambda a, b, s: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
        "s8 -> s32": jax.jit(lambda a, b, s: jnp.dot(a, b, preferred_element_type=jnp.int32)),
        "s8 -> bf16": jax.jit(lambda a, b, s: (jnp.dot(a, b, preferred_element_type=jnp.int32).astype(jnp.float32)
                                               * s).astype(jnp.bfloat16)),
    }
    out = []
    for m, k, n in RAW_SHAPES:
        m = max(m // scale, 128)
        ka, kb = jax.random.split(jax.random.PRNGKey(0))
        a, b = jax.random.normal(ka, (m, k), jnp.float32), jax.random.normal(kb, (k, n), jnp.float32)
        s = jnp.ones((n,), jnp.float32)
        operands = {"bf16": (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))}
        operands["s8"] = tuple(jnp.clip(x * 30, -127, 127).astype(jnp.int8) for x in (a, b))
        ms = {way: 1e3 * time_call(fn, (*operands["bf16" if way == "bf16" else "s8"], s), repeats)
              for way, fn in ways.items()}
        out.append({"m": m, "k": k, "n": n, "ms": ms})
        print(f"{m} x {k} x {n}: " + ", ".join(f"{w} {t:.3f} ms ({2 * m * k * n / t / 1e9:.0f} T/s)"
                                               for w, t in ms.items())
              + f"; int8 gain {ms['bf16'] / ms['s8 -> bf16']:.2f}x (bf16 output), "
                f"{ms['bf16'] / ms['s8 -> s32']:.2f}x (s32 output)", flush=True)
    return out


def time_call(fn, args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` over ``repeats`` calls, after one call that compiles."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--allow-cpu", action="store_true", help="run on CPU at 1/32 of the tokens (checks the script)")
    ap.add_argument("--raw", action="store_true", help="one product of given operands, bf16 against int8")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "tpu" and not args.allow_cpu:
        sys.exit("error: no TPU here; pass --allow-cpu to check the script on CPU at a tiny size")
    if args.raw:
        write_json(args.json, raw(args.repeats, scale=64 if args.allow_cpu else 1))
        return
    from levanter.quantization.int8 import product_plan

    fns, ceiling = ways()
    result, rows = [], []
    for model in args.models:
        tokens, layers = MODELS[model]
        if args.allow_cpu:
            tokens //= 32
        for layer, n_in, n_out in layers:
            k = jax.random.split(jax.random.PRNGKey(0), 4)
            h = jax.random.normal(k[0], (tokens, n_in), jnp.bfloat16)
            w = (jax.random.normal(k[1], (n_in, n_out), jnp.float32) / n_in**0.5).astype(jnp.bfloat16)
            g = jax.random.normal(k[2], (tokens, n_out), jnp.bfloat16)
            v = jax.random.uniform(k[3], (n_out,), jnp.bfloat16)
            ms = {}
            for name, fn in fns.items():
                try:
                    ms[name] = 1e3 * time_call(fn, (h, w, g, v), args.repeats)
                except Exception as e:  # the fused kernel refused this shape: say so, time the others
                    print(f"# {model} {layer}: {name} failed: {str(e)[:300]}", file=sys.stderr)
                    ms[name] = float("nan")
            int8 = [jnp.clip(a * 16, -127, 127).astype(jnp.int8) for a in (h, w, g)]
            ms["ceiling"] = 1e3 * time_call(ceiling, (*int8, h, g), args.repeats)
            plan = product_plan(tokens, n_in, n_out, "bfloat16")
            result.append({"model": model, "layer": layer, "tokens": tokens, "in": n_in, "out": n_out, "ms": ms,
                           "plan": plan})
            rows.append([model, layer, f"{tokens}x{n_in}x{n_out}", *(f"{ms[n]:.3f}" for n in ms),
                         *(f"{ms['bf16'] / ms[n]:.2f}x" for n in ("int8 xla", "int8 fused", "int8 fused x3",
                                                                  "ceiling"))])
            print(f"# plan {model} {layer}: forward {plan[0]}, input gradient {plan[1]}, weight gradient "
                  f"{plan[2]}: {plan[3]}", flush=True)
    print_table(f"forward + backward of one product, ms ({jax.devices()[0].device_kind})",
                [("model", 10), ("layer", 11), ("tokens x in x out", 18), ("bf16", 8), ("int8 xla", 8),
                 ("int8 fused", 10), ("fused x3", 8), ("ceiling", 8), ("xla gain", 8), ("fused gain", 10),
                 ("x3 gain", 8), ("ceil gain", 9)], rows)
    write_json(args.json, result)

if __name__ == "__main__":
    main()
