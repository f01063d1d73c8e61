"""The model an evaluation entry point (``eval_lm``, ``eval_harness``) evaluates: a run's checkpoint rebuilt
from what it records, or a Hugging Face checkpoint, with the trainer whose mesh evaluates it.

A checkpoint's ``metadata.json`` records what its model was built with (:func:`levanter.run.records.model_record`):
the vocabulary size (a run started from a Hugging Face checkpoint has that checkpoint's, often more rows
than the tokenizer's), an fp8 run's fp8 settings and a LoRA run's adapters. The model is built with all of
them, so the checkpoint's arrays load into the same structure that wrote them and the evaluation runs
through the fp8 state and the adapters, as training did; only the weights are read, never the optimizer.
"""

from __future__ import annotations

__all__ = ["EvalModel", "eval_trainer", "load_checkpoint_model", "load_hf_model"]

import dataclasses
from typing import Any, Optional

from levanter.checkpoint import initialize_from
from levanter.lm_config import TrainLmConfig, model_vocab_size
from levanter.lora import loraize, lora_from_record
from levanter.models import LmConfig
from levanter.quantization import fp8_from_record, with_fp8
from levanter.training import Trainer, TrainerConfig


@dataclasses.dataclass(frozen=True)
class EvalModel:
    """A model loaded for evaluation, and what the report says of it."""

    # The model, its weights loaded.
    model: Any
    # Rows of its embedding.
    vocab_size: int
    # The step it was saved at (0 for a Hugging Face checkpoint).
    step: int
    # The checkpoint it came from, as the report names it.
    where: str


def eval_trainer(tcfg: TrainerConfig) -> Trainer:
    """A trainer that only evaluates: the config's mesh and shardings, no optimizer and, whatever
    ``trainer.model_averaging`` says, no averaged copy of the model (as much device memory again, neither
    loaded nor evaluated)."""
    import optax

    def loss_fn(model, batch):  # never called: the evaluations compute their own sums and scores
        raise NotImplementedError

    return Trainer(dataclasses.replace(tcfg, model_averaging=None), optax.identity(), loss_fn)


def load_checkpoint_model(config: TrainLmConfig, trainer: Trainer, path: str, meta: dict, tokenizer, *,
                          tokenizer_name: str = "the tokenizer") -> EvalModel:
    """The model of the complete checkpoint ``path`` (``meta``: its ``metadata.json``), built as its record
    says and loaded on ``trainer``'s mesh. Its vocabulary is the one the checkpoint records, else the one the
    config and ``tokenizer`` give (:func:`levanter.lm_config.model_vocab_size`); one smaller than the tokenizer's
    (``tokenizer_name`` in the error) is refused, naming ``checkpoint_path``."""
    import haliax as hax
    import jax

    record = meta.get("metadata") or {}
    vocab_size = int(record["vocab_size"]) if record.get("vocab_size") else model_vocab_size(config, tokenizer)
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"checkpoint_path={path!r} has a vocabulary of {vocab_size}, smaller than {tokenizer_name}'s "
            f"({tokenizer.vocab_size}): set data.tokenizer as in the run that wrote it"
        )
    fp8, lora = fp8_from_record(record), lora_from_record(record)

    def build(k):
        model = with_fp8(config.model.build(hax.Axis("vocab", vocab_size), key=k), fp8)
        return model if lora is None else loraize(model, lora, key=k)

    state = trainer.initial_state(build, key=jax.random.PRNGKey(0))
    model = initialize_from(state, path, optimizer_state=False, key="checkpoint_path").model
    return EvalModel(model, vocab_size, int(meta["step"]), path)


def load_hf_model(path: str, tokenizer, *, key: str, model: Optional[LmConfig] = None,
                  tokenizer_name: str = "the tokenizer") -> EvalModel:
    """The model of the Hugging Face checkpoint ``path`` (the value of the config key ``key``), with the run
    settings of ``model`` (default: its own ``config.json``'s); a vocabulary smaller than ``tokenizer``'s
    (``tokenizer_name`` in the error) is refused."""
    from levanter.compat import load_hf_checkpoint

    _, loaded = load_hf_checkpoint(path, model)
    vocab_size = loaded.Vocab.size
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"{key}={path!r} has a vocabulary of {vocab_size}, smaller than {tokenizer_name}'s "
                         f"({tokenizer.vocab_size})")
    return EvalModel(loaded, vocab_size, 0, path)
