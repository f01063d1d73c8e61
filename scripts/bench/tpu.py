#!/usr/bin/env python
"""Benchmark: training speed on one TPU chip, as a user runs it (``levanter.main.train_lm`` on a shipped config).

Rows (each its own config under ``config/bench/``, run unchanged unless overrides are given):

* ``gpt2_small``: GPT-2 small, sequences of 1,024, 32 per step;
* ``llama_350m``: a 350M Llama (GQA 16/8), sequences of 2,048, 16 per step;
* ``llama_350m_8k``: the same Llama at 8,192-token sequences, 4 per step.

All read the embedded corpus through a 32,768-entry BPE trained on it (``tokenizers/bench-bpe-32k``, trained
here once if missing) with bf16 compute over float32 parameters.

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
* **data wait**: summed ``data/wait_seconds`` over summed step seconds.

``--profile`` also writes a ``jax.profiler`` trace of two steps and prints the device's busiest operations
(from the trace's Perfetto JSON; no TensorBoard needed).

Usage (on the TPU host, from the project root)::

    python scripts/bench/tpu.py                          # the three rows, ~5 minutes
    python scripts/bench/tpu.py --rows llama_350m --profile
    python scripts/bench/tpu.py --rows gpt2_small -- --model.gradient_checkpointing save_dots
    python scripts/bench/tpu.py --json tpu.json

``--allow-cpu`` runs the same code on CPU with a small matmul (to check the script, not to measure).
"""

from __future__ import annotations

import argparse
import collections
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
}
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
    from levanter.utils.flops import peak_flops_per_device

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

    threading.Thread(target=watch, daemon=True).start()
    train_lm.main(config)
    time.sleep(5)  # the run ended before --steps steps were logged: let the watcher see the last lines
    raise SystemExit(f"error: the run ended after {len(lines())} steps, before --steps {args.steps}")


# -- the parent: one process per row, a table at the end ------------------------------------------------------
def run_row(name: str, args: argparse.Namespace, overrides: list) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", ROWS[name], "--steps", str(args.steps),
           "--skip", str(args.skip), *(["--profile"] if args.profile else []),
           *(["--trace-dir", os.path.join(args.trace_dir, name)] if args.trace_dir else []),
           *(["--allow-cpu"] if args.allow_cpu else []), "--", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["row"], result["wall_seconds"] = name, time.perf_counter() - t0
            return result
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    return {"row": name, "overrides": overrides, "error": f"exit {proc.returncode}"}


def print_rows(results: list) -> None:
    head = f"{'row':<16}{'step s':>9}{'tokens/s':>11}{'MFU':>8}{'of matmul':>11}{'peak HBM':>15}{'wait':>8}"
    print(head)
    for r in results:
        if "error" in r:
            print(f"{r['row']:<16}  failed: {r['error']} {' '.join(r.get('overrides', []))}")
            continue
        stats = r.get("memory_stats") or {}
        used = max(stats.get("peak_bytes_reserved", 0), r["peak_hbm_bytes"] or 0)
        hbm = f"{used / 2**30:.1f}/{r['hbm_limit_bytes'] / 2**30:.1f} GiB" if used else "?"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "?"
        print(f"{r['row']:<16}{r['step_seconds']:>9.4f}{r['tokens_per_second']:>11,.0f}{mfu:>8}"
              f"{100 * r['of_matmul']:>10.1f}%{hbm:>15}{100 * r['data_wait']:>7.2f}%  {' '.join(r['overrides'])}")
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
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=20, help="steps logged before the row is measured")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (compile, warm-up)")
    parser.add_argument("--profile", action="store_true", help="trace two steps, print the busiest device ops")
    parser.add_argument("--trace-dir", help="with --profile: write the trace here (kept) instead of a temporary folder")
    parser.add_argument("--json", help="also write the results here")
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
    if args.child:
        child(args, overrides)
        return
    ensure_tokenizer()
    results = [run_row(name, args, overrides) for name in args.rows]
    print_rows(results)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
