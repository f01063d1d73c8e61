"""Small helpers shared by several test modules (not a test module itself)."""

import os


def tree_bytes(directory):
    """``{relative path: bytes}`` of every file under ``directory`` -- for byte-for-byte comparisons."""
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, directory)] = fh.read()
    return out


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_nano_config(tmp_path, name, *, steps, batch_size, overrides=()):
    """Train ``config/<name>.yaml`` as shipped but for the run length, the paths and the training data (each
    source reads its validation split: a small cache, built in seconds), in this process. Returns
    ``(config, {step: metrics row})`` of the training steps; every step's ``train/loss`` is checked finite."""
    import json

    import numpy as np
    import yaml

    from levanter.config import parse_config
    from levanter.main import train_lm

    with open(os.path.join(REPO, "config", f"{name}.yaml")) as f:
        raw = yaml.safe_load(f)
    for source in raw["data"]["configs"].values():
        source["train_urls"] = source["validation_urls"]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = parse_config(train_lm.TrainLmConfig, str(path), [
        "--trainer.num_train_steps", str(steps), "--trainer.train_batch_size", str(batch_size),
        "--trainer.steps_per_eval", "1000", "--trainer.id", name,
        "--data.cache_dir", str(tmp_path / "cache"), "--trainer.log_dir", str(tmp_path / "logs"),
        "--trainer.checkpointer.base_path", str(tmp_path / "ckpt"), *overrides,
    ])
    assert train_lm.main(cfg)["final_step"] == steps
    with open(tmp_path / "logs" / name / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_step = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(by_step) == list(range(steps)), sorted(by_step)
    assert np.isfinite([r["train/loss"] for r in by_step.values()]).all(), by_step
    return cfg, by_step


def loss_fall(by_step, last=5):
    """How far the mean train loss of the last ``last`` steps lies below the first step's."""
    steps = sorted(by_step)
    return by_step[steps[0]]["train/loss"] - sum(by_step[s]["train/loss"] for s in steps[-last:]) / last


def once_per_session(tmp_path_factory, name, make):
    """``make(directory)``'s value, computed once per test session, also under pytest-xdist: a module-scoped
    fixture would run once per worker that collects a test of the module, and the slow tests' references
    are whole training runs. The first worker to ask runs ``make`` in a new directory of the session's
    temporary root (shared by the workers), under a file lock, and pickles the value there; the others
    wait for the lock and read it. A failed ``make`` leaves nothing, so the next asker tries afresh."""
    import fcntl
    import pickle
    import tempfile

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, above each worker's popen-gwK/
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / f"{name}.pickle"
        if done.exists():
            return pickle.loads(done.read_bytes())
        value = make(type(root)(tempfile.mkdtemp(prefix=f"{name}-", dir=root)))
        done.write_bytes(pickle.dumps(value))
        return value


def _xla_size(n: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n}B"


class RefusingCompiler:
    """What :func:`compiler_refuses_above` installed: ``capacity`` (bytes; may be changed between compiles)
    and ``refused``, the totals it refused, in order."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.refused: list = []


def compiler_refuses_above(monkeypatch, capacity: int, *, only: str = "jit_flat") -> RefusingCompiler:
    """Make XLA's compiler behave as XLA:TPU's does for a device of ``capacity`` bytes: a program named
    ``only`` (the train step) whose buffers need more is refused at compile time with the TPU compiler's
    message (libtpu 0.0.42: "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
    temporaries (X) exceeds available HBM (Y)." where X counts the arguments and outputs too). The figure is
    the CPU compile's own (arguments + outputs - aliased + temporaries), so what fits and what does not is
    decided by the program, not by the test."""
    import jax
    from jax._src import compiler

    real = compiler.compile_or_get_cached  # above the persistent compilation cache
    fake = RefusingCompiler(capacity)

    def compile_(backend, module, *args, **kwargs):
        executable = real(backend, module, *args, **kwargs)
        if only in str(module.operation.attributes["sym_name"]):
            s = executable.get_compiled_memory_stats()
            total = (s.argument_size_in_bytes + s.output_size_in_bytes - s.alias_size_in_bytes
                     + s.temp_size_in_bytes)
            if total > fake.capacity:
                fake.refused.append(total)
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                    f"temporaries ({_xla_size(total)}) exceeds available HBM ({_xla_size(fake.capacity)}).")
        return executable

    monkeypatch.setattr(compiler, "compile_or_get_cached", compile_)
    return fake
