"""The language-model interface the trainer sees: a config registry, an abstract model, and the loss.

* :class:`LmConfig` is a draccus choice registry. Each architecture registers its frozen-dataclass
  config under a name (``@LmConfig.register_subclass("gpt2")``) and a YAML ``model:`` block selects
  one with ``type: gpt2``. Every config has ``seq_len``, the axes ``Pos`` / ``KeyPos`` / ``Embed``,
  ``build(Vocab, key=...)``, ``flops_per_token(vocab_size)`` and ``max_seq_len``.
* :class:`LmHeadModel` is the abstract Equinox module every architecture implements: token ids in,
  logits out, with optional ``segment_ids`` for packed sequences.
* :func:`next_token_loss` is the causal-LM objective on those logits.

Axis names are shared by every model in this package (the trainer's axis mapping refers to them):
``batch``, ``position``, ``key_position``, ``embed``, ``heads``, ``kv_heads``,
``q_heads_per_group``, ``head_size``, ``mlp``, ``vocab``, ``layers``.

The vocabulary size is not part of the model config: it belongs to the tokenizer, so ``build`` and
``flops_per_token`` take it as an argument.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp

import haliax as hax
from haliax import Axis, NamedArray

POS = "position"
KEY_POS = "key_position"
EMBED = "embed"
VOCAB = "vocab"
LAYERS = "layers"


class LmConfig(abc.ABC, draccus.ChoiceRegistry):
    """Abstract base of model configs. Subclasses are frozen dataclasses registered by name.

    Subclasses must provide the dataclass fields ``seq_len`` and ``hidden_dim`` (upstream names) and
    implement :meth:`build` and :meth:`flops_per_token`.
    """

    seq_len: int
    hidden_dim: int

    # Architectures with learned absolute positions cannot run past their table; others (RoPE) can.
    has_hard_seq_len_limit: ClassVar[bool] = False

    @property
    def Pos(self) -> Axis:
        return Axis(POS, self.seq_len)

    @property
    def KeyPos(self) -> Axis:
        return Axis(KEY_POS, self.seq_len)

    @property
    def Embed(self) -> Axis:
        return Axis(EMBED, self.hidden_dim)

    @property
    def max_seq_len(self) -> int | None:
        """The longest input the architecture accepts, or None if it has no hard limit."""
        return self.seq_len if self.has_hard_seq_len_limit else None

    @abc.abstractmethod
    def build(self, Vocab: Axis, *, key) -> "LmHeadModel":
        """A freshly initialised model for this config and vocabulary."""

    @abc.abstractmethod
    def flops_per_token(self, vocab_size: int) -> float:
        """Training (forward + backward) FLOPs per token, for MFU: 3 x the forward FLOPs.

        The forward count is 2 FLOPs per matmul weight (the lm head included, embedding lookups not)
        plus the attention score and weighted-sum matmuls over a full ``seq_len`` x ``seq_len`` map
        (the Megatron convention: causal masking is not credited as a saving).
        """


class LmHeadModel(eqx.Module):
    """Abstract causal language model: ``input_ids[..., position] -> logits[..., position, vocab]``.

    ``segment_ids`` (same axes as ``input_ids``) mark packed documents: position ``q`` attends to
    ``k`` only if ``k <= q`` and both have the same segment id. ``key`` enables dropout (where the
    architecture has any); ``key=None`` means deterministic evaluation.
    """

    config: eqx.AbstractVar[LmConfig]
    Vocab: eqx.AbstractVar[Axis]

    @property
    def Pos(self) -> Axis:
        return self.config.Pos

    @property
    def KeyPos(self) -> Axis:
        return self.config.KeyPos

    @property
    def Embed(self) -> Axis:
        return self.config.Embed

    @abc.abstractmethod
    def __call__(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> NamedArray: ...

    def compute_next_token_loss(
        self,
        input_ids: NamedArray,
        loss_mask: NamedArray | None = None,
        segment_ids: NamedArray | None = None,
        *,
        key=None,
        reduction: str | None = "mean",
        z_loss_weight: float = 0.0,
    ):
        """Forward pass plus :func:`next_token_loss` on the same tokens."""
        logits = self(input_ids, segment_ids, key=key)
        return next_token_loss(logits, input_ids, loss_mask, reduction=reduction, z_loss_weight=z_loss_weight)


def check_input_length(config: LmConfig, input_ids: NamedArray) -> Axis:
    """The input's position axis, after checking it fits the architecture's hard limit (if any)."""
    Pos = input_ids.resolve_axis(POS)
    limit = config.max_seq_len
    if limit is not None and Pos.size > limit:
        raise ValueError(
            f"input has {Pos.size} positions but the model supports at most {limit} (model.seq_len)"
        )
    return Pos


def next_token_loss(
    logits: NamedArray,
    tokens: NamedArray,
    loss_mask: NamedArray | None = None,
    *,
    reduction: str | None = "mean",
    z_loss_weight: float = 0.0,
):
    """Cross entropy of predicting ``tokens[t + 1]`` from ``logits[t]``, computed in float32.

    Args:
        logits: ``[..., position, vocab]``.
        tokens: integer ``[..., position]``, the same sequence the logits were computed from.
        loss_mask: ``[..., position]``; position ``t`` counts iff it is true (non-zero values are
            accepted and treated as true). The last position never counts: it has no next token.
            None means every position but the last counts.
        reduction: ``"mean"`` (over counted positions; 0 if none count), ``"sum"``,
            ``"sum_and_count"`` for ``(sum, number of counted positions as float32)`` (what a trainer
            needs to combine microbatches into the exact mean over a step), or ``None`` / ``"none"``
            for the per-position loss ``[..., position]`` with zeros where positions do not count.
        z_loss_weight: if non-zero, adds ``z_loss_weight * logsumexp(logits[t])**2`` per counted
            position (PaLM's z-loss, keeps the softmax normaliser near 1).
    """
    Vocab = logits.resolve_axis(VOCAB)
    Pos = tokens.resolve_axis(POS)
    logits = logits.astype(jnp.float32)

    targets = hax.roll(tokens, -1, Pos)
    not_last = hax.arange(Pos) < Pos.size - 1
    if loss_mask is None:
        valid = not_last.broadcast_axis(tokens.axes)
    else:
        # jax >= 0.8 rejects non-boolean `where=` masks, so normalise to bool here once.
        if loss_mask.dtype != jnp.bool_:
            loss_mask = loss_mask != 0
        valid = loss_mask & not_last

    log_z = hax.nn.logsumexp(logits, Vocab)
    # take() with an index that shares the batch/position axes gathers per position (take_along_axis),
    # so the loss never materialises a one-hot [.., vocab] target.
    target_logit = logits.take(Vocab, targets)
    per_pos = log_z - target_logit
    if z_loss_weight:
        per_pos = per_pos + z_loss_weight * hax.square(log_z)
    per_pos = hax.where(valid, per_pos, 0.0)

    if reduction is None or reduction == "none":
        return per_pos
    total = hax.sum(per_pos).scalar()
    if reduction == "sum":
        return total
    count = hax.sum(valid.astype(jnp.float32)).scalar()
    if reduction == "sum_and_count":
        return total, count
    if reduction == "mean":
        return total / jnp.maximum(count, 1.0)
    raise ValueError(f"reduction must be 'mean', 'sum', 'sum_and_count' or None, got {reduction!r}")


def parameter_shapes(config: LmConfig, vocab_size: int):
    """The model ``config.build`` would make, as ``jax.ShapeDtypeStruct`` leaves: traced with
    ``jax.eval_shape``, so nothing is allocated however large the model (for memory estimates)."""
    return jax.eval_shape(lambda key: config.build(Axis(VOCAB, vocab_size), key=key), jax.random.PRNGKey(0))


def tree_nbytes(tree, dtype=None) -> int:
    """Bytes of the floating-point leaves of ``tree`` (arrays or shape structs), each counted at ``dtype``
    if given (the training precision of the parameters), else at its own dtype."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape, leaf_dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or leaf_dtype is None or not jnp.issubdtype(leaf_dtype, jnp.inexact):
            continue
        size = 1
        for d in shape:
            size *= int(d)
        total += size * jnp.dtype(dtype if dtype is not None else leaf_dtype).itemsize
    return total


def split_key(key, n: int):
    """``n`` keys from ``key``, or ``n`` Nones when ``key`` is None (deterministic mode)."""
    if key is None:
        return (None,) * n
    return tuple(jax.random.split(key, n))
