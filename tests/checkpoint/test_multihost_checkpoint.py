"""Background checkpoints on several processes (2 and 4 real processes on 127.0.0.1, train_lm through
tests/training/test_multihost.py's harness): each process writes its own shards on its writer thread, process 0
commits once every process has said (through the runtime's key-value store) that its shards are written.

* kill -9 of one process at a seeded moment of a write (the others then killed too, as a scheduler
  would): the save in flight is never committed, every checkpoint on disk is complete, and a rerun
  resumes and ends bit for bit equal to an uninterrupted run of the same topology;
* SIGTERM on one process during a write: every process stops at the same step, the write in flight and
  the current step's checkpoint are committed, every process exits 75, and the rerun is bit for bit equal;
* one process's write failing (``LEVANTER_FAULT_RAISE``): nothing of that save is committed, and every
  process stops at the next save with one ``error:`` paragraph and exit status 1.

Every process holds part of each array (``trainer.model_axis_size`` = the number of devices), so each one
really writes shards. ``LEVANTER_FAULT_DELAY`` holds each write open ~1 s, so that steps train on while it
is in flight.
"""

import os
import random
import re
import signal
import subprocess
import time

import pytest

from levanter.checkpoint import discover_latest_checkpoint
from test_multihost import launch, start, stderr_of, steps_of

STEPS = 12  # saves at 4, 8 and 12 (test_multihost's config keeps every 4th step)
SLOW_WRITES = {"LEVANTER_FAULT_DELAY": "checkpoint_mid_write:0.02"}


def _extra(devices: int) -> list:
    return ["--trainer.model_axis_size", str(devices)]


def _committed(run_dir) -> list[int]:
    """The steps of the checkpoints on disk; each must be complete (a step-N directory exists only once
    committed)."""
    steps = []
    for entry in sorted(os.listdir(run_dir)) if run_dir.exists() else []:
        if entry.startswith("step-"):
            assert (run_dir / entry / "metadata.json").is_file(), f"{entry} is visible without metadata.json"
            steps.append(int(entry.split("-")[1]))
    return sorted(steps)


def _reference(tmp_path, processes, devices):
    outs = launch(tmp_path, "ref", processes=processes, devices_per_process=devices, steps=STEPS,
                  extra=_extra(processes * devices), timeout=900)
    for rc, err in outs:
        assert rc == 0, err[-3000:]
    return steps_of(tmp_path, "ref", "train/loss")


def _resume_matches(tmp_path, run_id, processes, devices, reference):
    outs = launch(tmp_path, run_id, processes=processes, devices_per_process=devices, steps=STEPS,
                  extra=_extra(processes * devices), timeout=900)
    for rc, err in outs:
        assert rc == 0, err[-3000:]
    assert steps_of(tmp_path, run_id, "train/loss") == reference  # bit for bit (exact float equality)
    assert _committed(tmp_path / "ckpt" / run_id)[-1] == STEPS


def _kill_trial(tmp_path, run_id, processes, devices, victim, rng, reference):
    """Kill process ``victim`` at its k-th point between two arrays of a write (k drawn from ``rng``), then
    the others; check the disk; rerun and compare."""
    k = rng.randint(1, 100)  # 52 arrays, 51 points a save: inside the save of step 4 or of step 8
    env = lambda pid: {**SLOW_WRITES, **({"LEVANTER_FAULT_KILL_AT": f"checkpoint_mid_write:{k}"}  # noqa: E731
                                          if pid == victim else {})}
    procs = start(tmp_path, run_id, processes=processes, devices_per_process=devices, steps=STEPS,
                  extra=_extra(processes * devices), per_process_env=env)
    try:
        procs[victim].wait(timeout=900)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # the scheduler ends the job of a lost process
            p.wait()
    assert procs[victim].returncode == -signal.SIGKILL, stderr_of(procs[victim])[-3000:]
    run_dir = tmp_path / "ckpt" / run_id
    committed = _committed(run_dir)
    # The victim was writing the save of step 4 or 8 when it died: nobody committed that one.
    in_flight = 4 * ((k - 1) // 51 + 1)
    assert in_flight not in committed, (victim, k, committed)
    latest = discover_latest_checkpoint(str(run_dir)) if run_dir.exists() else None
    assert latest == (str(run_dir / f"step-{committed[-1]}") if committed else None)
    _resume_matches(tmp_path, run_id, processes, devices, reference)
    return f"process {victim} killed at write point {k}: committed {committed}, rerun identical"


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    """An uninterrupted run on 2 processes of 1 device: its losses, step by step. Run once per session: the
    two tests using it may run on different xdist workers, and a module fixture runs once per worker."""
    from helpers import once_per_session

    def make(d):
        reference = _reference(d, 2, 1)
        assert _committed(d / "ckpt" / "ref") == [4, 8, 12]
        return reference

    reference = once_per_session(tmp_path_factory, "two-process-checkpoint-reference", make)
    assert sorted(reference) == list(range(STEPS))
    return reference


@pytest.mark.slow
@pytest.mark.sockets
@pytest.mark.timeout(1800)  # six launches of two train_lm processes
def test_two_processes_kill_9_of_one_during_a_write_then_resume_bit_for_bit(tmp_path, two_process_reference):
    rng = random.Random(1)  # kills at the 18th point (the save of step 4) and the 73rd (the save of step 8)
    for victim in (0, 1):  # the process that commits, and one that only writes its shards
        print(_kill_trial(tmp_path, f"kill{victim}", 2, 1, victim, rng, two_process_reference))


@pytest.mark.slow
@pytest.mark.sockets
@pytest.mark.timeout(1800)
def test_two_processes_sigterm_on_one_waits_for_the_write_everywhere(tmp_path, two_process_reference):
    """SIGTERM reaches process 1 only, while it writes the save of step 4: every process stops at the same
    step, after the write in flight and the current step's save are committed, and exits 75."""
    from levanter.training import PREEMPTED_EXIT_CODE

    reference = two_process_reference

    env = lambda pid: {**SLOW_WRITES, **({"LEVANTER_FAULT_KILL_AT": "checkpoint_mid_write:3",  # noqa: E731
                                           "LEVANTER_FAULT_SIGNAL": "SIGTERM"} if pid == 1 else {})}
    outs = launch(tmp_path, "term", processes=2, devices_per_process=1, steps=STEPS, extra=_extra(2),
                  per_process_env=env, timeout=900)
    for rc, err in outs:
        assert rc == PREEMPTED_EXIT_CODE, err[-3000:]
    run_dir = tmp_path / "ckpt" / "term"
    said = [re.findall(rf"SIGTERM: checkpointed step (\d+) in {re.escape(str(run_dir))};", err) for _, err in outs]
    assert said[0] and said[0] == said[1], said  # the same step on every process
    stopped = int(said[0][0])
    committed = _committed(run_dir)
    # The write of step 4 was in flight when the signal came (the save of step 8 may have run too, if the
    # signal came while the loop waited for that write); the stop's save is committed before any exit.
    assert 4 < stopped < STEPS and committed[0] == 4 and committed[-1] == stopped, committed
    assert set(committed) <= {4, 8, stopped}, committed
    assert not [e for e in os.listdir(run_dir) if e.startswith(".tmp-")]
    _resume_matches(tmp_path, "term", 2, 1, reference)


@pytest.mark.slow
@pytest.mark.sockets
@pytest.mark.timeout(1800)
def test_two_processes_a_write_failing_on_one_commits_nothing_and_stops_both(tmp_path):
    """Process 1's write of step 4 fails: nothing of it is committed; both stop at the save of step 8 with
    one error paragraph each (process 0's names process 1) and exit status 1."""
    env = lambda pid: {**SLOW_WRITES, **({"LEVANTER_FAULT_RAISE": "checkpoint_mid_write:2"}  # noqa: E731
                                          if pid == 1 else {})}
    outs = launch(tmp_path, "fail", processes=2, devices_per_process=1, steps=STEPS, extra=_extra(2),
                  per_process_env=env, timeout=900)
    run_dir = tmp_path / "ckpt" / "fail"
    for pid, (rc, err) in enumerate(outs):
        assert rc == 1, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert f"could not save the checkpoint of step 4 to {run_dir / 'step-4'}" in errors[0], errors
        assert ("process 1:" if pid == 0 else "injected at checkpoint_mid_write") in errors[0], errors
    assert _committed(run_dir) == [] and discover_latest_checkpoint(str(run_dir)) is None
    assert max(steps_of(tmp_path, "fail", "train/loss")) + 1 == 8  # stopped at the next save


@pytest.mark.slow
@pytest.mark.sockets
@pytest.mark.timeout(1800)
def test_four_processes_kill_9_of_one_during_a_write_then_resume_bit_for_bit(tmp_path):
    reference = _reference(tmp_path, 4, 1)
    assert _committed(tmp_path / "ckpt" / "ref") == [4, 8, 12]
    print(_kill_trial(tmp_path, "kill", 4, 1, 3, random.Random(5), reference))  # the 80th point: step 8's save
