#!/usr/bin/env python
"""What a background checkpoint save costs the training loop of a real ``train_lm`` run.

    .venv/bin/python scripts/bench/checkpoint_loop.py --config config/bench/llama_350m_tpu.yaml --every 8
    .venv/bin/python scripts/bench/checkpoint_loop.py --config config/bench/llama_350m_tpu.yaml --every 8 \\
        --policies auto,host,pinned-async --verify --json out.json    # the copies side by side
    .venv/bin/python scripts/bench/checkpoint_loop.py --quick          # CPU: config/gpt2_nano.yaml, 24 steps

Runs ``train_lm`` in this process on ``--config`` (relative data paths resolve from the current directory,
as for the other benchmarks; the bench tokenizer is trained first if missing), with
``trainer.checkpointer.keep: [{every: N}]``, ``save_interval`` far away, the checkpoints and logs in a
temporary directory (deleted afterwards) and the json tracker. Any further arguments are passed on to
train_lm as overrides. Saves run in the background as in any run, except the last one (the final step's
forced save), which is made synchronous: the same state, in the same process, so its time is what a
synchronous save would stop the loop for.

``--writers process,thread`` alternates the same way between writing in the writer process (the default)
and on the writer thread of the training process (``LEVANTER_CHECKPOINT_WRITER``,
``levanter.checkpoint.write_process``); a save's policy is then shown as ``policy/writer``.

``--policies`` names how the background saves copy the state before the loop goes on
(``Checkpointer.snapshot_policy``): ``auto`` (the default: device copies where the devices have room, the
rest copied to host memory, waited for), ``pinned`` (all transferred into pinned host memory),
``pinned-async`` (all transferred, not waited for: the next step is dispatched at once and the runtime
orders it after the transfers) or
``host`` (the copy to host memory: how every save that did not fit on the devices copied before). The first
background save uses the first policy and is a warm-up (it compiles the all-finite check), left out of the
medians; the following saves take the policies in turn, so each is measured in the same run.

From the run's ``metrics.jsonl`` (``throughput/step_seconds``: the wall time between the completions of
consecutive steps as the loop sees them, everything the loop did in between included):

* **steady step**: the median over the steps after ``--skip`` that are neither the step a save follows,
  nor one of the two after it;
* **around a save**: for each background save after step ``s``, the times of step ``s`` (the step whose
  state is saved), ``s + 1`` and ``s + 2``, and **lost**: their sum minus three steady steps (minus the
  ``--verify`` fingerprint's time);
* **blocked**: what ``Checkpointer.on_step`` itself took on the training thread, of which **waited**: the
  wait for the previous save's write (saves closer together than one write takes); **copy**: how the save
  copied the state (``device``, ``pinned``, ``device+pinned``, ``host``); **on host**: seconds from the
  save's start until the writer thread had every copy in host memory (the transfers' end); **write**: the
  background save's whole time, from the call to the commit;
* **dispatch**: the longest call into the train step of the two steps after the save (a runtime that made
  the dispatch wait for the transfers would show here); **stall**: the longest moment, while the save was
  in flight, that a probe thread of this process, waking every 2 ms, could not run (the GIL or the CPUs
  held by something else: what delays the loop's host work); **data wait**: the loop's wait for its
  batches (``data/wait_seconds``) over the three steps around the save;
* **sync save**: the final, synchronous save's time; **ratio**: median lost per save over it (goal
  <= 0.1), per policy.

``--verify``: the state handed to each background save is fingerprinted on its devices (per stored leaf,
the wrapping sum and the xor of its bits as 32-bit words); after training, the last two saves of a policy
other than ``host`` are read back from storage and fingerprinted on the host: ``verified`` says whether
the checkpoint is the state at the save, bit for bit.

The table goes to stdout, then one line of JSON (the last line) with ``steady_step_s``,
``lost_per_save_s`` (median, first policy), ``sync_save_s``, ``ratio``, ``by_policy`` and the per-save rows;
``--json PATH`` writes it to a file too. On the chip, run it with ``--every 8`` (the Llama 350M bench config
trains 40 steps: saves after steps 8, 16, 24 and 32, the synchronous one after step 40; with
``--policies auto,host,pinned-async``: auto after 8 (the warm-up) and 16, host after 24, pinned-async after
32). A run that fails (a save, or a step after one) still reports the saves before the failure, with
``error`` set.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

from _common import note_load_average, parser, print_table, write_json

QUICK = dict(config="config/gpt2_nano.yaml", steps=24, every=8)


class StallProbe(threading.Thread):
    """Wakes every ``period`` seconds; records when it woke more than ``floor`` late: moments this process's
    Python threads could not run (the GIL held, or no CPU free)."""

    def __init__(self, period: float = 0.002, floor: float = 0.005):
        super().__init__(name="stall-probe", daemon=True)
        self.period, self.floor, self.events, self.stopped = period, floor, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            t = time.perf_counter()
            time.sleep(self.period)
            late = time.perf_counter() - t - self.period
            if late > self.floor:
                self.events.append((t, late))

    def worst(self, start: float, end: float) -> float:
        return max((late for t, late in self.events if start <= t <= end), default=0.0)


def _words(x):
    """The bits of a jax array as uint32 words (1- and 2-byte elements widened)."""
    import jax
    import jax.numpy as jnp

    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


@functools.cache
def _fingerprint_fn():
    """One leaf's fingerprint, jitted: compiled once per shape and dtype (a few programs for a model's
    hundreds of leaves, where one program over all of them would take long to compile)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def fingerprint(x):
        w = _words(x)
        xor = jax.lax.reduce(w, np.uint32(0), jax.lax.bitwise_xor, (0,))
        return jnp.stack([jnp.sum(w, dtype=jnp.uint32), xor])

    return jax.jit(fingerprint)


def device_fingerprints(arrays: list) -> list[tuple[int, int]]:
    """(wrapping sum, xor) of each array's bits as uint32 words, reduced on its devices."""
    import jax

    rows = jax.device_get([_fingerprint_fn()(x) for x in arrays])
    return [(int(row[0]), int(row[1])) for row in rows]


def host_fingerprint(a) -> tuple[int, int]:
    import numpy as np

    a = np.ascontiguousarray(a)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    w = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[a.dtype.itemsize]).ravel()
    w = w.astype(np.uint32, copy=False)
    return int(np.sum(w, dtype=np.uint32)), int(np.bitwise_xor.reduce(w)) if w.size else 0


def fingerprint_tree(tree) -> dict[str, tuple[int, int]]:
    """Each stored leaf's fingerprint, by its checkpoint name (what a save writes: ``prepare_leaves``)."""
    import jax

    from levanter.checkpoint.leaf_writes import prepare_leaves

    items = prepare_leaves(tree)
    on_device = [it for it in items if isinstance(it.value, jax.Array)]
    names = [it.record["name"] for it in on_device]
    out = dict(zip(names, device_fingerprints([it.value for it in on_device])))
    out.update({it.record["name"]: host_fingerprint(it.value) for it in items
                if not isinstance(it.value, jax.Array)})
    return out


def fingerprint_checkpoint(path: str) -> dict[str, tuple[int, int]]:
    import tensorstore as ts

    from levanter.checkpoint.layout import read_checkpoint_metadata
    from levanter.checkpoint.tree_format import read_spec
    from levanter.utils import fs

    out = {}
    for leaf in read_checkpoint_metadata(path)["leaves"]:
        store = ts.open(read_spec(fs.join(path, leaf["name"])), open=True).result()
        out[leaf["name"]] = host_fingerprint(store.read().result())
    return out


def _metrics(path: str) -> tuple[dict[int, float], dict[int, float]]:
    """Step seconds and data wait seconds, by step."""
    if not os.path.exists(path):  # a run that failed before its first step
        return {}, {}
    with open(path) as f:
        rows = [r for r in map(json.loads, f) if "throughput/step_seconds" in r]
    return ({r["step"]: r["throughput/step_seconds"] for r in rows},
            {r["step"]: r.get("data/wait_seconds", 0.0) for r in rows})


def _ensure_bench_tokenizer(doc: dict) -> None:
    import tpu

    if (doc.get("data") or {}).get("tokenizer") == tpu.TOKENIZER:
        tpu.ensure_tokenizer()


def run(config: str, steps: int | None, every: int, overrides: list[str], work: str, policies: list[str],
        verify: bool, writers: list[str] | None = None) -> tuple[dict, list, int, dict]:
    """Train; returns (step seconds by step, one record per save, the number of steps, timings: the
    dispatch times in step order and the stall probe)."""
    import yaml

    from levanter.checkpoint import policy, serialization
    from levanter.main import train_lm
    from levanter.training.trainer import Trainer

    with open(config) as f:
        doc = yaml.safe_load(f)
    _ensure_bench_tokenizer(doc)
    num_steps = steps if steps is not None else int(doc["trainer"]["num_train_steps"])
    run_id = f"ckpt-loop-{uuid.uuid4().hex[:6]}"
    records: list[dict] = []
    on_host: dict[int, float] = {}  # step -> when (perf_counter) the writer had the copies on the host
    dispatch: list[float] = []
    originals = (policy.Checkpointer.save, serialization.PreparedSave.copy_to_host, Trainer.train_step)

    def save(self, tree, step, *, is_temporary=False):
        last = int(step) >= num_steps
        started = time.perf_counter()
        fingerprints = fingerprint_tree(tree) if verify and not last else None
        fingerprint_s = time.perf_counter() - started
        if last:  # the same state, saved synchronously: what a synchronous save stops the loop for
            self.wait_until_finished()
            self.asynchronous = False
        k = len(records)
        self.snapshot_policy = policies[0] if k == 0 else policies[(k - 1) % len(policies)]
        writer = None
        if writers:  # read when the write starts, after this save's wait for the previous write
            writer = writers[0] if k == 0 else writers[(k - 1) % len(writers)]
            os.environ["LEVANTER_CHECKPOINT_WRITER"] = writer
        path = originals[0](self, tree, step, is_temporary=is_temporary)
        if records:  # the previous save's write has finished (this one waited for it): its whole time
            records[-1]["write_s"] = self.last_save_s
        name = self.snapshot_policy if writer is None else f"{self.snapshot_policy}/{writer}"
        records.append({"step": int(step), "policy": "sync" if last else name,
                        "copy": "sync" if last else self.last_copy, "blocked_s": self.last_blocked_s,
                        "waited_s": self.last_waited_s, "write_s": None, "started": started + fingerprint_s,
                        "fingerprint_s": fingerprint_s, "fingerprints": fingerprints, "path": path})
        return path

    def copy_to_host(self):
        out = originals[1](self)
        on_host[int(self.step)] = time.perf_counter()
        return out

    def train_step(self, state, batch, batch_size):
        t = time.perf_counter()
        out = originals[2](self, state, batch, batch_size)
        dispatch.append(time.perf_counter() - t)
        return out

    writer_env = os.environ.get("LEVANTER_CHECKPOINT_WRITER")
    probe = StallProbe()
    policy.Checkpointer.save, serialization.PreparedSave.copy_to_host, Trainer.train_step = (
        save, copy_to_host, train_step)
    probe.start()
    error = None
    try:
        train_lm.cli(["--config_path", config, "--trainer.id", run_id, "--trainer.num_train_steps", str(num_steps),
                      "--trainer.log_dir", os.path.join(work, "logs"),
                      "--trainer.checkpointer.base_path", os.path.join(work, "ckpt"),
                      "--trainer.checkpointer.keep", f"[{{every: {every}}}]",
                      "--trainer.checkpointer.save_interval", "1000h",
                      "--trainer.tracker", "[{type: json}]", *overrides])
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the saves before the failure are still reported
        error = f"{type(e).__name__}: {e}"
        print(f"# the run failed: {error}", file=sys.stderr)
    finally:
        probe.stopped.set()
        if writers:  # as it was before the run
            os.environ.pop("LEVANTER_CHECKPOINT_WRITER", None)
            if writer_env is not None:
                os.environ["LEVANTER_CHECKPOINT_WRITER"] = writer_env
        policy.Checkpointer.save, serialization.PreparedSave.copy_to_host, Trainer.train_step = originals
    for r in records:
        r["on_host_s"] = on_host[r["step"]] - r["started"] if r["step"] in on_host else None
        r["stall_s"] = probe.worst(r["started"], r["started"] + (r["write_s"] or r["blocked_s"]))
    if verify:
        checked = [r for r in records if r["fingerprints"] is not None and r["copy"] != "host"][-2:]
        for r in checked:
            try:
                r["verified"] = fingerprint_checkpoint(r["path"]) == r["fingerprints"]
            except Exception as e:  # noqa: BLE001 -- e.g. a save the failure left uncommitted
                print(f"# could not verify the save of step {r['step']}: {e}", file=sys.stderr)
    for r in records:
        del r["fingerprints"]
    times, waits = _metrics(os.path.join(work, "logs", run_id, "metrics.jsonl"))
    return times, records, num_steps, {"dispatch": dispatch, "error": error, "waits": waits}


def summarise(times: dict[int, float], records: list[dict], num_steps: int, skip: int,
              dispatch: list[float] | None = None, waits: dict[int, float] | None = None) -> dict:
    background = [r for r in records if r["copy"] != "sync" and r["step"] < num_steps]
    near = {s for r in background for s in (r["step"] - 1, r["step"], r["step"] + 1)}
    steady = [t for s, t in times.items() if s >= skip and s not in near]
    if not steady:
        raise SystemExit("no steady steps: train longer (--steps) or save less often (--every)")
    steady_s = statistics.median(steady)
    rows = []
    for r in background:
        s = r["step"]  # saved after the update of step index s - 1
        around = [times.get(i) for i in (s - 1, s, s + 1)]
        lost = (sum(around) - 3 * steady_s - r.get("fingerprint_s", 0.0)
                if all(t is not None for t in around) else None)
        after = (dispatch or [])[s:s + 2]  # the calls that dispatched steps s and s + 1
        wait = sum((waits or {}).get(i, 0.0) for i in (s - 1, s, s + 1))
        rows.append(dict(r, around_s=around, lost_s=lost, dispatch_s=max(after) if after else None,
                         data_wait_s=wait))
    sync = [r["blocked_s"] for r in records if r["copy"] == "sync"]
    sync_s = sync[-1] if sync else None
    by_policy = {}
    for name in dict.fromkeys(r.get("policy", "auto") for r in rows):
        # The first background save is a warm-up (it compiles the all-finite check): not in the medians.
        lost = [r["lost_s"] for r in rows[1:] if r.get("policy", "auto") == name and r["lost_s"] is not None]
        lost_s = statistics.median(lost) if lost else None
        by_policy[name] = {"lost_per_save_s": lost_s, "saves": len(lost),
                           "ratio": lost_s / sync_s if lost_s is not None and sync_s else None}
    first = next(iter(by_policy.values()), {"lost_per_save_s": None, "ratio": None})
    return {"steady_step_s": steady_s, "lost_per_save_s": first["lost_per_save_s"], "sync_save_s": sync_s,
            "ratio": first["ratio"], "by_policy": by_policy, "saves": rows}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--config", help="train_lm config (default with --quick: config/gpt2_nano.yaml)")
    p.add_argument("--steps", type=int, help="trainer.num_train_steps (default: the config's)")
    p.add_argument("--every", type=int, default=8, help="a permanent checkpoint every N steps (default 8)")
    p.add_argument("--skip", type=int, default=3, help="steps (compile, warm-up) left out of the steady step")
    p.add_argument("--writers", default="", help="comma-separated writers the background saves take in "
                   "turn as --policies (LEVANTER_CHECKPOINT_WRITER: process, thread); default: as the environment")
    p.add_argument("--policies", default="auto", help="comma-separated snapshot policies the background "
                   "saves take in turn: auto, pinned, pinned-async, host (default: auto)")
    p.add_argument("--verify", action="store_true", help="check that the last two non-host saves are the "
                   "state at the save, bit for bit (fingerprints on the devices and of the stored arrays)")
    p.add_argument("--quick", action="store_true", help="CPU: config/gpt2_nano.yaml, 24 steps, every 8")
    p.add_argument("--keep-dir", action="store_true", help="keep the temporary checkpoint and log directory")
    p.add_argument("--json", help="also write the result here")
    args, overrides = p.parse_known_args()
    config, steps, every = args.config, args.steps, args.every
    if args.quick:
        config, steps, every = config or QUICK["config"], steps or QUICK["steps"], QUICK["every"]
    if config is None:
        p.error("--config is required (or --quick)")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
    from levanter.checkpoint.host_copy import SNAPSHOT_POLICIES
    from levanter.progress import setup_console_logging

    if not policies or any(x not in SNAPSHOT_POLICIES for x in policies):
        p.error(f"--policies: a comma-separated list of {', '.join(SNAPSHOT_POLICIES)}, "
                f"got {args.policies!r}")
    setup_console_logging()
    note_load_average()
    work = tempfile.mkdtemp(prefix="ckpt-loop-")
    try:
        writers = [x.strip() for x in args.writers.split(",") if x.strip()]
        times, records, num_steps, timings = run(config, steps, every, overrides, work, policies, args.verify,
                                                 writers)
    finally:
        if not args.keep_dir:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"# kept {work}", file=sys.stderr)
    result = summarise(times, records, num_steps, args.skip, timings["dispatch"], timings["waits"])
    result.update(config=config, steps=num_steps, every=every, policies=policies, error=timings["error"])
    report(result)
    write_json(args.json, result)
    print(json.dumps(result))


def report(result: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    print_table(f"{result['config']}: a checkpoint every {result['every']} steps; steady step "
                f"{f(result['steady_step_s'])} s",
                [("save", 5), ("copy", 13), ("blocked s", 9), ("waited s", 8), ("on host", 7), ("write s", 7),
                 ("step s", 7), ("s+1", 7), ("s+2", 7), ("lost s", 7), ("dispatch", 8), ("stall", 6),
                 ("data wait", 9), ("verified", 8)],
                [[str(r["step"]), r["copy"], f(r["blocked_s"]), f(r["waited_s"]), f(r.get("on_host_s")),
                  f(r["write_s"]), *[f(t) for t in r["around_s"]], f(r["lost_s"]), f(r.get("dispatch_s")),
                  f(r.get("stall_s")), f(r.get("data_wait_s")),
                  {True: "yes", False: "NO"}.get(r.get("verified"), "-")]
                 for r in result["saves"]])
    print()
    for name, p in result["by_policy"].items():
        print(f"{name}: lost per save {f(p['lost_per_save_s'])} s over {p['saves']} saves (the first save, a "
              f"warm-up, left out); ratio {f(p['ratio'])} (goal <= 0.1)")
    print(f"synchronous save {f(result['sync_save_s'])} s")
    if result.get("error"):
        print(f"the run failed: {result['error']}")


if __name__ == "__main__":
    main()
