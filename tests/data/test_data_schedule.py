"""The data planner against the real loader: what the plan says each step reads is what training reads.

Every check compares the planner's closed-form numbers (or its ``--dump`` rows) with an independent
observation: the tokens the real :class:`DataLoader` yields, the cache windows read directly from each
source's store, or a brute-force count over the batches the loader produced.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from levanter.config import parse_config
from levanter.data import planner
from levanter.data.dataset import ListAsyncDataset
from levanter.data.loader import DataLoader
from levanter.data.mixture import MixtureDataset
from levanter.data.text import TokenSeqDataset
from levanter.main import data_schedule
from levanter.lm_config import TrainLmConfig, data_key
from levanter.schedule import BatchSchedule, ScheduleStep
from levanter.store import TokenCache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ_LEN = 64
STEPS = 25
STAGES = (0, 7, 19)

# Three sources (the third is the docs split again under another name: a second cache, another
# shuffle seed), three stages at odd steps, and a batch size change (8 -> 16) at step 5.
MIXTURE_YAML = """
data:
  tokenizer: byte
  cache_dir: {cache}
  shuffle: {shuffle}
  cache_options: {{num_workers: 1}}
  configs:
    prose:
      train_urls: ["embedded://python-docs/validation"]
    code:
      train_urls: ["embedded://python-code/validation"]
    prose2:
      train_urls: ["embedded://python-docs/validation"]
  train_weights:
    - [0, {{prose: 0.5, code: 0.3, prose2: 0.2}}]
    - [7, {{prose: 0.1, code: 0.9}}]
    - [19, {{prose: 1, code: 1, prose2: 2}}]
  mixture_block_size: {block}
model: {{type: gpt2, seq_len: 64, hidden_dim: 32, num_heads: 2, num_layers: 1}}
trainer:
  seed: 3
  num_train_steps: 25
  train_batch_size: [{{start: 0, value: 8}}, {{start: 5, value: 16}}]
  require_accelerator: false
"""

# A tiny local source (a handful of windows) next to a real one: it wraps, or ends the data, early.
TINY_YAML = """
data:
  tokenizer: byte
  cache_dir: {cache}
  shuffle: true
  cache_options: {{num_workers: 1}}
  stop_strategy: {stop}
  configs:
    code:
      train_urls: ["embedded://python-code/validation"]
    tiny:
      train_urls: ["{tiny}"]
  train_weights:
    - [0, {{code: 0.75, tiny: 0.25}}]
    - [7, {{code: 0.5, tiny: 0.5}}]
  mixture_block_size: null
model: {{type: gpt2, seq_len: 64, hidden_dim: 32, num_heads: 2, num_layers: 1}}
trainer:
  seed: 0
  num_train_steps: 25
  train_batch_size: [{{start: 0, value: 8}}, {{start: 5, value: 16}}]
  require_accelerator: false
"""

SINGLE_YAML = """
data:
  tokenizer: byte
  cache_dir: {cache}
  shuffle: 16
  cache_options: {{num_workers: 1}}
  train_urls: ["embedded://python-docs/validation"]
model: {{type: gpt2, seq_len: 256, hidden_dim: 32, num_heads: 2, num_layers: 1}}
trainer:
  num_train_steps: 100
  train_batch_size: 16
  require_accelerator: false
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One cache directory for the whole module (caches are reused across configs) and a tiny corpus."""
    root = tmp_path_factory.mktemp("plan")
    tiny = root / "tiny.jsonl"
    docs = [json.dumps({"text": f"document {i}: " + "abcdefgh" * 9}) + "\n" for i in range(7)]
    tiny.write_text("".join(docs))
    return {"cache": root / "cache", "tiny": tiny, "root": root}


def load(tmp_path, text: str, **fmt) -> TrainLmConfig:
    path = tmp_path / "c.yaml"
    path.write_text(text.format(**fmt))
    return parse_config(TrainLmConfig, str(path))


def mixture_config(shared, tmp_path, block, shuffle="true"):
    block = "null" if block is None else block
    return load(tmp_path, MIXTURE_YAML, cache=shared["cache"], shuffle=shuffle, block=block)


def loader_tokens(cfg, end_step) -> dict:
    """The tokens of every batch the real loader yields for steps ``[0, end_step)``."""
    schedule = cfg.trainer.batch_schedule
    train_set = cfg.data.train_set(cfg.model.seq_len, schedule, key=data_key(cfg))
    with DataLoader(train_set, schedule, prefetch_depth=2).iter_from_step(0, end_step) as it:
        return {b.step: np.asarray(b.data["tokens"]) for b in it}


def source_store(cfg, name) -> TokenSeqDataset:
    """A source's token windows, opened straight from its cache directory (not via the planner)."""
    if name == planner.SINGLE_SOURCE_NAME:
        cache_dir = os.path.join(cfg.data.cache_dir, "train")
    else:
        cache_dir = os.path.join(cfg.data.source_cache_dir(name), "train")
    return TokenSeqDataset(TokenCache.open(cache_dir).store, cfg.model.seq_len)


def read_dump(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_rows_match_loader(cfg, rows, tokens):
    """For every step and position, the loader's tokens equal the cache window the dump names."""
    stores = {}
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == sorted(tokens)
    schedule = cfg.trainer.batch_schedule
    for step, step_rows in by_step.items():
        first, end = schedule.step_range(step)
        assert [r["position"] for r in step_rows] == list(range(end - first))
        assert [r["global_index"] for r in step_rows] == list(range(first, end))
        expected = np.empty_like(tokens[step])
        for r in step_rows:
            if r["source"] not in stores:
                stores[r["source"]] = source_store(cfg, r["source"])
            st = stores[r["source"]]
            start = np.array([r["store_row"] * st.seq_len])
            expected[r["position"]] = st.store.read_windows_sync(start, st.seq_len)[0]
        np.testing.assert_array_equal(tokens[step], expected, err_msg=f"step {step}")


def stage_of(step, starts=STAGES):
    return max(j for j, s in enumerate(starts) if s <= step)


# -- the mixture against the loader -------------------------------------------------------------------
@pytest.mark.parametrize("block,shuffle", [(None, "true"), (16, "32")])
def test_dump_and_counts_match_the_real_loader(shared, tmp_path, capsys, block, shuffle):
    cfg = mixture_config(shared, tmp_path, block, shuffle)
    dump = tmp_path / "rows.jsonl"
    result = data_schedule.main(cfg, dump=(0, STEPS, str(dump)))
    printed = capsys.readouterr().out
    rows = read_dump(dump)
    assert result["dump_rows"] == len(rows) == 5 * 8 + 20 * 16

    check_rows_match_loader(cfg, rows, loader_tokens(cfg, STEPS))

    # Per-stage, per-source counts: the plan's closed form against the dumped rows.
    names = ["prose", "code", "prose2"]
    assert [(st["first_step"], st["last_step"]) for st in result["stages"]] == [(0, 6), (7, 18), (19, 24)]
    for j, st in enumerate(result["stages"]):
        for s in st["sources"]:
            n = sum(1 for r in rows if stage_of(r["step"]) == j and r["source"] == s["source"])
            assert s["sequences"] == n, (j, s["source"])
            assert s["tokens"] == n * SEQ_LEN
        assert st["sequences"] == sum(1 for r in rows if stage_of(r["step"]) == j)
    if block is None:  # exact per batch: achieved fractions are per-step largest-remainder counts
        # 12 steps of 16 at weights 0.1 / 0.9: largest-remainder rounding gives 2 and 14 per step.
        assert [s["sequences"] for s in result["stages"][1]["sources"]] == [12 * 2, 12 * 14, 0]
    # Source indices are consecutive per source (no gap, no repeat) in training order, across stages.
    for name in names:
        got = [r["source_index"] for r in rows if r["source"] == name]
        assert got == list(range(len(got)))
    # No source wraps in 25 steps; the plan says so and prints it.
    assert all(s["wrap_step"] is None for s in result["sources"])
    assert "stage 2: steps 19..24" in printed and "never" in printed
    # The printed table carries the plan's numbers.
    assert f"{result['stages'][1]['sources'][1]['sequences']:,}" in printed


def test_a_tiny_source_wraps_at_the_planned_step(shared, tmp_path):
    cfg = load(tmp_path, TINY_YAML, cache=shared["cache"], tiny=shared["tiny"], stop="restart")
    dump = tmp_path / "rows.jsonl"
    result = data_schedule.main(cfg, dump=(0, STEPS, str(dump)))
    rows = read_dump(dump)
    check_rows_match_loader(cfg, rows, loader_tokens(cfg, STEPS))  # wrapped reads included

    tiny = next(s for s in result["sources"] if s["name"] == "tiny")
    length = len(source_store(cfg, "tiny"))
    assert tiny["length"] == length < 20
    # Brute force: the first step by which the tiny source has been read more than `length` times.
    seen, wrap = 0, None
    for step in range(STEPS):
        seen += sum(1 for r in rows if r["step"] == step and r["source"] == "tiny")
        if seen > length and wrap is None:
            wrap = step
    assert wrap is not None and tiny["wrap_step"] == wrap
    assert tiny["epochs"] == pytest.approx(seen / length)
    # The dump's wrapped source index repeats the first epoch's reads.
    tiny_rows = [r for r in rows if r["source"] == "tiny"]
    assert [r["source_index"] for r in tiny_rows] == [i % length for i in range(len(tiny_rows))]


def test_first_exhausted_ends_where_the_loader_stops(shared, tmp_path, capsys):
    cfg = load(tmp_path, TINY_YAML, cache=shared["cache"], tiny=shared["tiny"], stop="first_exhausted")
    result = data_schedule.main(cfg)
    printed = capsys.readouterr().out
    tokens = loader_tokens(cfg, STEPS)
    assert result["end_step"] == len(tokens) < STEPS
    assert result["steps"] == len(tokens)
    assert result["ended_by"] == "tiny"
    tiny = next(s for s in result["sources"] if s["name"] == "tiny")
    assert tiny["exhausted_step"] == result["end_step"]
    assert f"the data ends at step {result['end_step']}" in printed
    # The plan's counts cover exactly the steps the loader yielded.
    dump = tmp_path / "rows.jsonl"
    data_schedule.main(cfg, dump=(0, len(tokens), str(dump)))
    rows = read_dump(dump)
    check_rows_match_loader(cfg, rows, tokens)
    for s in tiny, next(s for s in result["sources"] if s["name"] == "code"):
        assert s["sequences"] == sum(1 for r in rows if r["source"] == s["name"])
    with pytest.raises(ValueError, match="past the last planned step"):
        data_schedule.main(cfg, dump=(0, len(tokens) + 1, str(dump)))


def test_single_source_is_one_stage_and_ends_with_its_data(shared, tmp_path):
    cfg = load(tmp_path, SINGLE_YAML, cache=shared["cache"] / "single")
    dump = tmp_path / "rows.jsonl"
    result = data_schedule.main(cfg)
    tokens = loader_tokens(cfg, 100)
    assert not result["is_mixture"] and len(result["stages"]) == 1
    assert result["end_step"] == len(tokens) < 100
    (src,) = result["sources"]
    assert src["name"] == "data" and src["exhausted_step"] == len(tokens)
    assert result["stages"][0]["sequences"] == 16 * len(tokens)
    data_schedule.main(cfg, dump=(0, len(tokens), str(dump)))
    check_rows_match_loader(cfg, read_dump(dump), tokens)  # block shuffle map included


# -- closed form against brute force over synthetic sources, every stop strategy --------------------
@pytest.mark.parametrize("block", [None, 4])
@pytest.mark.parametrize("stop", ["restart", "first_exhausted", "all_exhausted"])
def test_events_and_counts_match_brute_force(stop, block):
    lengths = {"a": 7, "b": 13, "c": 40}
    sources = {n: ListAsyncDataset(np.arange(k) + 10_000 * i) for i, (n, k) in enumerate(lengths.items())}
    weights = [
        (0, {"a": 0.5, "b": 0.3, "c": 0.2}),
        (3, {"a": 0.1, "b": 0.2, "c": 0.7}),
        (9, {"a": 1, "b": 1, "c": 2}),
    ]
    schedule = BatchSchedule([ScheduleStep(0, 4), ScheduleStep(5, 8)])
    mix = MixtureDataset(
        sources, weights, batch_schedule=schedule, block_size=block, key=5, stop_strategy=stop
    )
    num_steps = 40
    plan = planner.plan_data(mix, schedule, num_steps, seq_len=2)

    with DataLoader(mix, schedule, prefetch_depth=0).iter_from_step(0, num_steps) as it:
        batches = {b.step: np.asarray(b.data) for b in it}
    assert plan.steps == len(batches)
    assert plan.end_step == (None if len(batches) == num_steps else len(batches))
    names = list(lengths)
    drawn = {n: 0 for n in names}
    wrap, last_fresh = {}, {}
    per_stage = np.zeros((3, 3), dtype=int)
    for step in range(len(batches)):
        ids = batches[step] // 10_000
        for i, n in enumerate(names):
            drawn[n] += int((ids == i).sum())
            per_stage[stage_of(step, (0, 3, 9)), i] += int((ids == i).sum())
            if drawn[n] > lengths[n]:
                wrap.setdefault(n, step)
            if drawn[n] >= lengths[n]:
                last_fresh.setdefault(n, step)
    assert [[s.sequences for s in st.sources] for st in plan.stages] == per_stage.tolist()
    for s in plan.sources:
        assert s.sequences == drawn[s.name]
        if stop == "restart":
            assert s.wrap_step == wrap.get(s.name) and s.exhausted_step is None
        elif stop == "all_exhausted":
            assert s.wrap_step == wrap.get(s.name) and s.exhausted_step == last_fresh.get(s.name)
        else:
            assert s.wrap_step is None and s.name not in wrap  # nothing is ever read twice
    if stop == "first_exhausted":
        assert plan.end_step is not None
        assert [s.exhausted_step for s in plan.sources if s.name == plan.ended_by] == [plan.end_step]
    if stop == "all_exhausted":
        # The last source's last example may fall in the trailing partial batch, which the loader drops.
        assert plan.end_step is not None and plan.ended_by in names


# -- speed, plot, CLI ---------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [None, 16])
def test_a_million_steps_plan(shared, tmp_path, block):
    cfg = mixture_config(shared, tmp_path, block)
    schedule = cfg.trainer.batch_schedule
    train_set = cfg.data.train_set(SEQ_LEN, schedule, key=data_key(cfg))
    plan = planner.plan_data(train_set, schedule, 1_000_000, seq_len=SEQ_LEN)
    data_schedule.format_plan(plan)
    segments = planner.composition_segments(train_set, schedule, plan.steps)
    assert plan.stages[-1].last_step == 999_999
    total = schedule.global_data_offset_by_step(1_000_000)
    assert sum(st.sequences for st in plan.stages) == total
    assert sum((hi - lo) * sum(c.values()) for lo, hi, c in segments) == pytest.approx(total)
    assert all(s.wrap_step is not None for s in plan.sources)  # ~1.4k windows each: all wrap


def test_plot_writes_a_png(shared, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
    cfg = mixture_config(shared, tmp_path, None)
    out = tmp_path / "plots" / "plan.png"
    result = data_schedule.main(cfg, plot=str(out))
    assert result["plot"] == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def _cli(*args, cwd=REPO):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "levanter.main.data_schedule", *args],
        capture_output=True, text=True, cwd=cwd, env=env,
    )


def test_cli_user_errors_exit_2_without_a_traceback(shared, tmp_path):
    r = _cli()
    assert r.returncode == 2 and "--config_path" in r.stderr and "Traceback" not in r.stderr
    path = tmp_path / "c.yaml"
    path.write_text(MIXTURE_YAML.format(cache=shared["cache"], shuffle="true", block="null"))
    r = _cli("--config_path", str(path), "--dump", "9:3", str(tmp_path / "x.jsonl"))
    assert r.returncode == 2 and "--dump" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # In-process for the rest (no interpreter start-up each).
    for argv in (
        ["--config_path", str(path), "--dump", "nine", str(tmp_path / "x.jsonl")],
        ["--config_path", str(path), "--steps", "0"],
        ["--config_path", str(tmp_path / "missing.yaml")],
        ["--config_path", str(path), "--trainer.num_train_steps", "oops"],
    ):
        with pytest.raises(SystemExit) as e:
            data_schedule.cli(argv)
        assert e.value.code == 2, argv


def test_cli_plans_with_overrides(shared, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(MIXTURE_YAML.format(cache=shared["cache"], shuffle="true", block="null"))
    result = data_schedule.cli(["--config_path", str(path), "--trainer.num_train_steps", "12"])
    assert result["num_steps"] == 12 and result["stages"][2]["last_step"] is None
    assert "stage 2: from step 19, not reached" in capsys.readouterr().out


def test_a_data_only_config_plans_like_the_train_lm_config_holding_it(shared, tmp_path, capsys):
    whole = MIXTURE_YAML.format(cache=shared["cache"], shuffle="true", block="null")
    data = whole.split("\ndata:\n", 1)[1].split("\nmodel:", 1)[0]
    path = tmp_path / "data.yaml"
    path.write_text("\n".join(line[2:] for line in data.splitlines()) + "\n")  # the section, dedented
    path.with_name("whole.yaml").write_text(whole)
    args = ["--num_train_steps", "25", "--seq_len", "64"]
    # The data-only file's overrides are its own keys (no data. prefix).
    alone = data_schedule.cli(["--config_path", str(path), "--batch_size", "8", *args, "--stop_strategy", "restart"])
    held = data_schedule.cli(["--config_path", str(path.with_name("whole.yaml")), "--batch_size", "8", *args])
    assert alone == held and alone["num_steps"] == 25 and len(alone["stages"]) == 3
    # The shipped data-only config parses for planning once given a batch size and a length.
    cfg = data_schedule.load_config(os.path.join(REPO, "config", "data", "embedded_curriculum.yaml"), [],
                                    batch_size=8, num_train_steps=100)
    assert cfg.trainer.num_train_steps == 100 and [s for s, _ in cfg.data.stages()] == [0, 80]
    assert cfg.trainer.batch_schedule.batch_size_at_step(0) == 8


def test_entry_points_never_import_each_other():
    """Every module of levanter.main is an entry point; what two of them share (the run config) lives in
    a library module both import. Checked on each module's syntax tree, so an import inside a function
    counts too."""
    import ast

    main_dir = os.path.join(REPO, "src", "levanter", "main")
    entry_points = {f[:-3] for f in os.listdir(main_dir) if f.endswith(".py") and f != "__init__.py"}
    assert {"train_lm", "data_schedule", "cache_dataset"} <= entry_points
    found = []
    for name in sorted(entry_points):
        with open(os.path.join(main_dir, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x / from .x import y
                    base = "levanter.main" + ("." + base if base else "")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[:2] == ["levanter", "main"] and len(parts) > 2 and parts[2] in entry_points - {name}:
                    found.append(f"{name} imports {target} (line {node.lineno})")
    assert found == []
    from levanter.main import train_lm  # upstream's path to the config still works for users' scripts

    assert train_lm.TrainLmConfig is TrainLmConfig and train_lm.data_key is data_key
