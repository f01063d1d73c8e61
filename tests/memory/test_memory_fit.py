"""The memory check before the first step, ``per_device_parallelism: auto``, and the profiler window.

CPUs report no device memory, so these tests simulate one with ``LEVANTER_DEVICE_MEMORY``: the figures
the limit is placed between are measured here through the same ahead-of-time compile the run uses
(nothing hard-coded about what XLA's CPU compiler allocates).
"""

from __future__ import annotations

import glob
import json
import logging
from pathlib import Path

import jax
import pytest

from levanter.config import parse_config
from levanter.lm_config import TrainLmConfig
from levanter.training import lm_loss_fn
from levanter.main import train_lm
from levanter.memory import (
    AUTO_HEADROOM,
    DOES_NOT_FIT_EXIT_CODE,
    ENV_DEVICE_MEMORY,
    StepCompiler,
    StepMemory,
    divisors,
    is_resource_exhausted,
    microbatch_candidates,
    oom_figures,
    search_microbatch,
    size,
)

REPO = Path(__file__).resolve().parents[2]

# 32 sequences on 8 devices: 4 per device, so the microbatch can be 4, 2 or 1 per device.
CONFIG = """\
data:
  train_urls: ["embedded://python-docs/validation"]
  tokenizer: byte
  cache_dir: {tmp}/cache
model: {{type: gpt2, hidden_dim: 32, num_heads: 2, num_layers: 1, seq_len: 64, gradient_checkpointing: false}}
trainer:
  num_train_steps: 2
  train_batch_size: 32
  steps_per_eval: 100
  require_accelerator: false
  id: fit
  log_dir: {tmp}/logs
  tracker: {{type: json}}
  checkpointer: {{base_path: {tmp}/ckpt, keep: [{{every: 1}}]}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0, lr_schedule: constant}}
"""


def _config(tmp_path: Path, *args: str) -> tuple[str, TrainLmConfig]:
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(tmp=tmp_path))
    return str(path), parse_config(TrainLmConfig, str(path), list(args))


def test_microbatch_search_finds_the_largest_that_fits_with_few_compiles():
    # Memory as a compiled step has it: fixed state plus a share per sequence of the microbatch.
    calls = []

    def at(d):
        calls.append(d)
        return StepMemory(total=1000 + 100 * d)

    cands = [64, 32, 16, 8, 4, 2, 1]
    pick, seen = search_microbatch(at, cands, budget=1000 + 100 * 5, known={64: StepMemory(total=7400)})
    assert pick == 4 and seen[4].total == 1400
    assert len(calls) <= 3, calls  # halving, then a prediction from two figures
    assert 8 in seen and not seen[8].fits(1500)  # the next larger candidate was measured not to fit
    # Nothing fits: the smallest candidate is measured and the answer is None.
    pick, seen = search_microbatch(at, cands, budget=500, known={64: StepMemory(total=7400)})
    assert pick is None and 1 in seen
    # A compiler refusal (TPU: RESOURCE_EXHAUSTED at compile) counts as not fitting.
    pick, _ = search_microbatch(lambda d: StepMemory(total=None, oom="x") if d > 2 else StepMemory(total=1),
                                [8, 4, 2, 1], budget=10)
    assert pick == 2
    # A ramp (32 then 64 per device): the whole largest batch (64, not a candidate) measured not to fit
    # bounds the search, and the largest candidate (32) is measured, not assumed.
    calls.clear()
    pick, seen = search_microbatch(at, [32, 16, 8, 4, 2, 1], budget=1000 + 100 * 40, known={64: StepMemory(7400)})
    assert pick == 32 and calls == [32]


def test_device_out_of_memory_is_told_from_a_full_disk():
    xla = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1234 bytes.")
    assert is_resource_exhausted(xla)
    # tensorstore's full disk carries the same status code
    disk = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/x/c/0\": [OS error 28: No space left on device]")
    assert not is_resource_exhausted(disk)
    try:
        raise RuntimeError("the step failed") from xla
    except RuntimeError as e:
        assert is_resource_exhausted(e)


def test_xla_out_of_memory_figures():
    # XLA:TPU's two refusals (both in libtpu 0.0.42; the first is what a program too large for the chip gets)
    text = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
            "(48.00G) exceeds available HBM (15.75G).")
    assert oom_figures(text) == (48 * 2**30, int(15.75 * 2**30))
    text = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
            "Used 20.50G of 15.48G hbm. Exceeded hbm capacity by 5.02G.")
    need, have = oom_figures(text)
    assert need == int(20.50 * 2**30) and have == int(15.48 * 2**30)
    assert oom_figures("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1234 bytes.") is None
    # a kernel's scratchpad, not the device's memory
    assert oom_figures("Ran out of memory in memory space vmem. Used 20.00M of 16.00M vmem.") is None


def test_the_tpu_compilers_refusal_is_measured():
    """A program too large for a TPU v5e chip, compiled with libtpu for that chip's topology on this CPU-only
    machine: the compiler's real refusal, read as a measurement (its total and its capacity)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed")
    script = """
import json, jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from levanter.memory import compile_memory
topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1", chip_config_name="default",
                                    chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False))
s = NamedSharding(Mesh(topo.devices, ("x",)), PartitionSpec())
a = jax.ShapeDtypeStruct((1024, 1024, 3072), jnp.float32, sharding=s)  # 12 GiB (no padding in the TPU layout)
m = compile_memory(lambda: jax.jit(lambda x, y: x + y).lower(a, a).compile())
print(json.dumps({"total": m.total, "capacity": m.capacity, "oom": m.oom, "fits": m.fits(None)}))
"""
    # Another process may hold libtpu's lock file (a TPU job, another test run); compiling for a topology
    # needs no chip, so the lock is not needed.
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["total"] == 3 * 12 * 2**30  # x, y and x + y: the figure counts the arguments and the output
    assert 15 * 2**30 < got["capacity"] <= 16 * 2**30  # a v5e chip's 16 GiB, less what the runtime keeps
    assert "RESOURCE_EXHAUSTED" in got["oom"] and not got["fits"]


def test_divisors_are_found_up_to_the_square_root():
    assert divisors(12) == [12, 6, 4, 3, 2, 1] and divisors(1) == [1] and divisors(49) == [49, 7, 1]
    big = divisors(10**12)  # 2^12 x 5^12: 13 x 13 divisors, found with 10^6 trials, not 10^12
    assert len(big) == 169 and big[0] == 10**12 and big[-1] == 1
    assert big == sorted(big, reverse=True) and all(10**12 % d == 0 for d in big)


@pytest.mark.devices(8)  # the figures are per device of 8
def test_candidates_divide_every_batch_of_the_schedule(tmp_path):
    _, cfg = _config(tmp_path, "--trainer.train_batch_size", '[{start: 0, value: 16}, {start: 1, value: 48}]')
    # 2 and 6 per device: microbatches dividing both
    assert microbatch_candidates(cfg.trainer) == [2, 1]
    _, cfg = _config(tmp_path, "--trainer.train_batch_size", str(8 * 10**12))
    assert microbatch_candidates(cfg.trainer) == divisors(10**12)  # 10^12 per device


@pytest.mark.slow
def test_a_step_that_cannot_fit_is_one_error_and_auto_trains(tmp_path, capsys, monkeypatch, caplog):
    path, cfg = _config(tmp_path)
    opt = cfg.optimizer.build(cfg.trainer.num_train_steps)
    compiler = StepCompiler(cfg.model, cfg.trainer, opt, lm_loss_fn(0.0, 256), 257)
    whole, one = compiler.compile(), compiler.compile(per_device_parallelism=1)
    assert one.total < whole.total
    limit = int(one.total / (1 - AUTO_HEADROOM)) + 1024  # one sequence per device fits, the whole batch does not
    assert limit < whole.total
    monkeypatch.setenv(ENV_DEVICE_MEMORY, str(limit))
    monkeypatch.chdir(tmp_path)

    # As configured (4 per device at once): one error paragraph, exit 2, before any step or checkpoint.
    with pytest.raises(SystemExit) as e:
        train_lm.cli(["--config_path", path])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    [message] = [line for line in err.splitlines() if line.startswith("error:")]
    assert f"a device has {size(limit)} ({ENV_DEVICE_MEMORY}={limit})" in message
    assert "trainer.per_device_parallelism: " in message and "(fits)" in message
    assert "model.gradient_checkpointing: true ->" in message and "auto" in message and "--dry_run" in message
    assert not (tmp_path / "ckpt" / "fit").exists() or not list((tmp_path / "ckpt" / "fit").glob("step-*"))

    # The plan says the same, and what auto would pick; its exit status says it does not fit.
    with pytest.raises(SystemExit) as e:
        train_lm.cli(["--config_path", path, "--dry_run", "--device_memory", str(limit)])
    assert e.value.code == DOES_NOT_FIT_EXIT_CODE
    plan = capsys.readouterr().out
    assert "DOES NOT FIT" in plan and "what lowers it" in plan and "per_device_parallelism: auto would pick" in plan

    # With auto the same config trains, with a microbatch that fits, recorded in its checkpoints.
    with caplog.at_level(logging.WARNING, logger="levanter.memory.fit"):
        train_lm.cli(["--config_path", path, "--trainer.per_device_parallelism", "auto"])
    meta = json.loads((tmp_path / "ckpt" / "fit" / "step-2" / "metadata.json").read_text())
    pick = meta["metadata"]["per_device_parallelism"]
    assert pick in (1, 2) and f"auto -> {pick} sequences per device" in caplog.text
    assert (pick == 1) == (compiler.compile(per_device_parallelism=2).total > limit * (1 - AUTO_HEADROOM))
    # A resumed run takes the recorded pick.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="levanter.memory.fit"):
        train_lm.cli(["--config_path", path, "--trainer.per_device_parallelism", "auto",
                      "--trainer.num_train_steps", "3"])
    assert f"auto -> {pick} sequences per device per microbatch (recorded in the run's checkpoint" in caplog.text
    assert (tmp_path / "ckpt" / "fit" / "step-3" / "metadata.json").is_file()


def test_profiler_writes_a_trace_of_the_window(tmp_path, monkeypatch):
    _, cfg = _config(tmp_path, "--trainer.num_train_steps", "4", "--trainer.train_batch_size", "8",
                     "--trainer.profiler", "true", "--trainer.profiler_start_step", "1",
                     "--trainer.profiler_num_steps", "2")
    monkeypatch.chdir(tmp_path)
    assert train_lm.main(cfg)["final_step"] == 4
    traces = glob.glob(str(tmp_path / "logs" / "fit" / "profiler" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and Path(traces[0]).stat().st_size > 0
    assert jax.profiler is not None


def test_the_checked_step_is_the_runs_step(tmp_path, monkeypatch, caplog):
    # With the device's memory known the step is compiled before the first step; the run then uses that
    # executable: the train step (jit(flat)) compiles once, not twice.
    _, cfg = _config(tmp_path, "--trainer.train_batch_size", "8")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "64GiB")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="jax._src.interpreters.pxla"):
        assert train_lm.main(cfg)["final_step"] == 2
    compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(flat)")]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]


@pytest.mark.devices(8)  # the figures are per device of 8
def test_the_plan_says_what_auto_picks(tmp_path, capsys, monkeypatch):
    path, _ = _config(tmp_path)
    monkeypatch.chdir(tmp_path)
    train_lm.cli(["--config_path", path, "--dry_run", "--device_memory", "16GiB",
                  "--trainer.per_device_parallelism", "auto"])
    out = capsys.readouterr().out
    assert "per_device_parallelism: auto picks 4 (" in out and "1 microbatch;" in out  # 32 / 8 devices fit
    # A device one byte short of the step at one sequence per device: larger than the parameters, gradients
    # and optimizer state (the check from shapes passes), smaller than any microbatch's step.
    _, cfg = _config(tmp_path, "--trainer.train_batch_size", "16")
    compiler = StepCompiler(cfg.model, cfg.trainer, cfg.optimizer.build(cfg.trainer.num_train_steps),
                            lm_loss_fn(0.0, None), 257)
    limit = compiler.compile(per_device_parallelism=1).total - 1
    with pytest.raises(SystemExit) as e:
        train_lm.cli(["--config_path", path, "--dry_run", "--device_memory", str(limit),
                      "--trainer.train_batch_size", "16", "--trainer.per_device_parallelism", "auto"])
    assert e.value.code == DOES_NOT_FIT_EXIT_CODE == 3  # a script can gate a launch on the plan
    out = capsys.readouterr().out
    assert "auto finds no microbatch that fits (planned: the smallest, 1 per device)" in out
    assert "2 microbatches;" in out and "DOES NOT FIT (short by 1 B)" in out
    assert "what lowers it        model.gradient_checkpointing: true ->" in out
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()
