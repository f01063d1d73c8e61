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

import numpy as np
import pytest

from levanter.data.sources import SourceError, expand_urls
from levanter.data.text import TokenSeqDataset
from levanter.data.tokenization import ByteTokenizer, load_tokenizer, train_bpe
from levanter.store.cache import CacheMismatchError, CacheOptions, TokenCache, build_or_load_cache
from levanter.store.ledger import CorruptLedgerError
from helpers import tree_bytes


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
    return asyncio.run(cache.store.read_rows(list(range(cache.store.num_rows))))


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_round_trip_every_format(tmp_path, suffix):
    docs = make_docs(300)
    shards = write_shards(str(tmp_path), docs, suffix=suffix)
    tok = ByteTokenizer()
    cache = build_or_load_cache(shards, str(tmp_path / "cache"), tok, options=CacheOptions(1, 64), progress=False)
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
    cache = build_or_load_cache(shards, str(tmp_path / "cache"), tok, options=CacheOptions(1, 7), progress=False)
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
        build_or_load_cache(shards, str(d), tok, options=CacheOptions(w, 37, min_bytes_for_pool=0), progress=False)
        trees[w] = tree_bytes(d)
    assert trees[1] == trees[2] == trees[4]
    assert any(k.startswith("input_ids") for k in trees[1])


BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from levanter.data.tokenization import ByteTokenizer
    from levanter.store.cache import CacheOptions, build_or_load_cache

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
    return subprocess.run([sys.executable, str(script), str(out), *shards], env=env, capture_output=True, text=True)


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
    with pytest.raises(SourceError, match=r"bad\.jsonl, document 1: expected text"):
        build_or_load_cache([str(p)], str(tmp_path / "c"), ByteTokenizer(), options=CacheOptions(1, 16), progress=False)


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
    from levanter.data.embedded import iter_documents

    url = "embedded://python-docs/validation"
    emb = build_or_load_cache([url], str(tmp_path / "e"), ByteTokenizer(), embedded_dir=str(tmp_path / "raw"),
                              options=CacheOptions(1, 64), progress=False)
    docs = [d["text"] for d in iter_documents("python-docs", "validation")]
    assert emb.ledger.total_rows == len(docs)
    assert emb.ledger.total_tokens == sum(len(t.encode("utf-8")) + 1 for t in docs)
    assert emb.metadata["embedded"][url]  # the corpus fingerprint is recorded
