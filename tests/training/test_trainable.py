"""``Trainer(..., is_trainable=...)``: only the leaves the filter selects train. The others stay bit-for-bit
as they were, get no optimizer state, no gradient (so the gradient norm is that of the trained leaves alone)
and no average; evaluation sees the averaged trained leaves with the fixed ones."""

from __future__ import annotations

import functools

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from levanter.main.train_lm import lm_loss_fn
from levanter.models import Gpt2Config
from levanter.optim.model_averaging import EmaModelAveragingConfig
from levanter.training import Trainer, TrainerConfig

TINY = Gpt2Config(seq_len=16, hidden_dim=32, num_heads=4, num_layers=2, gradient_checkpointing=False)
Vocab = hax.Axis("vocab", 64)


def only_the_mlps(model):
    """A filter spec: the MLP weights train, nothing else."""
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: m.blocks.stacked.mlp, spec, replace_fn=lambda mlp: jax.tree.map(lambda _: True, mlp))


def _run(is_trainable, steps=3):
    tcfg = TrainerConfig(num_train_steps=steps, train_batch_size=8, require_accelerator=False, mp="f32",
                         model_averaging=EmaModelAveragingConfig(beta=0.5))
    tcfg.validate()
    trainer = Trainer(tcfg, optax.adam(1e-2), lm_loss_fn(0.0, eos_id=0), is_trainable=is_trainable)
    state = trainer.initial_state(lambda k: TINY.build(Vocab, key=k), key=jax.random.PRNGKey(0))
    start = jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, state)  # the step donates the state
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, TINY.seq_len), 1, Vocab.size)
    batch = {"tokens": hax.named(tokens, (hax.Axis("batch", 8), TINY.Pos))}
    with hax.partitioning.set_mesh(trainer.mesh):
        batch = hax.shard(batch, trainer.compute_mapping)
    reports = []
    for _ in range(steps):
        state, m = trainer.train_step(state, batch, 8)
        reports.append(m)
    return trainer, start, state, reports


@functools.lru_cache(maxsize=None)
def _unfiltered():
    """The run without a filter, shared by the tests that need it (each run compiles its own step)."""
    return _run(None)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]


def test_only_the_selected_leaves_train_and_carry_optimizer_state_and_an_average():
    trainer, start, state, reports = _run(only_the_mlps)
    _, all_start, all_state, all_reports = _unfiltered()
    trained0, fixed0 = trainer.split_trained(start.model)
    trained1, fixed1 = trainer.split_trained(state.model)
    assert len(jax.tree.leaves(trained0)) == 4  # c_fc and c_proj, weight and bias
    for a, b in zip(_leaves(fixed0), _leaves(fixed1)):
        assert np.array_equal(a, b)  # the fixed leaves did not move at all
    assert all(not np.array_equal(a, b) for a, b in zip(_leaves(trained0), _leaves(trained1)))
    # Adam's two moments for the trained leaves alone; the full run's for every float leaf.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    all_moments = [x for x in jax.tree.leaves(all_state.opt_state) if x.ndim > 0]
    assert len(moments) == 2 * 4 and len(all_moments) == 2 * len(_leaves(all_start.model))
    # The first step's gradient is that of the whole model restricted to the trained leaves.
    first = float(reports[0]["grad_norm"])
    assert 0 < first < float(all_reports[0]["grad_norm"])
    assert float(reports[0]["loss"]) == float(all_reports[0]["loss"])
    # The average holds the trained leaves only; evaluation sees it with the fixed leaves as they are.
    assert len(jax.tree.leaves(state.averaged_model)) == 4
    evaluated = state.eval_model
    for a, b in zip(_leaves(trainer.split_trained(evaluated)[1]), _leaves(fixed1)):
        assert np.array_equal(a, b)
    for a, b in zip(_leaves(trainer.split_trained(evaluated)[0]), _leaves(state.averaged_model)):
        assert np.array_equal(a, b)


def test_without_a_filter_every_float_leaf_trains():
    trainer, start, state, _ = _unfiltered()
    trained, rest = trainer.split_trained(start.model)
    assert not [x for x in jax.tree.leaves(rest) if eqx.is_inexact_array(x)]
    assert all(not np.array_equal(a, b) for a, b in zip(_leaves(start.model), _leaves(state.model))
               if a.size > 1 and float(jnp.abs(a).max()) > 0)
