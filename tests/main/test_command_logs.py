"""What the commands without a training run print and keep: ``cache_dataset`` (here) and
``export_lm_to_hf`` (tests/compat/test_hf_checkpoints.py) show levanter's records on the console and route every
record, third-party libraries' included, to a debug log, as ``train_lm`` does with its run's: the caches'
``<data.cache_dir>/debug.log`` for ``cache_dataset``, ``logs/export_lm_to_hf/debug.log`` for the export."""

import os
import re
import subprocess
import sys

# A console record (levanter.progress.CONSOLE_FORMAT): "<date> <time> LEVEL logger: message".
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ([\w.]+): ")


def console_records(stderr: str):
    return [(m.group(1), m.group(2)) for m in map(RECORD.match, stderr.splitlines()) if m]


def check_console_and_debug_log(stderr: str, stdout: str, debug_log, shown: str | None = None) -> None:
    """The console holds no third-party record below WARNING; the debug log holds the DEBUG records of every
    library (third parties' too) and the console's levanter lines, and the command's output names it
    (``shown``; by default its path from the directory above ``logs/``)."""
    for level, name in console_records(stderr):
        assert name.startswith("levanter") or level in ("WARNING", "ERROR", "CRITICAL"), (level, name, stderr)
    assert debug_log.exists(), stdout
    text = debug_log.read_text()
    third_party = {m.group(2) for m in map(re.compile(r"^\S+ \S+ \d+ (\w+) ([\w.]+): ").match, text.splitlines())
                   if m and not m.group(2).startswith("levanter")}
    assert third_party, text[:2000]
    assert " DEBUG " in text
    assert f"debug log: {shown or os.path.relpath(debug_log, debug_log.parents[2])}" in stdout


def test_cache_dataset_keeps_library_chatter_in_its_debug_log(tmp_path):
    # The debug log sits with the caches it describes, and the build's lines name the cache by the path given.
    (tmp_path / "docs.jsonl").write_text('{"text": "hello world"}\n{"text": "another document"}\n')
    (tmp_path / "data.yaml").write_text('tokenizer: byte\ncache_dir: mydata/cache\ntrain_urls: ["docs.jsonl"]\n')
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "levanter.main.cache_dataset", "--config_path", "data.yaml"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "data/train: 2 documents" in r.stdout
    assert ("INFO", "levanter.ingest.progress") in console_records(r.stderr)  # the build's summary line
    assert "levanter.ingest.progress: cached mydata/cache/train: 2 docs" in r.stderr, r.stderr
    debug_log = tmp_path / "mydata" / "cache" / "debug.log"
    check_console_and_debug_log(r.stderr, r.stdout, debug_log, shown="mydata/cache/debug.log")
    assert r.stdout.startswith("debug log: mydata/cache/debug.log\n"), r.stdout
    assert not (tmp_path / "logs").exists()
    # a second invocation appends to the same log
    before = debug_log.read_text()
    r = subprocess.run([sys.executable, "-m", "levanter.main.cache_dataset", "--config_path", "data.yaml"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert debug_log.read_text().startswith(before)
