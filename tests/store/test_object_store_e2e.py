"""Whole runs on object stores, end to end, against the real local servers of ``tests/object_store.py``.

For S3 (moto) and GCS (the emulator), with the command-line entry points, as a user runs them (endpoints
from ``AWS_ENDPOINT_URL`` / ``STORAGE_EMULATOR_HOST``; ``train_lm`` in subprocesses, so that it can be
killed):

1. ``cache_dataset`` builds the token cache into the bucket from input files in the bucket;
2. ``train_lm`` trains from it, checkpointing into the bucket and logging ``metrics.jsonl`` there, and is
   SIGKILLed during its second checkpoint save (a fault point: on S3 after the arrays are written and
   before the commit record, on GCS between two arrays);
3. the same command again resumes from the first checkpoint and finishes.

The resumed run's losses (``metrics.jsonl`` read back from the bucket) equal, bit for bit, those of one
uninterrupted run on local disk (shared by both stores). On S3 every request goes through the fault
proxy, which answers 10 % of them with 503 and delays the others: retries change nothing in the
numbers. The model is tiny and every run shares one persistent compilation cache, so each run costs
mostly its start-up; ``cache_dataset`` runs in this process.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest

from levanter.main import cache_dataset
from levanter.utils import fs

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 12
CONFIG = """\
data:
  tokenizer: byte
  cache_dir: {cache}
  shuffle: true
  train_urls: ["{data}/train.jsonl"]
  validation_urls: ["{data}/validation.jsonl"]
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 1, seq_len: 64, gradient_checkpointing: false}}
trainer:
  mp: f32
  num_train_steps: {steps}
  train_batch_size: 8
  steps_per_eval: 1000
  max_eval_batches: 1
  require_accelerator: false
  id: e2e
  log_dir: {logs}
  tracker: [{{type: json}}]
  checkpointer: {{base_path: {ckpt}, save_interval: 10m, keep: [{{every: 4}}]}}
optimizer: {{learning_rate: 3e-3, weight_decay: 0.0, warmup: 0.05, lr_schedule: cosine}}
"""


def _write_config(path: str, data: str, cache: str, logs: str, ckpt: str) -> str:
    with open(path, "w") as f:
        f.write(CONFIG.format(data=data, cache=cache, logs=logs, ckpt=ckpt, steps=STEPS))
    return path


def _documents(seed: int, n: int) -> bytes:
    """``n`` JSON-lines documents of seeded pseudo-words (byte-level tokens: ~60k for the training set)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(300)]
    texts = (" ".join(rng.choice(words) for _ in range(rng.randint(60, 140))) for _ in range(n))
    lines = [json.dumps({"text": text}) for text in texts]
    return ("\n".join(lines) + "\n").encode()


INPUTS = {"train.jsonl": _documents(0, 80), "validation.jsonl": _documents(1, 12)}


def _env() -> dict:
    # No re-execution with huge-page malloc: it would add an interpreter start-up to every run.
    return {**os.environ, "LEVANTER_MALLOC_HUGETLB": "0"}


def _run(module: str, args: list[str], env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _check(proc: subprocess.CompletedProcess, status: int = 0) -> None:
    assert proc.returncode == status, f"exit {proc.returncode}, expected {status}:\n{proc.stderr[-5000:]}"


def _records(text: str) -> list[tuple[int, str, float]]:
    """``(step, metric, value)`` for every loss in a metrics file, in file order."""
    out = []
    for line in text.splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key == "train/loss" or key.startswith("eval/"):
                out.append((record["step"], key, value))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run on local disk: its losses, the number of arrays a checkpoint holds, and the
    compilation cache every later run shares (one run per session, whichever xdist worker gets each store)."""
    from helpers import once_per_session

    def run(tmp):
        xla = str(tmp / "xla-cache")
        for name, data in INPUTS.items():
            (tmp / name).write_bytes(data)
        cfg = _write_config(str(tmp / "local.yaml"), str(tmp), *(str(tmp / d) for d in ("cache", "logs", "ckpt")))
        proc = _run("levanter.main.train_lm", ["--config_path", cfg, "--trainer.jax_compilation_cache_dir", xla],
                    _env())
        _check(proc)
        arrays = int(re.search(r"saved checkpoint for step 4 .*\((\d+) arrays", proc.stderr).group(1))
        with open(tmp / "logs" / "e2e" / "metrics.jsonl") as f:
            records = _records(f.read())
        assert [s for s, k, _ in records if k == "train/loss"] == list(range(STEPS))
        return {"records": records, "arrays": arrays, "xla": xla}

    return once_per_session(tmp_path_factory, "e2e-local-reference", run)


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_cache_train_kill_resume_on_an_object_store(store, reference, request, fault_proxy, tmp_path):
    server = request.getfixturevalue("s3_server" if store == "s3" else "gcs_server")
    env = {**_env(), **server.env}
    proxy = None
    if store == "s3":
        proxy = fault_proxy(server, fail_fraction=0.1, delay_s=(0.002, 0.01), seed=1)
        env.update(proxy.env_for(server))
    base = server.url(f"e2e-{tmp_path.name}")
    data, cache, logs, ckpt = (fs.join(base, d) for d in ("data", "cache", "logs", "ckpt"))
    for name, payload in INPUTS.items():  # the input files are read from the bucket too
        fs.atomic_write_bytes(fs.join(data, name), payload)
    cfg = _write_config(str(tmp_path / "run.yaml"), data, cache, logs, ckpt)
    xla = ["--trainer.jax_compilation_cache_dir", reference["xla"]]

    # In this process (the servers' environment is set here too): a subprocess would add only its start-up.
    assert cache_dataset.cli(["--config_path", cfg]) is None
    ledger = json.loads(fs.read_text(fs.join(cache, "train", "shard_ledger.json")))
    assert ledger["is_finished"], ledger

    # Killed during the second checkpoint save (step 8): the save of step 4 is committed, step 8 is not.
    if store == "s3":
        kill_at = "checkpoint_before_record:2"
    else:
        n = reference["arrays"]
        kill_at = f"checkpoint_mid_write:{(n - 1) + n // 2}"
    killed = _run("levanter.main.train_lm", ["--config_path", cfg, *xla],
                  {**env, "LEVANTER_FAULT_KILL_AT": kill_at})
    _check(killed, -signal.SIGKILL)
    run = fs.join(ckpt, "e2e")
    assert fs.exists(fs.join(run, "step-4", "metadata.json"))
    assert fs.isdir(fs.join(run, "step-8")) and not fs.exists(fs.join(run, "step-8", "metadata.json"))
    # metrics.jsonl holds every step before the committed checkpoint (uploaded before each save)
    stored = _records(fs.read_text(fs.join(logs, "e2e", "metrics.jsonl")))
    steps = [s for s, k, _ in stored if k == "train/loss"]
    assert steps[:4] == [0, 1, 2, 3]

    resumed = _run("levanter.main.train_lm", ["--config_path", cfg, *xla], env)
    _check(resumed)
    assert "step-4" in resumed.stderr  # it resumed rather than starting over
    assert fs.exists(fs.join(run, f"step-{STEPS}", "metadata.json"))
    assert fs.exists(fs.join(run, "step-8", "metadata.json"))  # saved again, whole, by the resumed run
    records = _records(fs.read_text(fs.join(logs, "e2e", "metrics.jsonl")))
    assert records == reference["records"]  # bit for bit: the JSON floats are exact
    if proxy is not None:
        assert proxy.failed > 10 and proxy.forwarded > 100, (proxy.failed, proxy.forwarded)
