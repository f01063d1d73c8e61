#!/usr/bin/env python
"""Benchmark: the loader on a token cache in an object store against the same cache on local disk.

The store is a real S3-compatible server (moto, started by ``tests/object_store.py``) behind the fault
proxy of the same module, which delays every request by a uniform 20-50 ms -- the latency of a cloud
store seen from a VM in the same region, and several times what moto answers in locally. The cache is the
synthetic 3-source mixture of ``loader_cache.py``, written once to local disk and uploaded object by
object to the bucket (straight to the server, not through the proxy), so both stores hold the same
bytes; the dataset is the production path (``LMMixtureDatasetConfig.train_set`` read by ``DataLoader``,
prefetch 8) with ``data.cache_dir`` a local directory or ``s3://``.

Measured per store, in the same process, local first:

* **data wait per step** while the consumer simulates a 300 ms training step (the host sleeps, as it
  waits for an accelerator): mean, p50, p99 and max of ``Batch.wait_seconds`` from step 2 on, and the
  mean as a fraction of the step (the goal for the object store: < 1 %). Steps 0 and 1 are reported
  apart as the start-up: the loader reads the first step alone (time to first batch), so step 1 waits
  for the first read-ahead group; a run pays that once, like its compile. The fraction with step 1
  included is shown too.
* **tokens/s** with no consumer delay (how fast the loader alone reads), and the first batch's wait.
* **requests per step** (object store only): what the proxy forwarded while the loader ran, divided by
  the steps -- the request cost of reading a cache from a bucket.

``--fail-fraction`` adds 503 answers to the delays (the retries are tensorstore's, then the loader's).
Run alone: ``.venv/bin/python scripts/bench/loader_object_store.py --quick``; ``run_all.py`` runs it as the
``object_store`` section.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np

from _common import parser, print_table, write_json

import loader_cache as lc

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

QUICK = dict(tokens=4_000_000, batch=64, steps=40, step_s=0.3, throughput_steps=24)
FULL = dict(tokens=8_000_000, batch=64, steps=150, step_s=0.3, throughput_steps=60)


def _servers():
    tests = os.path.join(REPO, "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    import object_store  # tests/object_store.py: the servers and the proxy the tests use

    return object_store


def upload_tree(client, bucket: str, local_root: str, prefix: str) -> int:
    """Upload every file under ``local_root`` to ``s3://bucket/prefix/...``; returns the object count."""
    n = 0
    for directory, _, files in os.walk(local_root):
        for name in files:
            path = os.path.join(directory, name)
            key = prefix + "/" + os.path.relpath(path, local_root).replace(os.sep, "/")
            with open(path, "rb") as f:
                client.put_object(Bucket=bucket, Key=key, Body=f.read())
            n += 1
    return n


def measure(root: str, cfg: dict, counter=None) -> dict:
    """The loader on the cache at ``root`` (a local directory or a URL): waits at a simulated step time,
    then tokens/s with no consumer delay; ``counter()`` (requests so far) gives the requests per step."""
    import jax

    batch, steps, step_s = cfg["batch"], cfg["steps"], cfg["step_s"]
    loader = lc.make_loader(root, batch, 8)
    before = counter() if counter else None
    waits = []
    t0 = time.perf_counter()
    with loader.iter_from_step(0, steps) as it:
        for b in it:
            jax.block_until_ready(b.data)
            waits.append(b.wait_seconds)
            del b
            time.sleep(step_s)
    elapsed = time.perf_counter() - t0
    requests = (counter() - before) if counter else None
    # Steps 0 and 1 are the start-up: the first step is read alone (time to first batch), and step 1 then
    # waits for the first read-ahead group. From step 2 on the loader runs ahead: the steady state.
    steady = np.asarray(waits[2:])
    out = {
        "steps": len(waits), "step_seconds": step_s, "batch": batch, "seq_len": lc.syn.SEQ_LEN,
        "first_wait_s": waits[0], "startup_wait_s": waits[0] + waits[1], "mean_wait_s": float(steady.mean()),
        "p50_wait_s": float(np.percentile(steady, 50)), "p99_wait_s": float(np.percentile(steady, 99)),
        "max_wait_s": float(steady.max()), "wait_fraction": float(steady.mean() / step_s),
        "wait_fraction_with_step1": float(np.mean(waits[1:]) / step_s),
        "elapsed_s": elapsed,
        "requests_per_step": None if requests is None else requests / len(waits),
    }
    n = cfg["throughput_steps"]
    out["tokens_per_s"] = lc.loader_throughput(root, batch, n, 8)["tokens_per_s"]
    return out


def run(cfg: dict, fail_fraction: float = 0.0, delay_s=(0.02, 0.05)) -> dict:
    object_store = _servers()
    work = tempfile.mkdtemp(prefix="levanter-bench-object-store-")
    saved = {}
    try:
        local_root = os.path.join(work, "cache")
        lc.write_caches(local_root, cfg["tokens"])
        results = {"local": measure(local_root, cfg)}
        with object_store.S3Server() as server:
            objects = upload_tree(server.client(), server.bucket, local_root, "bench/cache")
            proxy = object_store.FaultProxy(server.port, fail_fraction=fail_fraction, delay_s=delay_s, seed=0)
            with proxy:
                for k, v in proxy.env_for(server).items():
                    saved.setdefault(k, os.environ.get(k))
                    os.environ[k] = v
                s3 = measure(server.url("bench/cache"), cfg, counter=lambda: proxy.forwarded + proxy.failed)
                s3["failed_requests"] = proxy.failed
        results["s3"] = s3
        return {
            **results, "objects": objects, "load_average": os.getloadavg(), "delay_s": list(delay_s),
            "fail_fraction": fail_fraction,
            "tokens": cfg["tokens"],
            "s3_over_local_tokens_per_s": results["s3"]["tokens_per_s"] / results["local"]["tokens_per_s"],
        }
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(work, ignore_errors=True)


def print_section(res: dict) -> None:
    lo, s3 = res["local"], res["s3"]
    delay = f"{res['delay_s'][0] * 1e3:.0f}-{res['delay_s'][1] * 1e3:.0f} ms"
    fails = f", {res['fail_fraction'] * 100:.0f} % answered 503" if res["fail_fraction"] else ""
    rows = []
    for name, r in (("local disk", lo), (f"s3 (moto, +{delay}{fails})", s3)):
        rows.append([name, f"{r['tokens_per_s'] / 1e6:.2f}", f"{r['mean_wait_s'] * 1e3:.2f}",
                     f"{r['p99_wait_s'] * 1e3:.2f}", f"{r['max_wait_s'] * 1e3:.1f}",
                     f"{r['wait_fraction'] * 100:.3f}",
                     f"{r['first_wait_s'] * 1e3:.0f}", f"{r['startup_wait_s'] * 1e3:.0f}",
                     f"{r['wait_fraction_with_step1'] * 100:.2f}",
                     "-" if r["requests_per_step"] is None else f"{r['requests_per_step']:.1f}"])
    print_table(f"Object store: loader (prefetch 8) on the same cache ({res['objects']} objects), "
                f"{lo['steps']} steps of {lo['batch']}x{lo['seq_len']} at a simulated "
                f"{lo['step_seconds'] * 1e3:.0f} ms "
                f"step; waits from step 2 on (steady), start-up = steps 0 + 1; tokens/s without step delay; "
                f"s3/local tokens/s {res['s3_over_local_tokens_per_s']:.2f}x",
                [("store", 34), ("M tok/s", 8), ("wait ms", 8), ("p99 ms", 7), ("max ms", 7), ("wait %", 7),
                 ("first ms", 8), ("start-up ms", 11), ("% w/ step 1", 11), ("req/step", 8)], rows)


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--fail-fraction", type=float, default=0.0, help="fraction of requests answered 503")
    p.add_argument("--delay-ms", default="20,50", help="each request's added latency, uniform in LOW,HIGH ms")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    low, high = (float(x) / 1e3 for x in args.delay_ms.split(","))
    res = run(QUICK if args.quick else FULL, fail_fraction=args.fail_fraction, delay_s=(low, high))
    print_section(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
