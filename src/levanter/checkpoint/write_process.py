"""A background save's writes, made by a process of their own so that they cannot stall the training loop.

A background save hands the writer thread host copies of the state. Written through TensorStore from the
training process, those writes held up the loop's own thread for seconds on a TPU host, although the copy
to host memory itself takes a fraction of a second (docs/bench/2026-12-07-checkpoints.md). Whatever the
many concurrent writes hold that the loop's thread needs -- the interpreter lock, the allocator and the
page tables are all shared within a process -- a second process shares none of it. So on Linux, for local
disk and object stores, the writer thread:

1. copies the host copies into one anonymous shared-memory file (``memfd_create``; freed by the kernel
   once both processes have closed it, so a crash leaks nothing), the GIL released during the copies;
2. passes its descriptor and the arrays' TensorStore specs to a writer process over a socket;
3. waits for the writer's report of each finished leaf (the ``checkpoint_mid_write`` fault point is
   visited in this process, between leaves, as for writes in this process), then for its last report.

The commit, the agreement between processes and every error message stay with the caller
(:mod:`levanter.checkpoint.serialization`): an error the writer meets is sent back and raised here.

The writer process runs this file as a script: it imports only numpy and TensorStore (about a second to
start), is started at the first background save and serves every save after it. It ignores SIGINT and
SIGTERM (the training process decides whether to wait for the write in flight) and is killed by the kernel
when the training process dies (``PR_SET_PDEATHSIG``, set for the long-lived thread that starts it), so a
killed run leaves no writer behind that could still change its directory.

Trade-offs: a second host copy of the state exists while it is copied into shared memory (each array's
first copy is dropped once copied); ``memory://`` paths (whose store lives in this process's TensorStore
context) and platforms without ``memfd_create`` are written in this process, as are synchronous saves
(the loop waits for those anyway). Whether a write takes as long from the writer process as from this
one is not settled (the chip's one comparison says longer; the record says what was measured): a run that
saves more often than a write takes waits for the write in flight either way.
``LEVANTER_CHECKPOINT_WRITER=thread`` writes every save in this process.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["applies", "write_in_process_of_its_own"]

_ALIGN = 64
_LEN = struct.Struct("!Q")
_ENV = "LEVANTER_CHECKPOINT_WRITER"


# -- both sides: length-prefixed pickles over the socket -----------------------------------------------------
def _send(sock: socket.socket, obj: Any, fds: tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if fds:
        socket.send_fds(sock, [_LEN.pack(len(data))], list(fds))
    else:
        sock.sendall(_LEN.pack(len(data)))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end of the checkpoint writer's socket closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _recv(sock: socket.socket, with_fds: bool = False) -> tuple[Any, list[int]]:
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, 1)
        if not head:
            raise EOFError("the other end of the checkpoint writer's socket closed")
        if len(head) < _LEN.size:
            head += _recv_exact(sock, _LEN.size - len(head))
    else:
        head = _recv_exact(sock, _LEN.size)
    (n,) = _LEN.unpack(head)
    return pickle.loads(_recv_exact(sock, n)), fds


# -- the training process's side -----------------------------------------------------------------------------
def applies(root: str, items: list) -> bool:
    """Whether :func:`write_in_process_of_its_own` writes ``items`` under ``root``: Linux with
    ``memfd_create``, not a ``memory://`` path, every value a host copy or a numpy array, and not turned
    off with ``LEVANTER_CHECKPOINT_WRITER=thread``."""
    from levanter.checkpoint.host_copy import HostShards
    from levanter.utils import fs

    if os.environ.get(_ENV, "process") == "thread" or not hasattr(os, "memfd_create"):
        return False
    if fs.is_in_process_store(root):
        return False
    return all(isinstance(it.value, (HostShards, np.ndarray, np.generic)) for it in items)


def _job(root: str, items: list, process_index: int) -> tuple[list, list, int]:
    """(leaves to write, where each shard's data is, total bytes with alignment). A leaf is
    ``(spec, creates_metadata, [(index, offset, shape, dtype name), ...])``; a shard's data is
    ``(HostShards, position in its shards)``, or ``(None, array)`` for a host value."""
    import jax

    from levanter.checkpoint.host_copy import HostShards
    from levanter.checkpoint.tree_format import chunk_shape, write_spec
    from levanter.utils import fs

    leaves, sources, size = [], [], 0
    for it in items:
        value, directory = it.value, fs.join(root, it.record["name"])
        if isinstance(value, HostShards):
            spec = write_spec(directory, value.shape, value.dtype,
                              chunk_shape(value.shard_shape, value.dtype.itemsize))
            shards, creates = value.shards, jax.process_index() == 0
            where = [(value, j) for j in range(len(shards))]
        else:  # a host value: process 0's copy is the one written
            if process_index != 0:
                continue
            host = np.asarray(value)
            spec = write_spec(directory, host.shape, host.dtype, chunk_shape(host.shape, host.dtype.itemsize))
            shards, creates = [(tuple(slice(None) for _ in host.shape), host)], True
            where = [(None, host)]
        described = []
        for (index, data), source in zip(shards, where):
            described.append((index, size, tuple(data.shape), np.dtype(data.dtype).name))  # "bfloat16" too
            sources.append(source)
            size += -(-max(data.nbytes, 1) // _ALIGN) * _ALIGN
        leaves.append((spec, creates, described))
    return leaves, sources, size


def _copy_into(mm: mmap.mmap, leaves: list, sources: list) -> None:
    """Copy every shard into ``mm`` at its offset, dropping each host copy once copied (at most one array
    more than the state is in host memory at a time)."""
    shards = [d for _, _, described in leaves for d in described]
    for (_, offset, shape, _), (owner, at) in zip(shards, sources):
        if owner is None:
            data = at
        else:
            index, data = owner.shards[at]
            owner.shards[at] = (index, None)
        data = np.asarray(data)
        np.ndarray(shape, data.dtype, buffer=mm, offset=offset)[...] = data  # numpy releases the GIL
        del data


def _context_spec(root: str) -> dict:
    from levanter.checkpoint.tree_format import url_context_spec
    from levanter.utils import fs

    if not fs.is_url(root):  # as JAX's context for local disk, without its 10 GB chunk cache
        return {"file_io_concurrency": {"limit": 128}}
    return url_context_spec()


class _Writer:
    """The writer process and the socket to it; one save at a time (the background writer's thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._sock: socket.socket | None = None
        self._requests: list = []
        self._wake = threading.Condition()
        self._starter: threading.Thread | None = None

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _start(self) -> None:
        # PR_SET_PDEATHSIG fires when the *thread* that started the child exits: the writer process is
        # started by a thread that lives as long as this process.
        if self._starter is None:
            self._starter = threading.Thread(target=self._starter_loop, name="levanter-writer-starter",
                                             daemon=True)
            self._starter.start()
        done = threading.Event()
        box: dict = {}
        with self._wake:
            self._requests.append((done, box))
            self._wake.notify()
        done.wait()
        if "error" in box:
            raise box["error"]
        self._proc, self._sock = box["proc"], box["sock"]

    def _starter_loop(self) -> None:
        import subprocess

        while True:
            with self._wake:
                while not self._requests:
                    self._wake.wait()
                done, box = self._requests.pop(0)
            try:
                ours, theirs = socket.socketpair()
                proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno()),
                                         str(os.getpid())], pass_fds=(theirs.fileno(),),
                                        stdin=subprocess.DEVNULL)
                theirs.close()
                box.update(proc=proc, sock=ours)
            except Exception as e:  # noqa: BLE001 -- raised by the waiting thread
                box["error"] = e
            done.set()

    def write(self, root: str, items: list, process_index: int) -> None:
        from levanter.utils.fault import fault_point

        leaves, sources, size = _job(root, items, process_index)
        # The fault point's visits as for writes in this process (``leaf_writes.write_all``): one between
        # any two finished leaves, the host values another process writes finishing first.
        for _ in range(len(items) - len(leaves) - (0 if leaves else 1)):
            fault_point("checkpoint_mid_write")
        if not leaves:
            return
        with self._lock:
            fd = os.memfd_create("levanter-checkpoint", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, max(size, 1))
                with mmap.mmap(fd, max(size, 1)) as mm:
                    _copy_into(mm, leaves, sources)
                sources.clear()
                for it in items:  # only the shared copy is written
                    it.value = None
                # The environment as it is now (credentials, endpoints), not as it was at the writer's start.
                job = {"size": max(size, 1), "context": _context_spec(root), "leaves": leaves,
                       "env": dict(os.environ)}
                self._hand_over(job, fd)
            finally:
                os.close(fd)
            fault_point("checkpoint_writer_started")  # the job is the writer's
            self._wait(len(leaves))

    def _hand_over(self, job: dict, fd: int) -> None:
        """Send ``job`` and wait for the writer to take it; a writer found dead before it took the job (killed
        between saves) is replaced once."""
        for attempt in range(2):
            if self._proc is None or self._proc.poll() is not None:
                self._close_socket()
                self._start()
            try:
                _send(self._sock, job, fds=(fd,))
                kind, payload = _recv(self._sock)[0]
            except (EOFError, ConnectionError) as e:  # BrokenPipeError and resets included
                died = self._died()
                if attempt:
                    raise died from e
                continue
            if kind != "started":
                raise RuntimeError(f"the checkpoint writer process answered {kind!r} to a new job: {payload!r}")
            return

    def _wait(self, n: int) -> None:
        """Read the writer's reports of the job just sent, through its last (``done`` or ``error``), visiting
        the fault point between leaves; an error from either is raised once the job's reports are read."""
        from levanter.utils.fault import fault_point

        seen, error = 0, None
        while True:
            try:
                kind, payload = _recv(self._sock)[0]
            except (EOFError, ConnectionError) as e:
                raise self._died() from e
            if kind == "done":
                break
            if kind == "error":
                error = error or payload
                break
            seen += 1
            if seen < n and error is None:
                try:
                    fault_point("checkpoint_mid_write")
                except Exception as e:  # noqa: BLE001 -- raised after the job's last report
                    error = e
        if error is not None:
            raise error

    def _died(self) -> Exception:
        from levanter.checkpoint.errors import CheckpointSaveError

        code = None
        if self._proc is not None:
            self._proc.kill()  # in case only its socket failed
            code = self._proc.wait(timeout=30)
        self._proc = None  # the next save starts another
        self._close_socket()
        return CheckpointSaveError(f"the checkpoint writer process exited (code {code}) before the write "
                                   "finished")


_WRITER: _Writer | None = None
_WRITER_LOCK = threading.Lock()


def write_in_process_of_its_own(root: str, items: list, process_index: int) -> None:
    """Write ``items`` (host values only: :func:`applies`) under ``root`` through the writer process;
    returns once every leaf is written, raises the writer's error otherwise. The items' values are
    released once copied to shared memory."""
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = _Writer()
    _WRITER.write(root, items, process_index)


# -- the writer process's side -------------------------------------------------------------------------------
def _dtype(name: str) -> np.dtype:
    """A dtype by name; TensorStore's own for those numpy lacks (bfloat16 and the other ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:
        import tensorstore as ts

        return ts.dtype(name).numpy_dtype


def _serve(fd: int, parent: int) -> None:
    import asyncio

    import tensorstore as ts

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # killed with the training process (the thread that started this one lives as long as it)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- elsewhere: the socket's end stops this process
        pass
    if os.getppid() != parent:  # it died before the line above
        return
    sock = socket.socket(fileno=fd)
    contexts: dict[str, Any] = {}
    while True:
        try:
            job, fds = _recv(sock, with_fds=True)
        except (EOFError, ConnectionError):
            return
        mm = mmap.mmap(fds[0], job["size"], prot=mmap.PROT_READ)
        os.close(fds[0])
        _send(sock, ("started", None))
        if job["env"] != dict(os.environ):  # read by TensorStore's storage drivers: contexts made anew
            os.environ.clear()
            os.environ.update(job["env"])
            contexts.clear()
        key = repr(sorted(job["context"].items()))
        context = contexts.get(key) or contexts.setdefault(key, ts.Context(job["context"]))

        async def leaf(i: int, spec: dict, creates: bool, described: list) -> None:
            if creates:
                store = await ts.open(ts.Spec(spec), create=True, open=True, context=context)
            else:
                store = await ts.open(ts.Spec(spec), open=True, assume_metadata=True, context=context)
            for index, offset, shape, dtype in described:  # one shard at a time, as in this process
                data = np.ndarray(shape, _dtype(dtype), buffer=mm, offset=offset)
                await store[index].write(data, can_reference_source_data_indefinitely=True)
            _send(sock, ("leaf", i))

        async def everything() -> None:
            tasks = [asyncio.ensure_future(leaf(i, *x)) for i, x in enumerate(job["leaves"])]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]

        try:
            asyncio.run(everything())
            _send(sock, ("done", None))
        except BaseException as e:  # noqa: BLE001 -- reported to the training process, which raises it
            try:
                _send(sock, ("error", e))
            except Exception:  # noqa: BLE001 -- e.g. an exception that does not pickle
                _send(sock, ("error", RuntimeError(f"{type(e).__name__}: {e}")))
        try:
            mm.close()
        except BufferError:  # a view still referenced: the mapping goes with it
            pass


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
