"""Upstream Levanter's supervised fine-tuning config, and its mapping onto a :class:`~levanter.lm_config.TrainLmConfig`.

:class:`SFTConfig` reads the YAML of upstream's ``levanter.main.sft`` with upstream's key names
(``supervised_data`` as one source or ``{name: source}``, ``chat_train_urls``, ``messages_field``,
``mixture_weights``, ``mixture_block_size``, ``stop_strategy``, ``max_seq_len``, ``tokenizer``,
``model_name_or_path``, ``initialize_from_hf``, ``hf_save_path``, ``hf_save_steps``, ``epoch``, ``trainer``,
``model``, ``optimizer``, ...). :func:`to_train_lm_config` turns it into the ``TrainLmConfig`` that
``python -m levanter.main.train_lm`` would run -- the same training (:mod:`levanter.run`), no loop of its
own -- whose data is chat-formatted (``format: {type: chat}``, :mod:`levanter.ingest.chat`): every
conversation rendered by the tokenizer's chat template (or ``chat_template``), and the loss taken on the
assistant tokens only.

How the keys map (differences from upstream are deliberate and listed, never silent):

* one ``supervised_data`` source -> ``data`` (``train_urls`` from ``chat_train_urls`` or the source's own,
  ``cache_dir``); a mapping of sources -> a mixture (``data.configs``) weighted by ``mixture_weights`` (equal
  weights when unset), with ``mixture_block_size`` and ``stop_strategy``. A source of weight 0 is not
  trained on: its ``train_urls`` are dropped (upstream never reads them either);
* the data is shuffled (upstream permutes its SFT set), seeded by ``data_seed`` or ``trainer.seed``;
* conversations are packed into windows of ``max_seq_len`` tokens of the token stream, kept apart by
  segment ids, where upstream packs whole conversations into padded sequences: a conversation longer than
  a window continues into the next one;
* ``max_seq_len`` sets ``model.seq_len``; ``initialize_from_hf: true`` starts from ``model_name_or_path``
  (a string names the checkpoint itself), with the model's shape taken from its ``config.json`` as upstream
  does; without it the model starts fresh (upstream insists on ``trainer.initialize_from``, which works
  here too);
* ``hf_save_steps: 0`` (upstream's default) exports only at the end of the run, where ``hf_save_path`` is set.

* ``reinit_tokens`` (a list of tokens, or ``true`` for Llama 3's chat tokens) redraws those tokens' rows of
  the embedding and output head before the first step (:func:`levanter.models.reinit_token_rows`), after
  any ``initialize_from_hf``, never on resume.

Refused by name (:mod:`levanter.refused_keys`): ``dataset_type: huggingface`` (a hub dataset, which needs the
network; give the files as ``chat_train_urls`` or a source's ``train_urls``), ``input_role`` /
``output_role`` other than ``user`` / ``assistant`` (the chat template decides the roles), ``epoch`` > 0,
``hf_upload``, and a supervised source's ``input_field`` / ``output_field`` (upstream's prompt/response
format).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Dict, List, Optional, Union

from levanter.data.config import LMMixtureDatasetConfig, UrlSingleDatasetLMConfig
from levanter.data.source_config import LMDatasetSourceConfig, LmDatasetFormat
from levanter.lm_config import TrainLmConfig
from levanter.models import LlamaConfig, LmConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.refused_keys import check_refused, refused
from levanter.training import TrainerConfig

__all__ = ["LLAMA3_CHAT_TOKENS", "SFT_KEYS", "SFTConfig", "SupervisedSourceConfig", "fresh_model_fn",
           "reinit_token_ids", "to_train_lm_config"]

# reinit_tokens: true -- the chat tokens of Llama 3's tokenizer that its base model never trained (upstream's list).
LLAMA3_CHAT_TOKENS = ("<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                      "<|eot_id|>")

# Top-level keys only a fine-tuning config has: a config carrying one is checked as an SFTConfig.
SFT_KEYS = ("supervised_data", "dataset_type", "chat_train_urls", "model_name_or_path", "messages_field",
            "input_role", "output_role", "max_seq_len", "reinit_tokens", "mixture_weights")

_NO_HUB_DATA = (
    "a Hugging Face hub dataset needs the network: download its JSON-lines files and give them as "
    "chat_train_urls (or a supervised_data source's train_urls) with dataset_type: chat_jsonl"
)


@dataclasses.dataclass(frozen=True)
class SupervisedSourceConfig:
    """One ``supervised_data`` source: chat JSON lines (one conversation per line) and its cache."""

    # This source's token cache directory; null: cache/ (one source) or cache/<name> (a mixture's source).
    cache_dir: Optional[str] = None
    # Training files (JSON lines, optionally compressed): paths, fsspec URLs, globs.
    train_urls: List[str] = dataclasses.field(default_factory=list)
    # Validation files, in the same forms; evaluated on the assistant tokens.
    validation_urls: List[str] = dataclasses.field(default_factory=list)
    # Labels for evaluation (eval/<tag>/loss).
    tags: Optional[List[str]] = None
    # Upstream's prompt/response (supervised) format fields; refused if set (only chat data is read).
    input_field: Optional[str] = refused("only chat-formatted data (messages_field) is read by the fine-tuning entry point")
    # Upstream's prompt/response (supervised) format fields; refused if set, as input_field.
    output_field: Optional[str] = refused("only chat-formatted data (messages_field) is read by the fine-tuning entry point")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    # Steps, batch sizes, evaluation, checkpoints, trackers, devices (as in train_lm).
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    # The architecture; with initialize_from_hf its shape comes from the checkpoint's config.json instead.
    model: LmConfig = dataclasses.field(default_factory=LlamaConfig)
    # The optimizer and its learning-rate schedule.
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    # The chat data: one source ({cache_dir, train_urls, ...}) or a mixture {name: source}.
    supervised_data: Optional[Union[SupervisedSourceConfig, Dict[str, SupervisedSourceConfig]]] = None
    # Upstream's kind of data: chat_jsonl (JSON-lines conversations); huggingface (a hub dataset) is refused.
    dataset_type: str = "chat_jsonl"
    # The training files of a single supervised_data source (upstream's spelling of its train_urls).
    chat_train_urls: Optional[List[str]] = None
    # The field of each JSON line holding its list of {role, content} messages.
    messages_field: str = "messages"
    # The role of the prompt messages; only "user" (the chat template names the roles).
    input_role: str = refused("the chat template decides the roles; rename the data's roles to user/assistant",
                              default="user")
    # The role of the messages trained on; only "assistant" (the template's {% generation %} marks them).
    output_role: str = refused("the chat template decides the roles; rename the data's roles to user/assistant",
                               default="assistant")
    # The Jinja chat template (assistant text inside {% generation %}...{% endgeneration %}); null: the
    # tokenizer's own (the chat_template of its tokenizer_config.json).
    chat_template: Optional[str] = None
    # Tokens per training sequence: sets model.seq_len.
    max_seq_len: int = 2048
    # The Hugging Face checkpoint initialize_from_hf: true starts from (a local directory or a hub id).
    model_name_or_path: str = "NousResearch/Llama-2-7b-hf"
    # The tokenizer: a local directory with tokenizer.json (and tokenizer_config.json) or a hub id.
    tokenizer: str = "NousResearch/Llama-2-7b-hf"
    # Start from a Hugging Face checkpoint: true for model_name_or_path, or the checkpoint itself; false: a
    # fresh model (or trainer.initialize_from).
    initialize_from_hf: Union[bool, str] = False
    # Export Hugging Face checkpoints to <hf_save_path>/<run id>/step-N.
    hf_save_path: Optional[str] = None
    # Steps between exports; 0: only at the end of the run.
    hf_save_steps: int = 0
    # dtype of the exported weights (float32, bfloat16, float16; default: the parameters' own).
    hf_save_dtype: Optional[str] = None
    # Upstream's hub upload of the exports; refused (upload the step-N directories yourself).
    hf_upload: Optional[str] = refused("no hub access is assumed: upload the exported step-N directory yourself")
    # Seed of the data order; null: derived from trainer.seed.
    data_seed: Optional[int] = None
    # Upstream's number of passes over the data; 0 (the data repeats as the mixture's stop_strategy says)
    # is all that is accepted.
    epoch: int = refused("bound the run with trainer.num_train_steps (a mixture restarts sources that run out)",
                         default=0)
    # Tokens whose embedding (and output) rows are drawn afresh, from the trained rows' mean and spread, before
    # the first step (never on resume): a list of token strings, or true for Llama 3's chat tokens.
    reinit_tokens: Union[List[str], bool] = False
    # With reinit_tokens: also redraw those tokens' rows of the output head (when it is not tied).
    reinit_lm_head: bool = True
    # With reinit_tokens: also redraw those tokens' rows of the token embedding.
    reinit_embeddings: bool = True
    # A mixture's weight per supervised_data source; null: equal weights.
    mixture_weights: Optional[Dict[str, float]] = None
    # Sequences per block whose composition the weights fix (a mixture).
    mixture_block_size: int = 2048
    # When a source runs out: restart (wrap it), first_exhausted or all_exhausted.
    stop_strategy: str = "restart"

    # Top-level keys of train_lm configs: a file carrying them is refused as such.
    OTHER_ENTRY_POINTS: ClassVar[Dict[str, str]] = {
        "data": "levanter.main.train_lm (run it with python -m levanter.main.train_lm)",
    }


def to_train_lm_config(config: SFTConfig) -> TrainLmConfig:
    """The :class:`TrainLmConfig` that runs ``config`` (see the module docstring for the mapping); refuses
    (``ValueError`` naming the SFT key) what it cannot map."""
    check_refused(config)
    if config.dataset_type == "huggingface":
        raise ValueError(f"dataset_type='huggingface' is not supported: {_NO_HUB_DATA}")
    if config.dataset_type != "chat_jsonl":
        raise ValueError(f"dataset_type: expected chat_jsonl, got {config.dataset_type!r}")
    if config.supervised_data is None and not config.chat_train_urls:
        raise ValueError("supervised_data is not set: give the chat data (a source, or {name: source}) and its cache_dir")
    if isinstance(config.hf_save_steps, bool) or not isinstance(config.hf_save_steps, int) or config.hf_save_steps < 0:
        raise ValueError(f"hf_save_steps must be a number of steps >= 0 (0: at the end only), got {config.hf_save_steps!r}")
    if config.max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {config.max_seq_len}")
    fmt = LmDatasetFormat(type="chat", messages_field=config.messages_field)
    data = _data(config, fmt)
    init = config.initialize_from_hf
    if init is True:
        init = config.model_name_or_path
    hf_steps = config.hf_save_steps or max(config.trainer.num_train_steps, 1)
    return TrainLmConfig(
        data=data,
        trainer=config.trainer,
        model=dataclasses.replace(config.model, seq_len=config.max_seq_len),
        optimizer=config.optimizer,
        data_seed=config.data_seed,
        initialize_from_hf=init if init else False,
        use_hf_model_config=bool(init),
        hf_save_path=config.hf_save_path,
        hf_save_steps=hf_steps,
        hf_save_dtype=config.hf_save_dtype,
    )


def _data(config: SFTConfig, fmt: LmDatasetFormat):
    sup = config.supervised_data
    common = dict(tokenizer=config.tokenizer, chat_template=config.chat_template, shuffle=True)
    if sup is None or isinstance(sup, SupervisedSourceConfig):
        sup = sup or SupervisedSourceConfig()
        if config.mixture_weights is not None:
            raise ValueError(
                "mixture_weights is set but supervised_data is one source: make supervised_data a mapping "
                "{name: source} to mix sources"
            )
        if config.chat_train_urls and sup.train_urls and list(config.chat_train_urls) != list(sup.train_urls):
            raise ValueError("chat_train_urls and supervised_data.train_urls are both set and differ: keep one")
        return UrlSingleDatasetLMConfig(
            train_urls=list(config.chat_train_urls or sup.train_urls), validation_urls=list(sup.validation_urls),
            cache_dir=sup.cache_dir or "cache/", tags=sup.tags, format=fmt, **common,
        )
    if config.chat_train_urls:
        raise ValueError(
            "chat_train_urls is set but supervised_data is a mapping of sources: give each source its train_urls"
        )
    if not sup:
        raise ValueError("supervised_data is an empty mapping: give at least one source")
    weights = dict(config.mixture_weights) if config.mixture_weights is not None else {n: 1.0 for n in sup}
    for name in weights:
        if name not in sup:
            raise ValueError(f"mixture_weights.{name}: no such source; supervised_data has {sorted(sup)}")
    sources, kept = {}, {}
    for name, src in sup.items():
        w = weights.get(name, 0)
        if w > 0:
            sources[name] = LMDatasetSourceConfig(
                train_urls=list(src.train_urls), validation_urls=list(src.validation_urls),
                cache_dir=src.cache_dir, tags=src.tags, format=fmt,
            )
            kept[name] = w
        elif src.validation_urls:  # weight 0: never trained on (upstream never reads it); evaluated
            sources[name] = LMDatasetSourceConfig(validation_urls=list(src.validation_urls), cache_dir=src.cache_dir,
                                                  tags=src.tags, format=fmt)
    if not kept:
        raise ValueError("mixture_weights: every source has weight 0; give one a positive weight")
    return LMMixtureDatasetConfig(
        configs=sources, train_weights=kept, mixture_block_size=config.mixture_block_size,
        stop_strategy=config.stop_strategy, **common,
    )


def reinit_token_ids(config: SFTConfig, tokenizer) -> list:
    """The ids of ``reinit_tokens`` in ``tokenizer`` ([] when unset); refuses a token the vocabulary lacks."""
    tokens = config.reinit_tokens
    if tokens is False or tokens is None:
        return []
    names = list(LLAMA3_CHAT_TOKENS) if tokens is True else list(tokens)
    if not names:
        raise ValueError("reinit_tokens is an empty list: name the tokens to re-initialise, or remove the key")
    backend = tokenizer.backend
    if backend is None:
        raise ValueError(f"reinit_tokens needs a Hugging Face tokenizer (tokenizer.json), not {tokenizer.name!r}")
    ids, missing = [], []
    for name in names:
        tid = backend.token_to_id(name)
        (missing.append(name) if tid is None else ids.append(int(tid)))
    if missing:
        what = "Llama 3's chat tokens (reinit_tokens: true)" if tokens is True else "reinit_tokens"
        raise ValueError(
            f"{what}: {missing} not in the vocabulary of tokenizer {tokenizer.name!r}; list tokens it has"
        )
    if not (config.reinit_embeddings or config.reinit_lm_head):
        raise ValueError("reinit_tokens is set but reinit_embeddings and reinit_lm_head are both false: nothing to do")
    return ids


def fresh_model_fn(config: SFTConfig, tokenizer):
    """The ``fresh_model`` of :func:`levanter.run.main` for ``config``'s ``reinit_tokens`` (None when unset)."""
    ids = reinit_token_ids(config, tokenizer)
    if not ids:
        return None
    from levanter.models import reinit_token_rows

    def fresh(model, key):
        return reinit_token_rows(model, ids, key, embeddings=config.reinit_embeddings, lm_head=config.reinit_lm_head)

    return fresh
