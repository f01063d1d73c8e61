"""The language-model interface the trainer sees: a config registry, an abstract model, and the loss.

* :class:`LmConfig` is a draccus choice registry. Each architecture registers its frozen-dataclass
  config under a name (``@LmConfig.register_subclass("gpt2")``) and a YAML ``model:`` block selects
  one with ``type: gpt2``. Every config has ``seq_len``, the axes ``Pos`` / ``KeyPos`` / ``Embed``,
  ``build(Vocab, key=...)``, ``flops_per_token(vocab_size)`` and ``max_seq_len``.
* :class:`LmHeadModel` is the abstract Equinox module every architecture implements: token ids in,
  logits out, with optional ``segment_ids`` for packed sequences.
* :func:`next_token_loss` is the causal-LM objective on those logits;
  :func:`blockwise_next_token_loss` computes the same loss from the hidden states and the output
  projection without materialising the ``[tokens, vocab]`` logits (``model.cross_entropy_block_size``;
  the kernel is in :mod:`levanter.models.loss`). A model splits into :meth:`LmHeadModel.activations`
  (the final hidden states) and :meth:`LmHeadModel.get_lm_head` (the ``[vocab, embed]`` projection), so
  the loss can take either path.

Axis names are shared by every model in this package (the trainer's axis mapping refers to them):
``batch``, ``position``, ``key_position``, ``embed``, ``heads``, ``kv_heads``,
``q_heads_per_group``, ``head_size``, ``mlp``, ``vocab``, ``layers``.

The vocabulary size is not part of the model config: it belongs to the tokenizer, so ``build`` and
``flops_per_token`` take it as an argument.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar, Optional, Union

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp

import haliax as hax
from haliax import Axis, NamedArray

from .attention import (
    KEY_POS,
    POS,
    SplashBlockSizes,
    check_attn_config,
    check_backend_platform,
    resolve_splash_block_sizes,
)
from .layers import check_activation, check_epsilon, check_positive, check_remat
from .loss import blockwise_logsumexp
from .token_dot import token_dot

__all__ = [
    "EMBED",
    "VOCAB",
    "LAYERS",
    "LmConfig",
    "LmHeadModel",
    "check_input_length",
    "next_token_loss",
    "blockwise_next_token_loss",
    "parameter_shapes",
    "tree_nbytes",
    "split_key",
]

EMBED = "embed"
VOCAB = "vocab"
LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class LmConfig(abc.ABC, draccus.ChoiceRegistry):
    """Abstract base of model configs. Subclasses are frozen dataclasses registered by name.

    The fields every architecture shares, with the same meaning, are declared here (upstream's names).
    Subclasses must give the ones without a default here (``seq_len``, ``hidden_dim``, ``num_layers``,
    ``num_heads``, ``activation_function``, ``upcast_attn``, ``use_bias``) their own defaults (a
    redeclaration without a comment keeps the description here), implement :meth:`build` and
    :meth:`flops_per_token`, and call ``super().__post_init__()`` from their own ``__post_init__``.

    Every architecture has ``cross_entropy_block_size`` (upstream's name): ``null`` computes the loss from
    the full ``[tokens, vocab]`` logits (kept in the compute dtype, upcast to float32 inside the loss); a
    positive number computes it over blocks of that many
    vocabulary entries (:func:`blockwise_next_token_loss`), so that only one ``[tokens, block]`` slice of
    logits is ever live. Same loss and gradients up to float rounding; the backward pass recomputes the
    block logits (docs/bench/2026-12-03-attention-and-loss.md).
    """

    # Tokens per training sequence (the context length).
    seq_len: int
    # Width of the residual stream (the token embedding's size).
    hidden_dim: int
    # Transformer blocks.
    num_layers: int
    # Attention (query) heads.
    num_heads: int
    # Activation of the MLP (gelu_new, gelu, relu, silu, ...).
    activation_function: str
    # Compute the attention scores and softmax in float32 under a lower-precision policy.
    upcast_attn: bool
    # Give the linear layers biases.
    use_bias: bool
    # Standard deviation of the normal initialisation of the weights.
    initializer_range: float = 0.02
    # Epsilon of the layer (or RMS) norms, in (0, 1].
    layer_norm_epsilon: float = 1e-5
    # true/false or a named remat policy (levanter.models.layers.REMAT_POLICIES).
    gradient_checkpointing: Union[bool, str] = True
    # True: the layers run as one lax.scan (compile time independent of depth). False: the same stacked
    # parameters, but the loop is unrolled when traced, which lets XLA fuse across layers: faster steps
    # and compiles for small models (docs/performance.md). Large models keep True.
    scan_layers: bool = True
    # Which attention kernel runs (levanter.models.attention.ATTN_BACKENDS); None means "default", or what
    # upstream's use_flash_attention says when only that is given (true: jax_flash, false: vanilla).
    attn_backend: Optional[str] = None
    # Upstream's switch for the attention kernel: true runs jax_flash, false vanilla (attn_backend wins).
    use_flash_attention: Optional[bool] = None
    # Query/key block of jax_flash and splash; None means 512 (or the whole sequence when shorter).
    flash_attention_block_size: Optional[int] = None
    # The splash kernel's tiles one by one ({block_q, block_kv, block_kv_compute, block_q_dkv, block_kv_dkv,
    # block_kv_dkv_compute}; unset ones follow flash_attention_block_size); null: that block everywhere.
    splash_block_sizes: Optional[SplashBlockSizes] = None
    # Compute the loss over blocks of this many vocabulary entries (less memory); null: all logits at once.
    cross_entropy_block_size: Optional[int] = None

    def __post_init__(self):
        check_positive(self, "seq_len", "hidden_dim", "num_layers", "num_heads")
        check_epsilon(self.layer_norm_epsilon)
        check_activation(self.activation_function)
        check_remat(self.gradient_checkpointing)
        b = self.cross_entropy_block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(
                f"model.cross_entropy_block_size must be a positive number of vocabulary entries per block, "
                f"or null for the full loss, got {b!r}"
            )
        if self.attention_backend == "cudnn" and self.upcast_attn:  # also validates the attention keys
            raise ValueError(
                "model.attn_backend 'cudnn' needs model.upcast_attn: false (cuDNN takes bfloat16/float16 queries "
                "and keys; the scores and softmax are float32 inside it either way)"
            )
        if self.splash_block_sizes is not None:
            if not isinstance(self.splash_block_sizes, SplashBlockSizes):
                raise ValueError(
                    "model.splash_block_sizes must be a mapping of block_q, block_kv, block_kv_compute, "
                    f"block_q_dkv, block_kv_dkv, block_kv_dkv_compute, or null, got {self.splash_block_sizes!r}"
                )
            resolve_splash_block_sizes(self.seq_len, self.flash_attention_block_size, self.splash_block_sizes)

    @property
    def attention_backend(self) -> str:
        """The requested backend (``default`` until resolved for a platform); validates the keys."""
        return check_attn_config(self.attn_backend, self.use_flash_attention, self.flash_attention_block_size)

    def check_platform(self, platform: str) -> None:
        """Refuse an ``attn_backend`` that ``platform`` (``jax.default_backend()``) cannot run."""
        check_backend_platform(self.attention_backend, platform)

    def loss_logit_entries(self, vocab_size: int) -> int:
        """Vocabulary entries per token whose logits the loss holds at once: the whole vocabulary (in the
        compute dtype) for the full loss, one float32 block for the blockwise one (for memory estimates)."""
        b = self.cross_entropy_block_size
        return vocab_size if b is None else min(b, vocab_size)

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

    def aux_loss_weights(self) -> dict[str, float]:
        """Weight of each auxiliary training loss the model returns (:meth:`LmHeadModel.activations_and_aux`)
        in the training loss, by name; none by default."""
        return {}

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
    # Whether positions come from a table indexed by the position in the row (GPT-2's learned positions);
    # such a model's ``activations`` takes ``pos_ids``. Rotary models see only relative positions.
    absolute_positions: ClassVar[bool] = False

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
    def activations(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> NamedArray:
        """The final hidden states ``[..., position, embed]``, before the output projection."""

    @abc.abstractmethod
    def get_lm_head(self) -> NamedArray:
        """The output projection ``[vocab, embed]`` (any axis order): logits are ``activations . lm_head``."""

    def __call__(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> NamedArray:
        """Logits ``[..., position, vocab]``."""
        x = self.activations(input_ids, segment_ids, key=key)
        return token_dot(x, self.get_lm_head(), self.Embed)

    def activations_and_aux(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> tuple[NamedArray, dict[str, jax.Array]]:
        """:meth:`activations` plus the architecture's auxiliary training losses, by name, as unweighted
        scalars (their weights: ``config.aux_loss_weights()``). None by default; a mixture of experts
        returns its router load-balancing loss from the same forward pass."""
        return self.activations(input_ids, segment_ids, key=key), {}

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
        """Forward pass plus the next-token loss on the same tokens: :func:`next_token_loss` on the full
        logits, or :func:`blockwise_next_token_loss` when ``config.cross_entropy_block_size`` is set."""
        hidden = self.activations(input_ids, segment_ids, key=key)
        return self._loss_of_hidden(hidden, input_ids, loss_mask, reduction, z_loss_weight)

    def compute_training_loss(
        self,
        input_ids: NamedArray,
        loss_mask: NamedArray | None = None,
        segment_ids: NamedArray | None = None,
        *,
        key=None,
        z_loss_weight: float = 0.0,
    ):
        """``(sum, count, metric sums)``, what the trainer's loss returns: the summed next-token loss plus
        ``count x weight x value`` of each auxiliary loss (:meth:`activations_and_aux`), so that
        ``sum / count`` is the mean cross-entropy plus the weighted auxiliary losses; and each auxiliary
        loss times ``count`` by name, which the trainer divides by the step's count to log it."""
        hidden, aux = self.activations_and_aux(input_ids, segment_ids, key=key)
        total, count = self._loss_of_hidden(hidden, input_ids, loss_mask, "sum_and_count", z_loss_weight)
        weights = self.config.aux_loss_weights()
        metrics = {}
        for name, value in aux.items():
            value = value.astype(jnp.float32)
            if weights.get(name, 0.0):
                total = total + weights[name] * value * count
            metrics[name] = value * count
        return total, count, metrics

    def _loss_of_hidden(self, hidden: NamedArray, input_ids, loss_mask, reduction, z_loss_weight: float):
        block = self.config.cross_entropy_block_size
        if block is None:
            logits = token_dot(hidden, self.get_lm_head(), self.Embed)
            return next_token_loss(
                logits, input_ids, loss_mask, reduction=reduction, z_loss_weight=z_loss_weight
            )
        return blockwise_next_token_loss(
            hidden, self.get_lm_head(), input_ids, loss_mask,
            block_size=block, reduction=reduction, z_loss_weight=z_loss_weight,
        )


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
    targets, valid = _targets_and_positions(tokens, loss_mask)
    logits = logits.rearrange((..., VOCAB))
    outer = logits.axes[:-1]
    log_z, target_logit = _normaliser_and_target(logits.array, hax.broadcast_to(targets, outer).array)
    return _reduce(hax.named(log_z, outer), hax.named(target_logit, outer), valid, reduction, z_loss_weight)


def _normaliser_and_target(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``logsumexp(logits, -1)`` and ``logits[..., target]``, both float32, from ``logits [..., vocab]`` in
    any float dtype and integer ``targets [...]``.

    For logits narrower than float32 (bfloat16 compute) the derivative is written out
    (:func:`_narrow_normaliser_and_target`); float32 logits take autodiff's, which has no copy to avoid and
    which XLA on CPU runs in less memory and time than the rematerialised rule.
    """
    if jnp.dtype(logits.dtype).itemsize >= 4:
        x = logits.astype(jnp.float32)
        return jax.nn.logsumexp(x, axis=-1), jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    return _narrow_normaliser_and_target(logits, targets)


@jax.custom_jvp
def _narrow_normaliser_and_target(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`_normaliser_and_target` with its derivative written out, so that the backward pass reads the
    logits in their own dtype: derived by autodiff, XLA keeps a float32 copy of the whole ``[tokens, vocab]``
    logits from the forward pass (for bfloat16 logits, twice their size, written once and read back), where
    the softmax needs only the logits and each token's normaliser. The values are the same: the float32 upcast
    happens inside each pass. A JVP rule (not a VJP) so that forward-mode autodiff still works (Sophia's
    Hessian-vector products).
    """
    # A gather per position (take_along_axis): no one-hot [..., vocab] target is materialised. It reads the
    # logits as they are (the upcast is exact), so that no float32 copy exists for it to read.
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1), target


@_narrow_normaliser_and_target.defjvp
def _narrow_normaliser_and_target_jvp(primals, tangents):
    logits, targets = primals
    d_logits = tangents[0]
    log_z, target = _narrow_normaliser_and_target(logits, targets)

    # Rematerialised: reverse mode keeps only the logits and the normaliser, and its backward pass is one
    # element-wise pass over the logits (softmax plus the target's one-hot, compared against an iota), where
    # keeping the softmax would write it (in float32) in the forward pass, and a gather's transpose would
    # scatter into a zeroed [tokens, vocab] array.
    # prevent_cse=False: the forward pass computes no softmax for XLA to merge this recomputation with, so the
    # optimization barrier that would stop such merging is left out (with it: 5 ms more per Llama step on TPU).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def linear_part(logits, log_z, targets, d_logits):
        d = d_logits.astype(jnp.float32)
        softmax = jnp.exp(logits.astype(jnp.float32) - log_z[..., None])
        is_target = targets[..., None] == jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
        return jnp.sum(softmax * d, axis=-1), jnp.sum(jnp.where(is_target, d, 0.0), axis=-1)

    return (log_z, target), linear_part(logits, log_z, targets, d_logits)


def blockwise_next_token_loss(
    hidden: NamedArray,
    lm_head: NamedArray,
    tokens: NamedArray,
    loss_mask: NamedArray | None = None,
    *,
    block_size: int,
    reduction: str | None = "mean",
    z_loss_weight: float = 0.0,
):
    """:func:`next_token_loss` of the logits ``hidden . lm_head``, computed without materialising them.

    The normaliser ``logsumexp(logits[t])`` is accumulated over blocks of ``block_size`` vocabulary
    entries (:func:`levanter.models.loss.blockwise_logsumexp`, whose backward pass recomputes each
    block); the correct-class logit is the dot of ``hidden[t]`` with the gathered row
    ``lm_head[tokens[t + 1]]``. Both in float32. Arguments and results as :func:`next_token_loss`, with
    ``hidden`` ``[..., position, embed]`` and ``lm_head`` ``[vocab, embed]``.
    """
    Embed = hidden.resolve_axis(EMBED)
    Vocab = lm_head.resolve_axis(VOCAB)
    targets, valid = _targets_and_positions(tokens, loss_mask)

    outer = tuple(a for a in hidden.axes if a.name != EMBED)
    flat = hidden.rearrange((*outer, Embed)).array.reshape(-1, Embed.size)
    weight = lm_head.rearrange((Vocab, Embed)).array
    log_z = hax.named(blockwise_logsumexp(flat, weight, block_size).reshape([a.size for a in outer]), outer)
    rows = lm_head.take(Vocab, targets)  # [..., position, embed]: the target rows, one per position
    target_logit = hax.dot(hidden.astype(jnp.float32), rows.astype(jnp.float32), axis=Embed)
    return _reduce(log_z, target_logit, valid, reduction, z_loss_weight)


def _targets_and_positions(tokens: NamedArray, loss_mask: NamedArray | None) -> tuple[NamedArray, NamedArray]:
    """The next token of every position, and which positions count (the mask, never the last)."""
    Pos = tokens.resolve_axis(POS)
    targets = hax.roll(tokens, -1, Pos)
    not_last = hax.arange(Pos) < Pos.size - 1
    if loss_mask is None:
        valid = not_last.broadcast_axis(tokens.axes)
    else:
        # jax >= 0.8 rejects non-boolean `where=` masks, so normalise to bool here once.
        if loss_mask.dtype != jnp.bool_:
            loss_mask = loss_mask != 0
        valid = loss_mask & not_last
    return targets, valid


def _reduce(log_z: NamedArray, target_logit: NamedArray, valid: NamedArray, reduction, z_loss_weight: float):
    """Per-position cross entropy (plus z-loss) from the normaliser and the target logit, then reduced."""
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
