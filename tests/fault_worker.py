"""Helper for tests/checkpoint/test_fault_injection.py: a fork server whose children save checkpoints or build a
token cache, so that the test can SIGKILL them at random moments.

Starting Python and importing JAX costs ~2 s (more on a loaded machine); forty kill-and-resume runs
would spend most of their time there. So this process imports everything once -- without
initialising a JAX backend or touching tensorstore, so no runtime threads exist yet -- and then
forks one child per job. Each child is a fresh process as far as JAX, XLA and tensorstore are
concerned (they initialise in the child), and it is a real process that a SIGKILL ends without any
cleanup, exactly like ``kill -9`` of a training run.

Protocol (one JSON object per line). Requests on stdin: ``{"job": "ckpt" | "cache", "args": {...},
"linger": bool}``. Events on stdout:

* ``{"event": "started", "pid"}``: written by the server right after the fork;
* ``{"event": "loop", "pid"}``: the child's set-up is over and it starts saving or building (kill
  delays are measured from here); it may reach the test before "started";
* ``{"event": "done", "pid"}``: the child's job finished;
* ``{"event": "exit", "pid", "returncode"}``: the server reaped the child (``-9`` for SIGKILL).

A lingering child sleeps after "done" instead of exiting, so a kill sent late still hits the same,
live process (never a recycled pid). SIGUSR1 makes a child dump its Python stacks to stderr.

The checkpoint job is a miniature training run: resume from the latest complete checkpoint (checking
that it holds exactly the expected values), then for each step apply a deterministic update (float32
additions in XLA, exactly reproducible) and let a :class:`~levanter.checkpoint.Checkpointer` save it
(a temporary checkpoint every step, permanent ones every ``keep_every`` steps and at the end).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import traceback

import numpy as np

# -- the checkpointed state ----------------------------------------------------------------------------
# About 4.6 MB: large enough that a save takes tens of milliseconds, so random kills land inside saves.
_F32_LEAVES = {
    ("model", "embed"): (512, 1024),  # sharded over 2 devices in the worker: two chunk files
    ("model", "layers", 0, "w"): (256, 256),
    ("model", "layers", 1, "w"): (256, 256),
    ("model", "layers", 0, "b"): (256,),
    ("model", "layers", 1, "b"): (256,),
    ("opt_state", "mu", "embed"): (512, 512),
}


_NORM_BASE = np.linspace(-2, 2, 1024, dtype=np.float32)  # the bf16 leaf is round(base * (step + 1))


def _leaf_seed(path) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(repr(path)))


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _put(tree, path, value):
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def _skeleton() -> dict:
    layers = [{"w": None, "b": None}, {"w": None, "b": None}]
    return {"model": {"embed": None, "layers": layers, "norm": None},
            "opt_state": {"mu": {"embed": None}, "count": None}, "step": None}


def _base_and_delta(path, shape):
    rng = np.random.default_rng(_leaf_seed(path))
    base = rng.standard_normal(shape, dtype=np.float32)
    delta = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.01)).astype(np.float32)
    return base, delta


def expected_state(step: int) -> dict:
    """The state after ``step`` updates, as numpy (what every checkpoint ``step-N`` must hold).

    float32 leaves: ``base + delta + delta + ...`` (``step`` additions, in order), the same IEEE
    additions the worker does in XLA. The bf16 ``norm`` and the int counters are functions of the step.
    """
    tree = _skeleton()
    for path, shape in _F32_LEAVES.items():
        base, delta = _base_and_delta(path, shape)
        for _ in range(step):
            base = base + delta
        _put(tree, path, base)
    import ml_dtypes

    tree["model"]["norm"] = (_NORM_BASE * np.float32(step + 1)).astype(ml_dtypes.bfloat16)
    tree["opt_state"]["count"] = np.int32(step)
    tree["step"] = np.int32(step)
    return tree


def numpy_template() -> dict:
    """A template for ``load_checkpoint`` that restores every leaf as numpy (no devices needed)."""
    return expected_state(0)


# -- jobs ----------------------------------------------------------------------------------------------
def _ckpt_job(base: str, steps: int, keep_every: int) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from levanter.checkpoint import (
        Checkpointer,
        CheckpointInterval,
        load_checkpoint,
        read_checkpoint_metadata,
    )

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    row_sharded = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    def sharding(path):
        return row_sharded if path[-1] == "embed" else replicated

    def to_device(tree):
        out = _skeleton()
        for path in _F32_LEAVES:
            _put(out, path, jax.device_put(_get(tree, path), sharding(path)))
        out["model"]["norm"] = jax.device_put(tree["model"]["norm"], replicated)
        out["opt_state"]["count"] = jax.device_put(np.asarray(tree["opt_state"]["count"]), replicated)
        out["step"] = jax.device_put(np.asarray(tree["step"]), replicated)  # a jax scalar, as in training
        return out

    deltas = [jax.device_put(_base_and_delta(p, shape)[1], sharding(p)) for p, shape in _F32_LEAVES.items()]

    norm_base = jax.device_put(_NORM_BASE, replicated)

    @jax.jit
    def update(state, deltas, norm_base):
        new = jax.tree.map(lambda x: x, state)
        for path, delta in zip(_F32_LEAVES, deltas):
            _put(new, path, _get(state, path) + delta)
        s = state["step"] + 1
        new["model"]["norm"] = (norm_base * (s + 1).astype(jnp.float32)).astype(jnp.bfloat16)
        new["opt_state"]["count"] = state["opt_state"]["count"] + 1
        new["step"] = s
        return new

    # save_interval 0: a temporary checkpoint after every step (each deleting its predecessor).
    keep = [CheckpointInterval(every=keep_every)]
    ckpt = Checkpointer(base, save_interval=datetime.timedelta(0), keep=keep)
    state = to_device(expected_state(0))
    latest = ckpt.latest_checkpoint()
    start = 0
    if latest is not None:
        start = int(read_checkpoint_metadata(latest)["step"])
        state = load_checkpoint(state, latest)
        want = expected_state(start)
        for (path, got), (_, exp) in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                          jax.tree_util.tree_flatten_with_path(want)[0]):
            got = np.asarray(got)
            if got.dtype != exp.dtype or got.tobytes() != np.asarray(exp).tobytes():
                raise AssertionError(f"resumed from {latest}: leaf {jax.tree_util.keystr(path)} differs")
    jax.block_until_ready(update(state, deltas, norm_base))  # compile before the timed part
    _emit({"event": "loop", "pid": os.getpid(), "start": start})
    for step in range(start + 1, steps + 1):
        state = update(state, deltas, norm_base)
        ckpt.on_step(state, step, force=step == steps)
    ckpt.on_step(state, steps, force=True)  # resumed at the end: finishes the clean-up of temporaries
    ckpt.wait_until_finished()  # the last write runs in the background


def _cache_job(out: str, shards: list, batch_size: int) -> None:
    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache

    tokenizer = ByteTokenizer()
    _emit({"event": "loop", "pid": os.getpid()})
    build_or_load_cache(shards, out, tokenizer, options=CacheOptions(num_workers=1, batch_size=batch_size),
                        progress=False)


JOBS = {"ckpt": _ckpt_job, "cache": _cache_job}


# -- the server ----------------------------------------------------------------------------------------
def _emit(obj) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())  # one write: lines from server and children never mix


def serve() -> None:
    # Import (never initialise) everything the children need, so forking is cheap and safe.
    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
    import ml_dtypes  # noqa: F401
    import tensorstore  # noqa: F401

    import levanter.checkpoint  # noqa: F401
    import levanter.ingest.build  # noqa: F401
    import levanter.ingest.tokenization  # noqa: F401

    _emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks of a hung job
            try:
                JOBS[req["job"]](**req["args"])
                _emit({"event": "done", "pid": os.getpid()})
                if req.get("linger"):
                    while True:
                        time.sleep(3600)
            except BaseException:  # noqa: BLE001 -- reported through the exit status and stderr
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        _emit({"event": "started", "pid": pid})
        _, status = os.waitpid(pid, 0)
        _emit({"event": "exit", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
