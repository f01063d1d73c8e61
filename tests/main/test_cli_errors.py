"""Bad inputs that need a command of their own process: a Ray that will not start (Ray keeps per-process
state, so it cannot fail inside the test process), and a run whose debug log sits on a full disk (the
debug log is opened only by a command's ``__main__``). Each runs ``python -m levanter.main.X`` for real and
checks the exit status, that stderr holds exactly one ``error:`` paragraph naming the key or file, and no
traceback. ``docs/reference/errors.md`` lists them with the catalogue (tests/main/test_bad_inputs.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pythonpath() -> str:
    """The repository's src/ first, then what this process's PYTHONPATH adds (an install outside
    site-packages, as on a TPU host)."""
    return os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)


def run(module: str, args: list, cwd: Path, env: dict | None = None, timeout: float = 240) -> tuple[int, str]:
    full_env = {**os.environ, "PYTHONPATH": pythonpath(), **(env or {})}
    p = subprocess.run([sys.executable, "-m", f"levanter.main.{module}", *args], cwd=cwd, env=full_env,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


def one_error(stderr: str) -> str:
    """The single ``error:`` paragraph of ``stderr`` (asserting there is one, and no traceback)."""
    assert "Traceback" not in stderr, stderr
    starts = [m.start() for m in re.finditer(r"(?m)^error: ", stderr)]
    assert len(starts) == 1, f"expected exactly one 'error:' line in stderr:\n{stderr}"
    message = stderr[starts[0]:].rstrip("\n")
    assert len(message.splitlines()) == 1, message
    return message


def data_only(tmp: Path, cache: str = "cache") -> Path:
    (tmp / "data.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)))
    cfg = tmp / "data.yaml"
    cfg.write_text(f"train_urls: [{tmp / 'data.jsonl'}]\ntokenizer: byte\ncache_dir: {tmp / cache}\n")
    return cfg


# -- Ray ------------------------------------------------------------------------------------------------------
def test_ray_local_start_fails(tmp_path):
    """``ray-local-start-fails``: ``RAY_TMPDIR`` under a regular file, so Ray cannot create its session
    directory, for real."""
    pytest.importorskip("ray")
    cfg = data_only(tmp_path)
    (tmp_path / "afile").write_text("x")
    status, stderr = run("cache_dataset", ["--config_path", str(cfg), "--backend", "ray"], tmp_path,
                         env={"RAY_TMPDIR": str(tmp_path / "afile" / "ray")})
    message = one_error(stderr)
    assert status == 2, stderr
    assert "cache_options.backend" in message and "could not start a local Ray instance" in message, message
    assert str(tmp_path / "afile") in message and "cache_options.backend: process" in message, message


def test_ray_address_refuses(tmp_path):
    """``ray-address-refuses``: ``--ray_address`` at a closed port of this machine, refused at once, not
    after Ray's minutes of retries."""
    pytest.importorskip("ray")
    cfg = data_only(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the socket is
    status, stderr = run("cache_dataset", ["--config_path", str(cfg), "--backend", "ray", "--ray_address",
                                           f"127.0.0.1:{port}"], tmp_path, timeout=60)
    message = one_error(stderr)
    assert status == 2, stderr
    assert f"cache_options.ray_address: cannot join the Ray cluster at '127.0.0.1:{port}'" in message, message
    assert "cache_options.backend: process" in message, message


# -- a debug log on a full disk -------------------------------------------------------------------------------
TRAIN = """\
data: {{train_urls: [{data}], tokenizer: byte, cache_dir: {cache}, cache_options: {{num_workers: 2, batch_size: 16}}}}
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 1, seq_len: 32, gradient_checkpointing: false}}
trainer:
  num_train_steps: 2
  train_batch_size: 8
  require_accelerator: false
  id: bad
  log_dir: {logs}
  tracker: {{type: json}}
  checkpointer: {{base_path: {ckpt}}}
"""


def full_debug_log(logs: Path) -> None:
    """The run's debug.log on a full disk: writes to /dev/full fail with the kernel's ENOSPC."""
    (logs / "bad").mkdir(parents=True)
    os.symlink("/dev/full", logs / "bad" / "debug.log")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_debug_log_on_a_full_disk_prints_only_the_error(tmp_path):
    """``debug-log-disk-full``: a bad input line found while building the cache, with the debug log's disk
    full: only the ``error:`` of the bad line, not logging's "--- Logging error ---" traceback for every
    record."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n{"text": broken\n')
    full_debug_log(tmp_path / "logs")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(TRAIN.format(data=data, cache=tmp_path / "cache", logs=tmp_path / "logs", ckpt=tmp_path / "ckpt"))
    status, stderr = run("train_lm", ["--config_path", str(cfg)], tmp_path,
                         env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    message = one_error(stderr)
    assert status == 2 and f"{data}, line 2: not valid JSON" in message, stderr


def _tmpfs_shell() -> list | None:
    """A command prefix that runs a shell in a private mount namespace where a tmpfs can be mounted
    (``unshare -rm``: no root needed where user namespaces are allowed), or None."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return ["unshare", "-rm", "sh", "-c"] if probe.returncode == 0 else None


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_during_a_build_prints_only_the_exit_74_message(tmp_path):
    """``debug-log-disk-full``: a cache build into a real 1 MiB tmpfs that fills up, twice (the traceback
    came in one run out of two), with the debug log on a full disk too: exit 74 and the one out-of-space
    message, no traceback."""
    shell = _tmpfs_shell()
    if shell is None:
        pytest.skip("cannot mount a tmpfs here (no unprivileged user namespaces)")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i} " + "words " * 150}) + "\n" for i in range(3000)))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    full_debug_log(tmp_path / "logs")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(TRAIN.format(data=data, cache=mnt / "cache", logs=tmp_path / "logs", ckpt=tmp_path / "ckpt"))
    env = {**os.environ, "PYTHONPATH": pythonpath(), "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    for _ in range(2):
        script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && "
                  f"exec {sys.executable} -m levanter.main.train_lm --config_path {cfg}")
        p = subprocess.run([*shell, script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        message = one_error(p.stderr)
        assert p.returncode == 74, p.stderr
        assert f"out of disk space while building the token cache at {mnt / 'cache' / 'train'}" in message, message
