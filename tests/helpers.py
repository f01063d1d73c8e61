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
