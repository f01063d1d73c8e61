#!/usr/bin/env python
"""Benchmark: cache build throughput of both backends, against the raw tokenizer and upstream's builder.

One run, one machine, one corpus: the embedded ``python-code`` and ``python-docs`` train splits
(~10 MB, ~1.1k documents) re-cut round-robin into 8 JSON-lines shards, tokenized with a 2048-vocab
byte-level BPE trained by ``train_bpe`` on ~3 MB of the same text (a Hugging Face ``tokenizers``
tokenizer, loaded by upstream from the very same ``tokenizer.json``).

Figures are text tokens/s (the EOS the caches append is not counted, so every column counts the same
tokens), median over ``--repeats`` with min and max:

* **raw**: ``encode_batch(all documents)`` in one call, documents in memory, no I/O, in a fresh
  subprocess with ``TOKENIZERS_PARALLELISM`` unset (Rayon: every core) -- ``scripts/bench/cache.py``'s
  raw mode.
* **process pool**: ``build_or_load_cache(shards, fresh_dir, tok, options=CacheOptions(num_workers=2,
  min_bytes_for_pool=0))`` end to end: reading, tokenizing in 2 spawned workers, tensorstore writes,
  ledger commits, worker start-up and shutdown.
* **ray**: the same with ``backend="ray"`` on a local Ray instance started once (``num_cpus=2``) before
  the timed builds -- a cluster is running before a build joins it -- with one untimed build first so
  that Ray's worker processes exist (its pool keeps them between builds, as on a cluster).
* **upstream**: upstream Levanter's own builder (``levanter.store.cache.build_or_load_cache`` over a
  ``JsonlDataSource`` with a ``BatchTokenizer``, on its own local Ray instance with ``num_cpus=2``) in the
  venv of ``setup_upstream_venv.sh``, in a subprocess, timed from the call until it returns (it waits for
  the build), one untimed warm-up build first. It runs with ``CacheOptions.one_group()`` (every shard in
  one group): with its default 128 groups the step that copies the groups into the final cache asks Ray
  for 4 CPUs and 6 GiB, which a 2-CPU instance never grants (the build hangs), and on a 4-CPU instance on
  this 2-core machine it did not finish a 200-document corpus within 4 minutes.

Goals (docs/performance.md): each backend >= 0.8x raw, and faster than upstream's builder.

Usage::

    .venv/bin/python scripts/bench/cache_build.py                    # ~3 minutes on 2 cores
    .venv/bin/python scripts/bench/cache_build.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import load_average, parser, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_UPSTREAM = os.path.expanduser("~/.cache/levanter-bench/upstream-venv")
SOURCES = ("python-code", "python-docs")
N_SHARDS = 8
BPE_VOCAB = 2048
WORKERS = 2
GOAL_RAW = 0.8
QUICK = {"repeats": 2, "raw_repeats": 2, "bpe_train_mb": 3.0}
FULL = {"repeats": 3, "raw_repeats": 3, "bpe_train_mb": 3.0}


def mstats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# -- the corpus ------------------------------------------------------------------------------------------
def make_corpus(tmp: str, bpe_train_mb: float) -> tuple[list[str], str, int]:
    """``(shards, tokenizer_dir, text_tokens)``: 8 jsonl shards, the BPE's directory, raw token count."""
    from levanter.ingest import iter_documents, materialize, train_bpe

    src = os.path.join(tmp, "src")
    texts = [d for name in SOURCES for d in iter_documents(materialize(name, "train", src))]
    shards = [os.path.join(tmp, "corpus", f"part-{k}.jsonl") for k in range(N_SHARDS)]
    os.makedirs(os.path.dirname(shards[0]), exist_ok=True)
    for k, path in enumerate(shards):
        with open(path, "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts[k::N_SHARDS])
    sample, size = [], 0
    for t in texts[::3] + texts[1::3] + texts[2::3]:
        if size >= bpe_train_mb * 1e6:
            break
        sample.append(t)
        size += len(t)
    tok_dir = os.path.join(tmp, "bpe")
    train_bpe(sample, BPE_VOCAB, tok_dir)
    return shards, tok_dir, len(texts)


def raw_throughput(tok_dir: str, shards: list[str], repeats: int) -> dict:
    env = dict(os.environ)
    env.pop("TOKENIZERS_PARALLELISM", None)
    cmd = [sys.executable, os.path.join(HERE, "cache.py"), "--raw-encode", tok_dir, "--raw-repeats",
           str(repeats), "--raw-shards", *shards]
    proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tokens": res["tokens"], "tokens_per_s": mstats([res["tokens"] / s for s in res["seconds"]])}


def our_builds(tmp: str, shards: list[str], tok_dir: str, repeats: int) -> dict:
    """Process-pool and Ray builds, interleaved so that drift on the machine hits both alike."""
    import ray

    from levanter.ingest import CacheOptions, build_or_load_cache, load_tokenizer

    tok = load_tokenizer(tok_dir)
    options = {
        "process": CacheOptions(num_workers=WORKERS, min_bytes_for_pool=0),
        "ray": CacheOptions(num_workers=WORKERS, backend="ray"),
    }
    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    try:
        warm = os.path.join(tmp, "warm-ray")
        build_or_load_cache(shards, warm, tok, options=options["ray"], progress=False)
        rates: dict = {k: [] for k in options}
        seconds: dict = {k: [] for k in options}
        text_tokens = None
        for r in range(repeats):
            for name, opts in options.items():
                out = os.path.join(tmp, f"{name}-{r}")
                t0 = time.perf_counter()
                cache = build_or_load_cache(shards, out, tok, options=opts, progress=False)
                dt = time.perf_counter() - t0
                text_tokens = cache.ledger.total_tokens - cache.ledger.total_rows  # less one EOS per document
                seconds[name].append(dt)
                rates[name].append(text_tokens / dt)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        ray.shutdown()
    return {name: {"tokens": text_tokens, "tokens_per_s": mstats(rates[name]),
                   "seconds": mstats(seconds[name])} for name in options}


# -- upstream (runs in upstream's venv) ------------------------------------------------------------------
def upstream_main(tok_dir: str, out_root: str, repeats: int, shards: list[str]) -> None:
    """Hidden mode, in upstream's venv: time its builder ``repeats`` times; print one JSON line."""
    import ray
    from transformers import PreTrainedTokenizerFast

    from levanter.data.sharded_datasource import JsonlDataSource
    from levanter.data.text import BatchTokenizer
    from levanter.store.cache import CacheOptions, build_or_load_cache

    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    # The tokenizer.json that train_bpe wrote (its config names no tokenizer class for AutoTokenizer).
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
                                  eos_token="<|endoftext|>")
    source = JsonlDataSource(shards)
    seconds, tokens = [], None
    for r in range(repeats + 1):  # the first build is a warm-up (Ray workers, jit of nothing)
        out = os.path.join(out_root, f"up-{r}")
        t0 = time.perf_counter()
        cache = build_or_load_cache(out, source, BatchTokenizer(tok, enforce_bos=False, enforce_eos=True),
                                    options=CacheOptions.one_group())
        dt = time.perf_counter() - t0
        store = cache.store.tree["input_ids"]
        tokens = int(store.data_size) - len(cache)  # less one EOS per document
        if r:
            seconds.append(dt)
        shutil.rmtree(out, ignore_errors=True)
    ray.shutdown()
    print(json.dumps({"tokens": tokens, "seconds": seconds}))


def upstream_throughput(venv: str, tmp: str, tok_dir: str, shards: list[str], repeats: int) -> dict:
    py = os.path.join(venv, "bin", "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TOKENIZERS_PARALLELISM")}
    env.update(JAX_PLATFORMS="cpu", RAY_USAGE_STATS_ENABLED="0")
    cmd = [py, os.path.abspath(__file__), "--upstream-build", tok_dir, os.path.join(tmp, "upstream"),
           str(repeats), *shards]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"upstream builder failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tokens": res["tokens"], "tokens_per_s": mstats([res["tokens"] / s for s in res["seconds"]]),
            "seconds": mstats(res["seconds"])}


# -- the run ---------------------------------------------------------------------------------------------
def run(cfg: dict, venv: str | None = DEFAULT_UPSTREAM) -> dict:
    tmp = tempfile.mkdtemp(prefix="levanter-cache-build-")
    try:
        shards, tok_dir, n_docs = make_corpus(tmp, cfg["bpe_train_mb"])
        out: dict = {"corpus": {"docs": n_docs, "shards": len(shards),
                                "bytes": sum(os.path.getsize(s) for s in shards)}, "workers": WORKERS}
        out["raw"] = raw_throughput(tok_dir, shards, cfg["raw_repeats"])
        out.update(our_builds(tmp, shards, tok_dir, cfg["repeats"]))
        out["upstream"] = None
        if venv and os.path.exists(os.path.join(venv, "bin", "python")):
            out["upstream"] = upstream_throughput(venv, tmp, tok_dir, shards, cfg["repeats"])
        raw = out["raw"]["tokens_per_s"]["median"]
        for name in ("process", "ray"):
            rate = out[name]["tokens_per_s"]["median"]
            out[name]["vs_raw"] = rate / raw
            if out["upstream"]:
                out[name]["vs_upstream"] = rate / out["upstream"]["tokens_per_s"]["median"]
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_report(out: dict) -> None:
    c = out["corpus"]
    print(f"# corpus: {c['docs']} documents in {c['shards']} jsonl shards, {c['bytes'] / 1e6:.1f} MB; "
          f"BPE vocab {BPE_VOCAB}; {out['workers']} workers")
    print(f"{'what':<34} {'tokens/s (median)':>18} {'min':>12} {'max':>12} {'vs raw':>8} {'vs upstream':>12}")
    rows = [("raw encode_batch (all cores)", out["raw"], None, None)]
    rows += [(f"{n} backend, {out['workers']} workers", out[n], out[n]["vs_raw"], out[n].get("vs_upstream"))
             for n in ("process", "ray")]
    if out["upstream"]:
        rows.append((f"upstream builder (Ray, {out['workers']} CPUs)", out["upstream"],
                     out["upstream"]["tokens_per_s"]["median"] / out["raw"]["tokens_per_s"]["median"], 1.0))
    for label, d, vr, vu in rows:
        s = d["tokens_per_s"]
        print(f"{label:<34} {s['median']:>18,.0f} {s['min']:>12,.0f} {s['max']:>12,.0f} "
              f"{'' if vr is None else f'{vr:.2f}x':>8} {'' if vu is None else f'{vu:.2f}x':>12}")
    for n in ("process", "ray"):
        print(f"goal {n}: >= {GOAL_RAW}x raw: {'met' if out[n]['vs_raw'] >= GOAL_RAW else 'MISSED'}"
              + ("" if "vs_upstream" not in out[n] else
                 f"; ahead of upstream: {'met' if out[n]['vs_upstream'] > 1 else 'MISSED'}"))


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.add_argument("--upstream-venv", default=DEFAULT_UPSTREAM,
                   help="upstream levanter venv (setup_upstream_venv.sh)")
    p.add_argument("--no-upstream", action="store_true", help="skip upstream's builder")
    p.add_argument("--upstream-build", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.upstream_build:
        tok_dir, out_root, repeats, *shards = args.upstream_build
        upstream_main(tok_dir, out_root, int(repeats), shards)
        return
    print(f"# cache_build: python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
          + load_average())
    t0 = time.perf_counter()
    out = run(QUICK if args.quick else FULL, None if args.no_upstream else args.upstream_venv)
    print_report(out)
    print(f"# total {time.perf_counter() - t0:.1f} s; load average now " + load_average())
    write_json(args.json, out)


if __name__ == "__main__":
    main()
