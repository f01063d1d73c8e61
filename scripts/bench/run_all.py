#!/usr/bin/env python
"""The benchmark suite: the CPU figures of docs/performance.md (recorded under docs/bench/), ours and upstream's
side by side in one run, as tables + JSON.

    .venv/bin/python scripts/bench/run_all.py --quick --json bench.json     # < 2 minutes on 2 cores
    .venv/bin/python scripts/bench/run_all.py --json bench.json             # more repeats and steps
    scripts/bench/setup_upstream_venv.sh                                    # once, for the upstream columns

Sections (each figure is the median over repeats, shown with min and max; ratios are per repeat):

1. **Loader** -- ``loader_cache.py``: our ``DataLoader`` (prefetch 8, and 0 = fetch on demand) over a
   3-source, 2-stage, shuffled mixture on tensorstore caches of synthetic byte-level documents, against
   a raw tensorstore read of exactly the same rows, at 8x1024, 64x1024, 256x1024 and 8x64 (batch x seq).
   The timed steps straddle the stage switch. Upstream's loader reads the same tokens (its own cache
   format, written by its own writer) through its own ``train_set`` + ``DataLoader`` in its venv.
2. **Time to first batch** at steps 0, 1e3, 1e6, 1e9 (fresh dataset + loader, warm process), and the
   first loader of a fresh process ("cold"), for both sides.
3. **Stalls** -- 1,000 steps at a fixed step time (the host sleeps as it would while an accelerator
   computes): data-wait p50 / p99 / max, and the waits > 0.5 s, the stalls reported of upstream's loader (count,
   first and last spike step, total wait).
4. **Memory** -- resident memory growth of a fresh process iterating the loader, for a cache and one
   10x larger, from step 0 and from step 1e6, against prefetch depth x batch bytes.
5. **Training** -- ``config/gpt2_nano.yaml`` for N steps through ``python -m levanter.main.train_lm`` (fresh
   subprocess each), and upstream's ``train_lm`` on the mirrored config; both read a pre-written cache
   of the same synthetic tokens, so neither side builds a cache. Steady step, step 0 (first batch +
   compile + step), end to end, tokens/s and MFU against the matmul peak measured in the same run.
6. **Checksums** -- ``loader_cache.checksum_section``: the loader and the raw read at 8x1024 and 64x1024 on
   the caches above (crc32c on every chunk, as training writes them) and on the same tokens written
   without checksums, interleaved; the ratio checksummed / plain is what the checksums cost in read speed.
7. **Object store** -- ``loader_object_store.py``: the loader on the same cache in an S3 bucket (moto behind
   a proxy adding 20-50 ms to every request) and on local disk, in the same run: data wait per step at a
   simulated 300 ms step, tokens/s, requests per step.

Attention -- ``attention.py``: blockwise (``jax_flash``) against the materialised ``vanilla`` kernel,
forward+backward at sequence 4,096 (``--quick``: 2,048), 8 heads of 64: compiled temporaries and step time.

Loss -- ``loss.py``: the blockwise next-token loss against the full-logits loss, loss + gradient at 4,096
tokens x 128,256 vocabulary x 512 hidden (``--quick``: 1,024 x 32,768): compiled temporaries and time; and a
small Llama's train step at sequence 2,048 compiled ahead of time, ``jax_flash`` + blockwise loss against
``vanilla`` + full loss (per-device memory).

Cache build -- ``cache_build.py``: build throughput (text tokens/s) of the process-pool and Ray backends at 2
workers against the raw tokenizer on all cores and upstream's own builder, on the embedded corpus.

Checkpoint -- ``checkpoint_block.py``: how long ``Checkpointer.on_step`` stops the loop, a synchronous save
against a background one (the loop waits for the copy to host memory only), for a 2 M (``--quick``) or 20 M
parameter state with Adam's moments, and the background save's total time.
Input hash -- ``input_hash.py``: the SHA-256 of a cache's input file (what a cache check reads whenever
a file's metadata changed), in GB/s on a 1 GiB file (``--quick``: 256 MiB) in the page cache.

Upstream needs the venv of ``setup_upstream_venv.sh`` (default ``~/.cache/levanter-bench/upstream-venv``,
or ``--upstream-venv``); without it the upstream figures are null. See ``docs/performance.md``.
"""

from __future__ import annotations

from _common import load_average, parser, print_table, write_json  # noqa: E402 -- scripts/bench is on sys.path
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import yaml

import _synthetic as syn
import attention as attention_bench
import cache_build as cb
import checkpoint_block as ckb
import input_hash as ih
import loader_cache as lc
import loss as loss_bench
import loader_object_store as los

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_UPSTREAM = os.path.expanduser("~/.cache/levanter-bench/upstream-venv")
RESUME_STEPS = (0, 10**3, 10**6, 10**9)
TRAIN_TOKENS = 2_000_000  # the training comparison's pre-written cache (same tokens on both sides)
STALL_THRESHOLD = 0.5

QUICK = dict(
    repeats=3, tokens=4_000_000, mem_tokens=4_000_000, loader_n={(8, 1024): 300, (64, 1024): 80, (256, 1024): 12,
                                                                   (8, 64): 300},
    up_n={(8, 1024): 120, (64, 1024): 48, (8, 64): 300}, up_repeats=1, mem_steps=50,
    mem_cases=((1, 0, 8), (10, 0, 8), (10, 10**6, 8)),
    stall=dict(batch=32, steps=1000, step_s=0.01), train_steps=20, train_repeats=1, ttfb_batches=(64,), ttfb_repeats=7,
)
FULL = dict(
    repeats=5, tokens=16_000_000, mem_tokens=8_000_000,
    loader_n={(8, 1024): 600, (64, 1024): 150, (256, 1024): 40, (8, 64): 1200},
    up_n={(8, 1024): 400, (64, 1024): 150, (256, 1024): 40, (8, 64): 1200}, up_repeats=3, mem_steps=300,
    mem_cases=((1, 0, 8), (1, 10**6, 8), (10, 0, 8), (10, 10**6, 8), (10, 0, 2), (10, 0, 32)),
    stall=dict(batch=64, steps=1000, step_s=0.05), train_steps=60, train_repeats=3, ttfb_batches=(8, 64), ttfb_repeats=15,
)


def stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def med(s):
    return None if s is None else s["median"]


def fmt(s, scale=1.0, spec=".2f"):
    if s is None:
        return "-"
    if isinstance(s, dict):
        return f"{s['median'] * scale:{spec}} [{s['min'] * scale:{spec}}, {s['max'] * scale:{spec}}]"
    return f"{s * scale:{spec}}"


# ----------------------------------------------------------------------------------------------------------
# 1 + 2: our loader


def bench_ours_loader(root: str, cfg: dict, out: dict) -> None:
    R = cfg["repeats"]
    # Cold first: the first loader of this process (imports are done; first-use costs are not).
    out["ttfb_cold"] = lc.time_to_first_batch(root, 64, 0)
    results = {}
    for (bs, L), n in cfg["loader_n"].items():
        runs = {"loader": [], "prefetch0": [], "raw": [], "raw_batch": [], "raw_stack": [], "raw_concat": [],
                "raw_in_flight8": [], "raw_coalesced8": []}
        for r in range(R):
            methods = ["loader", "prefetch0", "raw"]
            for m in methods[r % 3:] + methods[: r % 3]:  # rotate the order: drift hits all alike
                if m == "loader":
                    runs[m].append(lc.loader_throughput(root, bs, n, 8, L)["tokens_per_s"])
                elif m == "prefetch0":
                    runs[m].append(lc.loader_throughput(root, bs, n, 0, L)["tokens_per_s"])
                else:
                    raw = lc.raw_throughput(root, bs, n, L)
                    runs["raw"].append(raw["tokens_per_s"])
                    runs["raw_batch"].append(raw["ts_batch"])
                    runs["raw_stack"].append(raw["ts_stack"])
                    runs["raw_concat"].append(raw["ts_concat"])
                    runs["raw_in_flight8"].append(raw["in_flight8"])
                    runs["raw_coalesced8"].append(raw["coalesced8"])
        results[f"{bs}x{L}"] = {
            "batch": bs, "seq_len": L, "batches": n,
            **{k: stats(v) for k, v in runs.items()},
            "loader_over_raw": stats([a / b for a, b in zip(runs["loader"], runs["raw"])]),
            "prefetch0_over_raw": stats([a / b for a, b in zip(runs["prefetch0"], runs["raw"])]),
        }
    out["loader"] = results
    ttfb = {}
    for bs in cfg["ttfb_batches"]:
        per = {k: [] for k in RESUME_STEPS}
        builds = []
        for _ in range(cfg["ttfb_repeats"]):  # milliseconds each: many repeats for a stable median
            for k in RESUME_STEPS:
                t = lc.time_to_first_batch(root, bs, k)
                per[k].append(t["first_batch_s"])
                builds.append(t["build_s"])
        ttfb[bs] = {"steps": {str(k): stats(v) for k, v in per.items()}, "build": stats(builds)}
    out["ttfb"] = ttfb


# ----------------------------------------------------------------------------------------------------------
# upstream (subprocesses in its venv)


def upstream_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               RAY_USAGE_STATS_ENABLED="0", JAX_PLATFORMS="cpu")
    return env


def run_upstream_helper(venv: str, script: str, args: list, timeout: float = 900) -> dict:
    py = os.path.join(venv, "bin", "python")
    proc = subprocess.run([py, os.path.join(HERE, script), *map(str, args)], capture_output=True, text=True,
                          env=upstream_env(), timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{script} {args[0]} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def bench_upstream(venv: str, work: str, cfg: dict, sections: set, out: dict) -> dict:
    """One process in upstream's venv: its tokenizer/HF-cache preparation, the caches (loader and
    training), and -- if the loader section is on -- its loader measurements. Returns ``prep`` paths."""
    spec: dict = {}
    if "training" in sections:
        spec["train_cache"] = [os.path.join(work, "train-upstream", "train"), TRAIN_TOKENS]
    if "upstream" in sections:
        spec["loader"] = {
            "tokens": cfg["tokens"], "repeats": cfg["up_repeats"],
            "ttfb_batch": 64, "ttfb_steps": list(RESUME_STEPS), "ttfb_repeats": 1,
            "throughput": [[bs, n, L] for (bs, L), n in cfg["up_n"].items()],
        }
    res = run_upstream_helper(venv, "upstream_loader.py", ["all", work, json.dumps(spec)])
    runs = res.get("loader") or []
    if runs:
        thr = {}
        for (bs, L) in cfg["up_n"]:
            vals = [t["tokens_per_s"] for r in runs for t in r["throughput"] if t["batch"] == bs and t["seq_len"] == L]
            thr[f"{bs}x{L}"] = stats(vals)
        ttfb, errors = {}, {}
        for k in RESUME_STEPS:
            ttfb[str(k)] = stats([t["first_batch_s"] for r in runs for t in r["ttfb"] if t["step"] == k and "error" not in t])
            errs = [t["error"] for r in runs for t in r["ttfb"] if t["step"] == k and "error" in t]
            if errs:
                errors[str(k)] = errs[0]
        out["upstream_loader"] = {
            "throughput": thr, "ttfb_64": ttfb, "ttfb_errors": errors,
            "ttfb_cold_64": stats([r["cold"]["first_batch_s"] for r in runs]),
            "build_cold_64": stats([r["cold"]["build_s"] for r in runs]),
        }
    return res["prep"]


# ----------------------------------------------------------------------------------------------------------
# 3: stalls, 4: memory


def bench_stalls(root: str, cfg: dict, out: dict) -> None:
    s = cfg["stall"]
    waits = lc.stall_run(root, s["batch"], s["steps"], s["step_s"])
    w = np.asarray(waits)
    spikes = np.flatnonzero(w > STALL_THRESHOLD)
    after_first = w[1:]
    out["stalls"] = {
        "batch": s["batch"], "seq_len": syn.SEQ_LEN, "steps": len(waits), "step_seconds": s["step_s"],
        "p50_s": float(np.percentile(after_first, 50)), "p99_s": float(np.percentile(after_first, 99)),
        "max_s": float(after_first.max()), "first_step_wait_s": float(w[0]),
        "spikes": int(spikes.size), "first_spike_step": int(spikes[0]) if spikes.size else None,
        "last_spike_step": int(spikes[-1]) if spikes.size else None,
        "spike_wait_s": float(w[spikes].sum()), "total_wait_s": float(w.sum()),
        "wait_fraction": float(after_first.sum() / (after_first.sum() + s["step_s"] * after_first.size)),
        "spikes_after_step0": int((after_first > STALL_THRESHOLD).sum()),
    }


def bench_memory(work: str, cfg: dict, out: dict) -> None:
    rows = []
    for scale in (1, 10):
        root = os.path.join(work, f"mem-{scale}x")
        lc.write_caches(root, cfg["mem_tokens"] * scale)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        for case_scale, start, depth in cfg["mem_cases"]:
            if case_scale != scale:
                continue
            args = {"root": root, "batch_size": 64, "steps": cfg["mem_steps"], "start": start, "prefetch": depth}
            proc = subprocess.run([sys.executable, os.path.join(HERE, "loader_cache.py"), json.dumps(args)],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"memory probe failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"cache_scale": scale, "cache_bytes": size, "start_step": start, "steps": args["steps"],
                         "prefetch": depth, **r})
        shutil.rmtree(root, ignore_errors=True)
    out["memory"] = rows


# ----------------------------------------------------------------------------------------------------------
# 5: training


def matmul_peak_flops() -> float:
    """FLOP/s of a jitted f32 1024x1024 matmul chain on this machine's CPU (all cores): the MFU peak."""
    import jax
    import jax.numpy as jnp

    n, k = 1024, 8

    @jax.jit
    def chain(a, b):
        for _ in range(k):
            a = (a @ b) * 0.5
        return a

    a = jnp.ones((n, n), jnp.float32)
    b = jnp.eye(n, dtype=jnp.float32)
    chain(a, b).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        chain(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * k / best


def bench_training(work: str, cfg: dict, venv: str | None, prep: dict | None, out: dict) -> None:
    import train as tr  # scripts/bench/train.py

    nano = tr.load_config(os.path.join(REPO, "config", "gpt2_nano.yaml"))
    nano["data"] = {"tokenizer": "byte", "cache_dir": "cache/synthetic", "shuffle": True,
                    "train_urls": ["synthetic://nano"], "validation_urls": []}
    # The pre-written cache: ours under <warm>/synthetic/train, upstream's under <up_warm>/train.
    warm = os.path.join(work, "train-ours")
    lc.write_source(os.path.join(warm, "synthetic", "train"), 0, TRAIN_TOKENS, "synthetic://nano")
    args = types.SimpleNamespace(tmp=work, python=sys.executable, timeout=900, keep=False, log_copies=None,
                                 upstream_venv=venv)
    up_warm = data = None
    if venv and prep:
        up_warm = os.path.join(work, "train-upstream")  # written by bench_upstream
        dummy = os.path.join(work, "synthetic-nano.jsonl")
        with open(dummy, "w") as f:
            f.write('{"text": "placeholder: the cache is pre-written"}\n')
        data = {"train": [dummy], "validation": []}
    steps, skip = cfg["train_steps"], 5
    ours_runs, up_runs = [], []
    for i in range(cfg["train_repeats"]):
        ours_runs.append(tr.run_ours(nano, [], steps, args, warm, i + 1))
        if up_warm:
            up_runs.append(tr.run_upstream(nano, steps, args, data, prep, up_warm, i + 1))

    from levanter.config import parse_config
    from levanter.main.train_lm import TrainLmConfig

    path = os.path.join(work, "nano.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(nano, f)
    flops_per_token = parse_config(TrainLmConfig, path).model.flops_per_token(syn.VOCAB)
    peak = matmul_peak_flops()

    def summarize(runs):
        if not runs:
            return None
        per = [tr.run_summary(r, skip) for r in runs]
        s = {
            "steady_step_s": stats([p["med"] for p in per]),
            "step0_s": stats([p["step0"] for p in per]),
            "end_to_end_s": stats([p["e2e"] for p in per]),
            "first_step_s": stats([p["first"] for p in per]),
            "tokens_per_s": stats([p["tok_s"] for p in per]),
            "data_wait_fraction": stats([p["wait"] for p in per]),
            "loss_first": per[0]["loss0"], "loss_last": per[0]["loss1"],
        }
        s["compile_s"] = stats([p["step0"] - p["med"] for p in per if p["step0"] is not None])
        s["mfu"] = stats([p["tok_s"] * flops_per_token / peak for p in per if p["tok_s"]])
        return s

    out["training"] = {
        "config": "config/gpt2_nano.yaml (data: pre-written synthetic cache)", "steps": steps,
        "steady_from_step": skip, "flops_per_token": flops_per_token, "matmul_peak_flops": peak,
        "ours": summarize(ours_runs), "upstream": summarize(up_runs),
    }


# ----------------------------------------------------------------------------------------------------------
# report


def report(out: dict) -> dict:
    if out.get("cache_build"):
        print("\nCache build: text tokens/s, median [min, max]")
        cb.print_report(out["cache_build"])
    lo, up = out.get("loader", {}), (out.get("upstream_loader") or {})
    rows = []
    for key, r in lo.items():
        u = (up.get("throughput") or {}).get(key)
        rows.append([key, str(r["batches"]), fmt(r["loader"], 1e-6), fmt(r["prefetch0"], 1e-6), fmt(r["raw"], 1e-6),
                     fmt(r["loader_over_raw"]), fmt(r["raw_in_flight8"], 1e-6),
                     fmt(r.get("raw_coalesced8"), 1e-6), fmt(u, 1e-6),
                     "-" if u is None else f"{med(r['loader']) / med(u):.1f}x"])
    print_table("Loader: M tokens/s, median [min, max]; 3-source 2-stage shuffled mixture on tensorstore caches",
                [("batch", 8), ("n", 5), ("ours (prefetch 8)", 22), ("ours (prefetch 0)", 22), ("raw tensorstore", 22),
                 ("ours/raw", 18), ("raw, 8 in flight", 22), ("raw, 8 per read", 22), ("upstream", 20),
                 ("ours/up", 7)], rows)

    rows = []
    for bs, t in out.get("ttfb", {}).items():
        base = med(t["steps"]["0"])
        for k, s in t["steps"].items():
            ups = (up.get("ttfb_64") or {}).get(k) if int(bs) == 64 else None
            rows.append([str(bs), f"{int(k):.0e}" if int(k) else "0", fmt(s, 1e3, ".1f"), f"{med(s) / base:.2f}x",
                         fmt(ups, 1e3, ".0f"), "-" if ups is None else f"{med(s) / med(ups):.3f}x"])
    cold = out.get("ttfb_cold")
    print_table("Time to first batch (ms; fresh dataset + loader, warm process), median [min, max]",
                [("batch", 6), ("step", 6), ("ours", 22), ("vs step 0", 9), ("upstream", 20), ("ours/up", 8)], rows)
    if cold:
        print(f"cold (first loader of the process, batch 64): ours {cold['first_batch_s'] * 1e3:.1f} ms; upstream "
              f"{fmt(up.get('ttfb_cold_64'), 1e3, '.0f')} ms")
    if up.get("ttfb_errors"):
        print(f"upstream errors: {up['ttfb_errors']}")

    st = out.get("stalls")
    if st:
        print_table(
            f"Stalls: {st['steps']} steps of {st['batch']}x{st['seq_len']}, step time {st['step_seconds'] * 1e3:.0f} ms "
            f"(host sleeps); waits after step 0",
            [("p50 ms", 8), ("p99 ms", 8), ("max ms", 8), ("step 0 ms", 9), ("wait %", 7), (f"> {STALL_THRESHOLD}s", 7),
             ("first spike", 11), ("last spike", 10), ("spike wait s", 12), ("total wait s", 12)],
            [[f"{st['p50_s'] * 1e3:.3f}", f"{st['p99_s'] * 1e3:.3f}", f"{st['max_s'] * 1e3:.2f}",
              f"{st['first_step_wait_s'] * 1e3:.1f}", f"{st['wait_fraction'] * 100:.3f}", str(st["spikes"]),
              str(st["first_spike_step"]), str(st["last_spike_step"]), f"{st['spike_wait_s']:.2f}",
              f"{st['total_wait_s']:.3f}"]])

    mem = out.get("memory")
    if mem:
        print_table(f"Memory: resident memory growth while iterating {mem[0]['steps']} steps of 64x1024 "
                    "(MiB; anon = anonymous memory, what the process itself holds; fresh process per row)",
                    [("cache", 6), ("cache MiB", 9), ("start step", 10), ("prefetch d", 10), ("base RSS", 9),
                     ("growth", 7), ("anon growth", 11), ("batch", 6), ("(d+2)*batch", 11)],
                    [[f"{m['cache_scale']}x", f"{m['cache_bytes'] / 2**20:.0f}", str(m["start_step"]), str(m["prefetch"]),
                      f"{m['base_rss'] / 2**20:.0f}", f"{m['growth'] / 2**20:.1f}", f"{m['growth_anon'] / 2**20:.1f}",
                      f"{m['batch_bytes'] / 2**20:.2f}", f"{m['bound'] / 2**20:.1f}"] for m in mem])

    tr = out.get("training")
    if tr:
        o, u = tr["ours"], tr["upstream"]
        rows = []
        for name, key, scale, spec in (("steady step (ms)", "steady_step_s", 1e3, ".1f"),
                                       ("step 0 (ms)", "step0_s", 1e3, ".0f"),
                                       ("compile ~ step0 - steady (s)", "compile_s", 1, ".2f"),
                                       ("time to first step (s)", "first_step_s", 1, ".2f"),
                                       ("end to end (s)", "end_to_end_s", 1, ".1f"),
                                       ("tokens/s", "tokens_per_s", 1, ",.0f"),
                                       ("MFU (vs matmul peak)", "mfu", 100, ".1f"),
                                       ("data wait (% of step)", "data_wait_fraction", 100, ".2f")):
            a, b = o.get(key), (u or {}).get(key)
            ratio = "-" if not (a and b and med(b)) else f"{med(a) / med(b):.2f}x"
            rows.append([name, fmt(a, scale, spec), fmt(b, scale, spec), ratio])
        print_table(f"Training: gpt2_nano, {tr['steps']} steps, steady = steps >= {tr['steady_from_step']}; "
                    f"{tr['flops_per_token'] / 1e6:.1f} MFLOP/token, matmul peak "
                    f"{tr['matmul_peak_flops'] / 1e9:.0f} GFLOP/s",
                    [("metric", 28), ("ours", 28), ("upstream", 28), ("ours/up", 8)], rows)

    if out.get("checksum"):
        lc.print_checksum_section(out["checksum"])

    if out.get("object_store"):
        los.print_section(out["object_store"])

    if out.get("attention"):
        attention_bench.print_section(out["attention"])

    if out.get("loss"):
        loss_bench.print_section(out["loss"])

    if out.get("checkpoint"):
        ckb.print_section(out["checkpoint"])
    if out.get("input_hash"):
        ih.print_section(out["input_hash"])

    def pick(d, *path):
        for p in path:
            if d is None:
                return None
            d = d.get(p)
        return med(d) if isinstance(d, dict) and "median" in d else d

    return {
        "loader_tokens_per_s": pick(out, "loader", "64x1024", "loader"),
        "raw_read_tokens_per_s": pick(out, "loader", "64x1024", "raw"),
        "upstream_loader_tokens_per_s": pick(out, "upstream_loader", "throughput", "64x1024"),
        "ttfb_step0_s": pick(out, "ttfb", 64, "steps", "0"),
        "ttfb_step1e9_s": pick(out, "ttfb", 64, "steps", str(10**9)),
        "data_wait_p99_s": pick(out, "stalls", "p99_s"),
        "train_step_s": pick(out, "training", "ours", "steady_step_s"),
        "upstream_train_step_s": pick(out, "training", "upstream", "steady_step_s"),
        "loss_blockwise_temp_ratio": pick(out, "loss", "loss", "temp_ratio"),
        "loss_blockwise_time_ratio": pick(out, "loss", "loss", "time_ratio"),
        "llama_vanilla_over_flash_memory": pick(out, "loss", "llama", "total_ratio"),
        "object_store_wait_fraction": pick(out, "object_store", "s3", "wait_fraction"),
        "attention_flash_temp_ratio": pick(out, "attention", "temp_ratio"),
        "attention_flash_time_ratio": pick(out, "attention", "time_ratio"),
        "checkpoint_block_ratio": pick(out, "checkpoint", "block_ratio"),
        "input_hash_gb_per_s": pick(out, "input_hash", "hash_gb_per_s"),
    }


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps: < 2 minutes on 2 cores")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--upstream-venv", default=DEFAULT_UPSTREAM, help="upstream levanter venv (setup_upstream_venv.sh)")
    p.add_argument("--no-upstream", action="store_true", help="skip the upstream columns")
    p.add_argument("--only", default=None,
                   help="comma-separated sections: loader,upstream,stalls,memory,training,checksum,object_store,attention,loss,"
                        "cache_build,checkpoint,input_hash")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    every = ("loader,upstream,stalls,memory,training,checksum,object_store,attention,loss,cache_build,checkpoint,"
             "input_hash")
    sections = set((args.only or every).split(","))
    t_start = time.perf_counter()
    import jax

    venv = None if args.no_upstream else args.upstream_venv
    why = None
    if venv and not os.path.exists(os.path.join(venv, "bin", "python")):
        why, venv = f"no upstream venv at {venv} (make one with scripts/bench/setup_upstream_venv.sh)", None
    print(f"# run_all{' --quick' if args.quick else ''}: python {platform.python_version()}, jax {jax.__version__}, "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average "
          + load_average() + (f"; upstream: {why}" if why else ""))
    out: dict = {"mode": "quick" if args.quick else "full", "machine": {
        "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
        "platform": platform.platform()}}
    work = tempfile.mkdtemp(prefix="levanter-bench-")
    timings = {}
    try:
        prep = None
        root = os.path.join(work, "cache")
        if {"loader", "stalls", "checksum"} & sections:
            lc.write_caches(root, cfg["tokens"])
            lc.check_same_rows(root, 64, syn.STAGE_SWITCH_STEP - 1)
        if venv and ({"upstream", "training"} & sections):
            t0 = time.perf_counter()
            prep = bench_upstream(venv, work, cfg, sections, out)
            timings["upstream"] = time.perf_counter() - t0
            print(f"# upstream (preparation, caches, loader): {timings['upstream']:.1f} s", flush=True)
        for name, fn in (
            ("loader", lambda: bench_ours_loader(root, cfg, out)),
            ("upstream", lambda: None),  # measured together with upstream's preparation, below
            ("stalls", lambda: bench_stalls(root, cfg, out)),
            ("memory", lambda: bench_memory(work, cfg, out)),
            ("training", lambda: bench_training(work, cfg, venv, prep, out)),
            ("checksum", lambda: out.update(checksum=lc.checksum_section(
                work, root, cfg["tokens"], {k: n for k, n in cfg["loader_n"].items() if k in ((8, 1024), (64, 1024))},
                cfg["repeats"]))),
            ("object_store", lambda: out.update(object_store=los.run(los.QUICK if args.quick else los.FULL))),
            ("attention", lambda: out.update(attention=attention_bench.run(
                attention_bench.QUICK if args.quick else attention_bench.FULL))),
            ("loss", lambda: out.update(loss=loss_bench.run(loss_bench.QUICK if args.quick else loss_bench.FULL))),
            ("cache_build", lambda: out.update(cache_build=cb.run(cb.QUICK if args.quick else cb.FULL, venv))),
            ("checkpoint", lambda: out.update(checkpoint=ckb.run(ckb.QUICK if args.quick else ckb.FULL))),
            ("input_hash", lambda: out.update(input_hash=ih.run(ih.QUICK if args.quick else ih.FULL, work))),
        ):
            if name in sections and name != "upstream":
                t0 = time.perf_counter()
                fn()
                timings[name] = time.perf_counter() - t0
                print(f"# {name}: {timings[name]:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    headline = report(out)
    out.update(headline)
    out["section_seconds"] = timings
    out["total_seconds"] = time.perf_counter() - t_start
    print()
    print("headline: " + ", ".join(f"{k}={'null' if v is None else f'{v:.4g}'}" for k, v in headline.items()))
    print(f"# total {out['total_seconds']:.1f} s; load average now " + load_average())
    write_json(args.json, out, default=str)


if __name__ == "__main__":
    main()
