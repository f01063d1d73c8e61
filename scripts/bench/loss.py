#!/usr/bin/env python
"""The blockwise next-token loss against the full-logits loss, and a small Llama's compiled memory with
blockwise attention + blockwise loss against the materialised kernels, in one process.

    .venv/bin/python scripts/bench/loss.py            # 4,096 tokens x 128,256 vocabulary x 512 hidden
    .venv/bin/python scripts/bench/loss.py --quick    # 1,024 x 32,768 x 512; Llama at a smaller batch

1. **Loss** -- one jitted ``value_and_grad`` over the hidden states and the output projection of the loss
   summed over the tokens (a loss mask and z-loss as training uses them), ``next_token_loss`` on the
   materialised float32 logits against ``blockwise_next_token_loss`` (``cross_entropy_block_size``).
   Temporaries are XLA's ``compile().memory_analysis().temp_size_in_bytes``; times are medians of
   interleaved repeats after a warm-up. Goals: blockwise temporaries <= 0.1x, time <= 1.2x the full loss.
2. **Llama** -- the train step of a small Llama at sequence 2,048 compiled ahead of time by the memory
   plan (``levanter.memory``, nothing allocated): ``attn_backend: jax_flash`` + blockwise loss
   against ``vanilla`` + the full loss, per-device total (state, batch, temporaries). Goal: vanilla needs
   more than 4x the memory.

Figures belong in docs/bench/2026-12-03-attention-and-loss.md; ``run_all.py`` runs this
as its ``loss`` section.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from _common import note_load_average, parser, write_json

QUICK = dict(tokens=1024, vocab=32_768, hidden=512, block=4096, repeats=3,
             llama=dict(seq_len=2048, batch=4, hidden=512, layers=4, heads=8, kv_heads=4, mlp=1408, vocab=32_000,
                        block=2048))
FULL = dict(tokens=4096, vocab=128_256, hidden=512, block=8192, repeats=3,
            llama=dict(seq_len=2048, batch=8, hidden=768, layers=8, heads=12, kv_heads=4, mlp=2048, vocab=128_256,
                       block=2048))


def run_loss(cfg: dict) -> dict:
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np

    from levanter.models import blockwise_next_token_loss, next_token_loss

    Tokens = hax.Axis("batch", 1)
    Pos, Embed, Vocab = hax.Axis("position", cfg["tokens"]), hax.Axis("embed", cfg["hidden"]), hax.Axis("vocab", cfg["vocab"])
    rng = np.random.default_rng(0)
    hidden = hax.named(jnp.asarray(rng.standard_normal((1, Pos.size, Embed.size)), jnp.float32), (Tokens, Pos, Embed))
    lm_head = hax.named(jnp.asarray(rng.standard_normal((Vocab.size, Embed.size)) * 0.05, jnp.float32), (Vocab, Embed))
    tokens = hax.named(jnp.asarray(rng.integers(0, Vocab.size, (1, Pos.size)), jnp.int32), (Tokens, Pos))
    mask = hax.named(jnp.asarray(rng.random((1, Pos.size)) < 0.9), (Tokens, Pos))

    def full(h, w):
        logits = hax.dot(hax.named(h, hidden.axes), hax.named(w, lm_head.axes), axis=Embed)
        total, _ = next_token_loss(logits, tokens, mask, reduction="sum_and_count", z_loss_weight=1e-4)
        return total

    def blockwise(h, w):
        total, _ = blockwise_next_token_loss(hax.named(h, hidden.axes), hax.named(w, lm_head.axes), tokens, mask,
                                             block_size=cfg["block"], reduction="sum_and_count", z_loss_weight=1e-4)
        return total

    res: dict = {"config": {k: v for k, v in cfg.items() if k != "llama"}, "platform": jax.default_backend()}
    fns = {}
    for name, f in (("full", full), ("blockwise", blockwise)):
        t0 = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(hidden.array, lm_head.array).compile()
        mem = compiled.memory_analysis()
        res[name] = {"temp_bytes": int(mem.temp_size_in_bytes), "compile_s": time.perf_counter() - t0}
        value, _ = jax.block_until_ready(compiled(hidden.array, lm_head.array))  # warm-up
        res[name]["loss"] = float(value)
        fns[name] = compiled
    times = {b: [] for b in fns}
    for _ in range(cfg["repeats"]):
        for b, fn in fns.items():  # interleaved, so load changes hit both
            t0 = time.perf_counter()
            jax.block_until_ready(fn(hidden.array, lm_head.array))
            times[b].append(time.perf_counter() - t0)
    for b in fns:
        res[b]["step_s"] = statistics.median(times[b])
        res[b]["step_s_all"] = times[b]
    res["temp_ratio"] = res["blockwise"]["temp_bytes"] / res["full"]["temp_bytes"]
    res["time_ratio"] = res["blockwise"]["step_s"] / res["full"]["step_s"]
    res["loss_rel_diff"] = abs(res["blockwise"]["loss"] - res["full"]["loss"]) / abs(res["full"]["loss"])
    return res


def run_llama(cfg: dict) -> dict:
    import jax

    from levanter.data.config import UrlSingleDatasetLMConfig
    from levanter.lm_config import TrainLmConfig
    from levanter.training import lm_loss_fn
    from levanter.memory import PlanOptions, make_plan
    from levanter.models import LlamaConfig
    from levanter.training import TrainerConfig

    c = cfg["llama"]
    base = LlamaConfig(seq_len=c["seq_len"], hidden_dim=c["hidden"], intermediate_dim=c["mlp"], num_layers=c["layers"],
                       num_heads=c["heads"], num_kv_heads=c["kv_heads"], gradient_checkpointing=True,
                       tie_word_embeddings=True)
    trainer = TrainerConfig(train_batch_size=c["batch"] * jax.device_count(), require_accelerator=False, mp="f32")
    data = UrlSingleDatasetLMConfig(tokenizer="passthrough", vocab_size=c["vocab"])
    res: dict = {"config": c, "platform": jax.default_backend(), "devices": jax.device_count()}
    variants = {
        "vanilla_full": dict(attn_backend="vanilla", cross_entropy_block_size=None),
        "flash_blockwise": dict(attn_backend="jax_flash", cross_entropy_block_size=c["block"]),
    }
    for name, overrides in variants.items():
        model = dataclasses.replace(base, **overrides)
        config = TrainLmConfig(data=data, model=model, trainer=trainer)
        t0 = time.perf_counter()
        plan = make_plan(config, lm_loss_fn(config.z_loss_weight), PlanOptions())
        res[name] = {"total_bytes": plan.total_bytes, "temp_bytes": plan.temp_bytes,
                     "param_bytes": plan.param_bytes, "opt_bytes": plan.opt_bytes,
                     "compile_s": time.perf_counter() - t0}
    res["total_ratio"] = res["vanilla_full"]["total_bytes"] / res["flash_blockwise"]["total_bytes"]
    res["temp_ratio"] = res["vanilla_full"]["temp_bytes"] / res["flash_blockwise"]["temp_bytes"]
    return res


def run(cfg: dict) -> dict:
    return {"loss": run_loss(cfg), "llama": run_llama(cfg)}


def print_section(res: dict) -> None:
    r = res["loss"]
    c = r["config"]
    print(f"\nLoss + gradient: {c['tokens']} tokens x {c['vocab']:,} vocabulary x {c['hidden']} hidden, block "
          f"{c['block']}, float32, platform {r['platform']}, median of {c['repeats']}")
    print(f"{'loss':<10} {'temporaries MiB':>16} {'step s':>8} {'compile s':>10}")
    for b in ("full", "blockwise"):
        print(f"{b:<10} {r[b]['temp_bytes'] / 2**20:>16.1f} {r[b]['step_s']:>8.3f} {r[b]['compile_s']:>10.1f}")
    print(f"blockwise / full: temporaries {r['temp_ratio']:.3f}x (goal <= 0.1x), time {r['time_ratio']:.2f}x "
          f"(goal <= 1.2x); loss differs by {r['loss_rel_diff']:.1e} (relative)")
    r = res["llama"]
    c = r["config"]
    print(f"\nLlama train step ({c['layers']} layers, hidden {c['hidden']}, {c['heads']}/{c['kv_heads']} heads, "
          f"tied vocabulary {c['vocab']:,}, loss block {c['block']}), sequence {c['seq_len']}, {c['batch']} "
          "sequences per device, "
          f"{r['devices']} {r['platform']} device(s), compiled ahead of time")
    print(f"{'variant':<16} {'total MiB':>10} {'temporaries MiB':>16}")
    for v in ("vanilla_full", "flash_blockwise"):
        print(f"{v:<16} {r[v]['total_bytes'] / 2**20:>10.1f} {r[v]['temp_bytes'] / 2**20:>16.1f}")
    print(f"vanilla + full / jax_flash + blockwise: total {r['total_ratio']:.2f}x (goal > 4x), "
          f"temporaries {r['temp_ratio']:.2f}x")


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="smaller loss shapes and Llama batch")
    p.add_argument("--only", default="loss,llama", help="comma-separated: loss,llama")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of the loss (after a warm-up)")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    note_load_average()
    cfg = dict(QUICK if args.quick else FULL)
    if args.repeats is not None:
        cfg["repeats"] = args.repeats
    only = set(args.only.split(","))
    res = {}
    if "loss" in only:
        res["loss"] = run_loss(cfg)
    if "llama" in only:
        res["llama"] = run_llama(cfg)
    if len(res) == 2:
        print_section(res)
    else:
        print(json.dumps(res, indent=1))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
