"""Hugging Face datasets as cache sources (``data.id``), offline: a ``save_to_disk`` directory and a
directory of parquet files give the same tokens as the same texts in a JSON-lines file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from levanter.data.config import UrlSingleDatasetLMConfig

datasets = pytest.importorskip("datasets")

TRAIN = [f"document {i}: " + "naïve café " * (i % 9) + "end" for i in range(60)]
VALIDATION = ["a held-out text", "and another one, ünïcode included"]


def tokens_of(config: UrlSingleDatasetLMConfig, split: str) -> list[list[int]]:
    cache = config.build_caches(split)
    return [row.tolist() for row in cache.store.read_rows_sync(np.arange(cache.store.num_rows))]


def test_a_saved_dataset_and_parquet_files_give_the_tokens_of_the_same_texts_in_jsonl(tmp_path):
    jsonl = {}
    for split, texts in (("train", TRAIN), ("validation", VALIDATION)):
        jsonl[split] = str(tmp_path / f"{split}.jsonl")
        with open(jsonl[split], "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    from_files = UrlSingleDatasetLMConfig(
        train_urls=[jsonl["train"]], validation_urls=[jsonl["validation"]], tokenizer="byte",
        cache_dir=str(tmp_path / "c-jsonl"),
    )

    # DatasetDict.save_to_disk, the train split in three Arrow files (three shards).
    saved = str(tmp_path / "saved")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": TRAIN, "id": list(range(len(TRAIN)))}),
        "validation": datasets.Dataset.from_dict({"text": VALIDATION, "id": [0, 1]}),
    }).save_to_disk(saved, num_shards={"train": 3, "validation": 1})
    from_saved = UrlSingleDatasetLMConfig(id=saved, tokenizer="byte", cache_dir=str(tmp_path / "c-saved"))

    # Parquet files named by the datasets library's conventions (train-*.parquet, validation-*.parquet).
    pq = tmp_path / "pq"
    pq.mkdir()
    datasets.Dataset.from_dict({"text": TRAIN[:25]}).to_parquet(str(pq / "train-00000-of-00002.parquet"))
    datasets.Dataset.from_dict({"text": TRAIN[25:]}).to_parquet(str(pq / "train-00001-of-00002.parquet"))
    from_parquet = UrlSingleDatasetLMConfig(id=str(pq), tokenizer="byte", cache_dir=str(tmp_path / "c-pq"))

    expected = tokens_of(from_files, "train")
    assert len(expected) == len(TRAIN)
    assert tokens_of(from_saved, "train") == expected
    assert tokens_of(from_parquet, "train") == expected
    assert tokens_of(from_saved, "validation") == tokens_of(from_files, "validation")
    # The parquet directory has no validation split: no validation set, not an error.
    assert from_parquet.build_caches("validation") is None
    # splits (upstream's key) lists the splits to read: without the validation split there is no validation
    # set; without the training split the config is refused, naming both keys.
    only_train = UrlSingleDatasetLMConfig(id=saved, splits=["train"], tokenizer="byte",
                                          cache_dir=str(tmp_path / "c-only-train"))
    assert only_train.build_caches("validation") is None
    with pytest.raises(ValueError, match=r"data.splits=\['validation'\] leaves out .*data.train_split='train'"):
        UrlSingleDatasetLMConfig(id=saved, splits=["validation"], tokenizer="byte",
                                 cache_dir=str(tmp_path / "c-none")).build_caches("train")
    # One shard per data file, so a build spreads over them.
    assert len(from_saved.build_caches("train").ledger.finished_shards) == 3
    assert len(from_parquet.build_caches("train").ledger.finished_shards) == 2


def test_a_split_the_dataset_lacks_is_named_with_the_splits_it_has(tmp_path):
    saved = str(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(saved)
    config = UrlSingleDatasetLMConfig(id=saved, train_split="training", tokenizer="byte",
                                      cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"no split 'training' .*data.train_split.*\['train'\]"):
        config.build_caches("train")
    assert not os.path.exists(tmp_path / "c")
