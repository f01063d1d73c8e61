"""The bad-input catalogue: configs and files users get wrong, each run through the real command-line
entry point, with the exit status and the message it must print.

Every case is one row of ``CASES``: what the user did, how to reproduce it (a YAML file, files to
create, command-line overrides), the expected exit status (2: fix the config or the input and rerun;
1: the run failed), and fragments the message must contain -- the config key or file at fault and the
value. For every case the test also checks that stderr holds no traceback and that the ``error:``
message is a single short paragraph. ``docs/reference/errors.md`` documents the same cases (a test below
keeps the two in step).

The entry points run in-process (``train_lm.cli(argv)``, ``cache_dataset.cli(argv)``,
``data_schedule.cli(argv)``) so the catalogue stays fast: almost every case fails before a cache is
built or a model compiled. The few that need a token cache or a saved checkpoint share the ones the
module-scoped ``shared`` fixture makes once.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import gzip
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from accelerator import require_devices, require_sockets
from levanter.main import cache_dataset, data_schedule, export_lm_to_hf, train_lm
from levanter.main import eval_harness, eval_lm, sft, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reference" / "errors.md"

# -- the configs the cases start from -----------------------------------------------------------------
# $TMP is the case's own directory, $SHARED the module's (a finished token cache of the base data lives
# in $SHARED/cache, a saved checkpoint of the base run in $SHARED/ckpt).
DATA = """\
data:
  train_urls: ["embedded://python-docs/validation"]
  tokenizer: byte
  cache_dir: $SHARED/cache
  shuffle: true
"""
REST = """\
model: {type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 1, seq_len: 32, gradient_checkpointing: false}
trainer:
  num_train_steps: 4
  train_batch_size: 8
  steps_per_eval: 100
  max_eval_batches: 1
  require_accelerator: false
  id: bad
  log_dir: $TMP/logs
  tracker: {type: json}
  checkpointer: {base_path: $TMP/ckpt, keep: [{every: 2}]}
optimizer: {learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0, lr_schedule: constant}
"""
BASE = DATA + REST

MIX_DATA = """\
data:
  tokenizer: byte
  cache_dir: $TMP/cache
  mixture_block_size: null
  configs:
    prose: {train_urls: ["embedded://python-docs/validation"]}
    code: {train_urls: ["embedded://python-code/validation"]}
  train_weights:
    - [0, {prose: 0.75, code: 0.25}]
    - [2, {prose: 0.5, code: 0.5}]
"""
MIX = MIX_DATA + REST


def files_data(urls: str, *, text_key: str = "") -> str:
    """The base config reading ``urls`` (a YAML list) into a cache of the case's own."""
    extra = f"  text_key: {text_key}\n" if text_key else ""
    return (
        "data:\n"
        f"  train_urls: {urls}\n"
        "  tokenizer: byte\n"
        "  cache_dir: $TMP/cache\n"
        "  cache_options: {num_workers: 1}\n" + extra + REST
    )


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# -- cases ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    area: str
    what: str  # what the user did
    status: int  # the exit status
    fragments: Sequence[str]  # the message must contain each ($TMP/$SHARED substituted)
    yaml: str | None = BASE  # the config file's text (None: no file is written)
    args: Sequence[str] = ()  # command-line arguments after --config_path
    entry: str = "train_lm"  # train_lm | cache_dataset | data_schedule
    config_path: str | None = "$TMP/config.yaml"  # None: no --config_path
    setup: Callable[[Path, Path], None] | None = None  # (tmp, shared): create or damage files
    patch: Callable[[pytest.MonkeyPatch], None] | None = None  # in-process fault injection
    after: Callable[[Path, Path], None] | None = None  # extra checks once it has failed
    # shared artefacts (see ensure): "cache", "checkpoint"; servers: "s3_server", "gcs_server"; "sockets": a
    # free TCP port ($PORT); "8 devices": a message that names the 8 simulated devices; "cpu": a refusal that
    # only a CPU backend gets
    needs: Sequence[str] = ()


_denying_proxies: list = []


def deny_access(monkeypatch) -> None:
    """Point S3 clients at a proxy in front of the session's moto server that answers every request with
    403 (tests/object_store.py), as a store does for credentials without rights to the bucket."""
    from object_store import FaultProxy

    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxy = FaultProxy(port, fail_fraction=1.0, delay_s=(0.0, 0.0), fail_status=403)
    _denying_proxies.append(proxy)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)


def close_denying_proxy() -> None:
    while _denying_proxies:
        _denying_proxies.pop().close()


def _compile_out_of_memory(monkeypatch) -> None:
    """XLA refuses to compile the train step for lack of device memory, as XLA:TPU does for a device of
    64 KiB: its message, with the step's own figure (tests/helpers.py)."""
    from helpers import compiler_refuses_above

    compiler_refuses_above(monkeypatch, 64 * 1024)


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)


def write_files(files: dict) -> Callable[[Path, Path], None]:
    def setup(tmp: Path, shared: Path) -> None:
        for rel, data in files.items():
            _write(tmp / rel, data)

    return setup


# Varied text, so that its gzip is long enough to cut in half.
GOOD_JSONL = "".join(
    json.dumps({"text": " ".join(str((i * 7919 + j * 104729) % 100003) for j in range(60))}) + "\n" for i in range(40)
)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def copy_cache(tmp: Path, shared: Path) -> None:
    shutil.copytree(shared / "cache", tmp / "cache")


def swap_files(a: Path, b: Path) -> None:
    aside = a.with_name(a.name + ".swap")
    a.rename(aside)
    b.rename(a)
    aside.rename(b)


def truncate_ledger(tmp: Path, shared: Path) -> None:
    copy_cache(tmp, shared)
    ledger = tmp / "cache" / "train" / "shard_ledger.json"
    ledger.write_bytes(ledger.read_bytes()[:40])


def copy_checkpoint(tmp: Path, shared: Path) -> Path:
    dst = tmp / "ckpt" / "bad" / "step-2"
    shutil.copytree(shared / "ckpt" / "bad" / "step-2", dst)
    return dst


def resumable_checkpoint(tmp: Path, shared: Path) -> None:
    """The shared run's step-2 checkpoint, intact, where the case's run will resume from it."""
    copy_checkpoint(tmp, shared)


_before: dict = {}


def keeping(*setups: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    """The ``setups``, then a note of every file under $TMP (with its bytes) for :func:`untouched`."""

    def setup(tmp: Path, shared: Path) -> None:
        from helpers import tree_bytes

        for s in setups:
            s(tmp, shared)
        _before[str(tmp)] = tree_bytes(tmp)

    return setup


def untouched(tmp: Path, shared: Path) -> None:
    """Every file that was under $TMP before the command is still there, byte for byte."""
    from helpers import tree_bytes

    before, now = _before.pop(str(tmp)), tree_bytes(tmp)
    assert before, "nothing was set up"
    lost = sorted(p for p in before if p not in now)
    changed = sorted(p for p in before if p in now and now[p] != before[p])
    assert not lost and not changed, f"deleted: {lost}, changed: {changed}"


def copy_run_logs(tmp: Path, shared: Path) -> None:
    """The shared run's log directory (its metrics, and the record of its checkpoints in $SHARED/ckpt)."""
    shutil.copytree(shared / "logs" / "bad", tmp / "logs" / "bad")


def _leaf_dir(ckpt: Path, leaf: str) -> Path:
    (match,) = [p for p in ckpt.rglob("zarr.json") if p.parent.relative_to(ckpt).as_posix() == leaf]
    return match.parent


WTE = "model/wte/weight/0"  # the token embedding
WTE_KEYPATH = ".model.wte.weight"


def delete_chunk(tmp: Path, shared: Path) -> None:
    leaf = _leaf_dir(copy_checkpoint(tmp, shared), WTE)
    chunks = sorted(p for p in leaf.rglob("*") if p.is_file() and p.name != "zarr.json")
    chunks[-1].unlink()


def delete_leaf(tmp: Path, shared: Path) -> None:
    shutil.rmtree(_leaf_dir(copy_checkpoint(tmp, shared), WTE))


def truncate_chunk(tmp: Path, shared: Path) -> None:
    leaf = _leaf_dir(copy_checkpoint(tmp, shared), WTE)
    chunk = sorted(p for p in leaf.rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    chunk.write_bytes(chunk.read_bytes()[:100])


def corrupt_checkpoint_metadata(tmp: Path, shared: Path) -> None:
    meta = copy_checkpoint(tmp, shared) / "metadata.json"
    meta.write_text(meta.read_text()[:50])


def block_checkpoint_dir(tmp: Path, shared: Path) -> None:
    _write(tmp / "afile", "a regular file, not a directory")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_this_process(mp: pytest.MonkeyPatch) -> None:
    """Background saves written by the training process, where the cases below replace ``write_leaf`` (the
    writer process meets a real full or read-only disk in tests/checkpoint/test_async_checkpoint.py)."""
    mp.setenv("LEVANTER_CHECKPOINT_WRITER", "thread")


def disk_full(mp: pytest.MonkeyPatch) -> None:
    import levanter.checkpoint.leaf_writes as ckpt

    in_this_process(mp)

    async def no_space(root, item, process_index):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(root, item.record["name"]))

    mp.setattr(ckpt, "write_leaf", no_space)


def checkpoint_dir_read_only(mp: pytest.MonkeyPatch) -> None:
    """The checkpoint directory's filesystem turns read-only once the run has started (a remount after an
    I/O error): the background save's writes and the run lock's removal fail with EROFS, as the kernel
    reports it."""
    import levanter.checkpoint.leaf_writes as ckpt
    from levanter.utils import fs

    def erofs(path):
        return OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    async def read_only(root, item, process_index):
        raise erofs(os.path.join(root, item.record["name"]))

    remove = fs.remove

    def remove_unless_lock(path, *args, **kwargs):
        if str(path).endswith("run.lock"):
            raise erofs(path)
        return remove(path, *args, **kwargs)

    in_this_process(mp)
    mp.setattr(ckpt, "write_leaf", read_only)
    mp.setattr(fs, "remove", remove_unless_lock)


def disk_full_tensorstore(mp: pytest.MonkeyPatch) -> None:
    """A full disk as tensorstore reports it: a ValueError whose text carries the errno."""
    import levanter.checkpoint.leaf_writes as ckpt

    in_this_process(mp)

    async def no_space(root, item, process_index):
        chunk = os.path.join(root, item.record["name"], "c", "0", "0")
        raise ValueError(
            f'RESOURCE_EXHAUSTED: Error writing local file "{chunk}": Failed writing: "{chunk}.__lock": Failed to '
            "write 4112 bytes to file 3: No space left on device [os_error_code='28'] [source locations='tensorstore"
            "/internal/os/file_util_posix.cc:412'] [tensorstore_spec='{\"driver\":\"zarr3\",\"kvstore\":"
            f'{{\"driver\":\"file\",\"path\":\"{root}\"}}}}\']'
        )

    mp.setattr(ckpt, "write_leaf", no_space)


def export_disk_full(mp: pytest.MonkeyPatch) -> None:
    """An export's first safetensors file is written to /dev/full, where the write fails with the kernel's
    ENOSPC, as on a full disk; every other file (later exports' too: space was freed) is written normally."""
    from levanter.utils import fs

    write = fs.atomic_write_bytes
    failed = []

    def atomic_write_bytes(path, data, **kwargs):
        if str(path).endswith(".safetensors") and not failed:
            failed.append(path)
            with open("/dev/full", "wb") as f:
                f.write(data)
                f.flush()
        return write(path, data, **kwargs)

    mp.setattr(fs, "atomic_write_bytes", atomic_write_bytes)


def export_on_rerun(tmp: Path, shared: Path) -> None:
    """The run stopped at its last step's export before checkpointing that step; rerun (with space), it resumes
    from the step before and writes the export it missed."""
    from levanter.config import parse_config

    run = tmp / "ckpt" / "bad"
    assert "step-4" not in [p.name for p in run.iterdir()] and not (tmp / "hf-out" / "bad" / "step-4").exists()
    result = train_lm.main(parse_config(train_lm.TrainLmConfig, str(tmp / "config.yaml")))
    assert result["final_step"] == 4
    assert (tmp / "hf-out" / "bad" / "step-4" / "model.safetensors").is_file()
    assert (run / "step-4" / "metadata.json").is_file()


def no_export_left(tmp: Path, shared: Path) -> None:
    """Nothing of the export that failed is left: no output directory, no temporary one beside it."""
    assert not (tmp / "out").exists()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(".tmp-")]


def metrics_disk_full(mp: pytest.MonkeyPatch) -> None:
    """The run's metrics.jsonl is opened for appending on /dev/full, where every write fails with the
    kernel's ENOSPC, as on a full disk; every other file is written normally."""
    import builtins

    import levanter.tracker.json_tracker as jt

    def open_(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            path = "/dev/full"
        return builtins.open(path, mode, *args, **kwargs)

    mp.setattr(jt, "open", open_, raising=False)


def no_wandb_login(mp: pytest.MonkeyPatch) -> None:
    """No wandb credentials anywhere: no key or mode in the environment, a home without ~/.netrc."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_CONFIG_DIR",
                 "WANDB_BASE_URL"):
        mp.delenv(name, raising=False)
    mp.setenv("HOME", "/nonexistent-home-for-wandb-test")


def no_checkpoint_left(tmp: Path, shared: Path) -> None:
    run_dir = tmp / "ckpt" / "bad"
    assert not (run_dir / "step-2").exists(), os.listdir(run_dir)
    assert not glob.glob(str(run_dir / "step-*" / "metadata.json")), os.listdir(run_dir)
    assert not [p for p in os.listdir(run_dir) if p.startswith(".tmp-")], os.listdir(run_dir)


# -- inputs and cache builds: files and faults ----------------------------------------------------------
def build_then_edit(before: dict, after: dict) -> Callable[[Path, Path], None]:
    """Write ``before``, build the case's caches from them (a finished cache), then write ``after``."""

    def setup(tmp: Path, shared: Path) -> None:
        write_files(before)(tmp, shared)
        cache_dataset.main(cache_dataset.load_data_config(str(tmp / "config.yaml")))
        write_files(after)(tmp, shared)

    return setup


def build_then_edit_keeping_mtime(name: str) -> Callable[[Path, Path], None]:
    """Write ``name`` (GOOD_JSONL), build the case's cache, then change one digit in the middle of the file
    (same size) and put its modification time back, as ``cp -p`` or ``rsync -t`` would."""

    def setup(tmp: Path, shared: Path) -> None:
        write_files({name: GOOD_JSONL})(tmp, shared)
        cache_dataset.main(cache_dataset.load_data_config(str(tmp / "config.yaml")))
        path = tmp / name
        st = os.stat(path)
        data = bytearray(path.read_bytes())
        mid = len(data) // 2
        while not chr(data[mid]).isdigit():
            mid += 1
        data[mid] = ord("1") if data[mid] != ord("1") else ord("2")
        path.write_bytes(bytes(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    return setup


def record_partial_hash(tmp: Path, shared: Path) -> None:
    """Build the case's cache, then rewrite its ledger as caches recorded files over 4 MiB before: a hash of
    the first and last MiB (``sampled``), no ctime or inode."""
    from levanter.store import CacheLedger

    write_files({"data.jsonl": GOOD_JSONL})(tmp, shared)
    cache_dataset.main(cache_dataset.load_data_config(str(tmp / "config.yaml")))
    ledger = CacheLedger.load(tmp / "cache" / "train")
    for ident in ledger.metadata["inputs"].values():
        ident.pop("ctime", None)
        ident.pop("inode", None)
        ident["sampled"] = True
    ledger.save(tmp / "cache" / "train")


def build_then_move(tmp: Path, shared: Path) -> None:
    """Build the cache from ``data.jsonl``, then copy the file to ``moved/`` (the case's config reads it
    there): the same content under another path."""
    write_files({"data.jsonl": GOOD_JSONL, "moved/data.jsonl": GOOD_JSONL})(tmp, shared)
    original = tmp / "original.yaml"
    original.write_text((tmp / "config.yaml").read_text().replace("/moved/data.jsonl", "/data.jsonl"))
    cache_dataset.main(cache_dataset.load_data_config(str(original)))


def zstd_cut(text: str, keep: float) -> bytes:
    """``text`` zstd-compressed, keeping the first ``keep`` fraction of the stream (an interrupted copy)."""
    import zstandard

    blob = zstandard.ZstdCompressor().compress(text.encode())
    return blob[: int(len(blob) * keep)]


TS_NO_SPACE = ("UNKNOWN: Error writing local file \"{path}/c/0\": Failed to write 4096 bytes: No space left "
               "on device [os_error_code='28'] [source locations='tensorstore/internal/os/file_util_posix.cc:412']")


def cache_disk_full(mp: pytest.MonkeyPatch) -> None:
    """The cache store's third write fails as tensorstore reports a full disk."""
    from levanter.store.jagged_array import JaggedArrayStore

    real, calls = JaggedArrayStore.append_flat, []

    def append_flat(self, *args, **kwargs):
        calls.append(1)
        if len(calls) >= 3:
            raise ValueError(TS_NO_SPACE.format(path="cache/train/input_ids/data"))
        return real(self, *args, **kwargs)

    mp.setattr(JaggedArrayStore, "append_flat", append_flat)


def cache_unfinished(rows: int) -> Callable[[Path, Path], None]:
    """The case's train cache is not finished and its ledger counts ``rows`` rows (those that landed)."""

    def check(tmp: Path, shared: Path) -> None:
        from levanter.store.ledger import CacheLedger

        ledger = CacheLedger.load(tmp / "cache" / "train")
        assert ledger is not None and not ledger.is_finished and ledger.total_rows == rows, ledger

    return check


SMALL_BATCHES = ("cache_options: {num_workers: 1}", "cache_options: {num_workers: 1, batch_size: 8}")
# Varied and long enough (~220 kB) that zstd writes several blocks: a cut stream decodes to whole lines and
# a partial one.
LONG_JSONL = "".join(
    json.dumps({"text": " ".join(str((i * 7919 + j * 104729) % 100003) for j in range(60))}) + "\n"
    for i in range(600)
)


CASES: list[Case] = [
    # ---------------------------------------------------------------------------------- config file
    Case("config-not-found", "config file", "--config_path names a file that does not exist", 2,
         ["config file not found", "$TMP/nope.yaml"], yaml=None, config_path="$TMP/nope.yaml"),
    Case("malformed-yaml", "config file", "a stray colon in a value (`tokenizer: byte: x`)", 2,
         ["$TMP/config.yaml, line 3", "malformed YAML", "mapping values are not allowed"],
         yaml=edit(BASE, "tokenizer: byte", "tokenizer: byte: x")),
    Case("yaml-not-a-mapping", "config file", "the YAML file is a list, not a mapping", 2,
         ["$TMP/config.yaml", "expected a mapping at the top level", "list"], yaml="- trainer\n- model\n"),
    Case("unknown-top-level-key", "config file", "a top-level key the config does not have (`trainr:`)", 2,
         ["$TMP/config.yaml", "`trainr`", "did you mean `trainer`"], yaml=BASE + "trainr: {num_train_steps: 5}\n"),
    Case("typo-nested-key", "config file", "a typo in a nested key (`trainer.num_train_step`)", 2,
         ["$TMP/config.yaml", "`trainer`", "`num_train_step`", "did you mean `num_train_steps`"], yaml=edit(BASE, "num_train_steps: 4", "num_train_step: 4")),
    Case("wrong-type", "config file", "a value of the wrong type (`num_train_steps: ten`)", 2,
         ["trainer.num_train_steps", "'ten'"], yaml=edit(BASE, "num_train_steps: 4", "num_train_steps: ten")),
    Case("section-not-a-mapping", "config file", "a section given as a list (`trainer: [..]`)", 2,
         ["`trainer`", "expected a mapping of TrainerConfig fields", "['num_train_steps', 4]"], yaml=DATA + "trainer: [num_train_steps, 4]\n"),
    Case("unknown-override", "config file", "a command-line override for a key that does not exist", 2,
         ["command line", "--trainer.num_train_stepz", "did you mean --trainer.num_train_steps?"],
         args=["--trainer.num_train_stepz", "5"]),
    # ---------------------------------------------------------------------------------------- trainer
    Case("zero-steps", "trainer", "`num_train_steps: 0`", 2, ["trainer.num_train_steps", "0"],
         args=["--trainer.num_train_steps", "0"]),
    Case("negative-steps", "trainer", "`num_train_steps: -5`", 2, ["trainer.num_train_steps", "-5"],
         args=["--trainer.num_train_steps", "-5"]),
    Case("batch-not-divisible", "trainer", "a batch size the 8 data-parallel devices cannot split", 2,
         ["trainer.train_batch_size", "12", "data-parallel size 8"], args=["--trainer.train_batch_size", "12"],
         needs=["8 devices"]),
    Case("microbatch-not-dividing", "trainer", "`per_device_parallelism` whose microbatch does not divide the batch",
         2, ["trainer.per_device_parallelism=3", "24", "16"],
         args=["--trainer.train_batch_size", "16", "--trainer.per_device_parallelism", "3"], needs=["8 devices"]),
    Case("batch-schedule-not-at-0", "trainer", "a batch-size schedule whose first entry starts at step 5", 2,
         ["trainer.train_batch_size", "step 0", "start=5"],
         args=["--trainer.train_batch_size", "[{start: 5, value: 8}]"]),
    Case("batch-schedule-not-increasing", "trainer", "batch-size schedule starts that go backwards", 2,
         ["trainer.train_batch_size", "strictly increasing", "10 then 3"],
         args=["--trainer.train_batch_size", "[{start: 0, value: 8}, {start: 10, value: 16}, {start: 3, value: 8}]"]),
    Case("batch-size-zero", "trainer", "`train_batch_size: 0`", 2, ["trainer.train_batch_size", "positive", "0"],
         args=["--trainer.train_batch_size", "0"]),
    Case("model-axis-not-dividing", "trainer", "`model_axis_size: 3` on 8 devices", 2,
         ["trainer.model_axis_size=3", "8 devices"], args=["--trainer.model_axis_size", "3"],
         needs=["8 devices"]),
    Case("bad-mp-policy", "trainer", "an unparseable mixed-precision policy", 2, ["trainer.mp", "p=f32,c=float99"],
         args=["--trainer.mp", "p=f32,c=float99"]),
    Case("require-accelerator-on-cpu", "trainer", "`require_accelerator: true` on a machine with only CPUs", 2,
         ["trainer.require_accelerator", "false"], args=["--trainer.require_accelerator", "true"], needs=["cpu"]),
    Case("bad-save-interval", "trainer", "a checkpoint interval that is not a duration", 2,
         ["trainer.checkpointer.save_interval", "'soon'"], args=["--trainer.checkpointer.save_interval", "soon"]),
    Case("keep-not-increasing", "trainer", "checkpoint `keep` intervals whose `until` goes backwards", 2,
         ["trainer.checkpointer.keep", "until=5"],
         args=["--trainer.checkpointer.keep", "[{every: 2, until: 10}, {every: 5, until: 5}, {every: 10}]"]),
    Case("checkpoint-dir-unwritable", "trainer", "a checkpoint base path under a regular file", 2,
         ["trainer.checkpointer.base_path", "$TMP/afile/ckpt", "Not a directory"],
         args=["--trainer.checkpointer.base_path", "$TMP/afile/ckpt"], setup=block_checkpoint_dir),
    # -------------------------------------------------------------------------------- object stores
    # Against the local servers of tests/object_store.py (needs: the session's s3_server / gcs_server).
    Case("object-store-missing-bucket", "object stores", "`data.cache_dir` in an S3 bucket that does not exist",
         2, ["data.cache_dir", "s3://no-such-bucket/cache", "'no-such-bucket' does not exist"],
         args=["--data.cache_dir", "s3://no-such-bucket/cache"], needs=["s3_server"],
         after=lambda t, s: None if not (t / "logs").exists() else pytest.fail("work started before the check")),
    Case("object-store-checkpoint-bucket-missing", "object stores",
         "`trainer.checkpointer.base_path` in a GCS bucket that does not exist", 2,
         ["trainer.checkpointer.base_path", "gs://no-such-bucket/ckpt", "'no-such-bucket' does not exist"],
         args=["--trainer.checkpointer.base_path", "gs://no-such-bucket/ckpt"], needs=["gcs_server"]),
    Case("object-store-log-dir-bucket-missing", "object stores", "`trainer.log_dir` in an S3 bucket that does not exist",
         2, ["trainer.log_dir", "s3://no-such-bucket/logs", "'no-such-bucket' does not exist"],
         args=["--trainer.log_dir", "s3://no-such-bucket/logs"], needs=["s3_server"]),
    Case("object-store-train-urls-bucket-missing", "object stores", "`data.train_urls` in a GCS bucket that does not exist",
         2, ["data.train_urls", "gs://no-such-bucket/docs.jsonl", "'no-such-bucket' does not exist"],
         yaml=files_data('["gs://no-such-bucket/docs.jsonl"]'), needs=["gcs_server"]),
    Case("object-store-access-denied", "object stores",
         "`cache_dataset` with `data.cache_dir` on an S3 store that denies access (HTTP 403)", 2,
         ["data.cache_dir", "s3://levanter-test/denied", "access denied"], entry="cache_dataset",
         yaml=files_data('["$TMP/data.jsonl"]'), setup=write_files({"data.jsonl": '{"text": "a"}\n'}),
         args=["--data.cache_dir", "s3://levanter-test/denied"], needs=["s3_server"], patch=lambda mp: deny_access(mp),
         after=lambda t, s: close_denying_proxy()),
    # ------------------------------------------------------------------------------------------ model
    Case("unknown-model-type", "model", "`model.type: transformer9000`", 2, ["$TMP/config.yaml", "`model`", "'transformer9000'", "gpt2, llama", "qwen3"],
         yaml=edit(BASE, "type: gpt2", "type: transformer9000")),
    Case("heads-not-dividing-hidden", "model", "`hidden_dim: 30` with `num_heads: 4`", 2,
         ["model.hidden_dim (30)", "model.num_heads (4)"], args=["--model.hidden_dim", "30"]),
    Case("rope-llama3-band-inverted", "model", "`rope: {type: llama3}` with `high_freq_factor` not above "
         "`low_freq_factor`", 2, ["model.rope.high_freq_factor (1.0)", "model.rope.low_freq_factor (2.0)"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: llama, rope: {type: llama3, low_freq_factor: 2.0, high_freq_factor: 1.0}, num_kv_heads: 4, hidden_dim: 32, "
                   "num_heads: 4,")),
    Case("head-size-odd", "model", "a Qwen3 with `head_dim: 7`", 2, ["$TMP/config.yaml", "(7: model.head_dim", "even"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: qwen3, hidden_dim: 32, intermediate_dim: 64, num_heads: 4, num_kv_heads: 2, head_dim: 7,")),
    Case("kv-heads-not-dividing", "model", "a Llama with `num_heads: 6`, `num_kv_heads: 4`", 2,
         ["model.num_heads (6)", "model.num_kv_heads (4)"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: llama, hidden_dim: 48, intermediate_dim: 64, num_heads: 6, num_kv_heads: 4,")),
    Case("moe-top-k-above-experts", "model", "a Mixtral with `num_experts_per_tok: 4` but `num_local_experts: 2`", 2,
         ["model.num_experts_per_tok (4)", "model.num_local_experts (2)"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: mixtral, hidden_dim: 32, intermediate_dim: 16, num_heads: 4, num_kv_heads: 2, "
                   "num_local_experts: 2, num_experts_per_tok: 4,")),
    Case("moe-unknown-dispatch", "model", "`moe_dispatch: sparse` on a Mixtral", 2,
         ["model.moe_dispatch 'sparse'", "dense", "grouped"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: mixtral, hidden_dim: 32, intermediate_dim: 16, num_heads: 4, num_kv_heads: 2, "
                   "moe_dispatch: sparse,")),
    Case("head-dim-odd", "model", "a Gemma with `head_dim: 7` (RoPE rotates pairs)", 2,
         ["head size (7: model.head_dim", "even"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: gemma, hidden_dim: 32, intermediate_dim: 64, head_dim: 7, num_kv_heads: 1, num_heads: 4,")),
    Case("gemma-norm-weight-off", "model", "a Gemma with `use_layer_norm_weight: false`", 2,
         ["model.use_layer_norm_weight false", "Gemma"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: gemma, use_layer_norm_weight: false, hidden_dim: 32, intermediate_dim: 64, num_heads: 4,")),
    Case("gemma2-attn-backend", "model", "a Gemma 2 with `attn_backend: jax_flash` (no soft-capping there)", 2,
         ["model.attn_backend 'jax_flash'", "Gemma 2", "vanilla"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: gemma2, attn_backend: jax_flash, hidden_dim: 32, intermediate_dim: 64, head_dim: 8, "
                   "num_kv_heads: 1, num_heads: 4,")),
    Case("gemma2-blockwise-loss-with-logit-cap", "model",
         "a Gemma 2 with `cross_entropy_block_size` and its logit cap", 2,
         ["model.cross_entropy_block_size", "model.final_logit_softcapping"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: gemma2, cross_entropy_block_size: 64, hidden_dim: 32, intermediate_dim: 64, head_dim: 8, "
                   "num_kv_heads: 1, num_heads: 4,")),
    Case("mistral-sliding-window-zero", "model", "a Mistral with `sliding_window: 0`", 2,
         ["model.sliding_window must be a positive number", "null"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: mistral, sliding_window: 0, hidden_dim: 32, intermediate_dim: 64, num_kv_heads: 2, "
                   "num_heads: 4,")),
    Case("olmo2-attention-dropout", "model", "upstream's `attention_dropout: 0.1` on an OLMo 2", 2,
         ["model.attention_dropout=0.1 is not supported", "remove the key"],
         yaml=edit(BASE, "{type: gpt2, hidden_dim: 32, num_heads: 4,",
                   "{type: olmo2, attention_dropout: 0.1, hidden_dim: 32, intermediate_dim: 64, num_kv_heads: 2, "
                   "num_heads: 4,")),
    Case("seq-len-beyond-positions", "model", "`seq_len: 2048` with `n_positions: 1024`", 2,
         ["model.seq_len (2048)", "model.n_positions", "1024"],
         args=["--model.seq_len", "2048", "--model.n_positions", "1024"]),
    Case("attn-backend-not-on-platform", "model", "`attn_backend: splash` on a machine with only CPUs", 2,
         ["model.attn_backend", "'splash'", "TPU", "'cpu'"], args=["--model.attn_backend", "splash"],
         needs=["cpu"]),
    Case("flash-block-size-zero", "model", "`flash_attention_block_size: 0`", 2,
         ["model.flash_attention_block_size", "positive integer", "got 0"],
         args=["--model.flash_attention_block_size", "0"]),
    Case("splash-block-not-dividing", "model", "`splash_block_sizes: {block_q: 24}` with `seq_len: 32`", 2,
         ["model.splash_block_sizes.block_q=24", "does not divide the sequence length 32"],
         args=["--model.splash_block_sizes.block_q", "24"]),
    Case("use-flash-attention-conflict", "model", "`use_flash_attention: false` with `attn_backend: jax_flash`", 2,
         ["model.use_flash_attention=false", "model.attn_backend='jax_flash'"],
         args=["--model.use_flash_attention", "false", "--model.attn_backend", "jax_flash"]),
    Case("unknown-activation", "model", "`activation_function: swishy`", 2,
         ["model.activation_function", "'swishy'"], args=["--model.activation_function", "swishy"]),
    Case("cross-entropy-block-zero", "model", "`cross_entropy_block_size: 0`", 2,
         ["model.cross_entropy_block_size", "positive", "got 0"], args=["--model.cross_entropy_block_size", "0"]),
    # -------------------------------------------------------------------------------------- optimizer
    Case("beta1-at-1", "optimizer", "`beta1: 1.0`", 2, ["optimizer.beta1", "1.0", "[0, 1)"],
         args=["--optimizer.beta1", "1.0"]),
    Case("unknown-lr-schedule", "optimizer", "`lr_schedule: cosinus`", 2, ["optimizer.lr_schedule", "'cosinus'"],
         args=["--optimizer.lr_schedule", "cosinus"]),
    Case("negative-learning-rate", "optimizer", "`learning_rate: -0.001`", 2,
         ["optimizer.learning_rate", "-0.001"], args=["--optimizer.learning_rate", "-0.001"]),
    Case("unknown-optimizer", "optimizer", "`optimizer.type: sgd` on the command line", 2,
         ["--optimizer.type", "'sgd'", "adam"], args=["--optimizer.type", "sgd"]),
    Case("unknown-optimizer-yaml", "optimizer", "`optimizer: {type: sgd}` in the file", 2,
         ["`optimizer`", "'sgd'", "known types: adam"], yaml=edit(BASE, "optimizer: {", "optimizer: {type: sgd, ")),
    Case("sophia-gamma-zero", "optimizer", "`optimizer: {type: sophia-h, gamma: 0}`", 2,
         ["optimizer.gamma must be positive", "got 0"],
         yaml=edit(BASE, "optimizer: {", "optimizer: {type: sophia-h, gamma: 0, ")),
    Case("muon-lr-set", "optimizer", "upstream's `optimizer: {type: muon, lr: 0.01}` (a key upstream never reads)", 2,
         ["optimizer.lr=0.01 is not supported", "learning_rate"],
         yaml=edit(BASE, "optimizer: {", "optimizer: {type: muon, lr: 0.01, ")),
    Case("skip-bad-steps-window", "optimizer", "`skip_bad_steps: 1` (a window of one step)", 2,
         ["optimizer.skip_bad_steps", "at least 2 steps", "got 1"], args=["--optimizer.skip_bad_steps", "1"]),
    Case("cyclic-schedule", "optimizer", "upstream's `cycle_length: 2` (two cycles in a 4-step run)", 2,
         ["optimizer.cycle_length=2 is not supported", "cyclic", "trainer.num_train_steps=4"],
         args=["--optimizer.cycle_length", "2"]),
    Case("inv-schedule-min-zero", "optimizer", "`lr_schedule: inv` with `min_lr_ratio: 0`", 2,
         ["optimizer.lr_schedule: inv", "min_lr_ratio > 0"],
         args=["--optimizer.lr_schedule", "inv", "--optimizer.min_lr_ratio", "0"]),
    Case("quantization-fp8-and-int8", "trainer", "`trainer.quantization: {fp8: true, int8: true}`", 2,
         ["trainer.quantization.fp8 and trainer.quantization.int8 are both true", "set one to false"],
         args=["--trainer.quantization.fp8", "true", "--trainer.quantization.int8", "true"]),
    Case("quantization-targets-without-int8", "trainer", "`trainer.quantization.targets` without `int8` or `fp8`", 2,
         ["trainer.quantization.targets is set but neither int8 nor fp8 is"],
         args=["--trainer.quantization.targets", "c_fc"]),
    Case("top-level-tokenizer-disagrees", "config file", "upstream's top-level `tokenizer: gpt2` beside "
         "`data.tokenizer: byte`", 2, ["tokenizer='gpt2'", "data.tokenizer='byte'", "disagree"],
         yaml="tokenizer: gpt2\n" + BASE),
    Case("sft-config", "config file", "an upstream SFT config (`supervised_data:`, `max_seq_len:`) given to train_lm",
         2, ["`supervised_data`", "supervised fine-tuning entry point", "not a config for it"],
         yaml=BASE + "supervised_data: {}\nmax_seq_len: 2048\n"),
    Case("list-for-a-string", "config file", "a YAML list for a string key (`trainer.id: [a, b]`)", 2,
         ["`trainer.id`", "expected str", "['a', 'b']"], yaml=edit(BASE, "id: bad", "id: [a, b]")),
    # ------------------------------------------------------------------------------------ data/mixture
    Case("no-train-urls", "data/mixture", "`train_urls: []`", 2, ["data.train_urls", "empty"],
         args=["--data.train_urls", "[]"]),
    Case("stage-after-end", "data/mixture", "a stage starting at step 4 of a 4-step run", 2,
         ["data.train_weights", "step 4", "trainer.num_train_steps is 4"], yaml=edit(MIX, "[2, {", "[4, {")),
    Case("negative-weight", "data/mixture", "a negative stage weight", 2,
         ["data.train_weights: stage 1 (step 2)", "'code'", "negative (-0.5)"], yaml=edit(MIX, "code: 0.5}", "code: -0.5}")),
    Case("all-zero-weights", "data/mixture", "a stage whose weights are all zero", 2,
         ["data.train_weights: stage 1 (step 2)", "all weights are zero"],
         yaml=edit(MIX, "{prose: 0.5, code: 0.5}", "{prose: 0, code: 0}")),
    Case("unknown-source", "data/mixture", "a weight for a source `data.configs` does not have", 2,
         ["data.train_weights: unknown source 'wiki'", "['code', 'prose']"], yaml=edit(MIX, "{prose: 0.5, code: 0.5}", "{wiki: 1}")),
    Case("source-never-drawn", "data/mixture", "a source with `train_urls` but weight 0 in every stage", 2,
         ["data.configs.code", "weight 0 in every stage"],
         yaml=edit(edit(MIX, "prose: 0.75, code: 0.25", "prose: 1.0"), "prose: 0.5, code: 0.5", "prose: 1.0")),
    Case("first-stage-not-at-0", "data/mixture", "a first stage that starts at step 1", 2,
         ["data.train_weights: the first stage must start at step 0", "step 1"],
         yaml=edit(MIX, "[0, {prose", "[1, {prose")),
    Case("stages-not-increasing", "data/mixture", "stages listed out of order", 2,
         ["data.train_weights: stage start steps must be strictly increasing", "3 then 2"],
         yaml=edit(MIX, "    - [2, {", "    - [3, {code: 1}]\n    - [2, {")),
    Case("weight-without-urls", "data/mixture", "a source with a training weight but no `train_urls`", 2,
         ["data.configs.code", "no train_urls"],
         yaml=edit(MIX, 'code: {train_urls: ["embedded://python-code/validation"]}',
                   'code: {validation_urls: ["embedded://python-code/validation"]}')),
    Case("unknown-stop-strategy", "data/mixture", "`stop_strategy: never`", 2, ["data.stop_strategy", "'never'"],
         yaml=MIX, args=["--data.stop_strategy", "never"]),
    Case("mixture-block-size-zero", "data/mixture", "`mixture_block_size: 0`", 2,
         ["data.mixture_block_size", "positive", "got 0"], yaml=edit(MIX, "mixture_block_size: null", "mixture_block_size: 0")),
    Case("target-budget", "data/mixture", "upstream's `data.target_budget` (not implemented here)", 2,
         ["data.target_budget", "not supported"], yaml=MIX, args=["--data.target_budget", "1000000"]),
    Case("initialize-from-hf", "data/mixture", "`initialize_from_hf` names a hub id (`gpt2`), without network", 2,
         ["'gpt2'", "could not be downloaded", "local directory"], args=["--initialize_from_hf", "gpt2"],
         patch=lambda mp: _offline_hub(mp)),
    Case("hf-dataset-id", "data/mixture", "a Hugging Face hub dataset `id` where the hub cannot be reached", 2,
         ["data.id='openwebtext'", "hub is unavailable", "HF_HUB_OFFLINE"],
         yaml="data:\n  id: openwebtext\n  tokenizer: byte\n  cache_dir: $TMP/cache\n" + REST,
         patch=lambda mp: mp.setenv("HF_HUB_OFFLINE", "1")),
    Case("cache-backend-unknown", "data/mixture", "`cache_dataset --backend` naming no backend", 2,
         ["cache_options.backend", "process, ray", "'spark'"], entry="cache_dataset", args=["--backend", "spark"]),
    # ------------------------------------------------------------------------------------ files/caches
    Case("missing-train-file", "files and caches", "a `train_urls` file that does not exist", 2,
         ["data.train_urls", "file not found", "$TMP/missing.jsonl"], yaml=files_data('["$TMP/missing.jsonl"]')),
    Case("missing-relative-train-file", "files and caches", "a relative `train_urls` path that does not exist", 2,
         ["data.train_urls", "file not found: 'train.jsonl'", "resolved to $TMP/train.jsonl",
          "working directory $TMP"], yaml=files_data('["train.jsonl"]')),
    Case("glob-matches-nothing", "files and caches", "a glob that matches no file", 2,
         ["data.train_urls", "$TMP/shards/*.jsonl.gz", "matches no files"],
         yaml=files_data('["$TMP/shards/*.jsonl.gz"]'), setup=write_files({"shards/a.jsonl": GOOD_JSONL})),
    Case("unknown-format", "files and caches", "a `.csv` train file", 2,
         ["data.train_urls", "$TMP/data.csv", "unknown format", ".jsonl"], yaml=files_data('["$TMP/data.csv"]'),
         setup=write_files({"data.csv": "text\nhello\n"})),
    Case("corrupt-jsonl-line", "files and caches", "a JSON-lines file with a broken line 3", 2,
         ["$TMP/data.jsonl, line 3", "not valid JSON", "column 12"], yaml=files_data('["$TMP/data.jsonl"]'),
         setup=write_files({"data.jsonl": '{"text": "a"}\n{"text": "b"}\n{"text": "c\n{"text": "d"}\n'})),
    Case("missing-text-key", "files and caches", "JSON lines whose text is under another key", 2,
         ["$TMP/data.jsonl", "line 1", "'text'", "content"], yaml=files_data('["$TMP/data.jsonl"]'),
         setup=write_files({"data.jsonl": '{"content": "a"}\n'})),
    Case("wrong-text-key", "files and caches", "`text_key: body` for files that use `text`", 2,
         ["$TMP/data.jsonl", "line 1", "'body'"], yaml=files_data('["$TMP/data.jsonl"]', text_key="body"),
         setup=write_files({"data.jsonl": GOOD_JSONL})),
    Case("truncated-gzip", "files and caches", "a `.jsonl.gz` shard cut short (interrupted download)", 2,
         ["$TMP/data.jsonl.gz", "cannot read line", "truncated"], yaml=files_data('["$TMP/data.jsonl.gz"]'),
         setup=lambda t, s: _write(t / "data.jsonl.gz", _half(gzip.compress(GOOD_JSONL.encode())))),
    Case("not-gzip", "files and caches", "a `.jsonl.gz` shard that is not gzip at all", 2,
         ["$TMP/data.jsonl.gz", "line 1"], yaml=files_data('["$TMP/data.jsonl.gz"]'),
         setup=write_files({"data.jsonl.gz": GOOD_JSONL})),
    Case("invalid-utf8", "files and caches", "a JSON-lines file that is not UTF-8 (Latin-1)", 2,
         ["$TMP/data.jsonl, line 2", "not valid UTF-8", "byte 0xe9 at column 14"], yaml=files_data('["$TMP/data.jsonl"]'),
         setup=write_files({"data.jsonl": '{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1")})),
    Case("txt-not-utf8", "files and caches", "a `.txt` file in another encoding (UTF-16)", 2,
         ["$TMP/notes.txt, line 1", "not valid UTF-8", "byte 0xff"], yaml=files_data('["$TMP/notes.txt"]'),
         setup=write_files({"notes.txt": "some notes\n".encode("utf-16")})),
    Case("corrupt-parquet", "files and caches", "a `.parquet` file that is not parquet", 2,
         ["$TMP/data.parquet", "not a readable parquet file"], yaml=files_data('["$TMP/data.parquet"]'),
         setup=write_files({"data.parquet": b"PAR1 but not really"})),
    Case("unknown-embedded-source", "files and caches", "an `embedded://` source that does not exist", 2,
         ["data.train_urls", "embedded://wikipedia/train", "python-docs"], args=["--data.train_urls", "[embedded://wikipedia/train]",
                                               "--data.cache_dir", "$TMP/cache"]),
    Case("tokenizer-path-missing", "files and caches", "a tokenizer path that does not exist", 2,
         ["data.tokenizer", "$TMP/tok/tokenizer.json", "does not exist"],
         args=["--data.tokenizer", "$TMP/tok/tokenizer.json"]),
    Case("passthrough-without-vocab", "files and caches", "`tokenizer: passthrough` without `vocab_size`", 2,
         ["data.tokenizer", "'passthrough'", "needs vocab_size"], args=["--data.tokenizer", "passthrough"]),
    Case("passthrough-no-eos", "files and caches", "pre-tokenized data with the default `enforce_eos: true`", 2,
         ["enforce_eos", "'passthrough'", "data.enforce_eos: false"],
         yaml=edit(files_data('["$TMP/ids.jsonl"]'), "tokenizer: byte", "tokenizer: passthrough\n  vocab_size: 300"),
         setup=write_files({"ids.jsonl": '{"text": [1, 2, 3]}\n'})),
    Case("passthrough-id-too-big", "files and caches", "pre-tokenized ids beyond `vocab_size`", 2,
         ["$TMP/ids.jsonl, line 2", "out of range", "300"],
         yaml=edit(files_data('["$TMP/ids.jsonl"]'), "tokenizer: byte",
                   "tokenizer: passthrough\n  vocab_size: 300\n  enforce_eos: false"),
         setup=write_files({"ids.jsonl": '{"text": [1, 2, 3]}\n{"text": [5, 299, 300]}\n'})),
    Case("passthrough-given-text", "files and caches", "text files with `tokenizer: passthrough`", 2,
         ["$TMP/data.jsonl, line 1", "list of token ids"],
         yaml=edit(files_data('["$TMP/data.jsonl"]'), "tokenizer: byte",
                   "tokenizer: passthrough\n  vocab_size: 300\n  enforce_eos: false"),
         setup=write_files({"data.jsonl": GOOD_JSONL})),
    Case("cache-other-tokenizer", "files and caches", "reusing a cache built with another tokenizer", 2,
         ["$SHARED/cache/train", "different settings", "vocab_size: cache has 257, config asks for 320"],
         args=["--data.vocab_size", "320"], needs=["cache"]),
    Case("cache-ledger-truncated", "files and caches", "a cache whose ledger file was cut short", 2,
         ["$TMP/cache/train/shard_ledger.json", "corrupt", "Delete the cache directory"],
         args=["--data.cache_dir", "$TMP/cache"], setup=truncate_ledger, needs=["cache"]),
    Case("cache-dataset-no-config", "files and caches", "`cache_dataset` without `--config_path`", 2,
         ["--config_path is required"], entry="cache_dataset", yaml=None, config_path=None),
    Case("cache-dataset-corrupt-jsonl", "files and caches", "`cache_dataset` over a broken JSON-lines file", 2,
         ["$TMP/data.jsonl", "line 2", "not valid JSON"], entry="cache_dataset",
         yaml=files_data('["$TMP/data.jsonl"]'), setup=write_files({"data.jsonl": '{"text": "a"}\n{text: b}\n'})),
    Case("cache-dataset-unknown-key", "files and caches", "a data-only config with a misspelled key", 2,
         ["$TMP/config.yaml", "unknown top-level key `tokeniser`", "did you mean `tokenizer`?"],
         entry="cache_dataset",
         yaml='train_urls: ["embedded://python-docs/validation"]\ntokeniser: byte\n'),
    Case("data-schedule-unknown-override", "files and caches", "`data_schedule` with a misspelled override", 2,
         ["command line", "--trainer.batch_size", "did you mean --trainer.train_batch_size?"], entry="data_schedule",
         args=["--trainer.batch_size", "16"]),
    Case("data-schedule-bad-dump", "files and caches", "`data_schedule --dump 5:3 out.jsonl`", 2,
         ["--dump", "5:3"], entry="data_schedule", args=["--dump", "5:3", "$TMP/out.jsonl"]),
    Case("data-schedule-data-only-no-batch", "files and caches",
         "`data_schedule` over a data-only config without `--batch_size` / `--num_train_steps`", 2,
         ["$TMP/config.yaml", "data-only config", "--batch_size and --num_train_steps", "train_lm config"],
         entry="data_schedule", yaml='train_urls: ["embedded://python-docs/validation"]\ntokenizer: byte\n'),
    Case("upstream-key-refused", "files and caches", "an upstream key that is not built here (`trainer.log_jaxprs`)",
         2, ["trainer.log_jaxprs=True", "not supported", "jaxprs are not logged", "remove the key"],
         args=["--trainer.log_jaxprs", "true"]),
    # ------------------------------------------------------------------------------------- checkpoints
    Case("checkpoint-chunk-deleted", "checkpoints", "resuming from a checkpoint with a chunk file deleted", 2,
         ["$TMP/ckpt/bad/step-2", WTE_KEYPATH, "cannot be read"], setup=delete_chunk, needs=["checkpoint"]),
    Case("checkpoint-chunk-truncated", "checkpoints", "resuming from a checkpoint with a truncated chunk file", 2,
         ["$TMP/ckpt/bad/step-2", WTE_KEYPATH, "cannot be read"], setup=truncate_chunk, needs=["checkpoint"]),
    Case("checkpoint-leaf-missing", "checkpoints", "resuming from a checkpoint missing a leaf directory", 2,
         ["$TMP/ckpt/bad/step-2", WTE_KEYPATH, "is missing"], setup=delete_leaf, needs=["checkpoint"]),
    Case("checkpoint-metadata-corrupt", "checkpoints", "resuming from a checkpoint whose metadata.json is cut short",
         2, ["$TMP/ckpt/bad/step-2", "metadata.json", "not valid JSON"], setup=corrupt_checkpoint_metadata,
         needs=["checkpoint"]),
    Case("checkpoint-other-model", "checkpoints", "resuming with a model of another shape", 2,
         ["$TMP/ckpt/bad/step-2", WTE_KEYPATH, "(257, 32)", "(257, 64)"],
         args=["--model.hidden_dim", "64"], setup=resumable_checkpoint, needs=["checkpoint"]),
    Case("checkpoint-data-changed", "checkpoints", "resuming after editing the data order (`data_seed`)", 2,
         ["data schedule changed at step 0", "$TMP/ckpt/bad/step-2", "allow_data_schedule_change"],
         args=["--data_seed", "7"], setup=resumable_checkpoint, needs=["checkpoint"]),
    Case("load-checkpoint-none", "checkpoints", "`load_checkpoint: true` with no checkpoint to load", 2,
         ["trainer.load_checkpoint", "$TMP/ckpt/bad"], args=["--trainer.load_checkpoint", "true"], needs=["cache"]),
    Case("log-dir-of-other-checkpoints", "checkpoints", "`trainer.id` of an earlier run, with another "
         "`checkpointer.base_path`, over that run's log directory", 2,
         ["trainer.id=bad", "$TMP/logs/bad/metrics.jsonl", "$SHARED/ckpt/bad", "$TMP/ckpt/bad", "new trainer.id"],
         setup=keeping(copy_run_logs), after=untouched, needs=["checkpoint"]),
    # ------------------------------------------------------------------------------------- multi-host
    Case("process-id-out-of-range", "multi-host", "`process_id: 2` with `num_processes: 2`", 2,
         ["trainer.distributed.process_id=2", "num_processes=2"],
         args=["--trainer.distributed.coordinator_address", "127.0.0.1:1234",
               "--trainer.distributed.num_processes", "2", "--trainer.distributed.process_id", "2"]),
    Case("coordinator-malformed", "multi-host", "a coordinator address without a port", 2,
         ["trainer.distributed.coordinator_address", "host:port", "'10.0.0.1'"],
         args=["--trainer.distributed.coordinator_address", "10.0.0.1",
               "--trainer.distributed.num_processes", "2", "--trainer.distributed.process_id", "0"]),
    Case("distributed-incomplete", "multi-host", "a coordinator address but no process id", 2,
         ["trainer.distributed", "process_id", "num_processes"],
         args=["--trainer.distributed.coordinator_address", "10.0.0.1:1234"]),
    Case("coordinator-unreachable", "multi-host", "process 1 started while the coordinator never comes up", 1,
         ["trainer.distributed", "did not answer within 1 s", "127.0.0.1:"],
         args=["--trainer.distributed.num_processes", "2", "--trainer.distributed.process_id", "1",
               "--trainer.distributed.initialization_timeout", "1",
               "--trainer.distributed.coordinator_address", "127.0.0.1:$PORT"], needs=["sockets"]),
    # ----------------------------------------------------------------------------------------- runtime
    Case("nan-loss", "runtime", "a learning rate so large the loss blows up (`learning_rate: 1e30`)", 1,
         ["train/loss", "at step 1", "trainer.crash_on_"], args=["--optimizer.learning_rate", "1e30"], needs=["cache"]),
    Case("disk-full-on-checkpoint", "runtime", "the disk fills up while a checkpoint is written", 74,
         ["$TMP/ckpt/bad/step-2", "step 2", "No space left on device"], patch=disk_full, after=no_checkpoint_left,
         needs=["cache"]),
    Case("checkpoint-dir-read-only", "runtime",
         "the checkpoint directory turns read-only during a background save (and the run lock cannot be removed)",
         74, ["$TMP/ckpt/bad is on a read-only filesystem", "saving the checkpoint of step 2 at $TMP/ckpt/bad/step-2",
              "Read-only file system"], patch=checkpoint_dir_read_only, after=no_checkpoint_left, needs=["cache"]),
    # ------------------------------------------------------------------------------------ cache reads
    Case("cache-data-chunk-deleted", "cache reads", "a finished cache with one token chunk file deleted", 2,
         ["the cache at $TMP/cache/train is damaged", "$TMP/cache/train/input_ids/data/c/2 is missing",
          "delete it to rebuild"], args=["--data.cache_dir", "$TMP/cache"], needs=["cache"],
         setup=lambda t, s: (copy_cache(t, s), os.remove(t / "cache/train/input_ids/data/c/2"))),
    Case("cache-chunk-bit-flipped", "cache reads", "a finished cache with a flipped bit in its token chunks", 1,
         ["step 0", "chunk $TMP/cache/train/input_ids/data/c/", "of the cache at $TMP/cache/train",
          "checksum mismatch", "delete $TMP/cache/train to rebuild it"],
         args=["--data.cache_dir", "$TMP/cache"], needs=["cache"],
         setup=lambda t, s: (copy_cache(t, s), [
             p.write_bytes(p.read_bytes()[:9] + bytes([p.read_bytes()[9] ^ 4]) + p.read_bytes()[10:])
             for p in (t / "cache/train/input_ids/data/c").iterdir()])),
    Case("cache-chunks-swapped", "cache reads", "a finished cache with two token chunk files swapped", 2,
         ["the cache at $TMP/cache/train is damaged", "$TMP/cache/train/input_ids/data/c/0",
          "$TMP/cache/train/input_ids/data/c/1", "checksum of another position", "delete it to rebuild"],
         args=["--data.cache_dir", "$TMP/cache"], needs=["cache"],
         setup=lambda t, s: (copy_cache(t, s), swap_files(t / "cache/train/input_ids/data/c/0",
                                                           t / "cache/train/input_ids/data/c/1"))),
    Case("cache-without-chunk-record", "cache reads",
         "a finished cache written before chunk checksums were bound to positions (no `chunk_checksums.json`)",
         2,
         ["the cache at $TMP/cache/train", "records no position of its chunk checksums", "delete it to rebuild"],
         args=["--data.cache_dir", "$TMP/cache"], needs=["cache"],
         setup=lambda t, s: (copy_cache(t, s), os.remove(t / "cache/train/input_ids/chunk_checksums.json"))),
    Case("cache-offsets-chunk-deleted", "cache reads", "a finished cache with its offsets chunk file deleted", 2,
         ["the cache at $TMP/cache/train is damaged", "$TMP/cache/train/input_ids/offsets/c/0 is missing",
          "delete it to rebuild"], args=["--data.cache_dir", "$TMP/cache"], needs=["cache"],
         setup=lambda t, s: (copy_cache(t, s), os.remove(t / "cache/train/input_ids/offsets/c/0"))),
    Case("cache-zarr-json-deleted", "cache reads", "a finished cache whose token array lost its `zarr.json`", 2,
         ["the cache at $TMP/cache/train is damaged", "$TMP/cache/train/input_ids/data/zarr.json is missing",
          "delete it to rebuild"], args=["--data.cache_dir", "$TMP/cache"], needs=["cache"],
         setup=lambda t, s: (copy_cache(t, s), os.remove(t / "cache/train/input_ids/data/zarr.json"))),
    Case("cache-random-bytes-unchecksummed", "cache reads",
         "random bytes in the token chunks of a cache written before chunks had checksums", 1,
         ["step 0", "the cache at $TMP/cache/train is damaged", "outside the vocabulary [0, 257)",
          "delete it to rebuild"], args=["--data.cache_dir", "$TMP/cache"], needs=["cache"],
         # The old format: no crc32c codec in zarr.json, no 4-byte checksum after each chunk.
         setup=lambda t, s: (copy_cache(t, s), [
             p.write_text(p.read_text().replace(',{"name":"crc32c"}', "")) if p.name == "zarr.json"
             else p.write_bytes(os.urandom(len(p.read_bytes()) - 4))
             for p in (t / "cache/train/input_ids/data").rglob("*") if p.is_file()])),
    # ------------------------------------------------------------------------- inputs and cache builds
    Case("input-edited-after-cache", "inputs and cache builds",
         "an input file edited after its cache was built (40 documents, then 120)", 2,
         ["data.train_urls", "$TMP/data.jsonl changed size", "delete $TMP/cache/train"],
         yaml=files_data('["$TMP/data.jsonl"]'),
         setup=build_then_edit({"data.jsonl": GOOD_JSONL}, {"data.jsonl": GOOD_JSONL * 3})),
    Case("input-edited-mtime-restored", "inputs and cache builds",
         "an input file edited in the middle (same size) after its cache was built, its mtime put back (`cp -p`)",
         2, ["data.train_urls", "$TMP/data.jsonl was modified (same size, different content)",
             "delete $TMP/cache/train"],
         yaml=files_data('["$TMP/data.jsonl"]'), setup=build_then_edit_keeping_mtime("data.jsonl")),
    Case("cache-partial-input-hash", "inputs and cache builds",
         "a cache written when files over 4 MiB were identified by their first and last MiB only", 2,
         ["only a partial content hash", "$TMP/data.jsonl", "delete $TMP/cache/train to rebuild it"],
         yaml=files_data('["$TMP/data.jsonl"]'), setup=record_partial_hash),
    Case("cache-verify-inputs-unknown", "inputs and cache builds", "`cache_options.verify_inputs: always`", 2,
         ["data.cache_options.verify_inputs", "metadata, full", "'always'"],
         yaml=edit(files_data('["$TMP/data.jsonl"]'), "cache_options: {num_workers: 1}",
                   "cache_options: {num_workers: 1, verify_inputs: always}"),
         setup=write_files({"data.jsonl": GOOD_JSONL})),
    Case("cache-inputs-moved", "inputs and cache builds",
         "the input files of a finished cache copied to another directory (or a bucket) and the URLs changed", 2,
         ["$TMP/cache/train", "different settings", "urls:", "$TMP/moved/data.jsonl",
          "tied to the paths of its input files", "point the URLs back"],
         yaml=files_data('["$TMP/moved/data.jsonl"]'), setup=build_then_move),
    Case("glob-gained-a-shard", "inputs and cache builds",
         "a new shard matching the glob of a finished cache", 2,
         ["data.train_urls", "new file $TMP/shards/b.jsonl", "delete $TMP/cache/train"],
         yaml=files_data('["$TMP/shards/*.jsonl"]'),
         setup=build_then_edit({"shards/a.jsonl": GOOD_JSONL}, {"shards/b.jsonl": GOOD_JSONL})),
    Case("truncated-zstd", "inputs and cache builds",
         "a `.jsonl.zst` shard cut in half (interrupted download)", 2,
         ["$TMP/data.jsonl.zst", "the file is truncated"], yaml=files_data('["$TMP/data.jsonl.zst"]'),
         setup=lambda t, s: _write(t / "data.jsonl.zst", zstd_cut(GOOD_JSONL, 0.5)),
         after=cache_unfinished(0)),
    Case("truncated-zstd-mid-line", "inputs and cache builds", "a `.jsonl.zst` shard cut inside a line", 2,
         ["$TMP/data.jsonl.zst", "the file is truncated"], entry="cache_dataset", yaml=files_data('["$TMP/data.jsonl.zst"]'),
         setup=lambda t, s: _write(t / "data.jsonl.zst", zstd_cut(LONG_JSONL, 0.9))),
    Case("json-array-not-lines", "inputs and cache builds", "a `.json` file holding one JSON array", 2,
         ["$TMP/data.json, line 1", "one JSON object per line"], yaml=files_data('["$TMP/data.json"]'),
         setup=write_files({"data.json": json.dumps([{"text": "a"}, {"text": "b"}], indent=1)})),
    Case("train-url-directory", "inputs and cache builds", "a directory listed in `train_urls`", 2,
         ["data.train_urls", "'$TMP/shards' is a directory", "$TMP/shards/*.jsonl"],
         yaml=files_data('["$TMP/shards"]'), setup=write_files({"shards/a.jsonl": GOOD_JSONL})),
    Case("input-without-text", "inputs and cache builds",
         "an input file with no documents (blank lines only)", 2,
         ["data.train_urls", "no text in $TMP/data.jsonl", "0 tokens"], yaml=files_data('["$TMP/data.jsonl"]'),
         setup=write_files({"data.jsonl": "\n\n"}), after=cache_unfinished(0)),
    Case("cache-dir-unwritable", "inputs and cache builds", "a `cache_dir` under a regular file", 2,
         ["data.cache_dir", "$TMP/afile/cache/train", "Not a directory"],
         args=["--data.cache_dir", "$TMP/afile/cache"], setup=block_checkpoint_dir),
    Case("disk-full-cache-build", "inputs and cache builds",
         "the disk fills up while `train_lm` builds a cache", 74,
         ["out of disk space while building the token cache at $TMP/cache/train", "No space left on device"],
         yaml=edit(files_data('["$TMP/data.jsonl"]'), *SMALL_BATCHES),
         setup=write_files({"data.jsonl": GOOD_JSONL}), patch=cache_disk_full, after=cache_unfinished(16)),
    Case("disk-full-cache-dataset", "inputs and cache builds", "the disk fills up during `cache_dataset`", 74,
         ["out of disk space while building the token cache at $TMP/cache/train", "No space left on device"],
         entry="cache_dataset", yaml=edit(files_data('["$TMP/data.jsonl"]'), *SMALL_BATCHES),
         setup=write_files({"data.jsonl": GOOD_JSONL}), patch=cache_disk_full, after=cache_unfinished(16)),
    # ---------------------------------------------------------------------------- runs and checkpoints
    Case("run-id-in-use", "runs and checkpoints", "the same `trainer.id` started while a run of it is going on", 2,
         ["$TMP/ckpt/bad/run.lock", "pid 4242 on host node-7, started 2026-12-01T10:00:00+00:00", "trainer.id",
          "delete $TMP/ckpt/bad/run.lock"],
         setup=lambda t, s: (_write(t / "ckpt/bad/.tmp-step-2-inflight/x", "a save in progress"),
                             _write(t / "ckpt/bad/run.lock", json.dumps(
                                 {"run_id": "bad", "host": "node-7", "pid": 4242, "token": "f00d",
                                  "started": "2026-12-01T10:00:00+00:00"}))),
         after=lambda t, s: None if (t / "ckpt/bad/.tmp-step-2-inflight/x").is_file()
         and not (t / "logs/bad/metrics.jsonl").exists() else pytest.fail("the refused start-up touched the run")),
    Case("run-id-not-a-name", "runs and checkpoints", "`trainer.id: ../../x` (a path, not a name)", 2,
         ["trainer.id='../../x'", "single directory name", "trainer.log_dir"], args=["--trainer.id", "../../x"],
         after=lambda t, s: None if not (t.parent / "x").exists() else pytest.fail("wrote outside base_path")),
    Case("load-checkpoint-path-typo", "runs and checkpoints", "a `load_checkpoint_path` that does not exist", 2,
         ["trainer.load_checkpoint_path='$TMP/ckpt/bda'", "does not exist"],
         args=["--trainer.load_checkpoint_path", "$TMP/ckpt/bda"]),
    Case("checkpoint-metadata-lost", "runs and checkpoints", "every checkpoint of the run lost its metadata.json", 2,
         ["$TMP/ckpt/bad holds checkpoints that cannot be read", "$TMP/ckpt/bad/step-2", "metadata.json",
          "trainer.load_checkpoint: false"],
         setup=lambda t, s: (copy_checkpoint(t, s) / "metadata.json").unlink(), needs=["checkpoint"],
         after=lambda t, s: None if (t / "ckpt/bad/step-2/model").is_dir()
         and not (t / "logs/bad/metrics.jsonl").exists() else pytest.fail("the arrays or the logs were touched")),
    Case("disk-full-on-checkpoint-tensorstore", "runs and checkpoints",
         "the disk fills up while tensorstore writes a checkpoint chunk", 74,
         ["out of disk space while saving the checkpoint of step 2 at $TMP/ckpt/bad/step-2", "No space left on device",
          "rerun"], patch=disk_full_tensorstore, after=no_checkpoint_left, needs=["cache"]),
    # -------------------------------------------------------------------------------- training values
    Case("learning-rate-nan", "training values", "`learning_rate: .nan` (YAML's NaN)", 2,
         ["$TMP/config.yaml", "optimizer.learning_rate must be a finite number", "nan"],
         yaml=edit(BASE, "learning_rate: 0.01", "learning_rate: .nan")),
    Case("learning-rate-inf", "training values", "`learning_rate: .inf`", 2,
         ["optimizer.learning_rate must be a finite number", "inf"], yaml=edit(BASE, "learning_rate: 0.01", "learning_rate: .inf")),
    Case("epsilon-zero", "training values", "`optimizer.epsilon: 0` (Adam's 0/0 for every zero gradient)", 2,
         ["optimizer.epsilon must be positive", "got 0.0", "0/0 = NaN"], args=["--optimizer.epsilon", "0"]),
    Case("max-grad-norm-inf", "training values", "`optimizer.max_grad_norm: .inf`", 2,
         ["optimizer.max_grad_norm must be a finite number", "inf"], args=["--optimizer.max_grad_norm", "inf"]),
    Case("weight-decay-negative", "training values", "`optimizer.weight_decay: -0.1` (was ignored)", 2,
         ["optimizer.weight_decay must be non-negative", "-0.1"], args=["--optimizer.weight_decay", "-0.1"]),
    Case("z-loss-nan", "training values", "`z_loss_weight: .nan`", 2, ["z_loss_weight", "finite", "nan"],
         args=["--z_loss_weight", "nan"]),
    Case("update-not-finite", "training values",
         "a learning rate beyond float32 (`1e39`): finite loss and gradient, non-finite update", 1,
         ["the update at step 0 is not finite", "loss and gradient norm were finite", "optimizer.learning_rate"],
         args=["--optimizer.learning_rate", "1e39", "--trainer.checkpointer.keep", "[{every: 1}]"], needs=["cache"],
         after=lambda t, s: None if not glob.glob(str(t / "ckpt/bad/step-*"))
         else pytest.fail(f"a checkpoint was committed: {os.listdir(t / 'ckpt/bad')}")),
    Case("seq-len-1", "training values", "`model.seq_len: 1` (no next token to predict)", 2,
         ["model.seq_len must be >= 2", "got 1"], args=["--model.seq_len", "1"]),
    Case("max-eval-batches-zero", "training values", "`trainer.max_eval_batches: 0` (evaluation skipped)", 2,
         ["trainer.max_eval_batches must be >= 1", "null", "got 0"], args=["--trainer.max_eval_batches", "0"]),
    Case("validation-smaller-than-batch", "training values", "a validation set shorter than one eval batch", 2,
         ["data.validation_urls", "fewer than one eval batch of 8", "trainer.per_device_eval_parallelism"],
         yaml=edit(BASE, "cache_dir: $SHARED/cache", "cache_dir: $TMP/cache\n  validation_urls: [\"$TMP/val.jsonl\"]"),
         setup=write_files({"val.jsonl": json.dumps({"text": "a short validation document. " * 5}) + "\n"})),
    Case("data-runs-out", "training values", "a single source with fewer sequences than the run's steps need", 2,
         ["data: the training data holds", "trainer.num_train_steps is 100000", "lower trainer.num_train_steps to",
          "stop_strategy restart"], args=["--trainer.num_train_steps", "100000"], needs=["cache"]),
    Case("epoch-runs-out", "training values", "`epoch: 2` of a source that two epochs do not cover", 2,
         ["epoch=2: the training data holds", "trainer.num_train_steps is 100000", "raise epoch to"],
         args=["--epoch", "2", "--trainer.num_train_steps", "100000"], needs=["cache"]),
    Case("epoch-negative", "training values", "`epoch: -1`", 2, ["epoch must be a whole number", "got -1"],
         yaml=BASE + "epoch: -1\n"),
    Case("epoch-with-mixture", "training values", "`epoch: 2` with a mixture (data.configs)", 2,
         ["epoch=2 applies to a single source", "data.stop_strategy"], yaml=MIX + "epoch: 2\n"),
    Case("model-averaging-beta", "training values", "`trainer.model_averaging: {type: ema, beta: 1.5}`", 2,
         ["trainer.model_averaging.beta must be a number in [0, 1)", "1.5"],
         yaml=edit(BASE, "  num_train_steps: 4", "  num_train_steps: 4\n  model_averaging: {type: ema, beta: 1.5}")),
    Case("model-averaging-unknown-type", "training values", "upstream's `model_averaging: {type: ema_decay_sqrt}`",
         2, ["trainer.model_averaging", "unknown type 'ema_decay_sqrt'", "known types: ema"],
         yaml=edit(BASE, "  num_train_steps: 4", "  num_train_steps: 4\n  model_averaging: {type: ema_decay_sqrt}")),
    Case("model-averaging-added-on-resume", "training values",
         "`trainer.model_averaging` set when resuming a checkpoint written without it", 2,
         ["trainer.model_averaging is set", "$TMP/ckpt/bad/step-2", "holds no averaged copy", "trainer.initialize_from"],
         yaml=edit(BASE, "  num_train_steps: 4", "  num_train_steps: 4\n  model_averaging: {type: ema, beta: 0.99}"),
         setup=resumable_checkpoint, needs=["checkpoint"]),
    Case("data-seed-too-big", "training values", "`data_seed: 2**70`", 2, ["data_seed", "[0, 2**32 - 1]",
         "1180591620717411303424"], args=["--data_seed", str(2**70)]),
    Case("trainer-seed-too-big", "training values", "`trainer.seed: 2**32` (the same key as seed 0)", 2,
         ["trainer.seed", "[0, 2**32 - 1]", "4294967296"], args=["--trainer.seed", str(2**32)]),
    Case("log-dir-unwritable", "training values", "a `log_dir` under a regular file", 2,
         ["trainer.log_dir", "$TMP/afile/logs/bad", "Not a directory"], args=["--trainer.log_dir", "$TMP/afile/logs"],
         setup=block_checkpoint_dir),
    Case("compilation-cache-dir-unwritable", "training values",
         "`trainer.jax_compilation_cache_dir` under a regular file", 2,
         ["trainer.jax_compilation_cache_dir=$TMP/afile/jax-cache", "Not a directory", "writable directory", "off"],
         args=["--trainer.jax_compilation_cache_dir", "$TMP/afile/jax-cache"], setup=block_checkpoint_dir),
    Case("compilation-cache-env-unwritable", "training values",
         "`JAX_COMPILATION_CACHE_DIR` naming a path under a regular file", 2,
         ["JAX_COMPILATION_CACHE_DIR=/dev/null/jax-cache", "Not a directory", "trainer.jax_compilation_cache_dir",
          "or to off"],
         patch=lambda mp: mp.setenv("JAX_COMPILATION_CACHE_DIR", "/dev/null/jax-cache")),
    Case("wandb-no-login", "training values", "`tracker: {type: wandb}` online, never logged in", 2,
         ["trainer.tracker", "wandb login", "WANDB_API_KEY", "WANDB_MODE=offline"], patch=no_wandb_login,
         yaml=edit(BASE, "tracker: {type: json}", "tracker: {type: wandb}")),
    Case("log-dir-full", "training values", "the disk holding `log_dir` fills up during the run", 74,
         ["out of disk space while logging metrics", "$TMP/logs/bad/metrics.jsonl"], patch=metrics_disk_full,
         needs=["cache"]),
    Case("batch-too-big", "training values", "`trainer.train_batch_size: 1000000000000`", 2,
         ["the model cannot fit", "a batch of 1000000000000 x 32", "trainer.train_batch_size"],
         args=["--trainer.train_batch_size", "1000000000000"]),
    Case("vocab-too-big", "training values", "`data.vocab_size: 1000000000` (hung at 0% CPU)", 2,
         ["the model cannot fit", "data.vocab_size=1,000,000,000", "GiB", "free"],
         args=["--data.vocab_size", "1000000000"]),
    Case("step-does-not-fit", "training values",
         "a compiled step larger than the device's memory (`LEVANTER_DEVICE_MEMORY=1KiB` simulates a small device)", 2,
         ["the train step needs", "a device has 1.00 KiB (LEVANTER_DEVICE_MEMORY=1KiB)",
          "trainer.per_device_parallelism: 1 ->", "model.gradient_checkpointing: true ->", "--dry_run"],
         args=["--trainer.train_batch_size", "32"],  # 4 sequences per device: the microbatch can shrink
         patch=lambda mp: mp.setenv("LEVANTER_DEVICE_MEMORY", "1KiB"), needs=["cache"],
         after=no_checkpoint_left),
    Case("device-out-of-memory", "training values",
         "the device runs out of memory compiling the step (XLA's `RESOURCE_EXHAUSTED`, as a TPU says it)", 2,
         ["the train step needs", "KiB per device but a device has 64.00 KiB", "RESOURCE_EXHAUSTED",
          "trainer.per_device_parallelism", "model.gradient_checkpointing: true", "model.cross_entropy_block_size",
          "model.attn_backend", "--dry_run"], patch=lambda mp: _compile_out_of_memory(mp),
         # On an accelerator that reports its memory the ahead-of-time check meets the refusal first and lists
         # the keys it measured (tests/memory/test_memory_fit.py covers that path).
         needs=["cache", "cpu"]),
    Case("per-device-parallelism-word", "training values", "`per_device_parallelism: max` (not a number or auto)", 2,
         ["trainer.per_device_parallelism", "'max'", "auto"], args=["--trainer.per_device_parallelism", "max"]),
    Case("profiler-window-negative", "training values", "`profiler: true` with `profiler_start_step: -1`", 2,
         ["trainer.profiler_start_step", "-1"],
         args=["--trainer.profiler", "true", "--trainer.profiler_start_step", "-1"]),
    Case("profiler-perfetto-link", "training values", "upstream's `profiler_perfetto_link: true`", 2,
         ["trainer.profiler_perfetto_link=True", "Perfetto", "docs/performance.md"],
         args=["--trainer.profiler_perfetto_link", "true"]),
    # ------------------------------------------------------------------------ config file and CLI (more)
    Case("config-not-utf8", "config file and CLI (more)", "a config file saved as Latin-1 (`# café` in a comment)", 2,
         ["$TMP/config.yaml, line 3", "not valid UTF-8", "byte 0xe9 at column 25"], yaml=None,
         setup=lambda t, s: _write(t / "config.yaml", _subst(
             edit(BASE, "tokenizer: byte", "tokenizer: byte  # caf\u00e9"), t, s, 0).encode("latin-1"))),
    Case("config-is-directory", "config file and CLI (more)", "`--config_path` names a directory", 2,
         ["$TMP", "is a directory, expected a YAML file"], yaml=None, config_path="$TMP"),
    Case("config-path-no-value", "config file and CLI (more)", "`--config_path` last on the line, with no value", 2,
         ["--config_path needs a file"], yaml=None, config_path=None, args=["--config_path"]),
    Case("cache-dataset-config-path-no-value", "config file and CLI (more)",
         "`cache_dataset --config_path` with no value", 2, ["--config_path needs a file"],
         entry="cache_dataset", yaml=None, config_path=None, args=["--config_path"]),
    Case("data-schedule-config-path-no-value", "config file and CLI (more)",
         "`data_schedule --config_path --steps 3` (the path forgotten)", 2, ["--config_path needs a file", "--steps"],
         entry="data_schedule", yaml=None, config_path=None, args=["--config_path", "--steps", "3"]),
    Case("override-bad-value", "config file and CLI (more)", "`--trainer.num_train_steps ten` on the command line", 2,
         ["command line: --trainer.num_train_steps ten", "'ten'", "an int"], args=["--trainer.num_train_steps", "ten"]),
    Case("cache-dataset-override-bad-value", "config file and CLI (more)", "`cache_dataset ... --data.shuffle maybe`",
         2, ["command line: --data.shuffle maybe", "'maybe'"], entry="cache_dataset", args=["--data.shuffle", "maybe"]),
    Case("duplicate-section", "config file and CLI (more)", "a second `optimizer:` block at the end of the file", 2,
         ["$TMP/config.yaml", "duplicate key `optimizer`", "lines 17 and 18"],
         yaml=BASE + "optimizer: {weight_decay: 0.1}\n"),
    Case("duplicate-nested-key", "config file and CLI (more)", "`num_train_steps` twice in `trainer:`", 2,
         ["$TMP/config.yaml", "duplicate key `trainer.num_train_steps`", "lines 8 and 10"],
         yaml=edit(BASE, "  train_batch_size: 8\n", "  train_batch_size: 8\n  num_train_steps: 40\n")),
    Case("data-key-typo", "config file and CLI (more)", "a typo in a `data` key (`tokeniser`)", 2,
         ["$TMP/config.yaml", "`data`", "unknown key `tokeniser`", "did you mean `tokenizer`?"],
         yaml=edit(BASE, "tokenizer: byte", "tokeniser: byte")),
    Case("mixture-key-typo", "config file and CLI (more)", "a typo in a mixture's key (`train_weight`)", 2,
         ["$TMP/config.yaml", "`data`", "unknown key `train_weight`", "did you mean `train_weights`?"],
         yaml=edit(MIX, "train_weights:", "train_weight:")),
    Case("mixture-source-key-typo", "config file and CLI (more)", "a typo in one mixture source (`train_url`)", 2,
         ["$TMP/config.yaml", "`data.configs.code`", "unknown key `train_url`", "did you mean `train_urls`?"],
         yaml=edit(MIX, 'code: {train_urls:', 'code: {train_url:')),
    Case("unknown-tracker-type", "config file and CLI (more)", "`tracker: {type: jsn}`", 2,
         ["$TMP/config.yaml", "`trainer.tracker`", "unknown type 'jsn'", "known types:", "did you mean 'json'?"],
         yaml=edit(BASE, "tracker: {type: json}", "tracker: {type: jsn}")),
    Case("model-without-type", "config file and CLI (more)", "a `model:` section without `type:`", 2,
         ["$TMP/config.yaml", "`model`", "no `type:`", "gpt2, llama"], yaml=edit(BASE, "model: {type: gpt2, ", "model: {")),
    Case("cache-dataset-duplicate-key", "config file and CLI (more)", "a data-only config naming `tokenizer` twice", 2,
         ["$TMP/config.yaml", "duplicate key `tokenizer`", "lines 2 and 4"], entry="cache_dataset",
         yaml='train_urls: ["embedded://python-docs/validation"]\ntokenizer: byte\ncache_dir: $TMP/cache\ntokenizer: gpt2\n'),
    Case("data-schedule-data-key-typo", "config file and CLI (more)", "`data_schedule` over a config with a `data` typo",
         2, ["$TMP/config.yaml", "`data`", "unknown key `shufle`", "did you mean `shuffle`?"], entry="data_schedule",
         yaml=edit(BASE, "shuffle: true", "shufle: true")),
    Case("dry-run-bad-device-memory", "config file and CLI (more)", "`--dry_run --device_memory 16XB`", 2,
         ["--device_memory", "'16XB'", "16GiB"], args=["--dry_run", "--device_memory", "16XB"]),
    Case("dry-run-unknown-vocab", "config file and CLI (more)",
         "`--dry_run` with a hub tokenizer that is not cached locally and no `--vocab_size`", 2,
         ["data.tokenizer", "'some-org/not-cached-tokenizer'", "--vocab_size"], args=["--dry_run"],
         yaml=edit(BASE, "tokenizer: byte", "tokenizer: some-org/not-cached-tokenizer")),
    Case("dry-run-batch-too-big", "config file and CLI (more)",
         "`--dry_run --trainer.train_batch_size 1000000000000` (kept the plan busy for minutes)", 3,
         ["the model cannot fit", "the tokens of a batch of 1,000,000,000,000 x 32",
          "16.00 GiB (--device_memory)", "trainer.train_batch_size"],
         args=["--dry_run", "--device_memory", "16GiB", "--trainer.train_batch_size", "1000000000000"]),
    Case("dry-run-model-too-big", "config file and CLI (more)",
         "`--dry_run --model.hidden_dim 1048576 --model.num_layers 10000` (kept the plan busy for minutes)",
         3,
         ["the model cannot fit", "parameters and gradients", "16.00 GiB (--device_memory)",
          "parameters: the tokenizer's vocabulary=257, model.hidden_dim, model.num_layers"],
         args=["--dry_run", "--device_memory", "16GiB", "--model.hidden_dim", "1048576", "--model.num_layers",
               "10000"]),
    Case("plan-flag-without-dry-run", "config file and CLI (more)", "`--vocab_size 50000` without `--dry_run`", 2,
         ["--vocab_size", "--dry_run"], args=["--vocab_size", "50000"]),
    Case("dry-run-unknown-slice", "config file and CLI (more)", "`--dry_run --slice v5e-7` (no such slice)", 2,
         ["--slice", "'v5e-7'", "v5e-{1,4,8,16,32,64,128,256} (chips)", "v4-{", "TensorCores, 2 per chip"],
         args=["--dry_run", "--slice", "v5e-7"]),
    Case("num-slices-without-slice", "config file and CLI (more)", "`--dry_run --num_slices 2` without `--slice`", 2,
         ["--num_slices", "--slice NAME"], args=["--dry_run", "--num_slices", "2"]),
    Case("dry-run-slice-without-libtpu", "config file and CLI (more)",
         "`--dry_run --slice v5e-8` where the TPU compiler (`libtpu`) is not installed", 2,
         ["--slice", "libtpu", "pip install -e '.[tpu]'", "libtpu==0.0.42.*"], args=["--dry_run", "--slice", "v5e-8"],
         patch=lambda mp: mp.setitem(sys.modules, "libtpu", None)),  # hides the installed wheel: import fails
]

# -- keys a command does not read, values argparse misreads, included files, value ranges ----------------
INCLUDED_MODEL = "type: gpt2\nhidden_dimm: 32\nnum_heads: 4\nnum_layers: 1\nseq_len: 32\n"
CLI_CASES = [
    Case("cache-dataset-unknown-flag", "command line", "`cache_dataset --no_such_flag 1` (was ignored, exit 0)", 2,
         ["command line: cache_dataset does not read --no_such_flag 1", "--data.KEY"], entry="cache_dataset",
         args=["--no_such_flag", "1"]),
    Case("cache-dataset-data-key-without-section", "command line",
         "`cache_dataset` over a train_lm config with data keys given without `data.` (were ignored)", 2,
         ["--cache_options.backend ray --tokenizer gpt2 --cache_dir $TMP/c",
          "did you mean --data.cache_options.backend, --data.tokenizer, --data.cache_dir?"], entry="cache_dataset",
         args=["--cache_options.backend", "ray", "--tokenizer", "gpt2", "--cache_dir", "$TMP/c"]),
    Case("cache-dataset-data-only-with-section", "command line",
         "`cache_dataset` over a data-only config with `--data.cache_dir`", 2,
         ["--data.cache_dir $TMP/c", "data-only config", "did you mean --cache_dir?"], entry="cache_dataset",
         yaml='train_urls: ["embedded://python-docs/validation"]\ntokenizer: byte\ncache_dir: $TMP/cache\n',
         args=["--data.cache_dir", "$TMP/c"]),
    Case("unknown-flag-nested-key", "command line", "`train_lm --save_interval 5m` (a key without its sections)", 2,
         ["unrecognized arguments: --save_interval 5m", "did you mean --trainer.checkpointer.save_interval?"],
         args=["--save_interval", "5m"]),
    Case("eval-lm-unknown-flag", "command line", "`eval_lm --max_eval_batches 3`", 2,
         ["--max_eval_batches 3", "did you mean --trainer.max_eval_batches?"], entry="eval_lm",
         args=["--max_eval_batches", "3"]),
    Case("export-unknown-flag", "command line", "`export_lm_to_hf --hidden_dim 32`", 2,
         ["--hidden_dim 32", "did you mean --model.hidden_dim?"], entry="export_lm_to_hf", yaml=None,
         config_path=None, args=["--checkpoint_path", "$TMP", "--hidden_dim", "32"]),
    Case("train-tokenizer-unknown-flag", "command line", "`train_tokenizer --vocab 1000`", 2,
         ["--vocab 1000", "did you mean --vocab_size?"], entry="train_tokenizer", yaml=None, config_path=None,
         args=["--vocab", "1000"]),
    Case("data-schedule-unknown-flag", "command line", "`data_schedule --cache_options.backend ray`", 2,
         ["--cache_options.backend ray", "did you mean --data.cache_options.backend?"], entry="data_schedule",
         args=["--cache_options.backend", "ray"]),
    Case("save-interval-negative", "command line", "`--trainer.checkpointer.save_interval -5s` (was \"expected one "
         "argument\")", 2, ["command line: --trainer.checkpointer.save_interval -5s", "must not be negative"],
         args=["--trainer.checkpointer.save_interval", "-5s"]),
    Case("save-interval-negative-equals", "command line", "`--trainer.checkpointer.save_interval=-5s`", 2,
         ["command line: --trainer.checkpointer.save_interval -5s", "must not be negative"],
         args=["--trainer.checkpointer.save_interval=-5s"]),
    Case("save-interval-negative-yaml", "command line", "`save_interval: -5s` in the file", 2,
         ["$TMP/config.yaml", "`trainer.checkpointer.save_interval`", "must not be negative", "'-5s'"],
         yaml=edit(BASE, "checkpointer: {", "checkpointer: {save_interval: -5s, ")),
    Case("brace-single-alternative", "command line", "`train_urls: [v{1}.jsonl]` (was reported as a missing v1.jsonl)",
         2, ["data.train_urls: file not found: '$TMP/v{1}.jsonl'"], yaml=files_data('["$TMP/v{1}.jsonl"]'),
         setup=write_files({"v2.jsonl": GOOD_JSONL})),
    Case("brace-expansion-missing", "command line", "`train_urls: [v{1,2}.jsonl]` without v1.jsonl", 2,
         ["file not found: '$TMP/v1.jsonl' (expanded from '$TMP/v{1,2}.jsonl')"], yaml=files_data('["$TMP/v{1,2}.jsonl"]'),
         setup=write_files({"v2.jsonl": GOOD_JSONL})),
    Case("include-typo", "command line", "a typo in a file the config `!include`s (was blamed on the config)", 2,
         ["$TMP/model.yaml, line 2 (included from $TMP/config.yaml)", "unknown key `hidden_dimm`",
          "did you mean `hidden_dim`?"], yaml=edit(BASE, REST.splitlines()[0], "model: !include model.yaml"),
         setup=write_files({"model.yaml": INCLUDED_MODEL})),
    Case("z-loss-huge", "command line", "`z_loss_weight: 1e30` (was an infinite gradient at step 0)", 2,
         ["z_loss_weight", "[0, 1]", "1e+30"], args=["--z_loss_weight", "1e30"]),
    Case("layer-norm-epsilon-negative", "command line", "`model.layer_norm_epsilon: -1` (was a NaN loss at step 0)",
         2, ["--model.layer_norm_epsilon -1", "model.layer_norm_epsilon", "(0, 1]", "-1.0"],
         args=["--model.layer_norm_epsilon", "-1"]),
    Case("layer-norm-epsilon-nan", "command line", "`layer_norm_epsilon: .nan` in a Llama config", 2,
         ["$TMP/config.yaml", "model.layer_norm_epsilon", "got nan"],
         yaml=edit(BASE, "type: gpt2, hidden_dim: 32", "type: llama, num_kv_heads: 4, layer_norm_epsilon: .nan, hidden_dim: 32")),
]
CASES += CLI_CASES

# -- supervised fine-tuning and chat data -----------------------------------------------------------------
SFT = """\
dataset_type: chat_jsonl
chat_train_urls: ["$TMP/chat.jsonl"]
supervised_data: {cache_dir: $TMP/cache}
tokenizer: byte
max_seq_len: 32
""" + REST
NO_GENERATION = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def chat_tokenizer_without_generation(tmp: Path, shared: Path) -> None:
    from chat_data import chat_tokenizer, write_chats

    chat_tokenizer(tmp / "tok", template=NO_GENERATION)
    write_chats(tmp / "chat.jsonl", 4)


SFT_CASES = [
    Case("sft-unknown-key", "fine-tuning and chat data", "a misspelt key in an SFT config (`reinit_tokenz`)", 2,
         ["unknown top-level key `reinit_tokenz`", "did you mean `reinit_tokens`?"], entry="sft",
         yaml=SFT + "reinit_tokenz: true\n"),
    Case("sft-huggingface-dataset", "fine-tuning and chat data", "`dataset_type: huggingface`", 2,
         ["dataset_type='huggingface' is not supported", "needs the network", "chat_train_urls"], entry="sft",
         yaml=SFT, args=["--dataset_type", "huggingface"]),
    Case("sft-output-role", "fine-tuning and chat data", "`output_role: gpt`", 2,
         ["output_role='gpt' is not supported", "user/assistant"], entry="sft", yaml=SFT,
         args=["--output_role", "gpt"]),
    Case("sft-epoch", "fine-tuning and chat data", "`epoch: 2`", 2,
         ["epoch=2 is not supported", "trainer.num_train_steps"], entry="sft", yaml=SFT, args=["--epoch", "2"]),
    Case("sft-reinit-token-missing", "fine-tuning and chat data", "`reinit_tokens` naming a token the tokenizer lacks",
         2, ["reinit_tokens: ['<|nope|>'] not in the vocabulary", "$TMP/tok"], entry="sft",
         yaml=edit(SFT, "tokenizer: byte", "tokenizer: $TMP/tok") + "reinit_tokens: ['<|nope|>']\n",
         setup=chat_tokenizer_without_generation),
    Case("sft-unknown-mixture-source", "fine-tuning and chat data", "`mixture_weights` naming no source", 2,
         ["mixture_weights.web: no such source", "['chat']"], entry="sft",
         yaml=edit(SFT, "chat_train_urls: [\"$TMP/chat.jsonl\"]\nsupervised_data: {cache_dir: $TMP/cache}",
                   "supervised_data: {chat: {train_urls: [\"$TMP/chat.jsonl\"]}}\nmixture_weights: {web: 1}")),
    Case("sft-no-chat-template", "fine-tuning and chat data", "chat data with a tokenizer that has no chat template",
         2, ["data.format: no chat template", "'byte'", "chat_template"], entry="sft", yaml=SFT),
    Case("chat-template-without-generation", "fine-tuning and chat data",
         "a chat template with no `{% generation %}` block", 2,
         ["data.format: the chat template has no {% generation %} block", "mask_user_turns: false"], entry="sft",
         yaml=edit(SFT, "tokenizer: byte", "tokenizer: $TMP/tok"), setup=chat_tokenizer_without_generation),
    Case("format-type-unknown", "fine-tuning and chat data", "`data.format.type: chatml`", 2,
         ["data.format.type: expected one of text, chat", "'chatml'"], args=["--data.format.type", "chatml"]),
]
CASES += SFT_CASES

# -- branching from a checkpoint, evaluation ------------------------------------------------------------
BRANCH_EVAL_CASES = [
    Case("initialize-from-missing", "branching and evaluation", "`initialize_from_checkpoint_path` that does not exist",
         2, ["initialize_from_checkpoint_path='$TMP/nowhere'", "does not exist"],
         args=["--initialize_from_checkpoint_path", "$TMP/nowhere"]),
    Case("initialize-from-no-checkpoint", "branching and evaluation",
         "`trainer.initialize_from` names a directory holding no complete checkpoint", 2,
         ["trainer.initialize_from='$TMP'", "holds no complete checkpoint"], args=["--trainer.initialize_from", "$TMP"]),
    Case("initialize-from-both", "branching and evaluation",
         "both `trainer.initialize_from` and `initialize_from_checkpoint_path`", 2,
         ["trainer.initialize_from and initialize_from_checkpoint_path are both set"],
         args=["--trainer.initialize_from", "$TMP", "--initialize_from_checkpoint_path", "$TMP"]),
    Case("initialize-from-shape-mismatch", "branching and evaluation",
         "a branch whose `model.hidden_dim` differs from the checkpoint's", 2,
         ["initialize_from_checkpoint_path='$SHARED/ckpt/bad/step-2'", "does not fit", "(257, 32)", "(257, 64)"],
         yaml=edit(BASE, "hidden_dim: 32", "hidden_dim: 64"),
         args=["--initialize_from_checkpoint_path", "$SHARED/ckpt/bad"], needs=["checkpoint"]),
    Case("tag-is-a-source-name", "branching and evaluation", "a source's `tags` naming another source", 2,
         ["data.configs.prose.tags", "'code'", "name of a source"],
         yaml=edit(MIX, 'prose: {train_urls: ["embedded://python-docs/validation"]}',
                   'prose: {train_urls: ["embedded://python-docs/validation"], tags: [code]}')),
    Case("eval-lm-no-checkpoint", "branching and evaluation", "`eval_lm` with neither `--checkpoint_path` nor "
         "`--hf_checkpoint`", 2, ["--checkpoint_path", "--hf_checkpoint"], entry="eval_lm"),
    Case("harness-task-named-twice", "branching and evaluation", "`eval_harness.task_spec` naming a task twice "
         "without a `task_alias`", 2, ["eval_harness.task_spec names 'levanter_mc' twice", "task_alias"],
         yaml=BASE + "eval_harness: {task_spec: [levanter_mc, {task: levanter_mc, num_fewshot: 1}]}\n"),
    Case("harness-eval-length-too-long", "branching and evaluation", "`eval_harness.max_eval_length` beyond a "
         "GPT-2's learned positions", 2, ["eval_harness.max_eval_length=64", "(32 positions)"],
         yaml=BASE + "eval_harness: {task_spec: [levanter_mc], max_eval_length: 64}\n"),
    Case("eval-harness-no-checkpoint", "branching and evaluation", "`eval_harness` with neither `--checkpoint_path` "
         "nor `--initialize_from_hf`", 2, ["--checkpoint_path", "--initialize_from_hf"], entry="eval_harness",
         yaml=BASE + "eval_harness: {task_spec: [levanter_mc]}\n"),
    Case("eval-lm-log-dir-unwritable", "branching and evaluation", "`eval_lm` with a `log_dir` under a regular file",
         2, ["trainer.log_dir", "$TMP/afile/logs/bad-eval", "Not a directory"], entry="eval_lm",
         args=["--checkpoint_path", "$SHARED/ckpt/bad", "--trainer.log_dir", "$TMP/afile/logs"],
         setup=block_checkpoint_dir, needs=["checkpoint"]),
]
CASES += BRANCH_EVAL_CASES

# -- Hugging Face import and export ---------------------------------------------------------------------
HF_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": 64, "vocab_size": 300}
HF_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}}


# A safetensors file holding no tensors: its 8-byte header length and an empty JSON header.
NO_TENSORS = (8).to_bytes(8, "little") + b"{}      "


def hf_dir(doc: dict, weights: str = "model.safetensors", content: bytes = NO_TENSORS) -> Callable[[Path, Path], None]:
    """A Hugging Face directory $TMP/hf: config.json ``doc`` and a weights file named ``weights`` holding
    ``content`` (by default a safetensors file of no tensors: the cases fail before the weights are read)."""
    return write_files({"hf/config.json": json.dumps(doc), f"hf/{weights}": content})


def _drop_model_record(step_dir: Path) -> None:
    """Make a checkpoint look written before checkpoints recorded their model block."""
    meta = step_dir / "metadata.json"
    doc = json.loads(meta.read_text())
    for key in ("model", "vocab_size", "tokenizer"):
        doc["metadata"].pop(key, None)
    meta.write_text(json.dumps(doc))


def _offline_hub(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as without network, however this machine is connected
    monkeypatch.setenv("HF_HUB_CACHE", os.path.join(os.sep, "nonexistent", "levanter-test-hub-cache"))


EXPORT_ARGS = ["--checkpoint_path", "$TMP/ckpt/bad"]
# An earlier export (its marker lists the files it wrote), and a file the user added to it since.
EARLIER_EXPORT = {"out/config.json": "{}", "out/model.safetensors": b"\0" * 16, "out/README.md": "my notes\n",
                  "out/.levanter-export.json": json.dumps({"format": "levanter-hf-export", "source": {},
                                                           "files": [".levanter-export.json", "config.json",
                                                                     "model.safetensors"]})}

HF_CASES = [
    Case("hf-init-true-without-reference", "hugging face", "`initialize_from_hf: true` with no checkpoint named", 2,
         ["initialize_from_hf: true", "give initialize_from_hf the checkpoint itself"], yaml=BASE + "initialize_from_hf: true\n"),
    Case("hf-init-missing-path", "hugging face", "`initialize_from_hf` names a directory that does not exist", 2,
         ["'$TMP/nope'", "does not exist"], yaml=BASE + "initialize_from_hf: $TMP/nope\n"),
    Case("hf-init-other-architecture", "hugging face", "a checkpoint of an architecture not implemented (t5)", 2,
         ["$TMP/hf/config.json", "model_type 't5'", "'qwen3'"], setup=hf_dir({**HF_LLAMA, "model_type": "t5"}),
         yaml=BASE + "initialize_from_hf: $TMP/hf\n"),
    Case("hf-init-sliding-window", "hugging face", "a Qwen2 checkpoint with sliding-window attention", 2,
         ["$TMP/hf/config.json", "'use_sliding_window'"],
         setup=hf_dir({**HF_LLAMA, "model_type": "qwen2", "rope_parameters": None, "use_sliding_window": True}),
         yaml=BASE + "initialize_from_hf: $TMP/hf\n"),
    Case("hf-init-mistral-layer-types", "hugging face", "a Mistral checkpoint whose `layer_types` alternate", 2,
         ["$TMP/hf/config.json", "'layer_types'", "sliding_window"],
         setup=hf_dir({**HF_LLAMA, "model_type": "mistral", "rope_parameters": None, "sliding_window": 4,
                       "layer_types": ["sliding_attention", "full_attention"]}),
         yaml=BASE + "initialize_from_hf: $TMP/hf\n"),
    Case("hf-init-rope-scaling", "hugging face", "a Llama checkpoint with a rope scaling not implemented (longrope)", 2,
         ["'rope_parameters'", "'longrope'"], setup=hf_dir(HF_LLAMA),
         yaml=edit(BASE, "type: gpt2, hidden_dim: 32", "type: llama, num_kv_heads: 4, hidden_dim: 32") + "initialize_from_hf: $TMP/hf\n"),
    Case("hf-init-bin-only", "hugging face", "a checkpoint with PyTorch `.bin` weights only", 2,
         ["$TMP/hf", "*.bin", "save_pretrained"], setup=hf_dir(HF_GPT2, "pytorch_model.bin"),
         yaml=BASE + "initialize_from_hf: $TMP/hf\n"),
    Case("hf-init-shape-disagrees", "hugging face", "`model.hidden_dim: 32` but the checkpoint's n_embd is 64", 2,
         ["model.hidden_dim=32", "64", "use_hf_model_config"], setup=hf_dir(HF_GPT2),
         yaml=BASE + "initialize_from_hf: $TMP/hf\n"),
    Case("hf-upload", "hugging face", "`hf_upload: org/name`", 2, ["hf_upload='org/name'", "hf_save_path"],
         yaml=BASE + "hf_upload: org/name\n"),
    Case("hf-save-path-unwritable", "hugging face", "`hf_save_path` under a file, so not a directory", 2,
         ["hf_save_path='$TMP/file/out'", "cannot write"], setup=write_files({"file": "x"}),
         yaml=BASE + "hf_save_path: $TMP/file/out\n"),
    Case("hf-save-dtype", "hugging face", "`hf_save_dtype: int8`", 2, ["hf_save_dtype 'int8'", "bfloat16"],
         yaml=BASE + "hf_save_path: $TMP/hf-out\nhf_save_dtype: int8\n"),
    Case("export-old-checkpoint", "hugging face", "`export_lm_to_hf` from a checkpoint that records no model block", 2,
         ["$TMP/ckpt/bad/step-2", "does not record its model", "--model.type"], entry="export_lm_to_hf",
         yaml=None, config_path=None, setup=lambda tmp, shared: _drop_model_record(copy_checkpoint(tmp, shared)),
         args=["--checkpoint_path", "$TMP/ckpt/bad/step-2", "--output_dir", "$TMP/out"], needs=["checkpoint"]),
    Case("export-no-checkpoint", "hugging face", "`export_lm_to_hf` from a directory with no checkpoint", 2,
         ["checkpoint_path='$TMP'", "no complete checkpoint"], entry="export_lm_to_hf", yaml=None, config_path=None,
         args=["--checkpoint_path", "$TMP", "--output_dir", "$TMP/out"]),
    Case("export-over-user-files", "hugging face", "`export_lm_to_hf --output_dir` a directory of the user's own files",
         2, ["output_dir='$TMP/mine'", "notes.txt", ".levanter-export.json", "new or empty directory"],
         entry="export_lm_to_hf", yaml=None, config_path=None, needs=["checkpoint"],
         setup=keeping(copy_checkpoint, write_files({"mine/notes.txt": "mine\n", "mine/data/a.bin": b"\1\2"})),
         args=EXPORT_ARGS + ["--output_dir", "$TMP/mine"], after=untouched),
    Case("export-over-checkpoints", "hugging face", "`export_lm_to_hf --output_dir` the run's own checkpoint directory",
         2, ["output_dir='$TMP/ckpt/bad'", "contains the checkpoint being exported", "$TMP/ckpt/bad/step-2"],
         entry="export_lm_to_hf", yaml=None, config_path=None, needs=["checkpoint"], setup=keeping(copy_checkpoint),
         args=EXPORT_ARGS + ["--output_dir", "$TMP/ckpt/bad"], after=untouched),
    Case("export-disk-full", "hugging face", "the disk fills up while `export_lm_to_hf` writes the weights", 74,
         ["out of disk space while writing an export at $TMP/out", "Nothing half-written is kept"],
         entry="export_lm_to_hf", yaml=None, config_path=None, needs=["checkpoint"], setup=copy_checkpoint,
         patch=export_disk_full, args=EXPORT_ARGS + ["--output_dir", "$TMP/out"], after=no_export_left),
    Case("hf-save-path-disk-full", "hugging face", "the disk fills up while a run exports to `hf_save_path`", 74,
         ["out of disk space while writing an export at $TMP/hf-out/bad/step-4", "Nothing half-written is kept"],
         yaml=BASE + "hf_save_path: $TMP/hf-out\n", patch=export_disk_full, after=export_on_rerun, needs=["cache"]),
    Case("export-to-working-dir", "hugging face", "`export_lm_to_hf --output_dir .`", 2,
         ["output_dir='.' is the working directory ($TMP)"], entry="export_lm_to_hf", yaml=None, config_path=None,
         needs=["checkpoint"], setup=keeping(copy_checkpoint, write_files({"notes.txt": "mine\n"})),
         args=EXPORT_ARGS + ["--output_dir", "."], after=untouched),
    Case("export-over-export-and-more", "hugging face", "`export_lm_to_hf` over an earlier export the user added a "
         "file to", 2, ["output_dir='$TMP/out'", "earlier export", "README.md"], entry="export_lm_to_hf", yaml=None,
         config_path=None, needs=["checkpoint"], setup=keeping(copy_checkpoint, write_files(EARLIER_EXPORT)),
         args=EXPORT_ARGS + ["--output_dir", "$TMP/out"], after=untouched),
    Case("hf-save-path-over-checkpoints", "hugging face", "`hf_save_path` equal to the checkpoint base path, so the "
         "exports would replace the run's checkpoints", 2,
         ["hf_save_path='$TMP/ckpt'", "'$TMP/ckpt/bad' is the run's checkpoint directory"], needs=["checkpoint"],
         yaml=BASE + "hf_save_path: $TMP/ckpt\n", setup=keeping(copy_checkpoint), after=untouched),
    Case("hf-save-path-over-user-files", "hugging face", "`hf_save_path` whose `<run id>/step-N` (a step the run "
         "exports) holds the user's files", 2,
         ["hf_save_path='$TMP/exports'", "'$TMP/exports/bad/step-4' is not empty", "notes.txt"],
         yaml=BASE + "hf_save_path: $TMP/exports\n", after=untouched,
         setup=keeping(write_files({"exports/bad/step-4/notes.txt": "mine\n", "exports/bad/mine.txt": "mine\n"}))),
]
CASES += HF_CASES

# -- runs that would train nothing, skip steps, or resume into other settings ----------------------------


def no_step_checkpoint(tmp: Path, shared: Path) -> None:
    """The run stopped before committing any checkpoint."""
    found = glob.glob(str(tmp / "ckpt/bad/step-*"))
    assert not found, f"a checkpoint was committed: {found}"


RUN_OUTCOME_CASES = [
    Case("update-vanishes-epsilon", "run outcomes", "`optimizer.epsilon: 1e18`: every update is ~0, nothing trains",
         2, ["the update at step 0", "too small to change float32 parameters", "optimizer.epsilon=1e+18"],
         args=["--optimizer.epsilon", "1e18", "--trainer.checkpointer.keep", "[{every: 1}]"], needs=["cache"],
         after=no_step_checkpoint),
    Case("learning-rate-zero", "run outcomes", "`optimizer.learning_rate: 0`: no update at all", 2,
         ["the update at step 0", "learning rate 0", "optimizer.learning_rate is 0"],
         args=["--optimizer.learning_rate", "0"], needs=["cache"], after=no_step_checkpoint),
    Case("learning-rate-diverges", "run outcomes", "`optimizer.learning_rate: 1e18`: step 0's update throws the "
         "weights out of range, step 1's loss is NaN", 1,
         ["train/loss is NaN at step 1", "The loss was the first value not finite", "Step 0's update was",
          "optimizer.learning_rate is far too large", "trainer.crash_on_nan: false would skip every later step"],
         args=["--optimizer.learning_rate", "1e18"], needs=["cache"]),
    Case("learning-rate-diverges-skipping", "run outcomes", "`learning_rate: 1e18` with `trainer.crash_on_nan: "
         "false`: every step after step 0 is skipped", 1,
         ["3 of the run's 4 steps were skipped", "the run did not train", "began at step 1",
          "optimizer.learning_rate is far too large"],
         args=["--optimizer.learning_rate", "1e18", "--trainer.crash_on_nan", "false", "--trainer.crash_on_inf",
               "false"], needs=["cache"]),
]


def checkpoint_recording_skip_window(tmp: Path, shared: Path) -> None:
    """The shared step-2 checkpoint, its metadata saying it was written with ``skip_bad_steps: 64``."""
    meta = copy_checkpoint(tmp, shared) / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["metadata"]["skip_bad_steps"] = {"rolling_interval_length": 64, "sigma_factor": 6.0}
    meta.write_text(json.dumps(doc))


RUN_OUTCOME_CASES += [
    Case("resume-skip-bad-steps-switched-on", "run outcomes", "resuming a run with `optimizer.skip_bad_steps` newly "
         "switched on", 2,
         ["$TMP/ckpt/bad/step-2 (step 2)", "optimizer.skip_bad_steps off", "this run has on (a window of 128 steps)",
          "set optimizer.skip_bad_steps: false", "initialize_from_checkpoint_path: $TMP/ckpt/bad/step-2"],
         args=["--optimizer.skip_bad_steps", "true"], setup=keeping(resumable_checkpoint), after=untouched,
         needs=["checkpoint"]),
    Case("resume-skip-bad-steps-window", "run outcomes", "resuming a `skip_bad_steps: 64` run with "
         "`skip_bad_steps: 32`", 2,
         ["optimizer.skip_bad_steps on (a window of 64 steps)", "on (a window of 32 steps)", "another length",
          "set optimizer.skip_bad_steps: 64"],
         args=["--optimizer.skip_bad_steps", "32"], setup=checkpoint_recording_skip_window, needs=["checkpoint"]),
    Case("eval-lm-without-config", "run outcomes", "`eval_lm --checkpoint_path` with no `--config_path` (so no "
         "validation data)", 2,
         ["no validation data to evaluate on", "no --config_path was given",
          "the model and tokenizer come from the checkpoint's metadata.json", "--config_path config/gpt2_nano.yaml",
          "--data.validation_urls"],
         entry="eval_lm", yaml=None, config_path=None, args=["--checkpoint_path", "$SHARED/ckpt/bad"],
         needs=["checkpoint"]),
]
CASES += RUN_OUTCOME_CASES
# -- messages that name the key: data, checkpoints and chat files ------------------------------------------
def chats_under_conversations(tmp: Path, shared: Path) -> None:
    """A chat tokenizer, and chat JSON lines whose conversations sit under ``conversations``."""
    import random

    from chat_data import chat_tokenizer, conversation

    chat_tokenizer(tmp / "tok")
    rng = random.Random(0)
    _write(tmp / "chat.jsonl", "".join(json.dumps({"conversations": conversation(rng)}) + "\n" for _ in range(4)))


KEYED_CASES = [
    Case("hf-init-empty-weights", "hugging face", "`initialize_from_hf` names a checkpoint whose "
         "`model.safetensors` is empty (a download that did not finish)", 2,
         ["initialize_from_hf='$TMP/hf'", "$TMP/hf/model.safetensors is empty (0 bytes)", "download or export"],
         setup=hf_dir(HF_GPT2, content=b""),
         yaml=edit(BASE, "hidden_dim: 32", "hidden_dim: 64") + "initialize_from_hf: $TMP/hf\n"),
    Case("sft-messages-field-missing", "fine-tuning and chat data", "an SFT chat file whose conversations sit under "
         "`conversations` (`messages_field` is `messages`)", 2,
         ["$TMP/chat.jsonl, line 1", "no key 'messages' (messages_field)", "['conversations']",
          "messages_field: conversations"], entry="sft", yaml=edit(SFT, "tokenizer: byte", "tokenizer: $TMP/tok"),
         setup=chats_under_conversations),
]
CASES += KEYED_CASES

MIN_CASES = 30


# -- running a case -------------------------------------------------------------------------------------
def _subst(s: str, tmp: Path, shared: Path, port: int) -> str:
    return s.replace("$TMP", str(tmp)).replace("$SHARED", str(shared)).replace("$PORT", str(port))


ENTRIES = {"train_lm": train_lm.cli, "cache_dataset": cache_dataset.cli, "data_schedule": data_schedule.cli,
           "export_lm_to_hf": export_lm_to_hf.cli}
ENTRIES["eval_lm"] = eval_lm.cli
ENTRIES["eval_harness"] = eval_harness.cli
ENTRIES["train_tokenizer"] = train_tokenizer.cli
ENTRIES["sft"] = sft.cli


def run_case(case: Case, tmp: Path, shared: Path, capsys, monkeypatch) -> tuple[int, str]:
    port = free_port() if "sockets" in case.needs else 0
    sub = lambda s: _subst(s, tmp, shared, port)  # noqa: E731
    if case.yaml is not None:
        _write(tmp / "config.yaml", sub(case.yaml))
    if case.setup is not None:
        case.setup(tmp, shared)
    if case.patch is not None:
        case.patch(monkeypatch)
    argv = [] if case.config_path is None else ["--config_path", sub(case.config_path)]
    argv += [sub(a) for a in case.args]
    monkeypatch.chdir(tmp)  # anything written to a relative path lands in the case's directory
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ENTRIES[case.entry](argv)
    if case.needs:
        time.sleep(0.1)  # a background thread's late traceback (e.g. from an I/O callback) lands in stderr
    return exc.value.code, capsys.readouterr().err


def error_message(stderr: str) -> str:
    """The ``error: ...`` paragraph at the end of stderr (progress bars may precede it)."""
    starts = [m.start() for m in re.finditer(r"(?m)^error: ", stderr)]
    assert len(starts) == 1, f"expected exactly one 'error:' line in stderr:\n{stderr}"
    return stderr[starts[0]:].rstrip("\n")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The module's directory for artefacts several cases need (made lazily by :func:`ensure`).

    The cases that get as far as compiling (checkpoint restores, the NaN and disk-full runs) compile the
    same functions for the same shapes; a persistent compilation cache, on for this module only, turns
    all but the first of each into a cache hit.
    """
    import jax

    d = tmp_path_factory.mktemp("bad-inputs-shared")
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    _reset_compilation_cache()
    jax.config.update("jax_compilation_cache_dir", str(d / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:
        yield d
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)
        _reset_compilation_cache()
        _made.clear()


def _reset_compilation_cache() -> None:
    try:  # private API: lets the cache directory change after the first compile of the session
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass


_made: set = set()


def ensure(what: str, shared: Path) -> None:
    if what in _made:
        return
    if what == "cache":
        cfg = shared / "cache.yaml"
        _write(cfg, _subst(BASE, shared / "cache-run", shared, 0))
        cache_dataset.main(cache_dataset.load_data_config(str(cfg)))
    elif what == "checkpoint":
        ensure("cache", shared)
        from levanter.config import parse_config

        # The base config as the cases write it (same paths relative to the case's directory), so that its
        # compiled functions are the ones the cases will ask for.
        _write(shared / "run.yaml", _subst(BASE, shared, shared, 0))
        cfg = parse_config(train_lm.TrainLmConfig, str(shared / "run.yaml"), ["--trainer.num_train_steps", "2"])
        assert train_lm.main(cfg)["final_step"] == 2
        assert (shared / "ckpt" / "bad" / "step-2" / "metadata.json").is_file()
    _made.add(what)


# An exception in a background thread or a callback (e.g. an I/O completion after the event loop closed)
# prints a traceback under the message in a real run; under pytest it surfaces as one of these warnings.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, shared, capsys, monkeypatch, request):
    for what in case.needs:
        if what in ("s3_server", "gcs_server"):
            request.getfixturevalue(what)  # started once per session; its environment is set while it runs
        elif what == "sockets":
            require_sockets()
        elif what == "8 devices":
            require_devices(8)
        elif what == "cpu":
            import jax

            if jax.default_backend() != "cpu":
                pytest.skip(f"a case of the CPU's path; this backend is {jax.default_backend()}")
        else:
            ensure(what, shared)
    status, stderr = run_case(case, tmp_path, shared, capsys, monkeypatch)
    assert "Traceback (most recent call last)" not in stderr, stderr
    message = error_message(stderr)
    lines = message.splitlines()
    assert len(lines) <= 6 and all(line.strip() for line in lines), f"not one short paragraph:\n{message}"
    for fragment in case.fragments:
        fragment = _subst(fragment, tmp_path, shared, 0)
        assert fragment in message, f"{fragment!r} not in the message:\n{message}"
    assert status == case.status, f"exit status {status}, expected {case.status}:\n{message}"
    if case.after is not None:
        case.after(tmp_path, shared)


def test_catalogue_is_big_enough_and_documented():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(CASES) >= MIN_CASES
    doc = DOC.read_text()
    undocumented = [i for i in ids if f"`{i}`" not in doc]
    assert not undocumented, f"cases missing from {DOC.relative_to(REPO)}: {undocumented}"
