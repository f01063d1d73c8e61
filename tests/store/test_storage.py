"""Storage on local disk, ``memory://``, S3 (a moto server) and GCS (an emulator): the ``levanter.utils.fs``
API, exclusive creation, retries of transient errors through a 503-injecting proxy, permanent errors named
by URL and config key, and token caches built into buckets (equal to a local build byte for byte, also
after a SIGKILL mid-build and a resume).

The servers are the session fixtures of conftest.py (tests/object_store.py), started once and shared."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from helpers import tree_bytes
from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache
from levanter.store import JaggedArrayStore, TokenCache
from levanter.utils import fs

STORES = ["local", "memory", "s3", "gcs"]


@pytest.fixture
def base(request, tmp_path):
    """A fresh directory or bucket prefix on the store named by the test's ``store`` parameter."""
    kind = request.param
    if kind == "local":
        return str(tmp_path / "root")
    if kind == "memory":
        return f"memory://{request.node.name.replace('[', '-').replace(']', '')}-{time.monotonic_ns()}"
    server = request.getfixturevalue("s3_server" if kind == "s3" else "gcs_server")
    return server.url(f"{request.node.name.replace('[', '-').replace(']', '')}-{time.monotonic_ns()}")


def bucket_tree(url):
    """``{relative key: bytes}`` of every object under ``url`` (the bucket's side of ``tree_bytes``)."""
    fsys, prefix = fs.filesystem(url)
    prefix = prefix.rstrip("/") + "/"
    return {k[len(prefix):]: fsys.cat_file(k) for k in fsys.find(prefix)}


@pytest.mark.parametrize("base", STORES, indirect=True)
def test_fs_api(base):
    d = fs.join(base, "dir")
    f = fs.join(d, "a.json")
    assert fs.parent(f) == d and fs.basename(f) == "a.json"
    assert not fs.exists(f) and not fs.isdir(d)
    with pytest.raises(FileNotFoundError):
        fs.read_bytes(f)
    with pytest.raises(FileNotFoundError):
        fs.listdir(d)
    fs.makedirs(d)
    fs.atomic_write_text(f, '{"x": 1}')
    fs.makedirs(fs.join(d, "sub"))
    fs.atomic_write_bytes(fs.join(d, "sub", "b.bin"), b"\x00\x01")
    assert json.loads(fs.read_text(f)) == {"x": 1}
    assert fs.read_bytes(fs.join(d, "sub", "b.bin")) == b"\x00\x01"
    assert fs.exists(f) and fs.isfile(f) and not fs.isdir(f)
    assert fs.isdir(d) and fs.isdir(fs.join(d, "sub")) and not fs.isfile(d)
    assert fs.listdir(d) == ["a.json", "sub"]
    assert fs.glob(fs.join(d, "*.json")) == [fs.abspath(f)]
    assert fs.size(f) == len('{"x": 1}')
    assert abs(fs.mtime(f) - time.time()) < 120
    fs.atomic_write_text(f, "replaced")
    assert fs.read_text(f) == "replaced"

    lock = fs.join(d, "lock")
    assert fs.create_exclusive(lock, b"first") is True
    assert fs.create_exclusive(lock, b"second") is False
    assert fs.read_bytes(lock) == b"first"

    fs.remove(lock)
    fs.remove(lock)  # missing_ok
    with pytest.raises(FileNotFoundError):
        fs.remove(lock, missing_ok=False)
    fs.remove_tree(d)
    assert not fs.exists(f) and not fs.isdir(d)
    fs.remove_tree(d)  # absent: nothing to do
    assert fs.supports_rename(base) == (not fs.is_url(base))


@pytest.mark.parametrize("base", STORES, indirect=True)
def test_create_exclusive_has_one_winner_among_racing_writers(base):
    fs.makedirs(base)
    target = fs.join(base, "run.lock")
    results = []
    barrier = threading.Barrier(6)

    def contend(i):
        barrier.wait()
        results.append((fs.create_exclusive(target, f"writer {i}".encode()), i))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for ok, i in results if ok]
    assert len(winners) == 1, results
    assert fs.read_bytes(target) == f"writer {winners[0]}".encode()


def test_paths_and_kvstore_specs(tmp_path, monkeypatch):
    assert fs.abspath("file://" + str(tmp_path)) == str(tmp_path)
    assert fs.abspath("s3://b/x/") == "s3://b/x" and fs.join("s3://b/x/", "y", "z") == "s3://b/x/y/z"
    assert fs.parent("gs://b/x/y") == "gs://b/x" and fs.basename("gs://b/x/y/") == "y"
    assert fs.kvstore_spec(str(tmp_path)) == {"driver": "file", "path": str(tmp_path) + "/"}
    assert fs.kvstore_spec("memory://a/b") == {"driver": "memory", "path": "a/b/"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    spec = fs.kvstore_spec("s3://bkt/p/q")
    assert (spec["bucket"], spec["path"], spec["endpoint"], spec["aws_region"]) == (
        "bkt", "p/q/", "http://127.0.0.1:1", "eu-west-1")
    with pytest.raises(ValueError, match="unsupported storage URL scheme"):
        fs.kvstore_spec("ftp://host/x")


def test_redact_removes_credentials(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-xyz")
    text = fs.redact("denied with s3cr3t-value-xyz at https://u:pw@host/p?X-Amz-Signature=abcd&k=1")
    assert "s3cr3t-value-xyz" not in text and "pw@" not in text and "abcd" not in text
    assert "k=1" in text


@pytest.mark.parametrize("server_name", ["s3_server", "gcs_server"])
def test_transient_errors_are_retried_through_a_faulty_store(request, fault_proxy, server_name):
    server = request.getfixturevalue(server_name)
    proxy = fault_proxy(server, fail_fraction=0.25, delay_s=(0.0, 0.004), seed=3)
    base = server.url(f"faulty-{server_name}-{time.monotonic_ns()}")
    for i in range(6):
        fs.atomic_write_bytes(fs.join(base, f"f{i}"), bytes([i]) * i)
    assert [fs.read_bytes(fs.join(base, f"f{i}")) for i in range(6)] == [bytes([i]) * i for i in range(6)]
    assert fs.listdir(base) == [f"f{i}" for i in range(6)]
    assert fs.create_exclusive(fs.join(base, "lock"), b"1") and not fs.create_exclusive(fs.join(base, "lock"), b"2")
    small_file_requests = proxy.requests

    rows = [np.arange(n, dtype=np.int32) for n in (5, 0, 17, 3)]
    store = JaggedArrayStore.open(fs.join(base, "store"), mode="w", dtype=np.int32, data_chunk=16,
                                  offsets_chunk=8)
    store.append(rows)
    reopened = JaggedArrayStore.open(fs.join(base, "store"), mode="r", num_rows=len(rows))
    got = reopened.read_rows_sync(list(range(len(rows))))
    assert all(np.array_equal(a, b) for a, b in zip(got, rows))
    assert proxy.requests > small_file_requests  # tensorstore went through the proxy too
    assert proxy.failed > 0


@pytest.mark.parametrize("server_name", ["s3_server", "gcs_server"])
def test_permanent_errors_name_the_url_and_the_key(request, fault_proxy, server_name, tmp_path):
    server = request.getfixturevalue(server_name)
    missing = f"{server.scheme}://no-such-bucket-here/cache"
    with pytest.raises(fs.StorageAccessError) as e:
        fs.check_access(missing, "data.cache_dir")
    assert str(e.value).startswith("data.cache_dir: ") and missing in str(e.value)
    assert "does not exist" in str(e.value)

    proxy = fault_proxy(server, fail_fraction=1.0, delay_s=(0, 0), fail_status=403)
    url = server.url("denied/cache")
    with pytest.raises(fs.StorageAccessError) as e:
        fs.check_access(url, "trainer.checkpointer.base_path", write=True)
    assert proxy.failed == proxy.requests == 1, proxy.requests  # the first request refused, never retried
    message = str(e.value)
    assert message.startswith("trainer.checkpointer.base_path: ") and url in message
    assert "access denied" in message
    for secret in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
        if os.environ.get(secret):
            assert os.environ[secret] not in message
    assert proxy.requests >= 1

    # The same through a cache build: one ValueError naming the key, before any tokenizing.
    shard = tmp_path / "a.jsonl"
    shard.write_text('{"text": "hello"}\n')
    with pytest.raises(fs.StorageAccessError, match=r"^data\.cache_dir: .*access denied"):
        build_or_load_cache([str(shard)], server.url("denied/c2"), ByteTokenizer(), cache_key="data.cache_dir",
                            progress=False)


def _docs(n, seed):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "γάμμα", "✓", "delta\n", ""]
    return [" ".join(rng.choice(words, size=int(rng.integers(0, 30)))) for _ in range(n)]


def _shards(directory, docs, n):
    per = -(-len(docs) // n)
    paths = []
    for s in range(n):
        p = os.path.join(directory, f"shard{s}.jsonl")
        with open(p, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs[s * per:(s + 1) * per])
        paths.append(p)
    return paths


@pytest.mark.parametrize("server_name", ["s3_server", "gcs_server"])
def test_cache_built_into_a_bucket_equals_a_local_build(request, server_name, tmp_path):
    server = request.getfixturevalue(server_name)
    shards = _shards(str(tmp_path), _docs(120, seed=1), 2)
    options = CacheOptions(1, 16)
    local = build_or_load_cache(shards, str(tmp_path / "local"), ByteTokenizer(), options=options, progress=False)
    url = server.url(f"cache-{server_name}-{time.monotonic_ns()}")
    remote = build_or_load_cache(shards, url, ByteTokenizer(), options=options, progress=False)
    assert bucket_tree(url) == tree_bytes(tmp_path / "local")
    again = TokenCache.open(url)  # a finished cache in a bucket opens for reading
    rows = list(range(local.store.num_rows))
    assert all(np.array_equal(a, b) for a, b in zip(again.store.read_rows_sync(rows), local.store.read_rows_sync(rows)))
    assert remote.ledger.total_tokens == local.ledger.total_tokens > 0

    # The inputs can live in the bucket too (train_urls on s3:// / gs://, globbed).
    for p in shards:
        fs.atomic_write_bytes(fs.join(url + "-raw", os.path.basename(p)), open(p, "rb").read())
    from_bucket = build_or_load_cache([fs.join(url + "-raw", "*.jsonl")], url + "-from-raw", ByteTokenizer(),
                                      options=options, progress=False)
    assert from_bucket.ledger.metadata["shards"] == [fs.join(url + "-raw", f"shard{i}.jsonl") for i in range(2)]
    got = from_bucket.store.read_rows_sync(rows)
    assert all(np.array_equal(a, b) for a, b in zip(got, local.store.read_rows_sync(rows)))


BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache

    if __name__ == "__main__":
        out, shards = sys.argv[1], sys.argv[2:]
        build_or_load_cache(shards, out, ByteTokenizer(), options=CacheOptions(1, 16), progress=False)
    """
)


def _run_build(script, out, shards, env, kill_at=None):
    env = {**os.environ, **env}
    env.pop("LEVANTER_FAULT_KILL_AT", None)
    if kill_at:
        env["LEVANTER_FAULT_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, str(script), out, *shards], env=env, capture_output=True, text=True,
                          timeout=300)


def _kill_and_resume(server, tmp_path, kill_at):
    """A build into the bucket SIGKILLed at ``kill_at`` (a real process, ended without any clean-up), then
    resumed (in this process: a resume is an ordinary build) ends byte-identical to a local build."""
    shards = _shards(str(tmp_path), _docs(96, seed=2), 2)  # 3 batches of 16 per shard
    options = CacheOptions(1, 16)
    local = tmp_path / "local"
    build_or_load_cache(shards, str(local), ByteTokenizer(), options=options, progress=False)
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    url = server.url(f"killed-{time.monotonic_ns()}")
    killed = _run_build(script, url, shards, server.env, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    with pytest.raises((ValueError, FileNotFoundError)):
        TokenCache.open(url)  # an unfinished cache is never served
    build_or_load_cache(shards, url, ByteTokenizer(), options=options, progress=False)
    assert bucket_tree(url) == tree_bytes(local)


def test_build_killed_in_an_s3_bucket_resumes_byte_identical(s3_server, tmp_path):
    _kill_and_resume(s3_server, tmp_path, "cache_after_append:4")


@pytest.mark.slow
def test_build_killed_in_a_gcs_bucket_resumes_byte_identical(gcs_server, tmp_path):
    _kill_and_resume(gcs_server, tmp_path, "cache_after_commit:2")


@pytest.mark.parametrize("server_name", ["s3_server", "gcs_server"])
def test_a_missing_chunk_in_a_bucket_is_refused_at_open(request, server_name):
    from levanter.store import DamagedStoreError

    server = request.getfixturevalue(server_name)
    url = server.url(f"holes-{server_name}-{time.monotonic_ns()}")
    rows = [np.full(n, n, dtype=np.int32) for n in (9, 30, 4)]
    store = JaggedArrayStore.open(url, mode="w", dtype=np.int32, data_chunk=8, offsets_chunk=8)
    store.append(rows)
    assert fs.listdir(fs.join(url, "data", "c")) == [str(k) for k in range(6)]  # 43 tokens, chunks of 8
    fs.remove(fs.join(url, "data", "c", "2"))
    with pytest.raises(DamagedStoreError, match=r"chunk file .*data/c/2 is missing"):
        JaggedArrayStore.open(url, mode="r", num_rows=len(rows))


def test_a_bucket_deleted_under_a_reader_is_named_by_its_url(s3_server):
    # tensorstore names a missing chunk by its key inside the bucket, which reads like a local path; the
    # error names the chunk's full URL, and a bucket that is gone as gone, not as a cache to delete.
    from levanter.data.load_errors import DataLoadError
    from levanter.data.loader import DataLoader
    from levanter.data.text import TokenSeqDataset
    from levanter.store import LEDGER_FILENAME

    bucket = f"doomed-{time.monotonic_ns()}"
    s3_server.create_bucket(bucket)
    cache = f"s3://{bucket}/cache/train"
    fs.atomic_write_text(fs.join(cache, LEDGER_FILENAME), "{}")
    store = JaggedArrayStore.open(fs.join(cache, "input_ids"), mode="w", dtype=np.int32)
    store.append([np.arange(40, dtype=np.int32)] * 4)
    store.finalize()
    reader = TokenSeqDataset(JaggedArrayStore.open(fs.join(cache, "input_ids"), mode="r", num_rows=4), 16)
    client = s3_server.client()
    for obj in client.list_objects_v2(Bucket=bucket)["Contents"]:
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)
    with pytest.raises(DataLoadError) as info:
        next(iter(DataLoader(reader, 2, retries=1, retry_backoff=0.01).iter_from_step(0, 1)))
    message = str(info.value)
    assert f"chunk {cache}/input_ids/data/c/0 is missing" in message, message
    assert f"The bucket s3://{bucket} no longer exists" in message, message
    assert "to rebuild it" not in message, message


@pytest.mark.parametrize("base", STORES, indirect=True)
def test_every_store_binds_chunk_checksums_to_positions(base):
    # A finished store records which checksum belongs at which chunk (chunk_checksums.json) on every kind of
    # storage, memory:// included, and a chunk swapped with another (each passing its own checksum) is
    # refused at open. On memory:// the record sits in fsspec's memory filesystem, beside the cache's
    # ledger, and the chunks in tensorstore's memory key-value store: each side is read through its own door.
    import tensorstore as ts

    from levanter.store import DamagedStoreError
    from levanter.store.zarr_arrays import CONTEXT

    url = fs.join(base, "input_ids")
    store = JaggedArrayStore.open(url, mode="w", dtype=np.int32, data_chunk=8, offsets_chunk=8)
    store.append([np.arange(n, dtype=np.int32) for n in (9, 30, 4)])
    store.finalize()
    assert fs.isfile(fs.join(url, "chunk_checksums.json"))
    JaggedArrayStore.open(url, mode="r", num_rows=3).verify_chunk_positions()
    chunks = ts.KvStore.open(fs.kvstore_spec(fs.join(url, "data", "c")), context=CONTEXT).result()
    first, second = chunks.read(b"1").result().value, chunks.read(b"2").result().value
    assert first != second
    chunks.write(b"1", second).result()
    chunks.write(b"2", first).result()
    with pytest.raises(DamagedStoreError, match="hold the checksum of another position"):
        JaggedArrayStore.open(url, mode="r", num_rows=3).verify_chunk_positions()
