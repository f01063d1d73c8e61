"""Data configs: upstream-shaped YAML parses; a config + schedule + seed becomes the training dataset."""

import asyncio
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from levanter.config import ConfigError
from levanter.data.config import LMMixtureDatasetConfig, UrlSingleDatasetLMConfig
from levanter.data.dataset import PermutationDataset
from levanter.data.loader import DataLoader
from levanter.data.mixture import MixtureDataset
from levanter.main.cache_dataset import load_data_config
from levanter.main.cache_dataset import main as cache_main
from levanter.schedule import BatchSchedule

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIXTURE_YAML = """
tokenizer: byte
cache_dir: {cache}
shuffle: true
cache_options: {{num_workers: 1}}
configs:
  prose:
    train_urls: ["embedded://python-docs/validation"]
  code:
    train_urls: ["embedded://python-code/validation"]
    validation_urls: ["embedded://python-code/validation"]
train_weights:
  - [0, {{prose: 1.0}}]
  - [7, {{prose: 0.25, code: 0.75}}]
mixture_block_size: null
"""


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "config", "data", "*.yaml"))))
def test_every_data_yaml_parses(path):
    cfg = load_data_config(path)
    assert isinstance(cfg, (LMMixtureDatasetConfig, UrlSingleDatasetLMConfig))
    if isinstance(cfg, LMMixtureDatasetConfig):
        cfg.stages()  # sources named by stages exist


def test_mixture_config_becomes_a_step_exact_training_set(tmp_path):
    (tmp_path / "mix.yaml").write_text(MIXTURE_YAML.format(cache=tmp_path / "cache"))
    cfg = load_data_config(str(tmp_path / "mix.yaml"))
    assert isinstance(cfg, LMMixtureDatasetConfig)
    schedule = BatchSchedule(4)
    ds = cfg.train_set(64, schedule, key=0)
    assert isinstance(ds, MixtureDataset)
    assert all(isinstance(d, PermutationDataset) for d in ds.datasets)  # shuffles sit below the mixture
    batches = list(DataLoader(ds, schedule, prefetch_depth=2).iter_from_step(0, 10))
    for b in batches:
        assert b.data["tokens"].shape == (4, 64)
        assert set(b.data) == {"tokens", "loss_mask", "segment_ids"}
        src, _ = asyncio.run(ds.source_indices(b.step, list(range(b.global_offset, b.global_offset + 4))))
        expected = [4, 0] if b.step < 7 else [1, 3]  # block None: exact per batch
        assert np.bincount(src, minlength=2).tolist() == expected
    vals = cfg.validation_sets(64)
    assert list(vals) == ["code"]
    # Same config, same seed -> the same bytes; another seed -> other bytes.
    again = cfg.train_set(64, schedule, key=0)
    other = cfg.train_set(64, schedule, key=1)
    a = asyncio.run(ds.get_batch(3, range(12, 16))).tree["tokens"]
    assert np.array_equal(a, asyncio.run(again.get_batch(3, range(12, 16))).tree["tokens"])
    assert not np.array_equal(a, asyncio.run(other.get_batch(3, range(12, 16))).tree["tokens"])


def test_whole_train_config_uses_its_data_section_and_overrides(tmp_path):
    body = "\n".join("  " + line for line in MIXTURE_YAML.format(cache=tmp_path / "c").splitlines())
    (tmp_path / "train.yaml").write_text("trainer:\n  num_train_steps: 10\ndata:\n" + body + "\n")
    cfg = load_data_config(str(tmp_path / "train.yaml"), ["--data.cache_dir", str(tmp_path / "other")])
    assert cfg.cache_dir == str(tmp_path / "other")
    caches = cache_main(cfg)
    assert set(caches) == {("prose", "train"), ("code", "train"), ("code", "validation")}
    assert os.path.isdir(tmp_path / "other" / "prose" / "train" / "input_ids")


def test_single_dataset_config(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(f'{{"content": "document number {i} " }}\n' for i in range(200)))
    cfg = UrlSingleDatasetLMConfig(train_urls=[str(tmp_path / "d.jsonl")], text_key="content", tokenizer="byte",
                                   cache_dir=str(tmp_path / "c"), shuffle=16)
    ds = cfg.train_set(32, 8, key=0)
    batch = asyncio.run(ds.get_batch(0, range(8)))
    assert batch.tree["tokens"].shape == (8, 32)
    assert cfg.validation_sets(32) == {}


@pytest.mark.parametrize(
    "yaml_text, fragment",
    [
        ("configs: {a: {train_urls: [x.jsonl]}}\ntrain_weights: {b: 1.0}\n", "unknown source 'b'"),
        ("configs: {a: {train_urls: [x.jsonl]}}\ntrain_weights: {a: 1.0}\ntarget_budget: 100\n", "target_budget"),
        ("train_url: [x.jsonl]\n", "train_url"),
        ("train_urls: [x.jsonl]\nshuffle: maybe\n", "shuffle"),
    ],
)
def test_bad_data_configs_name_the_key(tmp_path, yaml_text, fragment):
    (tmp_path / "bad.yaml").write_text("tokenizer: byte\n" + yaml_text)
    with pytest.raises((ConfigError, ValueError)) as e:
        cfg = load_data_config(str(tmp_path / "bad.yaml"))
        cfg.build_caches("train")
    assert fragment in str(e.value)


def test_unreachable_hub_tokenizer_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # .invalid never resolves
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from levanter.ingest import load_tokenizer

    with pytest.raises(ValueError, match="gpt2"):
        load_tokenizer("gpt2")


def test_cache_dataset_cli_reports_errors_without_traceback(tmp_path):
    (tmp_path / "bad.yaml").write_text("configs: [\n")
    r = subprocess.run([sys.executable, "-m", "levanter.main.cache_dataset", "--config_path", str(tmp_path / "bad.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "malformed YAML" in r.stderr and "Traceback" not in r.stderr


def test_cache_dataset_checks_every_source_before_tokenizing(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "afile").write_text("a regular file, not a directory")
    (tmp_path / "data.yaml").write_text(
        "tokenizer: byte\n"
        f"cache_dir: {tmp_path}/cache\n"
        "cache_options: {num_workers: 1}\n"
        "configs:\n"
        f"  a: {{train_urls: ['{tmp_path}/a.jsonl']}}\n"
        f"  b: {{train_urls: ['{tmp_path}/a.jsonl'], cache_dir: '{tmp_path}/afile/b'}}\n"
        "train_weights: {a: 1.0, b: 1.0}\n"
    )
    with pytest.raises(ValueError, match=r"data\.configs\.b\.cache_dir: cannot write the token cache at .*afile/b"):
        cache_main(load_data_config(str(tmp_path / "data.yaml")))
    assert not os.path.exists(tmp_path / "cache" / "a" / "train" / "shard_ledger.json")  # nothing tokenized
