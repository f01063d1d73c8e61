"""LoRA fine-tuning of a Hugging Face model: ``python -m levanter.main.lora_lm --config_path lora.yaml``.

The config is upstream Levanter's LoRA YAML (:class:`LoraLmConfig`: ``initialize_from_hf``, ``lora``,
``data``, ``trainer``, ``optimizer``, ``peft_save_path``, ``hf_save_steps``, ``merged_hf_save_path``,
``max_train_length``, ...). The model is the ``initialize_from_hf`` checkpoint's (its type and shape from its
``config.json``, its weights loaded once at step 0); :func:`levanter.lora.loraize` puts low-rank adapters on the
linear layers ``lora.target_modules`` selects, and only the adapters train (the trainer's ``is_trainable``):
the base weights stay bit for bit as loaded, with no gradient or optimizer state. The run is
:func:`levanter.run.main`'s, exactly as ``train_lm``'s: the same validation before any work, caches,
checkpoints (which record the adapters' settings: a resume with other ``lora`` settings is refused), resumption
by rerunning with the same ``trainer.id``, metrics and exit statuses.

Exports, every ``hf_save_steps`` steps and at the end, each all or nothing and replacing only an earlier export:

* ``peft_save_path``: ``<peft_save_path>/<run id>/step-N`` holds the adapters as a PEFT checkpoint
  (``adapter_model.safetensors``, ``adapter_config.json``, the tokenizer's files;
  :mod:`levanter.compat.hf_checkpoints.peft`), which ``peft.PeftModel.from_pretrained`` loads onto the base model;
* ``merged_hf_save_path``: ``<merged_hf_save_path>/<run id>/step-N`` holds the model with the adapters merged
  into its weights (:func:`levanter.lora.merge_lora`), a plain Hugging Face checkpoint.

(Without the run id when ``trainer.checkpointer.append_run_id_to_base_path`` is false.) Refused by name:
``peft_hf_upload`` and ``merged_hf_upload`` (no hub access is assumed: upload the step-N directories yourself),
``trust_remote_code: true`` (only the model families built here load, and no checkpoint code is run), and
``trainer.quantization`` (quantized layers take no adapters). ``trainer.train_batch_size: -1`` is upstream's
"``trainer.per_device_parallelism`` sequences on every data-parallel device".
"""

from __future__ import annotations

__all__ = ["LoraLmConfig", "main", "cli_main", "cli", "to_train_lm_config"]

if __name__ == "__main__":
    # Before the heavy imports, so that re-executing costs only an interpreter start-up.
    from levanter.utils.malloc import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
import dataclasses
import logging
from typing import ClassVar, Dict, Optional

import levanter.config
from levanter import run
from levanter.data.config import DataConfig, UrlSingleDatasetLMConfig
from levanter.lm_config import TrainLmConfig
from levanter.lora import LoraConfig
from levanter.models import LlamaConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.refused_keys import check_refused, refused
from levanter.training import TrainerConfig
from levanter.utils import fs

logger = logging.getLogger(__name__)

_NO_UPLOAD = "no hub access is assumed: upload the exported step-N directory yourself (huggingface-cli upload)"


@dataclasses.dataclass(frozen=True)
class LoraLmConfig:
    # The Hugging Face checkpoint to adapt (a local directory with config.json and *.safetensors, a bucket URL
    # or a hub id): the model's type, shape and weights; the weights stay fixed.
    initialize_from_hf: Optional[str] = None
    # The adapters: target_modules (regex or list of layer names; null: every linear layer), r, alpha, dropout.
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    # The training (and validation) data: one source, or a mixture of named sources.
    data: DataConfig = dataclasses.field(default_factory=UrlSingleDatasetLMConfig)
    # Steps, batch sizes, evaluation, checkpoints, trackers, devices.
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    # The optimizer of the adapters and its learning-rate schedule.
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    # Export the adapters as PEFT checkpoints to <peft_save_path>/<run id>/step-N every hf_save_steps steps
    # and at the end.
    peft_save_path: Optional[str] = None
    # Upstream's hub upload of the PEFT exports.
    peft_hf_upload: Optional[str] = refused(_NO_UPLOAD)
    # Steps between the exports of peft_save_path and merged_hf_save_path.
    hf_save_steps: int = 1000
    # Export the model with the adapters merged into its weights (a plain Hugging Face checkpoint) to
    # <merged_hf_save_path>/<run id>/step-N every hf_save_steps steps and at the end.
    merged_hf_save_path: Optional[str] = None
    # Upstream's hub upload of the merged exports.
    merged_hf_upload: Optional[str] = refused(_NO_UPLOAD)
    # Upstream's permission to run a checkpoint's own code.
    trust_remote_code: bool = refused("no checkpoint code is run here: only the model families built here load",
                                      default=False)
    # Tokens per training sequence (model.seq_len); null: the checkpoint's max_position_embeddings, at most 2048.
    max_train_length: Optional[int] = None

    # Top-level keys of the other entry points' configs: a file carrying them is refused as such.
    OTHER_ENTRY_POINTS: ClassVar[Dict[str, str]] = {
        **dict.fromkeys(("model", "hf_save_path", "initialize_from_checkpoint_path"),
                        "levanter.main.train_lm (run it with python -m levanter.main.train_lm)"),
        **dict.fromkeys(("supervised_data", "chat_train_urls", "max_seq_len"),
                        "upstream's supervised fine-tuning entry point (run it with python -m levanter.main.sft)"),
    }


def to_train_lm_config(config: LoraLmConfig, *, seq_len: Optional[int] = None) -> TrainLmConfig:
    """The :class:`TrainLmConfig` that trains ``config``'s base model: the model's type and shape come from the
    ``initialize_from_hf`` checkpoint when the run starts (``seq_len``: the sequence length when
    ``max_train_length`` is unset). Refuses (``ValueError`` naming the key) what cannot run; reads nothing."""
    check_refused(config)
    if not config.initialize_from_hf or not isinstance(config.initialize_from_hf, str):
        raise ValueError(
            "initialize_from_hf is not set: give the Hugging Face checkpoint to adapt (a directory holding "
            "config.json and *.safetensors, a bucket URL or a hub id)"
        )
    if config.trainer.quantization is not None:
        raise ValueError(
            "trainer.quantization is set, but LoRA and quantized training are not built together (a quantized "
            "layer takes no adapter): remove trainer.quantization"
        )
    config.lora.check("lora")
    if isinstance(config.hf_save_steps, bool) or not isinstance(config.hf_save_steps, int) or config.hf_save_steps <= 0:
        raise ValueError(f"hf_save_steps must be a positive number of steps, got {config.hf_save_steps!r}")
    length = config.max_train_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 2):
        raise ValueError(f"max_train_length must be a whole number of tokens >= 2, got {length!r}")
    return TrainLmConfig(
        data=config.data,
        trainer=_trainer(config.trainer),
        model=LlamaConfig(seq_len=length or seq_len or LlamaConfig.seq_len),
        optimizer=config.optimizer,
        initialize_from_hf=config.initialize_from_hf,
        use_hf_model_config=True,
    )


def _trainer(tcfg: TrainerConfig) -> TrainerConfig:
    """``trainer`` with upstream's ``train_batch_size: -1`` resolved: ``per_device_parallelism`` sequences on each
    data-parallel device."""
    if tcfg.train_batch_size != -1:
        return tcfg
    pdp = tcfg.per_device_parallelism
    if isinstance(pdp, bool) or not isinstance(pdp, int) or pdp < 1:
        raise ValueError(
            f"trainer.train_batch_size: -1 means trainer.per_device_parallelism sequences per device, but "
            f"per_device_parallelism is {pdp!r}: give it a number of sequences, or give train_batch_size itself"
        )
    return dataclasses.replace(tcfg, train_batch_size=pdp * tcfg.data_axis_size)


def _lora_run(config: LoraLmConfig) -> run.LoraRun:
    """The run's LoRA part, its export directories checked writable first (by writing a probe there, which
    creates a local directory: so this is the run's check, not :func:`to_train_lm_config`'s, which tools
    that only parse a config call)."""
    for key in ("peft_save_path", "merged_hf_save_path"):
        path = getattr(config, key)
        if path and fs.is_object_store(path):
            fs.check_access(path, key, write=True)
        elif path and not fs.is_url(path):
            try:
                fs.probe_writable(path)
            except OSError as e:
                raise ValueError(
                    f"{key}={path!r}: cannot write there ({e.strerror or e}); choose a writable directory"
                ) from None
    return run.LoraRun(lora=config.lora, base_model=config.initialize_from_hf,
                          peft_save_path=config.peft_save_path, merged_hf_save_path=config.merged_hf_save_path,
                          save_steps=config.hf_save_steps)


def main(config: LoraLmConfig) -> dict:
    """Fine-tune the adapters; returns ``{"run_id", "final_step", "final_loss"}`` (:func:`levanter.run.main`)."""
    config.trainer.distributed.initialize()  # before train_batch_size: -1 counts the devices
    train_config = to_train_lm_config(config)
    if config.max_train_length is None:  # the checkpoint's own length
        from levanter.compat import load_hf_config

        train_config = to_train_lm_config(config, seq_len=load_hf_config(config.initialize_from_hf).seq_len)
    return run.main(train_config, lora=_lora_run(config))


@levanter.config.main
def cli_main(config: LoraLmConfig):
    return main(config)


def cli(argv=None) -> None:
    """The command-line entry point: exit statuses as ``train_lm``'s (:func:`levanter.run.cli_errors`)."""
    run.run_config_command(__name__, cli_main, argv)


if __name__ == "__main__":
    run.start_command(cli)
