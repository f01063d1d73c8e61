"""Mixtral: a Llama decoder whose MLP is a mixture of experts with top-k routing.

Registered as ``type: mixtral``. Field names follow upstream Levanter's ``MixtralConfig``
(``num_local_experts``, ``num_experts_per_tok``, ``router_aux_loss_coef``, ``sliding_window``); the
attention, norms, rotary positions and every Llama key are :class:`~levanter.models.llama.LlamaConfig`'s,
which this config extends.

Routing (as ``transformers``' Mixtral): a linear router ``gate [embed -> experts]`` scores every token; the
``num_experts_per_tok`` experts with the highest scores are chosen and weighted by the softmax over the
selected logits alone (softmax over all experts, then renormalised over the chosen, which is the same
thing), computed in float32. Each expert is a gated MLP ``w2(act(w1 x) * w3 x)``.

Two ways to compute the experts (``moe_dispatch``), the same function up to float rounding:

* ``dense`` (default): every expert runs on every token and the outputs are summed with the routing
  weights, which are zero for the experts a token did not choose. Plain matmuls that shard like Llama's
  MLP and run anywhere, but ``num_local_experts / num_experts_per_tok`` times the useful MLP work and an
  ``[tokens, experts, mlp]`` activation.
* ``grouped``: each token's ``num_experts_per_tok`` assignments are sorted by expert and the experts run
  as grouped matmuls over their contiguous groups (:func:`~levanter.models.grouped_matmul.grouped_matmul`:
  ``jax.lax.ragged_dot(rows [T*k, D], weights [E, D, F], group_sizes [E])`` forward), so only the chosen
  experts' work is done. On one TPU device the forward products and the rows' gradients run through
  megablox's ``gmm`` Pallas kernel and the weights' gradients through its ``tgmm`` (XLA's ragged-dot
  instruction over a mesh of several);
  on a CPU JAX computes ``ragged_dot`` densely (every group against every row under a mask): correct, but
  ``num_local_experts`` times the work, so on CPU the dense path is the faster one. The sort's permutation
  and its inverse are gathers both ways (the gradient of each is the other), no scatters; the grouped
  products are named as the dense path's (``mlpwi_0``, ``mlpwi_1``, ``mlpwo``), so ``gradient_checkpointing:
  minimal_with_context`` saves them. The sort, gather and sum run over all tokens of the (micro)batch, so
  under data parallelism XLA gathers the batch's tokens onto every device for them: it is the path for
  one device, or for experts so wide that the dense path's extra work dominates; a per-device dispatch
  (``shard_map`` over the data axis) would remove the gather. The ragged products read the expert weights
  directly, so experts that ``trainer.quantization`` (int8 or fp8) selects are refused here: they compute
  through their kernels on the dense path.

Neither path drops tokens: there is no expert capacity (no ``capacity_factor``), every token is computed by
all ``num_experts_per_tok`` experts it chose however unevenly the router spreads them. The grouped path's
shapes stay static all the same: it always computes ``tokens x num_experts_per_tok`` rows, and only how they
split into groups (``group_sizes``) changes from step to step, so an expert that many tokens choose costs
time, never a dropped token or a recompile. The load-balancing loss below is what keeps the groups even.

The router load-balancing loss (Switch Transformer's, as ``transformers``' ``load_balancing_loss_func``):
``num_local_experts * sum_e f_e * p_e``, where ``f_e`` is the share of all top-k assignments that went to
expert ``e`` and ``p_e`` its mean router probability, both pooled over every layer and every position of
the batch (padding is not special-cased: training rows are packed). It is ``num_experts_per_tok`` when
the routing is uniform and grows as it concentrates. :meth:`MixtralLMHeadModel.activations_and_aux` returns it as
``router_aux_loss``; training adds ``router_aux_loss_coef`` times it to the loss (the trainer logs it as
``train/router_aux_loss``), evaluation reports the cross-entropy alone.

Parameter axes (for sharding), besides Llama's attention and norms: ``gate [embed -> experts]``,
``w1``/``w3 [embed -> experts, mlp]``, ``w2 [experts, mlp -> embed]``, all with ``layers``. Hugging Face
names: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1/w2/w3`` (the layout Mixtral
checkpoints are published in, and what ``transformers`` writes).

``flops_per_token`` counts the active experts only (``num_experts_per_tok`` gated MLPs per token) plus
the router, whichever dispatch runs: MFU measures useful work, so the dense path's extra experts show as
lower MFU, not as more work.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray

from .attention import AttentionMask
from .layers import ACTIVATIONS, check_positive, named, normal_linear
from .decoder import (
    DecoderLMHeadModel,
    PreNormBlock,
    decoder_block_parts,
    init_decoder_parts,
    plan_config_attention,
    rms_norm,
)
from .grouped_matmul import grouped_matmul
from .llama import LlamaConfig
from .lm_model import LAYERS, LmConfig, check_input_length
from .mistral import SlidingWindowAttention
from .rope import rotary_tables
from .token_dot import linear, lora_adapter, token_dot_kernel

__all__ = [
    "EXPERTS",
    "TOP_EXPERTS",
    "MOE_DISPATCHES",
    "ROUTER_AUX_LOSS",
    "MixtralConfig",
    "MixtralSparseMoe",
    "MixtralDecoderLayer",
    "MixtralLMHeadModel",
    "load_balancing_loss",
]

EXPERTS = "experts"
TOP_EXPERTS = "top_experts"
MOE_DISPATCHES = ("dense", "grouped")
ROUTER_AUX_LOSS = "router_aux_loss"


@LmConfig.register_subclass("mixtral")
@dataclasses.dataclass(frozen=True)
class MixtralConfig(SlidingWindowAttention, LlamaConfig):
    """A Llama decoder whose MLP is a mixture of ``num_local_experts`` experts, ``num_experts_per_tok`` per token."""

    # Tokens per training sequence (the context length).
    seq_len: int = 4096
    # Width of the residual stream (the token embedding's size).
    hidden_dim: int = 4096
    # Width of each expert's gated MLP hidden layer.
    intermediate_dim: int = 14336
    # Key/value heads (grouped-query attention): num_heads must be a multiple of it.
    num_kv_heads: int = 8
    # Experts per MLP layer.
    num_local_experts: int = 8
    # Experts each token is routed to (top-k), at most num_local_experts.
    num_experts_per_tok: int = 2
    # Weight of the router load-balancing loss added to the training loss (0 turns it off). Upstream's
    # default; Hugging Face's is 0.001.
    router_aux_loss_coef: float = 0.02
    # How the experts are computed: dense (every expert on every token, weighted by the router; runs and
    # shards anywhere) or grouped (tokens sorted by expert, jax.lax.ragged_dot: only the chosen experts' work,
    # for one TPU chip). Neither drops tokens: no expert capacity, every token reaches its top-k experts.
    moe_dispatch: str = "dense"
    # Each query attends to its own and the sliding_window - 1 positions before it (as Mistral's,
    # levanter.models.mistral); null: the whole prefix.
    sliding_window: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "num_local_experts", "num_experts_per_tok")
        if self.use_bias:
            raise ValueError("model.use_bias true is not supported for mixtral (its projections have no biases)")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                f"model.num_local_experts ({self.num_local_experts})"
            )
        coef = self.router_aux_loss_coef
        if not (isinstance(coef, (int, float)) and not isinstance(coef, bool) and 0.0 <= coef < float("inf")):
            raise ValueError(f"model.router_aux_loss_coef must be a finite number >= 0, got {coef!r}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"model.moe_dispatch {self.moe_dispatch!r} is not one of {list(MOE_DISPATCHES)}")
        self.check_sliding_window()

    @property
    def Experts(self) -> Axis:
        return Axis(EXPERTS, self.num_local_experts)

    @property
    def TopExperts(self) -> Axis:
        return Axis(TOP_EXPERTS, self.num_experts_per_tok)

    def build(self, Vocab: Axis, *, key) -> "MixtralLMHeadModel":
        return MixtralLMHeadModel.init(Vocab, self, key=key)

    def aux_loss_weights(self) -> dict[str, float]:
        return {ROUTER_AUX_LOSS: float(self.router_aux_loss_coef)}

    def flops_per_token(self, vocab_size: int) -> float:
        # Llama's count (attention, head and one gated MLP per layer), plus the router and the other
        # num_experts_per_tok - 1 active experts.
        d, mlp = self.hidden_dim, 2 * 3 * self.hidden_dim * self.intermediate_dim
        extra = 2 * d * self.num_local_experts + (self.num_experts_per_tok - 1) * mlp
        return super().flops_per_token(vocab_size) + 3.0 * self.num_layers * extra


class MixtralSparseMoe(eqx.Module):
    """The router and the stacked experts of one layer."""

    gate: hnn.Linear  # embed -> experts (the router)
    w1: hnn.Linear  # embed -> (experts, mlp): the gate projection of every expert
    w2: hnn.Linear  # (experts, mlp) -> embed: the down projection (contracts mlp per expert, see below)
    w3: hnn.Linear  # embed -> (experts, mlp): the up projection
    config: MixtralConfig = eqx.field(static=True)

    @staticmethod
    def init(config: MixtralConfig, *, key) -> "MixtralSparseMoe":
        k_gate, k1, k2, k3 = jax.random.split(key, 4)
        c, std = config, config.initializer_range
        gate = normal_linear(c.Embed, c.Experts, std=std, use_bias=False, key=k_gate)
        w1 = normal_linear(c.Embed, (c.Experts, c.Mlp), std=std, use_bias=False, key=k1)
        w3 = normal_linear(c.Embed, (c.Experts, c.Mlp), std=std, use_bias=False, key=k3)
        w2 = normal_linear((c.Experts, c.Mlp), c.Embed, std=std, use_bias=False, key=k2)
        return MixtralSparseMoe(gate, w1, w2, w3, config)

    def route(self, x: NamedArray) -> tuple[NamedArray, NamedArray, NamedArray]:
        """``(probs [.., experts], top weights [.., top_experts], top indices [.., top_experts])``, float32."""
        logits = linear(self.gate, x).astype(jnp.float32)
        probs = hnn.softmax(logits, axis=EXPERTS)
        _, top_i = hax.top_k(probs, EXPERTS, self.config.num_experts_per_tok, new_axis=TOP_EXPERTS)
        # The chosen probabilities read through a one-hot mask rather than top_k's values (the same numbers:
        # one term of each sum is not zero): the gradient of top_k's values is a scatter into [tokens,
        # experts], slow on a TPU at any size; the mask's gradient is elementwise.
        top_p = hax.sum(probs * hnn.one_hot(top_i, self.config.Experts, dtype=probs.dtype), axis=EXPERTS)
        return probs, top_p / hax.sum(top_p, axis=TOP_EXPERTS), top_i

    def __call__(self, x: NamedArray) -> tuple[NamedArray, NamedArray, NamedArray]:
        """``(output like x, assignments per expert [experts], router probability summed per expert [experts])``;
        the last two over every token of ``x``, for the load-balancing loss."""
        probs, weights, chosen = self.route(x)
        Experts = self.config.Experts
        one_hot = hnn.one_hot(chosen, Experts, dtype=jnp.float32)  # [.., top_experts, experts]
        assigned = hax.sum(one_hot, axis=tuple(a for a in one_hot.axes if a.name != EXPERTS))
        prob_sum = hax.sum(probs, axis=tuple(a for a in probs.axes if a.name != EXPERTS))
        return named(self.experts(x, weights, chosen), "mlpwo"), assigned, prob_sum

    def experts(self, x: NamedArray, weights: NamedArray, chosen: NamedArray) -> NamedArray:
        """The experts' output for given router choices (``chosen [.., top_experts]`` expert indices,
        ``weights [.., top_experts]``) through ``moe_dispatch``'s path."""
        if self.config.moe_dispatch == "grouped":
            if any(token_dot_kernel(layer) is not None or lora_adapter(layer) is not None
                   for layer in (self.w1, self.w2, self.w3)):
                # The ragged products read the weights directly: a quantized expert's kernel (and fp8's state)
                # would be skipped without a word.
                raise ValueError(
                    "model.moe_dispatch: grouped computes the experts with ragged matrix products, which "
                    "trainer.quantization's int8 and fp8 kernels and LoRA adapters do not run: set "
                    "model.moe_dispatch: dense to quantize or adapt the experts, or leave w1, w2 and w3 out of "
                    "trainer.quantization.targets (lora.target_modules)"
                )
            return self._grouped(x, weights, chosen)
        one_hot = hnn.one_hot(chosen, self.config.Experts, dtype=jnp.float32)
        return self._dense(x, hax.sum(one_hot * weights, axis=TOP_EXPERTS))

    def _dense(self, x: NamedArray, combine: NamedArray) -> NamedArray:
        """Every expert on every token; ``combine [.., experts]`` (zero for unchosen experts) weights them."""
        act = ACTIVATIONS[self.config.activation_function]
        gate = act(named(linear(self.w1, x), "mlpwi_0"))  # [.., experts, mlp]
        h = gate * named(linear(self.w3, x), "mlpwi_1")
        # Weighting before the down projection makes it one matmul contracting (experts, mlp).
        h = h * combine.astype(h.dtype)
        return linear(self.w2, h)

    def _grouped(self, x: NamedArray, weights: NamedArray, chosen: NamedArray) -> NamedArray:
        """The chosen experts only: assignments sorted by expert, grouped matmuls, then summed back per token."""
        c = self.config
        Embed, Experts, Mlp = c.Embed, c.Experts, c.Mlp
        outer = tuple(a for a in x.axes if a.name != Embed.name)
        tokens = x.rearrange((*outer, Embed)).array.reshape(-1, Embed.size)  # [T, D]
        k = c.num_experts_per_tok
        expert_of = chosen.rearrange((*outer, TOP_EXPERTS)).array.reshape(-1)  # [T*k]: assignment t*k+j
        order = jnp.argsort(expert_of, stable=True)  # assignments grouped by expert
        inverse = jnp.argsort(order)  # back to token order
        # Each token repeated k times (assignment t*k+j is token t), then sorted: [T*k, D].
        rows = _permute(jnp.repeat(tokens, k, axis=0), order, inverse)
        # Assignments per expert; zero for an expert no token chose (ragged_dot skips its group). Counted by
        # comparison with each expert's index, not bincount: a bincount is a scatter-add of every assignment
        # into a few bins, slow on a TPU at any size (docs/bench/2026-12-07-tpu-rows.md).
        group_sizes = jnp.sum(expert_of[:, None] == jnp.arange(Experts.size, dtype=expert_of.dtype)[None, :],
                              axis=0, dtype=jnp.int32)

        def expert_weights(layer: hnn.Linear, axes) -> jax.Array:
            return (layer.weight * layer.reparam.active_scale).rearrange(axes).array

        w1 = expert_weights(self.w1, (Experts, Embed, Mlp))
        w3 = expert_weights(self.w3, (Experts, Embed, Mlp))
        w2 = expert_weights(self.w2, (Experts, Mlp, Embed))
        act = ACTIVATIONS[c.activation_function]
        Rows = Axis("rows", rows.shape[0])
        # Named as the dense path's products, so that a remat policy saving them (minimal_with_context)
        # spares the backward pass the grouped matmuls.
        up0 = named(hax.named(grouped_matmul(rows, w1, group_sizes), (Rows, Mlp)), "mlpwi_0")
        up1 = named(hax.named(grouped_matmul(rows, w3, group_sizes), (Rows, Mlp)), "mlpwi_1")
        h = (act(up0) * up1).array
        # [T*k, D], named too: the router weights' gradient reads it, which would otherwise recompute the
        # down projection's grouped product in the backward pass.
        y = named(hax.named(grouped_matmul(h, w2, group_sizes), (Rows, Embed)), "mlpwo").array
        # Back to token order, then each token's k outputs weighted by the router and summed.
        y = _permute(y, inverse, order).reshape(-1, k, Embed.size)
        weight_of = weights.rearrange((*outer, TOP_EXPERTS)).array.reshape(-1, k, 1)
        y = jnp.sum(y * weight_of.astype(y.dtype), axis=1)
        out = hax.named(y.reshape(*(a.size for a in outer), Embed.size), (*outer, Embed))
        return out.rearrange(x.axes)


@jax.custom_vjp
def _permute(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[perm]`` along the first axis, for a permutation ``perm`` whose inverse is ``inverse``. Its gradient is
    the inverse gather, ``g[inverse]``, where JAX's own gradient of a gather is a scatter-add (slower on a TPU,
    and it cannot know the indices are a permutation)."""
    return _gather_rows(x, perm)


def _gather_rows(x: jax.Array, perm: jax.Array) -> jax.Array:
    # Indices in bounds and unique (a permutation): no clamping or fill for XLA to add.
    return x.at[perm].get(mode="promise_in_bounds", unique_indices=True)


def _permute_fwd(x, perm, inverse):
    return _gather_rows(x, perm), (perm, inverse)


def _permute_bwd(res, g):
    _, inverse = res
    return _gather_rows(g, inverse), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


class MixtralDecoderLayer(PreNormBlock):
    block_sparse_moe: MixtralSparseMoe

    @staticmethod
    def init(config: MixtralConfig, *, key) -> "MixtralDecoderLayer":
        # Llama's norms (float32 statistics; no bias, as Mixtral refuses use_bias) and attention.
        return MixtralDecoderLayer(*decoder_block_parts(config, MixtralSparseMoe, key=key))

    def __call__(
        self, x: NamedArray, mask: AttentionMask, cos: NamedArray, sin: NamedArray, *, key=None
    ) -> tuple[NamedArray, tuple[NamedArray, NamedArray]]:
        del key  # no dropout
        x = self.attend(x, mask, cos, sin)
        out, assigned, prob_sum = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + out, (assigned, prob_sum)


class MixtralLMHeadModel(DecoderLMHeadModel):
    config: MixtralConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)

    @staticmethod
    def init(Vocab: Axis, config: MixtralConfig, *, key) -> "MixtralLMHeadModel":
        embed_tokens, layers, lm_head = init_decoder_parts(Vocab, config, MixtralDecoderLayer, key=key)
        return MixtralLMHeadModel(
            embed_tokens=embed_tokens, layers=layers, norm=rms_norm(config), lm_head=lm_head, config=config,
            Vocab=Vocab,
        )

    def activations(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> NamedArray:
        return self.activations_and_aux(input_ids, segment_ids, key=key)[0]

    def activations_and_aux(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> tuple[NamedArray, dict[str, jax.Array]]:
        del key  # no dropout
        Pos = check_input_length(self.config, input_ids)
        x = self.embed_tokens.embed(input_ids)
        c = self.config
        mask = plan_config_attention(c, Pos, segment_ids, x.dtype)
        cos, sin = rotary_tables(Pos, c.HeadSize, c.rope_config)
        x, (assigned, prob_sum) = self.layers.scan(x, mask, cos, sin, unroll=not c.scan_layers)
        return self.norm(x), {ROUTER_AUX_LOSS: load_balancing_loss(assigned, prob_sum, input_ids.size, c)}


def load_balancing_loss(assigned: NamedArray, prob_sum: NamedArray, tokens: int, config: MixtralConfig) -> jax.Array:
    """``E * sum_e f_e * p_e`` from the per-layer sums ``[layers, experts]`` of top-k assignments and router
    probabilities over ``tokens`` positions, pooled over the layers (``transformers``' definition)."""
    rows = tokens * config.num_layers
    f = hax.sum(assigned, axis=LAYERS) / rows
    p = hax.sum(prob_sum, axis=LAYERS) / rows
    return config.num_local_experts * hax.sum(f * p).scalar()
