"""One builder per cache directory: a lock record that a second builder waits on, then joins the result.

Two runs that build the same new ``cache_dir`` at once (two ``train_lm`` runs, ``train_lm`` and
``cache_dataset``, two ``cache_dataset`` runs) would append to the same arrays and replace each other's
ledger. So a build first *creates* ``<cache_dir>/build.lock`` (create-if-absent:
:func:`levanter.utils.fs.create_exclusive`, a hard link locally, a conditional write on an object store)
holding ``{host, pid, boot, token}``, and deletes it when it ends, however it ends. A builder that finds
the lock waits, polling, and once the lock is gone reads the ledger again: a finished cache is served
(both runs end with the same cache), an unfinished one (the other build failed or was killed) is resumed
by whoever takes the lock next.

A lock whose holder is dead is taken over: on this machine (same host name and boot) when its PID is
gone; from another machine when neither the lock nor the ledger has changed for ``STALE_AFTER_SECONDS``
(a live build rewrites its ledger after every batch). Taking over removes the stale record only if it
is still the one read, then competes for the lock like any builder.

A builder killed after its finished ledger was saved but before it deleted its lock leaves a finished cache
with a dead holder's lock. Opening a finished cache never takes the lock, so
:func:`clear_stale_build_lock` removes such a record there (best effort: a read-only cache keeps it, and
it harms nothing but the byte-for-byte listing of the directory).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time

from ..utils import fs
from ..utils.process import pid_alive

__all__ = ["BUILD_LOCK_FILENAME", "BuildLock", "acquire_build_lock", "clear_stale_build_lock"]

logger = logging.getLogger(__name__)

BUILD_LOCK_FILENAME = "build.lock"
POLL_SECONDS = 0.5
# A build rewrites its ledger after every batch of documents; this long without a change means its holder
# is gone (only used for holders on other machines, whose PIDs cannot be checked).
STALE_AFTER_SECONDS = 600.0


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot": _boot_id(),
            "token": secrets.token_hex(8)}


def _age(path: str) -> float | None:
    try:
        return time.time() - fs.mtime(path)
    except (FileNotFoundError, OSError):
        return None


def _stale(holder: dict | None, lock_path: str, ledger_path: str) -> bool:
    if holder is not None and holder.get("host") == socket.gethostname() and holder.get("boot") == _boot_id():
        pid = holder.get("pid")
        return isinstance(pid, int) and not pid_alive(pid)
    ages = [a for a in (_age(lock_path), _age(ledger_path)) if a is not None]
    return bool(ages) and min(ages) > STALE_AFTER_SECONDS


def _read(path: str) -> tuple[dict | None, bytes | None]:
    try:
        raw = fs.read_bytes(path)
    except FileNotFoundError:
        return None, None
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, raw  # being written elsewhere, or damaged: judged by its age
    return (holder if isinstance(holder, dict) else None), raw


class BuildLock:
    """A held build lock; :meth:`release` deletes it if it is still this builder's."""

    def __init__(self, path: str, record: dict):
        self.path = path
        self._record = record

    def release(self) -> None:
        holder, _ = _read(self.path)
        if holder is not None and holder.get("token") == self._record["token"]:
            fs.retry_transient(fs.remove, self.path, missing_ok=True,
                               what=f"removing the build lock {self.path}")


def acquire_build_lock(cache_dir: str, *, ledger_path: str) -> BuildLock:
    """Take the build lock of ``cache_dir``, waiting while another live builder holds it (see the module
    docstring); a stale lock is taken over with a warning."""
    path = fs.join(cache_dir, BUILD_LOCK_FILENAME)
    record = _record()
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    fs.makedirs(cache_dir)
    waited = False
    while True:
        if fs.create_exclusive(path, data):
            if waited:
                logger.info("the other build of %s has ended; continuing", cache_dir)
            return BuildLock(path, record)
        holder, raw = _read(path)
        if raw is None:
            continue  # released between the attempt and the read
        if _stale(holder, path, ledger_path):
            logger.warning("taking over the build lock %s: its holder (%s) is no longer running", path,
                           _describe(holder))
            _, raw_again = _read(path)
            if raw_again == raw:
                fs.retry_transient(fs.remove, path, missing_ok=True,
                                   what=f"removing the stale build lock {path}")
            continue
        if not waited:
            logger.info("another process (%s) is building the token cache at %s; waiting for it to finish",
                        _describe(holder), cache_dir)
            waited = True
        time.sleep(POLL_SECONDS)


def clear_stale_build_lock(cache_dir: str, *, ledger_path: str) -> None:
    """Remove ``cache_dir``'s build lock if its holder is dead (see the module docstring); a live holder's
    lock, a missing one, or one that cannot be removed is left as it is."""
    path = fs.join(cache_dir, BUILD_LOCK_FILENAME)
    try:
        holder, raw = _read(path)
        if raw is None or not _stale(holder, path, ledger_path):
            return
        _, raw_again = _read(path)
        if raw_again == raw:
            fs.remove(path, missing_ok=True)
            logger.info("removed the build lock %s left by a finished build (%s)", path, _describe(holder))
    except (OSError, fs.StorageAccessError) as e:
        logger.debug("left the stale build lock %s: %s", path, e)


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "unknown holder"
    return f"pid {holder.get('pid')} on {holder.get('host')}"
