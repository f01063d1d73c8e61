"""The run lock: a second start-up of a held run is refused naming the holder, a lock left by a killed
process of this machine is taken over, a holder elsewhere is never second-guessed, release removes only
this run's record, and train_lm holds the lock for exactly the length of the run (two real concurrent
runs of one id, a SIGTERM, an error, a normal end)."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from levanter.checkpoint.run_lock import LOCK_FILENAME, RunLockedError, acquire_run_lock

HOLDER = """
import sys
from levanter.checkpoint.run_lock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1], "r")
print("held", flush=True)
sys.stdin.read()  # hold until the test closes stdin (or kills this process)
lock.release()
print("released", flush=True)
"""


def start_holder(run_dir):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_refuses_a_second_start_then_a_killed_holder_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "ckpt" / "r"
    holder = start_holder(run_dir)
    try:
        record = json.loads((run_dir / LOCK_FILENAME).read_text())
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
        with pytest.raises(RunLockedError) as e:
            acquire_run_lock(str(run_dir), "r")
        msg = str(e.value)
        for fragment in (f"pid {holder.pid}", socket.gethostname(), record["started"],
                         str(run_dir / LOCK_FILENAME), "delete", "trainer.id"):
            assert fragment in msg, msg
        # the refused start-up left it alone
        assert json.loads((run_dir / LOCK_FILENAME).read_text()) == record
    finally:
        holder.kill()
        holder.wait()
    # SIGKILL: no chance to release. Its host is this one and its pid is gone: the lock is stale.
    assert (run_dir / LOCK_FILENAME).exists()
    with caplog.at_level("WARNING", logger="levanter.checkpoint.run_lock"):
        lock = acquire_run_lock(str(run_dir), "r")
    assert "taking over" in caplog.text and f"pid {holder.pid}" in caplog.text
    assert json.loads((run_dir / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert os.listdir(run_dir) == []  # no lock, no temporary or set-aside file


def test_a_holder_that_releases_lets_the_next_start_in(tmp_path):
    holder = start_holder(tmp_path)
    holder.stdin.close()
    assert holder.stdout.readline().strip() == "released"
    holder.wait()
    with acquire_run_lock(str(tmp_path), "r"):
        assert (tmp_path / LOCK_FILENAME).exists()
    assert not (tmp_path / LOCK_FILENAME).exists()


def write_record(run_dir, **fields):
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"run_id": "r", "host": socket.gethostname(), "pid": 1, "started": "2026-01-02T03:04:05+00:00",
              "token": "t", **fields}
    (run_dir / LOCK_FILENAME).write_text(json.dumps(record))


def test_a_holder_on_another_host_or_with_an_unreadable_record_is_never_taken_over(tmp_path):
    write_record(tmp_path, host="node-7", pid=999999)  # no such pid here, but it is not ours to judge
    with pytest.raises(RunLockedError, match="pid 999999 on host node-7, started 2026-01-02T03:04:05"):
        acquire_run_lock(str(tmp_path), "r")
    (tmp_path / LOCK_FILENAME).write_text('{"host": "no')
    with pytest.raises(RunLockedError, match="a record that cannot be read.*delete"):
        acquire_run_lock(str(tmp_path), "r")


def test_a_reused_pid_or_another_boot_makes_the_lock_stale(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        write_record(tmp_path, pid=sleeper.pid, pid_start="1")  # alive, but started after the holder did
        acquire_run_lock(str(tmp_path), "r").release()
        write_record(tmp_path, pid=sleeper.pid)  # alive, no start time recorded: held
        with pytest.raises(RunLockedError, match=f"pid {sleeper.pid}"):
            acquire_run_lock(str(tmp_path), "r")
        write_record(tmp_path, pid=sleeper.pid, boot_id="another-boot")  # the machine rebooted since
        acquire_run_lock(str(tmp_path), "r").release()
        write_record(tmp_path, pid=os.getpid())  # this very process (a run in progress here)
        with pytest.raises(RunLockedError):
            acquire_run_lock(str(tmp_path), "r")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_without_a_heartbeat_is_stale_wherever_it_was_taken(tmp_path, monkeypatch):
    import levanter.checkpoint.run_lock as run_lock

    write_record(tmp_path, host="node-7", pid=4242, run_id="other")
    lock_file = tmp_path / LOCK_FILENAME
    old = time.time() - run_lock.STALE_AFTER_SECONDS + 60
    os.utime(lock_file, (old, old))  # a minute short of stale
    with pytest.raises(RunLockedError, match=r"held by run 'other', pid 4242 .*last heartbeat 5\d\d s ago"):
        acquire_run_lock(str(tmp_path), "r")
    old -= 120
    os.utime(lock_file, (old, old))
    monkeypatch.setattr(run_lock, "HEARTBEAT_SECONDS", 0.05)
    lock = acquire_run_lock(str(tmp_path), "r")
    try:
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
        os.utime(lock_file, (old, old))
        deadline = time.time() + 60
        while time.time() < deadline and lock_file.stat().st_mtime == old:
            time.sleep(0.05)
        assert lock_file.stat().st_mtime > old  # the holder's heartbeat refreshed it
    finally:
        lock.release()
    assert not lock_file.exists()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = acquire_run_lock(str(tmp_path), "r")
    write_record(tmp_path, host="node-7")  # broken by hand and taken by another run
    lock.release()
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["host"] == "node-7"


# -- train_lm -------------------------------------------------------------------------------------------
def tiny_config(tmp_path, **trainer_kw):
    from levanter.checkpoint import CheckpointerConfig, CheckpointInterval
    from levanter.data.config import UrlSingleDatasetLMConfig
    from levanter.main import train_lm
    from levanter.models import Gpt2Config
    from levanter.optim import AdamConfig
    from levanter.tracker import JsonConfig
    from levanter.training import TrainerConfig

    tkw = dict(num_train_steps=2, train_batch_size=8, require_accelerator=False, id="tiny",
               log_dir=str(tmp_path / "logs"), tracker=JsonConfig(), steps_per_eval=100,
               checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt"),
                                               keep=[CheckpointInterval(every=2)]))
    tkw.update(trainer_kw)
    return train_lm.TrainLmConfig(
        data=UrlSingleDatasetLMConfig(train_urls=["embedded://python-docs/validation"], tokenizer="byte",
                                      cache_dir=str(tmp_path / "cache")),
        model=Gpt2Config(hidden_dim=32, num_heads=4, num_layers=1, seq_len=32, gradient_checkpointing=False),
        trainer=TrainerConfig(**tkw),
        optimizer=AdamConfig(learning_rate=1e-2, warmup=0.0, weight_decay=0.0, lr_schedule="constant"),
        prefetch_depth=2,
    )


def test_train_lm_releases_the_lock_when_it_ends_and_when_it_fails(tmp_path):
    from levanter.main import train_lm

    lock = tmp_path / "ckpt" / "tiny" / LOCK_FILENAME
    assert train_lm.main(tiny_config(tmp_path))["final_step"] == 2
    assert not lock.exists()
    # A failure after the lock was taken (here: resuming with another model shape, for one more step: a run
    # already at num_train_steps stops before restoring anything) releases it too.
    cfg = tiny_config(tmp_path, num_train_steps=3)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_dim=64))
    with pytest.raises(ValueError, match="step-2"):
        train_lm.main(cfg)
    assert not lock.exists()


LONG_RUN = """\
data:
  tokenizer: byte
  cache_dir: {tmp}/cache
  configs: {{docs: {{train_urls: ["embedded://python-docs/validation"]}}}}
  train_weights: [[0, {{docs: 1.0}}]]
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 1, seq_len: 32, gradient_checkpointing: false}}
trainer:
  num_train_steps: 100000
  train_batch_size: 8
  steps_per_eval: 100000
  require_accelerator: false
  id: twice
  log_dir: {tmp}/logs
  tracker: {{type: json}}
  checkpointer: {{base_path: {tmp}/ckpt, keep: [{{every: 100000}}]}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0}}
"""


@pytest.mark.slow
def test_a_job_launched_twice_runs_once(tmp_path, capsys):
    """Two real train_lm processes of one id: the second stops at once (exit 2, naming the first), the
    first trains on undisturbed and, after SIGTERM, checkpoints, exits 75 and releases the lock."""
    from levanter.main import train_lm
    from levanter.training import PREEMPTED_EXIT_CODE

    cfg = tmp_path / "run.yaml"
    cfg.write_text(LONG_RUN.format(tmp=tmp_path))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    first = subprocess.Popen([sys.executable, "-m", "levanter.main.train_lm", "--config_path", str(cfg)],
                             env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    log = tmp_path / "logs" / "twice" / "metrics.jsonl"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.2)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:  # (a short run, so that without a lock this ends, and fails)
            train_lm.cli(["--config_path", str(cfg), "--trainer.num_train_steps", "5"])
        err = capsys.readouterr().err
        assert exc.value.code == 2, err
        assert f"pid {first.pid} on host {socket.gethostname()}" in err and "already running" in err, err
        # The first run's records go on, each step once: the second never logged or deleted anything.
        n = len(log.read_text().splitlines())
        deadline = time.time() + 60
        while time.time() < deadline and len(log.read_text().splitlines()) < n + 2:
            time.sleep(0.2)
        steps = [json.loads(line)["step"] for line in log.read_text().splitlines() if "train/loss" in line]
        assert steps == list(range(len(steps))) and len(steps) >= 4
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    assert not (tmp_path / "ckpt" / "twice" / LOCK_FILENAME).exists()


@pytest.mark.slow
def test_multi_process_runs_all_stop_when_the_lock_is_held(tmp_path):
    """Two real processes of one run, the lock held elsewhere: every process stops with exit 2 at once (none
    waits for the others at a barrier). That two processes take and release the lock of a run they complete
    is checked by tests/training/test_multihost.py's two-process runs."""
    from test_multihost import launch

    write_record(tmp_path / "ckpt" / "held", host="node-7", pid=4242)
    outs = launch(tmp_path, "held", processes=2, devices_per_process=1, steps=2, timeout=120)  # none hangs
    (rc0, err0), (rc1, err1) = outs
    assert rc0 == 2 and "pid 4242 on host node-7" in err0 and "Traceback" not in err0, err0[-3000:]
    assert rc1 == 2 and "process 0 could not take the run lock" in err1, err1[-3000:]
    assert "Traceback" not in err1, err1[-3000:]
    assert not (tmp_path / "logs" / "held" / "metrics.jsonl").exists()
