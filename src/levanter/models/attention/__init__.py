"""Causal dot-product attention with packed-sequence (segment id) masking and grouped-query heads,
behind one entry point (:func:`dot_product_attention`) with interchangeable backends.

Position ``q`` may attend to key position ``k`` iff ``k <= q`` and, when segment ids are given,
``segment_ids[q] == segment_ids[k]``, and, when a sliding window of ``w`` positions is given (Mistral's
``sliding_window``), ``q - k < w`` (the query's own position and the ``w - 1`` before it, transformers'
convention). Every backend applies the window: ``vanilla`` in its materialised mask, ``jax_flash`` per
block pair (skipping key blocks wholly outside the window), ``splash`` through its local mask (whose
block-sparsity skips them too) and ``cudnn`` through its local window. A model describes this once per
forward pass with an :class:`AttentionMask` (the segment ids, plus the materialised boolean ``[...,
position, key_position]`` mask only for the backend that reads one) and passes it to every layer.

The modules, one concern each:

* ``mask``: the axis names, the boolean mask, :class:`AttentionMask` and the per-pass plan
  (:func:`plan_attention`: the backend resolved for this platform and sequence, the mask it needs).
* ``backends``: the backend names (``model.attn_backend``), their validation, the platform each runs on
  and what ``default`` picks (:func:`resolve_attn_backend`).
* ``vanilla``: the materialised-scores kernel (:func:`causal_attention`, :func:`softmax_attention`).
* ``jax_flash``: blockwise attention in pure JAX (:func:`blockwise_attention`).
* ``splash``: JAX's Pallas splash kernel and its tiles (:class:`SplashBlockSizes`).
* ``cudnn``: cuDNN's fused kernel through ``jax.nn.dot_product_attention``.
* ``dot_product``: the entry point, which lays the named arrays out for the array kernels and calls the
  backend the mask names.

Numerics: scores and softmax are float32 in every backend; ``upcast`` additionally computes the
``q . k`` product in float32. Masked scores are a large finite negative number, not ``-inf``, so a
fully masked row (which cannot occur: every query sees itself) would stay NaN-free. Everything is
traceable, so all backends work under jit, scan-over-layers and remat.

Axis names: queries ``[..., position, heads, head_size]``; keys/values either
``[..., position, heads, head_size]`` (multi-head) or ``[..., position, kv_heads, head_size]``
(grouped-query: ``heads`` is split into ``kv_heads x q_heads_per_group``, so query head ``h`` uses
key/value head ``h // (heads // kv_heads)``, the Hugging Face ``repeat_kv`` convention).
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__, __package__, ("mask", "backends", "vanilla", "jax_flash", "splash", "cudnn", "dot_product")
)
