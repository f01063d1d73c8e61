"""Curricula you can trust: evals at stage boundaries, the append-only data-schedule check on resume,
and batch fingerprints that identify exactly what each step trained on."""

import dataclasses
import json

import pytest

from levanter.checkpoint import CheckpointerConfig, CheckpointInterval
from levanter.data.config import LMMixtureDatasetConfig
from levanter.data.source_config import LMDatasetSourceConfig
from levanter.main import train_lm
from levanter.models import Gpt2Config
from levanter.optim import AdamConfig
from levanter.tracker import JsonConfig
from levanter.training import TrainerConfig

PROSE = "embedded://python-docs/validation"
CODE = "embedded://python-code/validation"


def curriculum(tmp_path, run_id, stages, *, steps, steps_per_eval=100, keep_every=4):
    data = LMMixtureDatasetConfig(
        tokenizer="byte",
        cache_dir=str(tmp_path / "cache"),
        shuffle=True,
        configs={"prose": LMDatasetSourceConfig(train_urls=[PROSE], validation_urls=[PROSE]),
                 "code": LMDatasetSourceConfig(train_urls=[CODE], validation_urls=[CODE])},
        train_weights=stages,
        mixture_block_size=None,
    )
    trainer = TrainerConfig(
        num_train_steps=steps, train_batch_size=8, require_accelerator=False, id=run_id,
        log_dir=str(tmp_path / "logs"), tracker=JsonConfig(), steps_per_eval=steps_per_eval, max_eval_batches=1,
        checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=[CheckpointInterval(every=keep_every)]),
    )
    return train_lm.TrainLmConfig(
        data=data, trainer=trainer,
        model=Gpt2Config(hidden_dim=32, num_heads=4, num_layers=1, seq_len=32, gradient_checkpointing=False),
        optimizer=AdamConfig(learning_rate=1e-2, warmup=0.0, weight_decay=0.0, lr_schedule="constant"),
        prefetch_depth=2,
    )


def rows(tmp_path, run_id):
    with open(tmp_path / "logs" / run_id / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def per_step(rs, key):
    return {r["step"]: r[key] for r in rs if key in r}


W1 = {"prose": 0.75, "code": 0.25}
W2 = {"prose": 0.25, "code": 0.75}


@pytest.mark.slow
def test_eval_runs_at_the_stage_boundary_on_the_model_before_the_new_stage(tmp_path):
    # Run A switches at 7, between the evals every 4 steps; run B has a boundary at 7 that changes nothing
    # (same weights), so its model after 7 updates is A's, trained only on stage-1 data.
    train_lm.main(curriculum(tmp_path, "a", [(0, W1), (7, W2)], steps=10, steps_per_eval=4))
    train_lm.main(curriculum(tmp_path, "b", [(0, W1), (7, W1)], steps=10, steps_per_eval=4))
    a, b = rows(tmp_path, "a"), rows(tmp_path, "b")
    assert sorted(per_step(a, "eval/loss")) == [4, 7, 8, 10]
    assert per_step(a, "eval/loss")[7] == per_step(b, "eval/loss")[7]  # bit for bit
    la, lb = per_step(a, "train/loss"), per_step(b, "train/loss")
    assert all(la[s] == lb[s] for s in range(7)) and la[7] != lb[7]
    fa, fb = per_step(a, "data/fingerprint"), per_step(b, "data/fingerprint")
    assert [s for s in range(10) if fa[s] != fb[s]][0] == 7
    assert per_step(a, "data/source_counts/code")[6] == 2 and per_step(a, "data/source_counts/code")[7] == 6


@pytest.mark.slow
def test_resume_refuses_past_edits_and_accepts_future_ones(tmp_path):
    base = [(0, {"prose": 1.0}), (6, {"code": 1.0})]
    train_lm.main(curriculum(tmp_path, "x", base, steps=8))  # checkpoints at 4 and 8

    moved = [(0, {"prose": 1.0}), (5, {"code": 1.0})]
    with pytest.raises(ValueError, match=r"changed at step 5 .* before the checkpoint at step 8"):
        train_lm.main(curriculum(tmp_path, "x", moved, steps=12))

    future = base + [(10, {"prose": 0.5, "code": 0.5})]
    train_lm.main(curriculum(tmp_path, "x", future, steps=12))  # resumes from step 8
    train_lm.main(curriculum(tmp_path, "y", future, steps=12))  # the same config, uninterrupted
    train_lm.main(curriculum(tmp_path, "z", base, steps=12))  # without the edit
    x, y, z = (per_step(rows(tmp_path, r), "data/fingerprint") for r in "xyz")
    assert sorted(x) == list(range(12))
    assert x == y
    assert per_step(rows(tmp_path, "x"), "train/loss") == per_step(rows(tmp_path, "y"), "train/loss")
    assert [s for s in range(12) if x[s] != z[s]][0] == 10  # the data changes exactly at the edited stage


@pytest.mark.slow
def test_override_flag_allows_a_past_edit(tmp_path):
    train_lm.main(curriculum(tmp_path, "o", [(0, {"prose": 1.0}), (6, {"code": 1.0})], steps=8))
    cfg = curriculum(tmp_path, "o", [(0, {"prose": 1.0}), (5, {"code": 1.0})], steps=10)
    out = train_lm.main(dataclasses.replace(cfg, allow_data_schedule_change=True))
    assert out["final_step"] == 10


@pytest.mark.slow
def test_reported_experiment_first_difference_is_exactly_the_80_percent_step(tmp_path):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "exp.json"
    # Two devices instead of the suite's eight; the suite's other XLA flags (the backend optimization level of
    # tests/conftest.py: six short runs, bound by their compiles) are kept.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    r = subprocess.run(
        [sys.executable, os.path.join(repo, "scripts", "curriculum_experiment.py"), "--quick", "--json", str(out),
         "--workdir", str(tmp_path)],
        capture_output=True, text=True,
        env={**os.environ, "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=2", *flags])},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {x["variant"]: x for x in json.loads(out.read_text())}
    assert set(results) == {"constant", "batch_schedule", "grad_accum"}
    for res in results.values():
        s = res["switch_a"]
        assert s == 24 and res["switch_b"] == 27
        assert res["first_loss_diff"] == res["first_fingerprint_diff"] == res["first_counts_diff"] == s
        assert res["first_stage2_batch_a"] == s
        assert s in res["eval_steps_a"]  # an eval exactly at the switch


def test_compare_runs_script_finds_the_first_difference_and_ignores_timing(tmp_path):
    """``scripts/compare_runs.py`` (the bit-for-bit check of two runs' metrics): runs that differ only in
    what measures time are identical; a loss differing in its last bit is found at its step and key;
    an unreadable file is one ``error:`` paragraph with status 2 (docs/reference/errors.md)."""
    import math
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "compare_runs.py")

    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    base = [{"step": s, "train/loss": 1.0 / (s + 1), "data/fingerprint": f"f{s}", "data/source_counts/a": s,
             "throughput/step_seconds": 0.1, "data/wait_seconds": 0.01} for s in range(5)]
    base.append({"step": 4, "eval/loss": 0.5})
    slower = [dict(r, **{"throughput/step_seconds": 9.0}) if "train/loss" in r else r for r in base]
    off = [dict(r) for r in base]
    off[3]["train/loss"] = math.nextafter(off[3]["train/loss"], 1.0)  # one ulp more

    def run(a, b):
        return subprocess.run([sys.executable, script, a, b], capture_output=True, text=True)

    same = run(write("a.jsonl", base), write("b.jsonl", slower))
    assert same.returncode == 0 and "identical" in same.stdout and "eval 1" in same.stdout
    diff = run(write("a.jsonl", base), write("c.jsonl", off))
    assert diff.returncode == 1 and "first at step 3, train/loss" in diff.stdout
    missing = run(str(tmp_path / "nowhere.jsonl"), write("a.jsonl", base))
    assert missing.returncode == 2 and missing.stderr.startswith("error: cannot read the metrics file")
    assert "Traceback" not in missing.stderr and missing.stderr.count("\n") == 1
