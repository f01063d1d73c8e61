"""Export a ``train_lm`` checkpoint as a Hugging Face directory:
``python -m levanter.main.export_lm_to_hf --checkpoint_path checkpoints/RUN/step-N --output_dir hf/RUN``.

The checkpoint's ``metadata.json`` records the model block, the vocabulary size and ``data.tokenizer`` of the
run that wrote it (:func:`levanter.run.records.model_record`), so the checkpoint alone is enough. Checkpoints
written before that record existed need their run's model block and tokenizer on the command line
(``--model.type gpt2 --model.hidden_dim ... --tokenizer ...``) or in a YAML file given by ``--config_path``
(``model:`` and ``tokenizer:`` at its top level); the vocabulary size then comes from the checkpoint's
embedding. Explicit keys win over the record.

Only the model's weights are read (``load_checkpoint(..., subpath="model")``): the optimizer state stays on
disk. The output is written all or nothing by :func:`levanter.compat.save_hf_checkpoint` (locally or to a
bucket). ``checkpoint_path`` may be a run directory: its latest complete checkpoint is exported.
``output_dir`` is checked before the checkpoint is read (:mod:`levanter.compat.export_guard`): it must be new,
empty or exactly an earlier export (which is replaced), and neither be nor contain the checkpoint or the
working directory; a directory of the user's files is never replaced. A ``lora_lm`` checkpoint (which records
its adapters' settings) is exported with the adapters merged into the weights.

Bad input (a path without a complete checkpoint, a model block that does not match the arrays, an unknown
dtype) prints one ``error:`` paragraph and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Optional, Sequence

from levanter.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    read_checkpoint_metadata,
    resolve_checkpoint,
)
from levanter.compat.export_guard import check_export_dir
from levanter.config import ConfigError, parse_config, split_config_path
from levanter.errors import OUT_OF_SPACE_EXIT_CODE, OutOfSpaceError
from levanter.models import LmConfig
from levanter.progress import open_command_debug_log, setup_console_logging
from levanter.utils import fs

__all__ = ["ExportLmConfig", "main", "cli"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExportLmConfig:
    # The train_lm checkpoint to export: a step-N directory, or a run directory (its latest complete one).
    checkpoint_path: Optional[str] = None
    # Where the Hugging Face directory goes (local path or bucket URL): new, empty, or an earlier export
    # (which is replaced); a directory holding anything else is refused.
    output_dir: Optional[str] = None
    # The model block; default: the one the checkpoint records (needed for checkpoints that record none).
    model: Optional[LmConfig] = None
    # The run's data.tokenizer, whose files are copied; default: the one the checkpoint records.
    tokenizer: Optional[str] = None
    # Copy the tokenizer's files (when it is a Hugging Face tokenizer) into output_dir.
    save_tokenizer: bool = True
    # dtype of the exported weights: float32, bfloat16 or float16 (default: the checkpoint's own).
    save_dtype: Optional[str] = None
    # Largest safetensors file in bytes; above it the weights are split into shards with an index.
    max_shard_size: int = 5 * 1024**3
    # Upstream's hub upload; refused (no hub access is assumed: upload output_dir yourself).
    upload_to_hf: Optional[str] = None


def _vocab_from_leaves(doc: dict, config: LmConfig) -> Optional[int]:
    name = "model/wte/weight" if config.__class__.__name__ == "Gpt2Config" else "model/embed_tokens/weight"
    for rec in doc.get("leaves", []):
        if rec.get("name", "").startswith(name):
            return int(rec["shape"][0])
    return None


def main(config: ExportLmConfig) -> str:
    """Export; returns the output directory."""
    import draccus
    import haliax as hax
    import jax

    from levanter.checkpoint import load_checkpoint
    from levanter.compat import HF_SAVE_DTYPES, save_hf_checkpoint
    from levanter.lora import loraize, lora_from_record, merge_lora
    from levanter.quantization import fp8_from_record, with_fp8

    if not config.checkpoint_path:
        raise ConfigError("checkpoint_path is required: the train_lm checkpoint (step-N directory) to export")
    if not config.output_dir:
        raise ConfigError("output_dir is required: where the Hugging Face directory goes")
    if config.upload_to_hf:
        raise ValueError("upload_to_hf is not supported (no hub access is assumed): upload output_dir yourself")
    if config.save_dtype is not None and config.save_dtype not in HF_SAVE_DTYPES:
        raise ValueError(f"save_dtype {config.save_dtype!r} is not one of {sorted(HF_SAVE_DTYPES)}")
    path = resolve_checkpoint(config.checkpoint_path, "checkpoint_path")  # a step-N directory, or a run's latest
    # Before anything is loaded: the output may replace only an earlier export, and never the checkpoint.
    check_export_dir(config.output_dir, "output_dir", [("the checkpoint being exported", path, True),
                                                       ("checkpoint_path", config.checkpoint_path, True)])
    doc = read_checkpoint_metadata(path)
    record = doc.get("metadata", {}) or {}
    model_config = config.model
    if model_config is None:
        if "model" not in record:
            raise ValueError(
                f"checkpoint {path} does not record its model (written by an older train_lm): give the run's model "
                "block: --model.type and its keys (--model.hidden_dim ...), or --config_path FILE.yaml holding a model: "
                "section (and tokenizer:)"
            )
        model_config = draccus.decode(LmConfig, record["model"])
    tokenizer = config.tokenizer if config.tokenizer is not None else record.get("tokenizer")
    vocab = record.get("vocab_size") or _vocab_from_leaves(doc, model_config)
    if vocab is None:
        raise ValueError(f"checkpoint {path} has no embedding for a {type(model_config).__name__} model")

    Vocab = hax.Axis("vocab", int(vocab))
    # An fp8 run's checkpoint holds its layers' fp8 state too (recorded with its settings): loaded, not exported.
    fp8 = fp8_from_record(record)
    # A LoRA run's checkpoint holds its adapters (recorded with their settings): merged into the weights.
    lora = lora_from_record(record)

    def build(k):
        model = with_fp8(model_config.build(Vocab, key=k), fp8)
        return model if lora is None else loraize(model, lora, key=k)

    template = jax.eval_shape(build, jax.random.PRNGKey(0))
    # The parameters are stored in the run's parameter dtype (trainer.mp), float32 unless the run said otherwise.
    dtypes = {rec["dtype"] for rec in doc.get("leaves", []) if rec.get("name", "").startswith("model/")}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        template = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, template
        )
    try:
        model = load_checkpoint(template, path, subpath="model")
    except CheckpointMismatchError as e:
        raise ValueError(f"the model block does not match checkpoint {path}: {e}") from None
    if lora is not None:
        model = merge_lora(model)
    out = save_hf_checkpoint(model, model_config, config.output_dir,
                             tokenizer=tokenizer if config.save_tokenizer else None, dtype=config.save_dtype,
                             max_shard_size=config.max_shard_size,
                             source={"exported_by": "export_lm_to_hf", "checkpoint": fs.abspath(path),
                                     "step": doc.get("step")})
    print(f"exported {path} (step {doc.get('step')}) to {out}")
    return out


def cli(argv: Optional[Sequence[str]] = None) -> None:
    """Parse the command line (and ``--config_path``), export; user errors print one ``error:`` paragraph and exit 2,
    a full disk exits 74."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        path, rest = split_config_path(argv)
        config = parse_config(ExportLmConfig, path, rest)
        debug_log = open_command_debug_log("export_lm_to_hf")
        main(config)
        if debug_log is not None:
            print(f"debug log: {debug_log}")
    except OutOfSpaceError as e:  # nothing half-written is left (the export is written whole or not at all)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(OUT_OF_SPACE_EXIT_CODE) from None
    except (ConfigError, ValueError, FileNotFoundError, CorruptCheckpointError) as e:
        print(f"error: {fs.redact(str(e))}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    setup_console_logging()  # levanter's INFO on the console; everything, third parties' too, in the debug log
    cli()
