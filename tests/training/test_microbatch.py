"""Gradient accumulation with a mixed-precision policy: the cast to the compute dtype made once, ahead of the
microbatch loop, gives the numbers the loss's own cast in every microbatch gives, in the parameters' dtypes,
and the loop reads the cast weights (no cast of them left inside it); fp8's state, which the backward pass
overwrites, is left to the loss's cast."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from levanter.models import LlamaConfig
from levanter.quantization import QuantizationConfig, with_fp8
from levanter.training.fp8 import split_overwrites
from levanter.training.loss import lm_loss_fn
from levanter.training.microbatch import summed_gradients

Vocab = hax.Axis("vocab", 64)
TINY = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)
MP = jmp.get_policy("p=f32,c=bfloat16")
N = 8


def _sum_loss(params, static, micro):
    # As the trainer's step: the combined model cast to the compute dtype inside the loss.
    model = MP.cast_to_compute(eqx.combine(params, static))
    total, count, extra = lm_loss_fn(0.0, eos_id=0)(model, micro)
    return total.astype(jnp.float32), (count, extra)


def _inputs(fp8: bool):
    model = TINY.build(Vocab, key=jax.random.PRNGKey(0))
    if fp8:
        model = with_fp8(model, QuantizationConfig(fp8=True, amax_history_length=4))
    params, static = eqx.partition(MP.cast_to_param(model), eqx.is_inexact_array)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (N, TINY.seq_len), 1, Vocab.size)
    return params, static, {"tokens": hax.named(tokens, (hax.Axis("batch", N), TINY.Pos))}


def _gradients(params, static, batch, n_micro, cast):
    run = eqx.filter_jit(lambda p, b: summed_gradients(_sum_loss, p, static, b, n_micro=n_micro, batch_axis="batch",
                                                       compute_mapping={}, cast=cast))
    return run(params, batch)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_cast_ahead_of_the_microbatches_gives_the_same_gradients(fp8):
    params, static, batch = _inputs(fp8)
    inside = _gradients(params, static, batch, 4, None)
    ahead = _gradients(params, static, batch, 4, MP.cast_to_compute)
    assert float(inside.total) == float(ahead.total) and float(inside.count) == float(ahead.count)
    g_in, g_ahead = jax.tree.leaves(inside.grads), jax.tree.leaves(ahead.grads)
    assert len(g_in) == len(g_ahead) > 0
    for a, b, p in zip(g_in, g_ahead, jax.tree.leaves(split_overwrites(params)[1])):
        assert a.dtype == b.dtype == p.dtype == jnp.float32  # accumulated in the parameters' dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(float(jnp.abs(g).max()) > 0 for g in g_ahead)
    ow_in, ow_ahead = jax.tree.leaves(inside.overwrites), jax.tree.leaves(ahead.overwrites)
    # Six arrays of fp8 state for each of a layer's seven products (stacked over the layers).
    assert len(ow_in) == len(ow_ahead) == (6 * 7 if fp8 else 0)
    for a, b in zip(ow_in, ow_ahead):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_microbatch_loop_reads_the_cast_weights():
    params, static, batch = _inputs(False)
    weights = {tuple(x.shape) for x in jax.tree.leaves(params) if x.ndim >= 2}

    def loop_inputs(cast):
        jaxpr = jax.make_jaxpr(lambda p, b: summed_gradients(_sum_loss, p, static, b, n_micro=4, batch_axis="batch",
                                                             compute_mapping={}, cast=cast))(params, batch)
        scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        assert len(scans) == 1
        consts = scans[0].invars[:scans[0].params["num_consts"]]  # what the loop reads (the rest is its carry)
        return [v.aval for v in consts if tuple(v.aval.shape) in weights]

    inside, ahead = loop_inputs(None), loop_inputs(MP.cast_to_compute)
    assert inside and {a.dtype for a in inside} == {jnp.dtype(jnp.float32)}
    assert ahead and {a.dtype for a in ahead} == {jnp.dtype(jnp.bfloat16)}

