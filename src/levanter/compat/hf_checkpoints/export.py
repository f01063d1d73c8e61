"""Writing a Hugging Face checkpoint directory, and the exporter ``train_lm``'s ``hf_save_path`` uses.

:func:`save_hf_checkpoint` writes ``config.json``, the weights (one file, or shards of at most
``max_shard_size`` bytes plus the index) and, for a Hugging Face tokenizer, its files, so that
``transformers.AutoModelForCausalLM.from_pretrained`` loads the directory.

Writes are all or nothing. Locally the directory is assembled under a ``.tmp-`` name beside the target and
renamed into place. On an object store, which has no rename, a stale ``config.json`` is deleted first and
written last: ``transformers`` cannot load a directory without it, so an interrupted export never looks
complete. Only an earlier export is ever replaced: each export writes a marker listing its files, and a
directory holding anything else is refused before any work (:mod:`levanter.compat.export_guard`). The
whole export is assembled in host memory before the first write (simple and all-or-nothing; a model larger
than host memory cannot be exported this way).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from typing import Callable, Optional

import numpy as np

from levanter.models import LmConfig
from levanter.utils import fs

from .families import family_name, lm_to_hf_config
from .hub import could_be_hub_id, resolve_hf_checkpoint
from .safetensors_io import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    HF_SAVE_DTYPES,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    TOKENIZER_FILES,
    dtype_table,
    safetensors_bytes,
)
from .weights import to_state_dict

__all__ = ["save_hf_checkpoint", "HfExporter", "ExportingCheckpointer", "byte_tokenizer_files", "tokenizer_files",
           "write_export"]

logger = logging.getLogger(__name__)


BYTE_EOS_TEXT = "<|endoftext|>"  # the byte tokenizer's end of sequence, id 256 (levanter.ingest.ByteTokenizer)


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level pre-tokenizer's map of each byte to a printable character (GPT-2's convention: the
    printable Latin-1 bytes stand for themselves, the other 68 for the characters from U+0100 on, in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer_files() -> dict[str, bytes]:
    """A Hugging Face tokenizer whose ids are levanter's ``byte`` tokenizer's: each UTF-8 byte its own value
    (0..255), ``<|endoftext|>`` 256 (the EOS). A byte-level BPE with no merges over the 256 byte characters, so
    ``transformers.AutoTokenizer`` encodes any text to its bytes and decodes ids back to the text; the EOS is
    a special token, named in tokenizer_config.json (and so config.json's ``eos_token_id``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS_TEXT])
    if tok.token_to_id(BYTE_EOS_TEXT) != 256:  # the ids must be the byte tokenizer's
        raise AssertionError(f"the byte tokenizer's EOS got id {tok.token_to_id(BYTE_EOS_TEXT)}, not 256")
    # split_special_tokens: the text "<|endoftext|>" in a document is its 13 bytes, as levanter's tokenizer reads
    # it; the EOS id is what a tokenizer appends, not what a document spells.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BYTE_EOS_TEXT, "bos_token": None,
              "unk_token": None, "pad_token": None, "clean_up_tokenization_spaces": False,
              "split_special_tokens": True}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def tokenizer_files(tokenizer: Optional[str]) -> dict[str, bytes]:
    """The files of a Hugging Face tokenizer (a local directory or tokenizer.json, or a hub id); for
    levanter's own ``byte`` tokenizer, a Hugging Face tokenizer with the same ids (:func:`byte_tokenizer_files`);
    nothing for ``passthrough`` (ids with no text; the export says so)."""
    if tokenizer == "byte":
        return byte_tokenizer_files()
    if tokenizer == "passthrough":
        logger.warning("data.tokenizer is passthrough (token ids with no text form): the export has no tokenizer; "
                       "give transformers the tokenizer that made the ids")
        return {}
    if tokenizer is None:
        return {}
    local = os.path.expanduser(tokenizer)
    if os.path.isfile(local):
        local = os.path.dirname(os.path.abspath(local)) if os.path.basename(local) == "tokenizer.json" else local
    if os.path.isdir(local):
        root = local
    else:
        root = resolve_hf_checkpoint(tokenizer, what="tokenizer") if could_be_hub_id(tokenizer) else None
        if root is None:
            raise ValueError(f"tokenizer {tokenizer!r} is neither a local directory nor a hub id")
    out = {}
    for name in TOKENIZER_FILES:
        path = fs.join(root, name)
        if fs.exists(path):
            out[name] = fs.read_bytes(path)
    if "tokenizer.json" not in out:
        raise ValueError(f"tokenizer {tokenizer!r} has no tokenizer.json to save with the model")
    cfg = json.loads(out.get("tokenizer_config.json", b"{}") or b"{}")
    if "tokenizer_class" not in cfg:  # transformers' AutoTokenizer needs to know which class reads tokenizer.json
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        out["tokenizer_config.json"] = json.dumps(cfg, indent=2).encode()
    return out


def _special_token_ids(tok_files: dict[str, bytes], vocab_size: int) -> dict:
    """``bos_token_id`` / ``eos_token_id`` for config.json: the tokenizer's (named in tokenizer_config.json and
    found among tokenizer.json's added tokens), else null -- never transformers' class defaults (GPT-2's 50256),
    which may lie outside a smaller vocabulary."""
    out: dict[str, Optional[int]] = {"bos_token_id": None, "eos_token_id": None}
    if "tokenizer.json" not in tok_files:
        return out
    try:
        added = {t["content"]: t["id"] for t in json.loads(tok_files["tokenizer.json"]).get("added_tokens", [])}
        cfg = json.loads(tok_files.get("tokenizer_config.json", b"{}") or b"{}")
    except (ValueError, KeyError, TypeError):
        return out
    for key in ("bos", "eos"):
        value = cfg.get(f"{key}_token")
        content = value.get("content") if isinstance(value, dict) else value
        tid = added.get(content) if isinstance(content, str) else None
        if isinstance(tid, int) and 0 <= tid < vocab_size:
            out[f"{key}_token_id"] = tid
    return out


def _shards(tensors: dict[str, np.ndarray], max_shard_size: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    return shards


def save_hf_checkpoint(model, config: LmConfig, output_dir: str, *, tokenizer: str | None = None,
                       dtype: str | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                       source: Optional[dict] = None, label: Optional[str] = None) -> str:
    """Write ``model`` as a Hugging Face checkpoint directory ``output_dir`` (local path or URL); returns it.

    ``tokenizer``: the run's ``data.tokenizer`` (its files are copied for a Hugging Face tokenizer).
    ``dtype``: one of :data:`HF_SAVE_DTYPES` (default: the parameters' own). Above ``max_shard_size`` bytes
    the weights are split into ``model-0000k-of-0000n.safetensors`` files with an index. Only process 0
    writes; every process must call it (arrays sharded over several hosts are gathered). ``output_dir`` must be
    new, empty or exactly an earlier export (:mod:`levanter.compat.export_guard`; ``label`` names it in the
    error); the export's marker records ``source``, what was exported.
    """
    import jax

    from levanter.compat.export_guard import MARKER, check_replaceable, marker_bytes

    if dtype is not None and dtype not in HF_SAVE_DTYPES:
        raise ValueError(f"hf_save_dtype {dtype!r} is not one of {sorted(HF_SAVE_DTYPES)}")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    if family_name(model.config) != family_name(config):
        raise ValueError(f"the model is a {family_name(model.config)}, but the config is a {family_name(config)}")
    if jax.process_index() == 0:
        check_replaceable(output_dir, label)
    doc = lm_to_hf_config(config, model.Vocab.size)
    tok_files = tokenizer_files(tokenizer)
    state = to_state_dict(model)
    if jax.process_index() != 0:
        return output_dir
    table = {v: k for k, v in dtype_table().items()}
    if dtype is not None:
        target = dtype_table()[HF_SAVE_DTYPES[dtype]]
        state = {k: v.astype(target) for k, v in state.items()}
    names = {k: table[v.dtype] for k, v in state.items()}
    doc["torch_dtype"] = doc["dtype"] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(
        next(iter(names.values())), "float32")
    doc["transformers_version"] = _transformers_version()

    files: dict[str, bytes] = {}
    shards = _shards(state, max_shard_size)
    if len(shards) == 1:
        files[SAFE_WEIGHTS] = safetensors_bytes(state, names)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            files[file] = safetensors_bytes({n: state[n] for n in shard}, names)
            weight_map.update({n: file for n in shard})
        total = sum(v.nbytes for v in state.values())
        files[SAFE_INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
    files.update(tok_files)
    doc.update(_special_token_ids(tok_files, model.Vocab.size))
    files[CONFIG_FILE] = json.dumps(doc, indent=2, sort_keys=True).encode()  # last: the commit record
    # The marker first: on an object store every file present from then on is one it lists.
    files = {MARKER: marker_bytes(files, source), **files}
    write_export(output_dir, files)
    return output_dir


def _transformers_version() -> str:
    """The installed transformers' version, recorded in config.json (without importing transformers)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "4.0.0"


def write_export(output_dir: str, files: dict[str, bytes], commit_file: str = CONFIG_FILE) -> None:
    """Write ``files`` into ``output_dir`` all or nothing: locally a ``.tmp-`` directory renamed into place; on an
    object store ``commit_file`` (the file a reader needs first: ``config.json``, a PEFT adapter's
    ``adapter_config.json``) deleted first and written last. The caller has checked that ``output_dir`` may be
    replaced (:func:`levanter.compat.export_guard.check_replaceable`). A full disk is an
    :class:`~levanter.errors.OutOfSpaceError` naming ``output_dir`` (the commands' exit status 74)."""
    from levanter.errors import is_out_of_space, out_of_space_error

    try:
        _write_export(output_dir, files, commit_file)
    except OSError as e:
        if not is_out_of_space(e):
            raise
        raise out_of_space_error("writing an export", fs.abspath(output_dir)) from None


def _write_export(output_dir: str, files: dict[str, bytes], commit_file: str) -> None:
    if fs.supports_rename(output_dir):
        final = fs.abspath(output_dir)
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".tmp-{os.path.basename(final)}-{secrets.token_hex(4)}")
        os.makedirs(tmp)
        try:
            for name, data in files.items():
                fs.atomic_write_bytes(os.path.join(tmp, name), data)
            old = None
            if os.path.exists(final):
                old = os.path.join(parent, f".tmp-{os.path.basename(final)}-old-{secrets.token_hex(4)}")
                os.rename(final, old)
            os.rename(tmp, final)
            fs.fsync_dir(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    # Object store: no rename. Take away the old commit record first, write everything, the record last.
    url = fs.abspath(output_dir)
    fs.remove(fs.join(url, commit_file))
    try:
        stale = set(fs.listdir(url)) - set(files)
    except FileNotFoundError:
        stale = set()
    for name in sorted(stale):
        fs.remove(fs.join(url, name))  # the guard let only an earlier export's files be here
    for name, data in files.items():
        if name != commit_file:
            fs.atomic_write_bytes(fs.join(url, name), data)
    fs.atomic_write_bytes(fs.join(url, commit_file), files[commit_file])


# ------------------------------------------------------------------------------------------------
# Exports during training
# ------------------------------------------------------------------------------------------------


class StepExporter:
    """Exports a training run's model to ``<base_path>/step-<N>`` every ``every`` steps and at ``last_step``;
    subclasses say how (:meth:`write`). :meth:`wrap` puts it behind a checkpointer, whose
    ``on_step(state, step, force)`` the trainer calls after every step with the state after it."""

    what = "the model"  # in the log line of each export

    def __init__(self, base_path: str, *, every: int, last_step: int, key: str):
        self.base_path, self.every, self.last_step, self.key = base_path, every, last_step, key
        self.exported: list[str] = []

    def due(self, step: int) -> bool:
        """Whether :meth:`on_step` exports the model after ``step`` updates."""
        return step > 0 and (step % self.every == 0 or step == self.last_step)

    def write(self, model, path: str, step: int) -> None:
        raise NotImplementedError

    def on_step(self, model, step: int) -> None:
        path = fs.join(self.base_path, f"step-{step}")
        # A step already exported is not written again (a SIGTERM's forced save calls again for the same step).
        if not self.due(step) or path in self.exported:
            return
        self.write(model, path, step)
        self.exported.append(path)
        logger.info("exported %s of step %d to %s", self.what, step, path)

    def wrap(self, checkpointer) -> "ExportingCheckpointer":
        return ExportingCheckpointer(checkpointer, self)


class HfExporter(StepExporter):
    """A :class:`StepExporter` writing the model in Hugging Face format (upstream's layout for
    ``hf_save_path``)."""

    what = "the model (Hugging Face format)"

    def __init__(self, base_path: str, *, every: int, last_step: int, config: LmConfig,
                 tokenizer: Optional[str] = None, dtype: Optional[str] = None,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, prepare: Optional[Callable] = None,
                 key: str = "hf_save_path", exported_by: str = "train_lm"):
        super().__init__(base_path, every=every, last_step=last_step, key=key)
        self.config, self.tokenizer, self.dtype, self.max_shard_size = config, tokenizer, dtype, max_shard_size
        # prepare(model): the model to export (a LoRA run's adapters merged into the weights); key names the
        # config key in errors, exported_by the entry point in the export's marker.
        self.prepare, self.exported_by = prepare, exported_by

    def write(self, model, path: str, step: int) -> None:
        if self.prepare is not None:
            model = self.prepare(model)
        save_hf_checkpoint(model, self.config, path, tokenizer=self.tokenizer, dtype=self.dtype,
                           max_shard_size=self.max_shard_size, source={"exported_by": self.exported_by, "step": step},
                           label=f"{self.key}: the export directory {path!r}")


class ExportingCheckpointer:
    """A checkpointer that also hands each step's model to an exporter (anything with ``due(step)`` and
    ``on_step(model, step)``: :class:`HfExporter`, the PEFT adapters' exporter); everything else is the
    wrapped checkpointer's. The model exported is the state's ``eval_model``: with
    ``trainer.model_averaging``, the averaged weights (as upstream exports them)."""

    def __init__(self, inner, exporter):
        self._inner, self._exporter = inner, exporter

    def save_due(self, step: int, *, force: bool = False) -> bool:
        # Both asked: the inner checkpointer decides (and keeps) its time-based answer here.
        inner = self._inner.save_due(step, force=force)
        return self._exporter.due(step) or inner

    def on_step(self, state, step: int, force: bool = False):
        # The export first: one that fails (a full disk) stops the run before a checkpoint of this step exists,
        # so the rerun resumes from an earlier step and writes this export when it gets here again. A checkpoint
        # written first would make the rerun start after this step (or, at the last step, find nothing to
        # train), and the export would never be written.
        if self._exporter.due(step):
            self._exporter.on_step(state.eval_model, step)
        return self._inner.on_step(state, step, force=force)

    def __getattr__(self, name):
        return getattr(self._inner, name)
