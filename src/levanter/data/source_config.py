"""One data source's section of the data config: where its documents are and how each record is read.

:class:`LMDatasetSourceConfig` is a source as upstream Levanter writes it -- files (``train_urls`` /
``validation_urls``) or a Hugging Face dataset (``id``) -- and :class:`LmDatasetFormat` its ``format:``
section, plain text or chat. Both are parsed by draccus inside the ``data:`` section
(:mod:`levanter.data.config`, which builds caches and datasets from them); kept apart from it because a
source's fields and their checks are read on their own (the fine-tuning config builds sources directly).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from ..ingest import SourceError
from ..refused_keys import refused

__all__ = [
    "FORMAT_TYPES",
    "LmDatasetFormat",
    "TextLmDatasetFormat",
    "ChatLmDatasetFormat",
    "LMDatasetSourceConfig",
]


FORMAT_TYPES = ("text", "chat")


@dataclasses.dataclass(frozen=True)
class LmDatasetFormat:
    """``format: {type: text, text_key: ...}`` or ``format: {type: chat, messages_field: ..., chat_template:
    ...}`` as upstream writes them (one class for both: draccus reads the keys of either)."""

    # The document format: text (one string per record) or chat (a list of {role, content} messages).
    type: str = "text"
    # type text: the field of each input record (JSON line, Parquet column) that holds the document's text.
    text_key: str = "text"
    # type chat: the field of each record holding its list of messages.
    messages_field: str = "messages"
    # type chat: the Jinja chat template; null: data.chat_template, else the tokenizer's own. Assistant text
    # must sit inside {% generation %}...{% endgeneration %} (what the loss is computed on).
    chat_template: Optional[str] = None
    # type chat: train only on the assistant tokens (true), or on every token of the conversation (false).
    mask_user_turns: bool = True
    # Upstream's single-turn chat variant (first user and assistant message, no template); refused if set.
    single_turn: bool = refused("conversations are rendered whole by the chat template here; remove the key",
                                default=False)
    # Upstream's packing switch: conversations are always packed into windows of the token stream here
    # (segment ids keep them apart); false (one conversation per padded sequence) is refused.
    pack: bool = refused("sequences are windows over the packed token stream here; remove the key", default=True)

    def check(self, what: str) -> None:
        if self.type not in FORMAT_TYPES:
            raise ValueError(f"{what}.format.type: expected one of {', '.join(FORMAT_TYPES)}, got {self.type!r}")
        if self.type == "text" and self.chat_template is not None:
            raise ValueError(f"{what}.format.chat_template is set but format.type is text: set format.type: chat")


# Upstream's names for the two formats: the same class, told apart by ``type``.
TextLmDatasetFormat = LmDatasetFormat
ChatLmDatasetFormat = LmDatasetFormat


@dataclasses.dataclass(frozen=True)
class LMDatasetSourceConfig:
    """One source: files (``train_urls``/``validation_urls``: paths, fsspec URLs, globs, braces or
    ``embedded://<name>/<split>``) or, upstream's other kind, a Hugging Face dataset ``id`` (a local
    ``save_to_disk`` directory, a local directory of parquet / JSON-lines files, or a hub id when the hub is
    reachable), resolved to the files of its ``train_split`` / ``validation_split`` by
    :func:`~levanter.ingest.hf_data_files`."""

    # Training input files: paths, fsspec URLs (gs://, s3://), globs, {a,b} braces or embedded://NAME/SPLIT.
    train_urls: List[str] = dataclasses.field(default_factory=list)
    # Validation input files, in the same forms; empty: no evaluation on this source.
    validation_urls: List[str] = dataclasses.field(default_factory=list)
    # This source's token cache directory; null: <data.cache_dir>/<source name> (a mixture's source).
    cache_dir: Optional[str] = None
    # Labels for evaluation: eval/<tag>/loss and eval/<tag>/bpb average over the sources carrying a tag.
    tags: Optional[List[str]] = None
    # The document format section: type text (text_key) or chat (messages_field, chat_template, ...); a
    # text_key given directly wins for text.
    format: Optional[LmDatasetFormat] = None
    # The field holding each document's text; null: format.text_key, else data.text_key, else "text".
    text_key: Optional[str] = None
    # A Hugging Face dataset instead of urls: a hub id, a save_to_disk directory or a data-file directory.
    id: Optional[str] = None
    # The Hugging Face dataset's configuration name, used with id (null: its default configuration).
    name: Optional[str] = None
    # The split of the Hugging Face dataset (id) to train on.
    train_split: str = "train"
    # The split of the Hugging Face dataset (id) to evaluate on; a dataset without it has no validation set.
    validation_split: str = "validation"
    # Upstream's list of the Hugging Face dataset's splits to read (null: train_split and validation_split);
    # a split not listed is not read, so leaving out the validation split means no validation set.
    splits: Optional[List[str]] = None
    # Stream the Hugging Face dataset rather than download it (upstream, with id); refused if set.
    stream: bool = refused(
        "files are read one at a time here (a hub dataset's files are downloaded first); remove the key",
        default=True,
    )

    @property
    def is_chat(self) -> bool:
        return self.format is not None and self.format.type == "chat"

    def resolved_text_key(self, default: Optional[str]) -> str:
        """The record field holding each document: a chat source's ``format.messages_field``; for text the
        source's ``text_key``, else its ``format.text_key``, else the task-level one, else "text"."""
        if self.format is not None:
            self.format.check("data")
        if self.is_chat:
            return self.format.messages_field
        if self.text_key is not None:
            return self.text_key
        if self.format is not None:
            return self.format.text_key
        return default if default is not None else "text"

    def chat_spec(self, tokenizer, default_template: Optional[str], what: str):
        """The :class:`~levanter.ingest.ChatSpec` of a chat source (its template resolved and checked, errors
        naming ``what``), None for text."""
        if not self.is_chat:
            return None
        from ..ingest import ChatSpec, resolve_chat_template

        fmt = self.format
        template = fmt.chat_template if fmt.chat_template is not None else default_template
        template = resolve_chat_template(tokenizer, template, mask_user_turns=fmt.mask_user_turns,
                                         what=f"{what}.format")
        return ChatSpec(fmt.messages_field, template, fmt.mask_user_turns)

    def urls(self, split: str, what: str = "data") -> List[str]:
        """The input files of ``split`` ("train" or "validation"); ``what`` names the source in errors."""
        if self.id is not None:
            from ..ingest import hf_data_files

            if self.train_urls or self.validation_urls:
                raise SourceError(
                    f"{what}: set either id (a Hugging Face dataset) or train_urls/validation_urls, not both"
                )
            hf_split = self.train_split if split == "train" else self.validation_split
            if self.splits is not None and hf_split not in self.splits:
                if split == "train":
                    raise SourceError(
                        f"{what}.splits={list(self.splits)!r} leaves out the training split "
                        f"{what}.train_split={hf_split!r}: list it, or set train_split to one of the splits"
                    )
                return []
            return hf_data_files(self.id, self.name, hf_split, what=what, required=split == "train")
        return list(self.train_urls if split == "train" else self.validation_urls)
