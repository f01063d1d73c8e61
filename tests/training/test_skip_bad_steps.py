"""``optimizer.skip_bad_steps``: a step whose loss or gradient norm is a spike against the recent window is
not applied (parameters and optimizer state unchanged), is counted as skipped, and enters the window."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax
import pytest

from levanter.config import parse_config
from levanter.main import train_lm
from levanter.optim import AdamConfig
from levanter.optim.skip_steps import SkipBadSteps, resolve, skip_bad_steps, spike_skipped
from levanter.training import Trainer, TrainerConfig


@pytest.mark.parametrize("value, expected", [
    (False, None),
    (None, None),
    (True, SkipBadSteps(128, 6.0)),
    (64, SkipBadSteps(64, 6.0)),
    ({"rolling_interval_length": 32.0, "sigma_factor": 4.0}, SkipBadSteps(32, 4.0)),
    ({"sigma_factor": 3}, SkipBadSteps(128, 3.0)),
])
def test_the_upstream_forms_resolve(value, expected):
    assert resolve(value) == expected


@pytest.mark.parametrize("value, fragment", [
    (1, "at least 2 steps"),
    ({"window": 8}, "unknown key"),
    ({"sigma_factor": -1.0}, "sigma_factor must be a positive"),
    ({"rolling_interval_length": 8.5}, "whole number of steps"),
])
def test_bad_values_are_refused_naming_the_key(value, fragment):
    with pytest.raises(ValueError, match=r"optimizer\.skip_bad_steps.*" + fragment):
        resolve(value)


def test_a_config_with_skip_bad_steps_parses_and_builds_the_wrapper(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_urls: [memory://x/train.jsonl]\noptimizer:\n  skip_bad_steps: 16\n")
    cfg = parse_config(train_lm.TrainLmConfig, str(path))
    opt = cfg.optimizer.build(100)
    state = opt.init({"w": jnp.zeros(3)})
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    assert state.losses.shape == (16,)
    with pytest.raises(ValueError, match=r"optimizer\.skip_bad_steps"):
        parse_config(train_lm.TrainLmConfig, str(path), ["--optimizer.skip_bad_steps", "1"])


def test_a_spike_is_skipped_only_once_the_window_holds_enough_steps():
    opt = skip_bad_steps(optax.adam(0.1), SkipBadSteps(rolling_interval_length=8, sigma_factor=3.0))
    params = {"w": jnp.ones(4)}
    state = opt.init(params)
    grads = {"w": jnp.full(4, 0.5)}
    # A spike at the second step: too little history to judge, so it is applied.
    for i, loss in enumerate([1.0, 50.0, 1.1, 0.9, 1.0, 1.05]):
        updates, state = opt.update(grads, state, params, loss=jnp.float32(loss))
        assert not bool(spike_skipped(state)), i
        params = optax.apply_updates(params, updates)
    inner_before = state.inner
    # Loss spike: a zero update, Adam's moments and count untouched, counted as skipped.
    updates, state = opt.update(grads, state, params, loss=jnp.float32(1e4))
    assert bool(spike_skipped(state))
    assert float(jnp.abs(updates["w"]).max()) == 0.0
    for a, b in zip(jax.tree.leaves(state.inner), jax.tree.leaves(inner_before)):
        assert jnp.array_equal(a, b)
    # Gradient-norm spike at an ordinary loss: skipped too.
    updates, state = opt.update({"w": jnp.full(4, 1e3)}, state, params, loss=jnp.float32(1.0))
    assert bool(spike_skipped(state))
    # An ordinary step afterwards is applied and moves Adam's count on.
    updates, state = opt.update(grads, state, params, loss=jnp.float32(1.0))
    assert not bool(spike_skipped(state))
    assert float(jnp.abs(updates["w"]).max()) > 0
    assert int(state.inner[0].count) == int(inner_before[0].count) + 1


def test_the_update_needs_the_loss():
    opt = skip_bad_steps(optax.sgd(0.1), SkipBadSteps())
    with pytest.raises(ValueError, match="needs the step's loss"):
        opt.update({"w": jnp.ones(2)}, opt.init({"w": jnp.ones(2)}), None)


class _Scale(eqx.Module):
    w: hax.NamedArray


def _loss(model, batch):
    # Sum of squared errors of w * x against 0 over the batch; the batch's scale sets the loss level.
    x = batch["x"]
    err = hax.dot(x, model.w, axis="feature")
    return hax.sum(err * err).array, jnp.float32(x.axis_size("batch"))


def test_the_trainer_passes_the_loss_and_reports_a_spike_as_skipped():
    Feature, Batch = hax.Axis("feature", 4), hax.Axis("batch", 8)
    tcfg = TrainerConfig(num_train_steps=20, train_batch_size=8, require_accelerator=False, mp="f32")
    optimizer = AdamConfig(learning_rate=1e-3, warmup=0.0, weight_decay=0.0, max_grad_norm=None,
                           skip_bad_steps={"rolling_interval_length": 4, "sigma_factor": 3.0}).build(20)
    trainer = Trainer(tcfg, optimizer, _loss)
    state = trainer.initial_state(lambda k: _Scale(hax.random.normal(k, (Feature,))), key=jax.random.PRNGKey(0))

    def batch(scale, seed):
        x = hax.random.normal(jax.random.PRNGKey(seed), (Batch, Feature)) * scale
        with hax.partitioning.set_mesh(trainer.mesh):
            return hax.shard({"x": x}, trainer.compute_mapping)

    skipped = []
    for i in range(4):
        state, m = trainer.train_step(state, batch(1.0, i), 8)
        skipped.append(bool(m["skipped"]))
    w_before = jnp.copy(state.model.w.array)
    state, m = trainer.train_step(state, batch(100.0, 99), 8)  # loss x 1e4: a spike
    skipped.append(bool(m["skipped"]))
    assert bool(jnp.isfinite(m["loss"]))
    assert jnp.array_equal(state.model.w.array, w_before)  # not applied
    state, m = trainer.train_step(state, batch(1.0, 5), 8)
    skipped.append(bool(m["skipped"]))
    assert not jnp.array_equal(state.model.w.array, w_before)  # training goes on
    assert skipped == [False, False, False, False, True, False]


def _selects_of_state_shape(trainer, state, batch) -> int:
    """``select`` operations on ``f32[4]`` (the parameter's and the moments' shape) in the compiled step."""
    hlo = trainer.lower_train_step(state, batch, 8).compile().as_text()
    return sum(1 for line in hlo.splitlines() if "= f32[4]" in line and " select(" in line)


@pytest.mark.parametrize("crash", [False, True])
def test_the_step_keeps_the_old_state_only_where_the_run_skips_non_finite_steps(crash):
    # Skipping (crash_on_nan / crash_on_inf false): a NaN step leaves parameters and moments as they were.
    # Stopping (the default): the host raises at that step before the state after it is used, so the step
    # compiles without the select that would keep the old state (one pass over the state less).
    Feature, Batch = hax.Axis("feature", 4), hax.Axis("batch", 8)
    flags = {} if crash else {"crash_on_nan": False, "crash_on_inf": False}
    tcfg = TrainerConfig(num_train_steps=4, train_batch_size=8, require_accelerator=False, mp="f32", **flags)
    optimizer = AdamConfig(learning_rate=1e-3, warmup=0.0, weight_decay=0.0, max_grad_norm=None).build(4)
    trainer = Trainer(tcfg, optimizer, _loss)
    state = trainer.initial_state(lambda k: _Scale(hax.random.normal(k, (Feature,))), key=jax.random.PRNGKey(0))

    def batch(scale):
        x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Feature)) * scale
        with hax.partitioning.set_mesh(trainer.mesh):
            return hax.shard({"x": x}, trainer.compute_mapping)

    state, _ = trainer.train_step(state, batch(1.0), 8)
    before = [jnp.copy(x) for x in jax.tree.leaves((state.model, state.opt_state)) if eqx.is_inexact_array(x)]
    selects = _selects_of_state_shape(trainer, state, batch(1.0))
    state, m = trainer.train_step(state, batch(jnp.nan), 8)
    assert bool(m["skipped"])
    after = [x for x in jax.tree.leaves((state.model, state.opt_state)) if eqx.is_inexact_array(x)]
    kept = all(jnp.array_equal(a, b, equal_nan=True) for a, b in zip(after, before))
    assert kept == (not crash)
    with_select = Trainer(TrainerConfig(num_train_steps=4, train_batch_size=8, require_accelerator=False, mp="f32",
                                        crash_on_nan=False, crash_on_inf=False), optimizer, _loss)
    reference = _selects_of_state_shape(with_select, state, batch(1.0))
    # Keeping the old state is a select per leaf: the four-element parameter and Adam's two moments.
    assert reference >= 3
    assert selects == (0 if crash else reference)


def test_a_resume_is_checked_against_the_setting_the_checkpoint_records():
    """The window's length shapes the optimizer state: a resume that switches the setting on or off, or changes
    the window, is refused naming the key; the same window (any sigma_factor) resumes. A checkpoint written
    before the setting was recorded shows it by the window's arrays."""
    from levanter.optim import check_checkpoint_skip_bad_steps, skip_record

    record = skip_record({"rolling_interval_length": 64, "sigma_factor": 3.0})
    assert record == {"skip_bad_steps": {"rolling_interval_length": 64, "sigma_factor": 3.0}} and skip_record(False) == {}
    check_checkpoint_skip_bad_steps(record, True, 64, "ck/step-5", 5)
    check_checkpoint_skip_bad_steps(record, True, {"rolling_interval_length": 64, "sigma_factor": 9.0}, "ck/step-5", 5)
    check_checkpoint_skip_bad_steps({}, False, False, "ck/step-5", 5)
    check_checkpoint_skip_bad_steps({}, True, True, "ck/step-5", 5)  # older checkpoint: window length unknown
    with pytest.raises(ValueError, match=r"ck/step-5 \(step 5\) was written with optimizer.skip_bad_steps on \(a "
                       r"window of 64 steps\), but this run has off: .*it holds the window.*skip_bad_steps: 64 as"):
        check_checkpoint_skip_bad_steps(record, True, False, "ck/step-5", 5)
    with pytest.raises(ValueError, match=r"skip_bad_steps on, but this run has off: .*skip_bad_steps: true \(with the window"):
        check_checkpoint_skip_bad_steps({}, True, False, "ck/step-5", 5)
    with pytest.raises(ValueError, match=r"another length"):
        check_checkpoint_skip_bad_steps(record, True, 128, "ck/step-5", 5)
