"""scripts/launch_tpu.py against a fake ``gcloud``, and a syntax check of scripts/slurm/train_lm.sbatch.

The fake ``gcloud`` (written into tmp_path and put first on the launcher's PATH) appends each argv as a
JSON line to a log and keeps the TPU's state in a JSON file, so a test can assert the exact sequence of
gcloud calls the launcher made -- including a simulated preemption -- without any network. The launcher
runs as a subprocess, as a user runs it, so its stdout/stderr are exactly what a user would see.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "launch_tpu.py"
SBATCH = REPO / "scripts" / "slurm" / "train_lm.sbatch"
SECRET = "supersecret"

FAKE_GCLOUD = r'''#!{python}
"""Fake gcloud: log argv, simulate one TPU VM. Scenario (FAKE_GCLOUD_SCENARIO):
preempt        first training run: a worker prints status 75 and the TPU becomes PREEMPTED (gcloud exits 1)
sigterm        first training run exits 75 but the TPU stays READY
always_preempt every training run is preempted
fail           every training run fails with status 3 (a bug, not a preemption)
disconnect     first training run: the ssh session drops (exit 255) before any worker reports; TPU READY
"""
import json, os, re, sys

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
state_path = os.environ["FAKE_GCLOUD_STATE"]
if os.path.exists(state_path):
    st = json.load(open(state_path))
else:
    st = {{"tpu": os.environ.get("FAKE_GCLOUD_INITIAL", "NOT_FOUND"), "runs": 0}}
scenario = os.environ.get("FAKE_GCLOUD_SCENARIO", "preempt")

def save():
    json.dump(st, open(state_path, "w"))

verb = args[3] if args[:3] == ["compute", "tpus", "tpu-vm"] else None
if verb == "describe":
    if st["tpu"] == "NOT_FOUND":
        err = ("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: "
               "Resource 'nodes/" + args[4] + "' was not found")
        print(err, file=sys.stderr)
        sys.exit(1)
    print(st["tpu"])
elif verb == "create":
    st["tpu"] = "READY"; save()
    print(f"Create request issued for: [{{args[4]}}]", file=sys.stderr)
elif verb == "delete":
    st["tpu"] = "NOT_FOUND"; save()
    print(f"Deleted tpu [{{args[4]}}].", file=sys.stderr)
elif verb == "ssh":
    command = args[args.index("--command") + 1]
    if "levanter.main.train_lm" not in command:
        print("worker 0: setup ok"); print("worker 1: setup ok")
        sys.exit(0)
    st["runs"] += 1; save()
    # A worker that dumps its environment: the launcher must scrub the secret from what it prints.
    m = re.search(r"WANDB_API_KEY=(\S+)", command)
    print("worker env: WANDB_API_KEY=" + (m.group(1) if m else "<unset>"))
    print(f"step {{st['runs']}}: loss 5.3", flush=True)
    first = st["runs"] == 1
    if scenario == "disconnect" and first:
        sys.exit(255)
    if scenario == "fail":
        print("LEVANTER_EXIT_STATUS=3 host=w0"); sys.exit(3)
    if (scenario in ("preempt", "sigterm") and first) or scenario == "always_preempt":
        print("LEVANTER_EXIT_STATUS=75 host=w0"); print("LEVANTER_EXIT_STATUS=75 host=w1")
        if scenario != "sigterm":
            st["tpu"] = "PREEMPTED"; save()
        sys.exit(1)  # gcloud --worker=all does not pass the trainer's 75 through; the markers do
    print("LEVANTER_EXIT_STATUS=0 host=w0"); print("LEVANTER_EXIT_STATUS=0 host=w1")
else:
    print(f"fake gcloud: unexpected call {{args}}", file=sys.stderr)
    sys.exit(2)
'''

BASE_CONFIG = """\
project: proj
zone: us-west4-a
tpu_type: v5litepod-16
tpu_name: test-tpu
runtime_version: v2-alpha-tpuv5-lite
spot: true
setup:
  mode: venv
  repo_dir: levanter
  repo_url: https://example.invalid/levanter.git
  git_ref: main
env:
  WANDB_PROJECT: levanter
env_from_host: [WANDB_API_KEY]
poll_seconds: 0
"""

# A value with spaces (two in a row) and a quote: it must reach train_lm intact.
TRAIN_ARGS = ["--config_path", "config/my  run's.yaml", "--trainer.num_train_steps", "1000"]


@pytest.fixture
def fake(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    gcloud = bindir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(0o755)
    config = tmp_path / "launch.yaml"
    config.write_text(BASE_CONFIG + f"log_dir: {tmp_path / 'launch-logs'}\n")
    log = tmp_path / "gcloud-calls.jsonl"

    def run(*launcher_args, scenario="preempt", initial="NOT_FOUND", config_text=None, path=None,
            extra_env=None):
        if config_text is not None:
            config.write_text(config_text)
        env = dict(os.environ)
        env.update(
            PATH=path if path is not None else f"{bindir}{os.pathsep}{env.get('PATH', '')}",
            WANDB_API_KEY=SECRET,
            FAKE_GCLOUD_LOG=str(log),
            FAKE_GCLOUD_STATE=str(tmp_path / "tpu-state.json"),
            FAKE_GCLOUD_SCENARIO=scenario,
            FAKE_GCLOUD_INITIAL=initial,
            **(extra_env or {}),
        )
        p = subprocess.run(
            [sys.executable, str(LAUNCHER), "--config", str(config), *launcher_args],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return p, calls

    run.tmp_path = tmp_path
    return run


def _kind(call):
    """A short name for one gcloud call: describe / create / delete / setup / run."""
    verb = call[3]
    if verb == "ssh":
        return "run" if "levanter.main.train_lm" in call[call.index("--command") + 1] else "setup"
    return verb


def _remote_tokens(call):
    command = call[call.index("--command") + 1]
    # The remote command must be valid shell, with every value quoted.
    subprocess.run(["bash", "-n", "-c", command], check=True)
    # punctuation_chars: ';' and '&&' become tokens of their own
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _trainer_id(call):
    tokens = _remote_tokens(call)
    return tokens[tokens.index("--trainer.id") + 1]


def test_preemption_is_relaunched_with_the_same_trainer_id(fake):
    p, calls = fake("--retries", "2", "--", *TRAIN_ARGS)
    assert p.returncode == 0, p.stdout + p.stderr

    assert [_kind(c) for c in calls] == [
        "describe",  # NOT_FOUND
        "create",
        "describe",  # READY
        "setup",
        "run",  # a worker exits 75 (checkpointed after SIGTERM) ...
        "describe",  # ... and the TPU is PREEMPTED
        "delete",
        "create",
        "describe",  # READY
        "setup",
        "run",  # same --trainer.id: resumes from the latest checkpoint
    ]
    where = ["test-tpu", "--project", "proj", "--zone", "us-west4-a"]
    assert calls[0] == ["compute", "tpus", "tpu-vm", "describe", *where, "--format=value(state)"]
    assert calls[1] == [
        "compute", "tpus", "tpu-vm", "create", *where,
        "--accelerator-type", "v5litepod-16", "--version", "v2-alpha-tpuv5-lite", "--spot", "--quiet",
    ]
    assert calls[6] == ["compute", "tpus", "tpu-vm", "delete", *where, "--quiet"]
    for c in calls:
        if c[3] == "ssh":
            ssh = ["compute", "tpus", "tpu-vm", "ssh", *where, "--worker=all", "--quiet"]
            assert c[:c.index("--command")] == ssh

    runs = [c for c in calls if _kind(c) == "run"]
    first_id, second_id = _trainer_id(runs[0]), _trainer_id(runs[1])
    assert first_id == second_id and first_id.startswith("test-tpu-")
    tokens = _remote_tokens(runs[0])
    assert runs[0] == runs[1]  # the relaunch is the very same command
    # train_lm's arguments arrive intact (the one with a space included), followed by the pinned id.
    py = tokens.index(".venv/bin/python")
    assert tokens[py:py + 3] == [".venv/bin/python", "-m", "levanter.main.train_lm"]
    n = len(TRAIN_ARGS) + 2
    assert tokens[py + 3:py + 3 + n + 1] == TRAIN_ARGS + ["--trainer.id", first_id, ";"]
    # The secret reaches the workers as an environment assignment on the training command...
    assert f"WANDB_API_KEY={SECRET}" in tokens[:py] and "WANDB_PROJECT=levanter" in tokens[:py]
    setup_tokens = _remote_tokens(calls[3])
    assert "git clone" in calls[3][-1] and ".venv/bin/pip" in calls[3][-1] and SECRET not in calls[3][-1]
    assert setup_tokens[:2] == ["set", "-euo"]

    # ... but never shows up in anything the launcher prints or logs: there it is ***.
    logs = list((fake.tmp_path / "launch-logs").glob("test-tpu-*.log"))
    assert len(logs) == 1
    assert SECRET not in p.stdout + p.stderr + logs[0].read_text()
    assert "WANDB_API_KEY=***" in p.stdout and "WANDB_API_KEY=***" in logs[0].read_text()
    # The worker's dump of its environment was scrubbed too, and streamed lines carry a prefix.
    assert "[test-tpu run 1/3] worker env: WANDB_API_KEY=***" in p.stdout
    assert "[test-tpu run 2/3] step 2: loss 5.3" in p.stdout
    assert "preempted" in p.stdout and f"trainer.id {first_id}" in p.stdout


def test_sigterm_exit_on_a_healthy_tpu_relaunches_without_recreating(fake):
    p, calls = fake("--retries", "1", "--", *TRAIN_ARGS, "--trainer.id", "my-run",
                    scenario="sigterm", initial="READY")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [_kind(c) for c in calls] == ["describe", "setup", "run", "describe", "setup", "run"]
    runs = [c for c in calls if _kind(c) == "run"]
    assert [_trainer_id(c) for c in runs] == ["my-run", "my-run"]
    assert _remote_tokens(runs[0]).count("--trainer.id") == 1  # the user's id, not a second one


def test_lost_ssh_connection_is_relaunched(fake):
    p, calls = fake("--retries", "1", "--", *TRAIN_ARGS, scenario="disconnect", initial="READY")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [_kind(c) for c in calls] == ["describe", "setup", "run", "describe", "setup", "run"]
    assert "before any worker reported a status" in p.stdout


def test_other_failures_are_not_retried(fake):
    p, calls = fake("--retries", "3", "--", *TRAIN_ARGS, scenario="fail", initial="READY")
    assert p.returncode == 3
    assert [_kind(c) for c in calls] == ["describe", "setup", "run", "describe"]
    assert "not a preemption" in p.stdout


def test_retries_exhausted_exits_75(fake):
    p, calls = fake("--retries", "1", "--", *TRAIN_ARGS, scenario="always_preempt")
    assert p.returncode == 75
    assert [_kind(c) for c in calls].count("run") == 2
    assert "no retries left" in p.stdout


def test_dry_run_prints_everything_and_runs_nothing(fake):
    p, calls = fake("--dry-run", "--retries", "2", "--", *TRAIN_ARGS)
    assert p.returncode == 0, p.stderr
    assert calls == []  # the fake gcloud was on PATH and never called
    assert not (fake.tmp_path / "launch-logs").exists()
    commands = [line for line in p.stdout.splitlines() if line.startswith("$ gcloud ")]
    kinds = [_kind(shlex.split(line[2:].split("   #")[0])[1:]) for line in commands]
    assert kinds == ["describe", "create", "describe", "setup", "run",
                     "describe", "delete", "create", "describe", "setup", "run"]
    assert SECRET not in p.stdout + p.stderr
    assert "WANDB_API_KEY=*** " in p.stdout
    run_ids = set(re.findall(r"--trainer.id (\S+?);", p.stdout))
    assert len(run_ids) == 1


def test_dry_run_queued_resource(fake):
    config = BASE_CONFIG + "queued: true\n"
    p, calls = fake("--dry-run", "--", *TRAIN_ARGS, config_text=config)
    assert p.returncode == 0, p.stderr
    assert calls == []
    commands = [shlex.split(line[2:]) for line in p.stdout.splitlines() if line.startswith("$ ")]
    creates = [c for c in commands if "create" in c]
    assert creates == [[
        "gcloud", "alpha", "compute", "tpus", "queued-resources", "create", "test-tpu",
        "--project", "proj", "--zone", "us-west4-a", "--node-id", "test-tpu",
        "--accelerator-type", "v5litepod-16", "--runtime-version", "v2-alpha-tpuv5-lite", "--spot", "--quiet",
    ]]
    assert "--format=value(state.state)" in p.stdout


def test_config_errors_name_the_problem(fake):
    p, calls = fake("--", *TRAIN_ARGS, config_text=BASE_CONFIG.replace("zone: us-west4-a\n", ""))
    assert p.returncode == 2 and calls == []
    assert "missing required field(s) 'zone'" in p.stderr and "Traceback" not in p.stderr

    p, _ = fake("--", *TRAIN_ARGS, config_text=BASE_CONFIG + "zones: typo\n")
    assert p.returncode == 2 and "unknown field(s) 'zones'" in p.stderr

    p, _ = fake("--", *TRAIN_ARGS, config_text=BASE_CONFIG.replace("mode: venv", "mode: docker"))
    assert p.returncode == 2 and "setup.docker_image" in p.stderr

    p, _ = fake("--", *TRAIN_ARGS, config_text=BASE_CONFIG, extra_env={"LEVANTER_LAUNCH_RETRIES": "many"})
    assert p.returncode == 2 and "retries" in p.stderr


def test_missing_config_file_and_missing_gcloud(fake, tmp_path):
    p = subprocess.run(
        [sys.executable, str(LAUNCHER), "--config", str(tmp_path / "nope.yaml"), "--", *TRAIN_ARGS],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 2 and "launch config file not found" in p.stderr and "nope.yaml" in p.stderr

    empty = tmp_path / "empty-bin"
    empty.mkdir()
    p, calls = fake("--", *TRAIN_ARGS, path=str(empty))
    assert p.returncode == 2 and "gcloud not found on PATH" in p.stderr


def test_env_overrides_and_docker_mode(fake):
    image = "us-west4-docker.pkg.dev/proj/levanter/levanter:latest"
    config = BASE_CONFIG.replace("  mode: venv\n", f"  mode: docker\n  docker_image: {image}\n")
    p, _ = fake("--dry-run", "--", *TRAIN_ARGS, config_text=config,
                extra_env={"LEVANTER_LAUNCH_TPU_NAME": "other-tpu"})
    assert p.returncode == 0, p.stderr
    assert "tpu-vm create other-tpu" in p.stdout and "test-tpu" not in p.stdout
    assert f"sudo docker pull {image}" in p.stdout and "configure-docker us-west4-docker.pkg.dev" in p.stdout
    assert "-e WANDB_API_KEY=*** " in p.stdout and SECRET not in p.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for needle in ("#SBATCH --requeue", "#SBATCH --signal=TERM@120", "scontrol requeue",
                   "scontrol show hostnames", "srun", "levanter.main.train_lm"):
        assert needle in text
