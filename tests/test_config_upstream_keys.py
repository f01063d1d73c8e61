"""Upstream Levanter's spellings that its shipped configs use: ``data.cache_options`` build keys (accepted,
no effect on what is written), ``trainer.wandb`` (the wandb tracker) and ``optimizer.skip_bad_steps``
(refused naming the key, with what to do instead)."""

from __future__ import annotations

from pathlib import Path

import pytest

from levanter.config import parse_config
from levanter.ingest.build import CacheOptions
from levanter.main import train_lm
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


@pytest.mark.parametrize("value", ["true", "128", "{rolling_interval_length: 64, sigma_factor: 4.0}"])
def test_skip_bad_steps_is_refused_naming_the_key_and_the_alternative(tmp_path, value):
    with pytest.raises(ValueError, match=r"optimizer\.skip_bad_steps=.*crash_on_nan: false"):
        parse(tmp_path, DATA + f"optimizer:\n  type: adam\n  skip_bad_steps: {value}\n")


def test_skip_bad_steps_false_parses(tmp_path):
    cfg = parse(tmp_path, DATA + "optimizer:\n  skip_bad_steps: false\n")
    assert cfg.optimizer.skip_bad_steps is False
