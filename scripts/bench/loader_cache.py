#!/usr/bin/env python
"""Benchmark: our ``DataLoader`` on a tensorstore token cache against a raw tensorstore read of the same rows.

The data is the synthetic corpus of ``_synthetic.py`` (3 sources, byte-level tokens, EOS-terminated
documents) written straight into our cache format (``JaggedArrayStore`` + a finished ledger whose
metadata matches the config below, so ``build_or_load_cache`` opens it without rebuilding). The
dataset is the production path: ``LMMixtureDatasetConfig.train_set(1024, schedule, key, tokens_only=True)``
(as ``train_lm`` builds it: tokens only, the loss mask and segment ids are derived in the train step) -- per
source ``TokenSeqDataset -> CausalLmDataset -> shuffle`` (Feistel permutation), then a 2-stage
``MixtureDataset`` (block 2048, ``restart``) -- read by ``DataLoader`` on the first CPU device.

Measured (all functions return plain dicts; ``run_all.py`` drives them and prints the tables):

* ``loader_throughput``: tokens/s over ``n`` consecutive steps that straddle the stage switch, after the
  first batch (untimed); every batch's arrays are waited for (``block_until_ready``). ``prefetch`` 0 is
  the loader fetching each step on demand in the caller's thread.
* ``raw_throughput``: the same rows read straight from each source's ``input_ids/data`` zarr3 array
  with tensorstore -- the indices (mixture draw + permutation) are computed before the clock starts --
  one batch at a time as (a) one ``ts.stack`` read per source per batch, (a') one ``ts.concat`` of plain
  slices per source per batch (what our loader issues, for the whole batch) and (b) one read per window
  inside a ``ts.Batch``, then ``np.stack``. Tokens only (what the loader ships), into one host
  ``int32[B, 1024]`` array: no index math, no device arrays. The fastest of the three is the limit the
  loader is compared with (upstream's baseline measured its raw read the same way). For reference, (c) one
  concatenated read per batch with 8 batches in flight and (d) one concatenated read of 8 batches' rows
  at a time (what the loader's coalesced reads do for batches of <= 16 rows) show what tensorstore alone
  reaches with read-ahead.
* ``time_to_first_batch``: a fresh ``train_set`` + ``DataLoader`` (timed separately as "build"), then
  ``iter_from_step(k)`` until the first batch is ready.
* ``memory_probe`` (run in a fresh process by ``run_all.py``): resident set size before and while
  iterating, to show that what the loader holds is bounded by prefetch depth x batch bytes.
* ``checksum_cost``: what the crc32c codec of every cache chunk costs in read speed. The caches above are
  written as training writes them (with checksums); the same tokens are written again without them, and
  the loader and the raw concatenated read run on both, interleaved, in the same process: the ratio
  (checksummed / plain) is per repeat. ``python loader_cache.py --checksum`` runs it alone.
"""

from __future__ import annotations

import os
import time

import numpy as np

import _synthetic as syn

SYNTH_URL = "synthetic://{name}"  # recorded in the cache metadata; never opened (the cache is finished)


def write_source(cache_dir: str, index: int, n_tokens: int, url: str, checksum: bool = True) -> int:
    """Source ``index`` of the synthetic corpus as a finished cache of ours at ``cache_dir``; its tokens.
    ``checksum=False`` writes chunks without the crc32c codec (for :func:`checksum_cost`)."""
    from levanter.ingest import ByteTokenizer, cache_metadata
    from levanter.store import CacheLedger, JaggedArrayStore

    tok = ByteTokenizer()
    assert tok.eos_token_id == syn.EOS and tok.vocab_size == syn.VOCAB, "ByteTokenizer ids changed"
    flat, lengths = syn.source_tokens(index, n_tokens)
    store = JaggedArrayStore.open(os.path.join(cache_dir, "input_ids"), mode="w", checksum=checksum)
    store.append_flat(flat, lengths)
    store.finalize()
    meta = cache_metadata(tok, urls=[url], text_key="text", enforce_eos=True)
    CacheLedger(
        shard_rows={url: len(lengths)}, shard_docs={url: len(lengths)}, finished_shards=[url],
        total_rows=len(lengths), total_tokens=int(lengths.sum()), is_finished=True,
        metadata={**meta, "shards": [url]},
    ).save(cache_dir)
    return int(lengths.sum())


def write_caches(root: str, total_tokens: int, checksum: bool = True) -> dict:
    """Write the three sources into ``root/<name>/train`` in our format; returns per-source token counts."""
    return {
        name: write_source(os.path.join(root, name, "train"), k, n, SYNTH_URL.format(name=name), checksum)
        for k, (name, n) in enumerate(syn.source_sizes(total_tokens).items())
    }


def mixture_config(root: str):
    from levanter.data.config import LMMixtureDatasetConfig
    from levanter.data.source_config import LMDatasetSourceConfig

    return LMMixtureDatasetConfig(
        tokenizer="byte",
        cache_dir=root,
        configs={
            name: LMDatasetSourceConfig(train_urls=[SYNTH_URL.format(name=name)], cache_dir=os.path.join(root, name))
            for name in syn.SOURCES
        },
        train_weights=[(s, dict(w)) for s, w in syn.STAGES],
        shuffle=True,
        mixture_block_size=2048,
        stop_strategy="restart",
    )


def single_source_config(root: str, name: str = "web"):
    """One source of the corpus alone (``data.train_urls``, shuffled): ``train_lm``'s single-source path,
    ``TokenSeqDataset -> CausalLmDataset -> shuffle`` with no mixture above it."""
    from levanter.data.config import UrlSingleDatasetLMConfig

    return UrlSingleDatasetLMConfig(
        tokenizer="byte", cache_dir=os.path.join(root, name), train_urls=[SYNTH_URL.format(name=name)], shuffle=True
    )


def make_loader(root: str, batch_size: int, prefetch: int, seq_len: int = syn.SEQ_LEN, single: bool = False,
                provenance: bool = False):
    """A loader over the 3-source mixture, or with ``single`` over the first source alone; ``provenance``:
    each batch carries it, as ``train_lm``'s loader does."""
    import jax

    from levanter.data.loader import DataLoader, use_prefetch_switch_interval

    use_prefetch_switch_interval()  # as train_lm runs the loader
    from levanter.schedule import BatchSchedule

    schedule = BatchSchedule(batch_size)
    # tokens_only, as train_lm reads it: loss mask and segment ids are derived in the train step.
    config = single_source_config(root) if single else mixture_config(root)
    ds = config.train_set(seq_len, schedule, key=jax.random.PRNGKey(0), tokens_only=True)
    return DataLoader(ds, schedule, prefetch_depth=prefetch, provenance=provenance)


def first_step(n: int) -> int:
    """Timed runs cover steps ``[s, s + n]`` around the stage switch (both stages are read)."""
    return max(0, syn.STAGE_SWITCH_STEP - n // 2)


def _ready(batch) -> None:
    import jax

    jax.block_until_ready(batch.data)


def loader_throughput(
    root: str, batch_size: int, n: int, prefetch: int = 8, seq_len: int = syn.SEQ_LEN, single: bool = False,
    provenance: bool = False,
) -> dict:
    loader = make_loader(root, batch_size, prefetch, seq_len, single, provenance)
    start = 0 if single else first_step(n)  # one source alone is finite and has no stage switch
    with loader.iter_from_step(start, start + n + 1) as it:
        _ready(next(it))
        t0, c0 = time.perf_counter(), time.process_time()
        got = 0
        for batch in it:
            _ready(batch)
            got += 1
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert got == n, (got, n)
    # CPU seconds (all of the process's threads) per batch: steadier than the wall clock on a shared machine.
    return {"tokens_per_s": n * batch_size * seq_len / dt, "seconds": dt, "batches": n, "cpu_ms_per_batch": 1e3 * cpu / n}


def _raw_plan(root: str, batch_size: int, n: int, seq_len: int = syn.SEQ_LEN) -> list:
    """For each step: ``[(source, rows in the batch, token start of each window)]`` -- what the loader reads."""
    import asyncio

    loader = make_loader(root, batch_size, 0, seq_len)
    mixture = loader.dataset
    start = first_step(n)
    plan = []

    async def go():
        for step in range(start, start + n + 1):
            idx = loader.indices_for_step(step)
            source, src_index = await mixture.source_indices(step, idx)
            per = []
            for s in np.unique(source).tolist():
                sel = np.flatnonzero(source == s)
                shuffled = mixture.datasets[s]  # PermutationDataset over CausalLmDataset
                perm = await shuffled.permutation()
                windows = perm(src_index[sel])
                per.append((s, sel, windows * seq_len))
            plan.append(per)

    asyncio.run(go())
    return plan


def _open_raw(root: str):
    import tensorstore as ts

    arrays = []
    for name in syn.SOURCES:
        path = os.path.join(root, name, "train", "input_ids", "data")
        arrays.append(ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True).result())
    return arrays


def raw_throughput(root: str, batch_size: int, n: int, seq_len: int = syn.SEQ_LEN) -> dict:
    """Raw tensorstore reads of the loader's rows; returns tokens/s of both methods and the best."""
    import tensorstore as ts

    plan = _raw_plan(root, batch_size, n, seq_len)
    arrays = _open_raw(root)
    L = seq_len

    def stacked(per):
        out = np.empty((batch_size, L), np.int32)
        futs = [
            (sel, ts.stack([arrays[s][int(x): int(x) + L].translate_to[0] for x in starts], axis=0).read())
            for s, sel, starts in per
        ]
        for sel, f in futs:
            out[sel] = f.result()
        return out

    def concat(per):
        """One ts.concat of plain slices per batch (the views our loader makes), reshaped."""
        out = np.empty((batch_size, L), np.int32)
        futs = [
            (sel, len(starts), ts.concat([arrays[s][int(x): int(x) + L] for x in starts], axis=0).read())
            for s, sel, starts in per
        ]
        for sel, k, f in futs:
            out[sel] = f.result().reshape(k, L)
        return out

    def windows(per):
        with ts.Batch() as b:
            futs = [(sel, [arrays[s][int(x): int(x) + L].read(batch=b) for x in starts]) for s, sel, starts in per]
        out = np.empty((batch_size, L), np.int32)
        for sel, fs in futs:
            out[sel] = np.stack([f.result() for f in fs])
        return out

    def in_flight(pers):
        """One read per batch (all sources concatenated), 8 batches in flight at once (what a prefetcher
        could overlap)."""
        futs = []
        for per in pers:
            order = np.concatenate([sel for _, sel, _ in per])
            views = [arrays[s][int(x): int(x) + L] for s, _, starts in per for x in starts]
            futs.append((order, ts.concat(views, axis=0).read()))
        for order, f in futs:
            out = np.empty((batch_size, L), np.int32)
            out[order] = f.result().reshape(-1, L)

    def coalesced(pers):
        """One read of several batches' rows (all sources concatenated), split afterwards."""
        orders, views = [], []
        for per in pers:
            orders.append(np.concatenate([sel for _, sel, _ in per]))
            views += [arrays[s][int(x): int(x) + L] for s, _, starts in per for x in starts]
        rows = ts.concat(views, axis=0).read().result().reshape(-1, L)
        for k, order in enumerate(orders):
            out = np.empty((batch_size, L), np.int32)
            out[order] = rows[k * batch_size: (k + 1) * batch_size]

    result = {}
    for name, fn in (("ts_stack", stacked), ("ts_concat", concat), ("ts_batch", windows)):
        fn(plan[0])  # warm-up, untimed (as the loader's first batch is)
        t0 = time.perf_counter()
        for per in plan[1:]:
            fn(per)
        dt = time.perf_counter() - t0
        result[name] = n * batch_size * L / dt
    t0 = time.perf_counter()
    for i in range(1, len(plan), 8):
        in_flight(plan[i: i + 8])
    result["in_flight8"] = n * batch_size * L / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(1, len(plan), 8):
        coalesced(plan[i: i + 8])
    result["coalesced8"] = n * batch_size * L / (time.perf_counter() - t0)
    # The limit the loader is judged against: the faster sequential read (one batch at a time).
    result["tokens_per_s"] = max(result["ts_stack"], result["ts_concat"], result["ts_batch"])
    return result


def check_same_rows(root: str, batch_size: int, step: int) -> None:
    """The raw plan reads exactly the tokens the loader yields (a guard against benchmarking other rows)."""
    import tensorstore as ts

    plan = _raw_plan(root, batch_size, 2 * (syn.STAGE_SWITCH_STEP - step))
    arrays = _open_raw(root)
    loader = make_loader(root, batch_size, 0)
    with loader.iter_from_step(step, step + 1) as it:
        tokens = np.asarray(next(it).data["tokens"])
    expect = np.empty_like(tokens)
    for s, sel, starts in plan[0]:
        expect[sel] = ts.stack([arrays[s][int(x): int(x) + syn.SEQ_LEN].translate_to[0] for x in starts]).read().result()  # noqa: E501
    if not np.array_equal(tokens, expect):
        raise AssertionError("raw plan and loader disagree on the rows of a step")


def time_to_first_batch(root: str, batch_size: int, step: int, prefetch: int = 8, seq_len: int = syn.SEQ_LEN) -> dict:
    t0 = time.perf_counter()
    loader = make_loader(root, batch_size, prefetch, seq_len)
    t1 = time.perf_counter()
    it = loader.iter_from_step(step)
    _ready(next(it))
    t2 = time.perf_counter()
    it.close()
    return {"build_s": t1 - t0, "first_batch_s": t2 - t1}


def stall_run(root: str, batch_size: int, steps: int, step_seconds: float, prefetch: int = 8) -> list[float]:
    """Per-step data wait over ``steps`` steps when each step keeps the consumer busy ``step_seconds``.

    The step is a sleep: on an accelerator the host thread waits for the device while the loader works,
    which is what a sleep models (the GIL and the cores are free). What the consumer blocks on in
    ``next()`` is the loader's own ``Batch.wait_seconds``.
    """
    loader = make_loader(root, batch_size, prefetch)
    waits = []
    with loader.iter_from_step(0, steps) as it:
        for batch in it:
            _ready(batch)
            waits.append(batch.wait_seconds)
            del batch
            time.sleep(step_seconds)
    return waits


def rss_bytes() -> dict:
    """Resident memory of this process from /proc (Linux): total, anonymous, and file-backed (pages of
    mapped files -- tensorstore reads files through mmap, so touched cache pages show up here although
    they are page cache the kernel can drop, not memory the loader holds)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def memory_probe(root: str, batch_size: int, steps: int, start: int, prefetch: int) -> dict:
    """RSS growth while iterating ``steps`` steps from ``start``, against prefetch x batch bytes.

    The baseline is taken after one batch has been fetched and dropped (imports, jax, tensorstore and
    the first-use allocations are in it); the peak is sampled after every step.
    """
    import gc

    loader = make_loader(root, batch_size, prefetch)
    with loader.iter_from_step(start, start + 1) as it:
        b = next(it)
        _ready(b)
        batch_bytes = sum(x.nbytes for x in jax_leaves(b.data))
        del b
    gc.collect()
    base = rss_bytes()
    peak_anon = peak_total = 0
    with loader.iter_from_step(start, start + steps) as it:
        for batch in it:
            _ready(batch)
            now = rss_bytes()
            peak_anon = max(peak_anon, now["RssAnon"])
            peak_total = max(peak_total, now["VmRSS"])
            del batch
    return {
        "base_rss": base["VmRSS"], "base_anon": base["RssAnon"], "peak_rss": peak_total, "peak_anon": peak_anon,
        "growth": peak_total - base["VmRSS"], "growth_anon": peak_anon - base["RssAnon"],
        "batch_bytes": batch_bytes, "bound": (prefetch + 2) * batch_bytes,
    }


def checksum_cost(root: str, plain_root: str, shapes: dict, repeats: int) -> dict:
    """Tokens/s of the loader (prefetch 8) and of the raw concatenated read on the caches at ``root``
    (crc32c) and at ``plain_root`` (the same tokens without checksums), per ``(batch, seq_len): steps`` of
    ``shapes``; the order of the two alternates between repeats so that drift hits both alike.

    Returns ``{"<batch>x<seq_len>": {"loader_crc32c": [...], "loader_plain": [...], "raw_crc32c": [...],
    "raw_plain": [...]}}`` (one value per repeat).
    """
    out = {}
    for (bs, L), n in shapes.items():
        runs: dict = {"loader_crc32c": [], "loader_plain": [], "raw_crc32c": [], "raw_plain": []}
        for where in (root, plain_root):  # first-use costs (a loader's first build) out of the timed runs
            loader_throughput(where, bs, 2, 8, L)
        for r in range(repeats):
            order = [("crc32c", root), ("plain", plain_root)]
            for kind, where in order if r % 2 == 0 else order[::-1]:
                runs[f"loader_{kind}"].append(loader_throughput(where, bs, n, 8, L)["tokens_per_s"])
                runs[f"raw_{kind}"].append(raw_throughput(where, bs, n, L)["ts_concat"])
        out[f"{bs}x{L}"] = runs
    return out


def checksum_section(work: str, root: str, total_tokens: int, shapes: dict, repeats: int) -> dict:
    """:func:`checksum_cost` with the plain caches written under ``work`` (and deleted afterwards); the
    figures as ``run_all.py`` keeps them (median, min, max of each and of the per-repeat ratios)."""
    import shutil
    import statistics

    plain = os.path.join(work, "cache-no-checksum")
    write_caches(plain, total_tokens, checksum=False)
    try:
        raw = checksum_cost(root, plain, shapes, repeats)
    finally:
        shutil.rmtree(plain, ignore_errors=True)

    def stats(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}

    res = {}
    for key, r in raw.items():
        res[key] = {k: stats(v) for k, v in r.items()}
        for what in ("loader", "raw"):
            res[key][f"{what}_ratio"] = stats([a / b for a, b in zip(r[f"{what}_crc32c"], r[f"{what}_plain"])])
    return res


def print_checksum_section(res: dict) -> None:
    from _common import print_table

    def f(s, scale=1.0, spec=".2f"):
        return f"{s['median'] * scale:{spec}} [{s['min'] * scale:{spec}}, {s['max'] * scale:{spec}}]"

    rows = [[key, f(r["loader_crc32c"], 1e-6), f(r["loader_plain"], 1e-6), f(r["loader_ratio"], spec=".3f"),
             f(r["raw_crc32c"], 1e-6), f(r["raw_plain"], 1e-6), f(r["raw_ratio"], spec=".3f")] for key, r in res.items()]
    print_table("Checksums: M tokens/s with crc32c chunks vs without, median [min, max]; ratio = crc32c / plain",
                [("batch", 8), ("loader crc32c", 20), ("loader plain", 20), ("loader ratio", 20),
                 ("raw crc32c", 20), ("raw plain", 20), ("raw ratio", 20)], rows)


def single_vs_mixture(root: str, shapes: dict, repeats: int) -> dict:
    """Tokens/s of the loader (prefetch 8 and 0; and prefetch 8 with provenance, as ``train_lm`` reads) over
    one source alone and over the mixture, per ``(batch, seq_len): steps`` of ``shapes``, the runs rotated
    between repeats so that drift hits all alike.
    Returns ``{"<batch>x<seq_len>": {"single_p8": [...], "single_p0": [...], "mixture_p8": [...],
    "mixture_p0": [...], "single_p8_cpu_ms": [...], ...}}`` (one value per repeat; ``*_cpu_ms``: the
    process's CPU milliseconds per batch, steadier than tokens/s where other work shares the cores)."""
    out = {}
    kinds = [("single", True, 8, False), ("single", True, 0, False), ("single", True, 8, True),
             ("mixture", False, 8, False), ("mixture", False, 0, False), ("mixture", False, 8, True)]

    def name(k, p, prov):
        return f"{k}_p{p}" + ("_prov" if prov else "")

    for (bs, L), n in shapes.items():
        for _, single, p, _ in kinds[::3]:  # first-use costs (a loader's first build) out of the timed runs
            loader_throughput(root, bs, 2, p, L, single)
        runs: dict = {name(k, p, prov) + cpu: [] for k, _, p, prov in kinds for cpu in ("", "_cpu_ms")}
        for r in range(repeats):
            for k, single, p, prov in kinds[r % 6:] + kinds[: r % 6]:
                res = loader_throughput(root, bs, n, p, L, single, prov)
                runs[name(k, p, prov)].append(res["tokens_per_s"])
                runs[name(k, p, prov) + "_cpu_ms"].append(res["cpu_ms_per_batch"])
        out[f"{bs}x{L}"] = runs
    return out


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


if __name__ == "__main__":  # the memory probe runs here, in a fresh process, for run_all.py
    import json
    import sys

    if sys.argv[1:2] == ["--single"]:  # one source alone against the mixture: --single [tokens [repeats]]
        # 12M tokens: the first source (half of them) holds the 81 batches of 64 x 1024 read from step 0.
        import statistics
        import tempfile

        tokens, repeats = (int(x) for x in (sys.argv[2:] + ["12000000", "3"][len(sys.argv) - 2:])[:2])
        with tempfile.TemporaryDirectory(prefix="levanter-bench-single-") as work:
            write_caches(os.path.join(work, "cache"), tokens)
            res = single_vs_mixture(os.path.join(work, "cache"), {(8, 1024): 300, (64, 1024): 80, (8, 64): 600},
                                    repeats)
        for key, runs in res.items():
            print(key, "  ".join(f"{k} {statistics.median(v) / 1e6:.2f} M tok/s [{min(v) / 1e6:.2f}, "
                                 f"{max(v) / 1e6:.2f}]" for k, v in runs.items() if not k.endswith("_cpu_ms")))
            print(key, "  ".join(f"{k} {statistics.median(v):.3f} ms/batch" for k, v in runs.items()
                                 if k.endswith("_cpu_ms")))
        print(json.dumps(res))
    elif sys.argv[1:2] == ["--checksum"]:  # the checksum comparison alone: --checksum [tokens [steps [repeats]]]
        import tempfile

        tokens, steps, repeats = (int(x) for x in (sys.argv[2:] + ["4000000", "40", "3"][len(sys.argv) - 2:])[:3])
        with tempfile.TemporaryDirectory(prefix="levanter-bench-crc-") as work:
            write_caches(os.path.join(work, "cache"), tokens)
            res = checksum_section(work, os.path.join(work, "cache"), tokens,
                                   {(8, 1024): steps, (64, 1024): max(steps // 4, 2)}, repeats)
        print_checksum_section(res)
        print(json.dumps(res))
    else:
        args = json.loads(sys.argv[1])
        print(json.dumps(memory_probe(**args)))
