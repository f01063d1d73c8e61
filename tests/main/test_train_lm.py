"""train_lm end to end on CPU: loss falls (8 devices), grad accumulation reads the same indices, bad
configs fail before any work naming the key, every shipped YAML parses, kill -9 resumes bit for bit."""

import dataclasses
import datetime
import glob
import json
import logging
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import loss_fall, train_nano_config
from levanter.checkpoint import CheckpointerConfig, CheckpointInterval, restore
from levanter.config import ConfigError, parse_config
from levanter.data.config import UrlSingleDatasetLMConfig
from levanter.data.loader import Batch, DataLoader
from levanter.training import lm_loss_fn
import levanter.run.data
from levanter.main import train_lm
from levanter.memory import available_memory, check_memory
from levanter.models import Gpt2Config, LlamaConfig
from levanter.optim import AdamConfig
from levanter.schedule import ScheduleStep
from levanter.tracker import JsonConfig
from levanter.training import StepMismatchError, TrainerConfig, check_step, named_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config(tmp_path, *, steps=12, batch=8, model=None, **trainer_kw) -> train_lm.TrainLmConfig:
    data = UrlSingleDatasetLMConfig(
        train_urls=["embedded://python-docs/validation"],
        validation_urls=["embedded://python-code/validation"],
        tokenizer="byte",
        cache_dir=str(tmp_path / "cache"),
        shuffle=True,
    )
    tkw = dict(
        num_train_steps=steps,
        train_batch_size=batch,
        require_accelerator=False,
        id="tiny",
        log_dir=str(tmp_path / "logs"),
        tracker=JsonConfig(),
        checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=[CheckpointInterval(every=4)]),
        steps_per_eval=6,
        max_eval_batches=2,
    )
    tkw.update(trainer_kw)
    return train_lm.TrainLmConfig(
        data=data,
        model=model or Gpt2Config(hidden_dim=32, num_heads=4, num_layers=2, seq_len=32, gradient_checkpointing=False),
        trainer=TrainerConfig(**tkw),
        optimizer=AdamConfig(learning_rate=1e-2, warmup=0.0, weight_decay=0.0, lr_schedule="constant"),
        prefetch_depth=2,
    )


def metrics(tmp_path, run_id="tiny"):
    with open(tmp_path / "logs" / run_id / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(rows):
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.devices(8)
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_loss_falls_on_8_devices(tmp_path, model, capsys, caplog):
    """... and, with stdout not a terminal, prints a progress line per step (progress_interval 0), every
    eval's losses and a summary (tests/main/test_run_output.py checks the lines against the metrics)."""
    assert jax.device_count() == 8
    m = None
    if model == "llama":
        m = LlamaConfig(hidden_dim=32, intermediate_dim=64, num_heads=4, num_kv_heads=2, num_layers=2, seq_len=32,
                        gradient_checkpointing=False)
    cfg = tiny_config(tmp_path, steps=16, model=m, progress_interval=datetime.timedelta(0))
    caplog.set_level(logging.INFO)
    out = train_lm.main(cfg)
    assert out["final_step"] == 16
    from test_run_output import check_console_output

    check_console_output(tmp_path, capsys.readouterr().out, steps=16, evals=(6, 12, 16))
    assert "resuming" not in caplog.text  # a fresh start resumes nothing
    if model == "gpt2":  # rerun with fewer steps than the run trained: says so, touches nothing
        from test_run_output import check_finished_rerun

        check_finished_rerun(tmp_path, capsys, steps=16)
    rows = metrics(tmp_path)
    losses = train_losses(rows)
    assert sorted(losses) == list(range(16))
    assert np.mean([losses[s] for s in range(13, 16)]) < losses[0] - 1.0
    for r in rows:
        if "train/loss" in r:
            assert r["data/wait_seconds"] >= 0 and r["throughput/tokens_per_second"] > 0
            assert "train/learning_rate" in r
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [6, 12, 16]
    assert os.path.isdir(tmp_path / "ckpt" / "tiny" / "step-16")


@pytest.mark.slow
@pytest.mark.devices(8)
def test_qwen3_nano_config_trains_with_falling_loss(tmp_path):
    """config/qwen3_nano.yaml as shipped (model, optimizer, mixture of the two embedded sources), shortened."""
    cfg, by_step = train_nano_config(tmp_path, "qwen3_nano", steps=24, batch_size=8)
    assert type(cfg.model).__name__ == "Qwen3Config" and cfg.model.HeadSize.size == 64
    assert loss_fall(by_step) > 1.5, by_step


def test_batch_schedule_and_grad_accumulation_read_the_same_indices(tmp_path, monkeypatch):
    requests = []
    original = DataLoader.fetch

    async def recording_fetch(self, step, *args, **kwargs):
        if self.schedule.batch_size_at_step(0) == 8 and len(self.schedule.segments) == 2:  # the train loader
            requests.append((step, tuple(self.indices_for_step(step).tolist())))
        return await original(self, step, *args, **kwargs)

    monkeypatch.setattr(DataLoader, "fetch", recording_fetch)
    schedule = [ScheduleStep(0, 8), ScheduleStep(3, 16)]
    runs = {}
    for pdp in (-1, 1):
        requests.clear()
        d = tmp_path / f"pdp{pdp}"
        cfg = tiny_config(d, steps=6, train_batch_size=schedule, per_device_parallelism=pdp, steps_per_eval=100)
        train_lm.main(cfg)
        rows = metrics(d)
        runs[pdp] = (sorted(requests), train_losses(rows), [r["data/fingerprint"] for r in rows if "train/loss" in r])
    (req_plain, loss_plain, fp_plain), (req_accum, loss_accum, fp_accum) = runs[-1], runs[1]
    assert req_plain == req_accum
    assert fp_plain == fp_accum  # fingerprints do not depend on microbatching
    assert [s for s, _ in req_plain] == list(range(6))
    assert [len(i) for _, i in req_plain] == [8, 8, 8, 16, 16, 16]
    np.testing.assert_allclose([loss_accum[s] for s in range(6)], [loss_plain[s] for s in range(6)], rtol=2e-5)


def test_trainer_refuses_a_batch_of_another_step():
    check_step(Batch(step=3, global_offset=24, batch_size=8, data=None), 3)
    with pytest.raises(StepMismatchError, match="batch of step 4 but the trainer is at step 3"):
        check_step(Batch(step=4, global_offset=32, batch_size=8, data=None), 3)


def steps_saved(run_dir) -> list:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "step-*")))


def test_trainer_train_runs_the_loop_and_its_hooks(tmp_path):
    """Trainer.train alone, on batches made by hand: hooks see every step in order, evaluations land where
    is_eval_step says (and at the resumed step), the last step is checkpointed; batches that end early
    checkpoint the last state and raise DataEndedError; a batch of another step is refused."""
    import haliax as hax

    from levanter.training import DataEndedError, StepReport, Trainer, TrainHooks

    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    vocab = hax.Axis("vocab", 61)
    ckpt = CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=[])
    tcfg = TrainerConfig(num_train_steps=4, train_batch_size=8, require_accelerator=False, checkpointer=ckpt)
    trainer = Trainer(tcfg, AdamConfig(learning_rate=1e-2).build(4), lm_loss_fn(0.0, 60))
    rng = np.random.default_rng(0)
    data = [{"tokens": jax.device_put(rng.integers(0, 61, (8, 16)).astype(np.int32))} for _ in range(4)]

    def batches(steps):
        return [Batch(step=s, global_offset=8 * s, batch_size=8, data=data[s]) for s in steps]

    class Recorder(TrainHooks):
        def __init__(self):
            self.events = []

        def on_step(self, r: StepReport) -> None:
            assert np.isfinite(r.loss) and np.isfinite(r.grad_norm) and not r.skipped and r.seconds > 0
            self.events.append(("step", r.step))

        def is_eval_step(self, step: int) -> bool:
            return step % 2 == 0

        def evaluate(self, model, step: int) -> None:
            self.events.append(("eval", step))

    def to_named(d):
        return named_batch(d, model_cfg.Pos)

    def fresh():
        return trainer.initial_state(lambda k: model_cfg.build(vocab, key=k), key=jax.random.PRNGKey(3))

    hooks = Recorder()
    state = trainer.train(fresh(), batches(range(4)), to_named=to_named, checkpointer=ckpt.create("full"),
                          hooks=hooks)
    assert int(state.step) == 4
    assert hooks.events == [("step", 0), ("step", 1), ("eval", 2), ("step", 2), ("step", 3), ("eval", 4)]
    assert steps_saved(tmp_path / "ckpt" / "full") == ["step-4"]

    # Batches that end at step 2 of 4: the state after step 1 is checkpointed, and the run is an error.
    hooks = Recorder()
    with pytest.raises(DataEndedError, match="the training data ended at step 2 of trainer.num_train_steps=4"):
        trainer.train(fresh(), batches(range(2)), to_named=to_named, checkpointer=ckpt.create("mid"), hooks=hooks)
    assert hooks.events == [("step", 0), ("step", 1), ("eval", 2)]
    assert steps_saved(tmp_path / "ckpt" / "mid") == ["step-2"]

    # Resumed at step 2 (an eval step): the state as restored is evaluated first, then training goes on
    # to the same final parameters as the uninterrupted run.
    point = tcfg.resume_point("mid")
    restored = restore(fresh(), point)
    assert point is not None and point.step == int(restored.step) == 2
    hooks = Recorder()
    resumed = trainer.train(restored, batches(range(2, 4)), to_named=to_named, checkpointer=ckpt.create("mid"),
                            hooks=hooks)
    assert hooks.events == [("eval", 2), ("step", 2), ("step", 3), ("eval", 4)]
    for a, b in zip(jax.tree.leaves(resumed.model), jax.tree.leaves(state.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    with pytest.raises(StepMismatchError, match="batch of step 3 but the trainer is at step 0"):
        trainer.train(fresh(), batches([3]), to_named=to_named, checkpointer=ckpt.create("bad"))


def _lagged_trainer(tmp_path, num_steps=6):
    """A tiny model whose loss is multiplied by each batch's ``scale`` (NaN poisons a step), with
    ``to_named`` counting the steps dispatched (it is called just before each dispatch)."""
    import haliax as hax
    import jax.numpy as jnp

    from levanter.training import Trainer

    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    vocab = hax.Axis("vocab", 61)
    tcfg = TrainerConfig(num_train_steps=num_steps, train_batch_size=8, require_accelerator=False)
    base = lm_loss_fn(0.0, 60)

    def loss(model, b):
        total, *rest = base(model, {"tokens": b["tokens"]})
        return (total * b["scale"], *rest)

    trainer = Trainer(tcfg, AdamConfig(learning_rate=1e-2).build(num_steps), loss)
    rng = np.random.default_rng(0)
    tokens = [jax.device_put(rng.integers(0, 61, (8, 16)).astype(np.int32)) for _ in range(num_steps)]
    dispatched = []

    def batches(nan_at=None):
        for s in range(num_steps):
            scale = np.float32(np.nan if s == nan_at else 1.0)
            yield Batch(step=s, global_offset=8 * s, batch_size=8, data={"tokens": tokens[s], "scale": scale})

    def to_named(d):
        dispatched.append(1)
        return {"tokens": named_batch({"tokens": d["tokens"]}, model_cfg.Pos)["tokens"],
                "scale": jnp.asarray(d["scale"])}

    def fresh():
        return trainer.initial_state(lambda k: model_cfg.build(vocab, key=k), key=jax.random.PRNGKey(3))

    return trainer, fresh, batches, to_named, dispatched


def test_the_loop_reads_metrics_one_step_late_except_where_the_state_is_needed(tmp_path):
    """Step N+1 is dispatched before step N's report, except after a step whose state is saved (keep every
    3: after steps 2 and 5) or evaluated; the reports (losses, gradient norms) and the final parameters are
    bit for bit those of a loop that finishes every step first (a checkpointer without ``save_due``)."""
    from levanter.training import StepReport, TrainHooks

    trainer, fresh, batches, to_named, dispatched = _lagged_trainer(tmp_path)

    class Recorder(TrainHooks):
        def __init__(self, eval_at=()):
            self.reports, self.evals, self.eval_at = [], [], eval_at

        def on_step(self, r: StepReport) -> None:
            assert r.seconds > 0
            self.reports.append((r.step, len(dispatched), r.loss, r.grad_norm))

        def is_eval_step(self, step: int) -> bool:
            return step in self.eval_at

        def evaluate(self, model, step: int) -> None:
            self.evals.append((step, len(dispatched)))

    class EveryStepCheckpointer:  # a checkpointer that does not say when it saves
        def __init__(self, inner):
            self.inner = inner

        def on_step(self, state, step, force=False):
            return self.inner.on_step(state, step, force=force)

        def wait_until_finished(self):
            self.inner.wait_until_finished()

    ckpt = CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=[CheckpointInterval(every=3)])
    lagged = Recorder(eval_at={4})
    state = trainer.train(fresh(), batches(), to_named=to_named, checkpointer=ckpt.create("lag"), hooks=lagged)
    # (step reported, steps dispatched when it was): step 2 is saved, step 3 evaluated, step 5 is the last.
    assert [(s, n) for s, n, *_ in lagged.reports] == [(0, 2), (1, 3), (2, 3), (3, 4), (4, 6), (5, 6)]
    assert lagged.evals == [(4, 4)]  # the state after step 3, before step 4 was dispatched
    assert steps_saved(tmp_path / "ckpt" / "lag") == ["step-3", "step-6"]

    dispatched.clear()
    synchronous = Recorder(eval_at={4})
    plain = trainer.train(fresh(), batches(), to_named=to_named,
                          checkpointer=EveryStepCheckpointer(ckpt.create("sync")), hooks=synchronous)
    assert [(s, n) for s, n, *_ in synchronous.reports] == [(s, s + 1) for s in range(6)]
    assert [r[2:] for r in synchronous.reports] == [r[2:] for r in lagged.reports]
    for a, b in zip(jax.tree.leaves(plain.model), jax.tree.leaves(state.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for run in ("lag", "sync"):  # the saved state after step 5 is the final one
        point = TrainerConfig(require_accelerator=False, checkpointer=ckpt).resume_point(run)
        assert point.step == 6
        for a, b in zip(jax.tree.leaves(restore(fresh(), point).model), jax.tree.leaves(state.model)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_nan_found_a_step_late_names_its_step_and_no_later_state_is_saved(tmp_path):
    """A NaN loss at step 4, whose report comes after step 5 was dispatched: the run stops naming step 4,
    the hooks saw steps 0-3, and the last checkpoint is step-4 (the state after step 3; keep every 2 would
    have saved step-6 next)."""
    from levanter.training import StepReport, TrainHooks

    trainer, fresh, batches, to_named, dispatched = _lagged_trainer(tmp_path)
    seen = []

    class Hooks(TrainHooks):
        def on_step(self, r: StepReport) -> None:
            seen.append(r.step)

    ckpt = CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=[CheckpointInterval(every=2)])
    stopped = r"train/loss is NaN at step 4; training stopped and the state after this step was not saved"
    with pytest.raises(FloatingPointError, match=stopped):
        trainer.train(fresh(), batches(nan_at=4), to_named=to_named, checkpointer=ckpt.create("nan"), hooks=Hooks())
    assert len(dispatched) == 6  # step 5 was already dispatched when step 4's loss was read
    assert seen == [0, 1, 2, 3]
    assert steps_saved(tmp_path / "ckpt" / "nan") == ["step-2", "step-4"]


def write_yaml(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("trainer:\n  num_train_step: 10\n", "num_train_step"),  # typo
        ("trainer:\n  bogus: 1\n", "bogus"),  # unknown key
        ("trainer:\n  num_train_steps: ten\n", "num_train_steps"),  # wrong type
        ("model:\n  type: gpt2\n  hidden_dim: 30\n  num_heads: 4\n", "model.hidden_dim"),
        ("model:\n  type: gpt2\n  seq_len: 2048\n  n_positions: 1024\n", "model.seq_len"),
        ("model:\n  type: transformer9000\n", "transformer9000"),
    ],
)
def test_bad_yaml_fails_naming_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(train_lm.TrainLmConfig, write_yaml(tmp_path, text))
    assert fragment in str(e.value)


def test_bad_values_fail_before_any_work(tmp_path):
    if jax.device_count() > 1:  # a batch the data-parallel devices cannot split (one device takes any)
        cfg = tiny_config(tmp_path, batch=12)
        with pytest.raises(ValueError, match="trainer.train_batch_size"):
            train_lm.main(cfg)
    (tmp_path / "afile").write_text("not a directory")
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, checkpointer=CheckpointerConfig(base_path=str(tmp_path / "afile" / "x")))
    )
    with pytest.raises(ValueError, match="trainer.checkpointer.base_path"):
        train_lm.main(cfg)
    if jax.default_backend() == "cpu":  # an accelerator's backend passes require_accelerator
        cfg = tiny_config(tmp_path, require_accelerator=True)
        with pytest.raises(ValueError, match="trainer.require_accelerator"):
            train_lm.main(cfg)
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))  # nothing was built


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "config", "*.yaml"))))
def test_every_shipped_config_parses(path):
    cfg = parse_config(train_lm.TrainLmConfig, path)
    assert cfg.trainer.num_train_steps > 0
    cfg.trainer.batch_schedule  # noqa: B018 -- validates the schedule
    if hasattr(cfg.data, "stages"):
        cfg.data.stages()


UPSTREAM_CONFIGS = {
    # The shapes of upstream Levanter's own example configs, with only the data paths changed.
    "gpt2_nano.yaml": """
data:
  train_urls: ["embedded://python-docs/validation"]
  validation_urls: ["embedded://python-code/validation"]
  tokenizer: byte
model:
  type: gpt2
  hidden_dim: 32
  num_heads: 4
  num_layers: 2
trainer:
  mp: bfloat16
  num_train_steps: 100

  checkpointer:
    keep:
      - every: 50
    save_interval: 5m

  per_device_parallelism: -1
  train_batch_size: 32

  tensor_parallel_axes: ["mlp", "heads"]
  fsdp_axis: "embed"
  batch_axis: "batch"
""",
    "gpt2_nano_mixture.yaml": """
data:
  cache_dir: data_mix_cache
  tokenizer: byte
  configs:
    wikitext:
      train_urls: ["embedded://python-docs/validation"]
    w2:
      train_urls: ["embedded://python-code/validation"]
      cache_dir: wikitext2_cache
  train_weights:
    - [0, {"wikitext": 0.8, "w2": 0.2}]
    - [100, {"w2": 0.5, "wikitext": 0.5}]
model:
  type: gpt2
  hidden_dim: 32
  num_heads: 4
  num_layers: 2
trainer:
  mp: f32
  num_train_steps: 100

  checkpointer:
    keep:
      - every: 50
    save_interval: 5m

  per_device_eval_parallelism: 16
  train_batch_size: 32

  tensor_parallel_axes: ["mlp", "heads"]
  fsdp_axis: "embed"
  batch_axis: "batch"
""",
    "gpt2_small_fast_batch_schedule.yaml": """
data:
  configs:
    owt:
      train_urls:
        - "data/openwebtext_train.{1..128}-of-128.jsonl.gz"
      validation_urls:
        - "data/openwebtext_val.{1..8}-of-8.jsonl.gz"
    wikitext:
      train_urls: ["data/wikitext.jsonl"]
  train_weights:
    - [0, {"owt": 0.8, "wikitext": 0.2}]
    - [1000, {"owt": 0.5, "wikitext": 0.5}]
  tokenizer: gpt2
  cache_dir: "gs://levanter-data/tokenized/data_mix"
  mixture_block_size: 128
model:
  type: gpt2
  hidden_dim: 768
  num_heads: 12
  num_layers: 12
  seq_len: 1024
  gradient_checkpointing: true
  scale_attn_by_inverse_layer_idx: true
trainer:
  tracker:
    - type: wandb
      project: "levanter"
      tags: [ "openwebtext", "gpt2", "itest"]

  mp: p=f32,c=bfloat16
  model_axis_size: 1
  per_device_parallelism: -1
  per_device_eval_parallelism: 128

  train_batch_size:
    - start: 0
      value: 64
    - start: 64
      value: 128
    - start: 256
      value: 64
    - start: 1024
      value: 256
  num_train_steps: 20000
  allow_nondivisible_batch_size: true
optimizer:
  learning_rate: 1E-3
  weight_decay: 0.1
  warmup: 0.01
""",
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_CONFIGS))
def test_upstream_configs_parse(tmp_path, name):
    cfg = parse_config(train_lm.TrainLmConfig, write_yaml(tmp_path, UPSTREAM_CONFIGS[name], name))
    assert cfg.model.hidden_dim in (32, 768)
    if name == "gpt2_small_fast_batch_schedule.yaml":
        assert cfg.trainer.batch_schedule.batch_size_at_step(2000) == 256
        assert cfg.data.stages()[1][0] == 1000


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_nano.yaml", "gpt2_nano_mixture.yaml"])
def test_upstream_nano_configs_run(tmp_path, name):
    path = write_yaml(tmp_path, UPSTREAM_CONFIGS[name], name)
    extra = []
    if name == "gpt2_nano_mixture.yaml":
        # Upstream ships its second stage at step 100 = num_train_steps (it would never run, which is now an
        # error); shortened to 3 steps here, the switch moves to step 2 along with it.
        extra = ["--data.train_weights", "[[0, {wikitext: 0.8, w2: 0.2}], [2, {w2: 0.5, wikitext: 0.5}]]"]
        # As upstream's configs do, the data section lives in a file of its own, `!include`d relative to
        # the config (the override above still reaches into it).
        data, rest = UPSTREAM_CONFIGS[name].split("\nmodel:", 1)
        section = "\n".join(line[2:] for line in data.split("data:\n", 1)[1].splitlines())
        (tmp_path / "data").mkdir()
        write_yaml(tmp_path / "data", section + "\n", "mixture.yaml")
        path = write_yaml(tmp_path, "data: !include data/mixture.yaml\nmodel:" + rest, name)
    # One device, as on a user's machine; three steps are compile-bound, so without LLVM's backend
    # optimizations (tests/conftest.py): the same programs and numbers, compiled in less time.
    r = subprocess.run(
        [sys.executable, "-m", "levanter.main.train_lm", "--config_path", path, "--trainer.num_train_steps", "3",
         "--trainer.require_accelerator", "false", "--trainer.id", "up", "--trainer.tracker", "{type: json}",
         "--trainer.max_eval_batches", "1", "--model.seq_len", "128", *extra],
        cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(train_losses(metrics(tmp_path, "up"))) == 3


RESUME_YAML = """
data:
  train_urls: ["embedded://python-docs/validation"]
  validation_urls: ["embedded://python-code/validation"]
  tokenizer: byte
  cache_dir: {cache}
  shuffle: true
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 2, seq_len: 32, gradient_checkpointing: false}}
trainer:
  num_train_steps: 12
  train_batch_size: 8
  steps_per_eval: 100
  max_eval_batches: 2  # each eval reads 2 batches, not the whole validation split (~6 s a run)
  require_accelerator: false
  log_dir: {logs}
  tracker: {{type: json}}
  checkpointer: {{base_path: {ckpt}, keep: [{{every: 3}}]}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0}}
"""


def run_train(tmp_path, run_id, kill_at=None, signal_name=None, extra=()):
    cfg = write_yaml(tmp_path, RESUME_YAML.format(cache=tmp_path / "cache", logs=tmp_path / "logs",
                                                  ckpt=tmp_path / "ckpt"), "resume.yaml")
    # (the session's persistent compilation cache, tests/conftest.py, comes with os.environ)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    env.pop("LEVANTER_FAULT_KILL_AT", None)
    env.pop("LEVANTER_FAULT_SIGNAL", None)
    if kill_at:
        env["LEVANTER_FAULT_KILL_AT"] = kill_at
    if signal_name:
        env["LEVANTER_FAULT_SIGNAL"] = signal_name
    return subprocess.run(
        [sys.executable, "-m", "levanter.main.train_lm", "--config_path", cfg, "--trainer.id", run_id, *extra],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )


@pytest.mark.slow
def test_kill_9_or_ctrl_c_then_rerun_resumes_bit_for_bit(tmp_path):
    """kill -9 and Ctrl-C (SIGINT, sent by the process to itself at a known step through the fault point)
    both resume bit for bit; the reference run, with stdout to a pipe, prints progress lines, its eval
    losses and a summary, and nothing of JAX's or the malloc re-execution's start-up chatter."""
    ref = run_train(tmp_path, "ref", extra=["--trainer.progress_interval", "0", "--trainer.steps_per_eval", "6"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = ref.stdout.splitlines()
    losses_ref = train_losses(metrics(tmp_path, "ref"))
    step_lines = [x for x in out if x.startswith("step ")]
    assert len(step_lines) == 12, out  # progress_interval 0: every step
    for s, line in enumerate(step_lines):
        assert line.startswith(f"step {s + 1}/12 loss {losses_ref[s]:.4f} | "), line
        assert "tok/s" in line and "data wait" in line and "ETA" in line
    evals = {r["step"]: r["eval/loss"] for r in metrics(tmp_path, "ref") if "eval/loss" in r}
    for s in (6, 12):
        assert any(x.startswith(f"eval at step {s}: loss {evals[s]:.4f}") for x in out), out
    summary = "\n".join(out[out.index(next(x for x in out if x.startswith("finished at step"))):])
    assert summary.startswith("finished at step 12/12: trained 12 step(s)") and "tokens/s" in summary
    assert f"final train loss {losses_ref[11]:.4f} (step 11)" in summary and "eval at step 12" in summary
    assert str(tmp_path / "logs" / "ref" / "metrics.jsonl") in summary and str(tmp_path / "ckpt" / "ref") in summary
    for noise in ("Unable to initialize backend", "re-executed with", "GLIBC_TUNABLES", "resuming"):
        assert noise not in ref.stderr + ref.stdout, noise
    assert (tmp_path / "logs" / "ref" / "debug.log").exists()

    # SIGINT at the 4th step report: step 3's, made while step 4 runs (metrics are read a step late). The
    # run finishes step 4 and checkpoints the state after it, step 5 (not one of the keep steps).
    interrupted = run_train(tmp_path, "int", kill_at="train_after_step:4", signal_name="SIGINT")
    from levanter.training import PREEMPTED_EXIT_CODE

    assert interrupted.returncode == PREEMPTED_EXIT_CODE, interrupted.stderr[-3000:]
    assert "Traceback" not in interrupted.stderr and "KeyboardInterrupt" not in interrupted.stderr
    assert f"SIGINT: checkpointed step 5 in {tmp_path / 'ckpt' / 'int'}" in interrupted.stderr
    assert os.path.isdir(tmp_path / "ckpt" / "int" / "step-5")
    resumed = run_train(tmp_path, "int")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert train_losses(metrics(tmp_path, "int")) == losses_ref

    killed = run_train(tmp_path, "crash", kill_at="train_after_step:8")  # after step 7 (8 updates); last ckpt: 6
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert max(train_losses(metrics(tmp_path, "crash"))) == 7
    resumed = run_train(tmp_path, "crash")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from checkpoint" in resumed.stderr and "step-6" in resumed.stderr
    a, b = train_losses(metrics(tmp_path, "ref")), train_losses(metrics(tmp_path, "crash"))
    assert sorted(b) == list(range(12))  # steps 6 and 7 were not logged twice
    assert a == b  # bit for bit (exact float equality), before and after the crash
    fp = [{r["step"]: r["data/fingerprint"] for r in metrics(tmp_path, run) if "train/loss" in r} for run in ("ref", "crash")]
    assert fp[0] == fp[1] and len(set(fp[0].values())) == 12


def test_mixture_logs_source_counts_and_switches_at_the_stage_step(tmp_path):
    from levanter.data.config import LMMixtureDatasetConfig
    from levanter.data.source_config import LMDatasetSourceConfig

    data = LMMixtureDatasetConfig(
        tokenizer="byte",
        cache_dir=str(tmp_path / "cache"),
        configs={
            "prose": LMDatasetSourceConfig(train_urls=["embedded://python-docs/validation"]),
            "code": LMDatasetSourceConfig(train_urls=["embedded://python-code/validation"]),
        },
        train_weights=[(0, {"prose": 0.75, "code": 0.25}), (3, {"code": 1.0})],
        mixture_block_size=None,
    )
    cfg = dataclasses.replace(tiny_config(tmp_path, steps=5), data=data)
    train_lm.main(cfg)
    rows = [r for r in metrics(tmp_path) if "train/loss" in r]
    counts = [(r["data/source_counts/prose"], r["data/source_counts/code"]) for r in rows]
    assert counts == [(6, 2)] * 3 + [(0, 8)] * 2


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_with_the_preemption_status(tmp_path):
    import time

    from levanter.training import PREEMPTED_EXIT_CODE

    # A run far longer than the test: its one source is a mixture's, which wraps it (stop_strategy restart).
    text = RESUME_YAML.format(cache=tmp_path / "cache", logs=tmp_path / "logs", ckpt=tmp_path / "ckpt")
    single = ('  train_urls: ["embedded://python-docs/validation"]\n'
              '  validation_urls: ["embedded://python-code/validation"]\n')
    text = text.replace(single, '  configs: {prose: {train_urls: ["embedded://python-docs/validation"]}}\n'
                                '  train_weights: {prose: 1.0}\n')
    cfg = write_yaml(tmp_path, text.replace("num_train_steps: 12", "num_train_steps: 100000"))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.Popen([sys.executable, "-m", "levanter.main.train_lm", "--config_path", cfg, "--trainer.id", "pre"],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / "pre" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (
        log.exists() and len(log.read_text().splitlines()) >= 3
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    steps = train_losses(metrics(tmp_path, "pre"))
    done = max(steps) + 1
    assert os.path.isdir(tmp_path / "ckpt" / "pre" / f"step-{done}")


def test_initial_parameters_are_bit_identical_on_every_mesh():
    """The one-off init program (compiled with its own CPU options, see training.dispatch.init_compile_options)
    gives the same parameters, bit for bit, however the mesh shards them, and the same on a second call."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    import equinox as eqx
    import haliax as hax

    from levanter.training import Trainer

    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    vocab = hax.Axis("vocab", 61)
    params = []
    for model_axis_size, tp in ((8, None), (1, None), (2, ["mlp", "heads"]), (1, None)):
        tcfg = TrainerConfig(model_axis_size=model_axis_size, tensor_parallel_axes=tp, train_batch_size=8,
                             require_accelerator=False)
        trainer = Trainer(tcfg, AdamConfig().build(10), lambda m, b: (0.0, 1.0))
        state = trainer.initial_state(lambda k: model_cfg.build(vocab, key=k), key=jax.random.PRNGKey(3))
        params.append([np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))])
    for other in params[1:]:
        assert len(other) == len(params[0])
        for a, b in zip(params[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("eos", [9, None])
def test_tokens_only_batches_give_the_same_loss_and_gradients(eos):
    """train_lm's loader ships tokens alone; the step derives loss mask and segment ids from them. The
    loss-position count equals that of the same batch with the three host columns, and loss and gradients
    agree to float32 rounding: the columns are the same values (test_sources checks every short pattern),
    but XLA fuses the program that computes them differently, so sums may round differently (seen: 1 ulp)."""
    import equinox as eqx
    import haliax as hax

    from levanter.data.text import causal_lm_columns

    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    model = model_cfg.build(hax.Axis("vocab", 13), key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 13, (4, 16)).astype(np.int32)
    tokens[rng.random(tokens.shape) < 0.15] = 9
    assert (tokens == 9).any(axis=1).all()  # every row has documents to keep apart
    loss = lm_loss_fn(0.0, eos)

    @eqx.filter_jit
    def value_and_grad(m, batch):
        return eqx.filter_value_and_grad(lambda m: loss(m, batch)[0])(m), loss(m, batch)[1]

    full = value_and_grad(model, named_batch(causal_lm_columns(tokens, eos), model_cfg.Pos, "batch"))
    only = value_and_grad(model, named_batch({"tokens": tokens}, model_cfg.Pos, "batch"))
    (full_loss, full_grads), full_count = full
    (only_loss, only_grads), only_count = only
    assert float(full_count) == float(only_count) > 0
    np.testing.assert_allclose(np.asarray(only_loss), np.asarray(full_loss), rtol=1e-6)
    full_leaves = jax.tree.leaves(eqx.filter(full_grads, eqx.is_array))
    only_leaves = jax.tree.leaves(eqx.filter(only_grads, eqx.is_array))
    assert len(full_leaves) == len(only_leaves) > 0
    for a, b in zip(full_leaves, only_leaves):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    # And the derivation matters: with the EOS id ignored the loss differs (eos=9 only).
    if eos is not None:
        other = value_and_grad(model, named_batch(causal_lm_columns(tokens, None), model_cfg.Pos, "batch"))
        assert float(other[0][0]) != float(full_loss)


@pytest.mark.parametrize("model_axis_size,tp", [(1, None), (2, ["mlp", "heads"])])
def test_flat_dispatch_step_equals_named_jit(model_axis_size, tp):
    """The train step is called through FlatStep (a jax.jit over flat leaves, built once per structure).
    Three steps through it give the same state and metrics, bit for bit, with the same shardings, as the
    named_jit it replaces, and it compiles once."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    import equinox as eqx
    import haliax as hax

    from levanter.training import FlatStep
    from levanter.training import Trainer

    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    vocab = hax.Axis("vocab", 61)
    tcfg = TrainerConfig(model_axis_size=model_axis_size, tensor_parallel_axes=tp, train_batch_size=8,
                         require_accelerator=False)
    rng = np.random.default_rng(0)
    batches = [{"tokens": jax.device_put(rng.integers(0, 61, (8, 16)).astype(np.int32))} for _ in range(3)]
    results = []
    for use_flat in (True, False):
        trainer = Trainer(tcfg, AdamConfig(learning_rate=1e-2).build(10), lm_loss_fn(0.0, 60))
        state = trainer.initial_state(lambda k: model_cfg.build(vocab, key=k), key=jax.random.PRNGKey(3))
        step_fn = trainer._make_step(8)
        assert isinstance(step_fn, FlatStep)
        call = step_fn if use_flat else step_fn._named
        for data in batches:
            named = named_batch(data, model_cfg.Pos, "batch")
            with hax.partitioning.set_mesh(trainer.mesh), hax.axis_mapping(trainer.compute_mapping):
                state, metrics = call(state, named)
        if use_flat:
            assert step_fn.compile_count() == 1
            assert all(entry is not None for entry in step_fn._by_structure.values())  # not the fallback
        leaves = jax.tree.leaves(eqx.filter((state, metrics), eqx.is_array))
        results.append([(np.asarray(x), x.sharding) for x in leaves])
    flat, named = results
    assert len(flat) == len(named) > 0
    for (a, sa), (b, sb) in zip(flat, named):
        np.testing.assert_array_equal(a, b)
        assert sa.is_equivalent_to(sb, a.ndim), (sa, sb)


@pytest.mark.parametrize("mp", ["f32", "bfloat16", "p=f32,c=bfloat16"])
def test_the_train_step_compiles_once_and_keeps_every_dtype(mp):
    """With bfloat16 parameters the float32 optimizer updates used to promote parameters and moments to
    float32 after step 0, so step 1 compiled the step again (train_lm's recompile check stops a run on
    that). Every leaf of the state keeps its dtype, and three steps compile once."""
    import haliax as hax

    from levanter.training import Trainer

    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=2, seq_len=16)
    tcfg = TrainerConfig(mp=mp, train_batch_size=8, require_accelerator=False)
    trainer = Trainer(tcfg, AdamConfig(learning_rate=1e-2).build(10), lm_loss_fn(0.0, 60))
    vocab = hax.Axis("vocab", 61)
    state = trainer.initial_state(lambda k: model_cfg.build(vocab, key=k), key=jax.random.PRNGKey(3))
    dtypes = [x.dtype for x in jax.tree.leaves(state)]
    rng = np.random.default_rng(0)
    for _ in range(3):
        data = {"tokens": jax.device_put(rng.integers(0, 61, (8, 16)).astype(np.int32))}
        state, metrics = trainer.train_step(state, named_batch(data, model_cfg.Pos, "batch"), 8)
        assert np.isfinite(float(metrics["loss"]))
    assert [x.dtype for x in jax.tree.leaves(state)] == dtypes
    assert trainer.compile_count() == 1


def _zero_gradient_rows_step(eps: float, crash_on_nan: bool = True):
    """One train step of a model whose batch never uses most of the vocabulary, so those embedding rows
    get a gradient of exactly 0: with Adam's ``eps = 0`` their update is 0/0 = NaN although the loss and
    the gradient norm are finite. Returns the parameters before and after, and the step's metrics."""
    import equinox as eqx
    import optax

    from levanter.training import Trainer

    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    tcfg = TrainerConfig(train_batch_size=8, require_accelerator=False, crash_on_nan=crash_on_nan)
    # Built from optax directly: AdamConfig refuses epsilon 0, and this checks the step's own guard.
    optimizer = optax.chain(optax.scale_by_adam(eps=eps), optax.scale(-1e-2))
    trainer = Trainer(tcfg, optimizer, lm_loss_fn(0.0, 60))
    import haliax as hax

    vocab = hax.Axis("vocab", 61)
    state = trainer.initial_state(lambda k: model_cfg.build(vocab, key=k), key=jax.random.PRNGKey(3))
    before = [np.array(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))]
    data = {"tokens": jax.device_put(np.random.default_rng(0).integers(0, 10, (8, 16)).astype(np.int32))}
    state, metrics = trainer.train_step(state, named_batch(data, model_cfg.Pos, "batch"), 8)
    after = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))]
    floats = [np.asarray(x) for x in jax.tree.leaves(state)]
    floats = [x for x in floats if np.issubdtype(x.dtype, np.floating)]
    return before, after, floats, int(state.step), metrics


def test_a_non_finite_update_is_not_applied():
    """Loss and gradient norm finite, update NaN (Adam with epsilon 0 on zero-gradient rows): where such steps
    are skipped (crash_on_nan: false) the step leaves every parameter and moment as it was; either way it
    reports the update as non-finite, and by default the host check stops the run naming the step and the
    optimizer values to look at. A positive epsilon updates."""
    from levanter.training import check_finite

    before, after, floats, step, metrics = _zero_gradient_rows_step(eps=0.0, crash_on_nan=False)
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    assert np.isfinite(loss) and np.isfinite(grad_norm)
    assert not bool(metrics["update_finite"]) and bool(metrics["skipped"])
    assert step == 1
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(x).all() for x in floats)  # nothing non-finite for a checkpoint to hold
    check_finite(loss, 0, TrainerConfig(crash_on_nan=False), grad_norm=grad_norm, update_finite=False)

    _, _, _, _, stopping = _zero_gradient_rows_step(eps=0.0)
    assert not bool(stopping["update_finite"]) and bool(stopping["skipped"])
    with pytest.raises(FloatingPointError, match=r"the update at step 0 is not finite .*optimizer.epsilon"):
        check_finite(float(stopping["loss"]), 0, TrainerConfig(), grad_norm=float(stopping["grad_norm"]),
                     update_finite=bool(stopping["update_finite"]))

    before, after, _, _, metrics = _zero_gradient_rows_step(eps=1e-8)
    assert bool(metrics["update_finite"]) and not bool(metrics["skipped"])
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_check_finite_names_a_non_finite_gradient_norm():
    from levanter.training import check_finite

    with pytest.raises(FloatingPointError, match=r"train/grad_norm is NaN at step 7 \(the loss was finite\)"):
        check_finite(1.5, 7, TrainerConfig(), grad_norm=float("nan"))
    with pytest.raises(FloatingPointError, match=r"train/grad_norm is infinite at step 2.*crash_on_inf"):
        check_finite(1.5, 2, TrainerConfig(), grad_norm=float("inf"))
    check_finite(1.5, 2, TrainerConfig(crash_on_inf=False), grad_norm=float("inf"))


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"learning_rate": float("nan")}, "optimizer.learning_rate must be a finite number"),
        ({"learning_rate": float("inf")}, "optimizer.learning_rate must be a finite number"),
        ({"weight_decay": -0.1}, "optimizer.weight_decay must be non-negative"),
        ({"weight_decay": float("nan")}, "optimizer.weight_decay must be a finite number"),
        ({"beta2": float("nan")}, "optimizer.beta2 must be a finite number"),
        ({"epsilon": 0.0}, "optimizer.epsilon must be positive"),
        ({"epsilon": -1e-8}, "optimizer.epsilon must be positive"),
        ({"epsilon": float("inf")}, "optimizer.epsilon must be a finite number"),
        ({"max_grad_norm": float("nan")}, "optimizer.max_grad_norm must be a finite number"),
        ({"warmup": float("inf")}, "optimizer.warmup must be a finite number"),
        ({"warmup": -1.0}, "optimizer.warmup must be non-negative"),
        ({"decay": float("nan")}, "optimizer.decay must be a finite number"),
        ({"min_lr_ratio": float("nan")}, "optimizer.min_lr_ratio must be a finite number"),
        ({"min_lr_ratio": 1.5}, r"optimizer.min_lr_ratio must be in \[0, 1\]"),
    ],
)
def test_optimizer_refuses_non_finite_and_out_of_range_values(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        AdamConfig(**kw)


def test_optimizer_values_in_range_are_accepted():
    cfg = AdamConfig(learning_rate=0.0, weight_decay=0.0, warmup=0, decay=None, min_lr_ratio=1.0,
                     max_grad_norm=None)
    assert cfg.build(10) is not None


def test_training_values_checked_before_any_work(tmp_path):
    """seq_len 1, a seed JAX would truncate, a NaN z-loss weight and max_eval_batches 0 fail in validate,
    naming the key, before a cache is built."""
    base = tiny_config(tmp_path)
    bad = [
        (dataclasses.replace(base, model=dataclasses.replace(base.model, seq_len=1)),
         "model.seq_len must be >= 2"),
        (dataclasses.replace(base, data_seed=2**32), r"data_seed must be in \[0, 2\*\*32 - 1\]"),
        (dataclasses.replace(base, data_seed=-1), "data_seed must be in"),
        (dataclasses.replace(base, z_loss_weight=float("nan")), "z_loss_weight must be a finite number"),
        (dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, max_eval_batches=0)),
         "trainer.max_eval_batches must be >= 1"),
        (dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, seed=-3)),
         "trainer.seed must be in"),
    ]
    for cfg, fragment in bad:
        with pytest.raises(ValueError, match=fragment):
            train_lm.main(cfg)
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))  # nothing was built
    train_lm.validate(dataclasses.replace(base, data_seed=2**32 - 1))


def test_memory_estimate_refuses_what_cannot_fit(tmp_path):
    """A 1e8 vocabulary at hidden size 32 needs ~12 GiB of parameters, as much again for gradients and
    twice for Adam's moments, plus ~95 GiB of float32 logits: refused against 16 GiB, naming the key.
    The tiny model fits; with the host's real free memory the check passes for it too."""
    base = tiny_config(tmp_path)
    huge = dataclasses.replace(base, data=dataclasses.replace(base.data, vocab_size=10**8))
    with pytest.raises(ValueError, match=r"cannot fit.*16.0 GiB free.*data.vocab_size=100,000,000") as e:
        check_memory(huge, 10**8, available=(16 * 2**30, "the test's budget"))
    gib = float(str(e.value).split("at least ")[1].split(" GiB")[0].replace(",", ""))
    assert 4 * 10**8 * 32 * 4 / 2**30 < gib  # parameters, gradients and two moments alone
    check_memory(base, 257, available=(16 * 2**30, "the test's budget"))
    check_memory(base, 257)
    assert available_memory() is not None  # CPU devices: the host's memory is known


def test_data_ending_early_at_run_time_exits_1(tmp_path, monkeypatch, capsys):
    """If the training data ends before num_train_steps once the run is under way, the run checkpoints
    the last state and fails with exit 1 naming the step, instead of exiting 0. The up-front check
    (check_data_covers_run) refuses every such config the test can build, so it is switched off here
    to reach the run-time guard behind it."""
    docs = "".join(json.dumps({"text": f"document {i} " + "words " * 40}) + "\n" for i in range(4))
    (tmp_path / "data.jsonl").write_text(docs)  # ~1,000 byte tokens: 3 steps of 8 x 32
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""\
data: {{train_urls: ["{tmp_path}/data.jsonl"], tokenizer: byte, cache_dir: {tmp_path}/cache}}
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 1, seq_len: 32, gradient_checkpointing: false}}
trainer:
  num_train_steps: 5
  train_batch_size: 8
  require_accelerator: false
  id: short
  log_dir: {tmp_path}/logs
  tracker: {{type: json}}
  checkpointer: {{base_path: {tmp_path}/ckpt}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0, lr_schedule: constant}}
""")
    argv = ["--config_path", str(cfg)]
    with pytest.raises(SystemExit) as e:
        train_lm.cli(argv)
    assert e.value.code == 2
    assert "lower trainer.num_train_steps to 3" in capsys.readouterr().err

    monkeypatch.setattr(levanter.run.data, "check_data_covers_run", lambda *a, **k: None)
    with pytest.raises(SystemExit) as e:
        train_lm.cli(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1, err
    assert "error: the training data ended at step 3 of trainer.num_train_steps=5" in err
    assert os.path.isdir(tmp_path / "ckpt" / "short" / "step-3")


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted", "restart"])
def test_a_mixture_that_ends_before_num_train_steps_is_refused(tmp_path, stop):
    """A mixture whose stop strategy ends it (first_exhausted / all_exhausted) before the run's last
    step is refused up front, naming data.stop_strategy and the step the data reaches; restart wraps
    its sources and never ends."""
    from levanter.data.dataset import ListAsyncDataset
    from levanter.data.mixture import MixtureDataset
    from levanter.schedule import BatchSchedule

    schedule = BatchSchedule(8)
    sources = {"a": ListAsyncDataset(list(range(40))), "b": ListAsyncDataset(list(range(200)))}
    mix = MixtureDataset(sources, [(0, {"a": 0.5, "b": 0.5})], batch_schedule=schedule, key=5, stop_strategy=stop)
    cfg = tiny_config(tmp_path, steps=100)
    if stop == "restart":
        train_lm.check_data_covers_run(cfg, mix, schedule)
        return
    import asyncio

    end = schedule.find_step_containing_offset(asyncio.run(mix.async_len()))
    assert 0 < end < 100
    with pytest.raises(ValueError, match=rf"data.stop_strategy={stop}: .* enough for {end} steps, but "
                       rf"trainer.num_train_steps is 100 .* lower trainer.num_train_steps to {end}, .*restart"):
        train_lm.check_data_covers_run(cfg, mix, schedule)
    train_lm.check_data_covers_run(tiny_config(tmp_path, steps=end), mix, schedule)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="trains on the TPU chip with the compiled splash "
                                                           "kernel; JAX_PLATFORMS=tpu runs this")
def test_llama_nano_trains_on_tpu_with_splash_attention(tmp_path):
    """config/llama_nano.yaml, in process, on the TPU with ``attn_backend: splash`` (the compiled kernel,
    forward and backward), bfloat16 compute and ``require_accelerator: true``: the loss is finite every
    step and falls."""
    import yaml

    with open(os.path.join(REPO, "config", "llama_nano.yaml")) as f:
        raw = yaml.safe_load(f)
    # The validation splits as training data: a small cache, built in seconds.
    for source in raw["data"]["configs"].values():
        source["train_urls"] = source["validation_urls"]
    path = write_yaml(tmp_path, yaml.safe_dump(raw), "llama_nano.yaml")
    cfg = parse_config(train_lm.TrainLmConfig, path, [
        "--model.attn_backend", "splash", "--model.seq_len", "128", "--trainer.mp", "p=f32,c=bfloat16",
        "--trainer.require_accelerator", "true", "--trainer.num_train_steps", "6", "--trainer.train_batch_size", "8",
        "--trainer.steps_per_eval", "1000", "--trainer.id", "tpu", "--data.cache_dir", str(tmp_path / "cache"),
        "--trainer.log_dir", str(tmp_path / "logs"), "--trainer.checkpointer.base_path", str(tmp_path / "ckpt"),
    ])
    assert cfg.model.attention_backend == "splash" and cfg.trainer.require_accelerator
    # A run's own matmul precision: the session's "highest" (tests/conftest.py) asks Mosaic for float32
    # contraction of the splash kernel's bfloat16 operands, which it refuses to compile.
    with jax.default_matmul_precision("default"):
        out = train_lm.main(cfg)
    assert out["final_step"] == 6
    losses = train_losses(metrics(tmp_path, "tpu"))
    assert sorted(losses) == list(range(6)) and np.isfinite(list(losses.values())).all(), losses
    assert losses[5] < losses[0], losses


def test_the_step_measures_its_update_against_the_parameters():
    """The step reports its update's global norm and the parameters' (before the step): for one Adam step
    they are those of the arrays themselves, and a huge epsilon makes the update vanish."""
    before, after, _, _, metrics = _zero_gradient_rows_step(eps=1e-8)
    moved = np.sqrt(sum(float(np.sum((b.astype(np.float64) - a) ** 2)) for a, b in zip(before, after)))
    norm = np.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in before))
    assert float(metrics["param_norm"]) == pytest.approx(norm, rel=1e-5)
    assert float(metrics["update_norm"]) == pytest.approx(moved, rel=1e-3)
    _, _, _, _, vanishing = _zero_gradient_rows_step(eps=1e18)
    assert float(vanishing["update_norm"]) < 1e-9 * float(vanishing["param_norm"])


def _report(step=3, *, update_norm=1e-3, param_norm=10.0, grad_norm=0.5, skipped=False, non_finite=False):
    from levanter.training import StepReport

    batch = Batch(step=step, global_offset=0, batch_size=2, data={})
    return StepReport(step, batch, 2.5, grad_norm, skipped, 0.1, update_norm=update_norm, param_norm=param_norm,
                      non_finite=non_finite)


def test_an_update_too_small_to_count_stops_the_run_naming_the_key():
    from levanter.run import check_update_moves

    adam = AdamConfig(learning_rate=1e-3, epsilon=1e18)
    with pytest.raises(ValueError, match=r"the update at step 3 is 1\.0e-24 .*optimizer\.epsilon=1e\+18"):
        check_update_moves(_report(update_norm=1e-23), 1e-3, adam)
    with pytest.raises(ValueError, match=r"optimizer\.learning_rate is 0"):
        check_update_moves(_report(update_norm=0.0), 0.0, AdamConfig(learning_rate=0.0))
    with pytest.raises(ValueError, match=r"raise optimizer\.learning_rate=1e-20 or lower optimizer\.epsilon=1e-08"):
        check_update_moves(_report(update_norm=1e-22), 1e-20, AdamConfig(learning_rate=1e-20))
    check_update_moves(_report(), 1e-3, adam)  # a normal update
    check_update_moves(_report(update_norm=0.0), 1e-7, adam)  # the warmup's first step: small by design
    check_update_moves(_report(update_norm=0.0, skipped=True), 1e-3, adam)  # a spike, not applied
    check_update_moves(_report(update_norm=0.0, grad_norm=0.0), 1e-3, adam)  # no gradient (no loss tokens)


def test_a_run_whose_parameters_never_changed_says_so_in_its_summary():
    from levanter.training import StepTally

    tally = StepTally()
    tally.add(_report(update_norm=0.0))
    assert tally.warnings() and "the parameters did not change" in tally.warnings()[0]
    tally.add(_report(update_norm=1e-3))
    assert tally.warnings() == []


def test_a_non_finite_value_names_what_came_first_and_the_likely_key():
    from levanter.training import check_finite

    with pytest.raises(FloatingPointError, match=r"train/loss is NaN at step 5; .*The loss was the first value not "
                       r"finite \(train/grad_norm nan\)\. Step 4's update was 3\.0e\+05 times .*optimizer\."
                       r"learning_rate is far too large.*checkpoint step-4 or earlier.*crash_on_nan: false would "
                       r"skip every later step"):
        check_finite(float("nan"), 5, TrainerConfig(), grad_norm=float("nan"), previous=(4, 3e5))
    with pytest.raises(FloatingPointError, match=r"Step 0's update was too large for float32 to measure .*new "
                       r"trainer\.id"):
        check_finite(float("inf"), 1, TrainerConfig(), grad_norm=float("inf"), previous=(0, float("inf")))
    # An ordinary last update: a rare bad batch is what skipping is for.
    with pytest.raises(FloatingPointError, match=r"The gradient was the first value not finite\. If it is a rare "
                       r"bad batch, set trainer\.crash_on_nan: false .*step 6's update was 1\.0e-03"):
        check_finite(2.0, 7, TrainerConfig(), grad_norm=float("nan"), previous=(6, 1e-3))


def test_skipped_steps_are_counted_and_a_run_that_skipped_most_fails():
    from levanter.training import StepTally

    tally = StepTally()
    tally.add(_report(step=0, update_norm=1e5, param_norm=1.0))  # thrown out of range
    for s in range(1, 4):
        tally.add(_report(step=s, skipped=True, non_finite=True))
    (line,) = tally.warnings()
    assert "3 of 4 steps were skipped" in line and "the last 3 in a row (from step 1)" in line
    assert "began at step 1" in tally.failure() and "step 0's update was 1.0e+05 times" in tally.failure()

    rare = StepTally()
    for s in range(6):
        rare.add(_report(step=s, skipped=s == 2, non_finite=s == 2))
    rare.add(_report(step=6, skipped=True))  # a spike (optimizer.skip_bad_steps)
    assert rare.failure() is None
    assert rare.warnings() == [
        "1 of 7 steps were skipped: their loss, gradient or update was not finite (trainer.crash_on_nan / "
        "crash_on_inf: false)", "1 of 7 steps were skipped as spikes (optimizer.skip_bad_steps)"]


def test_a_run_resumed_past_its_last_step_keeps_the_eval_of_that_step(tmp_path):
    """A 4-step run evaluates at its end; raised to 6 steps it resumes from step 4, whose records the metrics
    log drops (the steps it redoes): the eval of step 4 is redone, once, with the same values, and the log
    reads as the two runs' evals at 4 and 6."""
    first = train_lm.main(tiny_config(tmp_path, steps=4, steps_per_eval=100))
    assert first["final_step"] == 4
    evals = {r["step"]: r for r in metrics(tmp_path) if "eval/loss" in r}
    assert sorted(evals) == [4]
    meta = json.loads((tmp_path / "ckpt" / "tiny" / "step-4" / "metadata.json").read_text())
    assert meta["metadata"]["evals"] == {"steps_per_eval": 100, "num_train_steps": 4}

    assert train_lm.main(tiny_config(tmp_path, steps=6, steps_per_eval=100))["final_step"] == 6
    rows = metrics(tmp_path)
    resumed = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in resumed] == [4, 6]
    assert resumed[0] == evals[4]  # the same state, evaluated again
    assert sorted(train_losses(rows)) == list(range(6))


def test_use_hf_model_config_warns_of_each_key_the_checkpoint_overrides(tmp_path, caplog):
    """initialize_from_hf with use_hf_model_config: true takes the checkpoint's shape; each key the config set to
    something else is named in a warning with both values (keys left at their defaults are not)."""
    from levanter.lm_config import with_hf_model

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                "n_positions": 64, "vocab_size": 300}))
    header = b"{}"  # a safetensors file of no tensors: the shape comes from config.json, no weights are read
    (hf / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    base = tiny_config(tmp_path, model=Gpt2Config(hidden_dim=128, num_heads=4, num_layers=2, seq_len=32))
    config = dataclasses.replace(base, initialize_from_hf=str(hf), use_hf_model_config=True)
    with caplog.at_level(logging.WARNING, logger="levanter"):
        merged = with_hf_model(config)
    assert merged.model.hidden_dim == 64 and merged.model.num_layers == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # num_layers: 2 in both; n_positions: the config left it at its default
    assert "model.hidden_dim=128 in the config is replaced by the checkpoint's 64" in warned[0]
    assert "use_hf_model_config: true" in warned[0] and str(hf) in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="levanter"):
        with_hf_model(merged)  # already the checkpoint's: nothing to say
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
