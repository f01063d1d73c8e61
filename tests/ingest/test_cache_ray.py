"""Cache builds on Ray (``cache_options.backend: ray``) against the process pool, on a local Ray instance.

One Ray instance (``num_cpus=2``) is started per test process and shared: starting Ray takes seconds,
so the fast checks run in one test. The SIGKILLed driver is a subprocess that joins the same instance
by address, as a driver on a cluster would.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import tree_bytes
from levanter.ingest import ByteTokenizer, CacheOptions, SourceError, build_or_load_cache

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address():
    from accelerator import require_sockets

    require_sockets()  # a local Ray instance listens on TCP ports
    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


def write_shards(directory, n_shards=3, docs_per_shard=150):
    """``n_shards`` JSON-lines files of documents of varied lengths; their paths."""
    paths = []
    for k in range(n_shards):
        path = os.path.join(directory, f"part-{k}.jsonl")
        with open(path, "w") as f:
            for i in range(docs_per_shard):
                f.write(json.dumps({"text": f"shard {k} doc {i}: " + "tok " * ((7 * i + k) % 41)}) + "\n")
        paths.append(path)
    return paths


def test_ray_build_is_byte_identical_to_the_pool_retries_a_failed_task_and_names_a_bad_line(
    ray_address, tmp_path, monkeypatch, caplog
):
    shards = write_shards(str(tmp_path))
    pool_dir, ray_dir = str(tmp_path / "pool"), str(tmp_path / "ray")
    build_or_load_cache(shards, pool_dir, ByteTokenizer(), progress=False,
                        options=CacheOptions(num_workers=2, batch_size=32, min_bytes_for_pool=0))

    # The first Ray task raises (once: it creates the marker file); Ray retries it.
    marker = tmp_path / "raised-once"
    monkeypatch.setenv("LEVANTER_FAULT_RAISE_ONCE", str(marker))
    with caplog.at_level(logging.INFO, logger="levanter.ingest.progress"):
        cache = build_or_load_cache(shards, ray_dir, ByteTokenizer(),
                                    options=CacheOptions(num_workers=2, batch_size=32, backend="ray"))
    assert marker.exists()
    assert cache.ledger.total_rows == 450 and len(cache.ledger.finished_shards) == 3
    assert tree_bytes(ray_dir) == tree_bytes(pool_dir)  # arrays and ledger, byte for byte
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cached ")]
    assert len(summary) == 1 and "450 docs" in summary[0] and "ray backend" in summary[0]
    assert f"{cache.ledger.total_tokens:,} tokens" in summary[0]
    monkeypatch.delenv("LEVANTER_FAULT_RAISE_ONCE")

    # A damaged line in the second shard stops the build, naming the file and the line.
    lines = open(shards[1]).read().splitlines(keepends=True)
    lines[4] = '{"text": "cut off\n'
    with open(shards[1], "w") as f:
        f.writelines(lines)
    bad_dir = str(tmp_path / "bad")
    with pytest.raises(SourceError, match=rf"{shards[1]}, line 5: not valid JSON"):
        build_or_load_cache(shards, bad_dir, ByteTokenizer(), progress=False,
                            options=CacheOptions(num_workers=2, batch_size=32, backend="ray"))
    from levanter.store import CacheLedger

    assert not CacheLedger.load(bad_dir).is_finished


DRIVER = textwrap.dedent(
    """
    import sys
    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache

    out, address, shards = sys.argv[1], sys.argv[2], sys.argv[3:]
    options = CacheOptions(num_workers=2, batch_size=16, backend="ray", ray_address=address)
    build_or_load_cache(shards, out, ByteTokenizer(), options=options, progress=False)
    """
)


@pytest.mark.slow
def test_ray_driver_sigkilled_mid_build_then_rerun_is_byte_identical(ray_address, tmp_path):
    shards = write_shards(str(tmp_path), n_shards=3, docs_per_shard=80)  # 5 batches of 16 per shard
    ref = str(tmp_path / "ref")
    build_or_load_cache(shards, ref, ByteTokenizer(), progress=False, options=CacheOptions(1, 16))

    out = str(tmp_path / "killed")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, LEVANTER_FAULT_KILL_AT="cache_after_commit:7")  # inside the second shard
    killed = subprocess.run([sys.executable, str(script), out, ray_address, *shards], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    from levanter.store import CacheLedger

    partial = CacheLedger.load(out)
    assert not partial.is_finished and partial.total_rows == 7 * 16

    # Rerun in this process, on the same Ray instance: committed batches are skipped.
    cache = build_or_load_cache(shards, out, ByteTokenizer(), progress=False,
                                options=CacheOptions(num_workers=2, batch_size=16, backend="ray"))
    assert cache.ledger.is_finished
    assert tree_bytes(out) == tree_bytes(ref)


def test_a_process_pool_build_imports_neither_ray_nor_datasets(tmp_path):
    shards = write_shards(str(tmp_path), n_shards=1, docs_per_shard=20)
    code = textwrap.dedent(
        f"""
        import sys
        from levanter.data.config import UrlSingleDatasetLMConfig
        UrlSingleDatasetLMConfig(train_urls={shards!r}, tokenizer="byte", cache_dir={str(tmp_path / "c")!r}
                                 ).build_caches("train")
        print(sorted(m for m in ("ray", "datasets", "huggingface_hub") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
