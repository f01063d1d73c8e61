"""Token-cache storage: jagged stores round-trip, resume byte-identically, read in batches;
the ledger saves atomically and refuses corrupt files with a clear error."""

import asyncio
import json
import os

import numpy as np
import pytest

from helpers import tree_bytes
from levanter.store import LEDGER_FILENAME, CacheLedger, CorruptLedgerError, JaggedArrayStore


SMALL = dict(data_chunk=16, offsets_chunk=8)  # tiny chunks so rows and windows cross chunk boundaries


def ragged_rows(n, seed=0, max_len=40, dtype=np.int32):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, n)
    lengths[::7] = 0  # plenty of empty rows, including the first
    return [rng.integers(0, 50_000, int(k)).astype(dtype) for k in lengths]


def build(path, batches, **kw):
    store = JaggedArrayStore.open(path, mode="w", **{**SMALL, **kw})
    for b in batches:
        store.append(b)
    store.finalize()
    return store


def run(coro):
    return asyncio.run(coro)


# -- JaggedArrayStore ------------------------------------------------------------------------------


def test_round_trip_ragged_rows_across_chunks(tmp_path):
    rows = ragged_rows(300)
    build(tmp_path / "s", [rows])
    store = JaggedArrayStore.open(tmp_path / "s", mode="r")
    assert store.num_rows == 300
    assert store.data_size == sum(len(r) for r in rows) > 20 * 16  # many data chunks
    assert store.dtype == np.int32
    order = list(range(300))[::-1] + [3, 3, 0]
    got = store.read_rows_sync(order)
    for i, g in zip(order, got):
        np.testing.assert_array_equal(g, rows[i])
        assert g.dtype == np.int32
    # Rows lie back to back in the flat token stream that windows read.
    np.testing.assert_array_equal(store.read_windows_sync([0], store.data_size)[0], np.concatenate(rows))
    assert [len(r) for r in store.read_rows_sync([0, 7, 5])] == [0, 0, len(rows[5])]
    assert store.read_rows_sync([]) == []


def test_only_empty_rows_and_other_dtypes(tmp_path):
    store = build(tmp_path / "e", [[np.array([], np.uint16)] * 3], dtype=np.uint16)
    assert (store.num_rows, store.data_size) == (3, 0)
    got = JaggedArrayStore.open(tmp_path / "e", mode="r").read_rows_sync([0, 2])
    assert [g.dtype for g in got] == [np.uint16] * 2 and all(g.size == 0 for g in got)
    with pytest.raises(TypeError, match="uint16"):
        JaggedArrayStore.open(tmp_path / "e", mode="r", dtype=np.int32)
    w = JaggedArrayStore.open(tmp_path / "x", mode="w")
    with pytest.raises(OverflowError):
        w.append([np.array([2**40])])
    with pytest.raises(TypeError):
        w.append([np.array([1.5])])
    with pytest.raises(ValueError, match="1-D"):
        w.append([np.zeros((2, 2), np.int32)])
    assert w.num_rows == 0


def test_split_appends_are_byte_identical(tmp_path):
    rows = ragged_rows(200, seed=1)
    build(tmp_path / "one", [rows])
    cuts = [0, 1, 2, 17, 60, 61, 150, 200]
    build(tmp_path / "many", [rows[a:b] for a, b in zip(cuts, cuts[1:])] + [[]])
    a, b = tree_bytes(tmp_path / "one"), tree_bytes(tmp_path / "many")
    assert len(a) > 10 and a == b


@pytest.mark.parametrize("committed", [0, 1, 37, 120])
def test_resume_after_crash_is_byte_identical(tmp_path, committed):
    rows = ragged_rows(150, seed=2)
    build(tmp_path / "clean", [rows])

    crashed = JaggedArrayStore.open(tmp_path / "crash", mode="w", **SMALL)
    crashed.append(rows[:committed])
    crashed.append(rows[committed:140])  # written but never recorded in a ledger; no finalize
    del crashed

    # Before resuming, a reader with the ledger count sees only committed rows...
    reader = JaggedArrayStore.open(tmp_path / "crash", mode="r", num_rows=committed)
    assert reader.num_rows == committed
    with pytest.raises(IndexError):
        reader.read_rows_sync([committed])
    # ...and one without it is refused rather than served garbage.
    with pytest.raises(ValueError, match="not finalized"):
        JaggedArrayStore.open(tmp_path / "crash", mode="r")

    resumed = JaggedArrayStore.open(tmp_path / "crash", mode="a", num_rows=committed)
    assert resumed.data_size == sum(len(r) for r in rows[:committed])
    mid = (committed + 150) // 2
    resumed.append(rows[committed:mid])
    resumed.append(rows[mid:])
    resumed.finalize()
    assert tree_bytes(tmp_path / "crash") == tree_bytes(tmp_path / "clean")


def test_resume_where_garbage_extends_past_final_end(tmp_path):
    # The crashed writer wrote more than the resumed build will: its tail must vanish entirely.
    rows = ragged_rows(60, seed=3)
    build(tmp_path / "clean", [rows[:30]])
    crashed = JaggedArrayStore.open(tmp_path / "crash", mode="w", **SMALL)
    crashed.append(rows[:25])
    crashed.append(rows[25:])
    resumed = JaggedArrayStore.open(tmp_path / "crash", mode="a", num_rows=25)
    resumed.append(rows[25:30])
    resumed.finalize()
    assert tree_bytes(tmp_path / "crash") == tree_bytes(tmp_path / "clean")


def test_crash_while_creating(tmp_path):
    import shutil

    build(tmp_path / "s", [ragged_rows(5)])
    shutil.rmtree(tmp_path / "s" / "offsets")  # died between creating data and offsets
    with pytest.raises(FileNotFoundError, match="offsets"):
        JaggedArrayStore.open(tmp_path / "s", mode="a", num_rows=3)
    s = JaggedArrayStore.open(tmp_path / "s", mode="a", num_rows=0)  # nothing committed: start afresh
    s.append([np.arange(4)])
    s.finalize()
    (row,) = JaggedArrayStore.open(tmp_path / "s", mode="r").read_rows_sync([0])
    np.testing.assert_array_equal(row, np.arange(4))


def test_append_to_finalized_store(tmp_path):
    rows = ragged_rows(80, seed=4)
    build(tmp_path / "clean", [rows])
    build(tmp_path / "two", [rows[:50]])
    s = JaggedArrayStore.open(tmp_path / "two", mode="a")
    assert s.num_rows == 50
    s.append(rows[50:])
    s.finalize()
    assert tree_bytes(tmp_path / "two") == tree_bytes(tmp_path / "clean")


def test_read_windows_matches_numpy(tmp_path):
    rows = ragged_rows(400, seed=5)
    flat = np.concatenate(rows)
    store = build(tmp_path / "w", [rows])
    rng = np.random.default_rng(0)
    L = 37
    starts = np.concatenate([rng.integers(0, flat.size - L + 1, 200), [0, flat.size - L, 15, 16]])
    expect = flat[starts[:, None] + np.arange(L)]
    got = run(store.read_windows(starts, L))
    assert got.shape == (len(starts), L) and got.dtype == np.int32
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(store.read_windows_sync(starts[:5], L), expect[:5])
    assert run(store.read_windows(np.array([], np.int64), L)).shape == (0, L)


def test_out_of_range_reads(tmp_path):
    store = build(tmp_path / "o", [ragged_rows(10, seed=6)])
    with pytest.raises(IndexError, match=r"row 10 .* 10 rows"):
        store.read_rows_sync([0, 10])
    with pytest.raises(IndexError, match="row -1"):
        store.read_rows_sync([-1])
    n = store.data_size
    with pytest.raises(IndexError, match=rf"\[{n - 3}, {n + 1}\) .* {n} elements"):
        run(store.read_windows([0, n - 3], 4))
    with pytest.raises(IndexError):
        store.read_windows_sync([-1], 4)


def test_window_blocks_read_what_window_views_read(tmp_path):
    """An index-array block of windows (from one store or several) holds the same rows as one view per
    window; bad windows are refused before any read, naming the window and the store's size."""
    from levanter.store.batched_reads import read_blocks, read_stacked

    a = build(tmp_path / "a", [ragged_rows(40, seed=8)])
    b = build(tmp_path / "b", [ragged_rows(30, seed=9)])
    starts_a, starts_b = np.array([5, 0, 5, a.data_size - 7]), np.array([b.data_size - 7, 3])
    views = a.window_views(starts_a, 7) + b.window_views(starts_b, 7)
    want = read_stacked(views).result()
    got = read_blocks([a.window_block(starts_a, 7), b.window_block(starts_b, 7)]).result()
    assert got.shape == (6, 7) and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(read_blocks([a.window_block([2], 3)]).result(), a.read_windows_sync([2], 3))
    n = a.data_size
    with pytest.raises(IndexError, match=rf"\[{n - 3}, {n + 1}\) .* {n} elements"):
        a.window_block([0, n - 3], 4)
    with pytest.raises(IndexError, match=r"\[-1, 3\)"):
        a.window_block([-1], 4)
    with pytest.raises(ValueError, match="non-empty"):
        a.window_block([], 4)
    with pytest.raises(ValueError, match="length"):
        a.window_block([0], 0)


def test_open_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        JaggedArrayStore.open(tmp_path / "nowhere", mode="r")
    with pytest.raises(ValueError, match="mode"):
        JaggedArrayStore.open(tmp_path / "s", mode="x")
    build(tmp_path / "s", [ragged_rows(5)])
    with pytest.raises(ValueError, match="at most 5 rows"):
        JaggedArrayStore.open(tmp_path / "s", mode="r", num_rows=6)
    with pytest.raises(PermissionError):
        JaggedArrayStore.open(tmp_path / "s", mode="r").append([np.arange(3)])
    # "w" replaces an existing store.
    s = JaggedArrayStore.open(tmp_path / "s", mode="w")
    assert s.num_rows == 0
    assert JaggedArrayStore.open(tmp_path / "s", mode="r").num_rows == 0


def test_memory_url_and_codec():
    rows = ragged_rows(50, seed=7)
    s = JaggedArrayStore.open("memory://store_test/zstd", mode="w", codec="zstd", **SMALL)
    s.append(rows)
    s.finalize()
    r = JaggedArrayStore.open("memory://store_test/zstd", mode="r")
    for a, b in zip(r.read_rows_sync(range(50)), rows):
        np.testing.assert_array_equal(a, b)


def test_reads_are_batched(tmp_path, monkeypatch):
    rows = ragged_rows(2000, seed=8, max_len=20)
    flat = np.concatenate(rows)
    from levanter.store import batched_reads

    store = build(tmp_path / "b", [rows])
    calls = []
    real = batched_reads.read_view
    monkeypatch.setattr(batched_reads, "read_view", lambda view: calls.append(1) or real(view))
    order = np.random.default_rng(0).permutation(2000)
    got = store.read_rows_sync(order)
    assert len(calls) == 2  # offsets, then data: independent of the number of rows
    assert all(np.array_equal(g, rows[i]) for g, i in zip(got, order))
    calls.clear()
    run(store.read_windows(np.arange(0, flat.size - 8, 5), 8))
    assert len(calls) == 1


# -- CacheLedger -------------------------------------------------------------------------------------


def sample_ledger():
    return CacheLedger(
        shard_rows={"shard-b": 10, "shard-a": 3},
        shard_docs={"shard-b": 12, "shard-a": 3},
        finished_shards=["shard-b"],
        total_rows=13,
        total_tokens=4096,
        is_finished=False,
        metadata={"tokenizer": "abc123", "text_key": "text", "format": {"kind": "text", "a": 1}},
    )


def test_ledger_round_trip_and_determinism(tmp_path):
    assert CacheLedger.load(tmp_path) is None
    led = sample_ledger()
    path = led.save(tmp_path / "cache")
    assert path == str(tmp_path / "cache" / LEDGER_FILENAME)
    loaded = CacheLedger.load(tmp_path / "cache")
    assert loaded == led
    assert list(loaded.shard_rows) == ["shard-b", "shard-a"]  # shard order survives
    first = open(path, "rb").read()
    loaded.save(tmp_path / "cache")
    assert open(path, "rb").read() == first
    assert os.listdir(tmp_path / "cache") == [LEDGER_FILENAME]  # no temp files left behind
    keys = list(json.loads(first))
    assert keys == sorted(keys)


def test_ledger_save_replaces_atomically(tmp_path, monkeypatch):
    sample_ledger().save(tmp_path)
    before = open(tmp_path / LEDGER_FILENAME, "rb").read()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        CacheLedger(total_rows=99).save(tmp_path)
    assert open(tmp_path / LEDGER_FILENAME, "rb").read() == before
    assert os.listdir(tmp_path) == [LEDGER_FILENAME]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda text: text[: len(text) // 2], "not valid JSON"),
        (lambda text: "", "not valid JSON"),
        (lambda text: "[1, 2]", "JSON object"),
        (lambda text: text.replace('"total_rows": 13', '"total_rows": "13"'), "total_rows"),
        (lambda text: text.replace('"is_finished": false', '"is_finished": 0'), "is_finished"),
        (lambda text: text.replace('"shard-a": 3', '"shard-a": -3', 1), "shard_(rows|docs)"),
        (lambda text: text.replace('"finished_shards": [', '"finished_shards": [1, '), "finished_shards"),
        (lambda text: text.replace('"format_version": 1', '"format_version": 7'), "format_version"),
        (lambda text: text.replace('"total_tokens"', '"tokens"'), "keys"),
    ],
)
def test_corrupt_ledger_raises_clear_error(tmp_path, mutate, message):
    path = sample_ledger().save(tmp_path)
    text = open(path).read()
    bad = mutate(text)
    assert bad != text
    with open(path, "w") as f:
        f.write(bad)
    with pytest.raises(CorruptLedgerError, match=message) as info:
        CacheLedger.load(tmp_path)
    assert path in str(info.value) and "Delete the cache directory" in str(info.value)
    assert isinstance(info.value, ValueError)


# -- integrity: missing chunks, checksums, damaged stores, storage errors ---------------------------


def _chunk_files(store_dir, array="data"):
    d = os.path.join(store_dir, array, "c")
    return sorted((os.path.join(d, f) for f in os.listdir(d)), key=lambda p: int(os.path.basename(p)))


def _flip_byte(path, at=3):
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x10
    open(path, "wb").write(bytes(data))


def _every_read_path(store, starts, length):
    """Each way a store is read, as a thunk returning what it read."""
    from levanter.store.batched_reads import read_blocks, read_stacked

    rows = list(range(store.num_rows))
    return {
        "read_rows_sync": lambda: store.read_rows_sync(rows),
        "read_windows": lambda: run(store.read_windows(starts, length)),
        "read_windows_sync": lambda: store.read_windows_sync(starts, length),
        "read_stacked": lambda: read_stacked(store.window_views(starts, length)).result(),
        "read_blocks": lambda: read_blocks([store.window_block(starts, length)]).result(),
    }


def test_a_missing_chunk_is_an_error_on_every_read_path(tmp_path):
    rows = [np.arange(1, 41, dtype=np.int32) + 100 * i for i in range(10)]  # no token is 0
    build(tmp_path / "s", [rows])
    store = JaggedArrayStore.open(tmp_path / "s", mode="r")
    starts = np.arange(0, 380, 20)
    before = {name: read() for name, read in _every_read_path(store, starts, 20).items()}
    victim = _chunk_files(tmp_path / "s")[5]  # elements 80..95: inside every read above
    os.remove(victim)
    for name, read in _every_read_path(store, starts, 20).items():
        with pytest.raises(ValueError, match=r"NOT_FOUND.*" + victim) as info:
            read()
        assert "is missing" in str(info.value), name
    # An offsets chunk too: rows 8..15 end in offsets chunk 1.
    os.remove(_chunk_files(tmp_path / "s", "offsets")[1])
    with pytest.raises(ValueError, match="NOT_FOUND"):
        store.read_rows_sync([9])
    assert all(len(v) for v in before.values())


def test_chunks_equal_to_the_fill_value_are_stored_and_read_back(tmp_path):
    # Whole chunks of token 0 (and of offset 0: empty rows) must exist on disk, or a strict reader
    # would take them for missing.
    rows = [np.zeros(0, np.int32)] * 9 + [np.zeros(64, np.int32), np.arange(5, dtype=np.int32)]
    build(tmp_path / "z", [rows])
    assert len(_chunk_files(tmp_path / "z")) == 5 and len(_chunk_files(tmp_path / "z", "offsets")) == 2
    store = JaggedArrayStore.open(tmp_path / "z", mode="r", num_rows=len(rows))
    for got, want in zip(store.read_rows_sync(range(len(rows))), rows):
        np.testing.assert_array_equal(got, want)


def test_sparse_capacity_of_an_unfinalized_store_reads_and_resumes(tmp_path):
    # Capacity past the committed end was never written: reading committed rows must not touch it, and
    # a resumed build still ends byte-identical to a clean one.
    rows = ragged_rows(100, seed=9)
    build(tmp_path / "clean", [rows])
    s = JaggedArrayStore.open(tmp_path / "grow", mode="w", **SMALL)
    s.append(rows[:60])
    reader = JaggedArrayStore.open(tmp_path / "grow", mode="r", num_rows=60)
    for got, want in zip(reader.read_rows_sync(range(60)), rows):
        np.testing.assert_array_equal(got, want)
    n = reader.data_size // 16 * 16
    np.testing.assert_array_equal(reader.read_windows_sync([0], n)[0], np.concatenate(rows[:60])[:n])
    resumed = JaggedArrayStore.open(tmp_path / "grow", mode="a", num_rows=60)
    resumed.append(rows[60:])
    resumed.finalize()
    assert tree_bytes(tmp_path / "grow") == tree_bytes(tmp_path / "clean")


@pytest.mark.parametrize("codec, chain", [(None, ["bytes", "crc32c"]), ("zstd", ["bytes", "zstd", "crc32c"])])
def test_new_stores_checksum_every_chunk(tmp_path, codec, chain):
    from levanter.store.faults import storage_fault

    rows = ragged_rows(80, seed=10)
    build(tmp_path / "s", [rows], codec=codec)
    for array in ("data", "offsets"):
        meta = json.load(open(tmp_path / "s" / array / "zarr.json"))
        assert [c["name"] for c in meta["codecs"]] == chain
    store = JaggedArrayStore.open(tmp_path / "s", mode="r", num_rows=80)
    victim = _chunk_files(tmp_path / "s")[2]
    _flip_byte(victim)
    # The checksum is verified as the chunk streams through the codecs: a compressed chunk may fail to
    # decompress first (FAILED_PRECONDITION). Either way the read fails and the chunk counts as corrupt.
    expected = "DATA_LOSS" if codec is None else "DATA_LOSS|FAILED_PRECONDITION"
    with pytest.raises(ValueError, match=expected) as info:
        store.read_windows_sync([32], 16)
    fault = storage_fault(info.value)
    assert fault.chunk == victim and fault.damaged and fault.cache == str(tmp_path / "s")
    if codec is None:
        assert fault.what() == f"chunk {victim} is corrupt (checksum mismatch)"
    # Chunks that were not touched still read.
    np.testing.assert_array_equal(store.read_windows_sync([0], 16)[0], np.concatenate(rows)[:16])


def test_stores_written_without_checksums_still_read_and_append(tmp_path):
    """A store as written before checksums (codecs ``[bytes]``, all-fill chunks left out) opens, reads and
    grows in its own format."""
    import tensorstore as ts

    rows = ragged_rows(30, seed=11)
    flat = np.concatenate(rows)
    ends = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    for array, values, chunk in (("data", flat, 16), ("offsets", ends, 8)):
        metadata = {
            "shape": [len(values)],
            "data_type": values.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "fill_value": 0,
        }
        kv = {"driver": "file", "path": str(tmp_path / "old" / array) + "/"}
        arr = ts.open({"driver": "zarr3", "kvstore": kv, "metadata": metadata}, create=True).result()
        arr.write(values).result()
    store = JaggedArrayStore.open(tmp_path / "old", mode="r", num_rows=30)
    for got, want in zip(store.read_rows_sync(range(30)), rows):
        np.testing.assert_array_equal(got, want)
    grown = JaggedArrayStore.open(tmp_path / "old", mode="a", num_rows=30)
    grown.append([np.arange(7)])
    grown.finalize()
    codecs = json.load(open(tmp_path / "old" / "data" / "zarr.json"))["codecs"]
    assert [c["name"] for c in codecs] == ["bytes"]
    (last,) = JaggedArrayStore.open(tmp_path / "old", mode="r").read_rows_sync([30])
    np.testing.assert_array_equal(last, np.arange(7))


def _cache_like(tmp_path, n=40):
    """A store inside a directory with a ledger file, as in a token cache: damage names that directory."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / LEDGER_FILENAME).write_text("{}")
    build(cache / "input_ids", [ragged_rows(n, seed=12)])
    return cache, cache / "input_ids"


@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda s: os.remove(_chunk_files(s)[1]), "chunk file {s}/data/c/1 is missing"),
        (lambda s: [os.remove(p) for p in _chunk_files(s)[:5]], "chunk files {s}/data/c/0, {s}/data/c/1, "
                                                                  "{s}/data/c/2 and 2 more are missing"),
        (lambda s: os.remove(_chunk_files(s, "offsets")[-1]), "chunk file {s}/offsets/c/5 is missing"),
        (lambda s: os.remove(s / "data" / "zarr.json"), "{s}/data/zarr.json is missing"),
        (lambda s: (s / "offsets" / "zarr.json").write_text('{"zarr_format": 3, "sh'),
         "{s}/offsets/zarr.json cannot be read: Invalid JSON"),
    ],
    ids=["data-chunk", "many-chunks", "offsets-chunk", "zarr-json", "corrupt-zarr-json"],
)
def test_a_damaged_store_is_refused_at_open_naming_the_cache(tmp_path, damage, what):
    from levanter.store.faults import DamagedStoreError

    cache, store = _cache_like(tmp_path)
    damage(store)
    with pytest.raises(DamagedStoreError) as info:
        JaggedArrayStore.open(store, mode="r", num_rows=40)
    described = what.format(s=store)
    assert str(info.value) == f"the cache at {cache} is damaged ({described}); delete it to rebuild"
    assert isinstance(info.value, ValueError)  # a user-fixable input: the CLIs exit with 2


@pytest.mark.parametrize(
    "text, code, retried, chunk",
    [
        ('NOT_FOUND: chunk {3} stored at local file "/c/input_ids/data/c/3" is missing',
         "NOT_FOUND", True, "/c/input_ids/data/c/3"),
        ('DATA_LOSS: Error reading local file "/c/s/data/c/0": Digest mismatch, stored digest is 0x1',
         "DATA_LOSS", True, "/c/s/data/c/0"),
        ('PERMISSION_DENIED: Error opening file "/c/s/data/c/2" [os_error_code=\'13\']',
         "PERMISSION_DENIED", True, "/c/s/data/c/2"),
        ('UNAVAILABLE: Error reading "gs://b/c/s/data/c/7": 503 [source locations=\'x\']',
         "UNAVAILABLE", True, "gs://b/c/s/data/c/7"),
        ("DEADLINE_EXCEEDED: timed out", "DEADLINE_EXCEEDED", True, None),
        ("INVALID_ARGUMENT: Cannot broadcast array of shape {3} to {4}", None, False, None),
        ("OUT_OF_RANGE: Index 9 is outside valid range [0, 8)", None, False, None),
        ("INTERNAL: assertion failed", None, False, None),
        ("row 43 is malformed", None, False, None),
    ],
)
def test_storage_errors_are_classified(text, code, retried, chunk):
    from levanter.data.load_errors import is_transient
    from levanter.store.faults import storage_fault

    fault = storage_fault(ValueError(text))
    assert (fault.code if fault else None) == code
    assert is_transient(ValueError(text)) == retried
    if fault is not None:
        assert fault.chunk == chunk
        assert "source locations" not in fault.detail and "os_error_code" not in fault.detail


def test_a_chunk_that_vanishes_for_a_moment_is_retried_and_the_batches_are_unchanged(tmp_path, caplog):
    """The loader's view of a real fault: a chunk renamed away while the loader reads, and put back once
    a read has failed on it. The failed step is read again and every batch equals an undisturbed run's."""
    import logging

    from levanter.data.loader import DataLoader
    from levanter.data.text import TokenSeqDataset

    cache, store_dir = _cache_like(tmp_path, n=300)
    store = JaggedArrayStore.open(store_dir, mode="r", num_rows=300)
    ds = TokenSeqDataset(store, 16)
    steps = len(ds) // 4

    def batches():
        loader = DataLoader(ds, 4, prefetch_depth=0, retries=4, retry_backoff=0.01)
        return [np.asarray(b.data) for b in loader.iter_from_step(0, steps)]

    clean = batches()
    victims = _chunk_files(store_dir)[3:5]
    for v in victims:
        os.rename(v, v + ".away")

    class PutBack(logging.Handler):
        def emit(self, record):
            if "transient error" in record.getMessage():
                for v in victims:
                    if os.path.exists(v + ".away"):
                        os.rename(v + ".away", v)

    handler = PutBack()
    logging.getLogger("levanter.data.loader").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="levanter.data.loader"):
            disturbed = batches()
    finally:
        logging.getLogger("levanter.data.loader").removeHandler(handler)
    retried = [r for r in caplog.records if "transient error" in r.getMessage()]
    assert len(retried) == 1 and "NOT_FOUND" in retried[0].getMessage()
    assert len(disturbed) == len(clean) == steps
    for a, b in zip(disturbed, clean):
        np.testing.assert_array_equal(a, b)


def test_a_chunk_that_stays_missing_is_one_error_naming_cache_chunk_and_step(tmp_path):
    from levanter.data.load_errors import DataLoadError
    from levanter.data.loader import DataLoader
    from levanter.data.text import TokenSeqDataset

    cache, store_dir = _cache_like(tmp_path, n=300)
    store = JaggedArrayStore.open(store_dir, mode="r", num_rows=300)
    ds = TokenSeqDataset(store, 16)
    victim = _chunk_files(store_dir)[6]  # elements 96..111: windows 6, step 1 at 4 windows a step
    os.remove(victim)
    loader = DataLoader(ds, 4, prefetch_depth=2, retries=3, retry_backoff=0.01)
    got = []
    with pytest.raises(DataLoadError) as info:
        for b in loader.iter_from_step(0, 10):
            got.append(b.step)
    assert got == [0]
    assert str(info.value) == (
        f"data loading failed at step 1 for global indices 4..7 (4 rows): chunk {victim} of the cache at "
        f"{cache} is missing, still after 4 attempts over {info.value.seconds:.1f} s. The cache is damaged: "
        f"delete {cache} to rebuild it."
    )


def test_resuming_a_store_with_a_committed_chunk_missing_is_refused(tmp_path):
    # A write into a missing chunk would fill the rest of it with zeros: the resumed build would hold
    # zeros where committed tokens were.
    from levanter.store.faults import DamagedStoreError

    cache, store = _cache_like(tmp_path)
    last = _chunk_files(store)[-1]
    os.remove(last)
    with pytest.raises(DamagedStoreError, match=f"chunk file {last} is missing"):
        JaggedArrayStore.open(store, mode="a", num_rows=40)
