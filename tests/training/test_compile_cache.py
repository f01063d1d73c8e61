"""JAX's persistent compilation cache, on by default (levanter.utils.compile_cache): where it goes, that the
``off`` value turns it off, that a second launch of the same config loads its programs from it instead of
compiling them, and the time to the first step that a run reports.

The session's own cache (tests/conftest.py sets ``JAX_COMPILATION_CACHE_DIR`` for every test and
subprocess, with both thresholds at their minimum so that the tiny test programs are stored) is what the
in-process tests here switch away from; the ``jax_cache_state`` fixture puts it back."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from levanter.utils import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OPTIONS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
            "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def jax_cache_state():
    """JAX's cache options as the session set them, restored (and JAX's cache reopened) afterwards."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    saved = {n: getattr(jax.config, n) for n in _OPTIONS}
    try:
        yield
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)
        cc.reset_cache()


def entries(directory) -> list:
    """The executables a cache directory holds (JAX names them ``<key>-cache``)."""
    return sorted(f for f in os.listdir(directory) if f.endswith("-cache")) if os.path.isdir(directory) else []


def test_where_the_cache_goes(tmp_path, monkeypatch, jax_cache_state):
    base = str(tmp_path / "ckpt")
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    # null: beside the checkpoints (a local base path made absolute; gs:// kept as it is); memory://: none
    assert compile_cache.resolve_cache_dir(None, base) == (os.path.join(base, "jax-cache"), "default")
    monkeypatch.chdir(tmp_path)
    assert compile_cache.resolve_cache_dir(None, "ckpt")[0] == os.path.join(str(tmp_path), "ckpt", "jax-cache")
    assert compile_cache.resolve_cache_dir(None, "gs://bucket/runs/") == ("gs://bucket/runs/jax-cache", "default")
    assert compile_cache.resolve_cache_dir(None, "memory://x/ckpt") == (None, "default")
    # the environment's directory is kept, the key wins over it, and off turns either off
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env-cache"))
    assert compile_cache.resolve_cache_dir(None, base) == (str(tmp_path / "env-cache"), "env")
    assert compile_cache.resolve_cache_dir("gs://b/cc", base) == ("gs://b/cc", "key")
    assert compile_cache.resolve_cache_dir("off", base) == (None, "key")
    # a directory the calling program gave JAX is kept too, but not one an earlier run (from Python) chose
    monkeypatch.delenv(compile_cache.ENV_VAR)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "program"))
    assert compile_cache.resolve_cache_dir(None, base) == (str(tmp_path / "program"), "jax")
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.use_compilation_cache(None, base) == os.path.join(base, "jax-cache")
    other = str(tmp_path / "other-ckpt")
    assert compile_cache.use_compilation_cache(None, other) == os.path.join(other, "jax-cache")
    assert jax.config.jax_compilation_cache_dir == os.path.join(other, "jax-cache")
    assert compile_cache.use_compilation_cache(str(tmp_path / "given"), base) == str(tmp_path / "given")
    assert compile_cache.use_compilation_cache(None, base) == os.path.join(base, "jax-cache")


def test_off_compiles_without_the_cache_and_a_directory_stores_programs(tmp_path, jax_cache_state):
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the tiny programs below are stored
    stats = compile_cache.cache_stats()
    assert compile_cache.use_compilation_cache("off", str(tmp_path / "ckpt")) is None
    assert jax.config.jax_compilation_cache_dir is None and not jax.config.jax_enable_compilation_cache
    jax.jit(lambda x: x * 3.25 + 1.5)(np.ones(7, np.float32)).block_until_ready()  # a program no other test compiles
    assert stats.lookups == 0 and stats.directory is None and stats.summary() is None
    assert not (tmp_path / "ckpt").exists()

    d = tmp_path / "cc"
    assert compile_cache.use_compilation_cache(str(d), str(tmp_path / "ckpt")) == str(d)
    jax.jit(lambda x: x * 5.75 - 2.5)(np.ones(9, np.float32)).block_until_ready()
    assert (stats.lookups, stats.hits, stats.written) == (1, 0, 1)
    assert len(entries(d)) == 1
    assert stats.summary() == f"compilation cache: {d} (0 of 1 programs loaded, 0s of compiling saved; 1 written)"


@pytest.mark.parametrize("given", ["yaml", "cli"])
def test_off_as_the_config_gives_it(tmp_path, given):
    """YAML (and so draccus, on the command line too) reads a bare ``off`` as false: both mean off."""
    from levanter.config import parse_config
    from levanter.main.train_lm import TrainLmConfig

    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  jax_compilation_cache_dir: off\n" if given == "yaml" else "trainer: {}\n")
    args = ["--trainer.jax_compilation_cache_dir", "off"] if given == "cli" else []
    config = parse_config(TrainLmConfig, str(path), args)
    assert compile_cache.resolve_cache_dir(config.trainer.jax_compilation_cache_dir, "ckpt") == (None, "key")


def test_a_directory_that_cannot_be_written_names_its_setting(tmp_path, monkeypatch, jax_cache_state):
    (tmp_path / "afile").write_text("a regular file")
    with pytest.raises(ValueError, match=r"trainer.jax_compilation_cache_dir=.*afile/cc: cannot write .*"
                                         r"Not a directory.*or to off"):
        compile_cache.use_compilation_cache(str(tmp_path / "afile" / "cc"), str(tmp_path / "ckpt"))
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "afile" / "env"))
    with pytest.raises(ValueError, match=r"JAX_COMPILATION_CACHE_DIR=.*afile/env: .*Point JAX_COMPILATION_CACHE"):
        compile_cache.use_compilation_cache(None, str(tmp_path / "ckpt"))
    monkeypatch.delenv(compile_cache.ENV_VAR)
    jax.config.update("jax_compilation_cache_dir", None)
    with pytest.raises(ValueError, match=r"beside trainer.checkpointer.base_path, to .*afile/jax-cache: .*"
                                         r"Choose a writable trainer.checkpointer.base_path"):
        compile_cache.use_compilation_cache(None, str(tmp_path / "afile"))


CONFIG = """\
data:
  train_urls: ["embedded://python-docs/validation"]
  tokenizer: byte
  cache_dir: {tmp}/cache
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 1, seq_len: 32, gradient_checkpointing: false}}
trainer:
  num_train_steps: 2
  train_batch_size: 8
  steps_per_eval: 100
  require_accelerator: false
  log_dir: {tmp}/logs
  tracker: {{type: json}}
  checkpointer: {{base_path: {tmp}/ckpt}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, lr_schedule: constant}}
"""


def _launch(tmp_path, run_id: str, *args: str) -> str:
    """``train_lm`` in a fresh process (what a relaunch is), without the session's cache directory, so that
    the run's default applies; returns its stdout. The thresholds stay at the session's minimum (the test
    model's programs compile in well under JAX's default second)."""
    env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV_VAR}
    env["PYTHONPATH"] = os.path.join(REPO, "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    proc = subprocess.run(
        [sys.executable, "-m", "levanter.main.train_lm", "--config_path", str(tmp_path / "config.yaml"),
         "--trainer.id", run_id, *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _hits(tmp_path, run_id: str) -> int:
    """The cache hits JAX logged (at DEBUG: the run's debug log keeps them)."""
    text = (tmp_path / "logs" / run_id / "debug.log").read_text()
    return text.count("Persistent compilation cache hit for")


@pytest.mark.slow
def test_a_second_launch_loads_its_programs_from_the_default_cache(tmp_path):
    (tmp_path / "config.yaml").write_text(CONFIG.format(tmp=tmp_path))
    cache = tmp_path / "ckpt" / "jax-cache"  # the default: beside the checkpoints

    out = _launch(tmp_path, "first")
    stored = entries(cache)
    assert stored, "the first launch stored no compiled program"
    assert _hits(tmp_path, "first") == 0
    assert f"compilation cache: {cache} (0 of " in out and f"; {len(stored)} written)" in out
    rows = [json.loads(x) for x in (tmp_path / "logs" / "first" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    first = steps[0]["throughput/time_to_first_step_seconds"]
    assert first > steps[0]["throughput/step_seconds"] > 0  # start-up comes before the step
    assert not any("throughput/time_to_first_step_seconds" in r for r in steps[1:])
    assert "first step done " in out and " after the process started" in out

    # The same config launched again (another run id: nothing else differs) compiles nothing it stored.
    out = _launch(tmp_path, "second")
    assert entries(cache) == stored, "the second launch wrote programs the first had stored"
    hits = _hits(tmp_path, "second")
    assert hits >= len(stored)
    assert f"compilation cache: {cache} ({hits} of " in out and "; 0 written)" in out


@pytest.mark.sockets
@pytest.mark.parametrize("server", ["gcs_server", "s3_server"])
def test_a_cache_in_a_bucket_stores_and_loads_programs(server, request, monkeypatch, jax_cache_state):
    """Checkpoints on gs:// (or s3://) put the default cache in the same bucket, where every host of a slice
    and every relaunch find it: JAX writes and reads it there (through etils' epath)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    from levanter.utils import fs

    store = request.getfixturevalue(server)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    base = store.url(f"runs-{os.getpid()}-{server}")
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)  # else the session's cache would be kept
    jax.config.update("jax_compilation_cache_dir", None)
    directory = compile_cache.use_compilation_cache(None, base)
    assert directory == f"{base}/jax-cache"
    stats = compile_cache.cache_stats()

    def program(x):  # one no other test compiles
        return x * 7.125 - 0.375

    jax.jit(program)(np.ones(11, np.float32)).block_until_ready()
    assert (stats.lookups, stats.hits, stats.written) == (1, 0, 1)
    stored = [p for p in fs.listdir(directory) if p.endswith("-cache")]
    assert len(stored) == 1
    cc.reset_cache()  # as a new process would: the executable comes from the bucket, not JAX's memory
    jax.clear_caches()
    jax.jit(program)(np.ones(11, np.float32)).block_until_ready()
    assert (stats.lookups, stats.hits, stats.written) == (2, 1, 1)
