"""Checkpoints on object stores, against real local servers (moto's S3 and the GCS emulator): a save
commits by writing metadata.json last under the final prefix, so discovery never sees an uncommitted
save, deletion never leaves something that looks complete, a save SIGKILLed between its arrays and its
commit record leaves no visible checkpoint and the next save of that step replaces its leftovers; the
run lock on a bucket refuses a second holder and takes over a dead one's."""

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from levanter.checkpoint import (
    METADATA_FILENAME,
    CheckpointerConfig,
    CheckpointInterval,
    CheckpointSaveError,
    RunLockedError,
    acquire_run_lock,
    delete_stale_temporaries,
    discover_latest_checkpoint,
    load_checkpoint,
    read_checkpoint_metadata,
    restore,
    save_checkpoint,
    unreadable_checkpoints,
)
from levanter.checkpoint.layout import step_dirs
from levanter.checkpoint.run_lock import LOCK_FILENAME
from levanter.utils import fs


@pytest.fixture(params=["s3", "gcs"])
def store(request):
    return request.getfixturevalue(f"{request.param}_server")


def fresh_base(store) -> str:
    return store.url(f"ckpt-{uuid.uuid4().hex[:8]}")


def make_tree(seed: int, *, extra: bool = True) -> dict:
    """Device arrays (one sharded over two devices: two chunk objects), a typed key, host values."""
    import ml_dtypes

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(seed)
    tree = {
        "w": jax.device_put(rng.standard_normal((8, 16), dtype=np.float32), NamedSharding(mesh, P("data"))),
        "b": jax.device_put(rng.standard_normal(16, dtype=np.float32).astype(ml_dtypes.bfloat16)),
        "key": jax.random.wrap_key_data(jax.device_put(rng.integers(0, 2**32, 2, dtype=np.uint32))),
        "host": np.arange(5, dtype=np.int64) * seed,
        "step": jax.device_put(np.int32(seed)),
    }
    if extra:
        tree["extra"] = {"m": jax.device_put(np.full((3, 3), seed, np.float32))}
    return tree


def assert_bit_equal(a_tree, b_tree):
    la = jax.tree_util.tree_flatten_with_path(a_tree)[0]
    lb = jax.tree_util.tree_flatten_with_path(b_tree)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, a), (_, b) in zip(la, lb):
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert b.dtype == a.dtype, path
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path


def test_save_load_discover_delete_round_trip(store):
    base = fresh_base(store)
    t1, t3 = make_tree(1), make_tree(3)
    assert save_checkpoint(t1, 1, fs.join(base, "step-1")) == fs.join(base, "step-1")
    save_checkpoint(t3, 3, fs.join(base, "step-3"))
    assert discover_latest_checkpoint(base) == fs.join(base, "step-3")
    assert [s for s, _ in step_dirs(base)] == [1, 3]
    assert_bit_equal(t3, load_checkpoint(make_tree(0), fs.join(base, "step-3")))
    assert_bit_equal(t1, load_checkpoint(make_tree(0), fs.join(base, "step-1")))
    with pytest.raises(FileExistsError):
        save_checkpoint(t1, 1, fs.join(base, "step-1"))

    # An uncommitted save (arrays, no record) and a deletion cut short (record gone first) are both
    # invisible to discovery, are not "damage", and the start-up clean-up removes them.
    save_checkpoint(t1, 5, fs.join(base, "step-5"))
    fs.remove(fs.join(base, "step-5", METADATA_FILENAME))
    save_checkpoint(t1, 7, fs.join(base, "step-7"))
    fs.remove(fs.join(base, "step-7", METADATA_FILENAME))
    assert fs.isdir(fs.join(base, "step-7", "w"))
    assert discover_latest_checkpoint(base) == fs.join(base, "step-3")
    assert unreadable_checkpoints(base) == []
    assert delete_stale_temporaries(base) == [fs.join(base, "step-5"), fs.join(base, "step-7")]
    assert fs.listdir(base) == ["step-1", "step-3"]

    # The Checkpointer: a temporary checkpoint is deleted, record and arrays, once a newer one is complete;
    # the trainer resumes from the latest checkpoint under the URL.
    cfg = CheckpointerConfig(base_path=base, keep=[CheckpointInterval(every=10)],
                             save_interval=datetime.timedelta(seconds=1))
    assert cfg.validate_writable("r") == fs.join(base, "r")
    clock = [0.0]
    ck = cfg.create("r", clock=lambda: clock[0])
    clock[0] = 5.0
    assert ck.on_step(t1, 4)  # temporary (save_interval passed)
    ck.wait_until_finished()  # the write runs in the background
    assert read_checkpoint_metadata(fs.join(base, "r", "step-4"))["is_temporary"]
    assert ck.on_step(t3, 10)  # permanent: supersedes step-4
    ck.wait_until_finished()
    assert fs.listdir(fs.join(base, "r")) == ["step-10"]

    from levanter.training import TrainerConfig

    tcfg = TrainerConfig(id="r", require_accelerator=False, checkpointer=cfg)
    point = tcfg.resume_point("r")
    assert point.path == fs.join(base, "r", "step-10") and point.step == 10
    state = restore(make_tree(0), point)
    assert_bit_equal(t3, state)


# One Python + JAX start for both stores: a child forked per base URL saves step 2 and is SIGKILLed by the
# fault point between its arrays and its commit record; the parent prints each child's exit status.
KILL_SCRIPT = """
import os, sys
import numpy as np
from levanter.checkpoint import save_checkpoint
for base in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        import jax.numpy as jnp
        tree = {"w": jnp.arange(64.0).reshape(8, 8), "host": np.arange(5), "extra": {"m": jnp.ones((3, 3))}}
        save_checkpoint(tree, 2, base + "/step-2")
        os._exit(0)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.fixture(scope="module")
def killed_saves(s3_server, gcs_server):
    """``{scheme: base URL}``: step 1 saved, then a save of step 2 killed before its record."""
    bases = {server.scheme: fresh_base(server) for server in (s3_server, gcs_server)}
    for base in bases.values():
        save_checkpoint(make_tree(1), 1, fs.join(base, "step-1"))
    env = dict(os.environ, LEVANTER_FAULT_KILL_AT="checkpoint_before_record:1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device is plenty and starts faster
    r = subprocess.run([sys.executable, "-c", KILL_SCRIPT, *bases.values()], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["-9", "-9"], r.stdout + r.stderr
    return bases


def test_a_save_killed_before_its_record_is_invisible_and_the_next_save_replaces_it(store, killed_saves):
    base = killed_saves[store.scheme]
    t1 = make_tree(1)
    killed = fs.join(base, "step-2")
    assert fs.isdir(fs.join(killed, "extra")) and not fs.exists(fs.join(killed, METADATA_FILENAME))
    assert discover_latest_checkpoint(base) == fs.join(base, "step-1")
    assert [s for s, _ in step_dirs(base)] == [1]

    # The next save of step 2 (another tree: no "extra" leaf) removes the leftovers first and commits.
    t2 = make_tree(2, extra=False)
    save_checkpoint(t2, 2, killed)
    assert discover_latest_checkpoint(base) == killed
    assert "extra" not in fs.listdir(killed)
    assert_bit_equal(t2, load_checkpoint(make_tree(0, extra=False), killed))
    assert_bit_equal(t1, load_checkpoint(make_tree(0), fs.join(base, "step-1")))


def test_saves_and_loads_ride_out_transient_errors(s3_server, fault_proxy):
    """Through a proxy answering a fifth of all requests with 503: metadata and listings are retried by
    levanter.utils.fs, array chunks by tensorstore's retry context; nothing differs."""
    proxy = fault_proxy(s3_server, fail_fraction=0.2, delay_s=(0.0, 0.002), seed=3)
    base = fresh_base(s3_server)
    ck = CheckpointerConfig(base_path=base, keep=[CheckpointInterval(every=2)]).create("r")
    assert ck.on_step(make_tree(2), 2) and ck.on_step(make_tree(4), 4)
    assert ck.latest_checkpoint() == fs.join(base, "r", "step-4")
    assert_bit_equal(make_tree(4), load_checkpoint(make_tree(0), ck.latest_checkpoint()))
    assert proxy.failed > 0 and proxy.forwarded > 0


def test_a_failed_save_is_one_line_naming_the_url(gcs_server):
    url = f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/ck/step-1"
    with pytest.raises(CheckpointSaveError) as e:
        save_checkpoint({"w": np.arange(4.0)}, 1, url)
    msg = str(e.value)
    assert f"could not save the checkpoint of step 1 to {url}: NOT_FOUND" in msg, msg
    assert "\n" not in msg and "tensorstore_spec" not in msg and "Nothing was committed" in msg, msg
    # A Checkpointer checks its bucket when it is made, before any training step.
    with pytest.raises(fs.StorageAccessError, match=r"trainer\.checkpointer\.base_path: .*no-such-bucket"):
        CheckpointerConfig(base_path=fs.parent(fs.parent(url))).create("r")


def test_the_run_lock_on_a_bucket(store, caplog, monkeypatch):
    import levanter.checkpoint.run_lock as run_lock

    run_dir = fs.join(fresh_base(store), "r")
    lock_url = fs.join(run_dir, LOCK_FILENAME)
    lock = acquire_run_lock(run_dir, "r")
    try:
        assert json.loads(fs.read_text(lock_url))["pid"] == os.getpid()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            acquire_run_lock(run_dir, "r")  # a second holder (a live process) is refused
    finally:
        lock.release()
    assert not fs.exists(lock_url)

    # A holder of this machine that is gone (its pid no longer exists) is taken over, without rename.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"run_id": "r", "host": socket.gethostname(), "pid": dead.pid, "started": "2026-01-02T03:04:05",
              "token": "t"}
    fs.atomic_write_text(lock_url, json.dumps(record))
    monkeypatch.setattr(run_lock, "TAKEOVER_SETTLE_SECONDS", 0.05)
    monkeypatch.setattr(run_lock, "HEARTBEAT_SECONDS", 0.05)
    with caplog.at_level("WARNING", logger="levanter.checkpoint.run_lock"):
        lock = acquire_run_lock(run_dir, "r")
    try:
        assert "taking over" in caplog.text and f"pid {dead.pid}" in caplog.text
        # The heartbeat rewrites the record (objects cannot be touched).
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=10)
        while "heartbeat" not in json.loads(fs.read_text(lock_url)) and datetime.datetime.now() < deadline:
            time.sleep(0.05)
        now = json.loads(fs.read_text(lock_url))
        assert now["pid"] == os.getpid() and "heartbeat" in now
    finally:
        lock.release()
    assert not fs.exists(lock_url)
