"""The configuration of a language-model run, shared by the entry points that read it.

:class:`TrainLmConfig` is the whole YAML of ``python -m levanter.main.train_lm`` (and what
``levanter.main.data_schedule`` plans); :func:`validate` is every check that needs no data and no compile;
:func:`data_key` is the key the training data is derived from; :func:`check_storage_access` (part of
:func:`validate`) checks every object-store URL in the config; :func:`with_hf_model` and
:func:`model_vocab_size` give a run that starts from a Hugging Face checkpoint (``initialize_from_hf``) that
checkpoint's model shape and vocabulary. Entry points import these from here, never
from one another (``levanter.main.train_lm`` re-exports them under upstream's path).
"""

from __future__ import annotations

__all__ = [
    "SEED_LIMIT",
    "BranchOrigin",
    "TrainLmConfig",
    "branch_origin",
    "check_branch_model",
    "check_epoch",
    "check_eval_harness",
    "check_hf_keys",
    "check_storage_access",
    "config_locations",
    "data_key",
    "hf_init_path",
    "model_vocab_size",
    "overridden_model_keys",
    "storage_locations",
    "validate",
    "with_hf_model",
]

import dataclasses
import logging
import math
import re
from typing import ClassVar, Dict, Optional, Union

import jax

from levanter.refused_keys import check_refused, refused
from levanter.data.config import DataConfig, LMMixtureDatasetConfig, UrlSingleDatasetLMConfig
from levanter.eval_harness.config import LmEvalHarnessConfig
from levanter.models import LlamaConfig, LmConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.training import TrainerConfig
from levanter.utils import fs

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainLmConfig:
    # The training (and validation) data: one source, or a mixture of named sources.
    data: DataConfig = dataclasses.field(default_factory=UrlSingleDatasetLMConfig)
    # Steps, batch sizes, evaluation, checkpoints, trackers, devices.
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    # The architecture (its type: gpt2, llama, qwen3, ...) and its sizes.
    model: LmConfig = dataclasses.field(default_factory=LlamaConfig)
    # The optimizer and its learning-rate schedule.
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    # Weight of the z-loss (the squared log-sum-exp of each position's logits) added to the loss; 0: none,
    # at most 1 (1e-4 is usual).
    z_loss_weight: float = 0.0
    # Seed of the data order (shuffles, mixture draws); null: derived from trainer.seed.
    data_seed: Optional[int] = None
    # Batches the loader reads ahead of the step being trained; 0: read each batch when it is needed.
    prefetch_depth: int = 8
    # Also hash each step's token content into data/fingerprint (single-process runs only).
    fingerprint_tokens: bool = False
    # Resume even if the data schedule changed before the checkpoint's step (the resumed run's past then
    # differs from what the checkpointed model saw). Off by default: such edits are refused.
    allow_data_schedule_change: bool = False
    # Another run's checkpoint (a step-N directory, or a run directory for its latest) whose weights start
    # this run, with a fresh optimizer, at step 0 (trainer.initialize_from also takes its optimizer state).
    initialize_from_checkpoint_path: Optional[str] = None
    # A Hugging Face checkpoint (local directory, bucket URL or hub id) whose weights start this run at step
    # 0 with a fresh optimizer; the model's shape comes from its config.json.
    initialize_from_hf: Union[bool, str] = False
    # With initialize_from_hf: take the model's type and shape from config.json even where the YAML's model
    # block says otherwise (false: a disagreeing shape key is an error).
    use_hf_model_config: bool = False
    # Export the model in the Hugging Face layout to <hf_save_path>/<run id>/step-N every hf_save_steps
    # steps and at the end (without the run id when trainer.checkpointer.append_run_id_to_base_path is false).
    hf_save_path: Optional[str] = None
    # Upstream's hub upload of the exports; refused (no hub access is assumed: upload the directories yourself).
    hf_upload: Optional[str] = refused(
        "no hub access is assumed: export with hf_save_path and upload the step-N directory with huggingface-cli "
        "upload"
    )
    # Steps between Hugging Face exports (hf_save_path).
    hf_save_steps: int = 10000
    # dtype of the exported weights: float32, bfloat16 or float16 (default: the parameters' own).
    hf_save_dtype: Optional[str] = None
    # Epochs of a single source's training data (upstream's epoch): above 0 the data repeats, in the same
    # order, up to this many times, and a run that needs more is refused before training; 0: read once.
    # A mixture repeats by data.stop_strategy instead.
    epoch: int = 0
    # lm-evaluation-harness tasks run on the model during training (levanter.eval_harness; the eval extra).
    eval_harness: Optional[LmEvalHarnessConfig] = None
    # Steps between eval_harness runs (they also run at the end and at each mixture stage's start).
    eval_harness_steps: int = 10000
    # Upstream logs the entropy of the predictions; refused if set.
    log_entropy: bool = refused("prediction entropy is not logged; remove the key", default=False)
    # Upstream's top-level tokenizer (its SFT and conversion configs): sets data.tokenizer when that is left
    # at its default (gpt2); a different data.tokenizer is an error. null: data.tokenizer alone decides.
    tokenizer: Optional[str] = None

    # Top-level keys of upstream's other entry points' configs: a file carrying them is refused as such
    # (levanter.config names the entry point) instead of listing unknown keys.
    OTHER_ENTRY_POINTS: ClassVar[Dict[str, str]] = {
        **dict.fromkeys(
            ("supervised_data", "dataset_type", "chat_train_urls", "model_name_or_path", "messages_field",
             "input_role", "output_role", "max_seq_len", "reinit_tokens", "mixture_weights",
             "mixture_block_size"),
            "upstream's supervised fine-tuning entry point (run it with python -m levanter.main.sft)",
        ),
        **dict.fromkeys(
            ("peft_save_path", "peft_hf_upload", "merged_hf_save_path", "merged_hf_upload", "lora",
             "max_train_length"),
            "upstream's LoRA fine-tuning entry point (run it with python -m levanter.main.lora_lm)",
        ),
    }

    def __post_init__(self):
        if self.tokenizer is None or self.tokenizer == self.data.tokenizer:
            return
        default = next(f.default for f in dataclasses.fields(self.data) if f.name == "tokenizer")
        if self.data.tokenizer != default:
            raise ValueError(
                f"tokenizer={self.tokenizer!r} and data.tokenizer={self.data.tokenizer!r} disagree: the top-level "
                "tokenizer is upstream's spelling of data.tokenizer; keep one of them"
            )
        object.__setattr__(self, "data", dataclasses.replace(self.data, tokenizer=self.tokenizer))


# Upstream and PaLM use 1e-4; at 1 the z-loss already outweighs the cross-entropy it regularises.
Z_LOSS_WEIGHT_MAX = 1.0


def validate(config: TrainLmConfig):
    """Every check that needs no data and no compile; errors name the config key. Returns the tokenizer."""
    check_refused(config)  # keys accepted from upstream configs, set to what is not built here
    check_hf_keys(config)
    check_epoch(config)
    if config.prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {config.prefetch_depth}")
    if not (math.isfinite(config.z_loss_weight) and 0 <= config.z_loss_weight <= Z_LOSS_WEIGHT_MAX):
        raise ValueError(
            f"z_loss_weight must be a finite number in [0, {Z_LOSS_WEIGHT_MAX:g}] (1e-4 is usual), got "
            f"{config.z_loss_weight}: the z-loss adds z_loss_weight x logsumexp(logits)^2 per position, so a "
            "larger weight swamps the next-token loss (and overflows float32 gradients at step 0)"
        )
    if config.data_seed is not None and not 0 <= config.data_seed < SEED_LIMIT:
        raise ValueError(
            f"data_seed must be in [0, 2**32 - 1], got {config.data_seed}: JAX keeps the low 32 bits of a "
            "seed, so a larger or negative one would repeat the data order of another"
        )
    if config.model.seq_len < 2:
        raise ValueError(
            f"model.seq_len must be >= 2, got {config.model.seq_len}: each position learns to predict the "
            "next token, and a sequence of one token has no next token (the loss would be 0 over no "
            "positions)"
        )
    config.trainer.validate()
    check_eval_harness(config)
    config.model.check_platform(jax.default_backend())  # model.attn_backend: a kernel this platform has
    config.optimizer.lr_scheduler(config.trainer.num_train_steps)  # lr_schedule, warmup, decay, min_lr_ratio
    config.data.validate(num_train_steps=config.trainer.num_train_steps)
    max_len = config.model.max_seq_len
    if max_len is not None and config.model.seq_len > max_len:
        raise ValueError(f"model.seq_len={config.model.seq_len} exceeds what the model supports ({max_len})")
    check_storage_access(config)
    branch_origin(config)
    tokenizer = config.data.the_tokenizer()
    config.data.check_inputs()  # missing files and empty globs, before any cache is built
    return tokenizer


def check_eval_harness(config: TrainLmConfig) -> None:
    """``eval_harness`` (its own checks) and ``eval_harness_steps``; ``eval_harness.max_eval_length`` within
    what the model supports (learned positions)."""
    if config.eval_harness_steps < 1:
        raise ValueError(f"eval_harness_steps must be >= 1, got {config.eval_harness_steps}")
    harness = config.eval_harness
    if harness is None:
        return
    harness.validate("eval_harness")
    limit = config.model.max_seq_len
    if harness.max_eval_length is not None and limit is not None and harness.max_eval_length > limit:
        raise ValueError(
            f"eval_harness.max_eval_length={harness.max_eval_length} exceeds what the model supports ({limit} "
            "positions): lower it, or leave it null for model.seq_len"
        )


def check_epoch(config: TrainLmConfig) -> None:
    """``epoch``: a whole number >= 0, and 0 for a mixture (which repeats by ``data.stop_strategy``). Whether
    the epochs cover ``trainer.num_train_steps`` needs the data's length: ``train_lm`` checks it once the
    caches are built, before training."""
    from levanter.data.config import MIXTURE_EPOCH_ERROR

    e = config.epoch
    if isinstance(e, bool) or not isinstance(e, int) or e < 0:
        raise ValueError(f"epoch must be a whole number of epochs >= 0 (0: read the data once), got {e!r}")
    if e > 0 and isinstance(config.data, LMMixtureDatasetConfig):
        raise ValueError(MIXTURE_EPOCH_ERROR.format(epochs=e))


def storage_locations(config: TrainLmConfig) -> list[tuple[str, str, bool]]:
    """``(config key, URL, written)`` for every object-store location (``gs://``, ``s3://``, ``memory://``)
    the run reads or writes: caches, input files, checkpoints, the checkpoint to load, the log directory."""
    return [(key, url, written) for key, url, written in config_locations(config) if fs.is_object_store(url)]


def config_locations(config: TrainLmConfig) -> list[tuple[str, str, bool]]:
    """``(config key, path or URL, written)`` for every location the run reads or writes, local or not."""
    data = config.data
    found: list[tuple[str, str, bool]] = [("data.cache_dir", data.cache_dir or "cache/", True)]
    if not isinstance(data, LMMixtureDatasetConfig):  # one source
        found += [("data.train_urls", u, False) for u in data.train_urls]
        found += [("data.validation_urls", u, False) for u in data.validation_urls]
    else:
        for name, src in data.configs.items():
            found.append((data.source_cache_key(name), data.source_cache_dir(name), True))
            found += [(f"data.configs.{name}.train_urls", u, False) for u in src.train_urls]
            found += [(f"data.configs.{name}.validation_urls", u, False) for u in src.validation_urls]
    tcfg = config.trainer
    found.append(("trainer.checkpointer.base_path", tcfg.checkpointer.base_path, True))
    if tcfg.load_checkpoint_path:
        found.append(("trainer.load_checkpoint_path", tcfg.load_checkpoint_path, False))
    found.append(("trainer.log_dir", tcfg.log_dir, True))
    if config.hf_save_path:
        found.append(("hf_save_path", config.hf_save_path, True))
    if isinstance(config.initialize_from_hf, str):
        found.append(("initialize_from_hf", config.initialize_from_hf, False))
    seen, out = set(), []
    for key, url, written in found:
        if url and (key, url) not in seen:
            seen.add((key, url))
            out.append((key, url, written))
    return out


def check_storage_access(config: TrainLmConfig) -> None:
    """Refuse, before any work, an object-store location that is missing or refuses access (a bucket that
    does not exist, bad credentials, a 403): the bucket is listed, and a probe object written and deleted
    where the run writes. :class:`levanter.utils.fs.StorageAccessError` (a ``ValueError``) names the URL
    and the config key; transient errors are retried inside the check."""
    for key, url, written in storage_locations(config):
        fs.check_access(url, key, write=written)


@dataclasses.dataclass(frozen=True)
class BranchOrigin:
    """Where a run branched from: the complete checkpoint ``path`` (resolved), the config ``key`` that named
    it, and whether the optimizer state comes along (``trainer.initialize_from``) or only the weights."""

    key: str
    path: str
    optimizer_state: bool


def branch_origin(config: TrainLmConfig) -> Optional[BranchOrigin]:
    """The checkpoint ``trainer.initialize_from`` or ``initialize_from_checkpoint_path`` names, resolved to a
    complete ``step-N`` directory; None when neither is set. Refuses both at once, a path with no complete
    checkpoint, and a path inside this run's own checkpoint directory (the branch needs its own
    ``trainer.id``, or its checkpoints would mix with the origin's)."""
    from levanter.checkpoint import resolve_checkpoint

    tcfg = config.trainer
    if tcfg.initialize_from and config.initialize_from_checkpoint_path:
        raise ValueError(
            "trainer.initialize_from and initialize_from_checkpoint_path are both set: use "
            "trainer.initialize_from for weights and optimizer state, initialize_from_checkpoint_path for "
            "weights alone"
        )
    if tcfg.initialize_from:
        key, path, with_opt = "trainer.initialize_from", tcfg.initialize_from, True
    elif config.initialize_from_checkpoint_path:
        key, path, with_opt = "initialize_from_checkpoint_path", config.initialize_from_checkpoint_path, False
    else:
        return None
    found = resolve_checkpoint(path, key)
    if tcfg.id is not None:
        own = fs.abspath(tcfg.checkpointer.expanded_path(tcfg.id)).rstrip("/") + "/"
        if (fs.abspath(found).rstrip("/") + "/").startswith(own):
            raise ValueError(
                f"{key}={path!r} is a checkpoint of this run (trainer.id={tcfg.id}): a branch is a new run, so "
                "give it its own trainer.id"
            )
    return BranchOrigin(key, found, with_opt)


def hf_init_path(config: TrainLmConfig) -> Optional[str]:
    """The checkpoint ``initialize_from_hf`` names, or None (``true``, upstream's "the model config's reference
    checkpoint", is refused: model configs here name none)."""
    value = config.initialize_from_hf
    if value is False or value is None:
        return None
    if value is True:
        raise ValueError(
            "initialize_from_hf: true means upstream's reference checkpoint of the model config, which this build "
            "does not have: give initialize_from_hf the checkpoint itself (a directory holding config.json and "
            "*.safetensors, or a hub id)"
        )
    return value


def check_hf_keys(config: TrainLmConfig) -> None:
    """The Hugging Face keys of a run: refuses a non-positive hf_save_steps, an unknown hf_save_dtype, and
    initialize_from_hf combined with another initialisation (hf_upload is refused with the other upstream keys)."""
    from levanter.compat import HF_SAVE_DTYPES

    if isinstance(config.hf_save_steps, bool) or not isinstance(config.hf_save_steps, int) or config.hf_save_steps <= 0:
        raise ValueError(f"hf_save_steps must be a positive number of steps, got {config.hf_save_steps!r}")
    if config.hf_save_dtype is not None and config.hf_save_dtype not in HF_SAVE_DTYPES:
        raise ValueError(f"hf_save_dtype {config.hf_save_dtype!r} is not one of {sorted(HF_SAVE_DTYPES)}")
    if config.hf_save_path and not fs.is_url(config.hf_save_path):  # buckets: check_storage_access
        try:
            fs.probe_writable(config.hf_save_path)
        except OSError as e:
            raise ValueError(
                f"hf_save_path={config.hf_save_path!r}: cannot write there ({e.strerror or e}); choose a writable "
                "directory"
            ) from None
    if config.use_hf_model_config and not config.initialize_from_hf:
        raise ValueError("use_hf_model_config: true needs initialize_from_hf (the checkpoint whose config.json to use)")
    if hf_init_path(config) is not None:
        others = [k for k, v in (("trainer.initialize_from", config.trainer.initialize_from),
                                 ("initialize_from_checkpoint_path", config.initialize_from_checkpoint_path)) if v]
        if others:
            raise ValueError(f"initialize_from_hf and {others[0]} are both set: a run starts from one of them")


def with_hf_model(config: TrainLmConfig) -> TrainLmConfig:
    """``config`` with the model block of its ``initialize_from_hf`` checkpoint
    (:func:`levanter.compat.merge_hf_model_config`: shape from config.json, run settings from the YAML);
    ``config`` itself without one."""
    path = hf_init_path(config)
    if path is None:
        return config
    from levanter.compat import merge_hf_model_config

    check_hf_keys(config)
    model, _ = merge_hf_model_config(config.model, path, use_hf_model_config=config.use_hf_model_config)
    for line in overridden_model_keys(config.model, model):
        logger.warning("initialize_from_hf=%r with use_hf_model_config: true: %s", path, line)
    return dataclasses.replace(config, model=model)


def overridden_model_keys(mine: LmConfig, merged: LmConfig) -> list:
    """What the checkpoint's config.json replaced of what the run's config set (``model.type``, or a key set to
    a value other than its default), a line each naming the key and both values: the YAML says one model and
    the run trains another, which must not go unsaid. Keys the config left at their defaults take the
    checkpoint's values as a matter of course and are not listed."""
    if type(mine) is not type(merged):
        return [f"model.type {mine.get_choice_name(type(mine))} in the config is replaced by the checkpoint's "
                f"{merged.get_choice_name(type(merged))} (with its shape; the config's shape keys are ignored)"]
    defaults = type(mine)(seq_len=mine.seq_len)
    out = []
    for f in dataclasses.fields(mine):
        value, theirs = getattr(mine, f.name), getattr(merged, f.name)
        if value != theirs and value != getattr(defaults, f.name):
            out.append(f"model.{f.name}={value!r} in the config is replaced by the checkpoint's {theirs!r}")
    return out


def model_vocab_size(config: TrainLmConfig, tokenizer) -> int:
    """Rows of the model's embedding: the ``initialize_from_hf`` checkpoint's vocab_size (which must hold every
    token id of the tokenizer), else the tokenizer's vocabulary."""
    path = hf_init_path(config)
    if path is None:
        return tokenizer.vocab_size
    from levanter.compat import merge_hf_model_config

    _, vocab = merge_hf_model_config(config.model, path, use_hf_model_config=True)
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but initialize_from_hf={path!r} has an embedding of "
            f"{vocab} rows (vocab_size in its config.json): use the checkpoint's tokenizer"
        )
    return vocab


def check_branch_model(config: TrainLmConfig, vocab_size: int, branch: Optional[BranchOrigin]) -> None:
    """Before any work: a branch (``trainer.initialize_from`` / ``initialize_from_checkpoint_path``) whose
    model's parameter shapes differ from those of the model its origin checkpoint records
    (:func:`model_record`) is refused, naming the first parameter and both shapes. Shapes come from
    ``jax.eval_shape``: nothing is allocated or read but ``metadata.json``. An origin that records no model,
    or that cannot be resolved here, is left to the load, which checks every array."""
    import draccus
    from draccus.utils import DecodingError

    from levanter.checkpoint import read_checkpoint_metadata
    from levanter.models import parameter_shapes

    try:
        record = (read_checkpoint_metadata(branch.path).get("metadata") or {}) if branch is not None else {}
        origin = draccus.decode(LmConfig, record["model"]) if "model" in record else None
    except (ValueError, OSError, DecodingError):
        return
    if branch is not None:
        from levanter.quantization import check_checkpoint_fp8

        check_checkpoint_fp8(record, config.trainer.quantization, f"{branch.key}={branch.path!r}")
    if origin is None or not record.get("vocab_size"):
        return
    theirs = jax.tree_util.tree_flatten_with_path(parameter_shapes(origin, int(record["vocab_size"])))[0]
    mine = jax.tree_util.tree_flatten_with_path(parameter_shapes(config.model, vocab_size))[0]
    for (path, a), (_, b) in zip(theirs, mine):
        if tuple(a.shape) != tuple(b.shape):
            name = "model" + re.sub(r"\[<flat index \d+>\]", "", jax.tree_util.keystr(path))
            raise ValueError(
                f"{branch.key}={branch.path!r} does not fit this run's model ({name} is {tuple(a.shape)} in the "
                f"checkpoint but {tuple(b.shape)} here): set model as in the run that wrote it"
            )
    if len(theirs) != len(mine):
        raise ValueError(
            f"{branch.key}={branch.path!r} does not fit this run's model (the checkpoint's model has "
            f"{len(theirs)} parameter arrays, this run's {len(mine)}): set model as in the run that wrote it"
        )


SEED_LIMIT = 2**32  # jax.random.PRNGKey keeps the low 32 bits (without jax_enable_x64)


def data_key(config: TrainLmConfig) -> jax.Array:
    """The key the training data is derived from: ``data_seed`` if set, else a split of ``trainer.seed``."""
    if config.data_seed is not None:
        return jax.random.PRNGKey(config.data_seed)
    return jax.random.split(jax.random.PRNGKey(config.trainer.seed), 4)[0]

