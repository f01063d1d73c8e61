"""Many hosts: per-process rows (simulated up to 1,024 processes), two real processes on 127.0.0.1
matching one process and resuming across topologies, and start-up errors."""

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from levanter.data.loader import process_rows, rows_for_process
from levanter.distributed import DistributedConfig, config_digest
from levanter.schedule import BatchSchedule, ScheduleStep

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers


# -- the index map, simulated at scale ------------------------------------------------------------------
@pytest.mark.devices(8)
def test_pure_row_map_matches_jax_sharding_on_real_meshes():
    devices = np.asarray(jax.devices())
    for shape, names, data_axes in [((8,), ("data",), ("data",)), ((4, 2), ("data", "model"), ("data",)),
                                    ((2, 4), ("model", "data"), ("data",)), ((2, 2, 2), ("a", "b", "c"), ("a", "c"))]:
        mesh = Mesh(devices.reshape(shape), names)
        sharding = NamedSharding(mesh, PartitionSpec(data_axes))
        for device, (sl,) in sharding.devices_indices_map((64,)).items():
            # Re-label this one device as process 1 and check the pure map finds exactly its slice.
            procs = np.vectorize(lambda d: 1 if d == device else 0, otypes=[np.int64])(mesh.devices)
            got = rows_for_process(procs, names, data_axes, 64, 1)
            assert got.tolist() == list(range(*sl.indices(64))), (shape, names, device)
        assert process_rows(mesh, data_axes, 64, 0).tolist() == list(range(64))


TOPOLOGIES = {
    # name: (number of processes, devices per process, data axis size, model axis size)
    "1024x4 data only": (1024, 4, 4096, 1),
    "1024x4 model=4 within host": (1024, 4, 1024, 4),
    "1024x4 model=8 across hosts": (1024, 4, 512, 8),
    "256x8 model=2": (256, 8, 1024, 2),
    "4096x1": (4096, 1, 4096, 1),
}


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_simulated_topologies_cover_each_step_exactly(name):
    n_proc, per_proc, data, model = TOPOLOGIES[name]
    # Devices are numbered host-major; the mesh is (data, model) row-major over them, as jax.devices() orders.
    procs = (np.arange(n_proc * per_proc) // per_proc).reshape(data, model)
    schedule = BatchSchedule([ScheduleStep(0, 4096), ScheduleStep(300, 8192), ScheduleStep(700, 4096 * 3)])
    rows = {bs: [rows_for_process(procs, ("data", "model"), ("data",), bs, p) for p in range(n_proc)]
            for bs in schedule.distinct_batch_sizes}
    for bs, per_process in rows.items():
        # Processes holding the same data shards (model-parallel replicas) read the same rows; otherwise
        # processes' rows are disjoint, and together they cover the batch exactly.
        groups = {}
        for p, r in enumerate(per_process):
            groups.setdefault(tuple(r.tolist()), []).append(p)
        all_rows = np.concatenate([np.asarray(k, dtype=np.int64) for k in groups])
        assert sorted(all_rows.tolist()) == list(range(bs))
        for r in per_process:
            assert (np.diff(r) > 0).all()  # ascending, as the loader requests them
    for step in range(0, 1000, 7):
        first, end = schedule.step_range(step)
        bs = end - first
        requested = np.unique(np.concatenate([first + r for r in rows[bs]]))
        np.testing.assert_array_equal(requested, np.arange(first, end))  # independent of the topology


# -- start-up errors -------------------------------------------------------------------------------------
def test_process_id_out_of_range_is_named():
    with pytest.raises(ValueError, match="trainer.distributed.process_id=2 is out of range"):
        DistributedConfig(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2).validate()
    with pytest.raises(ValueError, match="missing num_processes"):
        DistributedConfig(coordinator_address="127.0.0.1:1234", process_id=0).validate()
    with pytest.raises(ValueError, match="host:port"):
        DistributedConfig(coordinator_address="localhost", num_processes=1, process_id=0).validate()


def test_config_digest_ignores_only_per_process_fields():
    a = {"trainer": {"seed": 0, "distributed": {"process_id": 0, "num_processes": 2}}}
    b = {"trainer": {"seed": 0, "distributed": {"process_id": 1, "num_processes": 2}}}
    c = {"trainer": {"seed": 1, "distributed": {"process_id": 1, "num_processes": 2}}}
    assert config_digest(a) == config_digest(b) != config_digest(c)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONFIG = """
data:
  train_urls: ["embedded://python-docs/validation"]
  tokenizer: byte
  cache_dir: {cache}
  shuffle: true
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 2, seq_len: 32, gradient_checkpointing: false}}
trainer:
  num_train_steps: {steps}
  train_batch_size: 8
  steps_per_eval: 1000
  require_accelerator: false
  log_dir: {logs}
  tracker: {{type: json}}
  checkpointer: {{base_path: {ckpt}, keep: [{{every: 4}}]}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0, lr_schedule: constant}}
"""


def start(tmp_path, run_id, *, processes, devices_per_process, steps, extra=(), per_process_extra=None,
          per_process_env=None, config=None):
    """Start the processes of one run (``config``: the YAML template, CONFIG by default); returns them."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text((config or CONFIG).format(cache=tmp_path / "cache", logs=tmp_path / "logs", ckpt=tmp_path / "ckpt",
                                             steps=steps))
    port = free_port()
    procs = []
    for pid in range(processes):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEVANTER_FAULT_")}
        # The suite's other XLA flags (conftest.py: no LLVM optimisation on CPU) are kept.
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        env.update({"XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"]),
                    "LEVANTER_TEST_RECORD": str(tmp_path / f"requests-{run_id}.jsonl")})
        if per_process_env:
            env.update(per_process_env(pid))
        args = [sys.executable, os.path.join(HERE, "multiproc_worker.py"), "--config_path", str(cfg),
                "--trainer.id", run_id, *extra]
        if processes > 1:
            args += ["--trainer.distributed.coordinator_address", f"127.0.0.1:{port}",
                     "--trainer.distributed.num_processes", str(processes), "--trainer.distributed.process_id", str(pid),
                     "--trainer.distributed.initialization_timeout", "60"]
        if per_process_extra:
            args += per_process_extra(pid)
        # stderr to a file, not a pipe: a process whose pipe nobody reads while the test waits for another
        # would block, and hold up the others at the next collective.
        log = tmp_path / f"stderr-{run_id}-{pid}-{uuid.uuid4().hex[:6]}.txt"
        with open(log, "w") as f:
            proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=f, text=True)
        proc.log = log
        procs.append(proc)
    return procs


def stderr_of(proc) -> str:
    return proc.log.read_text()


def launch(tmp_path, run_id, *, processes, devices_per_process, steps, timeout=240, **kwargs):
    """Run one run's processes to the end; ``[(returncode, stderr)]`` by process."""
    procs = start(tmp_path, run_id, processes=processes, devices_per_process=devices_per_process, steps=steps,
                  **kwargs)
    outs = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, stderr_of(p)))
    return outs


def steps_of(tmp_path, run_id, key):
    with open(tmp_path / "logs" / run_id / "metrics.jsonl") as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r and "train/loss" in r}


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory):
    """12 steps on one process of 4 devices: what the topologies below must reproduce, step by step."""
    from helpers import once_per_session

    def run(d):
        for rc, err in launch(d, "ref", processes=1, devices_per_process=4, steps=12):
            assert rc == 0, err[-3000:]
        return {key: steps_of(d, "ref", key) for key in ("train/loss", "data/fingerprint")}

    return once_per_session(tmp_path_factory, "multihost-reference", run)


def requests_by_step(tmp_path, run_id):
    """``{step: {process: indices}}`` of the training loader's requests in a run's launches so far (the
    record is then cleared, so the next launch's requests are its own)."""
    path = tmp_path / f"requests-{run_id}.jsonl"
    out = {}
    with open(path) as f:
        for r in map(json.loads, f):
            assert r["process"] not in out.setdefault(r["step"], {}), r  # each step requested once per process
            out[r["step"]][r["process"]] = r["indices"]
    path.unlink()
    return out


@pytest.mark.slow
@pytest.mark.sockets  # a jax.distributed coordinator on 127.0.0.1
def test_two_processes_match_one_process_and_resume_across_topologies(tmp_path, one_process_reference):
    """Four steps on one process of 4 devices, a resume to eight on two real processes of 2 devices each
    (127.0.0.1), a resume to twelve on one process again: every step's loss and data fingerprint equal the
    one-process reference; each process reads only its own rows of each step; each resume starts from the
    previous launch's checkpoint; a two-process run releases the run lock when it ends."""
    from levanter.checkpoint.run_lock import LOCK_FILENAME

    requests = {}
    for (processes, devices), steps in (((1, 4), 4), ((2, 2), 8), ((1, 4), 12)):
        outs = launch(tmp_path, "el", processes=processes, devices_per_process=devices, steps=steps)
        for rc, err in outs:
            assert rc == 0, err[-3000:]
        if steps > 4:  # process 0 says where it resumed from
            assert "resuming from checkpoint" in outs[0][1] and f"step-{steps - 4}" in outs[0][1], outs[0][1][-3000:]
        assert os.path.isdir(tmp_path / "ckpt" / "el" / f"step-{steps}")
        assert not (tmp_path / "ckpt" / "el" / LOCK_FILENAME).exists()
        part = requests_by_step(tmp_path, "el")
        for step in range(steps - 4, steps):
            requests[step] = (processes, part[step])
    for step, (processes, by_proc) in requests.items():
        rows = list(range(8 * step, 8 * step + 8))
        if processes == 1:
            assert by_proc == {0: rows}
        else:
            assert by_proc == {0: rows[:4], 1: rows[4:]}, step
    ref = one_process_reference
    assert steps_of(tmp_path, "el", "data/fingerprint") == ref["data/fingerprint"]
    el = steps_of(tmp_path, "el", "train/loss")
    assert sorted(el) == list(range(12))
    np.testing.assert_allclose([el[s] for s in range(12)], [ref["train/loss"][s] for s in range(12)], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.sockets
def test_mismatched_configs_across_processes_are_refused(tmp_path):
    outs = launch(tmp_path, "mm", processes=2, devices_per_process=1, steps=2,
                  per_process_extra=lambda pid: ["--trainer.seed", str(pid)])
    for rc, err in outs:
        assert rc != 0
        assert "launched with different configs" in err and "Traceback" not in err.split("error:")[-1]


@pytest.mark.sockets  # a free port on 127.0.0.1
def test_unreachable_coordinator_fails_fast_with_a_clear_error(tmp_path):
    port = free_port()  # nothing listens there
    code = (
        "from levanter.distributed import DistributedConfig\n"
        f"DistributedConfig(coordinator_address='127.0.0.1:{port}', num_processes=2, process_id=1,"
        " initialization_timeout=3).initialize()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XLA_FLAGS": ""})
    assert r.returncode != 0
    assert "did not answer within 3 s" in r.stderr and f"127.0.0.1:{port}" in r.stderr  # the timeout given
