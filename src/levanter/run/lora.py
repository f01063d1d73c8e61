"""A LoRA run (``python -m levanter.main.lora_lm``): what it adds to a training run.

:class:`LoraRun` carries the adapters' settings and exports; :func:`levanter.run.main` asks it, at each phase,
for its part: the adapters checked against the model before any work, put on the model it builds (the Hugging
Face weights loaded beneath them), the filter that trains only them, their PEFT and merged exports. Keeping
it one object handed to the one run builder (rather than a second builder) means a LoRA run validates,
resumes, checkpoints and logs exactly as ``train_lm`` does.
"""

from __future__ import annotations

__all__ = ["LoraRun"]

import dataclasses
import logging
from typing import Optional

import equinox as eqx
import haliax as hax
import jax

from levanter.lm_config import TrainLmConfig
from levanter.lora import LoraConfig, loraize, merge_lora
from levanter.run.exports import check_export_path, export_base

logger = logging.getLogger(__name__)

_LORA_KEY = 1  # folded into the model's key for the adapters' initialisation


@dataclasses.dataclass(frozen=True)
class LoraRun:
    """What a LoRA run (``python -m levanter.main.lora_lm``) adds to its :class:`TrainLmConfig`: the adapters
    (:mod:`levanter.lora`) put on the model built from ``initialize_from_hf``, which alone train, and where
    their exports go."""

    # The adapters: which layers, their rank and scale.
    lora: LoraConfig
    # The base model as the config names it (adapter_config.json's base_model_name_or_path).
    base_model: Optional[str] = None
    # PEFT exports of the adapters: <peft_save_path>/<run id>/step-N.
    peft_save_path: Optional[str] = None
    # Exports of the model with the adapters merged into its weights: <merged_hf_save_path>/<run id>/step-N.
    merged_hf_save_path: Optional[str] = None
    # Steps between both exports (and one at the end).
    save_steps: int = 1000

    def adapt(self, model, key):
        """``model`` with its adapters (drawn from a key of their own)."""
        return loraize(model, self.lora, key=jax.random.fold_in(key, _LORA_KEY))

    def check_model(self, config: TrainLmConfig, vocab_size: int) -> None:
        """Before any work: the adapters can be put on the model (``lora.target_modules`` selects a layer, none
        of them quantized); traced with ``jax.eval_shape``, nothing is allocated."""
        vocab = hax.Axis("vocab", vocab_size)
        jax.eval_shape(lambda k: self.adapt(config.model.build(vocab, key=k), k), jax.random.PRNGKey(0))

    def check_paths(self, config: TrainLmConfig, run_id: str) -> None:
        """Before any work: both exports may replace only earlier exports (:func:`check_export_path`)."""
        for key, path in (("peft_save_path", self.peft_save_path), ("merged_hf_save_path", self.merged_hf_save_path)):
            if path:
                check_export_path(config, run_id, path, key, self.save_steps)

    def exporters(self, config: TrainLmConfig, run_id: str) -> list:
        """The exporters of ``peft_save_path`` and ``merged_hf_save_path`` that are set."""
        from levanter.compat import HfExporter, PeftExporter

        last = config.trainer.num_train_steps
        out = []
        if self.peft_save_path:
            out.append(PeftExporter(export_base(config, self.peft_save_path, run_id), every=self.save_steps,
                                    last_step=last, lora=self.lora, base_model_name_or_path=self.base_model,
                                    tokenizer=config.data.tokenizer))
        if self.merged_hf_save_path:
            out.append(HfExporter(export_base(config, self.merged_hf_save_path, run_id), every=self.save_steps,
                                  last_step=last, config=config.model, tokenizer=config.data.tokenizer,
                                  prepare=merge_lora, key="merged_hf_save_path", exported_by="lora_lm"))
        return out

    @staticmethod
    def log_trainable(trainer, model, tracker) -> None:
        """The parameter counts of a run that trains part of its model (upstream's summary names)."""
        total = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
        trained = sum(x.size for x in jax.tree.leaves(trainer.trained(model)))
        tracker.log_summary({"parameter_count": total, "trainable_parameter_count": trained,
                             "fraction_trainable": trained / max(total, 1)})
        logger.info("parameters: %d, of which %d train (%.3e)", total, trained, trained / max(total, 1))
