"""Chat-formatted documents: a conversation rendered by a chat template into token ids and a loss mask.

A chat source's documents are lists of messages (``[{"role": ..., "content": ...}, ...]``, under the record
field ``format.messages_field``). Each is rendered by a Jinja chat template (``format.chat_template``, else
``data.chat_template``, else the ``chat_template`` of the tokenizer's ``tokenizer_config.json``) and
tokenized by transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``: the template
marks the text to train on with ``{% generation %} ... {% endgeneration %}`` (transformers' convention), and
every token whose characters lie in such a span is an assistant token. The per-token mask is what the cache
stores beside the token ids (``loss_mask/``, one ``uint8`` per token); the data layer turns it into the
next-token loss mask (:func:`levanter.data.text.causal_lm_columns`).

:class:`ChatSpec` is what a chat cache depends on beyond the tokenizer (the field, the template, whether user
turns are masked) and is recorded in its ledger, so a text cache is never read as a chat cache or the other
way round. :class:`ChatTokenizer` is the tokenizer handed to the build's encoders (in this process, in pool
workers or in Ray tasks): it pickles with its spec, and :func:`~levanter.ingest.tokenize_worker.encode` asks it
for ids and masks.

Trade-offs: rendering goes through transformers (the ``hf`` extra), wrapping our ``tokenizers`` tokenizer,
so the template semantics (``{% generation %}``, ``raise_exception``, the ``messages`` variable) are exactly
Hugging Face's; a template without a generation block cannot mark assistant tokens and is refused unless
``mask_user_turns`` is false (then every token is trained on). Templates add their own special tokens
(BOS, end-of-turn); the builder still appends EOS to each conversation when ``enforce_eos`` is on, and that
EOS is not an assistant token.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from .errors import SourceError

__all__ = ["ChatSpec", "ChatTokenizer", "has_generation_block", "resolve_chat_template"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_block(template: str) -> bool:
    """Whether ``template`` marks assistant text with ``{% generation %}`` (transformers' convention)."""
    return bool(_GENERATION.search(template))


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    """What a chat cache's content depends on besides the tokenizer: recorded in its ledger."""

    messages_field: str
    chat_template: str
    mask_user_turns: bool = True

    def record(self) -> dict:
        return dataclasses.asdict(self)


def resolve_chat_template(tokenizer, configured: Optional[str], *, mask_user_turns: bool, what: str) -> str:
    """The template a chat source is rendered with: ``configured``, else the tokenizer's own; refused (naming
    ``what``, the config key) when there is none, or when it has no generation block and user turns are
    masked."""
    template = configured if configured is not None else tokenizer.chat_template
    if not template:
        raise ValueError(
            f"{what}: no chat template: the tokenizer {tokenizer.name!r} has none (no "
            "chat_template in its tokenizer_config.json); set format.chat_template or data.chat_template "
            "(chat_template in a fine-tuning config) to a Jinja template"
        )
    if mask_user_turns and not has_generation_block(template):
        raise ValueError(
            f"{what}: the chat template has no {{% generation %}} block, so the assistant tokens to train on "
            "cannot be told apart: wrap the assistant content in {% generation %}...{% endgeneration %} (set "
            "format.chat_template or data.chat_template; chat_template in a fine-tuning config), or set "
            "format.mask_user_turns: false to train on every token"
        )
    return template


class ChatTokenizer:
    """A tokenizer and a :class:`ChatSpec`: what the build's encoders call to tokenize conversations."""

    def __init__(self, base, spec: ChatSpec):
        self.base = base
        self.spec = spec
        self.name = base.name
        self.vocab_size = base.vocab_size
        self.eos_token_id = base.eos_token_id
        self.bos_token_id = base.bos_token_id
        self._hf = None

    def __getstate__(self):
        return {"base": self.base, "spec": self.spec}

    def __setstate__(self, state):
        self.__init__(state["base"], state["spec"])

    def fingerprint(self) -> dict:
        return {**self.base.fingerprint(), "chat": self.spec.record()}

    def _transformers(self):
        if self._hf is None:
            backend = self.base.backend
            if backend is None:
                raise ValueError(
                    f"chat-formatted data needs a Hugging Face tokenizer (a tokenizer.json), not {self.name!r}"
                )
            try:
                from transformers import PreTrainedTokenizerFast
            except ImportError:
                raise ValueError(
                    "chat-formatted data is rendered with transformers' chat templates: install levanter[hf]"
                ) from None
            self._hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        return self._hf

    def encode_chats(self, docs: list, shard: str, where: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(flat int32 ids, int64 lengths, flat uint8 assistant mask)`` of the conversations ``docs``."""
        for k, doc in enumerate(docs):
            _check_conversation(doc, shard, where[k], self.spec.messages_field)
        hf = self._transformers()
        try:
            out = hf.apply_chat_template(
                list(docs), tokenize=True, chat_template=self.spec.chat_template, return_dict=True,
                return_assistant_tokens_mask=self.spec.mask_user_turns,
            )
        except Exception as e:  # noqa: BLE001 -- a template error (raise_exception) names no document
            raise SourceError(
                f"{shard}, {where[0]}..{where[-1]}: the chat template failed to render a conversation "
                f"({type(e).__name__}: {e})"
            ) from None
        ids = out["input_ids"]
        masks = out["assistant_masks"] if self.spec.mask_user_turns else [[1] * len(x) for x in ids]
        for k, m in enumerate(masks):
            if not any(m):
                raise SourceError(
                    f"{shard}, {where[k]}: the conversation has no assistant tokens to train on (no message the "
                    "chat template renders inside {% generation %}); drop it or fix its roles"
                )
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(lengths.sum()))
        mask = np.fromiter((t for x in masks for t in x), dtype=np.uint8, count=int(lengths.sum()))
        return flat, lengths, mask


def _check_conversation(doc, shard: str, where: str, field: str) -> None:
    if not isinstance(doc, list) or not doc:
        raise SourceError(
            f"{shard}, {where}: {field!r} (format.messages_field) must be a non-empty list of messages, got "
            f"{type(doc).__name__}"
        )
    for i, m in enumerate(doc):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise SourceError(
                f"{shard}, {where}: message {i} of {field!r} is not a {{\"role\": ..., \"content\": ...}} object"
            )
