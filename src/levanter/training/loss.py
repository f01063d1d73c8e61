"""The training loss of a causal language model, as the trainer takes it: ``loss(model, batch) -> (sum,
count)``.

:func:`lm_loss_fn` joins the two halves the trainer must not know about: the batch the loader ships (the
tokens alone, or tokens with their loss mask and segment ids) and the model's own loss
(``compute_next_token_loss``: :func:`levanter.models.next_token_loss`, or its blockwise form over the
vocabulary). It returns a *sum* with its token count, not a mean, so that microbatches combine into the exact
step-wide mean. It lives here, beside neither half, because ``models`` may not import ``data``; the entry
points (``train_lm``, its dry run) and the memory checks import it from here.
"""

from __future__ import annotations

from typing import Callable, Optional

import haliax as hax

from levanter.data.text import causal_lm_columns_jax
from levanter.quantization import quantize


def lm_loss_fn(z_loss_weight: float = 0.0, eos_id: Optional[int] = None, quantization=None) -> Callable:
    """``(sum of next-token cross-entropies over loss positions, number of loss positions, metric sums)``:
    the model's ``compute_training_loss`` (:func:`levanter.models.next_token_loss` on the logits, or the
    blockwise loss when ``model.cross_entropy_block_size`` is set, with a z-loss of ``z_loss_weight``, plus
    the model's weighted auxiliary losses, e.g. Mixtral's router load-balancing loss, which the metric sums
    carry for logging).

    A batch of ``{tokens}`` alone (the training set ``train_lm`` reads, ``tokens_only``) gets its loss mask
    and segment ids from the tokens and ``eos_id``, on the device (:func:`causal_lm_columns_jax`: the
    same values the dataset would have shipped); a batch that has them uses its own.

    ``quantization`` (``trainer.quantization``): the model's linear layers compute in int8 inside the loss
    (:func:`levanter.quantization.quantize`); the evaluator (:mod:`levanter.training.eval`) quantizes the same way.
    """

    def loss(model, batch):
        model = quantize(model, quantization)
        tokens = batch["tokens"]
        if "loss_mask" in batch:
            mask, seg = batch["loss_mask"], batch["segment_ids"]
        else:
            derived = causal_lm_columns_jax(tokens.array, eos_id)
            mask = hax.named(derived["loss_mask"], tokens.axes)
            seg = hax.named(derived["segment_ids"], tokens.axes)
        # (sum, count, metric sums): auxiliary losses (a mixture of experts' router loss) ride along.
        return model.compute_training_loss(tokens, mask, seg, z_loss_weight=z_loss_weight)

    return loss


__all__ = ["lm_loss_fn"]
