#!/usr/bin/env python
"""Benchmark: how close is building a token cache to raw tokenizer speed, and reading it to raw tensorstore?

Everything is measured in one run on the same machine, on the same text: the embedded ``python-code``
and ``python-docs`` train splits, materialised as jsonl into a temp dir (~10 MB, ~1.1k documents).

1. **Build throughput** (text tokens/s; the EOS that the cache appends is not counted, so raw and build
   count the same tokens):

   * *raw*: ``tok.encode_batch(all documents)`` in one call, documents already in memory, no I/O. Each
     raw measurement runs in a fresh subprocess (this script in a hidden mode) because HF ``tokenizers``
     decides on Rayon multithreading from ``TOKENIZERS_PARALLELISM`` in the process that encodes:
     "1 thread" sets it to ``false``; "default" leaves it unset (Rayon, one thread per core). One
     untimed warm-up call on a few documents, then ``--raw-repeats`` timed calls.
   * *build*: ``build_or_load_cache(shards, fresh_dir, tok, options=CacheOptions(num_workers=w),
     progress=False)`` end to end: reading jsonl, tokenizing, writing tensorstore, ledger commits,
     worker start-up (spawn) and shutdown. Builds are repeated ``--build-repeats`` times, interleaved
     across (tokenizer, workers) so drift hits every configuration alike.
   * tokenizers: a 2048-vocab byte-level BPE trained with ``train_bpe`` on ~3 MB of the same text, and
     the ``ByteTokenizer``.
   * ratio = median build tokens/s / median raw tokens/s. The goal (>= 0.5x at 2 workers) is judged
     against raw **default** (multithreaded) for BPE: on this machine it is what ``encode_batch`` alone
     achieves with all cores, as the 2-worker build also has all cores. The ratio against raw 1-thread
     is printed alongside. (For the ByteTokenizer, pure Python, the two raw modes are the same thing.)

2. **Read throughput**: a byte-tokenizer cache of ``--read-copies`` copies of the same text (default 2,
   ~20M tokens; ``--quick`` 1) is built (2 workers), then for batches of B x 1024 (B = 8, 256) of random
   window indices (sorted ascending, as the loader passes them) it times
   ``TokenSeqDataset(cache.store, 1024).get_batch(step, indices)`` against a raw tensorstore read of the
   same windows (the store's ``input_ids/data`` zarr3 array opened directly, one ``arr[s:s+1024].read``
   per window inside one ``ts.Batch()``, then ``np.stack``). A raw ``ts.stack`` single read (what
   ``JaggedArrayStore.read_windows`` does internally) is shown for reference. Each repeat draws
   ``--read-batches`` fresh random batches and runs every method over the same batches (method order
   rotated per repeat); median/min/max over ``--read-repeats`` repeats, warm-up excluded.

Usage::

    .venv/bin/python scripts/bench/cache.py            # ~2 minutes on 2 cores
    .venv/bin/python scripts/bench/cache.py --quick    # well under a minute
"""

from __future__ import annotations

from _common import load_average, parser, print_table  # noqa: E402 -- scripts/bench is on sys.path
import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

# Keep the imports above light: the cache builder's ``spawn`` workers re-import this module as
# ``__mp_main__``, and anything imported here would be charged to every build's worker start-up.

SOURCES = ("python-code", "python-docs")
SEQ_LEN = 1024
READ_BATCH_SIZES = (8, 256)
BPE_VOCAB = 2048
GOAL_BUILD = 0.5
GOAL_READ = 0.5


# -- helpers -------------------------------------------------------------------------------------------
def mstats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def fs_type(path: str) -> str:
    """Filesystem type of ``path`` from /proc/mounts (longest matching mount point), or '?'."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) >= len(best):
                        best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def read_texts(shards: list[str]) -> list[str]:
    from levanter.ingest import iter_documents

    return [d for s in shards for d in iter_documents(s)]


# -- 1. raw tokenizer throughput (runs in a subprocess) ------------------------------------------------
def raw_encode_main(tok_spec: str, shards: list[str], repeats: int) -> None:
    """Hidden mode: time ``encode_batch`` over all documents; print one JSON line."""
    from levanter.ingest import load_tokenizer

    texts = read_texts(shards)
    tok = load_tokenizer(tok_spec)
    tok.encode_batch(texts[:8])  # warm-up: first call, thread-pool start
    seconds, convert, tokens = [], [], None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        ids = tok.encode_batch(texts)
        seconds.append(time.perf_counter() - t0)
        tokens = sum(len(x) for x in ids)
        # For information only, not part of "raw": turning the id lists into int32 arrays the way the
        # cache builder's _encode does (per 512-document batch: per-document int64 arrays, concatenate,
        # cast to int32).
        t0 = time.perf_counter()
        for i in range(0, len(ids), 512):
            np.concatenate([np.asarray(x, dtype=np.int64) for x in ids[i : i + 512]]).astype(np.int32)
        convert.append(time.perf_counter() - t0)
        del ids
    print(json.dumps({"tokens": tokens, "docs": len(texts), "seconds": seconds, "convert": convert}))


def run_raw(tok_spec: str, shards: list[str], repeats: int, single_thread: bool) -> dict:
    env = dict(os.environ)
    if single_thread:
        env["TOKENIZERS_PARALLELISM"] = "false"
    else:
        env.pop("TOKENIZERS_PARALLELISM", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--raw-encode", tok_spec, "--raw-repeats", str(repeats)]
    cmd += ["--raw-shards", *shards]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- 1. build throughput -------------------------------------------------------------------------------
def time_build(shards: list[str], cache_dir: str, tok, workers: int) -> tuple[float, int, int]:
    """Seconds for one end-to-end build into a fresh ``cache_dir``; also (text tokens, documents)."""
    from levanter.ingest import CacheOptions, build_or_load_cache

    shutil.rmtree(cache_dir, ignore_errors=True)
    gc.collect()
    t0 = time.perf_counter()
    options = CacheOptions(num_workers=workers)
    cache = build_or_load_cache(shards, cache_dir, tok, options=options, progress=False)
    elapsed = time.perf_counter() - t0
    eos = 1 if cache.eos_id is not None and cache.metadata.get("enforce_eos") else 0
    rows = cache.ledger.total_rows
    return elapsed, cache.ledger.total_tokens - eos * rows, rows


# -- 2. read throughput --------------------------------------------------------------------------------
def read_benchmark(cache_dir: str, batch_sizes, n_batches: int, repeats: int, seed: int):
    """{(batch_size, method): [tokens/s per repeat]} plus the dataset length in windows."""
    import asyncio

    import tensorstore as ts

    from levanter.data.text import TokenSeqDataset
    from levanter.store import TokenCache

    cache = TokenCache.open(cache_dir)
    ds = TokenSeqDataset(cache.store, SEQ_LEN)
    n_windows = len(ds)
    data_path = os.path.join(cache_dir, "input_ids", "data")
    raw = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": data_path}}, open=True).result()
    if int(raw.domain.exclusive_max[0]) != cache.store.data_size:
        raise AssertionError("raw data array and store disagree on size")
    loop = asyncio.new_event_loop()

    def read_ds(batches):
        async def go():
            return [await ds.get_batch(step, idx) for step, idx in enumerate(batches)]

        return loop.run_until_complete(go())

    def read_raw_batch(batches):
        out = []
        for idx in batches:
            with ts.Batch() as batch:
                futs = [raw[int(s) : int(s) + SEQ_LEN].read(batch=batch) for s in idx * SEQ_LEN]
            out.append(np.stack([f.result() for f in futs]))
        return out

    def read_raw_stack(batches):
        out = []
        for idx in batches:
            views = [raw[int(s) : int(s) + SEQ_LEN].translate_to[0] for s in idx * SEQ_LEN]
            out.append(ts.stack(views, axis=0).read().result())
        return out

    methods = {"get_batch": read_ds, "raw ts.Batch": read_raw_batch, "raw ts.stack": read_raw_stack}
    rng = np.random.default_rng(seed)

    def draw(bs: int, k: int):
        return [np.sort(rng.choice(n_windows, size=bs, replace=False)).astype(np.int64) for _ in range(k)]

    # Warm-up (untimed) and a correctness check: every method returns the same windows.
    for bs in batch_sizes:
        batches = draw(bs, 3)
        results = {name: fn(batches) for name, fn in methods.items()}
        for name, res in results.items():
            for a, b in zip(res, results["raw ts.Batch"]):
                if a.shape != (bs, SEQ_LEN) or not np.array_equal(a, b):
                    raise AssertionError(f"{name} returned different data than the raw read")

    rates: dict = {(bs, m): [] for bs in batch_sizes for m in methods}
    names = list(methods)
    for r in range(repeats):
        for bs in batch_sizes:
            batches = draw(bs, n_batches)
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                gc.collect()
                t0 = time.perf_counter()
                methods[name](batches)
                elapsed = time.perf_counter() - t0
                rates[(bs, name)].append(n_batches * bs * SEQ_LEN / elapsed)
    loop.close()
    return rates, n_windows, cache.store.data_size


# -- main ----------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    p = parser(
        __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats, workers 1 and 2 only (< 1 minute)")
    p.add_argument("--build-repeats", type=int, default=None, help="builds per configuration (3; --quick: 1)")
    p.add_argument("--raw-repeats", type=int, default=None, help="timed encode_batch calls (3; --quick: 1)")
    p.add_argument("--workers", type=int, nargs="+", default=None, help="num_workers to build with (1 2 4)")
    p.add_argument("--bpe-train-mb", type=float, default=3.0, help="MB of text to train the BPE on")
    p.add_argument("--read-copies", type=int, default=None, help="corpus copies to read (2; quick: 1)")
    p.add_argument("--read-batches", type=int, default=None, help="batches per read repeat (30; --quick: 10)")
    p.add_argument("--read-repeats", type=int, default=None, help="read repeats (5; --quick: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="parent of the temp dir (default: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    # hidden: the raw-encode subprocess mode
    p.add_argument("--raw-encode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--raw-shards", nargs="+", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.raw_encode is not None:
        raw_encode_main(args.raw_encode, args.raw_shards, args.raw_repeats or 1)
        return

    q = args.quick
    build_repeats = args.build_repeats or (1 if q else 3)
    raw_repeats = args.raw_repeats or (1 if q else 3)
    workers_list = args.workers or ([1, 2] if q else [1, 2, 4])
    read_copies = args.read_copies or (1 if q else 2)
    read_batches = args.read_batches or (10 if q else 30)
    read_repeats = args.read_repeats or (3 if q else 5)

    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="levanter-cache-bench-", dir=args.tmpdir)
    try:
        _run(args, tmp, build_repeats, raw_repeats, workers_list, read_copies, read_batches, read_repeats)
    finally:
        if args.keep:
            print(f"# kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"# total wall time {time.perf_counter() - t_start:.1f} s; load average now "
          + load_average())


def _run(
    args, tmp, build_repeats, raw_repeats, workers_list, read_copies, read_batches, read_repeats
) -> None:
    from levanter.ingest import ByteTokenizer, materialize, train_bpe

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    print(
        f"# cache benchmark: python {platform.python_version()} ({platform.machine()}), "
        f"{os.cpu_count()} CPUs "
        f"({usable} usable), load average " + load_average()
    )
    print(
        f"# tokenizers {pkg_version('tokenizers')}, tensorstore {pkg_version('tensorstore')}, "
        f"numpy {np.__version__}; temp dir {tmp} ({fs_type(tmp)}); parent TOKENIZERS_PARALLELISM="
        f"{os.environ.get('TOKENIZERS_PARALLELISM', '<unset>')}, RAYON_NUM_THREADS="
        f"{os.environ.get('RAYON_NUM_THREADS', '<unset>')}"
    )

    # -- corpus and tokenizers (untimed setup, reported for information) -----------------------------
    t0 = time.perf_counter()
    corpus = os.path.join(tmp, "corpus")
    shards = [materialize(name, "train", corpus) for name in SOURCES]
    t_mat = time.perf_counter() - t0
    texts = read_texts(shards)
    n_bytes = sum(os.path.getsize(s) for s in shards)
    budget = int(args.bpe_train_mb * 1e6)
    sample, size = [], 0
    for t in texts[::3] + texts[1::3] + texts[2::3]:  # spread over both sources
        if size >= budget:
            break
        sample.append(t)
        size += len(t)
    t0 = time.perf_counter()
    bpe_dir = os.path.join(tmp, "bpe")
    bpe = train_bpe(sample, BPE_VOCAB, bpe_dir)
    t_train = time.perf_counter() - t0
    del texts, sample
    print(
        f"# corpus: {', '.join(f'{n}/train' for n in SOURCES)} -> {len(shards)} jsonl shards, "
        f"{n_bytes / 1e6:.1f} MB (materialised in {t_mat:.1f} s); BPE vocab {bpe.vocab_size} trained on "
        f"{size / 1e6:.1f} MB in {t_train:.1f} s"
    )
    tokenizers = {"bpe-2048": (bpe, bpe_dir), "byte": (ByteTokenizer(), "byte")}

    # -- 1a. raw tokenizer throughput, each in a fresh subprocess -------------------------------------
    raw: dict = {}
    for name, (_, spec) in tokenizers.items():
        if name == "byte":  # pure Python: TOKENIZERS_PARALLELISM does not apply; one mode serves both
            res = run_raw(spec, shards, raw_repeats, single_thread=True)
            raw[(name, "1 thread")] = raw[(name, "default")] = res
        else:
            for mode in ("1 thread", "default"):
                raw[(name, mode)] = run_raw(spec, shards, raw_repeats, single_thread=mode == "1 thread")
    rows = []
    for (name, mode), res in raw.items():
        if name == "byte" and mode == "default":
            continue
        med, lo, hi = mstats(res["seconds"])
        label = "any (pure Python)" if name == "byte" else (
            "default (Rayon)" if mode == "default" else "1 thread (PARALLELISM=false)"
        )
        rows.append([name, label, f"{res['tokens']:,}", f"{med:.3f}", f"{lo:.3f}", f"{hi:.3f}",
                     f"{res['tokens'] / med / 1e6:.2f}", f"{statistics.median(res['convert']):.3f}"])
    print_table(
        f"Raw tokenization: tok.encode_batch(all {raw[('byte', '1 thread')]['docs']} docs), in-memory, fresh "
        f"subprocess each, median of {raw_repeats}",
        [("tokenizer", 9), ("mode", 28), ("tokens", 11), ("median s", 9), ("min s", 7), ("max s", 7),
         ("Mtok/s", 7), ("(+ ids->int32 s)", 16)],
        rows,
    )
    print("(+ ids->int32 s: extra time, not in 'raw', to turn the id lists into int32 arrays as the cache's "
          "_encode does, per 512-doc batch)")

    # -- 1b. end-to-end builds --------------------------------------------------------------------------
    builds: dict = {(name, w): [] for name in tokenizers for w in workers_list}
    counts: dict = {}
    for r in range(build_repeats):
        for name, (tok, _) in tokenizers.items():
            for w in workers_list:
                secs, tokens, docs = time_build(shards, os.path.join(tmp, "build", f"{name}-w{w}"), tok, w)
                builds[(name, w)].append(secs)
                counts[name] = (tokens, docs)
    shutil.rmtree(os.path.join(tmp, "build"), ignore_errors=True)
    rows = []
    ratios: dict = {}
    for (name, w), secs in builds.items():
        tokens, docs = counts[name]
        if tokens != raw[(name, "default")]["tokens"]:
            raw_tokens = raw[(name, "default")]["tokens"]
            raise AssertionError(f"{name}: build stored {tokens} text tokens, raw encode gave {raw_tokens}")
        med, lo, hi = mstats(secs)
        rate = tokens / med
        r_def = rate / (tokens / statistics.median(raw[(name, "default")]["seconds"]))
        r_one = rate / (tokens / statistics.median(raw[(name, "1 thread")]["seconds"]))
        ratios[(name, w)] = r_def
        rows.append([name, str(w), f"{tokens:,}", f"{med:.3f}", f"{lo:.3f}", f"{hi:.3f}", f"{rate / 1e6:.2f}",
                     f"{r_def:.2f}x", f"{r_one:.2f}x"])
    print_table(
        f"build_or_load_cache end to end (fresh dir, progress=False, batch_size 512, EOS appended but not "
        f"counted), median of {build_repeats}",
        [("tokenizer", 9), ("workers", 7), ("tokens", 11), ("median s", 9), ("min s", 7), ("max s", 7),
         ("Mtok/s", 7), ("vs raw default", 14), ("vs raw 1 thread", 15)],
        rows,
    )

    # -- 2. read throughput -----------------------------------------------------------------------------
    read_shards = []
    for c in range(read_copies):
        for s in shards:
            source = os.path.basename(os.path.dirname(s))
            dst = os.path.join(tmp, "read-corpus", f"copy{c}", source + ".jsonl")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(s, dst)
            read_shards.append(dst)
    read_dir = os.path.join(tmp, "read-cache")
    t_build, _, _ = time_build(read_shards, read_dir, ByteTokenizer(), 2)
    rates, n_windows, data_size = read_benchmark(
        read_dir, READ_BATCH_SIZES, read_batches, read_repeats, args.seed
    )
    print()
    print(
        f"# read cache: byte tokenizer, {read_copies} cop{'y' if read_copies == 1 else 'ies'} of the corpus, "
        f"{data_size:,} tokens "
        f"({data_size * 4 / 1e6:.0f} MB int32, {n_windows:,} windows of {SEQ_LEN}); built (2 workers) in "
        f"{t_build:.1f} s; page cache warm"
    )
    rows = []
    read_ratios = {}
    for bs in READ_BATCH_SIZES:
        base = statistics.median(rates[(bs, "raw ts.Batch")])
        for name in ("get_batch", "raw ts.Batch", "raw ts.stack"):
            med, lo, hi = mstats(rates[(bs, name)])
            ms = bs * SEQ_LEN / med * 1e3
            if name == "get_batch":
                read_ratios[bs] = med / base
            rows.append([f"{bs}x{SEQ_LEN}", name, f"{med / 1e6:.1f}", f"{lo / 1e6:.1f}", f"{hi / 1e6:.1f}",
                         f"{ms:.2f}", f"{med / base:.2f}x"])
    print_table(
        f"Random-window reads: {read_batches} batches per repeat (sorted random indices), "
        f"median/min/max over "
        f"{read_repeats} repeats, warm-up excluded",
        [("batch", 8), ("method", 12), ("median Mtok/s", 13), ("min", 6), ("max", 6), ("ms/batch", 8),
         ("vs raw ts.Batch", 15)],
        rows,
    )

    # -- summary ----------------------------------------------------------------------------------------
    print()
    print("# summary (ratio of medians; build ratio is against raw default = multithreaded encode_batch)")
    for name in tokenizers:
        if (name, 2) in ratios:
            r = ratios[(name, 2)]
            verdict = "PASS" if r >= GOAL_BUILD else "MISS"
            print(f"build {name:>8}, 2 workers: {r:.2f}x raw encode_batch (goal >= {GOAL_BUILD}x): {verdict}")
    for bs, r in read_ratios.items():
        verdict = "PASS" if r >= GOAL_READ else "MISS"
        print(
            f"read {bs:>4}x{SEQ_LEN} get_batch: {r:.2f}x raw ts.Batch+np.stack "
            f"(goal >= {GOAL_READ}x): {verdict}"
        )


if __name__ == "__main__":
    main()
