"""Token caches: exact round trip for every format, worker-count independence, crash safety (SIGKILL at
several points, then resume -> byte-identical), refusal of mismatched caches, clear errors."""

import asyncio
import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import tree_bytes
from levanter.data.text import TokenSeqDataset
from levanter.ingest import (
    ByteTokenizer,
    CacheMismatchError,
    CacheOptions,
    SourceError,
    build_or_load_cache,
    expand_urls,
    load_tokenizer,
    train_bpe,
)
from levanter.store import CorruptLedgerError, TokenCache


def make_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "✓", "zeta\n", "eta", ""]
    return [" ".join(rng.choice(words, size=int(rng.integers(0, 40)))) for _ in range(n)]


def write_shards(directory, docs, n_shards=3, suffix=".jsonl"):
    paths = []
    per = -(-len(docs) // n_shards)
    for s in range(n_shards):
        p = os.path.join(directory, f"shard{s}{suffix}")
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs[s * per : (s + 1) * per])
        if suffix.endswith(".gz"):
            with gzip.open(p, "wt", encoding="utf-8") as f:
                f.write(lines)
        elif suffix.endswith(".zst"):
            import zstandard

            with open(p, "wb") as f:
                f.write(zstandard.ZstdCompressor().compress(lines.encode("utf-8")))
        elif suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": docs[s * per : (s + 1) * per]}), p)
        else:
            with open(p, "w", encoding="utf-8") as f:
                f.write(lines)
        paths.append(p)
    return paths


def all_rows(cache):
    return cache.store.read_rows_sync(list(range(cache.store.num_rows)))


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_round_trip_every_format(tmp_path, suffix):
    docs = make_docs(300)
    shards = write_shards(str(tmp_path), docs, suffix=suffix)
    tok = ByteTokenizer()
    cache = build_or_load_cache(shards, str(tmp_path / "cache"), tok, options=CacheOptions(1, 64),
                                progress=False)
    rows = all_rows(cache)
    assert len(rows) == len(docs)
    for doc, row in zip(docs, rows):
        assert row.tolist() == tok.encode_batch([doc])[0] + [tok.eos_token_id]


def test_round_trip_txt_and_bpe(tmp_path):
    docs = make_docs(40, seed=1)
    paths = []
    for i, d in enumerate(docs):
        p = tmp_path / f"doc{i:03d}.txt"
        p.write_text(d, encoding="utf-8")
        paths.append(str(p))
    tok = train_bpe(make_docs(500, seed=2), 300, str(tmp_path / "tok"))
    shards = expand_urls([str(tmp_path / "doc*.txt")])
    cache = build_or_load_cache(shards, str(tmp_path / "cache"), tok, options=CacheOptions(1, 7),
                                progress=False)
    rows = all_rows(cache)
    assert [r.tolist() for r in rows] == [ids + [tok.eos_token_id] for ids in tok.encode_batch(docs)]
    assert cache.eos_id == tok.eos_token_id


def test_token_seq_dataset_cuts_the_stream_into_windows(tmp_path):
    docs = make_docs(200, seed=3)
    cache = build_or_load_cache(write_shards(str(tmp_path), docs), str(tmp_path / "c"), ByteTokenizer(),
                                options=CacheOptions(1, 50), progress=False)
    stream = np.concatenate(all_rows(cache))
    ds = TokenSeqDataset(cache.store, 16)
    assert len(ds) == len(stream) // 16
    idx = [0, 5, len(ds) - 1, 5]
    got = asyncio.run(ds.get_batch(0, idx))
    np.testing.assert_array_equal(got, np.stack([stream[i * 16 : (i + 1) * 16] for i in idx]))


def test_same_cache_for_1_2_and_4_workers(tmp_path):
    shards = write_shards(str(tmp_path), make_docs(1200, seed=4), n_shards=4)
    tok = ByteTokenizer()
    trees = {}
    for w in (1, 2, 4):
        d = tmp_path / f"cache{w}"
        build_or_load_cache(shards, str(d), tok, options=CacheOptions(w, 37, min_bytes_for_pool=0),
                            progress=False)
        trees[w] = tree_bytes(d)
    assert trees[1] == trees[2] == trees[4]
    assert any(k.startswith("input_ids") for k in trees[1])


BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache

    if __name__ == "__main__":
        out, shards = sys.argv[1], sys.argv[2:]
        build_or_load_cache(shards, out, ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    """
)


def run_build(script, out, shards, kill_at=None):
    env = dict(os.environ)
    env.pop("LEVANTER_FAULT_KILL_AT", None)
    if kill_at:
        env["LEVANTER_FAULT_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, str(script), str(out), *shards], env=env, capture_output=True,
                          text=True)


def test_sigkill_at_several_points_then_resume_is_byte_identical(tmp_path):
    shards = write_shards(str(tmp_path), make_docs(240, seed=5), n_shards=3)  # 5 batches of 16 per shard
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    ref = tmp_path / "ref"
    assert run_build(script, ref, shards).returncode == 0
    expected = tree_bytes(ref)
    kill_points = ["cache_after_append:1", "cache_after_commit:1", "cache_after_append:7",
                   "cache_after_commit:11", "cache_after_commit:15", "cache_after_finalize:1"]
    for point in kill_points:
        out = tmp_path / point.replace(":", "_")
        killed = run_build(script, out, shards, kill_at=point)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
        with pytest.raises((ValueError, FileNotFoundError)):
            TokenCache.open(str(out))  # an unfinished cache is never served
        resumed = run_build(script, out, shards)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert tree_bytes(out) == expected, point


def test_sigkill_twice_then_resume(tmp_path):
    shards = write_shards(str(tmp_path), make_docs(240, seed=6), n_shards=2)
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    assert run_build(script, tmp_path / "ref", shards).returncode == 0
    out = tmp_path / "out"
    assert run_build(script, out, shards, kill_at="cache_after_append:3").returncode == -signal.SIGKILL
    assert run_build(script, out, shards, kill_at="cache_after_append:4").returncode == -signal.SIGKILL
    assert run_build(script, out, shards).returncode == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "ref")


RACE_SCRIPT = textwrap.dedent(
    """
    import hashlib, os, sys, time
    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache

    if __name__ == "__main__":
        go, out, shards = sys.argv[1], sys.argv[2], sys.argv[3:]
        while not os.path.exists(go):  # both builders start at the same moment
            time.sleep(0.005)
        cache = build_or_load_cache(shards, out, ByteTokenizer(), options=CacheOptions(1, 8), progress=False)
        rows = cache.store.read_rows_sync(range(cache.ledger.total_rows))
        print(hashlib.sha256(b"".join(r.tobytes() + b"|" for r in rows)).hexdigest())
    """
)


def test_two_concurrent_builds_of_one_new_cache_both_succeed_with_the_same_cache(tmp_path):
    shards = write_shards(str(tmp_path), make_docs(1200, seed=21), n_shards=3)  # 150 commits of 8 documents
    script = tmp_path / "race.py"
    script.write_text(RACE_SCRIPT)
    ref, go_now = tmp_path / "ref", tmp_path / "go-now"
    go_now.touch()
    alone = subprocess.run([sys.executable, str(script), str(go_now), str(ref), *shards], capture_output=True,
                           text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    out, go = tmp_path / "out", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(script), str(go), str(out), *shards], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(3.0)  # both have imported everything and are polling for the start signal
    go.touch()
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for stdout, stderr, rc in results:
        assert rc == 0, stderr[-3000:]
        assert stdout.strip() == alone.stdout.strip()  # both served the whole corpus, as one build alone does
    assert tree_bytes(out) == tree_bytes(ref)  # and the cache on disk is the one a single build writes
    assert not (out / "build.lock").exists()


def test_finished_cache_is_not_rewritten_and_mismatch_is_refused(tmp_path):
    shards = write_shards(str(tmp_path), make_docs(50, seed=7))
    d = str(tmp_path / "c")
    build_or_load_cache(shards, d, ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    before = {p: os.stat(os.path.join(d, p)).st_mtime_ns for p in tree_bytes(d)}
    build_or_load_cache(shards, d, ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    assert {p: os.stat(os.path.join(d, p)).st_mtime_ns for p in tree_bytes(d)} == before
    bpe = train_bpe(make_docs(300, seed=8), 280, str(tmp_path / "tok"))
    with pytest.raises(CacheMismatchError, match="tokenizer"):
        build_or_load_cache(shards, d, bpe, progress=False)
    with pytest.raises(CacheMismatchError, match="text_key"):
        build_or_load_cache(shards, d, ByteTokenizer(), text_key="content", progress=False)
    with pytest.raises(CacheMismatchError, match="enforce_eos"):
        build_or_load_cache(shards, d, ByteTokenizer(), enforce_eos=False, progress=False)


def test_a_dead_builders_lock_left_in_a_finished_cache_is_removed_and_a_live_ones_kept(tmp_path):
    # A build killed between saving its finished ledger and deleting its lock leaves both; the next open
    # serves the cache and clears the dead holder's record, so the directory is the one a clean build writes.
    import socket
    from levanter.ingest.build_lock import _boot_id

    shards = write_shards(str(tmp_path), make_docs(40, seed=3))
    d = tmp_path / "c"
    build_or_load_cache(shards, str(d), ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    clean = tree_bytes(d)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid, removed in ((dead.pid, True), (os.getpid(), False)):
        record = {"boot": _boot_id(), "host": socket.gethostname(), "pid": pid, "token": "0"}
        (d / "build.lock").write_text(json.dumps(record) + "\n")
        cache = build_or_load_cache(shards, str(d), ByteTokenizer(), options=CacheOptions(1, 16),
                                    progress=False)
        assert cache.ledger.total_rows == 40
        assert (d / "build.lock").exists() is not removed
    (d / "build.lock").unlink()
    assert tree_bytes(d) == clean


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_type"])
def test_corrupt_ledger_is_a_clear_error(tmp_path, damage):
    shards = write_shards(str(tmp_path), make_docs(30, seed=9))
    d = tmp_path / "c"
    build_or_load_cache(shards, str(d), ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    ledger = d / "shard_ledger.json"
    text = ledger.read_text()
    if damage == "truncate":
        ledger.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        ledger.write_bytes(b"\x00\xff not json")
    else:
        ledger.write_text(text.replace('"total_rows": ', '"total_rows": "many", "x": '))
    with pytest.raises(CorruptLedgerError, match="shard_ledger.json"):
        build_or_load_cache(shards, str(d), ByteTokenizer(), progress=False)


def test_bad_documents_are_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"text": 12}\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"bad\.jsonl, line 2: expected text"):
        build_or_load_cache([str(p)], str(tmp_path / "c"), ByteTokenizer(), options=CacheOptions(1, 16),
                            progress=False)


def test_passthrough_reads_token_ids_and_checks_range(tmp_path):
    p = tmp_path / "ids.jsonl"
    p.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4]}\n', encoding="utf-8")
    tok = load_tokenizer("passthrough", vocab_size=10)
    cache = build_or_load_cache([str(p)], str(tmp_path / "c"), tok, text_key="input_ids", enforce_eos=False,
                                options=CacheOptions(1, 16), progress=False)
    assert [r.tolist() for r in all_rows(cache)] == [[1, 2, 3], [4]]
    p2 = tmp_path / "ids2.jsonl"
    p2.write_text('{"input_ids": [1, 99]}\n', encoding="utf-8")
    with pytest.raises(SourceError, match="out of range"):
        build_or_load_cache([str(p2)], str(tmp_path / "c2"), tok, text_key="input_ids", enforce_eos=False,
                            options=CacheOptions(1, 16), progress=False)


def test_missing_tokenizer_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        load_tokenizer(str(tmp_path / "does-not-exist"))


def test_finished_cache_serves_without_raw_files_and_embedded_sources_build(tmp_path):
    shards = write_shards(str(tmp_path), make_docs(60, seed=10), n_shards=2)
    d = str(tmp_path / "c")
    first = build_or_load_cache(shards, d, ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    for s in shards:
        os.remove(s)
    again = build_or_load_cache(shards, d, ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    assert again.ledger.total_tokens == first.ledger.total_tokens
    from levanter.ingest.embedded import iter_embedded_documents

    url = "embedded://python-docs/validation"
    emb = build_or_load_cache([url], str(tmp_path / "e"), ByteTokenizer(), embedded_dir=str(tmp_path / "raw"),
                              options=CacheOptions(1, 64), progress=False)
    docs = [d["text"] for d in iter_embedded_documents("python-docs", "validation")]
    assert emb.ledger.total_rows == len(docs)
    assert emb.ledger.total_tokens == sum(len(t.encode("utf-8")) + 1 for t in docs)
    assert emb.metadata["embedded"][url]  # the corpus fingerprint is recorded


# -- stale inputs ------------------------------------------------------------------------------------------
def _jsonl(path, n, seed=0):
    docs = make_docs(n, seed=seed)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return docs


def _build(urls, d, **kw):
    return build_or_load_cache([str(u) for u in urls], str(d), ByteTokenizer(), options=CacheOptions(1, 16),
                               progress=False, **kw)


def test_edited_input_file_is_refused_not_reused(tmp_path):
    p = tmp_path / "data.jsonl"
    _jsonl(p, 100)
    assert _build([p], tmp_path / "c").ledger.total_rows == 100
    _jsonl(p, 300, seed=1)
    with pytest.raises(CacheMismatchError, match=r"data\.jsonl changed size .*delete .*/c to rebuild"):
        _build([p], tmp_path / "c")


def test_same_size_edit_is_caught_by_the_content_hash_and_a_touch_is_not(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text('{"text": "aaaa"}\n', encoding="utf-8")
    _build([p], tmp_path / "c")
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes
    assert _build([p], tmp_path / "c").ledger.total_rows == 1
    p.write_text('{"text": "bbbb"}\n', encoding="utf-8")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    with pytest.raises(CacheMismatchError, match="same size, different content"):
        _build([p], tmp_path / "c")


def _big_jsonl(path, mib=6):
    """A JSON-lines file over 4 MiB (the old identity hashed only the first and last MiB of such files)."""
    line = json.dumps({"text": "x" * 1000}) + "\n"
    path.write_text(line * (mib * 2**20 // len(line)), encoding="utf-8")


def _edit_middle(path, *, restore_mtime: bool):
    """Change one byte in the middle of ``path`` (same size), optionally putting the mtime back as
    ``cp -p`` / ``rsync -t`` / ``git checkout`` would."""
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    mid = data.index(b"x", mid)
    data[mid : mid + 1] = b"y"
    path.write_bytes(bytes(data))
    if restore_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["new-mtime", "mtime-restored"])
def test_same_size_edit_in_the_middle_of_a_large_file_is_refused(tmp_path, restore_mtime):
    p = tmp_path / "data.jsonl"
    _big_jsonl(p)
    rows = _build([p], tmp_path / "c").ledger.total_rows
    assert _build([p], tmp_path / "c").ledger.total_rows == rows  # unchanged: served
    _edit_middle(p, restore_mtime=restore_mtime)
    with pytest.raises(CacheMismatchError, match=r"data\.jsonl was modified \(same size, different content\)"):
        _build([p], tmp_path / "c")


def test_touched_large_file_with_the_same_content_is_served(tmp_path):
    p = tmp_path / "data.jsonl"
    _big_jsonl(p)
    rows = _build([p], tmp_path / "c").ledger.total_rows
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    assert _build([p], tmp_path / "c").ledger.total_rows == rows


def test_verify_inputs_full_rehashes_files_whose_metadata_is_unchanged(tmp_path):
    from levanter.store import CacheLedger

    p = tmp_path / "data.jsonl"
    _jsonl(p, 30)
    _build([p], tmp_path / "c")
    # A content change that size, mtime, ctime and inode do not show (a clock set back, a raw disk write)
    # is simulated by changing the recorded hash: only a full rehash notices it.
    ledger = CacheLedger.load(tmp_path / "c")
    (recorded,) = ledger.metadata["inputs"].values()
    assert "ctime" in recorded and "inode" in recorded
    recorded["sha256"] = "0" * 64
    ledger.save(tmp_path / "c")
    assert _build([p], tmp_path / "c").ledger.total_rows == 30  # metadata: the shortcut applies
    full = CacheOptions(1, 16, verify_inputs="full")
    with pytest.raises(CacheMismatchError, match="same size, different content"):
        build_or_load_cache([str(p)], str(tmp_path / "c"), ByteTokenizer(), options=full, progress=False)


def test_a_cache_recording_only_a_partial_hash_is_refused(tmp_path):
    from levanter.store import CacheLedger

    p = tmp_path / "data.jsonl"
    _big_jsonl(p)
    _build([p], tmp_path / "c")
    ledger = CacheLedger.load(tmp_path / "c")
    (recorded,) = ledger.metadata["inputs"].values()
    # As caches recorded files over 4 MiB before: a hash of the first and last MiB, no ctime or inode.
    recorded.pop("ctime", None)
    recorded.pop("inode")
    recorded["sampled"] = True
    ledger.save(tmp_path / "c")
    with pytest.raises(CacheMismatchError, match=r"only a partial content hash .*data\.jsonl.*delete .*/c to rebuild"):
        _build([p], tmp_path / "c")


def test_unknown_verify_inputs_mode_is_refused():
    with pytest.raises(ValueError, match=r"cache_options\.verify_inputs: expected one of metadata, full, got 'always'"):
        CacheOptions(verify_inputs="always").check()


def test_shard_added_to_or_removed_from_a_glob_is_refused(tmp_path):
    (tmp_path / "shards").mkdir()
    _jsonl(tmp_path / "shards" / "a.jsonl", 20)
    _jsonl(tmp_path / "shards" / "b.jsonl", 20, seed=1)
    glob_url = tmp_path / "shards" / "*.jsonl"
    _build([glob_url], tmp_path / "c")
    _jsonl(tmp_path / "shards" / "c.jsonl", 20, seed=2)
    with pytest.raises(CacheMismatchError, match=r"new file .*shards/c\.jsonl"):
        _build([glob_url], tmp_path / "c")
    os.remove(tmp_path / "shards" / "c.jsonl")
    os.remove(tmp_path / "shards" / "b.jsonl")
    with pytest.raises(CacheMismatchError, match=r"shards/b\.jsonl is gone"):
        _build([glob_url], tmp_path / "c")


def test_cache_without_recorded_identities_still_serves_with_a_warning(tmp_path, caplog):
    from levanter.store import CacheLedger

    p = tmp_path / "data.jsonl"
    _jsonl(p, 30)
    _build([p], tmp_path / "c")
    ledger = CacheLedger.load(tmp_path / "c")
    del ledger.metadata["inputs"]  # as written before identities were recorded
    ledger.save(tmp_path / "c")
    _jsonl(p, 40, seed=1)
    with caplog.at_level("WARNING"):
        assert _build([p], tmp_path / "c").ledger.total_rows == 30
    assert "cannot be checked" in caplog.text


def test_cache_without_recorded_identities_is_warned_about_once_per_directory(tmp_path, caplog):
    from levanter.store import CacheLedger

    p = tmp_path / "data.jsonl"
    _jsonl(p, 30)
    for name in ("a", "b"):
        _build([p], tmp_path / name)
        ledger = CacheLedger.load(tmp_path / name)
        del ledger.metadata["inputs"]
        ledger.save(tmp_path / name)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert _build([p], tmp_path / "a").ledger.total_rows == 30
        assert _build([p], str(tmp_path / "a") + "/").ledger.total_rows == 30  # the same directory
        assert _build([p], tmp_path / "b").ledger.total_rows == 30
    warned = [r.getMessage() for r in caplog.records if "records no identities" in r.getMessage()]
    assert len(warned) == 2, warned
    assert str(tmp_path / "a") in warned[0] and str(tmp_path / "b") in warned[1]


def test_embedded_sources_are_identified_by_their_fingerprint(tmp_path):
    url = "embedded://python-docs/validation"
    first = _build([url], tmp_path / "c", embedded_dir=str(tmp_path / "raw"))
    assert first.metadata["inputs"] == {} and first.metadata["embedded"][url]
    again = _build([url], tmp_path / "c", embedded_dir=str(tmp_path / "raw"))
    assert again.ledger.total_rows == first.ledger.total_rows


def test_interrupted_build_over_an_edited_file_is_refused(tmp_path):
    shards = write_shards(str(tmp_path), make_docs(240, seed=11), n_shards=2)
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    out = tmp_path / "out"
    assert run_build(script, out, shards, kill_at="cache_after_commit:3").returncode == -signal.SIGKILL
    with open(shards[0], "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(CacheMismatchError, match=r"interrupted cache build.*shard0\.jsonl changed size"):
        _build(shards, out)


# -- builds that produce nothing -----------------------------------------------------------------------
def test_build_with_no_text_is_not_left_finished_and_is_rebuilt_once_fixed(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text("\n\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"no text in .*data\.jsonl"):
        _build([p], tmp_path / "c")
    with pytest.raises(SourceError, match="no text in"):  # the same files: the same error, never a cache
        _build([p], tmp_path / "c")
    _jsonl(p, 25)
    assert _build([p], tmp_path / "c").ledger.total_rows == 25


# -- unwritable cache directories and full disks -----------------------------------------------------------
def test_unwritable_cache_dir_is_named_before_tokenizing(tmp_path):
    p = tmp_path / "data.jsonl"
    _jsonl(p, 5)
    (tmp_path / "afile").write_text("a regular file, not a directory")
    with pytest.raises(ValueError, match=r"data\.cache_dir: cannot write the token cache at .*afile/c"):
        _build([p], tmp_path / "afile" / "c", cache_key="data.cache_dir")


def _fail_after(calls: int, exc):
    state = {"n": 0}

    def maybe_fail():
        state["n"] += 1
        if state["n"] > calls:
            raise exc()

    return maybe_fail


@pytest.mark.parametrize("where", ["store", "ledger"])
def test_disk_full_during_a_build_is_out_of_space_and_resumes(tmp_path, monkeypatch, where):
    import errno

    from levanter.errors import OutOfSpaceError
    from levanter.store import CacheLedger, JaggedArrayStore

    shards = write_shards(str(tmp_path), make_docs(160, seed=12), n_shards=2)
    ref = _build(shards, tmp_path / "ref")
    if where == "store":
        # tensorstore's shape of a failed write on a full disk
        fail = _fail_after(3, lambda: ValueError(
            "UNKNOWN: Error writing local file \"x/c/0\": [OS error: No space left on device] "
            "[os_error_code='28'] [source locations='tensorstore/kvstore/file/file_key_value_store.cc:460']"))
        real = JaggedArrayStore.append_flat

        def append_flat(self, *a, **k):
            fail()
            return real(self, *a, **k)

        monkeypatch.setattr(JaggedArrayStore, "append_flat", append_flat)
    else:
        # (taking the build lock costs 2 fsyncs: the lock file and its directory)
        fail = _fail_after(6, lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        real_fsync = os.fsync

        def fsync(fd):
            fail()
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OutOfSpaceError, match=r"out of disk space while building the token cache at .*/out"):
        _build(shards, tmp_path / "out")
    monkeypatch.undo()
    ledger = CacheLedger.load(tmp_path / "out")
    assert not ledger.is_finished and 0 < ledger.total_rows < 160
    done = _build(shards, tmp_path / "out")
    assert [r.tolist() for r in all_rows(done)] == [r.tolist() for r in all_rows(ref)]


# -- tokenizer workers die with their parent -----------------------------------------------------------------
POOL_BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache

    if __name__ == "__main__":
        out, shards = sys.argv[1], sys.argv[2:]
        build_or_load_cache(shards, out, ByteTokenizer(), options=CacheOptions(2, 8, min_bytes_for_pool=0),
                            progress=False)
    """
)


def _children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _is_pool_worker(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")
def test_sigkill_of_a_build_takes_its_tokenizer_workers_with_it(tmp_path):
    import time

    shards = write_shards(str(tmp_path), make_docs(6000, seed=13), n_shards=2)
    script = tmp_path / "build.py"
    script.write_text(POOL_BUILD_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), *shards])
    try:
        deadline = time.monotonic() + 60
        workers = []
        while time.monotonic() < deadline and len(workers) < 2 and proc.poll() is None:
            workers = [c for c in _children(proc.pid) if _is_pool_worker(c)]
            time.sleep(0.05)
        assert len(workers) >= 2, "the build never started two workers (or finished first)"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "tokenizer workers outlived their killed parent"
    finally:
        proc.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)


# -- the ingest package ----------------------------------------------------------------------------------
def test_tokenizer_workers_import_neither_tensorstore_nor_jax():
    # Every spawned worker imports these two modules (and the package around them) afresh: anything
    # heavier is paid once per worker on every build.
    code = (
        "import sys, levanter.ingest.tokenize_worker, levanter.ingest.tokenization\n"
        "heavy = ('tensorstore', 'jax', 'levanter.store', 'levanter.data')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ingest_exports_every_public_name_it_lists():
    import levanter.ingest as ingest
    from levanter.ingest import build, sources, tokenization

    wanted = {"build_or_load_cache", "CacheOptions", "SourceError", "load_tokenizer", "expand_urls"}
    assert wanted <= set(ingest.__all__)
    for name in ingest.__all__:
        assert getattr(ingest, name) is not None
    assert ingest.build_or_load_cache is build.build_or_load_cache
    assert ingest.iter_documents is sources.iter_documents and ingest.Tokenizer is tokenization.Tokenizer
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        ingest.nothing_here
