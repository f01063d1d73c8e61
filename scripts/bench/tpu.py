#!/usr/bin/env python
"""Benchmark: training speed on one TPU chip, as a user runs it (``levanter.main.train_lm`` on a shipped config).

Rows (each its own config under ``config/bench/``, run unchanged unless overrides are given):

* ``gpt2_small``: GPT-2 small, sequences of 1,024, 32 per step;
* ``llama_350m``: a 350M Llama (GQA 16/8), sequences of 2,048, 16 per step;
* ``llama_350m_8k``: the same Llama at 8,192-token sequences, 4 per step;
* ``llama_600m``: a 600M Llama with heads of 128 (GQA 12/4), layers scanned, sequences of 2,048, 16 per step,
  the microbatch found by ``per_device_parallelism: auto``;
* ``mixtral``: a Mixtral-style mixture of experts (8 experts, 2 per token, ``moe_dispatch: grouped``),
  sequences of 2,048, 16 per step; its MFU counts the active parameters only.

The default runs every row (~10 minutes on a v5e chip); ``--rows`` picks some. All read the embedded corpus
through a 32,768-entry BPE trained on it (``tokenizers/bench-bpe-32k``, trained here once if missing) with
bf16 compute over float32 parameters.

Each row runs in a **fresh process** (one program holds the chip at a time, and the peak-memory figure is
per process). That process first times a bf16 ``8192 x 8192 x 8192`` matmul (the chip's achievable
rate, measured in the same process and moment as the training steps), then calls ``train_lm.main`` on the
config and watches its ``metrics.jsonl``; once ``--steps`` steps are logged it reads the device's
``memory_stats()`` and reports, then exits without the run's final checkpoint (not part of a step). Reported:

* **step**: median of ``throughput/step_seconds`` over the steps after the first ``--skip`` (the wall time
  between steps: data wait, host syncs and logging included, as the run's own progress line shows it);
* **tokens/s** and **MFU**: the model's ``flops_per_token`` (3 x the forward matmuls, no credit for
  recomputation) x tokens per step / step / the chip's peak (levanter.utils.flops: 197 TFLOP/s for v5e);
* **of matmul**: the same FLOP rate as a share of the measured matmul rate;
* **peak HBM**: the device's ``memory_stats()`` after the measured steps: ``peak_bytes_in_use`` (buffers: the
  parameters, optimizer state and batches) and ``peak_bytes_reserved`` (what the TPU runtime also holds for the
  compiled programs' temporaries), against ``bytes_limit``;
* **data wait**: summed ``data/wait_seconds`` over summed step seconds;
* **first step**: ``throughput/time_to_first_step_seconds``, the run's own figure: seconds from the process's
  start (its imports and the matmul timing included) to the end of its first step, compiles included.

Each row writes its checkpoints under a fresh temporary directory, so JAX's persistent compilation cache
(by default beside the checkpoints, ``levanter.utils.compile_cache``) starts empty: every row compiles,
unless ``JAX_COMPILATION_CACHE_DIR`` names a cache. ``--cold-warm`` launches each row twice over one fresh
cache directory instead (its token caches built first, so that neither launch builds them) and reports
both launches' time to the first step and their ratio: the second launch loads the programs the first
compiled. ``--cold-warm`` alone runs ``llama_350m`` (the row that compiles longest) for 3 steps (~5 minutes on
a v5e chip).

``--int8`` runs each row twice, in bf16 as configured and with ``trainer.quantization: {int8: true}`` (the
linear layers' products in int8 through haliax's AQT kernel), and prints the two side by side with the
ratio of their steps. ``moe_dispatch: grouped`` computes the experts with ragged products, which the int8
kernel does not run, so a grouped Mixtral row's int8 launch quantizes the attention only
(``trainer.quantization.targets: .*self_attn.*``; with ``-- --model.moe_dispatch dense`` every layer).

``--profile`` also writes a ``jax.profiler`` trace of two steps and prints the device's busiest operations
(from the trace's Perfetto JSON; no TensorBoard needed).

Usage (on the TPU host, from the project root)::

    python scripts/bench/tpu.py                          # every row, ~10 minutes
    python scripts/bench/tpu.py --rows llama_600m mixtral --json moe.json
    python scripts/bench/tpu.py --rows mixtral -- --model.moe_dispatch dense --trainer.per_device_parallelism 1
    python scripts/bench/tpu.py --rows gpt2_small --int8 # bf16 and int8 side by side
    python scripts/bench/tpu.py --rows llama_350m --profile
    python scripts/bench/tpu.py --rows gpt2_small -- --model.gradient_checkpointing save_dots
    python scripts/bench/tpu.py --json tpu.json --logs tpu-logs  # and each launch's log
    python scripts/bench/tpu.py --cold-warm              # llama_350m launched twice: first step cold vs warm
    python scripts/bench/tpu.py --cold-warm --rows gpt2_small

``--allow-cpu`` runs the same code on CPU with a small matmul (to check the script, not to measure).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402 -- after the path insert above

ROWS = {
    "gpt2_small": "config/bench/gpt2_small_tpu.yaml",
    "llama_350m": "config/bench/llama_350m_tpu.yaml",
    "llama_350m_8k": "config/bench/llama_350m_8k_tpu.yaml",
    "llama_600m": "config/bench/llama_600m_tpu.yaml",
    "mixtral": "config/bench/mixtral_tpu.yaml",
}
INT8 = ["--trainer.quantization.int8", "true"]
# The int8 launch of a row whose experts dispatch grouped: the attention only (grouped refuses int8 experts).
INT8_ATTENTION_ONLY = ["--trainer.quantization.targets", ".*self_attn.*"]
TOKENIZER = "tokenizers/bench-bpe-32k"
CORPUS = ["embedded://python-docs/train", "embedded://python-code/train"]


def ensure_tokenizer() -> None:
    if os.path.exists(os.path.join(REPO, TOKENIZER, "tokenizer.json")):
        return
    subprocess.run(
        [sys.executable, "-m", "levanter.main.train_tokenizer", "--train_urls", json.dumps(CORPUS),
         "--vocab_size", "32768", "--output_dir", TOKENIZER],
        cwd=REPO, check=True,
    )


# -- the child: one row in one process ---------------------------------------------------------------------
def matmul_rate(n: int, repeats: int = 10) -> float:
    """Achieved FLOP/s of a bf16 ``n x n x n`` matmul (float32 accumulation), best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def busiest_ops(trace_dir: str, top: int = 30) -> tuple:
    """``([(name, total_ms, count)], module_ms, steps)``: the device's operations in a Perfetto trace, busiest
    first, the summed time of the compiled programs it ran (the device's busy time; the rest is idle), and the
    steps the window holds (``tpu_trace.steps_in_window``). ``scripts/bench/tpu_trace.py`` breaks the same trace
    down further."""
    from tpu_trace import load_events, steps_in_window

    if not glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True):
        return [], 0.0, 0.0
    total = collections.defaultdict(float)
    count = collections.Counter()
    modules = []
    for proc, thread, e in load_events(trace_dir):
        if "TPU:0" not in proc:
            continue
        if "XLA Modules" in thread:
            modules.append(e["dur"] / 1000.0)
        if "XLA Ops" in thread:
            total[e["name"]] += e["dur"] / 1000.0
            count[e["name"]] += 1
    busiest = sorted(((k, v, count[k]) for k, v in total.items()), key=lambda r: -r[1])[:top]
    return busiest, sum(modules), steps_in_window(modules)


def child(args: argparse.Namespace, overrides: list) -> None:
    import jax

    import levanter.config
    from levanter.ingest.tokenization import load_tokenizer
    from levanter.lm_config import TrainLmConfig, model_vocab_size
    from levanter.main import train_lm
    from levanter.progress import setup_console_logging
    from levanter.utils import compile_cache
    from levanter.utils.flops import peak_flops_per_device

    setup_console_logging()  # the run's log lines (the int8 plan's among them) in the launch's output
    platform = jax.default_backend()
    if platform != "tpu" and not args.allow_cpu:
        raise SystemExit(f"error: this benchmark measures a TPU; jax's backend here is {platform!r} (--allow-cpu)")
    rate = matmul_rate(8192 if platform == "tpu" else 512, repeats=10 if platform == "tpu" else 2)
    work = tempfile.mkdtemp(prefix="tpu-bench-")
    run_id = "bench"
    argv = ["--trainer.id", run_id, *(["--trainer.require_accelerator", "false"] if platform != "tpu" else []), "--trainer.log_dir", os.path.join(work, "logs"),
            "--trainer.checkpointer.base_path", os.path.join(work, "checkpoints"),
            "--trainer.num_train_steps", str(args.steps + 10), *overrides]
    config = levanter.config.parse_config(TrainLmConfig, os.path.join(REPO, args.config), argv)
    os.chdir(REPO)  # the configs' relative paths (tokenizer, cache) are the project's
    vocab = model_vocab_size(config, load_tokenizer(config.data.tokenizer))
    metrics_path = os.path.join(work, "logs", run_id, "metrics.jsonl")
    trace_dir = args.trace_dir or os.path.join(work, "trace")

    def lines() -> list:
        try:
            with open(metrics_path) as f:
                return [json.loads(x) for x in f if x.strip()]
        except (FileNotFoundError, json.JSONDecodeError):
            return []

    def watch() -> None:
        state = "before"  # the trace: before, on, done
        trace_from = 0
        while True:
            time.sleep(0.05)
            rows = [r for r in lines() if "throughput/step_seconds" in r]
            n = len(rows)
            if args.profile and state == "before" and n >= args.skip:
                jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
                state, trace_from = "on", n
            if state == "on" and (n >= trace_from + 2 or n >= args.steps):
                jax.profiler.stop_trace()
                state = "done"
            if n < args.steps:
                continue
            stats = jax.devices()[0].memory_stats() or {}
            steady = rows[args.skip:args.steps]
            step_s = [r["throughput/step_seconds"] for r in steady]
            med = statistics.median(step_s)
            tokens = config.trainer.train_batch_size * config.model.seq_len
            fpt = config.model.flops_per_token(vocab)
            peak = peak_flops_per_device(jax.devices()[0])
            flops_rate = fpt * tokens / med
            result = {
                "config": args.config, "overrides": overrides, "device": jax.devices()[0].device_kind,
                "steps": len(step_s), "step_seconds": med, "step_min": min(step_s), "step_max": max(step_s),
                "tokens_per_second": tokens / med, "flops_per_token": fpt, "vocab_size": vocab,
                "mfu": flops_rate / peak if peak else None, "matmul_flops": rate,
                "of_matmul": flops_rate / rate,
                "peak_hbm_bytes": stats.get("peak_bytes_in_use"), "hbm_limit_bytes": stats.get("bytes_limit"),
                "memory_stats": stats,
                "data_wait": sum(r.get("data/wait_seconds", 0.0) for r in steady) / sum(step_s),
                "loss_first": rows[0].get("train/loss"), "loss_last": steady[-1].get("train/loss"),
                "compile_step_seconds": rows[0]["throughput/step_seconds"],
                "time_to_first_step": rows[0].get("throughput/time_to_first_step_seconds"),
                "compilation_cache": dataclasses.asdict(compile_cache.cache_stats()),
            }
            if args.profile:
                ops, module_ms, steps = busiest_ops(trace_dir)
                steps = steps or 1.0
                result["busiest_ops"] = [
                    {"op": k, "ms_per_step": round(v / steps, 3), "count_per_step": round(c / steps)} for k, v, c in ops
                ]
                result["device_busy_ms_per_step"] = module_ms / steps
            print("RESULT " + json.dumps(result), flush=True)
            os._exit(0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    train_lm.main(config)
    # Let the watcher see the last lines; with --profile it may still be reading the trace (it exits the
    # process when done).
    watcher.join(timeout=300 if args.profile else 5)
    raise SystemExit(f"error: the run ended after {len(lines())} steps, before --steps {args.steps}")


# -- the parent: one process per row, a table at the end ------------------------------------------------------
def ensure_caches(name: str) -> None:
    """The row's token caches, built (or found finished) before a timed launch."""
    subprocess.run([sys.executable, "-m", "levanter.main.cache_dataset", "--config_path", ROWS[name]], cwd=REPO,
                   check=True, capture_output=True)


def run_cold_warm(name: str, args: argparse.Namespace, overrides: list) -> list:
    """The row launched twice over one fresh compilation cache: ``[cold, warm]``, each labelled."""
    ensure_caches(name)
    with tempfile.TemporaryDirectory(prefix="tpu-bench-jax-cache-") as cache:
        runs = []
        for label in ("cold", "warm"):
            r = run_row(name, args, [*overrides, "--trainer.jax_compilation_cache_dir", cache])
            r["launch"] = label
            r["cache_entries"] = len([f for f in os.listdir(cache) if f.endswith("-cache")])
            runs.append(r)
    return runs


def print_cold_warm(results: list) -> None:
    print(f"{'row':<16}{'launch':>7}{'first step s':>14}{'loaded':>10}{'written':>9}{'saved s':>9}{'entries':>9}")
    by_row = collections.defaultdict(dict)
    for r in results:
        by_row[r["row"]][r["launch"]] = r
        if "error" in r:
            print(f"{r['row']:<16}{r['launch']:>7}  failed: {r['error']}")
            continue
        c = r.get("compilation_cache") or {}
        print(f"{r['row']:<16}{r['launch']:>7}{r['time_to_first_step']:>14.1f}"
              f"{c.get('hits', 0):>5}/{c.get('lookups', 0):<4}{c.get('written', 0):>9}"
              f"{c.get('seconds_saved', 0.0):>9.1f}{r['cache_entries']:>9}")
    for name, runs in by_row.items():
        cold, warm = runs.get("cold", {}), runs.get("warm", {})
        if cold.get("time_to_first_step") and warm.get("time_to_first_step"):
            ratio = warm["time_to_first_step"] / cold["time_to_first_step"]
            print(f"{name}: the warm launch reached its first step in {ratio:.2f}x the cold launch's time "
                  f"({warm['time_to_first_step']:.1f} s vs {cold['time_to_first_step']:.1f} s)")


def run_row(name: str, args: argparse.Namespace, overrides: list) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", ROWS[name], "--steps", str(args.steps),
           "--skip", str(args.skip), *(["--profile"] if args.profile else []),
           *(["--trace-dir", os.path.join(args.trace_dir, name)] if args.trace_dir else []),
           *(["--allow-cpu"] if args.allow_cpu else []), "--", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
        n = len([f for f in os.listdir(args.logs) if f.startswith(name + ".")])
        with open(os.path.join(args.logs, f"{name}.{n}.log"), "w") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["row"], result["wall_seconds"] = name, time.perf_counter() - t0
            return result
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    return {"row": name, "overrides": overrides, "error": f"exit {proc.returncode}"}


def moe_dispatch(name: str, overrides: list) -> str | None:
    """The row's ``model.moe_dispatch`` after the overrides (None for a model without one)."""
    import yaml

    with open(os.path.join(REPO, ROWS[name])) as f:
        value = (yaml.safe_load(f).get("model") or {}).get("moe_dispatch")
    for i, arg in enumerate(overrides[:-1]):
        if arg == "--model.moe_dispatch":
            value = overrides[i + 1]
    return value


def int8_overrides(name: str, overrides: list) -> list:
    """The overrides of a row's int8 launch: ``trainer.quantization.int8`` on, the attention only where the
    experts dispatch grouped and no targets are given."""
    extra = INT8_ATTENTION_ONLY
    if moe_dispatch(name, overrides) != "grouped" or "--trainer.quantization.targets" in overrides:
        extra = []
    return [*overrides, *INT8, *extra]


def run_bf16_int8(name: str, args: argparse.Namespace, overrides: list) -> list:
    """The row launched twice, as configured and in int8: ``[bf16, int8]``, each labelled."""
    runs = []
    for label, row_overrides in (("bf16", overrides), ("int8", int8_overrides(name, overrides))):
        r = run_row(name, args, row_overrides)
        r["launch"] = label
        runs.append(r)
    return runs


def print_int8(results: list) -> None:
    """Each row's bf16 and int8 launches side by side, with int8's step over bf16's."""
    print(f"{'row':<16}{'bf16 step s':>12}{'int8 step s':>12}{'int8/bf16':>11}{'bf16 MFU':>10}{'int8 MFU':>10}"
          f"{'bf16 loss':>11}{'int8 loss':>11}")
    by_row = collections.defaultdict(dict)
    for r in results:
        by_row[r["row"]][r["launch"]] = r
    for name, runs in by_row.items():
        bf, q = runs.get("bf16", {}), runs.get("int8", {})
        if "step_seconds" not in bf or "step_seconds" not in q:
            print(f"{name:<16}  a launch failed: {bf.get('error', '')} {q.get('error', '')}")
            continue

        def pct(r):
            return f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "?"

        ratio = q["step_seconds"] / bf["step_seconds"]
        print(f"{name:<16}{bf['step_seconds']:>12.4f}{q['step_seconds']:>12.4f}{ratio:>10.3f}x{pct(bf):>10}"
              f"{pct(q):>10}{bf['loss_last']:>11.4f}{q['loss_last']:>11.4f}")
        print(f"{name}: int8 takes {ratio:.3f}x the bf16 step ({'faster' if ratio < 1 else 'slower'}; "
              f"int8 overrides: {' '.join(q['overrides'][len(bf['overrides']):])})")


def print_rows(results: list) -> None:
    head = (f"{'row':<16}{'step s':>9}{'tokens/s':>11}{'MFU':>8}{'of matmul':>11}{'peak HBM':>15}{'wait':>8}"
            f"{'1st step':>10}")
    print(head)
    for r in results:
        if "launch" in r:  # --cold-warm
            r = {**r, "row": f"{r['row']} {r['launch']}"}
        if "error" in r:
            print(f"{r['row']:<16}  failed: {r['error']} {' '.join(r.get('overrides', []))}")
            continue
        stats = r.get("memory_stats") or {}
        used = max(stats.get("peak_bytes_reserved", 0), r["peak_hbm_bytes"] or 0)
        hbm = f"{used / 2**30:.1f}/{r['hbm_limit_bytes'] / 2**30:.1f} GiB" if used else "?"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "?"
        first = r.get("time_to_first_step")
        first = f"{first:>9.1f}s" if first is not None else f"{'?':>10}"
        print(f"{r['row']:<16}{r['step_seconds']:>9.4f}{r['tokens_per_second']:>11,.0f}{mfu:>8}"
              f"{100 * r['of_matmul']:>10.1f}%{hbm:>15}{100 * r['data_wait']:>7.2f}%{first}  "
              f"{' '.join(r['overrides'])}")
    rates = [r["matmul_flops"] for r in results if "matmul_flops" in r]
    if rates:
        print(f"bf16 8192^3 matmul: {min(rates) / 1e12:.1f}-{max(rates) / 1e12:.1f} TFLOP/s (per process)")
    for r in results:
        if "device_busy_ms_per_step" in r:
            print(f"  {r['row']}: device busy {r['device_busy_ms_per_step']:.1f} ms of a {1e3 * r['step_seconds']:.1f} ms step")
        for op in r.get("busiest_ops", [])[:25]:
            print(f"  {r['row']}: {op['ms_per_step']:9.3f} ms x{op['count_per_step']:<4} {op['op'][:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS),
                        help="the rows to run (default: all; with --cold-warm, llama_350m)")
    parser.add_argument("--steps", type=int, help="steps logged before the row is measured (default 20; "
                        "with --cold-warm, 3)")
    parser.add_argument("--skip", type=int, help="first steps left out (compile, warm-up; default 4; with "
                        "--cold-warm, 1)")
    parser.add_argument("--cold-warm", action="store_true",
                        help="launch each row twice over one fresh compilation cache; report the time to the "
                             "first step of both launches and their ratio")
    parser.add_argument("--int8", action="store_true",
                        help="launch each row twice, bf16 and trainer.quantization.int8; print both side by side "
                             "with the ratio of their steps")
    parser.add_argument("--profile", action="store_true", help="trace two steps, print the busiest device ops")
    parser.add_argument("--trace-dir", help="with --profile: write the trace here (kept) instead of a temporary folder")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--logs", help="keep each launch's output (the run's log) in this folder")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per row")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU (checks the script, measures nothing)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    overrides = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    quick = args.cold_warm
    args.steps = args.steps if args.steps is not None else (3 if quick else 20)
    args.skip = args.skip if args.skip is not None else (1 if quick else 4)
    args.rows = args.rows or (["llama_350m"] if quick else list(ROWS))
    if args.int8 and args.cold_warm:
        parser.error("--int8 and --cold-warm each launch a row twice: choose one")
    if args.steps <= args.skip:
        parser.error(f"--steps ({args.steps}) must be more than --skip ({args.skip})")
    if args.child:
        child(args, overrides)
        return
    ensure_tokenizer()
    if args.cold_warm:
        results = [r for name in args.rows for r in run_cold_warm(name, args, overrides)]
        print_rows(results)
        print_cold_warm(results)
    elif args.int8:
        results = [r for name in args.rows for r in run_bf16_int8(name, args, overrides)]
        print_rows(results)
        print_int8(results)
    else:
        results = [run_row(name, args, overrides) for name in args.rows]
        print_rows(results)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
