"""``~`` in local path keys means the home directory: nothing is created in a folder literally named ``~``."""

import json
import os

from levanter.config import parse_config
from levanter.lm_config import TrainLmConfig
from levanter.main import cache_dataset
from levanter.utils import fs


def test_fs_helpers_expand_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = str(tmp_path / "home")
    assert fs.expand_user("~/x") == f"{home}/x"
    assert fs.expand_user("file://~/x") == f"file://{home}/x"
    assert fs.expand_user("gs://b/~x") == "gs://b/~x" and fs.expand_user("gpt2") == "gpt2"
    assert fs.join("~/c", "train") == f"{home}/c/train"
    assert fs.parent("~/c/train") == f"{home}/c"
    assert fs.kvstore_spec("~/c")["path"] == f"{home}/c/"


def test_every_local_path_key_of_a_train_lm_config_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        "data:\n"
        "  train_urls: ['~/d/train.jsonl']\n  validation_urls: ['~/d/val.jsonl']\n"
        "  tokenizer: ~/tok\n  cache_dir: ~/cache\n"
        "model: {type: gpt2}\n"
        "trainer:\n"
        "  log_dir: ~/logs\n  load_checkpoint_path: ~/ckpt/run/step-2\n  initialize_from: ~/other/step-1\n"
        "  jax_compilation_cache_dir: ~/jaxcache\n"
        "  tracker: {type: json, log_dir: ~/jsonlogs}\n"
        "  checkpointer: {base_path: ~/ckpt}\n"
        "initialize_from_hf: ~/hf/model\n"
        "hf_save_path: ~/hf/out\n"
    )
    from levanter.config import LOCAL_PATH_KEYS

    cfg = parse_config(TrainLmConfig, str(cfg_path))
    found = []

    def walk(obj, where):
        import dataclasses

        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if f.name in LOCAL_PATH_KEYS:
                    for v in value if isinstance(value, (list, tuple)) else [value]:
                        if isinstance(v, str):
                            found.append((f"{where}.{f.name}", v))
                else:
                    walk(value, f"{where}.{f.name}")

    walk(cfg, "")
    named = {k: v for k, v in found}
    for key in (".data.train_urls", ".data.validation_urls", ".data.tokenizer", ".data.cache_dir",
                ".trainer.log_dir", ".trainer.load_checkpoint_path", ".trainer.initialize_from",
                ".trainer.jax_compilation_cache_dir", ".trainer.tracker.log_dir",
                ".trainer.checkpointer.base_path", ".initialize_from_hf", ".hf_save_path"):
        assert key in named, (key, sorted(named))
    leftovers = [(k, v) for k, v in found if v.startswith("~")]
    assert not leftovers, leftovers
    assert named[".data.cache_dir"] == str(tmp_path / "home" / "cache")


def test_cache_dataset_with_home_paths_writes_under_home(monkeypatch, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    (home / "d").mkdir(parents=True)
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (home / "d" / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    cfg = work / "data.yaml"
    cfg.write_text("train_urls: ['~/d/train.jsonl']\ntokenizer: byte\ncache_dir: ~/cache\n"
                   "cache_options: {num_workers: 1}\n")
    cache_dataset.cli(["--config_path", str(cfg)])
    assert (home / "cache" / "train" / "shard_ledger.json").is_file()
    assert not os.path.exists(work / "~"), sorted(os.listdir(work))
