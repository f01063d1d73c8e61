"""One writer per run: a lock record in the run's checkpoint directory, held for the whole run.

Two processes training the same ``trainer.id`` would interleave their checkpoints and metrics, and the
second one's start-up would delete the first one's in-progress save. So a run starts by *creating* the
file ``<base_path>/<run_id>/run.lock`` -- create-if-absent, never overwrite -- holding a small JSON
record ``{run_id, host, pid, started, token, ...}``, and deletes it when it ends (normally, with an
error, or after SIGTERM). A start-up that finds the file refuses to run, naming the holder.

Protocol. The only primitive is "create this object with these bytes unless it exists", which a local
or network filesystem provides (the record is written to a temporary file and hard-linked into place,
so the lock never exists half-written; ``O_CREAT | O_EXCL`` where hard links are not supported) and an
object store provides as a conditional write (``ifGenerationMatch=0`` on GCS, ``If-None-Match: *`` on
S3; :func:`levanter.utils.fs.create_exclusive`). Release deletes the file only if it still holds this
run's ``token``. Transient store errors are retried; a create whose reply was lost and whose retry finds
the object finds this run's own token in it, and holds the lock.

Stale locks. A process killed with SIGKILL (or a machine that died) leaves its lock behind. When the
holder ran on this machine -- same host name, same boot and, where Linux reports them, the same PID
namespace -- and its PID is gone (or now belongs to a process started later), the lock is stale and is
taken over with a warning. A holder on another machine cannot be checked from here, so the holder
also keeps a heartbeat: every ``HEARTBEAT_SECONDS`` it touches the file (POSIX storage) or rewrites the
record with a ``heartbeat`` time (object stores, whose objects cannot be touched), and a lock whose
modification time is ``STALE_AFTER_SECONDS`` old (a machine lost with its run, a job killed after its
grace period and requeued elsewhere) is stale wherever it was taken. On an object store that time is
the store's clock, compared with this machine's: the generous limit absorbs ordinary skew. Before that,
the error says how to break the lock (delete the file or object) once the user is sure that run is dead.

Taking over a stale lock. On POSIX storage the stale file is renamed aside and checked, so two start-ups
breaking the same lock cannot both win. An object store has no rename: the stale record is read again,
deleted if unchanged, and the lock created anew; since another start-up could delete the new lock in the
moment between its own check and delete, a start-up that took over re-reads the lock after
``TAKEOVER_SETTLE_SECONDS`` and refuses to run if it is no longer its own.

Multi-process runs take the lock on process 0 only; :func:`hold_run_lock` tells the other processes
whether it succeeded, so that all of them stop with the same message instead of waiting at a barrier.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Optional

from levanter.errors import is_out_of_space, out_of_space_error
from levanter.utils import fs
from levanter.utils.process import pid_alive, proc_stat

__all__ = ["LOCK_FILENAME", "RunLock", "RunLockedError", "acquire_run_lock", "hold_run_lock"]

logger = logging.getLogger(__name__)

LOCK_FILENAME = "run.lock"
HEARTBEAT_SECONDS = 30.0
# Generous against clock skew between machines sharing the filesystem and against a busy holder.
STALE_AFTER_SECONDS = 600.0
# After taking over a stale lock on an object store: how long to wait before checking it is still ours.
TAKEOVER_SETTLE_SECONDS = 1.0


class RunLockedError(ValueError):
    """Another process holds the run's lock (a user error: the same ``trainer.id`` launched twice)."""


# ---------------------------------------------------------------------------------------------------
# Who we are, and whether a recorded holder is still alive
# ---------------------------------------------------------------------------------------------------


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _boot_id() -> Optional[str]:
    return _read_text("/proc/sys/kernel/random/boot_id")


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _pid_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot: with the boot id, a process's identity."""
    fields = proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _this_process(run_id: str) -> dict:
    record: dict[str, Any] = {
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "token": secrets.token_hex(8),
    }
    identity = (("boot_id", _boot_id()), ("pid_ns", _pid_namespace()), ("pid_start", _pid_start(os.getpid())))
    for key, value in identity:
        if value is not None:
            record[key] = value
    return record


def _heartbeat_age(path: str) -> Optional[float]:
    try:
        return time.time() - fs.retry_transient(fs.mtime, path, what=f"reading the run lock {path}")
    except Exception:  # noqa: BLE001 -- gone, or unreadable: no heartbeat to judge by
        return None


def _is_stale(holder: dict, path: str) -> bool:
    """Whether ``holder`` has certainly exited: no heartbeat for ``STALE_AFTER_SECONDS``, or a process of
    this machine that is gone."""
    age = _heartbeat_age(path)
    if age is not None and age > STALE_AFTER_SECONDS:
        return True
    if holder.get("host") != socket.gethostname():
        return False
    for key, mine in (("boot_id", _boot_id()), ("pid_ns", _pid_namespace())):
        theirs = holder.get(key)
        if theirs is not None and mine is not None and theirs != mine:
            # Another boot: the holder died with the machine. Another PID namespace (a container on
            # the same host): its PIDs mean nothing here.
            return key == "boot_id"
    pid = holder.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return False  # this process holds it (a run in progress in this interpreter)
    if not pid_alive(pid):
        return True
    start = holder.get("pid_start")
    return start is not None and _pid_start(pid) not in (None, start)  # the PID was reused


# ---------------------------------------------------------------------------------------------------
# The store: create-if-absent, read, delete
# ---------------------------------------------------------------------------------------------------


def _create_if_absent(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; True if this call created it."""
    if not fs.supports_rename(path):
        return fs.retry_transient(fs.create_exclusive, path, data, what=f"creating the run lock {path}")
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # atomic, fails if the name exists, and never shows a half-written record
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    # No hard links on this filesystem: exclusive create, then write.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return True


def _read_record(path: str) -> tuple[Optional[dict], Optional[bytes]]:
    """``(record, raw bytes)``; ``(None, None)`` if the file is gone, ``(None, raw)`` if unparseable."""
    try:
        raw = fs.retry_transient(fs.read_bytes, path, what=f"reading the run lock {path}")
    except FileNotFoundError:
        return None, None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, raw
    return (doc if isinstance(doc, dict) else None), raw


def _describe(holder: Optional[dict], run_id: str) -> str:
    if holder is None:
        return "a record that cannot be read"
    other = f"run {holder['run_id']!r}, " if holder.get("run_id") not in (None, run_id) else ""
    return (
        f"{other}pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
        f"{holder.get('started', '?')}"
    )


# ---------------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------------


class RunLock:
    """A held run lock (or, on processes other than 0, a placeholder). :meth:`release` is idempotent."""

    def __init__(self, path: Optional[str], record: Optional[dict]):
        self.path = path
        self.record = record
        self._stop = threading.Event()
        if path is not None:
            self._thread = threading.Thread(target=self._beat, args=(path,), name="run-lock-heartbeat",
                                            daemon=True)
            self._thread.start()

    def _beat(self, path: str) -> None:
        touch = fs.supports_rename(path)
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                if touch:
                    os.utime(path)
                elif not self._rewrite(path):
                    return
            except Exception as e:  # noqa: BLE001 -- gone (broken by hand) or storage trouble: run on
                logger.warning("cannot refresh the run lock %s: %s", path, fs.redact(str(e)))

    def _rewrite(self, path: str) -> bool:
        """Rewrite the record (a fresh modification time on an object store); False once it is not ours."""
        current, _ = _read_record(path)
        if self.record is None or current is None or current.get("token") != self.record["token"]:
            logger.warning("run lock %s is no longer this run's (broken by hand?); no more heartbeats", path)
            return False
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        beat = dict(self.record, heartbeat=now)
        data = (json.dumps(beat, indent=1, sort_keys=True) + "\n").encode()
        fs.retry_transient(fs.atomic_write_bytes, path, data, what=f"refreshing the run lock {path}")
        return True

    @property
    def held(self) -> bool:
        return self.path is not None

    def release(self) -> None:
        if self.path is None or self.record is None:
            return
        path, self.path = self.path, None
        self._stop.set()
        # A heartbeat in flight must land before the record is deleted: on an object store a rewrite that
        # landed after the delete would put the lock back.
        self._thread.join(timeout=60)
        current, _ = _read_record(path)
        if current is None or current.get("token") != self.record["token"]:
            logger.warning("run lock %s is no longer this run's (it was broken by hand?); leaving it", path)
            return
        try:
            fs.retry_transient(fs.remove, path, missing_ok=True, what=f"removing the run lock {path}")
        except (OSError, fs.StorageAccessError) as e:
            # Release runs as the run ends, often because of an error about the same storage (a directory
            # that turned read-only): that error is the one to report. The lock left behind is taken over
            # as stale by the next start on this host, or after STALE_AFTER_SECONDS anywhere.
            logger.warning("could not remove the run lock %s (%s); the next start of this run takes it over "
                           "once it is stale, or delete it by hand", path, fs.redact(str(e)))

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire_run_lock(run_dir: str, run_id: str) -> RunLock:
    """Take the lock of the run whose checkpoints live in ``run_dir`` (created if needed).

    Raises :class:`RunLockedError` if a live run holds it; takes over (with a warning) a lock whose
    holder has certainly exited (a process of this machine that is gone, or no heartbeat for
    ``STALE_AFTER_SECONDS``).
    """
    run_dir = fs.abspath(run_dir)
    path = fs.join(run_dir, LOCK_FILENAME)
    record = _this_process(run_id)
    data = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()
    took_over = False
    for _ in range(5):
        try:
            fs.makedirs(run_dir)
            created = _create_if_absent(path, data)
        except (OSError, fs.StorageAccessError) as e:
            if isinstance(e, OSError) and is_out_of_space(e):
                raise out_of_space_error("taking the run lock", path) from e
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(
                f"trainer.checkpointer.base_path: cannot create the run lock {path} ({fs.redact(why)}). "
                "Choose a writable directory."
            ) from None
        holder, raw = (None, None) if created else _read_record(path)
        if created or (holder is not None and holder.get("token") == record["token"]):
            # (Not created, yet ours: a retried create whose first attempt went through.)
            if took_over and not fs.supports_rename(path):
                _confirm_takeover(path, record, run_id)
            return RunLock(path, record)
        if raw is None:
            continue  # released between our attempt and the read: try again
        if holder is None or not _is_stale(holder, path):
            age = _heartbeat_age(path)
            beat = f" (last heartbeat {age:.0f} s ago)" if age is not None else ""
            raise RunLockedError(
                f"run {run_id!r} is already running: its lock {path} is held by "
                f"{_describe(holder, run_id)}{beat}. Two runs with one trainer.id would mix their "
                "checkpoints and metrics: wait for it to finish, or use another trainer.id. If that run is "
                f"dead (e.g. its machine was lost), delete {path} and rerun; the lock also expires "
                f"{STALE_AFTER_SECONDS / 60:.0f} minutes after its last heartbeat."
            )
        logger.warning(
            "taking over the run lock %s: its holder (%s) is no longer running",
            path,
            _describe(holder, run_id),
        )
        _break_stale(path, raw)
        took_over = True
    raise RunLockedError(
        f"run {run_id!r}: could not take its lock {path}: other processes keep taking it. Is the same run "
        "being started several times at once?"
    )


def _confirm_takeover(path: str, record: dict, run_id: str) -> None:
    """After taking over on an object store: wait, then make sure no concurrent start-up replaced the lock."""
    time.sleep(TAKEOVER_SETTLE_SECONDS)
    holder, _ = _read_record(path)
    if holder is None or holder.get("token") != record["token"]:
        raise RunLockedError(
            f"run {run_id!r}: another start-up took over the stale lock {path} at the same moment (it is now "
            f"held by {_describe(holder, run_id)}). Is the same run being started several times at once?"
        )


def _break_stale(path: str, raw: bytes) -> None:
    """Remove the lock at ``path`` if it still holds ``raw`` (another start-up may have replaced it)."""
    if not fs.supports_rename(path):
        _, current = _read_record(path)
        if current == raw:
            fs.retry_transient(fs.remove, path, missing_ok=True, what=f"removing the stale run lock {path}")
        return
    aside = f"{path}.stale-{secrets.token_hex(4)}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # someone else removed it
    try:
        with open(aside, "rb") as f:
            moved = f.read()
        if moved != raw:
            # Another start-up broke the same stale lock and took it in the meantime: put its lock back.
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
    finally:
        os.unlink(aside)


def hold_run_lock(run_dir: str, run_id: str, *, process_index: int | None = None) -> RunLock:
    """:func:`acquire_run_lock` on process 0; every process raises if that failed, none waits forever.

    ``process_index`` is this process's index (default ``jax.process_index()``).
    """
    import jax

    if jax.process_count() == 1:
        return acquire_run_lock(run_dir, run_id)
    import numpy as np
    from jax.experimental import multihost_utils

    process_index = jax.process_index() if process_index is None else process_index
    lock, failure = RunLock(None, None), None
    if process_index == 0:
        try:
            lock = acquire_run_lock(run_dir, run_id)
        except BaseException as e:  # noqa: BLE001 -- reported to the others first, then re-raised
            failure = e
    ok = bool(multihost_utils.broadcast_one_to_all(np.bool_(failure is None)))
    if failure is not None:
        raise failure
    if not ok:
        raise RunLockedError(
            f"run {run_id!r}: process 0 could not take the run lock in {run_dir} (its error says why)"
        )
    return lock

