#!/usr/bin/env python3
"""Launch ``levanter.main.train_lm`` on every worker of a Cloud TPU VM slice and relaunch it after preemption.

    python scripts/launch_tpu.py --config scripts/launch.example.yaml [--dry-run] [--retries N] \\
        -- --config_path config/gpt2_small_openwebtext.yaml --trainer.num_train_steps 1000

Everything after ``--`` is passed to ``train_lm`` unchanged. The launcher drives ``gcloud`` only:

1. ``describe`` the TPU VM (or queued resource); create it if it does not exist, delete and recreate it
   if it was preempted; poll until it is READY (ACTIVE for a queued resource).
2. Set up every worker (``ssh --worker=all``): in ``venv`` mode clone / check out the repo and run the
   ``venv_setup`` commands; in ``docker`` mode pull the image.
3. Run the training command on every worker (``ssh --worker=all``) and stream its output line by line,
   each line prefixed with the TPU name and attempt number, to stdout and to a log file in ``log_dir``.
4. If the run failed because of preemption -- a worker reported exit status 75 (the trainer
   checkpointed after SIGTERM) or the TPU is no longer READY -- and ``--retries`` allows, go back to 1.
   The relaunch uses the same ``--trainer.id``, so the trainer resumes from its latest complete
   checkpoint; nothing else is needed to resume. A lost ssh connection (gcloud failed, no worker reported
   a status) is treated the same way. A worker that reports any other failure is not retried: a
   deterministic bug would fail again, and burning TPU hours on it helps nobody.

Design choices and their trade-offs:

* **One pinned run id.** The launcher always passes ``--trainer.id``: the one given after ``--``, else
  ``trainer_id`` from the launch YAML, else ``trainer.id`` from the training config if that file is
  readable locally, else one generated once per launcher invocation (printed, so that a later
  invocation can reuse it). Without a pinned id every relaunch would start a fresh run.
* **Exit status by marker line.** The remote command ends with ``echo LEVANTER_EXIT_STATUS=<rc>`` on
  each worker, and the launcher reads those lines, because ``gcloud ... ssh --worker=all`` fans out to
  many ssh sessions and its own exit status does not reliably carry the trainer's (75 vs 1 vs 255).
* **Secrets** (``env_from_host``) are read from the launcher's own environment and handed to the
  workers as ``NAME=value`` assignments inside the remote command. Every command the launcher prints
  or logs is built a second time with ``***`` in place of each secret, and every streamed output line
  is scrubbed of secret values. The price of the simple transport: while ``gcloud`` runs, the value is
  in its argv (visible to ``ps`` on the launching machine) and in the remote shell's command line. A
  secret-manager fetch on the workers avoids that, at the cost of IAM set-up; not done here.
* **No shell locally.** Every local command is an argument list. The remote ``--command`` string is
  a script for the worker's login shell (bash on TPU VM images); every value interpolated into it
  (paths, training arguments, env values) is quoted with ``shlex.quote``.
* Setup runs again before every attempt: it is idempotent and cheap next to a TPU start, and a
  recreated VM needs it anyway.

The launcher needs only Python and PyYAML (it does not import levanter or JAX), plus ``gcloud`` on PATH
for real runs (``--dry-run`` runs nothing and does not need it). Configuration comes from the YAML file;
any top-level scalar field can also be set (or overridden) by an environment variable
``LEVANTER_LAUNCH_<FIELD>``, e.g. ``LEVANTER_LAUNCH_TPU_NAME=my-tpu``, handy in CI.

Exit status: 0 on success; 2 for a configuration error; 1 when launching fails (gcloud error);
75 when the run was still preempted after the last retry; otherwise the training command's status.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

# levanter.training.PREEMPTED_EXIT_CODE, repeated so the launcher runs on a laptop without JAX installed.
PREEMPTED_EXIT_CODE = 75
EXIT_MARKER = "LEVANTER_EXIT_STATUS"
_MARKER_RE = re.compile(EXIT_MARKER + r"=(\d+)")
REDACTED = "***"
ENV_OVERRIDE_PREFIX = "LEVANTER_LAUNCH_"
NOT_FOUND = "NOT_FOUND"
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# TPU VM states (``gcloud compute tpus tpu-vm describe``): READY runs; these two never come back by
# themselves, the VM must be deleted and recreated.
TPU_READY = "READY"
TPU_LOST = {"PREEMPTED", "TERMINATED"}
# Queued resource states: ACTIVE means the node exists; a preempted spot node leaves its queued resource
# SUSPENDED, which cannot be resumed, only deleted (with --force, taking the node along) and recreated.
QR_READY = "ACTIVE"
QR_LOST = {"SUSPENDING", "SUSPENDED", "FAILED"}


class LaunchError(Exception):
    """A user-facing error, printed as one line without a traceback."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class ConfigError(LaunchError):
    def __init__(self, message: str):
        super().__init__(message, exit_code=2)


class Preempted(Exception):
    """The TPU went away (or a worker reported status 75): relaunch if retries allow."""

    def __init__(self, reason: str, state: Optional[str] = None):
        super().__init__(reason)
        self.state = state  # the last observed TPU state, so the relaunch need not describe it again


# -- configuration ---------------------------------------------------------------------------------------

DEFAULT_VENV_SETUP = [
    "python3 -m venv .venv",
    ".venv/bin/pip install -q -U pip",
    '.venv/bin/pip install -q -e ".[tpu]"',  # double quotes: the script travels inside single quotes
]


@dataclasses.dataclass
class SetupConfig:
    mode: str = "venv"  # venv | docker
    # venv mode: where the repo lives on each worker (relative to the ssh user's home directory, or
    # starting with ~/), where to clone it from if it is missing, and which commit / tag / branch to use.
    repo_dir: str = "levanter"
    repo_url: Optional[str] = None
    git_ref: Optional[str] = None
    venv_setup: List[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_VENV_SETUP))
    # The interpreter that runs train_lm: default .venv/bin/python (venv) or python (docker).
    python: Optional[str] = None
    # docker mode
    docker_image: Optional[str] = None
    docker_args: List[str] = dataclasses.field(default_factory=list)  # extra `docker run` arguments


@dataclasses.dataclass
class LaunchConfig:
    project: str
    zone: str
    tpu_type: str
    tpu_name: str
    runtime_version: str
    queued: bool = False
    spot: bool = False
    preemptible: bool = False
    setup: SetupConfig = dataclasses.field(default_factory=SetupConfig)
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    env_from_host: List[str] = dataclasses.field(default_factory=list)
    retries: int = 0
    log_dir: str = "logs/launch"
    trainer_id: Optional[str] = None
    poll_seconds: float = 30.0
    # 0: wait for READY as long as it takes (a queued resource can wait hours for capacity)
    wait_timeout_minutes: float = 0.0


_REQUIRED = [
    f.name
    for f in dataclasses.fields(LaunchConfig)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]
_SCALAR_KINDS = {
    "queued": bool, "spot": bool, "preemptible": bool,
    "retries": int, "poll_seconds": float, "wait_timeout_minutes": float,
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(where: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind``; strings are accepted for every kind because env overrides are strings."""
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if kind in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            out = kind(value)
        except (TypeError, ValueError):
            expected = "an integer" if kind is int else "a number"
            raise ConfigError(f"{where}: expected {expected}, got {value!r}") from None
        if out < 0:
            raise ConfigError(f"{where}: must be >= 0, got {value!r}")
        return out
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{where}: expected a single value, got {type(value).__name__}")
    if isinstance(value, bool):  # YAML `true` for a string field: write it the way the shell would
        return "true" if value else "false"
    return str(value)


def _string_list(where: str, value: Any) -> List[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
    return [_coerce(f"{where}[{i}]", v, str) for i, v in enumerate(value)]


def load_config(path: Optional[str], environ: Optional[Dict[str, str]] = None) -> LaunchConfig:
    """Read the launch YAML (if given), apply ``LEVANTER_LAUNCH_*`` overrides and validate everything."""
    environ = os.environ if environ is None else environ
    where = path or "launch config"
    raw: Dict[str, Any] = {}
    if path is not None:
        try:
            import yaml
        except ImportError:
            raise ConfigError("PyYAML is needed to read the launch config: pip install pyyaml") from None
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"launch config file not found: {path}")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: malformed YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")

    top = {f.name: f for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(set(raw) - set(top))
    if unknown:  # a typo ('zones:') must not silently fall back to a default
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; known fields: {', '.join(top)}"
        )

    scalars = [n for n in top if n not in ("setup", "env", "env_from_host")]
    for name in scalars:
        env_name = ENV_OVERRIDE_PREFIX + name.upper()
        if environ.get(env_name, "") != "":
            raw[name] = environ[env_name]

    missing = [n for n in _REQUIRED if raw.get(n) in (None, "")]
    if missing:
        raise ConfigError(
            f"{where}: missing required field(s) {', '.join(map(repr, missing))} "
            f"(set them in the YAML or as {ENV_OVERRIDE_PREFIX}<FIELD> environment variables)"
        )

    kw: Dict[str, Any] = {}
    for name in scalars:
        if name in raw:
            value = _coerce(f"{where}: {name}", raw[name], _SCALAR_KINDS.get(name, str))
            if value is not None:
                kw[name] = value

    env = raw.get("env") or {}
    if not isinstance(env, dict):
        raise ConfigError(f"{where}: env: expected a mapping NAME: value, got {type(env).__name__}")
    kw["env"] = {str(k): _coerce(f"{where}: env.{k}", v, str) or "" for k, v in env.items()}
    kw["env_from_host"] = _string_list(f"{where}: env_from_host", raw.get("env_from_host"))
    for name in list(kw["env"]) + kw["env_from_host"]:
        if not _ENV_NAME_RE.match(name):  # names go unquoted into the remote shell
            raise ConfigError(f"{where}: {name!r} is not a valid environment variable name")
    both = set(kw["env"]) & set(kw["env_from_host"])
    if both:
        raise ConfigError(f"{where}: {', '.join(sorted(both))} in both env and env_from_host; keep one")

    kw["setup"] = _load_setup(where, raw.get("setup"))
    cfg = LaunchConfig(**kw)
    if cfg.spot and cfg.preemptible:
        raise ConfigError(f"{where}: set spot or preemptible, not both")
    if cfg.queued and cfg.preemptible:
        raise ConfigError(f"{where}: queued resources have no 'preemptible' option; use spot: true")
    return cfg


def _load_setup(where: str, raw: Any) -> SetupConfig:
    if raw is None:
        return SetupConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: setup: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(SetupConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"{where}: setup: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    kw: Dict[str, Any] = {}
    for name in ("mode", "repo_dir", "repo_url", "git_ref", "python", "docker_image"):
        if raw.get(name) is not None:
            kw[name] = _coerce(f"{where}: setup.{name}", raw[name], str)
    if "venv_setup" in raw:
        kw["venv_setup"] = _string_list(f"{where}: setup.venv_setup", raw["venv_setup"])
    if "docker_args" in raw:
        kw["docker_args"] = _string_list(f"{where}: setup.docker_args", raw["docker_args"])
    s = SetupConfig(**kw)
    if s.mode not in ("venv", "docker"):
        raise ConfigError(f"{where}: setup.mode must be 'venv' or 'docker', got {s.mode!r}")
    if s.mode == "docker" and not s.docker_image:
        raise ConfigError(f"{where}: missing required field 'setup.docker_image' (setup.mode is docker)")
    if not s.repo_dir:
        raise ConfigError(f"{where}: setup.repo_dir must not be empty")
    return s


# -- the run id ------------------------------------------------------------------------------------------


def _flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in ``args`` (``--flag v`` or ``--flag=v``; the last one wins, as in argparse)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
    return value


def _trainer_id_in_train_config(train_args: Sequence[str]) -> Optional[str]:
    """``trainer.id`` of the training config if it is readable here (best effort: it lives on the workers)."""
    path = _flag_value(train_args, "--config_path")
    if not path or not Path(path).is_file():
        return None
    try:
        import yaml

        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        tid = (data.get("trainer") or {}).get("id")
    except Exception:  # noqa: BLE001 -- a guess only; the worker parses the config for real
        return None
    return str(tid) if tid else None


def resolve_trainer_id(
    cfg: LaunchConfig, train_args: Sequence[str], now: Optional[datetime.datetime] = None
) -> Tuple[str, str]:
    """(run id, where it came from). Fixed once per launcher invocation and reused by every relaunch."""
    given = _flag_value(train_args, "--trainer.id")
    if given:
        return given, "--trainer.id"
    if cfg.trainer_id:
        return cfg.trainer_id, "trainer_id in the launch config"
    from_config = _trainer_id_in_train_config(train_args)
    if from_config:
        return from_config, "trainer.id in the training config"
    now = now or datetime.datetime.now()
    return f"{cfg.tpu_name}-{now:%Y%m%d-%H%M%S}", "generated"


def with_trainer_id(train_args: Sequence[str], run_id: str) -> List[str]:
    if _flag_value(train_args, "--trainer.id"):
        return list(train_args)
    return list(train_args) + ["--trainer.id", run_id]


# -- commands --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Command:
    argv: List[str]  # what runs
    shown: List[str]  # what is printed and logged: the same with every secret replaced by ***

    def display(self) -> str:
        return "$ " + shlex.join(self.shown)


def _q_value(value: str) -> str:
    # The redacted placeholder stays bare: the shown command is for reading, and quoting it would bury
    # it under layers of '"'"' once the whole --command string is quoted for display.
    return value if value == REDACTED else shlex.quote(value)


def _q_path(path: str) -> str:
    """Quote a remote path, keeping a leading ~/ expandable (quoting would make it literal)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


class Commands:
    """Builds every gcloud command line. Pure: no I/O, so --dry-run and the real run print the same thing."""

    def __init__(self, cfg: LaunchConfig, train_args: Sequence[str], secrets: Dict[str, str]):
        self.cfg = cfg
        self.train_args = list(train_args)
        self.secrets = secrets

    def _where(self) -> List[str]:
        return ["--project", self.cfg.project, "--zone", self.cfg.zone]

    def _plain(self, argv: List[str]) -> Command:
        return Command(argv, list(argv))

    def _tpu(self, verb: str, *extra: str) -> List[str]:
        return ["gcloud", "compute", "tpus", "tpu-vm", verb, self.cfg.tpu_name, *self._where(), *extra]

    def _qr(self, verb: str, *extra: str) -> List[str]:
        qr = ["gcloud", "alpha", "compute", "tpus", "queued-resources"]
        return [*qr, verb, self.cfg.tpu_name, *self._where(), *extra]

    # TPU VM lifecycle
    def describe(self) -> Command:
        if self.cfg.queued:
            return self._plain(self._qr("describe", "--format=value(state.state)"))
        return self.describe_node()

    def describe_node(self) -> Command:
        return self._plain(self._tpu("describe", "--format=value(state)"))

    def create(self) -> Command:
        c = self.cfg
        if c.queued:
            argv = self._qr("create", "--node-id", c.tpu_name, "--accelerator-type", c.tpu_type,
                            "--runtime-version", c.runtime_version)
            argv += ["--spot"] if c.spot else []
        else:
            argv = self._tpu("create", "--accelerator-type", c.tpu_type, "--version", c.runtime_version)
            argv += (["--spot"] if c.spot else []) + (["--preemptible"] if c.preemptible else [])
        return self._plain(argv + ["--quiet"])

    def delete(self) -> Command:
        if self.cfg.queued:
            # --force also deletes the node; without it a SUSPENDED queued resource cannot be deleted.
            return self._plain(self._qr("delete", "--force", "--quiet"))
        return self._plain(self._tpu("delete", "--quiet"))

    def start(self) -> Command:
        return self._plain(self._tpu("start", "--quiet"))

    def _ssh(self, script_real: str, script_shown: str) -> Command:
        base = self._tpu("ssh", "--worker=all", "--quiet", "--command")
        return Command(base + [script_real], base + [script_shown])

    # Remote scripts
    def setup(self) -> Command:
        script = self._setup_script()
        return self._ssh(script, script)  # setup carries no secrets

    def _setup_script(self) -> str:
        s = self.cfg.setup
        steps = ["set -euo pipefail"]
        if s.mode == "docker":
            image = s.docker_image or ""
            host = image.split("/", 1)[0] if "/" in image else ""
            if host.endswith("-docker.pkg.dev") or host.endswith("gcr.io"):
                # Artifact Registry / GCR need docker credentials; the VM's service account provides them.
                steps.append(f"sudo gcloud auth configure-docker {shlex.quote(host)} --quiet")
            steps.append(f"sudo docker pull {shlex.quote(image)}")
            return "; ".join(steps)
        rd = _q_path(s.repo_dir)
        if s.repo_url:
            steps.append(f"if [ ! -d {rd}/.git ]; then git clone --quiet {shlex.quote(s.repo_url)} {rd}; fi")
        missing = 'echo "launch: setup.repo_dir not found on $(hostname); set setup.repo_url" >&2'
        steps.append(f"cd {rd} || {{ {missing}; exit 1; }}")
        if s.git_ref:
            # origin/<ref> first so that a branch name means the remote tip, not a stale local branch.
            ref, remote_ref = shlex.quote(s.git_ref), shlex.quote("origin/" + s.git_ref)
            steps.append("git fetch --quiet --tags origin")
            checkout = "git checkout --quiet --detach"
            steps.append(f"{{ {checkout} {remote_ref} 2>/dev/null || {checkout} {ref}; }}")
        steps.extend(s.venv_setup)
        return "; ".join(steps)

    def run(self) -> Command:
        shown = self._run_script({k: REDACTED for k in self.secrets})
        return self._ssh(self._run_script(self.secrets), shown)

    def _env(self, secrets: Dict[str, str]) -> Dict[str, str]:
        # Unbuffered so that log lines reach the launcher as they happen, not in 8 KiB chunks.
        return {"PYTHONUNBUFFERED": "1", **self.cfg.env, **secrets}

    def _run_script(self, secrets: Dict[str, str]) -> str:
        s = self.cfg.setup
        train = " ".join(shlex.quote(a) for a in self.train_args)
        env = self._env(secrets)
        if s.mode == "docker":
            name = "levanter-train"
            # A container from an earlier attempt survives a dropped ssh session (no tty): remove it first.
            # --privileged and --net=host give the container the TPU devices and the pod's network.
            env_flags = " ".join(f"-e {k}={_q_value(v)}" for k, v in env.items())
            extra = " ".join(shlex.quote(a) for a in s.docker_args)
            python = shlex.quote(s.python or "python")
            run = [
                "sudo docker run --rm --name", name, "--privileged --net=host --shm-size=16g",
                env_flags, extra,
                shlex.quote(s.docker_image or ""), python, "-m levanter.main.train_lm", train,
            ]
            cmd = f"sudo docker rm -f {name} >/dev/null 2>&1 || true; " + " ".join(p for p in run if p)
        else:
            assigns = " ".join(f"{k}={_q_value(v)}" for k, v in env.items())
            python = shlex.quote(s.python or ".venv/bin/python")
            cmd = f"cd {_q_path(s.repo_dir)} && {assigns} {python} -m levanter.main.train_lm {train}"
        # The marker reports this worker's status to the launcher (see the module docstring).
        return f'{cmd}; rc=$?; echo "{EXIT_MARKER}=$rc host=$(hostname)"; exit $rc'


# -- running ---------------------------------------------------------------------------------------------


class Launcher:
    def __init__(self, cfg: LaunchConfig, train_args: Sequence[str], retries: int, secrets: Dict[str, str],
                 out: IO[str] = sys.stdout, sleep=time.sleep):
        self.cfg = cfg
        self.retries = retries
        self.secrets = secrets
        self.run_id, self.run_id_source = resolve_trainer_id(cfg, train_args)
        self.cmds = Commands(cfg, with_trainer_id(train_args, self.run_id), secrets)
        self.out = out
        self.sleep = sleep
        self.log: Optional[IO[str]] = None
        self.attempt = 1
        # Longest first, so that a secret containing another is replaced whole.
        values = sorted({v for v in secrets.values() if v}, key=len, reverse=True)
        self._scrub = [(form, REDACTED) for v in values for form in (shlex.quote(v), v) if form]

    # output
    def redact(self, text: str) -> str:
        for value, repl in self._scrub:
            text = text.replace(value, repl)
        return text

    def say(self, message: str) -> None:
        line = self.redact(message)
        print(line, file=self.out, flush=True)
        if self.log is not None:
            self.log.write(f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S} {line}\n")
            self.log.flush()

    def _prefix(self, what: str) -> str:
        return f"[{self.cfg.tpu_name} {what} {self.attempt}/{self.retries + 1}]"

    # subprocesses
    def _capture(self, cmd: Command, quiet: bool = False) -> Tuple[int, str, str]:
        if not quiet:
            self.say(cmd.display())
        p = subprocess.run(cmd.argv, capture_output=True, text=True, errors="replace")
        return p.returncode, p.stdout, p.stderr

    def _checked(self, cmd: Command, what: str) -> None:
        rc, out, err = self._capture(cmd)
        for line in (out + err).splitlines():
            self.say(f"{self._prefix(what)} {line}")
        if rc != 0:
            raise LaunchError(f"{what} failed (gcloud exit status {rc}); see the output above")

    def _stream(self, cmd: Command, what: str) -> Tuple[int, List[int]]:
        """Run ``cmd``, echoing its output line by line; return its status and the workers' exit markers."""
        self.say(cmd.display())
        markers: List[int] = []
        proc = subprocess.Popen(
            cmd.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\r\n")
                m = _MARKER_RE.search(line)
                if m:
                    markers.append(int(m.group(1)))
                self.say(f"{self._prefix(what)} {line}")
            return proc.wait(), markers
        except BaseException:
            # Ctrl-C / errors: do not leave gcloud (and, through its ssh sessions, the workers) running.
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise

    # TPU state
    def state(self, quiet: bool = False, node: bool = False) -> str:
        cmd = self.cmds.describe_node() if node else self.cmds.describe()
        rc, out, err = self._capture(cmd, quiet=quiet)
        if rc == 0:
            return out.strip().splitlines()[-1].strip() if out.strip() else "UNKNOWN"
        if "NOT_FOUND" in err or "not found" in err.lower():
            return NOT_FOUND
        raise LaunchError(f"describe failed (gcloud exit status {rc}): {self.redact(err.strip())}")

    def _ready_state(self) -> str:
        return QR_READY if self.cfg.queued else TPU_READY

    def _lost_states(self) -> set:
        return QR_LOST if self.cfg.queued else TPU_LOST

    def ensure_ready(self, state: Optional[str] = None) -> None:
        """Make the TPU exist and be READY: create it, or delete and recreate a preempted one, then wait."""
        state = state or self.state()
        if state == self._ready_state():
            return
        if state == "DELETING":  # e.g. a delete from an earlier launcher still in progress
            state = self._wait_while({"DELETING"})
        if state in self._lost_states():
            self.say(f"TPU {self.cfg.tpu_name} is {state}: deleting it to create it again")
            self._checked(self.cmds.delete(), "delete")
            state = NOT_FOUND
        if state == NOT_FOUND:
            self._checked(self.cmds.create(), "create")
        elif state == "STOPPED" and not self.cfg.queued:
            self._checked(self.cmds.start(), "start")
        self._wait_until_ready()

    def _wait_while(self, states: set) -> str:
        last = None
        while True:
            state = self.state(quiet=last is not None)
            if state not in states:
                return state
            last = state
            self.sleep(self.cfg.poll_seconds)

    def _wait_until_ready(self) -> None:
        timeout = self.cfg.wait_timeout_minutes
        deadline = time.monotonic() + timeout * 60 if timeout else None
        name, ready = self.cfg.tpu_name, self._ready_state()
        last = None
        while True:
            # The describe command is printed once, then only state changes: a queued resource can wait
            # for capacity for hours, and a line per poll would drown the log.
            state = self.state(quiet=last is not None)
            if state == ready:
                self.say(f"TPU {name} is {state}")
                return
            if state in self._lost_states() or (state == NOT_FOUND and last is not None):
                raise Preempted(f"TPU became {state} while waiting for it", state)
            if state != last:
                self.say(f"TPU {name} is {state}; polling every {self.cfg.poll_seconds:g}s until {ready}")
            last = state
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"TPU {name} not {ready} after {timeout:g} minutes (state {state})")
            self.sleep(self.cfg.poll_seconds)

    def _lost_reason(self) -> Tuple[Optional[str], str]:
        """(why the TPU counts as gone or None, last state) -- asked after a failure."""
        state = self.state()
        if state != self._ready_state():
            return f"TPU state is {state}", state
        if self.cfg.queued:
            # A queued resource can still say ACTIVE for a moment after its node was preempted.
            node = self.state(node=True)
            if node != TPU_READY:
                # Reported as SUSPENDED so that the relaunch deletes (--force) and recreates at once
                # instead of setting up workers on a node that is going away.
                return f"TPU node state is {node}", "SUSPENDED"
        return None, state

    # the attempt loop
    def warn_short_secrets(self) -> None:
        # Scrubbing is plain text replacement, so a very short value also masks unrelated text
        # (a secret "x" turns "exit" into "e***it"). Safe, but confusing without this note.
        for name, value in self.secrets.items():
            if len(value) < 8:
                self.say(f"note: {name} is only {len(value)} characters; every occurrence of its value "
                         "in the output is shown as ***")

    def launch(self) -> int:
        rid = self.run_id
        self.say(f"trainer.id = {rid} ({self.run_id_source}); every relaunch reuses it and resumes")
        if self.run_id_source == "generated":
            self.say(f"to resume this run from another launcher invocation, pass --trainer.id {rid} after --")
        known_state: Optional[str] = None
        while True:
            try:
                return self._attempt(known_state)
            except Preempted as p:
                if self.attempt > self.retries:
                    self.say(f"preempted ({p}); no retries left (--retries {self.retries}). "
                             "Rerun with the same --trainer.id to resume.")
                    return PREEMPTED_EXIT_CODE
                self.say(f"preempted ({p}); relaunching (retry {self.attempt} of {self.retries}) "
                         f"with trainer.id {self.run_id}")
                self.attempt += 1
                known_state = p.state

    def _attempt(self, known_state: Optional[str]) -> int:
        self.ensure_ready(known_state)
        rc, _ = self._stream(self.cmds.setup(), "setup")
        if rc != 0:
            reason, state = self._lost_reason()
            if reason:
                raise Preempted(f"setup failed and {reason}", state)
            raise LaunchError(f"setup failed on the workers (gcloud exit status {rc}); see the output above")
        rc, markers = self._stream(self.cmds.run(), "run")
        failed = [m for m in markers if m != 0]
        if rc == 0 and not failed:
            self.say(f"training finished on all workers (trainer.id {self.run_id})")
            return 0
        reason, state = self._lost_reason()
        if PREEMPTED_EXIT_CODE in markers or rc == PREEMPTED_EXIT_CODE:
            why = "a worker exited with status 75 after checkpointing on SIGTERM"
            raise Preempted(why + (f"; {reason}" if reason else ""), state)
        if reason:
            raise Preempted(reason, state)
        if not failed:
            # gcloud failed but no worker reported a failure: the ssh sessions ended before the trainer did
            # (a dropped connection, a host restarted by maintenance). The trainer gave no verdict, so this
            # is treated like a preemption: relaunching resumes from the checkpoint. (Set-up, which ran just
            # before, already proved that ssh itself works.)
            why = f"the ssh session ended (gcloud exit status {rc}) before any worker reported a status"
            raise Preempted(why, state)
        self.say(f"training failed with exit status {failed[0]} (not a preemption, so not retried)")
        return failed[0]

    # --dry-run
    def plan(self) -> None:
        c = self.cmds
        self.say(f"# dry run: nothing is executed. trainer.id = {self.run_id} ({self.run_id_source})")
        self.say(f"# check whether TPU {self.cfg.tpu_name} exists (assumed not found below):")
        self.say(c.describe().display())
        self.say("# create it:")
        self.say(c.create().display())
        self.say(f"# poll every {self.cfg.poll_seconds:g}s until {self._ready_state()}:")
        self.say(c.describe().display())
        self.say("# set up every worker:")
        self.say(c.setup().display())
        self.say("# train on every worker, streaming the output:")
        self.say(c.run().display())
        if self.retries:
            ready = self._ready_state()
            self.say(f"# on preemption (a worker exits with 75, or the TPU is not {ready} afterwards), "
                     f"up to {self.retries} time(s):")
            self.say(c.describe().display())
            self.say(c.delete().display())
            self.say(c.create().display())
            self.say(c.describe().display())
            self.say(c.setup().display())
            self.say(c.run().display() + "   # same --trainer.id: resumes from the latest checkpoint")


# -- command line ----------------------------------------------------------------------------------------


EXAMPLE_TRAIN_ARGS = "-- --config_path config/gpt2_small_openwebtext.yaml"


def _split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: Optional[Sequence[str]] = None) -> int:
    ours, train_args = _split_argv(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="launch_tpu.py",
        description="Run levanter.main.train_lm on every worker of a Cloud TPU VM slice; relaunch it after "
        "preemption.",
        epilog=f"Everything after -- goes to levanter.main.train_lm, e.g. {EXAMPLE_TRAIN_ARGS}",
    )
    parser.add_argument(
        "--config",
        help="launch YAML (see scripts/launch.example.yaml); fields may also come from "
        "LEVANTER_LAUNCH_<FIELD> environment variables",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print every command it would run (secrets: ***); run nothing"
    )
    parser.add_argument(
        "--retries", type=int, default=None, help="relaunches after preemption (default: config's retries)"
    )
    args = parser.parse_args(ours)
    try:
        if args.retries is not None and args.retries < 0:
            raise ConfigError(f"--retries must be >= 0, got {args.retries}")
        cfg = load_config(args.config)
        if not train_args:
            raise ConfigError(f"nothing to run: put train_lm's arguments after --, e.g. {EXAMPLE_TRAIN_ARGS}")
        missing = [n for n in cfg.env_from_host if n not in os.environ]
        if missing:
            raise ConfigError(f"env_from_host: {', '.join(missing)} not set in the launcher's environment")
        secrets = {n: os.environ[n] for n in cfg.env_from_host}
        retries = cfg.retries if args.retries is None else args.retries
        launcher = Launcher(cfg, train_args, retries, secrets)
        launcher.warn_short_secrets()
        if args.dry_run:
            launcher.plan()
            return 0
        if shutil.which("gcloud") is None:
            raise ConfigError(
                "gcloud not found on PATH: install the Google Cloud SDK (https://cloud.google.com/sdk) "
                "or use --dry-run to see the commands"
            )
        log_dir = Path(cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{cfg.tpu_name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.log"
        with open(log_path, "a", encoding="utf-8") as log:
            launcher.log = log
            launcher.say(f"logging to {log_path}")
            return launcher.launch()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted; the TPU is left running (gcloud compute tpus tpu-vm delete)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
