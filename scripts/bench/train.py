#!/usr/bin/env python
"""Benchmark: end-to-end cost of the README main job (``config/gpt2_nano.yaml``), and optionally upstream's.

Every repeat runs ``python -m levanter.main.train_lm`` as a **fresh subprocess** in a **fresh temporary
working directory** (so the token cache, logs and checkpoints start empty, and imports, cache build,
model init and compile are all inside the end-to-end time). The benchmark writes a copy of the config
into that directory with ``trainer.id: bench``, ``trainer.log_dir`` and ``trainer.checkpointer.base_path``
pointing into it and ``trainer.tracker: [{type: json}]``; relative data paths (the shipped configs'
``cache/embedded``) therefore resolve inside it. Overrides after the options are passed on to train_lm.

Reported per repeat (and over all repeats), from the subprocess and ``<log_dir>/bench/metrics.jsonl``:

* **end-to-end**: process start to process exit (cache build, compile, N steps, the final eval and
  checkpoint included).
* **first step**: process start to the first metrics line (the file is polled every 10 ms); the split
  into *start-up* (imports, config, cache build, model init) and the step-0 ``throughput/step_seconds``
  (first batch + compile + the step) is shown next to it.
* **steady step**: median / min / max of ``throughput/step_seconds`` over steps >= ``--skip`` (5), i.e.
  after the first 5 steps. This is the wall time between successive steps of the loop, so it includes
  the data wait, the host sync on the loss and the per-step logging, not just the compiled step.
* **tokens/s**: tokens of the steady steps / their summed step seconds.
* **data wait**: sum of ``data/wait_seconds`` / sum of ``throughput/step_seconds`` over the steady steps
  (goal < 1%: the loader should never be what a step waits for).
* **loss** at the first and the last step.

**Upstream comparison** (``--upstream-venv PATH``, a venv made by ``scripts/bench/setup_upstream_venv.sh``):
the same model and data through upstream Levanter 1.2.dev1644 (jax 0.7.2), offline. Only gpt2 configs are
mirrored, a mixture's sources as one source (their train_urls in order: the same tokens, another order): model ``hidden_dim / num_heads / num_layers / seq_len`` (gradient
checkpointing off, as ours), ``train_batch_size``, ``mp``, ``steps_per_eval``, ``max_eval_batches``,
``per_device_parallelism`` (gradient accumulation) and the
optimizer block are copied from our (overridden) config; embedded URLs are materialised as jsonl with
``levanter.ingest.embedded.materialize``; the byte tokenizer becomes an HF tokenizer directory with the
same 257 ids, and ``gpt2``'s hard-coded hub reference is served from a fake HF cache
(``scripts/bench/upstream_train.py prepare``). Upstream runs with ``HF_HUB_OFFLINE=1``, a ``json_logger``
tracker only (no wandb), ``ray.auto_start_cluster: false``, ``require_accelerator: false`` and
``log_jaxprs / log_xla_hlo: false`` (upstream defaults them to true; off is the faster upstream).
Its per-step metrics are parsed from the json_logger lines in its log. Upstream's
``throughput/duration`` covers only the jitted step and the loss fetch, so the comparable wall step is
``duration + throughput/loading_time + throughput/hook_time`` (the table shows the duration-only median
too). Upstream's own behaviour is kept: it also evaluates after step 0 (``step % steps_per_eval == 0``)
and starts a local Ray to build a fresh cache. Ratios are ours / upstream of the medians over repeats
(goals: steady step <= 0.6x, end-to-end <= 0.5x; reported, not enforced).

``--warm-cache`` builds the token cache(s) once, untimed, and copies them into every repeat's directory,
so the end-to-end time excludes the cache build (for both sides).

Usage::

    .venv/bin/python scripts/bench/train.py                      # 3 repeats x 60 steps, ~4 min on 2 cores
    .venv/bin/python scripts/bench/train.py --quick              # 1 repeat x 20 steps
    .venv/bin/python scripts/bench/train.py --config config/llama_nano.yaml --trainer.train_batch_size 16
    scripts/bench/setup_upstream_venv.sh ~/.cache/levanter-bench/upstream-venv      # ~2 min, ~1.7 GB
    .venv/bin/python scripts/bench/train.py --upstream-venv ~/.cache/levanter-bench/upstream-venv
"""

from __future__ import annotations

from _common import parser, print_table  # noqa: E402 -- scripts/bench is on sys.path
import argparse
import copy
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(REPO, "config", "gpt2_nano.yaml")
UPSTREAM_HELPER = os.path.join(REPO, "scripts", "bench", "upstream_train.py")
RUN_ID = "bench"
POLL_SECONDS = 0.01


@dataclasses.dataclass
class Step:
    step: int
    seconds: float  # wall seconds of the step as the benchmark compares them
    wait: float  # data wait seconds (ours: data/wait_seconds; upstream: throughput/loading_time)
    tokens: float
    loss: Optional[float]
    compute: Optional[float] = None  # upstream only: throughput/duration


@dataclasses.dataclass
class RunResult:
    label: str
    end_to_end: float
    first_step: Optional[float]  # process start -> first metrics line
    steps: list[Step]
    log_path: str

    def steady(self, skip: int) -> list[Step]:
        rest = [s for s in self.steps if s.step >= skip]
        return rest if rest else self.steps[1:] or self.steps

    @property
    def step0(self) -> Optional[float]:
        return self.steps[0].seconds if self.steps and self.steps[0].step == 0 else None


# ----------------------------------------------------------------------------------------------------------
# running a subprocess and timing its first metrics line


def run_timed(
    cmd: list[str], cwd: str, env: dict, log_path: str, watch_path: str, is_first: Callable[[str], bool],
    timeout: float,
) -> tuple[float, Optional[float], int]:
    """Run ``cmd``; return (end-to-end seconds, seconds to the first line of ``watch_path`` matching, rc).

    stdout and stderr go to ``log_path``. ``watch_path`` (which may be ``log_path``) is read incrementally
    every ``POLL_SECONDS`` until a complete line satisfies ``is_first``.
    """
    first = None
    offset = 0
    pending = b""
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while True:
                rc = proc.poll()
                if first is None and os.path.exists(watch_path):
                    with open(watch_path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                    offset += len(chunk)
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if is_first(line.decode("utf-8", "replace")):
                            first = time.perf_counter() - t0
                            break
                if rc is not None:
                    break
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"{' '.join(cmd[:4])} ... ran over {timeout:.0f} s; log: {log_path}")
                time.sleep(POLL_SECONDS if first is None else 0.05)
            elapsed = time.perf_counter() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            _kill_leftovers(proc.pid)
    return elapsed, first, proc.returncode


def _kill_leftovers(pgid: int) -> None:
    """Kill what is left of the process group we started (e.g. helper processes of upstream's Ray)."""
    try:
        os.killpg(pgid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: str, n: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


# ----------------------------------------------------------------------------------------------------------
# config handling


def parse_overrides(args: list[str]) -> list[tuple[str, object]]:
    """``--a.b value`` / ``--a.b=value`` pairs (values parsed as YAML), to mirror into upstream's config."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise SystemExit(f"unexpected override {a!r}: expected --key value or --key=value")
        if "=" in a:
            key, value = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise SystemExit(f"override {a} has no value")
            key, value = a[2:], args[i + 1]
            i += 2
        out.append((key, yaml.safe_load(value)))
    return out


def apply_overrides(cfg: dict, overrides: list[tuple[str, object]]) -> dict:
    cfg = copy.deepcopy(cfg)
    for key, value in overrides:
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def load_config(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def ours_config(base: dict, workdir: str, steps: int) -> dict:
    cfg = copy.deepcopy(base)
    trainer = cfg.setdefault("trainer", {})
    trainer["num_train_steps"] = steps
    trainer["id"] = RUN_ID
    trainer["log_dir"] = os.path.join(workdir, "logs")
    trainer["tracker"] = [{"type": "json"}]
    ckpt = dict(trainer.get("checkpointer") or {})
    ckpt["base_path"] = os.path.join(workdir, "checkpoints")
    trainer["checkpointer"] = ckpt
    return cfg


def upstream_config(cfg: dict, workdir: str, steps: int, data: dict, prep: dict, cache_dir: str) -> dict:
    """The upstream config mirroring ``cfg`` (ours, with overrides applied)."""
    m, t = cfg["model"], cfg.get("trainer", {})
    model = {"type": "gpt2", "gradient_checkpointing": False}
    for k in ("hidden_dim", "num_heads", "num_layers", "seq_len"):
        if k in m:
            model[k] = m[k]
    trainer = {
        "mp": t.get("mp", "f32"),
        "num_train_steps": steps,
        "train_batch_size": t.get("train_batch_size", 32),
        "steps_per_eval": t.get("steps_per_eval", 1000),
        "require_accelerator": False,
        "id": RUN_ID,
        "log_dir": os.path.join(workdir, "logs"),
        "tracker": [{"type": "json_logger"}],
        "checkpointer": {"base_path": os.path.join(workdir, "checkpoints")},
        "ray": {"auto_start_cluster": False},
        "log_jaxprs": False,
        "log_xla_hlo": False,
    }
    for k in ("max_eval_batches", "per_device_parallelism"):
        if t.get(k) is not None:
            trainer[k] = t[k]
    return {
        "data": {
            "train_urls": data["train"],
            "validation_urls": data["validation"],
            "cache_dir": cache_dir,
            "tokenizer": prep["tokenizer"],
            "shuffle": bool(cfg.get("data", {}).get("shuffle", True)),
        },
        "model": model,
        "trainer": trainer,
        "optimizer": dict(cfg.get("optimizer", {})),
    }


def data_urls(data: dict, key: str) -> list:
    """``data[key]`` of a single source; for a mixture, every source's ``key`` in source order (the upstream
    mirror trains on their union as one source: the same tokens and model, another data order)."""
    if "configs" in data:
        return [u for c in data["configs"].values() for u in (c or {}).get(key) or []]
    return list(data.get(key) or [])


def upstream_unsupported(cfg: dict) -> Optional[str]:
    model, data = cfg.get("model", {}), cfg.get("data", {})
    if model.get("type") != "gpt2":
        return f"model.type is {model.get('type')!r}; the upstream mirror handles gpt2 only"
    if not data_urls(data, "train_urls") or "components" in data:
        return "the upstream mirror handles data configs of train_urls (one source, or a mixture's union) only"
    if data.get("tokenizer", "byte") != "byte":
        tok = data.get("tokenizer")
        return f"data.tokenizer is {tok!r}; the upstream mirror handles the byte tokenizer only"
    return None


# ----------------------------------------------------------------------------------------------------------
# one run of ours / upstream


def run_ours(
    cfg: dict, overrides: list[str], steps: int, args, warm_cache: Optional[str], index: int
) -> RunResult:
    workdir = tempfile.mkdtemp(prefix="bench-train-", dir=args.tmp)
    try:
        if warm_cache:
            shutil.copytree(warm_cache, os.path.join(workdir, "cache"))
        path = os.path.join(workdir, "config.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(ours_config(cfg, workdir, steps), f, sort_keys=False)
        cmd = [args.python, "-m", "levanter.main.train_lm", "--config_path", path, *overrides]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        metrics = os.path.join(workdir, "logs", RUN_ID, "metrics.jsonl")
        log = os.path.join(workdir, "train.log")
        e2e, first, rc = run_timed(
            cmd, workdir, env, log, metrics, lambda line: "throughput/step_seconds" in line, args.timeout
        )
        if rc != 0:
            raise RuntimeError(f"ours exited with {rc}; last lines of {log}:\n{tail(log)}")
        result = RunResult("ours", e2e, first, parse_ours(metrics), log)
        keep_log(args, log, f"ours-{index}.log")
        return result
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def parse_ours(path: str) -> list[Step]:
    steps = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if "throughput/step_seconds" not in d:
                continue
            dt = d["throughput/step_seconds"]
            steps.append(
                Step(d["step"], dt, d.get("data/wait_seconds", 0.0), d["throughput/tokens_per_second"] * dt,
                     d.get("train/loss"))
            )
    return steps


def run_upstream(
    cfg: dict, steps: int, args, data: dict, prep: dict, warm_cache: Optional[str], index: int
) -> RunResult:
    workdir = tempfile.mkdtemp(prefix="bench-upstream-", dir=args.tmp)
    try:
        cache_dir = os.path.join(workdir, "cache")
        if warm_cache:
            shutil.copytree(warm_cache, cache_dir)
        path = os.path.join(workdir, "upstream.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(upstream_config(cfg, workdir, steps, data, prep, cache_dir), f, sort_keys=False)
        cmd = [upstream_python(args), "-m", "levanter.main.train_lm", "--config_path", path]
        env = upstream_env(prep, workdir)
        log = os.path.join(workdir, "train.log")
        e2e, first, rc = run_timed(cmd, workdir, env, log, log, is_upstream_step_line, args.timeout)
        if rc != 0:
            raise RuntimeError(f"upstream exited with {rc}; last lines of {log}:\n{tail(log)}")
        parsed = parse_upstream(log)
        if not parsed:
            raise RuntimeError(f"no json_logger step metrics in upstream's log {log}:\n{tail(log)}")
        result = RunResult("upstream", e2e, first, parsed, log)
        keep_log(args, log, f"upstream-{index}.log")
        return result
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def upstream_python(args) -> str:
    return os.path.join(args.upstream_venv, "bin", "python")


def upstream_env(prep: dict, workdir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HOME=prep["hf_home"],
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_DIR=workdir,
        TOKENIZERS_PARALLELISM=os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        RAY_USAGE_STATS_ENABLED="0",
    )
    return env


def _json_logger_record(line: str) -> Optional[dict]:
    if "json_logger" not in line:
        return None
    i = line.find('{"tracker"')
    if i < 0:
        return None
    try:
        return json.loads(line[i:])
    except ValueError:
        return None


def is_upstream_step_line(line: str) -> bool:
    rec = _json_logger_record(line)
    return bool(rec) and rec.get("event") == "log" and rec.get("step") is not None


def parse_upstream(log_path: str) -> list[Step]:
    """Merge upstream's json_logger records per step; keep the steps that have ``throughput/duration``."""
    by_step: dict[int, dict] = {}
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            rec = _json_logger_record(line)
            if not rec or rec.get("event") != "log" or rec.get("step") is None:
                continue
            by_step.setdefault(int(rec["step"]), {}).update(rec.get("metrics") or {})
    steps = []
    for s in sorted(by_step):
        d = by_step[s]
        if "throughput/duration" not in d:
            continue
        compute = float(d["throughput/duration"])
        wait = float(d.get("throughput/loading_time", 0.0))
        seconds = compute + wait + float(d.get("throughput/hook_time", 0.0))
        tokens = float(d.get("throughput/tokens_per_second", 0.0)) * compute
        steps.append(Step(s, seconds, wait, tokens, d.get("train/loss"), compute))
    return steps


def keep_log(args, log: str, name: str) -> None:
    if args.log_copies:
        shutil.copy(log, os.path.join(args.log_copies, name))


# ----------------------------------------------------------------------------------------------------------
# warm caches and upstream preparation


def build_ours_cache(cfg: dict, overrides: list[str], args) -> str:
    """A 1-step run in a scratch dir, untimed; returns its ``cache`` dir (copied into each repeat)."""
    workdir = tempfile.mkdtemp(prefix="bench-train-warm-", dir=args.tmp)
    path = os.path.join(workdir, "config.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(ours_config(cfg, workdir, 1), f, sort_keys=False)
    cmd = [args.python, "-m", "levanter.main.train_lm", "--config_path", path, *overrides]
    log = os.path.join(workdir, "train.log")
    _, _, rc = run_timed(cmd, workdir, dict(os.environ), log, log, lambda _: False, args.timeout)
    if rc != 0:
        raise RuntimeError(f"warm-cache run exited with {rc}:\n{tail(log)}")
    cache = os.path.join(workdir, "cache")
    if not os.path.isdir(cache):
        raise RuntimeError("--warm-cache: the config's cache_dir is not under ./cache; nothing to copy")
    return cache


def prepare_upstream(cfg: dict, args, prep_dir: str) -> tuple[dict, dict]:
    """Materialise the data as jsonl and write the tokenizer + fake HF cache; returns (data, prep)."""
    from levanter.ingest import is_embedded_url, materialize, parse_embedded_url

    data = {}
    for split, key in (("train", "train_urls"), ("validation", "validation_urls")):
        paths = []
        for url in data_urls(cfg["data"], key):
            if is_embedded_url(url):
                name, which = parse_embedded_url(url)
                paths.append(materialize(name, which, os.path.join(prep_dir, "data")))
            else:
                paths.append(url if "://" in url else os.path.abspath(url))
        if len(paths) > 1 and all(os.path.isfile(p) and p.endswith(".jsonl") for p in paths):
            # One file per split: with several, upstream's cache build ends with a Ray task asking for
            # 4 CPUs and 6 GiB ("copy other groups into permanent cache"), which never schedules on a
            # 2-core machine. Concatenating in URL order keeps the same documents in the same order.
            joined = os.path.join(prep_dir, "data", f"{split}.jsonl")
            with open(joined, "wb") as out:
                for p in paths:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, out)
            paths = [joined]
        data[split] = paths
    py = upstream_python(args)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run([py, UPSTREAM_HELPER, "prepare", prep_dir], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"upstream prepare failed:\n{out.stdout}\n{out.stderr}")
    prep = json.loads(out.stdout.strip().splitlines()[-1])
    return data, prep


def build_upstream_cache(cfg: dict, args, data: dict, prep: dict) -> str:
    workdir = tempfile.mkdtemp(prefix="bench-upstream-warm-", dir=args.tmp)
    cache_dir = os.path.join(workdir, "cache")
    path = os.path.join(workdir, "upstream.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(upstream_config(cfg, workdir, 1, data, prep, cache_dir), f, sort_keys=False)
    cmd = [upstream_python(args), "-m", "levanter.main.train_lm", "--config_path", path]
    log = os.path.join(workdir, "train.log")
    _, _, rc = run_timed(cmd, workdir, upstream_env(prep, workdir), log, log, lambda _: False, args.timeout)
    if rc != 0:
        raise RuntimeError(f"upstream warm-cache run exited with {rc}:\n{tail(log)}")
    return cache_dir


# ----------------------------------------------------------------------------------------------------------
# tables


def fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run_summary(r: RunResult, skip: int) -> dict:
    st = r.steady(skip)
    secs = [s.seconds for s in st]
    total = sum(secs)
    compute = [s.compute for s in st if s.compute is not None]
    return {
        "e2e": r.end_to_end,
        "first": r.first_step,
        "step0": r.step0,
        "startup": (r.first_step - r.step0) if (r.first_step is not None and r.step0 is not None) else None,
        "med": statistics.median(secs),
        "min": min(secs),
        "max": max(secs),
        "compute_med": statistics.median(compute) if compute else None,
        "tok_s": sum(s.tokens for s in st) / total if total else None,
        "wait": sum(s.wait for s in st) / total if total else None,
        "loss0": r.steps[0].loss,
        "loss1": r.steps[-1].loss,
        "last_step": r.steps[-1].step,
        "n_steady": len(st),
    }


COLUMNS = [
    ("run", 9), ("e2e s", 7), ("1st step s", 10), ("start-up s", 10), ("step0 s", 7),
    ("steady med ms", 13), ("min ms", 7), ("max ms", 7), ("tokens/s", 9), ("data wait", 9),
    ("loss first", 10), ("loss last", 9),
]


def summary_row(name: str, s: dict) -> list[str]:
    return [
        name, fmt(s["e2e"], ".1f"), fmt(s["first"], ".2f"), fmt(s["startup"], ".2f"), fmt(s["step0"], ".2f"),
        fmt(s["med"] * 1e3, ".1f"), fmt(s["min"] * 1e3, ".1f"), fmt(s["max"] * 1e3, ".1f"),
        fmt(s["tok_s"], ",.0f"), fmt(None if s["wait"] is None else s["wait"] * 100, ".2f") + "%",
        fmt(s["loss0"], ".4f"), fmt(s["loss1"], ".4f"),
    ]


def aggregate(results: list[RunResult], skip: int) -> dict:
    """Medians over repeats of the per-run figures; steady min / max pooled over all repeats' steps."""
    per = [run_summary(r, skip) for r in results]

    def med(key):
        vals = [p[key] for p in per if p[key] is not None]
        return statistics.median(vals) if vals else None

    pooled = [s.seconds for r in results for s in r.steady(skip)]
    agg = {k: med(k) for k in per[0]}
    agg["med_pooled"] = statistics.median(pooled)
    agg["min"], agg["max"] = min(pooled), max(pooled)
    agg["e2e_min"] = min(p["e2e"] for p in per)
    return agg


def report(label: str, results: list[RunResult], skip: int, steps: int) -> dict:
    rows = [summary_row(f"#{i + 1}", run_summary(r, skip)) for i, r in enumerate(results)]
    agg = aggregate(results, skip)
    if len(results) > 1:
        rows.append(summary_row("median", agg))
    n = run_summary(results[0], skip)["n_steady"]
    print_table(
        f"{label}: {steps} steps, {len(results)} repeat(s); steady = steps >= {skip} ({n} steps/run); "
        f"median row = median over repeats (min/max pooled)",
        COLUMNS,
        rows,
    )
    wait = agg["wait"]
    if wait is not None and label.startswith("ours"):
        verdict = "meets" if wait < 0.01 else "MISSES"
        print(f"data wait {wait * 100:.2f}% of steady step time ({verdict} goal < 1%)")
    if agg.get("compute_med") is not None:
        print(
            f"upstream's throughput/duration alone (jitted step + loss fetch): median "
            f"{agg['compute_med'] * 1e3:.1f} ms; the step columns add loading_time and hook_time"
        )
    return agg


# ----------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    p = parser(
        __doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [--key value ...]   (unknown --key value pairs are passed to train_lm)",
        allow_abbrev=False,
    )
    p.add_argument("--quick", action="store_true", help="1 repeat of 20 steps (smoke run)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="train_lm config (default config/gpt2_nano.yaml)")
    p.add_argument("--steps", type=int, default=None, help="trainer.num_train_steps (60; --quick: 20)")
    p.add_argument("--repeats", type=int, default=None, help="fresh-process repeats per side (3; --quick: 1)")
    p.add_argument("--skip", type=int, default=5, help="steps excluded from the steady-state figures")
    p.add_argument("--warm-cache", action="store_true", help="build the token cache once (untimed)")
    p.add_argument("--upstream-venv", default=None, help="upstream levanter venv (setup_upstream_venv.sh)")
    p.add_argument("--no-ours", action="store_true", help="only run upstream (debugging the mirror)")
    p.add_argument("--python", default=sys.executable, help="python that runs our train_lm (default: this)")
    p.add_argument("--tmp", default=None, help="parent of the temporary working directories")
    p.add_argument("--keep", action="store_true", help="keep the temporary working directories")
    p.add_argument("--log-copies", default=None, help="copy every run's stdout/stderr log into this dir")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed")
    p.add_argument("--step-goal", type=float, default=0.6, help="target ours/upstream steady step ratio")
    p.add_argument("--e2e-goal", type=float, default=0.5, help="target ours/upstream end-to-end ratio")
    args, overrides = p.parse_known_args(argv)
    steps = args.steps if args.steps is not None else (20 if args.quick else 60)
    if any(o == "--trainer.num_train_steps" or o.startswith("--trainer.num_train_steps=") for o in overrides):
        raise SystemExit("use --steps N (it is also passed to upstream), not --trainer.num_train_steps")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    for d in (args.log_copies, args.tmp):
        if d:
            os.makedirs(d, exist_ok=True)
    config_path = os.path.abspath(args.config)
    base = load_config(config_path)
    mirrored = apply_overrides(base, parse_overrides(overrides))

    import jax  # noqa: F401 -- version for the header only

    print(
        f"# train benchmark: python {platform.python_version()}, jax {jax.__version__}, "
        f"{os.cpu_count()} CPUs, "
        f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}; config {os.path.relpath(config_path, REPO)}"
        + (f" {' '.join(overrides)}" if overrides else "")
        + f"; {steps} steps x {repeats} repeat(s), fresh subprocess + working dir each"
        + ("; warm (pre-built) token cache" if args.warm_cache else "; fresh token cache (build included)")
        + "; load average %.2f %.2f %.2f" % os.getloadavg()
    )
    t_start = time.perf_counter()

    upstream_why = None
    if args.upstream_venv:
        if not os.path.exists(upstream_python(args)):
            upstream_why = f"no venv at {args.upstream_venv} (make one: scripts/bench/setup_upstream_venv.sh)"
        else:
            upstream_why = upstream_unsupported(mirrored)
        if upstream_why:
            print(f"# upstream comparison skipped: {upstream_why}")

    ours_warm = build_ours_cache(base, overrides, args) if (args.warm_cache and not args.no_ours) else None
    up_ready = bool(args.upstream_venv) and not upstream_why
    prep_dir = data = prep = up_warm = None
    if up_ready:
        prep_dir = tempfile.mkdtemp(prefix="bench-upstream-prep-", dir=args.tmp)
        data, prep = prepare_upstream(mirrored, args, prep_dir)
        if args.warm_cache:
            up_warm = build_upstream_cache(mirrored, args, data, prep)

    # Alternate the two sides repeat by repeat so that drift on a shared machine hits both alike.
    ours_runs: list[RunResult] = []
    up_runs: list[RunResult] = []
    try:
        for i in range(repeats):
            if not args.no_ours:
                ours_runs.append(run_ours(base, overrides, steps, args, ours_warm, i + 1))
                r = ours_runs[-1]
                print(f"# ours #{i + 1}: {r.end_to_end:.1f} s end to end", flush=True)
            if up_ready:
                up_runs.append(run_upstream(mirrored, steps, args, data, prep, up_warm, i + 1))
                r = up_runs[-1]
                print(f"# upstream #{i + 1}: {r.end_to_end:.1f} s end to end", flush=True)
    finally:
        if not args.keep:
            for d in (prep_dir, ours_warm, up_warm):
                if d:
                    shutil.rmtree(d if d == prep_dir else os.path.dirname(d), ignore_errors=True)

    ours_agg = report("ours (levanter fork)", ours_runs, args.skip, steps) if ours_runs else None
    up_agg = None
    if up_runs:
        model = mirrored["model"]
        up_agg = report(
            f"upstream levanter 1.2.dev1644 (gpt2 d{model.get('hidden_dim')} h{model.get('num_heads')} "
            f"L{model.get('num_layers')} seq{model.get('seq_len')}, batch "
            f"{mirrored.get('trainer', {}).get('train_batch_size')})",
            up_runs, args.skip, steps,
        )
    if ours_agg and up_agg:
        rows = []
        for name, key, goal in (
            ("steady step (median)", "med", args.step_goal),
            ("steady step (min)", "min", None),
            ("end-to-end", "e2e", args.e2e_goal),
            ("end-to-end (min)", "e2e_min", None),
            ("time to first step", "first", None),
        ):
            o, u = ours_agg[key], up_agg[key]
            if o is None or u is None:
                continue
            ratio = o / u
            verdict = "-" if goal is None else ("meets" if ratio <= goal else "MISSES")
            target = "-" if goal is None else f"<= {goal}x"
            rows.append([name, f"{o:.3f}", f"{u:.3f}", f"{ratio:.2f}x", target, verdict])
        if up_agg.get("compute_med"):
            o, u = ours_agg["med"], up_agg["compute_med"]
            rows.append(["step vs upstream duration", f"{o:.3f}", f"{u:.3f}", f"{o / u:.2f}x", "-", "-"])
        print_table(
            "Ours / upstream (medians over repeats, seconds)",
            [("metric", 26), ("ours", 9), ("upstream", 9), ("ratio", 7), ("goal", 8), ("verdict", 7)],
            rows,
        )

    print()
    print(
        f"# total wall time {time.perf_counter() - t_start:.1f} s; load average now %.2f %.2f %.2f "
        "(above ~0.5 on top of this benchmark, other processes share the cores: prefer min over median)"
        % os.getloadavg()
    )


if __name__ == "__main__":
    main()
