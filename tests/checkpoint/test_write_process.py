"""The writer process of background saves (levanter.checkpoint.write_process): what it writes is the state at
the save, bit for bit (bfloat16, PRNG keys and host values included); it ignores the signals a terminal or a
scheduler sends the whole process group; a writer that dies fails the save in flight alone (the previous
checkpoint stays the latest, the next save starts another writer; one found dead between saves is replaced
before the job is sent); and it never outlives the training
process (a ``kill -9`` of the trainer takes it down with it, so it cannot go on changing the run's
directory)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from levanter.checkpoint import CheckpointInterval, Checkpointer, discover_latest_checkpoint, load_checkpoint
from levanter.checkpoint import write_process
from levanter.checkpoint.errors import CheckpointSaveError
from levanter.utils import fault

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs Linux")


def make_state(seed: int) -> dict:
    k = jax.random.PRNGKey(seed)
    return {
        "w": jax.random.normal(k, (64, 48)),
        "b": jnp.arange(40, dtype=jnp.bfloat16) * seed,
        "key": jax.random.key(seed),
        "host": np.arange(7, dtype=np.int64) + seed,
        "step": jnp.asarray(seed, jnp.int32),
    }


def raw(tree) -> list:
    def one(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        x = np.asarray(x)
        return x.dtype.str, x.shape, x.tobytes()

    return [one(x) for x in jax.tree.leaves(tree)]


def writer_pid() -> int:
    proc = write_process._WRITER._proc if write_process._WRITER is not None else None
    assert proc is not None and proc.poll() is None, "no writer process is running"
    return proc.pid


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_a_background_save_written_by_the_writer_process_is_the_state_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.delenv("LEVANTER_CHECKPOINT_WRITER", raising=False)
    ck = Checkpointer(str(tmp_path), save_interval=None, keep=[CheckpointInterval(1)])
    state = make_state(3)
    ck.on_step(state, 3)
    ck.wait_until_finished()
    pid = writer_pid()
    assert raw(load_checkpoint(make_state(0), str(tmp_path / "step-3"))) == raw(state)
    # Ctrl-C in a terminal and a scheduler's SIGTERM reach the whole process group: the writer stays, and
    # the training process decides whether to wait for the write in flight.
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    state = make_state(4)
    ck.on_step(state, 4)
    ck.wait_until_finished()
    assert writer_pid() == pid
    assert raw(load_checkpoint(make_state(0), str(tmp_path / "step-4"))) == raw(state)


def test_a_writer_process_that_dies_fails_only_the_save_in_flight(tmp_path, monkeypatch):
    monkeypatch.delenv("LEVANTER_CHECKPOINT_WRITER", raising=False)
    ck = Checkpointer(str(tmp_path), save_interval=None, keep=[CheckpointInterval(1)])
    ck.on_step(make_state(1), 1)
    ck.wait_until_finished()
    pid = writer_pid()
    with fault.holding("checkpoint_writer_started", limit_s=30) as (reached, release):
        ck.on_step(make_state(2), 2)
        assert reached.wait(30)  # the writer has taken the save's job...
        os.kill(pid, signal.SIGKILL)  # ...which dies before it is done
        release.set()
    with pytest.raises(CheckpointSaveError, match="writer process exited") as e:
        ck.wait_until_finished()
    assert "step 2" in str(e.value) and str(tmp_path / "step-2") in str(e.value)
    assert discover_latest_checkpoint(str(tmp_path)).endswith("step-1")
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # nothing of the failed save is left
    state = make_state(3)
    ck.on_step(state, 3)  # a new writer
    ck.wait_until_finished()
    assert writer_pid() != pid
    assert raw(load_checkpoint(make_state(0), str(tmp_path / "step-3"))) == raw(state)
    os.kill(writer_pid(), signal.SIGKILL)  # between saves: replaced before the next job is sent
    state = make_state(4)
    ck.on_step(state, 4)
    ck.wait_until_finished()
    assert raw(load_checkpoint(make_state(0), str(tmp_path / "step-4"))) == raw(state)


def test_the_writer_process_dies_with_the_training_process(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        os.environ.pop("LEVANTER_CHECKPOINT_WRITER", None)
        os.environ["LEVANTER_FAULT_DELAY"] = "checkpoint_mid_write:60"  # the write stays in flight
        from levanter.checkpoint import CheckpointInterval, Checkpointer, write_process
        from test_write_process import make_state
        ck = Checkpointer({str(tmp_path)!r}, save_interval=None, keep=[CheckpointInterval(1)])
        ck.on_step(make_state(1), 1)
        while write_process._WRITER is None or write_process._WRITER._proc is None:
            time.sleep(0.01)
        print(write_process._WRITER._proc.pid, flush=True)
        time.sleep(600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(trainer.stdout.readline())
        assert not gone(pid)
        trainer.kill()
        trainer.wait(30)
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(pid), "the writer process outlived the training process"
        assert discover_latest_checkpoint(str(tmp_path)) is None
    finally:
        trainer.kill()
