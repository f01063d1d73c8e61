"""Data configuration for language-model training, with upstream Levanter's field names.

Two shapes, parsed by draccus from the ``data:`` section of a config:

* :class:`UrlSingleDatasetLMConfig` (alias ``LMDatasetConfig``): one source -- ``train_urls``,
  ``validation_urls``, ``cache_dir``, ``tokenizer``, ``text_key``, ``shuffle``, ...
* :class:`LMMixtureDatasetConfig`: ``configs: {name: source}``, ``train_weights`` (a mapping, or a list of
  ``[step, {name: weight}]`` in **training steps**), ``mixture_block_size``, ``stop_strategy``, ...

``train_set(seq_len, batch_schedule, key=...)`` turns a config into the training
:class:`~levanter.data.dataset.AsyncDataset` (building token caches on first use): per-source shuffles
sit *below* the mixture, never above it, so the mixture alone decides which step sees which source.
``validation_sets(seq_len)`` gives one unshuffled dataset per source with validation data.

A source's ``format`` is plain text (``type: text``, one string per record under ``text_key``) or chat
(``type: chat``, upstream's ``ChatLmDatasetFormat`` names: a list of messages per record under
``messages_field``, rendered by ``chat_template`` -- else ``data.chat_template``, else the tokenizer's -- and
trained only on the assistant tokens the template marks; :mod:`levanter.ingest.chat`). A chat source's cache
holds a loss mask beside its tokens, and its examples carry it.

Fields upstream has but this fork does not implement (``target_budget``, ``experiment_budget``,
``max_train_batches``, ``num_validation_sequences``, the single-turn and unpacked chat variants) are accepted
by the parser so configs load, and refused with a clear error if set -- never silently ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Dict, List, Optional, Tuple, Union

from ..refused_keys import check_refused, refused
from ..schedule import BatchSchedule, as_int
from ..utils import fs
from ._prp import derive_seed, seed_from_key
from .dataset import AsyncDataset
from .mixture import MixtureDataset
from .mixture_weights import STOP_STRATEGIES
from .source_config import LMDatasetSourceConfig
from ..ingest import CacheOptions, check_embedded_url, expand_urls
from .text import CausalLmDataset, TokenMaskSeqDataset, TokenSeqDataset

__all__ = [
    "LMTaskConfig",
    "UrlSingleDatasetLMConfig",
    "LMDatasetConfig",
    "TrainWeights",
    "LMMixtureDatasetConfig",
    "DataConfig",
    "MIXTURE_EPOCH_ERROR",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LMTaskConfig:
    """Settings shared by single-source and mixture data configs (upstream names)."""

    # Tokenizer: a Hugging Face name or local directory, "byte" (256 byte values) or "passthrough".
    tokenizer: str = "gpt2"
    # Vocabulary size, needed by the passthrough tokenizer (token ids read as they are).
    vocab_size: Optional[int] = None
    # Where token caches are built and found (a mixture's sources in subdirectories by name).
    cache_dir: Optional[str] = "cache/"
    # How caches are built: the backend (process pool or Ray), tokenizer workers, documents per batch.
    cache_options: CacheOptions = dataclasses.field(default_factory=CacheOptions)
    # Append the tokenizer's end-of-sequence token to every document that lacks it.
    enforce_eos: bool = True
    # The field holding each document's text, for sources that name none; null: "text".
    text_key: Optional[str] = None
    # Shuffle the training data: true (a full permutation), an int (shuffle within eras of that many
    # sequences), or false (read in order). A change alters every step's data: a resumed run refuses it.
    shuffle: Union[bool, int] = False
    # Upstream's permutation kind: feistel (used here) or linear (accepted; a Feistel permutation is used).
    permutation_type: Optional[str] = None
    # Upstream's token id excluded from the loss; refused if set.
    ignore_token_id: Optional[int] = refused("the loss covers every position here; remove the key")
    # The chat template of chat-format sources that set no format.chat_template; null: the tokenizer's own.
    chat_template: Optional[str] = None

    # -- shared machinery --------------------------------------------------------------------------
    def the_tokenizer(self):
        from ..ingest import load_tokenizer

        try:
            return load_tokenizer(self.tokenizer, vocab_size=self.vocab_size)
        except ValueError as e:
            raise ValueError(f"data.tokenizer: {e}") from None

    def _check_task_fields(self) -> None:
        check_refused(self, "data")  # keys accepted from upstream configs, set to what is not built here
        try:
            self.cache_options.check()
        except ValueError as e:
            raise ValueError(f"data.{e}") from None
        if self.permutation_type not in (None, "feistel", "linear"):
            raise ValueError(f"data.permutation_type: expected 'feistel' or 'linear', got {self.permutation_type!r}")
        if self.permutation_type == "linear":
            logger.warning("data.permutation_type=linear: this fork always uses a Feistel permutation")
        if isinstance(self.shuffle, int) and not isinstance(self.shuffle, bool) and self.shuffle < 1:
            raise ValueError(f"data.shuffle: an int shuffle is a block size and must be >= 1, got {self.shuffle}")

    def _cache(
        self, source: LMDatasetSourceConfig, cache_dir: str, split: str, tokenizer, what: str, cache_key: str
    ):
        from ..ingest import build_or_load_cache

        urls = source.urls(split, what.rsplit(".", 1)[0])
        if not urls:
            return None
        chat = source.chat_spec(tokenizer, self.chat_template, what.rsplit(".", 1)[0])
        return build_or_load_cache(
            urls,
            fs.join(cache_dir, split),
            tokenizer,
            text_key=source.resolved_text_key(self.text_key),
            enforce_eos=self.enforce_eos,
            options=self.cache_options,
            embedded_dir=fs.join(cache_dir, "_embedded"),
            what=what,
            cache_key=cache_key,
            chat=chat,
        )

    def _check_source_inputs(
        self, source: LMDatasetSourceConfig, cache_dir: str, what: str, cache_key: str
    ) -> None:
        """Before any cache is built: missing files, empty globs and directories among the inputs, and an
        unwritable cache directory, for caches still to be built; for finished ones, inputs that changed
        since (a finished cache needs no files, but must not be served over edited ones)."""
        from ..ingest import check_writable, verify_inputs
        from ..store import CacheLedger

        source.resolved_text_key(self.text_key)  # format.type
        if source.is_chat:  # the template, before any cache is built
            source.chat_spec(self.the_tokenizer(), self.chat_template, what)
        for split in ("train", "validation"):
            urls = source.urls(split, what)
            if not urls:
                continue
            for u in urls:
                if u.startswith("embedded://"):
                    check_embedded_url(u, what=f"{what}.{split}_urls")
            split_dir = fs.join(cache_dir, split)
            try:
                ledger = CacheLedger.load(split_dir)
            except fs.StorageAccessError as e:
                raise fs.StorageAccessError(f"{cache_key}: {e}") from None
            if ledger is not None and ledger.is_finished:
                verify_inputs(split_dir, ledger, urls, what=f"{what}.{split}_urls",
                              full=self.cache_options.verify_inputs == "full")
                continue
            expand_urls([u for u in urls if not u.startswith("embedded://")] or [], what=f"{what}.{split}_urls",
                        allow_empty=True)
            check_writable(split_dir, cache_key)

    def _dataset(self, cache, seq_len: int, tokens_only: bool = False) -> AsyncDataset:
        vocab_size = cache.metadata.get("vocab_size")
        if cache.mask_store is not None:  # a chat cache: its examples carry the loss mask
            tokens = TokenMaskSeqDataset(cache.store, cache.mask_store, seq_len, vocab_size=vocab_size)
            tokens_only = False
        else:
            tokens = TokenSeqDataset(cache.store, seq_len, vocab_size=vocab_size)
        if len(tokens) == 0:
            raise ValueError(
                f"the cache at {cache.cache_dir!r} has {cache.store.data_size} tokens, fewer than one sequence "
                f"of seq_len={seq_len}"
            )
        return CausalLmDataset(tokens, cache.eos_id, tokens_only=tokens_only)

    def _shuffled(self, ds: AsyncDataset, seed: int) -> AsyncDataset:
        if self.shuffle is True:
            return ds.shuffle(key=seed)
        if self.shuffle is False:
            return ds
        return ds.block_shuffle(int(self.shuffle), key=seed)


@dataclasses.dataclass(frozen=True)
class UrlSingleDatasetLMConfig(LMTaskConfig, LMDatasetSourceConfig):
    """A single source (upstream ``LMDatasetConfig`` / ``UrlSingleDatasetLMConfig``)."""

    def validate(self, *, num_train_steps: int) -> None:
        self._check_task_fields()
        if not self.train_urls and self.id is None:
            raise ValueError("data.train_urls is empty: nothing to train on")
        self.eval_tags()

    def eval_tags(self) -> Dict[str, Tuple[str, ...]]:
        """``{"": tags}``: the source's checked ``tags`` (eval metrics per tag, :mod:`levanter.training.eval`)."""
        from .tags import check_tags

        return {"": check_tags(self.tags, "data.tags")}

    def check_inputs(self) -> None:
        self._check_source_inputs(self, self.cache_dir or "cache/", "data", "data.cache_dir")

    def build_caches(self, split: str = "train"):
        self._check_task_fields()
        tokenizer = self.the_tokenizer()
        cache_dir = self.cache_dir or "cache/"
        return self._cache(self, cache_dir, split, tokenizer, f"data.{split}_urls", "data.cache_dir")

    def has_chat_sources(self) -> bool:
        """Whether the training data is chat-formatted (its examples carry a loss mask of their own)."""
        return self.is_chat

    def train_eos_ids(self) -> set:
        """The EOS ids the training caches were built with (a set: one id when they agree)."""
        cache = self.build_caches("train")
        return set() if cache is None else {cache.eos_id}

    def train_set(
        self, seq_len: int, batch_schedule: BatchSchedule | int, *, key, tokens_only: bool = False,
        epochs: int = 0,
    ) -> AsyncDataset:
        """The training examples; ``tokens_only``: ``{tokens}`` alone (see :class:`CausalLmDataset`).

        ``epochs`` (``train_lm``'s top-level ``epoch``, upstream's meaning): above 0, the (shuffled) examples
        repeat in the same order up to that many times (:class:`~levanter.data.dataset.EpochDataset`, an
        index map ``i -> i mod len``); 0: they are read once."""
        cache = self.build_caches("train")
        if cache is None:
            raise ValueError("data.train_urls is empty: nothing to train on")
        ds = self._shuffled(self._dataset(cache, seq_len, tokens_only), derive_seed(seed_from_key(key), 0))
        return ds.epochs(max_epochs=epochs) if epochs > 0 else ds

    def validation_sets(self, seq_len: int) -> Dict[str, AsyncDataset]:
        cache = self.build_caches("validation")
        return {} if cache is None else {"": self._dataset(cache, seq_len)}


LMDatasetConfig = UrlSingleDatasetLMConfig

def _name_id(name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


TrainWeights = Union[Dict[str, float], List[Tuple[int, Dict[str, float]]]]


@dataclasses.dataclass(frozen=True)
class LMMixtureDatasetConfig(LMTaskConfig):
    """A mixture of named sources; ``train_weights`` stages are in **training steps**."""

    # The sources, by name (a name is also the subdirectory of data.cache_dir holding its cache).
    configs: Dict[str, LMDatasetSourceConfig] = dataclasses.field(default_factory=dict)
    # Each source's weight: {name: weight}, or stages [[start_step, {name: weight}], ...] in training steps.
    train_weights: TrainWeights = dataclasses.field(default_factory=dict)
    # When a source runs out: restart (wrap it), first_exhausted (stop the data), all_exhausted.
    stop_strategy: str = "restart"
    # Sequences per block whose composition is fixed by the weights; null: one block per batch (exact).
    mixture_block_size: Optional[int] = 2048
    # Upstream's token budget for sub-sampling sources; refused if set.
    target_budget: Optional[int] = refused("bound the run with trainer.num_train_steps instead")
    # Upstream's experiment token budget (with target_budget); refused if set.
    experiment_budget: Optional[int] = refused("bound the run with trainer.num_train_steps instead")
    # Upstream's per-source cap on training batches; refused if set.
    max_train_batches: Optional[Dict[str, int]] = refused("shape the mixture with data.train_weights instead")
    # Upstream's per-source cap on validation sequences; refused if set.
    num_validation_sequences: Optional[Dict[str, int]] = refused(
        "cap evaluation with trainer.max_eval_batches instead"
    )

    def stages(self) -> list:
        """``train_weights`` as ``[(start_step, {name: weight})]``, validated against ``configs``."""
        w = self.train_weights
        # A start is taken as written: 2.5 is refused, never truncated to 2 (that would move the switch).
        stages = [(0, dict(w))] if isinstance(w, dict) else [
            (as_int(s, what="data.train_weights: a stage's start step"), dict(m)) for s, m in w
        ]
        for _, mapping in stages:
            for name in mapping:
                if name not in self.configs:
                    raise ValueError(
                        f"data.train_weights: unknown source {name!r}; data.configs has {sorted(self.configs)}"
                    )
        return stages

    def _check(self) -> None:
        self._check_task_fields()
        if not self.configs:
            raise ValueError("data.configs is empty: a mixture needs at least one source")
        from .mixture_weights import stage_schedule

        stages = self.stages()  # its errors name data.train_weights already
        try:
            stage_schedule(stages, list(self.configs))
        except ValueError as e:
            # The mixture's messages say "weights..."; here the key is data.train_weights.
            why = re.sub(r"^weights:? ", "", str(e))
            raise ValueError(f"data.train_weights: {why}") from None
        if self.stop_strategy not in STOP_STRATEGIES:
            raise ValueError(f"data.stop_strategy: expected one of {STOP_STRATEGIES}, got {self.stop_strategy!r}")
        if self.mixture_block_size is not None:
            k = as_int(self.mixture_block_size, what="data.mixture_block_size")
            if k < 1:
                raise ValueError(
                    f"data.mixture_block_size: must be a positive number of sequences, or null for one block "
                    f"per batch; got {k}"
                )
        self.eval_tags()

    def eval_tags(self) -> Dict[str, Tuple[str, ...]]:
        """``{source: tags}``: each source's checked ``tags`` (eval metrics per tag, :mod:`levanter.training.eval`)."""
        from .tags import check_tags

        return {
            name: check_tags(src.tags, f"data.configs.{name}.tags", [n for n in self.configs if n != name])
            for name, src in self.configs.items()
        }

    def validate(self, *, num_train_steps: int) -> None:
        """Cross-field checks against the run length; errors name the key and a fix."""
        self._check()
        stages = self.stages()
        for start, _ in stages:
            if start >= num_train_steps:
                raise ValueError(
                    f"data.train_weights: the stage starting at step {start} would never run, since "
                    f"trainer.num_train_steps is {num_train_steps} (steps 0..{num_train_steps - 1}). Remove the stage "
                    "or train longer."
                )
        for name, src in self.configs.items():
            if src.train_urls and not any(m.get(name, 0) > 0 for _, m in stages):
                raise ValueError(
                    f"data.configs.{name} has train_urls but weight 0 in every stage of data.train_weights: give it a "
                    "weight, or drop its train_urls to keep it for validation only"
                )
            if any(m.get(name, 0) > 0 for _, m in stages) and not src.train_urls and src.id is None:
                raise ValueError(f"data.configs.{name} has a training weight but no train_urls")

    def check_inputs(self) -> None:
        for name, src in self.configs.items():
            self._check_source_inputs(src, self.source_cache_dir(name), f"data.configs.{name}",
                                      self.source_cache_key(name))

    def source_cache_dir(self, name: str) -> str:
        src = self.configs[name]
        return src.cache_dir if src.cache_dir is not None else fs.join(self.cache_dir or "cache/", name)

    def source_cache_key(self, name: str) -> str:
        """The config key that sets :meth:`source_cache_dir`, for error messages."""
        own = self.configs[name].cache_dir is not None
        return f"data.configs.{name}.cache_dir" if own else "data.cache_dir"

    def drawn_sources(self) -> List[str]:
        """Sources with a positive weight in some stage (the others only serve validation)."""
        return [n for n in self.configs if any(m.get(n, 0) > 0 for _, m in self.stages())]

    def build_caches(self, split: str = "train") -> dict:
        self._check()
        tokenizer = self.the_tokenizer()
        names = self.drawn_sources() if split == "train" else list(self.configs)
        out = {}
        for name in names:
            cache = self._cache(
                self.configs[name], self.source_cache_dir(name), split, tokenizer,
                f"data.configs.{name}.{split}_urls", self.source_cache_key(name),
            )
            if cache is None and split == "train":
                raise ValueError(f"data.configs.{name}.train_urls is empty but the source has a training weight")
            if cache is not None:
                out[name] = cache
        return out

    def has_chat_sources(self) -> bool:
        """Whether a drawn source is chat-formatted (its examples carry a loss mask of their own)."""
        return any(self.configs[n].is_chat for n in self.drawn_sources())

    def train_eos_ids(self) -> set:
        """The EOS ids the drawn sources' training caches were built with (a set: one id when they agree)."""
        return {c.eos_id for c in self.build_caches("train").values()}

    def train_set(
        self, seq_len: int, batch_schedule: BatchSchedule | int, *, key, tokens_only: bool = False,
        epochs: int = 0,
    ) -> AsyncDataset:
        """The training mixture; ``tokens_only``: examples are ``{tokens}`` alone (``CausalLmDataset``).
        ``epochs`` must be 0: a mixture repeats its sources by ``stop_strategy`` (as upstream, which refuses
        epochs for mixtures)."""
        if epochs:
            raise ValueError(MIXTURE_EPOCH_ERROR.format(epochs=epochs))
        seed = seed_from_key(key)
        caches = self.build_caches("train")
        datasets = {}
        for name in self.configs:
            if name in caches:
                # Keyed by the source's name, not its position: adding a source leaves the others' order alone.
                ds = self._dataset(caches[name], seq_len, tokens_only)
                datasets[name] = self._shuffled(ds, derive_seed(seed, 1, _name_id(name)))
        stages = [(s, {n: w for n, w in m.items() if n in datasets}) for s, m in self.stages()]
        return MixtureDataset(
            datasets,
            stages,
            batch_schedule=batch_schedule,
            block_size=self.mixture_block_size,
            key=derive_seed(seed, 2),
            stop_strategy=self.stop_strategy,
        )

    def validation_sets(self, seq_len: int) -> Dict[str, AsyncDataset]:
        return {name: self._dataset(c, seq_len) for name, c in self.build_caches("validation").items()}


DataConfig = Union[UrlSingleDatasetLMConfig, LMMixtureDatasetConfig]

MIXTURE_EPOCH_ERROR = (
    "epoch={epochs} applies to a single source (data.train_urls); a mixture (data.configs) repeats its sources "
    "by data.stop_strategy (restart, the default, wraps each source that runs out): remove epoch"
)
