"""Fault injection at random moments (the fixed-point SIGKILL tests live in test_checkpoint/test_cache):

* checkpoint saves SIGKILLed at 20 random moments: no half-written checkpoint is ever visible, the
  latest complete one holds exactly its step's values, and a rerun ends byte-identical to a run that
  was never interrupted;
* cache builds SIGKILLed at 10 random moments: the committed prefix is valid, and a rerun ends
  byte-identical to an uninterrupted build;
* flaky storage: ~10% of reads fail with transient errors, the loader retries and yields exactly the
  fault-free batches; a permanent error (or transient errors beyond ``retries``) is a DataLoadError
  naming the step and the indices, raised at that step;
* cache chunks that vanish or fail their checksum while a real run reads them: put back after the first
  failed read, the run retries and its losses equal an undisturbed run's; gone for good, the run stops
  with one DataLoadError naming the step, the chunk and the cache to delete;
* a non-finite loss: stops the run (FloatingPointError naming the step) by default, or with
  crash_on_nan/crash_on_inf off the bad steps are skipped (logged as train/skipped_step = 1) and the
  parameters never change at those steps nor become NaN.

The kill tests run their victims in children of a fork server (tests/fault_worker.py) that has
imported JAX once, so a trial costs the job's own time rather than a Python + JAX start-up.
"""

import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import haliax as hax
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from helpers import tree_bytes
from levanter.checkpoint import (
    METADATA_FILENAME,
    discover_latest_checkpoint,
    load_checkpoint,
    read_checkpoint_metadata,
)
from levanter.data.dataset import AsyncDataset, ListAsyncDataset
from levanter.data.load_errors import DataLoadError, TransientDataError
from levanter.data.loader import DataLoader
from levanter.data.mixture import MixtureDataset
from levanter.store import CacheLedger, JaggedArrayStore, TokenCache

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers


def _load_helper(name):
    path = os.path.join(HERE, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_fault_injection_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fault_worker = _load_helper("fault_worker")


# ---------------------------------------------------------------------------------------------------
# The fork server
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunResult:
    returncode: int
    finished: bool  # the job completed ("done") -- for a killed run: before the kill landed
    loop_seconds: float | None  # from the child's "loop" event to "done" (None if it never got there)


class ForkServer:
    def __init__(self, workdir, devices: int = 2):
        env = dict(os.environ)
        env.pop("LEVANTER_FAULT_KILL_AT", None)
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            OPENBLAS_NUM_THREADS="1",  # no BLAS thread in the server at fork time
            # Children compile the same small function again and again: share it on disk.
            JAX_COMPILATION_CACHE_DIR=os.path.join(workdir, "jax-cache"),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
        self.log_path = os.path.join(workdir, "fork-server.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fault_worker.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, bufsize=1,
        )
        self.events: queue.Queue = queue.Queue()
        self.current_pid = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next(lambda e: e["event"] == "ready", timeout=180)

    def _read(self):
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "server-gone"})

    def log_tail(self, n=3000) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def _next(self, pred, timeout):
        """Events until one satisfies ``pred``; returns (that event, the ones before it)."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            left = deadline - time.monotonic()
            try:
                ev = self.events.get(timeout=max(left, 0.001))
            except queue.Empty:
                pid = self.current_pid
                if pid is not None:  # not reaped yet (no "exit" event), so the pid is still the child's
                    try:
                        os.kill(pid, signal.SIGUSR1)  # the child dumps its stacks into the log...
                        time.sleep(2)
                        os.kill(pid, signal.SIGKILL)  # ...and goes, so the server can serve the next trial
                    except ProcessLookupError:
                        pass
                raise AssertionError(
                    f"fork server: no expected event within {timeout}s (child {pid}, events so far "
                    f"{seen})\n{self.log_tail(20000)}"
                ) from None
            if ev["event"] == "server-gone":
                raise AssertionError(f"fork server died\n{self.log_tail()}")
            if pred(ev):
                return ev, seen
            seen.append(ev)

    def run(self, job: str, args: dict, *, kill_after: float | None = None, timeout: float = 180):
        """Run ``job``; with ``kill_after``, SIGKILL the child that many seconds after its "loop" event."""
        self.current_pid = None
        request = {"job": job, "args": args, "linger": kill_after is not None}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        # The child's own events may overtake the server's "started": collect everything in one list.
        events = []
        times = {}

        def wait_for(*kinds):
            while True:
                for e in events:
                    if e["event"] in kinds:
                        return e
                ev, _ = self._next(lambda e: True, timeout)
                times.setdefault(ev["event"], time.monotonic())
                events.append(ev)
                if ev["event"] == "started":
                    self.current_pid = ev["pid"]
                elif ev["event"] == "exit":
                    self.current_pid = None

        pid = wait_for("started")["pid"]
        if kill_after is not None and wait_for("loop", "exit")["event"] == "loop":
            time.sleep(max(0.0, times["loop"] + kill_after - time.monotonic()))
            os.kill(pid, signal.SIGKILL)  # the child lingers after finishing, so the pid is still its own
        exit_ev = wait_for("exit")
        assert all(e["pid"] == pid for e in events), events
        finished = "done" in times
        loop_seconds = times["done"] - times["loop"] if finished and "loop" in times else None
        return RunResult(exit_ev["returncode"], finished, loop_seconds)

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def fork_server(tmp_path):
    server = ForkServer(str(tmp_path))
    yield server
    server.close()


def run_trials(n, trial_fn):
    """Run ``trial_fn(i)`` for each trial; an AssertionError fails the trial, not the loop. Returns
    (number passed, details of the failures)."""
    passed, failures = 0, []
    for i in range(n):
        try:
            note = trial_fn(i)
            passed += 1
            print(f"trial {i:2d} ok   {note}", flush=True)
        except AssertionError as e:
            text = str(e) or repr(e)
            print(f"trial {i:2d} FAIL {text.splitlines()[0]}", flush=True)
            failures.append(f"trial {i}: {text[:3000]}")
    return passed, failures


# ---------------------------------------------------------------------------------------------------
# 1. Checkpoint saves killed at random moments
# ---------------------------------------------------------------------------------------------------
CKPT_STEPS, CKPT_KEEP_EVERY, CKPT_TRIALS = 10, 4, 20
_STEP_DIR = re.compile(r"^step-(\d+)$")


def assert_checkpoint_holds_step(path, step):
    assert read_checkpoint_metadata(path)["step"] == step, path
    got = load_checkpoint(fault_worker.numpy_template(), path)
    want = fault_worker.expected_state(step)
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (kp, g), (_, w) in zip(flat_got, flat_want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (path, jax.tree_util.keystr(kp))
        assert g.tobytes() == w.tobytes(), f"{path}: leaf {jax.tree_util.keystr(kp)} is not step {step}'s"


def snapshot(base):
    """Every file under ``base``: bytes, except metadata.json, compared parsed and without its timestamp."""
    out = {}
    for root, dirs, files in os.walk(base):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            rel = os.path.relpath(p, base)
            with open(p, "rb") as fh:
                data = fh.read()
            if f == METADATA_FILENAME:
                doc = json.loads(data)
                doc.pop("timestamp")
                data = doc
            out[rel] = data
    return out


def describe_diff(a: dict, b: dict) -> str:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return f"only in result: {only_a[:5]}, only in reference: {only_b[:5]}, differing: {differ[:5]}"


@pytest.mark.slow
def test_checkpoint_saves_survive_sigkill_at_random_moments(tmp_path, fork_server):
    t_start = time.monotonic()
    args = lambda base: {"base": str(base), "steps": CKPT_STEPS, "keep_every": CKPT_KEEP_EVERY}  # noqa: E731

    # The uninterrupted run, twice (the first also fills the compilation cache the children share).
    loop_times = []
    for name in ("warm-up", "ref"):
        ref = fork_server.run("ckpt", args(tmp_path / name))
        assert ref.returncode == 0, fork_server.log_tail()
        loop_times.append(ref.loop_seconds)
    ref_dir = tmp_path / "ref"
    assert sorted(os.listdir(ref_dir)) == ["step-10", "step-4", "step-8"]  # permanent ones only, no .tmp-*
    for entry in os.listdir(ref_dir):
        assert_checkpoint_holds_step(str(ref_dir / entry), int(entry.split("-")[1]))
    reference = snapshot(ref_dir)
    assert reference == snapshot(tmp_path / "warm-up")  # the format itself is deterministic
    loop_seconds = min(loop_times)  # the other agents on the machine only ever slow a run down
    print(f"\nreference run: {CKPT_STEPS} steps, saving loop {loop_seconds * 1000:.0f} ms")

    rng = random.Random(20240611)
    stats = Counter()

    def trial(i):
        nonlocal loop_seconds
        base = tmp_path / f"trial{i:02d}"
        delay = rng.uniform(0.0, loop_seconds)
        killed = fork_server.run("ckpt", args(base), kill_after=delay)
        if killed.finished:  # the reference ran slow (a busy machine): aim the next kills inside the run
            loop_seconds = min(loop_seconds, killed.loop_seconds)
        assert killed.returncode == -signal.SIGKILL, f"status {killed.returncode}\n{fork_server.log_tail()}"
        entries = sorted(os.listdir(base)) if base.exists() else []
        partial_saves = [e for e in entries if e.startswith(".tmp-step-")]
        partial_deletes = [e for e in entries if e.startswith(".tmp-delete-")]
        steps = []
        for e in entries:
            if e.startswith(".tmp-"):
                continue
            m = _STEP_DIR.match(e)
            assert m, f"unexpected entry {e!r} in the checkpoint directory"
            # A step-N directory exists only once complete: nothing half-written is ever visible.
            assert os.path.isfile(base / e / METADATA_FILENAME), f"{e} is visible without {METADATA_FILENAME}"
            steps.append(int(m.group(1)))
            assert_checkpoint_holds_step(str(base / e), int(m.group(1)))
        latest = discover_latest_checkpoint(str(base)) if base.exists() else None
        if steps:
            assert latest == str(base / f"step-{max(steps)}"), latest
        else:
            assert latest is None
        stats["mid_save"] += bool(partial_saves)
        stats["mid_delete"] += bool(partial_deletes)
        stats["finished_before_kill"] += killed.finished
        stats[f"latest={max(steps) if steps else None}"] += 1

        resumed = fork_server.run("ckpt", args(base))
        assert resumed.returncode == 0, f"rerun failed ({resumed.returncode})\n{fork_server.log_tail()}"
        got = snapshot(base)
        assert got == reference, describe_diff(got, reference)
        assert_checkpoint_holds_step(str(base / f"step-{CKPT_STEPS}"), CKPT_STEPS)
        shutil.rmtree(base)
        where = "mid-save" if partial_saves else "mid-delete" if partial_deletes else "between saves"
        if killed.finished:
            where = "after the run finished"
        latest_name = f"step-{max(steps)}" if steps else "none"
        return (f"kill at +{delay * 1000:4.0f} ms ({where}): latest complete {latest_name}, "
                f"steps on disk {sorted(steps)} -> rerun identical")

    passed, failures = run_trials(CKPT_TRIALS, trial)
    print(f"checkpoint kill trials: {passed}/{CKPT_TRIALS} passed; {dict(sorted(stats.items()))}; "
          f"{time.monotonic() - t_start:.1f} s")
    assert passed == CKPT_TRIALS, "\n\n".join(failures)
    # The kills must have hit the interesting moments, not just the gaps between saves.
    assert stats["mid_save"] + stats["mid_delete"] >= CKPT_TRIALS // 4, stats


# ---------------------------------------------------------------------------------------------------
# 2. Cache builds killed at random moments
# ---------------------------------------------------------------------------------------------------
CACHE_TRIALS = 10


def write_corpus(directory, n_shards=4, docs_per_shard=650, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "✓", "zeta\n", "eta", "", "theta"]
    paths = []
    for s in range(n_shards):
        p = os.path.join(directory, f"shard{s}.jsonl")
        with open(p, "w", encoding="utf-8") as f:
            for _ in range(docs_per_shard):
                text = " ".join(rng.choice(words, size=int(rng.integers(0, 150))))
                f.write(json.dumps({"text": text}) + "\n")
        paths.append(p)
    return paths


@pytest.mark.slow
def test_cache_builds_survive_sigkill_at_random_moments(tmp_path, fork_server):
    t_start = time.monotonic()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shards = write_corpus(str(corpus))
    size = sum(os.path.getsize(p) for p in shards)
    batch_size = 32
    args = lambda out: {"out": str(out), "shards": shards, "batch_size": batch_size}  # noqa: E731

    loop_times = []
    for name in ("warm-up", "ref"):
        ref = fork_server.run("cache", args(tmp_path / name))
        assert ref.returncode == 0, fork_server.log_tail()
        loop_times.append(ref.loop_seconds)
    loop_seconds = min(loop_times)  # the other agents on the machine only ever slow a run down
    reference = tree_bytes(tmp_path / "ref")
    assert reference == tree_bytes(tmp_path / "warm-up")
    ref_cache = TokenCache.open(str(tmp_path / "ref"))
    n_rows = ref_cache.ledger.total_rows
    ref_rows = ref_cache.store.read_rows_sync(list(range(n_rows)))
    commits = -(-650 // batch_size) * len(shards)
    print(f"\nreference build: {size / 1e6:.2f} MB of jsonl in {len(shards)} shards, {n_rows} documents, "
          f"{commits} commits, {loop_seconds * 1000:.0f} ms")

    rng = random.Random(777)
    stats = Counter()

    def trial(i):
        nonlocal loop_seconds
        out = tmp_path / f"trial{i:02d}"
        delay = rng.uniform(0.0, loop_seconds)
        killed = fork_server.run("cache", args(out), kill_after=delay)
        if killed.finished:  # the reference ran slow (a busy machine): aim the next kills inside the run
            loop_seconds = min(loop_seconds, killed.loop_seconds)
        assert killed.returncode == -signal.SIGKILL, f"status {killed.returncode}\n{fork_server.log_tail()}"
        ledger = CacheLedger.load(str(out)) if out.exists() else None
        committed = ledger.total_rows if ledger is not None else 0
        stats["unfinished"] += not (ledger is not None and ledger.is_finished)
        if ledger is None or not ledger.is_finished:
            with pytest.raises((ValueError, FileNotFoundError)):
                TokenCache.open(str(out))  # an unfinished cache is never served
        if committed:
            # What the ledger counts is valid, whatever the killed writer left past it.
            store = JaggedArrayStore.open(str(out / "input_ids"), mode="r", num_rows=committed)
            got = store.read_rows_sync(list(range(committed)))
            same = all(np.array_equal(g, w) for g, w in zip(got, ref_rows[:committed]))
            assert same, "the committed rows differ from the reference's"
        stats["finished_before_kill"] += killed.finished
        resumed = fork_server.run("cache", args(out))
        assert resumed.returncode == 0, f"rerun failed ({resumed.returncode})\n{fork_server.log_tail()}"
        got = tree_bytes(out)
        extra = set(got) - set(reference)
        orphans = sorted(k for k in extra if os.path.basename(k).startswith(".") and k.endswith(".tmp"))
        if orphans and {k: v for k, v in got.items() if k not in orphans} == reference:
            raise AssertionError(f"the rerun left orphaned temporary file(s) {orphans} of an atomic write "
                                 "the kill interrupted; every other file is byte-identical")
        assert got == reference, describe_diff(got, reference)
        shutil.rmtree(out)
        state = "finished" if ledger is not None and ledger.is_finished else "unfinished"
        return (f"kill at +{delay * 1000:4.0f} ms: {committed:4d}/{n_rows} documents committed ({state}) "
                f"-> rerun byte-identical ({len(got)} files)")

    passed, failures = run_trials(CACHE_TRIALS, trial)
    print(f"cache kill trials: {passed}/{CACHE_TRIALS} passed; {dict(stats)}; "
          f"{time.monotonic() - t_start:.1f} s")
    assert passed == CACHE_TRIALS, "\n\n".join(failures)
    assert stats["unfinished"] >= CACHE_TRIALS // 3, stats  # kills landed inside builds, not after them


# ---------------------------------------------------------------------------------------------------
# 3. Flaky storage
# ---------------------------------------------------------------------------------------------------
FLAKY_ERRORS = (TransientDataError, OSError, TimeoutError, ConnectionError)


class FlakyDataset(AsyncDataset):
    """Fails a read with probability ``p`` (a transient error type) after a small random latency.

    The outcome of attempt ``a`` at step ``s`` is drawn from ``rng(seed, s, a)``, so which reads fail does
    not depend on the order in which the prefetcher issues them.
    """

    def __init__(self, inner: AsyncDataset, p: float, seed: int):
        self.inner, self.p, self.seed = inner, p, seed
        self.attempts: Counter = Counter()
        self.failures: Counter = Counter()
        self._lock = threading.Lock()

    @staticmethod
    def outcome(seed, p, step, attempt):
        r = np.random.default_rng([seed, step, attempt])
        latency = r.random() * 0.002
        fails = r.random() < p
        return latency, (FLAKY_ERRORS[int(r.integers(len(FLAKY_ERRORS)))] if fails else None)

    async def get_batch(self, step, indices):
        with self._lock:
            attempt = self.attempts[step]
            self.attempts[step] += 1
        latency, error = self.outcome(self.seed, self.p, step, attempt)
        await asyncio.sleep(latency)  # reads finish out of order
        if error is not None:
            with self._lock:
                self.failures[step] += 1
            raise error(f"simulated flaky read at step {step} (attempt {attempt + 1})")
        return await self.inner.get_batch(step, indices)

    async def async_len(self):
        return await self.inner.async_len()

    def is_finite(self):
        return self.inner.is_finite()


def make_mixture(batch_size):
    sources = {}
    for k, (name, n) in enumerate([("prose", 301), ("code", 517), ("math", 89)]):
        # Example i of source k holds 1_000_000 * k + 1000 * i + (0..5): values name where they came from.
        examples = [{"tokens": np.arange(6, dtype=np.int32) + 1000 * i + 1_000_000 * k, "source": np.int32(k)}
                    for i in range(n)]
        sources[name] = ListAsyncDataset(examples).shuffle(key=k)
    weights = [(0, {"prose": 0.5, "code": 0.3, "math": 0.2}), (40, {"code": 0.5, "math": 0.5})]
    return MixtureDataset(sources, weights, batch_schedule=batch_size, key=3, stop_strategy="restart")


def mesh8():
    return Mesh(np.asarray(jax.devices()), ("data",))


def collect(loader, steps):
    with loader.iter_from_step(0, steps) as it:
        return [(b.step, b.global_offset, jax.tree.map(np.asarray, b.data)) for b in it]


@pytest.mark.parametrize("prefetch", [8, 0])
def test_flaky_storage_is_retried_and_batches_are_unchanged(prefetch):
    t0 = time.monotonic()
    steps, batch_size, p, seed = 100, 8, 0.1, 5
    clean_loader = DataLoader(make_mixture(batch_size), batch_size, mesh=mesh8(), prefetch_depth=prefetch)
    clean = collect(clean_loader, steps)
    flaky_ds = FlakyDataset(make_mixture(batch_size), p, seed)
    loader = DataLoader(flaky_ds, batch_size, mesh=mesh8(), prefetch_depth=prefetch, retries=8,
                        retry_backoff=0.001)
    flaky = collect(loader, steps)

    assert [s for s, _, _ in flaky] == list(range(steps))
    for (s, off, a), (_, off2, b) in zip(flaky, clean):
        assert off == off2 and jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.dtype == y.dtype and np.array_equal(x, y), f"step {s} differs after retries"
    # The faults really happened, exactly where the seeded draws put them.
    expected = Counter()
    for s in range(steps):
        a = 0
        while FlakyDataset.outcome(seed, p, s, a)[1] is not None:
            expected[s] += 1
            a += 1
    assert flaky_ds.failures == expected
    assert flaky_ds.attempts == Counter({s: 1 + expected[s] for s in range(steps)})
    total = sum(expected.values())
    assert total >= 5 and max(expected.values()) >= 2  # several faults; a step that failed twice in a row
    print(f"\nprefetch {prefetch}: {total} transient failures over {sum(flaky_ds.attempts.values())} reads "
          f"({len(expected)} of {steps} steps retried, worst step {max(expected.values())} failures), "
          f"batches identical; {time.monotonic() - t0:.2f} s")


class BrokenAt(AsyncDataset):
    """Delegates, except at ``step`` where every read raises ``error``."""

    def __init__(self, inner, step, error):
        self.inner, self.step, self.error = inner, step, error
        self.calls: Counter = Counter()

    async def get_batch(self, step, indices):
        self.calls[step] += 1
        if step == self.step:
            raise self.error
        return await self.inner.get_batch(step, indices)

    async def async_len(self):
        return await self.inner.async_len()

    def is_finite(self):
        return self.inner.is_finite()


@pytest.mark.parametrize("prefetch", [8, 0])
@pytest.mark.parametrize(
    "step, error, attempts",
    [
        (5, ValueError("row 43 is malformed"), 1),  # permanent: not retried
        (7, TransientDataError("the bucket is gone"), 4),  # transient, beyond retries=3
    ],
)
def test_permanent_errors_name_the_step_and_indices(prefetch, step, error, attempts):
    batch_size = 8
    clean = collect(DataLoader(make_mixture(batch_size), batch_size, mesh=mesh8(), prefetch_depth=0), step)
    ds = BrokenAt(make_mixture(batch_size), step, error)
    loader = DataLoader(ds, batch_size, mesh=mesh8(), prefetch_depth=prefetch, retries=3, retry_backoff=0.001)
    got = []
    with loader.iter_from_step(0, 30) as it:
        with pytest.raises(DataLoadError) as info:
            for b in it:
                got.append((b.step, b.global_offset, jax.tree.map(np.asarray, b.data)))
        # The error surfaces at its own step: every earlier batch was delivered, and intact.
        assert [s for s, _, _ in got] == list(range(step))
        for (_, _, a), (_, _, b) in zip(got, clean):
            assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        first, last = step * batch_size, step * batch_size + batch_size - 1
        msg = str(info.value)
        assert f"at step {step} " in msg and f"global indices {first}..{last} (8 rows)" in msg, msg
        assert f"after {attempts} attempt" in msg and type(error).__name__ in msg and str(error) in msg, msg
        assert info.value.step == step and info.value.indices.tolist() == list(range(first, last + 1))
        assert info.value.__cause__ is error
        assert ds.calls[step] == attempts  # permanent: not retried; transient: retries + 1 attempts
        with pytest.raises(DataLoadError):  # the iterator stays dead
            next(it)


# ---------------------------------------------------------------------------------------------------
# 4. Non-finite loss
# ---------------------------------------------------------------------------------------------------
def nan_config(tmp_path, name, *, steps, crash, lr=1e-2):
    from levanter.checkpoint import CheckpointerConfig, CheckpointInterval
    from levanter.data.config import UrlSingleDatasetLMConfig
    from levanter.main import train_lm
    from levanter.models import Gpt2Config
    from levanter.optim import AdamConfig
    from levanter.tracker import JsonConfig
    from levanter.training import TrainerConfig

    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        write_corpus(str(corpus), n_shards=1, docs_per_shard=200, seed=11)
    return train_lm.TrainLmConfig(
        data=UrlSingleDatasetLMConfig(train_urls=[str(corpus / "shard0.jsonl")], tokenizer="byte",
                                      cache_dir=str(tmp_path / "cache"), shuffle=True),
        model=Gpt2Config(hidden_dim=32, num_heads=4, num_layers=1, seq_len=32, gradient_checkpointing=False),
        trainer=TrainerConfig(
            num_train_steps=steps, train_batch_size=8, require_accelerator=False, id=name,
            log_dir=str(tmp_path / "logs"), tracker=JsonConfig(), steps_per_eval=1000,
            checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt"),
                                            keep=[CheckpointInterval(every=1)]),
            **({} if crash else {"crash_on_nan": False, "crash_on_inf": False}),
        ),
        optimizer=AdamConfig(learning_rate=lr, warmup=0.0, weight_decay=0.0, lr_schedule="constant"),
        prefetch_depth=2,
    )


def read_metrics(tmp_path, run_id):
    with open(tmp_path / "logs" / run_id / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f) if "train/loss" in r}


def checkpoint_arrays(path):
    """Every stored array of a checkpoint, by leaf name (read straight from the zarr arrays)."""
    import tensorstore as ts

    out = {}
    for rec in read_checkpoint_metadata(str(path))["leaves"]:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, rec["name"])}}
        out[rec["name"]] = ts.open(spec, open=True).result().read().result()
    return out


def test_divergence_stops_the_run_by_default(tmp_path):
    """A learning rate of 1e30: step 0 is fine, its update makes the weights ~1e30, and step 1's forward
    pass overflows to NaN. The default config stops there, naming the step, without applying it."""
    from levanter.main import train_lm

    t0 = time.monotonic()
    msg = r"train/loss is (NaN|infinite) at step 1; training stopped and the state after this step was not saved"
    with pytest.raises(FloatingPointError, match=msg):
        train_lm.main(nan_config(tmp_path, "diverge", steps=4, crash=True, lr=1e30))
    ckpt = tmp_path / "ckpt" / "diverge"
    assert sorted(os.listdir(ckpt)) == ["step-1"]  # the last good state; step 1's update never happened
    arrays = checkpoint_arrays(ckpt / "step-1")
    assert all(np.isfinite(a).all() for a in arrays.values() if np.issubdtype(a.dtype, np.floating))
    rows = read_metrics(tmp_path, "diverge")
    assert sorted(rows) == [0] and np.isfinite(rows[0]["train/loss"])  # step 1 raised before it was logged
    print(f"\ndivergence stopped at step 1 ({time.monotonic() - t0:.1f} s)")


def test_check_finite_flags():
    from levanter.training import TrainerConfig, check_finite

    default = TrainerConfig()
    check_finite(2.5, 3, default)
    with pytest.raises(FloatingPointError, match=r"NaN at step 3.*crash_on_nan: false"):
        check_finite(float("nan"), 3, default)
    with pytest.raises(FloatingPointError, match=r"infinite at step 4.*crash_on_inf: false"):
        check_finite(float("-inf"), 4, default)
    only_inf = TrainerConfig(crash_on_nan=False)
    check_finite(float("nan"), 3, only_inf)
    with pytest.raises(FloatingPointError, match="infinite at step 5"):
        check_finite(float("inf"), 5, only_inf)
    check_finite(float("inf"), 5, TrainerConfig(crash_on_nan=False, crash_on_inf=False))


# Poisoning: every step's batch gains a "poison" column, zero but for a mark at [0, 0] on the chosen steps:
# -1 (NaN) or -2 (inf); the wrapped loss drops the column and multiplies the loss by NaN or inf, so the
# loss *and* every gradient of that step are non-finite -- what a real divergence looks like to the trainer.
NAN_MARK, INF_MARK = -1, -2


def test_non_finite_steps_are_skipped_when_allowed(tmp_path, monkeypatch):
    import jax.numpy as jnp

    import levanter.run.state
    from levanter.main import train_lm

    t0 = time.monotonic()
    poison = {2: NAN_MARK, 4: INF_MARK}
    original_loss, original_fetch = train_lm.lm_loss_fn, DataLoader.fetch

    def poisoned_loss_fn(z_loss_weight=0.0, eos_id=None, quantization=None):
        inner = original_loss(z_loss_weight, eos_id, quantization)

        def loss(model, batch):
            # The mark rides in the first token of the batch (a negative id no tokenizer makes), so the
            # batch keeps the structure the step was compiled for ahead of time; the loss sees token 0 there.
            tokens = batch["tokens"]
            marks = tokens.array[0, 0]
            scale = jnp.where(marks == NAN_MARK, jnp.nan, jnp.where(marks == INF_MARK, jnp.inf, 1.0))
            clean = tokens.array.at[0, 0].set(jnp.maximum(marks, 0))
            total, count, extra = inner(model, {**batch, "tokens": hax.named(clean, tokens.axes)})
            return total * scale, count, extra

        return loss

    async def poisoned_fetch(self, step, *args, **kwargs):
        batch = await original_fetch(self, step, *args, **kwargs)
        if step not in poison:
            return batch
        arr = batch.data["tokens"]
        host = np.asarray(jax.device_get(arr)).copy()
        host[0, 0] = poison[step]
        marked = jax.make_array_from_callback(host.shape, arr.sharding, lambda idx: host[idx])
        return dataclasses.replace(batch, data={**batch.data, "tokens": marked})

    monkeypatch.setattr(levanter.run.state, "lm_loss_fn", poisoned_loss_fn)
    monkeypatch.setattr(DataLoader, "fetch", poisoned_fetch)
    steps = 6
    out = train_lm.main(nan_config(tmp_path, "skip", steps=steps, crash=False))
    assert out["final_step"] == steps

    rows = read_metrics(tmp_path, "skip")
    assert sorted(rows) == list(range(steps))
    skipped = {s: r["train/skipped_step"] for s, r in rows.items()}
    assert skipped == {s: int(s in poison) for s in range(steps)}
    assert np.isnan(rows[2]["train/loss"]) and np.isinf(rows[4]["train/loss"])
    assert all(np.isfinite(rows[s]["train/loss"]) for s in range(steps) if s not in poison)

    ckpt = tmp_path / "ckpt" / "skip"
    states = {s: checkpoint_arrays(ckpt / f"step-{s}") for s in range(1, steps + 1)}
    for s, arrays in states.items():
        floats = [a for a in arrays.values() if np.issubdtype(a.dtype, np.floating)]
        assert floats and all(np.isfinite(a).all() for a in floats), f"non-finite values in step-{s}"
    for bad in poison:
        # step-k holds the state after k updates: a skipped step k changes nothing but the step counter.
        before, after = states[bad], states[bad + 1]
        assert set(before) == set(after)
        for name in before:
            if name != "step":
                same = before[name].tobytes() == after[name].tobytes()
                assert same, f"{name} changed at skipped step {bad}"
    # ...while a good step does change the parameters.
    assert any(states[1][n].tobytes() != states[2][n].tobytes() for n in states[1] if n.startswith("model/"))
    print(f"\nskipped steps {sorted(poison)} (NaN, inf), parameters finite and untouched there "
          f"({time.monotonic() - t0:.1f} s)")


# ---------------------------------------------------------------------------------------------------
# 5. Cache chunks that vanish or go bad while a run reads them
# ---------------------------------------------------------------------------------------------------
class _OnLog(logging.Handler):
    """Runs ``action`` (once) when a record whose message contains ``text`` is logged -- synchronously, in
    the thread that logs it, so the fault lands at a known point of the real run."""

    def __init__(self, text, action):
        super().__init__()
        self.text, self.action, self.fired = text, action, 0

    def emit(self, record):
        if not self.fired and self.text in record.getMessage():
            self.fired += 1
            self.action()


class _ChunkFaults:
    """Takes a cache's token chunks away -- the even ones vanish, the odd ones are replaced by a copy with
    a flipped bit -- and puts the originals back."""

    def __init__(self, cache_dir):
        self.dir = os.path.join(cache_dir, "input_ids", "data", "c")
        self.away = os.path.join(cache_dir, "chunks-away")
        self.chunks = sorted(os.listdir(self.dir), key=int)

    def take_away(self):
        os.makedirs(self.away)
        for name in self.chunks:
            os.rename(os.path.join(self.dir, name), os.path.join(self.away, name))
            if int(name) % 2:
                data = bytearray(open(os.path.join(self.away, name), "rb").read())
                data[len(data) // 2] ^= 0x01
                with open(os.path.join(self.dir, name), "wb") as f:
                    f.write(bytes(data))

    def put_back(self):
        for name in self.chunks:
            os.replace(os.path.join(self.away, name), os.path.join(self.dir, name))


def _resumed_run(tmp_path, name, steps, from_ckpt, faults, *, restore):
    """``train_lm.main`` of run ``name`` from checkpoint ``from_ckpt``: the chunks are taken away as the run
    restores the checkpoint (after the cache was opened and checked, before the loader's first read), and
    put back when the loader reports its first failed read if ``restore``."""
    from levanter.main import train_lm

    config = nan_config(tmp_path, name, steps=steps, crash=True)
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, load_checkpoint_path=from_ckpt))
    take = _OnLog("resuming from checkpoint", faults.take_away)
    back = _OnLog("transient error reading step", faults.put_back if restore else lambda: None)
    loggers = [logging.getLogger("levanter.checkpoint.resume"), logging.getLogger("levanter.data.loader")]
    levels = [lg.level for lg in loggers]
    for lg, h in zip(loggers, (take, back)):
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
    try:
        return train_lm.main(config), take, back
    finally:
        for lg, h, level in zip(loggers, (take, back), levels):
            lg.removeHandler(h)
            lg.setLevel(level)


@pytest.mark.slow
def test_cache_chunks_failing_during_training_are_retried_or_stop_the_run(tmp_path):
    """A real run whose cache chunks vanish or fail their checksum while the loader reads them: with the
    chunks back after the first failed read, the run retries and its per-step losses are exactly those of
    an undisturbed run (no batch of fill values was trained on); with the chunks gone for good, it stops
    with one DataLoadError naming the step, the chunk and the cache, and saves nothing past it."""
    from levanter.main import train_lm

    t0 = time.monotonic()
    steps, resume_at = 8, 3
    out = train_lm.main(nan_config(tmp_path, "undisturbed", steps=steps, crash=True))
    assert out["final_step"] == steps
    reference = read_metrics(tmp_path, "undisturbed")
    ckpt = str(tmp_path / "ckpt" / "undisturbed" / f"step-{resume_at}")
    cache = str(tmp_path / "cache" / "train")
    faults = _ChunkFaults(cache)
    assert len(faults.chunks) >= 4, faults.chunks  # shuffled windows of every step touch several chunks

    out, take, back = _resumed_run(tmp_path, "flaky", steps, ckpt, faults, restore=True)
    assert take.fired == 1 and back.fired == 1, "the faults did not land where the run reads"
    assert out["final_step"] == steps
    flaky = read_metrics(tmp_path, "flaky")
    assert sorted(flaky) == list(range(resume_at, steps))
    for s in flaky:
        assert flaky[s]["train/loss"] == reference[s]["train/loss"], f"step {s}: the retried run trained on other data"

    shutil.rmtree(faults.away)
    with pytest.raises(DataLoadError) as info:
        _resumed_run(tmp_path, "gone", steps, ckpt, faults, restore=False)
    msg = str(info.value)
    assert info.value.step == resume_at and f"data loading failed at step {resume_at} " in msg, msg
    assert re.search(rf"chunk {re.escape(faults.dir)}/\d+ of the cache at {re.escape(cache)} is "
                     r"(missing|corrupt \(checksum mismatch\))", msg), msg
    assert msg.endswith(f"The cache is damaged: delete {cache} to rebuild it."), msg
    saved = os.listdir(tmp_path / "ckpt" / "gone") if os.path.exists(tmp_path / "ckpt" / "gone") else []
    assert not [d for d in saved if d.startswith("step-")], saved  # nothing trained, nothing saved
    logged = tmp_path / "logs" / "gone" / "metrics.jsonl"
    assert not logged.exists() or not read_metrics(tmp_path, "gone")
    print(f"\nchunks vanished/corrupted for one read: retried, losses identical; gone for good: one error "
          f"({time.monotonic() - t0:.1f} s)")
