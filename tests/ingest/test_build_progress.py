"""What a cache build reports while it runs: log lines when stderr is not a terminal, a bar when it is,
and one summary line at the end."""

from __future__ import annotations

import io
import json
import logging
import sys

from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache
from levanter.ingest.progress import BuildProgress


def test_a_build_without_a_terminal_logs_progress_lines_and_a_summary(tmp_path, caplog):
    shards = []
    for k in range(2):
        shards.append(str(tmp_path / f"s{k}.jsonl"))
        with open(shards[-1], "w") as f:
            f.writelines(json.dumps({"text": f"doc {k}.{i} " * (i + 1)}) + "\n" for i in range(40))
    with caplog.at_level(logging.INFO, logger="levanter.ingest.progress"):
        progress = BuildProgress("c/train", shard_bytes={s: 100 for s in shards}, shards_total=2,
                                 terminal=False, interval_s=0.0)
        progress.committed(10, 500)
        assert "ETA ?" in caplog.records[-1].getMessage()  # no shard finished yet
        progress.shard_done(shards[0])
        progress.committed(5, 100)
        line = caplog.records[-1].getMessage()
        assert line.startswith("caching c/train: 15 docs, 600 tokens,") and "1/2 shards" in line
        assert "ETA ?" not in line
        progress.close(finished=True)
        assert caplog.records[-1].getMessage().startswith("cached c/train: 15 docs, 600 tokens in ")

        caplog.clear()
        cache = build_or_load_cache(shards, str(tmp_path / "cache"), ByteTokenizer(),
                                    options=CacheOptions(batch_size=8))
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cached ")]
    assert summaries == [summaries[0]] and f"{cache.ledger.total_tokens:,} tokens" in summaries[0]
    assert "80 docs" in summaries[0] and "process backend" in summaries[0]


def test_on_a_terminal_the_bar_shows_tokens_shards_and_eta(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    progress = BuildProgress("c/train", shard_bytes={"a": 10, "b": 30}, shards_total=2, terminal=True)
    progress.committed(3, 1234)
    progress.shard_done("a")
    progress.committed(1, 10)
    progress.close(finished=False)
    text = err.getvalue()
    assert "caching c/train" in text and "4 docs" in text
    assert "tokens=1,244" in text and "shards=1/2" in text and "eta=" in text
