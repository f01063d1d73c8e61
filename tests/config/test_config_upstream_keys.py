"""Upstream Levanter's spellings that its shipped configs use: ``data.cache_options`` build keys (accepted,
no effect on what is written), ``trainer.wandb`` (the wandb tracker), optimizer types and schedule keys
(built, or refused naming the key with what to do instead), the top-level ``tokenizer``, and configs of
upstream's other entry points (refused as such). ``optimizer.skip_bad_steps`` and ``trainer.quantization``
have their own tests (test_skip_bad_steps.py, test_quantization.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from levanter.config import ConfigError, parse_config
from levanter.refused_keys import check_refused
from levanter.ingest.cache_options import CacheOptions
from levanter.main import train_lm
from levanter.optim import AdamConfig
from levanter.tracker import TensorboardConfig, WandbConfig

DATA = """data:
  train_urls: ["memory://corpus/train.jsonl"]
  tokenizer: gpt2
"""


def parse(tmp_path: Path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return parse_config(train_lm.TrainLmConfig, str(path))


def test_upstream_cache_options_parse(tmp_path):
    cfg = parse(tmp_path, DATA + """  cache_options:
    num_shard_groups: 64
    target_size_per_flush: 256MB
    prefetch_per_group: 8
    batch_size: 128
""")
    opts = cfg.data.cache_options
    assert (opts.num_shard_groups, opts.target_size_per_flush, opts.prefetch_per_group, opts.batch_size) == (
        64, "256MB", 8, 128)
    cfg.data._check_task_fields()  # the data section's own checks accept them too


@pytest.mark.parametrize("key, value, fragment", [
    ("num_shard_groups", 0, "cache_options.num_shard_groups"),
    ("target_size_per_flush", "lots", "cache_options.target_size_per_flush"),
    ("shard_order_randomization_key", 3, "cache_options.shard_order_randomization_key=3 is not supported"),
])
def test_upstream_cache_options_that_cannot_be_honoured_are_refused_by_name(key, value, fragment):
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        CacheOptions(**{key: value}).check()


WANDB = """trainer:
  require_accelerator: false
  wandb:
    project: my-project
    entity: my-team
    name: run-name
    tags: [a, b]
    mode: offline
"""


def test_trainer_wandb_block_is_the_wandb_tracker(tmp_path):
    tcfg = parse(tmp_path, DATA + WANDB).trainer
    tcfg.validate()
    (tracker,) = tcfg.trackers()
    assert tracker == WandbConfig(project="my-project", entity="my-team", name="run-name", tags=["a", "b"],
                                  mode="offline")


def test_trainer_wandb_joins_the_trackers_given(tmp_path):
    tcfg = parse(tmp_path, DATA + WANDB + "  tracker:\n    type: tensorboard\n").trainer
    tcfg.validate()
    kinds = [type(t) for t in tcfg.trackers()]
    assert kinds == [TensorboardConfig, WandbConfig]


def test_trainer_wandb_and_a_wandb_tracker_together_are_refused(tmp_path):
    tcfg = parse(tmp_path, DATA + WANDB + "  tracker:\n    - type: json\n    - type: wandb\n").trainer
    with pytest.raises(ValueError, match=r"trainer\.wandb and a wandb entry in trainer\.tracker"):
        tcfg.validate()


def test_skip_bad_steps_false_parses(tmp_path):
    cfg = parse(tmp_path, DATA + "optimizer:\n  skip_bad_steps: false\n")
    assert cfg.optimizer.skip_bad_steps is False


def test_upstream_sophia_h_and_muon_sections_parse_with_upstream_defaults(tmp_path):
    # Sections as upstream's gpt2_1536_sophiah.yaml and gpt2_small_fast_muon.yaml write them.
    from levanter.optim import MuonConfig, SophiaHConfig

    cfg = parse(tmp_path, DATA + "optimizer:\n  type: sophia-h\n  learning_rate: 2E-4\n  weight_decay: 0.2\n"
                "  min_lr_ratio: 0.1\n  gamma: 0.01\n  warmup: 2000\n")
    o = cfg.optimizer
    assert isinstance(o, SophiaHConfig) and (o.learning_rate, o.weight_decay, o.warmup, o.gamma) == (2e-4, 0.2, 2000, 0.01)
    assert (o.beta1, o.beta2, o.epsilon, o.clip_threshold, o.update_interval, o.rng_seed) == (0.96, 0.99, 1e-12, 1.0, 10, 0)
    cfg = parse(tmp_path, DATA + "optimizer:\n  type: muon\n  learning_rate: 1E-2\n  weight_decay: 0.05\n"
                "  adam_lr: 1e-3\n  momentum: 0.9\n  nesterov: false\n  backend_steps: 3\n  use_kimi_scaling: true\n")
    o = cfg.optimizer
    assert isinstance(o, MuonConfig) and (o.learning_rate, o.weight_decay, o.adam_lr, o.momentum) == (1e-2, 0.05, 1e-3, 0.9)
    assert (o.nesterov, o.backend_steps, o.use_kimi_scaling) == (False, 3, True)
    assert (o.lr, o.beta1, o.beta2, o.epsilon, o.muon_epsilon, o.max_grad_norm) == (0.02, 0.9, 0.95, 1e-8, 1e-8, 1.0)


def test_top_level_tokenizer_sets_data_tokenizer(tmp_path):
    cfg = parse(tmp_path, "tokenizer: byte\ndata:\n  train_urls: [memory://corpus/train.jsonl]\n")
    assert cfg.data.tokenizer == "byte"
    cfg = parse(tmp_path, DATA + "tokenizer: gpt2\n")  # the same one twice: fine
    assert cfg.data.tokenizer == "gpt2"


def test_top_level_tokenizer_disagreeing_with_data_tokenizer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer='byte' and data\.tokenizer='passthrough' disagree"):
        parse(tmp_path, "tokenizer: byte\ndata:\n  train_urls: [memory://c/t.jsonl]\n  tokenizer: passthrough\n")


@pytest.mark.parametrize("keys, fragment", [
    ("supervised_data: {}\nmax_seq_len: 2048\n", "upstream's supervised fine-tuning entry point"),
    ("peft_save_path: out/\n", "upstream's LoRA fine-tuning entry point"),
])
def test_configs_of_other_upstream_entry_points_are_refused_as_such(tmp_path, keys, fragment):
    with pytest.raises(ConfigError, match=r"top-level `.*: a config of " + re.escape(fragment)
                       + r".*is not supported here"):
        parse(tmp_path, DATA + keys)


def test_an_unknown_top_level_key_is_still_an_unknown_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown top-level key `bogus_key`"):
        parse(tmp_path, DATA + "bogus_key: 1\n")


def test_one_cycle_spanning_the_run_is_accepted_and_real_cycles_refused(tmp_path):
    cfg = parse(tmp_path, DATA + "trainer:\n  num_train_steps: 100\noptimizer:\n  cycle_length: 100\n")
    cfg.optimizer.lr_scheduler(100)
    with pytest.raises(ValueError, match=r"optimizer\.cycle_length=100 is not supported: cyclic"):
        cfg.optimizer.lr_scheduler(200)
    with pytest.raises(ValueError, match=r"optimizer\.cycles=4 is not supported"):
        train_lm.validate(parse(tmp_path, DATA + "optimizer:\n  cycles: 4\n"))


def test_the_inv_schedule_decays_hyperbolically_to_the_minimum():
    cfg = AdamConfig(learning_rate=1.0, warmup=0.0, min_lr_ratio=0.1, lr_schedule="inv")
    lr = cfg.lr_scheduler(100)
    # 1 / (1 + k t) with k = (1 / 0.1 - 1) / 100: 1 at 0, 1/2 at t = 100/9, 0.1 at the end.
    assert float(lr(0)) == pytest.approx(1.0)
    assert float(lr(100 / 9)) == pytest.approx(0.5, rel=1e-2)
    assert float(lr(100)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"inv .*needs optimizer\.min_lr_ratio > 0"):
        AdamConfig(min_lr_ratio=0.0, lr_schedule="inv").lr_scheduler(10)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "inv", "wsd"])
def test_the_logged_learning_rate_is_the_schedules_at_every_step(schedule):
    # train_lm logs the rate through host_lr_scheduler (evaluated on the CPU backend, so that reading it does
    # not wait for the step queued on the accelerator): the same figure as the optimizer's schedule.
    cfg = AdamConfig(learning_rate=3e-4, warmup=0.1, min_lr_ratio=0.1, lr_schedule=schedule)
    lr, on_host = cfg.lr_scheduler(50), cfg.host_lr_scheduler(50)
    values = [on_host(step) for step in range(51)]
    assert all(isinstance(v, float) for v in values)
    assert values == [float(lr(step)) for step in range(51)]
    assert len(set(values)) > 1 or schedule == "constant"


def test_upstream_default_reference_checkpoint_is_accepted_and_others_refused(tmp_path):
    model = "model:\n  type: llama\n  reference_checkpoint: {}\n"
    check_refused(parse(tmp_path, DATA + model.format("NousResearch/Llama-2-7b-hf")))
    cfg = parse(tmp_path, DATA + model.format("meta-llama/x"))
    with pytest.raises(ValueError, match=r"model\.reference_checkpoint='meta-llama/x' is not supported"):
        check_refused(cfg)


def test_ray_start_workers_false_is_what_happens(tmp_path):
    tcfg = parse(tmp_path, DATA + "trainer:\n  require_accelerator: false\n  ray:\n    start_workers: false\n").trainer
    tcfg.validate()
    tcfg = parse(tmp_path, DATA + "trainer:\n  ray:\n    start_workers: true\n").trainer
    with pytest.raises(ValueError, match=r"trainer\.ray\.start_workers=True is not supported"):
        tcfg.validate()


def test_model_averaging_parses_as_upstream_writes_it(tmp_path):
    from levanter.optim import EmaModelAveragingConfig

    tcfg = parse(tmp_path, DATA + "trainer:\n  require_accelerator: false\n  model_averaging:\n    type: ema\n"
                 "    beta: 0.995\n").trainer
    assert tcfg.model_averaging == EmaModelAveragingConfig(beta=0.995)
    tcfg.validate()
    tcfg = parse(tmp_path, DATA + "trainer:\n  model_averaging:\n    beta: 0.9\n").trainer  # ema by default
    assert tcfg.model_averaging == EmaModelAveragingConfig(beta=0.9)
    with pytest.raises(ConfigError, match=r"ema_decay_sqrt"):
        parse(tmp_path, DATA + "trainer:\n  model_averaging:\n    type: ema_decay_sqrt\n")


def test_a_list_for_a_string_or_list_key_stays_a_list(tmp_path):
    # A string field used to take str() of a YAML list, and unions of str and a list shared that decoder.
    tcfg = parse(tmp_path, DATA + "trainer:\n  fsdp_axis: [embed, mlp]\n").trainer
    assert tcfg.fsdp_axis == ["embed", "mlp"]
    assert parse(tmp_path, DATA + "trainer:\n  fsdp_axis: embed\n").trainer.fsdp_axis == "embed"
    with pytest.raises(ConfigError, match=r"`trainer\.id`: expected str"):
        parse(tmp_path, DATA + "trainer:\n  id: [a, b]\n")


@pytest.mark.parametrize("schedule", ["linear", "cosine", "inv"])
def test_a_given_decay_ends_the_run_after_holding_the_peak(schedule):
    # Upstream's shape: warmup, then the peak held, then the decay over the last `decay` steps.
    lr = AdamConfig(learning_rate=1.0, warmup=10, min_lr_ratio=0.1, lr_schedule=schedule,
                    decay=20).lr_scheduler(100)
    assert float(lr(5)) == pytest.approx(0.5)
    assert [float(lr(t)) for t in (10, 50, 80)] == pytest.approx([1.0, 1.0, 1.0])
    assert 0.1 < float(lr(90)) < 1.0
    assert float(lr(100)) == pytest.approx(0.1)
