"""Nothing a user owns is deleted by an export or by a run that reuses a run id.

* ``export_lm_to_hf`` and ``save_hf_checkpoint`` replace only an empty directory or exactly an earlier export
  (the marker ``.levanter-export.json`` and the files it lists), locally and on an object store
  (``memory://`` takes the object-store path of :mod:`levanter.utils.fs`).
* A run without ``trainer.id`` prints its generated id with the command that resumes it, and that command
  resumes it.
* A log directory written before it recorded its checkpoints (``checkpoints.json``) is recognised from the
  ``config.json`` the JSON tracker stored, and a run with other checkpoints is refused there too.

The refusals themselves, with their messages and byte-for-byte checks, are cases of
``tests/main/test_bad_inputs.py`` (``export-*``, ``hf-save-path-over-*``, ``log-dir-of-other-checkpoints``).
"""

from __future__ import annotations

import json
import uuid

import jax
import pytest

import haliax as hax

from helpers import tree_bytes
from levanter.compat import save_hf_checkpoint
from levanter.compat.export_guard import MARKER, ExportTargetError
from levanter.main import export_lm_to_hf, train_lm
from levanter.models import Gpt2Config
from levanter.utils import fs

CONFIG = Gpt2Config(seq_len=16, hidden_dim=16, num_heads=2, num_layers=1, gradient_checkpointing=False,
                    scan_layers=False)


@pytest.fixture(scope="module")
def model():
    return CONFIG.build(hax.Axis("vocab", 257), key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    """A train_lm-style checkpoint of a tiny GPT-2 (the model under ``model/``, its record in metadata.json)."""
    import draccus

    from levanter.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("export-guard") / "ckpt" / "run" / "step-3"
    record = {"model": {"type": "gpt2", **draccus.encode(CONFIG)}, "vocab_size": 257, "tokenizer": "byte"}
    save_checkpoint({"model": model}, 3, str(path), metadata=record)
    return path


def test_an_earlier_export_is_replaced_and_carries_its_marker(checkpoint, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is fine
    export_lm_to_hf.cli(["--checkpoint_path", str(checkpoint), "--output_dir", str(out)])
    marker = json.loads((out / MARKER).read_text())
    # The byte tokenizer's Hugging Face form comes with the weights (tests/compat/test_hf_tokenizer_export.py).
    assert sorted(p.name for p in out.iterdir()) == marker["files"] == [
        MARKER, "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert marker["source"]["checkpoint"] == str(checkpoint) and marker["source"]["step"] == 3
    first = tree_bytes(out)
    # Exactly an earlier export: replaced, by the same bytes (the export of the same checkpoint).
    export_lm_to_hf.cli(["--checkpoint_path", str(checkpoint.parent), "--output_dir", str(out)])
    assert tree_bytes(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left beside it


def test_a_file_where_the_directory_should_be_is_refused(model, tmp_path):
    target = tmp_path / "weights"
    target.write_bytes(b"mine")
    with pytest.raises(ExportTargetError, match="is a file"):
        save_hf_checkpoint(model, CONFIG, str(target))
    assert target.read_bytes() == b"mine"


def _objects(url: str) -> dict:
    return {name: fs.read_bytes(fs.join(url, name)) for name in fs.listdir(url)}


def test_an_object_store_prefix_is_replaced_only_when_it_holds_an_earlier_export(model):
    root = f"memory://export-guard-{uuid.uuid4().hex[:8]}"
    try:
        mine = fs.join(root, "mine")
        fs.atomic_write_bytes(fs.join(mine, "notes.txt"), b"my notes")
        fs.atomic_write_bytes(fs.join(mine, "config.json"), b"{}")
        with pytest.raises(ExportTargetError, match="notes.txt") as e:
            save_hf_checkpoint(model, CONFIG, mine)
        assert MARKER in str(e.value)
        assert _objects(mine) == {"config.json": b"{}", "notes.txt": b"my notes"}  # nothing deleted first

        out = fs.join(root, "hf")
        save_hf_checkpoint(model, CONFIG, out, max_shard_size=4_000)  # sharded: index and several files
        listed = json.loads(fs.read_bytes(fs.join(out, MARKER)))["files"]
        assert sorted(fs.listdir(out)) == listed and "model.safetensors.index.json" in listed
        save_hf_checkpoint(model, CONFIG, out)  # over an earlier export: its shards are replaced
        assert fs.listdir(out) == [MARKER, "config.json", "model.safetensors"]

        fs.atomic_write_bytes(fs.join(out, "README.md"), b"about this model")
        before = _objects(out)
        with pytest.raises(ExportTargetError, match="README.md"):
            save_hf_checkpoint(model, CONFIG, out)
        assert _objects(out) == before
    finally:
        fs.remove_tree(root)


RUN = """\
data: {train_urls: ["embedded://python-docs/validation"], tokenizer: byte, cache_dir: $TMP/cache}
model: {type: gpt2, hidden_dim: 16, num_heads: 2, num_layers: 1, seq_len: 16, gradient_checkpointing: false}
trainer:
  num_train_steps: 1
  train_batch_size: 8
  steps_per_eval: 100
  require_accelerator: false
  log_dir: $TMP/logs
  tracker: {type: json}
  checkpointer: {base_path: $TMP/ckpt}
optimizer: {learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0}
"""


def test_a_generated_run_id_is_printed_with_the_command_that_resumes_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(RUN.replace("$TMP", str(tmp_path)))
    argv = ["--config_path", str(tmp_path / "run.yaml")]
    train_lm.cli(argv)
    out = capsys.readouterr().out
    (run_id,) = [p.name for p in (tmp_path / "ckpt").iterdir()]  # the id the run generated for itself
    assert f"run id: {run_id} " in out and f"rerun with --trainer.id {run_id} to resume" in out

    train_lm.cli(argv + ["--trainer.id", run_id])  # the printed command finds the run
    assert f"run {run_id} already reached step 1" in capsys.readouterr().out

    # A log directory from before checkpoints.json existed: its config.json still says whose it is.
    logs = tmp_path / "logs" / run_id
    (logs / "checkpoints.json").unlink()
    before = tree_bytes(tmp_path)
    with pytest.raises(SystemExit) as e:
        train_lm.cli(argv + ["--trainer.id", run_id, "--trainer.checkpointer.base_path", str(tmp_path / "other")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"trainer.id={run_id}" in err and str(tmp_path / "ckpt" / run_id) in err and "new trainer.id" in err
    now = tree_bytes(tmp_path)
    assert all(now.get(p) == b for p, b in before.items()), "a file was deleted or changed"
