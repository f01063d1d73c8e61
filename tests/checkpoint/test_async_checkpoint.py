"""Checkpoints written in the background (levanter.checkpoint.async_writer):

* ``on_step`` returns before the write commits, and the checkpoint holds the state as it was at the
  call, bit for bit, although the next steps donate and overwrite its device buffers;
* one write in flight: a second save waits for the first, and saves commit in order;
* a write that fails in the background (a bucket refusing writes through the fault proxy, a full disk)
  is raised at the next step boundary, naming the path and the cause; nothing of it is ever discovered
  as a complete checkpoint, and the previous one stays the latest;
* end to end through ``train_lm``: kill -9 while a background write is in flight, then a rerun, ends bit
  for bit equal to an uninterrupted run; SIGTERM during a background write lets it finish, checkpoints the
  current step, exits 75 and resumes bit for bit; a background write that fills the disk stops the run
  with one ``error:`` paragraph and exit status 74.

``fault.holding`` (in-process) and ``LEVANTER_FAULT_DELAY`` (a subprocess) hold writes open at the
``checkpoint_mid_write`` point, so that the loop provably trains on while a write is in flight.
"""

import datetime
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from levanter.checkpoint import (
    Checkpointer,
    CheckpointInterval,
    CheckpointSaveError,
    discover_latest_checkpoint,
    load_checkpoint,
    read_checkpoint_metadata,
)
from levanter.checkpoint.layout import step_dirs
from levanter.errors import OutOfSpaceError
from levanter.utils import fault, fs


def make_state(seed: int) -> dict:
    """Device arrays (one sharded over two devices), a bf16 leaf, a typed key, a host value, a step."""
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(seed)
    return {
        "w": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32), NamedSharding(mesh, P("data"))),
        "b": jax.device_put(rng.standard_normal(32, dtype=np.float32).astype(jnp.bfloat16)),
        "opt": {"mu": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32)),
                "count": jax.device_put(np.int32(seed))},
        "key": jax.random.wrap_key_data(jax.device_put(rng.integers(0, 2**32, 2, dtype=np.uint32))),
        "host": np.arange(5, dtype=np.int64) * seed,
        "step": jax.device_put(np.int32(seed)),
    }


def host_bytes(tree) -> list:
    def raw(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        x = np.asarray(x)
        return (x.dtype.str, x.shape, x.tobytes())

    return [raw(x) for x in jax.tree.leaves(tree)]


@jax.jit
def _bump(x):
    return x * 2 + 1


_donating_step = jax.jit(lambda t: jax.tree.map(_bump, t), donate_argnums=(0,))


def train_on(tree) -> dict:
    """What the next train steps do to the saved state: donate its device buffers and overwrite them."""
    arrays = {k: v for k, v in tree.items() if k in ("w", "b", "opt")}
    for _ in range(3):
        arrays = _donating_step(arrays)
    jax.block_until_ready(arrays)
    return arrays


@pytest.mark.parametrize("policy, copy", [("auto", "device"), ("pinned", "pinned"),
                                          ("pinned-async", "pinned-async"), ("host", "host")])
def test_on_step_returns_before_the_commit_and_the_checkpoint_is_the_state_at_the_call(tmp_path, policy,
                                                                                        copy):
    """The writer is held after its first array (``fault.holding``): ``on_step`` has returned, the write is
    in flight and nothing is committed; the loop then donates and overwrites the saved state's buffers; once
    released, the write commits the state as it was at the call. A save that waited for its write would
    return only after the hold's limit, with the checkpoint committed, and fail the checks below. Each way
    of copying the state: on the devices (the CPU backend has room), into pinned host memory (waited for, or
    not: transfers the next step's donation must run after), to host memory."""
    ck = Checkpointer(str(tmp_path), save_interval=None, keep=[CheckpointInterval(1)])
    ck.snapshot_policy = policy
    state = make_state(1)
    expected = host_bytes(state)
    with fault.holding("checkpoint_mid_write", limit_s=30) as (reached, release):
        assert ck.on_step(state, 1)
        assert ck.last_copy == copy
        assert reached.wait(30)  # the write is under way...
        assert ck.writing and discover_latest_checkpoint(str(tmp_path)) is None  # ...and not committed
        assert [e for e in os.listdir(tmp_path) if e.startswith(".tmp-step-1-")], os.listdir(tmp_path)
        train_on(state)  # the loop moves on: the saved state's device buffers are donated and overwritten
        assert state["w"].is_deleted() and state["opt"]["mu"].is_deleted()
        assert ck.writing  # still held: the write waits for nothing the loop does
        release.set()
    ck.wait_until_finished()
    assert not ck.writing and sorted(os.listdir(tmp_path)) == ["step-1"]
    assert host_bytes(load_checkpoint(make_state(0), str(tmp_path / "step-1"))) == expected


def test_the_host_copy_taken_where_the_devices_lack_room_is_the_state_at_the_call(tmp_path):
    """The other way a background save copies the state (devices without room for a snapshot): to host
    memory before the call returns; the write after the next steps donated the buffers is bit-exact."""
    from levanter.checkpoint.serialization import prepare_save

    state = make_state(5)
    expected = host_bytes(state)
    prepared = prepare_save(state, 5, str(tmp_path / "step-5"))
    assert prepared.copy_to_host() > 0
    train_on(state)
    assert state["w"].is_deleted()
    prepared.commit()
    assert host_bytes(load_checkpoint(make_state(0), str(tmp_path / "step-5"))) == expected


def test_pinned_transfers_still_in_flight_when_the_next_step_donates_are_the_state_at_the_call(tmp_path):
    """With the ``pinned-async`` policy the transfers into pinned host memory are started, not waited for:
    the next (donating) step is dispatched right after ``on_step`` returns, over a state large enough that
    they may still be running; the checkpoint is the state at the call, bit for bit."""
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(7)
    sharded = NamedSharding(mesh, P("data"))
    state = {"w": jax.device_put(rng.standard_normal((2048, 2048), dtype=np.float32), sharded),
             "b": jax.device_put(rng.standard_normal((1024, 1024), dtype=np.float32).astype(jnp.bfloat16)),
             "opt": {"mu": jax.device_put(rng.standard_normal((2048, 1024), dtype=np.float32))}}
    expected = host_bytes(state)
    ck = Checkpointer(str(tmp_path), save_interval=None, keep=[CheckpointInterval(1)])
    ck.snapshot_policy = "pinned-async"
    assert ck.on_step(state, 1) and ck.last_copy == "pinned-async"
    train_on(state)
    ck.wait_until_finished()
    assert host_bytes(load_checkpoint(state_like(state), str(tmp_path / "step-1"))) == expected


def state_like(state):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), state)


def test_a_snapshot_split_between_device_copies_and_host_copies_is_the_state_at_the_call():
    """Where the devices have room for part of the state, those arrays are copied on the devices (in tree
    order, while they fit) and the rest to host memory (by default; pinned host memory only where the
    policy asks for it); after the next steps donate the originals, both come to host memory bit for bit."""
    from levanter.checkpoint.host_copy import finish_snapshot, plan_snapshot, take_snapshot

    state = make_state(4)
    values = [state["w"], state["opt"]["mu"], state["b"], state["host"]]
    d0, d1 = jax.devices()[:2]
    room = {d0: 4096.0 + 8191, d1: 4096.0}  # w: 4 KiB on each; then mu (8 KiB, on d0) does not fit
    assert plan_snapshot(values, room, pinned=True) == ["device", "pinned", "device", "host"]
    assert plan_snapshot(values, room, pinned=False) == ["device", "host", "device", "host"]
    expected = [np.asarray(v).copy() for v in values]
    snap, how = take_snapshot(values, room=room)
    assert how == "device+host"
    train_on(state)
    assert state["w"].is_deleted() and state["opt"]["mu"].is_deleted()
    for value, want in zip(finish_snapshot(snap), expected):
        if isinstance(value, np.ndarray):
            assert value.tobytes() == want.tobytes()
            continue
        got = np.empty(value.shape, value.dtype)
        for index, data in value.shards:
            got[index] = data
        assert got.tobytes() == want.tobytes()


def test_a_second_save_waits_for_the_first_and_they_commit_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("LEVANTER_FAULT_DELAY", "checkpoint_mid_write:0.1")
    clock = [0.0]
    ck = Checkpointer(str(tmp_path), save_interval=datetime.timedelta(seconds=10), keep=[CheckpointInterval(3)],
                      clock=lambda: clock[0])
    first, second = make_state(2), make_state(3)
    clock[0] = 11.0
    assert ck.on_step(first, 2)  # temporary
    assert ck.on_step(second, 3)  # permanent: waits for step-2, then supersedes it once it is complete
    assert os.path.isfile(tmp_path / "step-2" / "metadata.json")  # committed before the second save began
    assert ck.latest_checkpoint() == str(tmp_path / "step-3")  # waits for the save in flight
    assert sorted(os.listdir(tmp_path)) == ["step-3"]
    assert not read_checkpoint_metadata(str(tmp_path / "step-3"))["is_temporary"]
    assert host_bytes(load_checkpoint(make_state(0), str(tmp_path / "step-3"))) == host_bytes(second)


def test_a_bucket_refusing_a_background_write_stops_the_next_step(s3_server, fault_proxy):
    """A real failure: the fault proxy in front of the S3 server answers every request with 403 once the
    first checkpoint is complete. The save returns (its write runs in the background); the next
    ``on_step`` raises, naming the URL and the cause; the uncommitted save is never discovered."""
    proxy = fault_proxy(s3_server, fail_fraction=0.0, delay_s=(0.0, 0.0), fail_status=403)
    base = s3_server.url(f"async-{uuid.uuid4().hex[:8]}")
    ck = Checkpointer(base, save_interval=None, keep=[CheckpointInterval(2)])
    assert ck.on_step(make_state(2), 2)
    ck.wait_until_finished()
    proxy.fail_fraction = 1.0  # from now on the bucket refuses everything
    assert ck.on_step(make_state(4), 4)  # returns: the write fails in the background
    with pytest.raises(CheckpointSaveError) as e:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the loop's next steps: the failure stops the first one after it
            ck.on_step(make_state(5), 5)
            time.sleep(0.05)
    msg = str(e.value)
    url = fs.join(base, "step-4")
    assert msg.startswith(f"could not save the checkpoint of step 4 to {url}: ") and "\n" not in msg, msg
    assert "Forbidden" in msg or "PERMISSION_DENIED" in msg or "AccessDenied" in msg, msg
    assert "Nothing was committed" in msg
    proxy.fail_fraction = 0.0
    assert discover_latest_checkpoint(base) == fs.join(base, "step-2")
    assert [s for s, _ in step_dirs(base) if fs.isfile(fs.join(base, f"step-{s}", "metadata.json"))] == [2]
    ck.wait_until_finished()  # the failure was reported once; nothing is in flight


def _mount_tmpfs(path, size: str):
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")


def test_a_full_disk_during_a_background_write_is_raised_by_wait_and_commits_nothing(tmp_path):
    """A real full filesystem (a 256 KiB tmpfs; skipped where mounting one is not allowed)."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "256k")
    try:
        ck = Checkpointer(str(mnt), save_interval=None, keep=[CheckpointInterval(1)])
        assert ck.on_step({"small": jnp.arange(8.0)}, 1)
        assert ck.on_step({"big": jnp.ones((512, 256), jnp.float32)}, 2)  # 512 KiB: cannot fit
        with pytest.raises(OutOfSpaceError) as e:
            ck.wait_until_finished()
        msg = str(e.value)
        assert f"saving the checkpoint of step 2 at {mnt / 'step-2'}" in msg and "No space left" in msg, msg
        assert sorted(os.listdir(mnt)) == ["step-1"]  # no partial step-2, no temporary directory
        assert discover_latest_checkpoint(str(mnt)) == str(mnt / "step-1")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ---------------------------------------------------------------------------------------------------
# End to end: train_lm
# ---------------------------------------------------------------------------------------------------
YAML = """
data:
  train_urls: ["embedded://python-docs/validation"]
  validation_urls: ["embedded://python-code/validation"]
  tokenizer: byte
  cache_dir: {cache}
  shuffle: true
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 2, seq_len: 32, gradient_checkpointing: false}}
trainer:
  num_train_steps: 12
  train_batch_size: 8
  steps_per_eval: 100
  max_eval_batches: 2  # the final eval reads 2 batches, not the whole validation split (~6 s a run)
  require_accelerator: false
  log_dir: {logs}
  tracker: {{type: json}}
  checkpointer: {{base_path: {ckpt}, keep: [{{every: 3}}]}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0}}
"""


def run_train(tmp_path, run_id, ckpt=None, **fault_env):
    cfg = tmp_path / "async.yaml"
    cfg.write_text(YAML.format(cache=tmp_path / "cache", logs=tmp_path / "logs", ckpt=ckpt or tmp_path / "ckpt"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVANTER_FAULT_")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", **fault_env)
    return subprocess.run([sys.executable, "-m", "levanter.main.train_lm", "--config_path", str(cfg),
                           "--trainer.id", run_id], env=env, capture_output=True, text=True, cwd=tmp_path)


def losses(tmp_path, run_id) -> dict:
    import json

    with open(tmp_path / "logs" / run_id / "metrics.jsonl") as f:
        return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The losses of one uninterrupted run, step by step: what every interrupted and resumed run below must
    equal. Run once per session (the tests using it may run on different xdist workers)."""
    from helpers import once_per_session

    def make(directory):
        ref = run_train(directory, "ref")
        assert ref.returncode == 0, ref.stderr[-3000:]
        return losses(directory, "ref")

    value = once_per_session(tmp_path_factory, "async-checkpoint-reference", make)
    assert sorted(value) == list(range(12))
    return value


@pytest.mark.slow
def test_kill_9_or_sigterm_during_a_background_write_then_rerun_resumes_bit_for_bit(tmp_path, reference):

    # kill -9 after 8 updates. Each save is held open ~0.05 s per array (~4 s), so step-3 was committed (the
    # save of step 6 waited for it) and the save of step 6 is still in flight: steps 7 and 8 trained on.
    slow = {"LEVANTER_FAULT_DELAY": "checkpoint_mid_write:0.05"}
    killed = run_train(tmp_path, "crash", LEVANTER_FAULT_KILL_AT="train_after_step:8", **slow)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = tmp_path / "ckpt" / "crash"
    entries = sorted(os.listdir(run_dir))
    assert "step-3" in entries and "step-6" not in entries, entries
    assert any(e.startswith(".tmp-step-6-") for e in entries), entries  # the write in flight at the kill
    assert discover_latest_checkpoint(str(run_dir)) == str(run_dir / "step-3")
    resumed = run_train(tmp_path, "crash")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-3" in resumed.stderr  # resumed from the last complete checkpoint
    assert losses(tmp_path, "crash") == reference  # bit for bit (exact float equality)

    # SIGTERM while the save of step 3 is being written (the signal comes from inside the write): the write
    # completes, the current step is checkpointed after it, the run exits 75 and resumes bit for bit.
    from levanter.training import PREEMPTED_EXIT_CODE

    term = run_train(tmp_path, "term", LEVANTER_FAULT_KILL_AT="checkpoint_mid_write:3", LEVANTER_FAULT_SIGNAL="SIGTERM",
                     **slow)
    assert term.returncode == PREEMPTED_EXIT_CODE, term.stderr[-3000:]
    run_dir = tmp_path / "ckpt" / "term"
    entries = sorted(os.listdir(run_dir))
    assert not [e for e in entries if e.startswith(".tmp-")], entries
    stopped = max(losses(tmp_path, "term")) + 1  # updates done when the run stopped
    assert stopped >= 3 and f"SIGTERM: checkpointed step {stopped} in {run_dir}" in term.stderr, term.stderr[-3000:]
    # The save of step 6 may have run too: the signal can come while the loop waits for the write of step 3
    # at that save (a background save returns at once, so the loop may reach step 6 before the write is done).
    saved = {int(e.split("-")[1]) for e in entries if e.startswith("step-")}
    assert {3, stopped} <= saved <= {3, 6, stopped}, saved
    for step in saved:
        assert read_checkpoint_metadata(str(run_dir / f"step-{step}"))["step"] == step
    resumed = run_train(tmp_path, "term")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path, "term") == reference


@pytest.mark.slow
def test_a_background_write_filling_the_disk_stops_the_run_with_one_error(tmp_path):
    """The checkpoints go to a tmpfs with room for one (skipped where mounting one is not allowed): the
    save of step 6 fails in the background; the run stops at the next step boundary after the failure with
    one ``error:`` paragraph naming the path, exit status 74, and only step-3 on the disk."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "1600k")  # one checkpoint of this model is ~1.1 MB
    try:
        r = run_train(tmp_path, "full", ckpt=mnt)
        assert r.returncode == 74, r.stderr[-3000:]
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, r.stderr[-3000:]
        assert f"saving the checkpoint of step 6 at {mnt / 'full' / 'step-6'}" in errors[0], errors
        assert "No space left on device" in errors[0] and "Traceback" not in r.stderr
        # Steps trained on while the write was in flight; the first step boundary after the failure stopped
        # the run, at the latest the save of step 9, which waits for the write of step 6.
        assert 6 <= max(losses(tmp_path, "full")) + 1 <= 9
        assert sorted(e for e in os.listdir(mnt / "full") if e != "run.lock") == ["step-3"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_a_checkpoint_directory_turning_read_only_during_a_background_save_is_one_error(tmp_path, request):
    """The checkpoints go to a tmpfs (skipped where mounting one is not allowed) that is remounted read-only
    while the save of step 6 is in flight (the writer stops itself with SIGSTOP just before its commit, the
    test remounts and continues it). The run stops with one ``error:`` paragraph naming the directory and
    exit status 74 -- the run lock, which cannot be removed either, adds no second error -- and once the
    directory is writable again the rerun resumes from the latest checkpoint and ends bit for bit equal to an
    uninterrupted run."""
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "64m")
    try:
        reference = request.getfixturevalue("reference")  # after the mount: a skipped test runs nothing
        cfg = tmp_path / "async.yaml"
        cfg.write_text(YAML.format(cache=tmp_path / "cache", logs=tmp_path / "logs", ckpt=mnt))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEVANTER_FAULT_")}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   LEVANTER_FAULT_KILL_AT="checkpoint_before_rename:2", LEVANTER_FAULT_SIGNAL="SIGSTOP")
        proc = subprocess.Popen([sys.executable, "-m", "levanter.main.train_lm", "--config_path", str(cfg),
                                 "--trainer.id", "ro"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 300
            while not _stopped(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                time.sleep(0.05)
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            proc.send_signal(signal.SIGCONT)
            _, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 74, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
        run_dir = mnt / "ro"
        assert errors[0].startswith(f"error: {run_dir} is on a read-only filesystem"), errors
        # The save that meets the read-only directory first: the held one of step 6, or, where its write had
        # finished before the remount, the final one of step 9; the latest checkpoint is the one before it.
        failed = re.search(rf"while saving the checkpoint of step (\d+) at {re.escape(str(run_dir))}/", errors[0])
        assert failed and int(failed.group(1)) in (6, 9), errors
        before = {6: "step-3", 9: "step-6"}[int(failed.group(1))]
        assert discover_latest_checkpoint(str(run_dir)) == str(run_dir / before)
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        resumed = run_train(tmp_path, "ro", ckpt=mnt)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resuming from checkpoint {run_dir / before}" in resumed.stderr, resumed.stderr[-3000:]
        assert losses(tmp_path, "ro") == reference
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
