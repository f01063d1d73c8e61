"""The configuration of a language-model run, shared by the entry points that read it.

:class:`TrainLmConfig` is the whole YAML of ``python -m levanter.main.train_lm`` (and what
``levanter.main.data_schedule`` plans); :func:`validate` is every check that needs no data and no compile;
:func:`data_key` is the key the training data is derived from; :func:`check_storage_access` (part of
:func:`validate`) checks every object-store URL in the config. Entry points import these from here, never
from one another (``levanter.main.train_lm`` re-exports them under upstream's path).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Union

import jax

from levanter.data.config import DataConfig, UrlSingleDatasetLMConfig
from levanter.models import LlamaConfig, LmConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.trainer import TrainerConfig
from levanter.utils import fs


@dataclasses.dataclass(frozen=True)
class TrainLmConfig:
    data: DataConfig = dataclasses.field(default_factory=UrlSingleDatasetLMConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    model: LmConfig = dataclasses.field(default_factory=LlamaConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    z_loss_weight: float = 0.0
    data_seed: Optional[int] = None
    prefetch_depth: int = 8
    # Also hash each step's token content into data/fingerprint (single-process runs only).
    fingerprint_tokens: bool = False
    # Resume even if the data schedule changed before the checkpoint's step (the resumed run's past then
    # differs from what the checkpointed model saw). Off by default: such edits are refused.
    allow_data_schedule_change: bool = False
    # Another run's checkpoint (a step-N directory, or a run directory for its latest) whose weights start
    # this run, with a fresh optimizer, at step 0 (trainer.initialize_from also takes its optimizer state).
    initialize_from_checkpoint_path: Optional[str] = None
    # Upstream fields accepted so configs parse; refused if set (they need the HF hub or are not built).
    initialize_from_hf: Union[bool, str] = False
    use_hf_model_config: bool = False
    hf_save_path: Optional[str] = None
    hf_upload: Optional[str] = None
    hf_save_steps: int = 10000
    hf_save_dtype: Optional[str] = None
    epoch: int = 0
    eval_harness: Optional[Dict] = None
    eval_harness_steps: int = 10000
    log_entropy: bool = False


def validate(config: TrainLmConfig):
    """Every check that needs no data and no compile; errors name the config key. Returns the tokenizer."""
    for name in ("initialize_from_hf", "use_hf_model_config", "hf_save_path", "hf_upload", "eval_harness",
                 "log_entropy"):
        value = getattr(config, name)
        if value not in (False, None):
            raise ValueError(f"{name} is not supported by this fork yet; remove it from the config")
    if config.epoch:
        raise ValueError("epoch is not supported: use data.stop_strategy or a longer run instead")
    if config.prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {config.prefetch_depth}")
    if not math.isfinite(config.z_loss_weight) or config.z_loss_weight < 0:
        raise ValueError(f"z_loss_weight must be a finite number >= 0, got {config.z_loss_weight}")
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
    check_platform = getattr(config.model, "check_platform", None)
    if check_platform is not None:  # model.attn_backend: a kernel this platform has
        check_platform(jax.default_backend())
    config.optimizer.lr_scheduler(config.trainer.num_train_steps)  # lr_schedule, warmup, decay, min_lr_ratio
    config.data.validate(num_train_steps=config.trainer.num_train_steps)
    max_len = getattr(config.model, "max_seq_len", None)
    if max_len is not None and config.model.seq_len > max_len:
        raise ValueError(f"model.seq_len={config.model.seq_len} exceeds what the model supports ({max_len})")
    check_storage_access(config)
    branch_origin(config)
    tokenizer = config.data.the_tokenizer()
    model_vocab = getattr(config.model, "vocab_size", None)
    if model_vocab is not None and model_vocab < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})"
        )
    config.data.check_inputs()  # missing files and empty globs, before any cache is built
    return tokenizer


def storage_locations(config: TrainLmConfig) -> list[tuple[str, str, bool]]:
    """``(config key, URL, written)`` for every object-store location (``gs://``, ``s3://``, ``memory://``)
    the run reads or writes: caches, input files, checkpoints, the checkpoint to load, the log directory."""
    data = config.data
    found: list[tuple[str, str, bool]] = [("data.cache_dir", data.cache_dir or "cache/", True)]
    sources = getattr(data, "configs", None)
    if sources is None:  # one source
        found += [("data.train_urls", u, False) for u in data.train_urls]
        found += [("data.validation_urls", u, False) for u in data.validation_urls]
    else:
        for name, src in sources.items():
            found.append((data.source_cache_key(name), data.source_cache_dir(name), True))
            found += [(f"data.configs.{name}.train_urls", u, False) for u in src.train_urls]
            found += [(f"data.configs.{name}.validation_urls", u, False) for u in src.validation_urls]
    tcfg = config.trainer
    found.append(("trainer.checkpointer.base_path", tcfg.checkpointer.base_path, True))
    if tcfg.load_checkpoint_path:
        found.append(("trainer.load_checkpoint_path", tcfg.load_checkpoint_path, False))
    found.append(("trainer.log_dir", tcfg.log_dir, True))
    seen, out = set(), []
    for key, url, written in found:
        if url and fs.is_object_store(url) and (key, url) not in seen:
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
    from levanter.trainer import resolve_checkpoint

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


SEED_LIMIT = 2**32  # jax.random.PRNGKey keeps the low 32 bits (without jax_enable_x64)


def data_key(config: TrainLmConfig) -> jax.Array:
    """The key the training data is derived from: ``data_seed`` if set, else a split of ``trainer.seed``."""
    if config.data_seed is not None:
        return jax.random.PRNGKey(config.data_seed)
    return jax.random.split(jax.random.PRNGKey(config.trainer.seed), 4)[0]


__all__ = ["SEED_LIMIT", "BranchOrigin", "TrainLmConfig", "branch_origin", "check_storage_access", "data_key", "storage_locations", "validate"]
