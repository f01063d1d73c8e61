#!/usr/bin/env python
"""What a background checkpoint save costs the training loop of a real ``train_lm`` run.

    .venv/bin/python scripts/bench/checkpoint_loop.py --config config/bench/llama_350m_tpu.yaml --every 8
    .venv/bin/python scripts/bench/checkpoint_loop.py --quick          # CPU: config/gpt2_nano.yaml, 24 steps

Runs ``train_lm`` in this process on ``--config`` (relative data paths resolve from the current directory,
as for the other benchmarks), with ``trainer.checkpointer.keep: [{every: N}]``, ``save_interval`` far away,
the checkpoints and logs in a temporary directory (deleted afterwards) and the json tracker. Any further
arguments are passed on to train_lm as overrides. Saves run in the background as in any run, except the
last one (the final step's forced save), which is made synchronous: the same state, in the same process,
so its time is what a synchronous save would stop the loop for.

From the run's ``metrics.jsonl`` (``throughput/step_seconds``: the wall time between the completions of
consecutive steps as the loop sees them, everything the loop did in between included):

* **steady step**: the median over the steps after ``--skip`` that are neither the step a save follows,
  nor one of the two after it;
* **around a save**: for each background save after step ``s``, the times of step ``s`` (the step whose
  state is saved), ``s + 1`` and ``s + 2``, and **lost**: their sum minus three steady steps;
* **blocked**: what ``Checkpointer.on_step`` itself took on the training thread, of which **waited**: the
  wait for the previous save's write (saves closer together than one write takes: no change to the copy
  helps there, only a faster write or fewer saves); where the save first copied the state (``device``: a
  device snapshot, moved to host memory by the writer; ``host``: the devices lacked room, so the loop
  waited for the host copy); **write**: the background save's whole time, from the call to the commit.
  The first save also compiles the all-finite check; the median over saves leaves it out;
* **sync save**: the final, synchronous save's time; **ratio**: median lost per save over it (goal
  <= 0.1).

The table goes to stdout, then one line of JSON (the last line) with ``steady_step_s``,
``lost_per_save_s`` (median), ``sync_save_s``, ``ratio`` and the per-save rows; ``--json PATH`` writes it
to a file too. On the chip, run it with ``--every 8`` (the Llama 350M bench config trains 40 steps: saves
after steps 8, 16, 24 and 32, the synchronous one after step 40).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import uuid

from _common import note_load_average, parser, print_table, write_json

QUICK = dict(config="config/gpt2_nano.yaml", steps=24, every=8)


def _metrics(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["throughput/step_seconds"] for r in map(json.loads, f)
                if "throughput/step_seconds" in r}


def run(config: str, steps: int | None, every: int, overrides: list[str], work: str) -> tuple[dict, list, int]:
    """Train; returns (step seconds by step, one record per save, the number of steps)."""
    import yaml

    from levanter.checkpoint import policy
    from levanter.main import train_lm

    with open(config) as f:
        doc = yaml.safe_load(f)
    num_steps = steps if steps is not None else int(doc["trainer"]["num_train_steps"])
    run_id = f"ckpt-loop-{uuid.uuid4().hex[:6]}"
    records: list[dict] = []
    original = policy.Checkpointer.save

    def save(self, tree, step, *, is_temporary=False):
        last = int(step) >= num_steps
        if last:  # the same state, saved synchronously: what a synchronous save stops the loop for
            self.wait_until_finished()
            self.asynchronous = False
        path = original(self, tree, step, is_temporary=is_temporary)
        if records:  # the previous save's write has finished (this one waited for it): its whole time
            records[-1]["write_s"] = self.last_save_s
        records.append({"step": int(step), "copy": "sync" if last else self.last_copy,
                        "blocked_s": self.last_blocked_s, "waited_s": self.last_waited_s, "write_s": None})
        return path

    policy.Checkpointer.save = save
    try:
        train_lm.cli(["--config_path", config, "--trainer.id", run_id, "--trainer.num_train_steps", str(num_steps),
                      "--trainer.log_dir", os.path.join(work, "logs"),
                      "--trainer.checkpointer.base_path", os.path.join(work, "ckpt"),
                      "--trainer.checkpointer.keep", f"[{{every: {every}}}]",
                      "--trainer.checkpointer.save_interval", "1000h",
                      "--trainer.tracker", "[{type: json}]", *overrides])
    finally:
        policy.Checkpointer.save = original
    return _metrics(os.path.join(work, "logs", run_id, "metrics.jsonl")), records, num_steps


def summarise(times: dict[int, float], records: list[dict], num_steps: int, skip: int) -> dict:
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
        lost = sum(around) - 3 * steady_s if all(t is not None for t in around) else None
        rows.append(dict(r, around_s=around, lost_s=lost))
    sync = [r["blocked_s"] for r in records if r["copy"] == "sync"]
    sync_s = sync[-1] if sync else None
    lost = [r["lost_s"] for r in rows if r["lost_s"] is not None]
    lost_s = statistics.median(lost) if lost else None
    ratio = lost_s / sync_s if lost_s is not None and sync_s else None
    return {"steady_step_s": steady_s, "lost_per_save_s": lost_s, "sync_save_s": sync_s, "ratio": ratio,
            "saves": rows}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--config", help="train_lm config (default with --quick: config/gpt2_nano.yaml)")
    p.add_argument("--steps", type=int, help="trainer.num_train_steps (default: the config's)")
    p.add_argument("--every", type=int, default=8, help="a permanent checkpoint every N steps (default 8)")
    p.add_argument("--skip", type=int, default=3, help="steps (compile, warm-up) left out of the steady step")
    p.add_argument("--quick", action="store_true", help="CPU: config/gpt2_nano.yaml, 24 steps, every 8")
    p.add_argument("--keep-dir", action="store_true", help="keep the temporary checkpoint and log directory")
    p.add_argument("--json", help="also write the result here")
    args, overrides = p.parse_known_args()
    config, steps, every = args.config, args.steps, args.every
    if args.quick:
        config, steps, every = config or QUICK["config"], steps or QUICK["steps"], QUICK["every"]
    if config is None:
        p.error("--config is required (or --quick)")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
    from levanter.progress import setup_console_logging

    setup_console_logging()
    note_load_average()
    work = tempfile.mkdtemp(prefix="ckpt-loop-")
    try:
        times, records, num_steps = run(config, steps, every, overrides, work)
    finally:
        if not args.keep_dir:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"# kept {work}", file=sys.stderr)
    result = summarise(times, records, num_steps, args.skip)
    result.update(config=config, steps=num_steps, every=every)

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    print_table(f"{config}: a checkpoint every {every} steps; steady step {f(result['steady_step_s'])} s",
                [("save", 6), ("copy", 7), ("blocked s", 10), ("waited s", 9), ("write s", 8), ("step s", 8),
                 ("s+1", 8), ("s+2", 8), ("lost s", 8)],
                [[str(r["step"]), r["copy"], f(r["blocked_s"]), f(r["waited_s"]), f(r["write_s"]),
                  *[f(t) for t in r["around_s"]], f(r["lost_s"])] for r in result["saves"]])
    print(f"\nlost per save {f(result['lost_per_save_s'])} s; synchronous save {f(result['sync_save_s'])} s; "
          f"ratio {f(result['ratio'])} (goal <= 0.1)")
    write_json(args.json, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
