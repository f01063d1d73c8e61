"""Mistral: a Llama decoder whose attention looks back over a sliding window.

Registered as ``type: mistral`` (upstream Levanter's name and field names). The block, the parameters and
their axes are Llama's (:mod:`levanter.models.llama`); a Mistral model is a ``LlamaLMHeadModel`` whose config
is a :class:`MistralConfig`. The one addition is ``sliding_window``: every layer's query at position ``q``
attends to key positions ``q - sliding_window + 1 .. q`` only (transformers' convention), in whichever
``attn_backend`` runs (:mod:`levanter.models.attention` applies the window in each; ``jax_flash`` and
``splash`` skip the key blocks outside it). A window at least as long as the sequence changes nothing and is
not applied; ``null`` means none (Mistral 7B v0.2 and later releases).

Defaults are Mistral 7B v0.1's shape (8 key/value heads, a 14336-wide MLP, a 4096-position window, norm
epsilon 1e-6). FLOPs per token are Llama's, over the full ``seq_len`` x ``seq_len`` map, as for every model
here (:meth:`LmConfig.flops_per_token`): the window's saving is not credited, so MFU stays comparable with
the same shape without a window.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .llama import LlamaConfig
from .lm_model import LmConfig

__all__ = ["MistralConfig", "SlidingWindowAttention"]


class SlidingWindowAttention:
    """The ``sliding_window`` of a Llama variant whose every layer attends over a window (Mistral, Mixtral):
    the config's ``attention_window``, and its check. Listed before :class:`LlamaConfig` among a config's bases,
    so that this ``attention_window`` replaces Llama's."""

    def check_sliding_window(self) -> None:
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(
                f"model.sliding_window must be a positive number of positions (or null for none), got {w!r}"
            )

    @property
    def attention_window(self) -> Optional[int]:
        return self.sliding_window


@LmConfig.register_subclass("mistral")
@dataclasses.dataclass(frozen=True)
class MistralConfig(SlidingWindowAttention, LlamaConfig):
    """A Mistral decoder: Llama with sliding-window attention."""

    seq_len: int = 8192
    intermediate_dim: int = 14336
    # Key/value heads (grouped-query attention): num_heads must be a multiple of it.
    num_kv_heads: int = 8
    layer_norm_epsilon: float = 1e-6
    # Each query attends to its own and the sliding_window - 1 positions before it; null: the whole prefix.
    sliding_window: Optional[int] = 4096

    def __post_init__(self):
        super().__post_init__()
        self.check_sliding_window()
