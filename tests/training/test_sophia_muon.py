"""Sophia-H and Muon (``optimizer: {type: sophia-h | muon}``): each trains a tiny model through the real train
step; Sophia's Hutchinson estimate is the Hessian's diagonal (exactly for a diagonal Hessian, in expectation
otherwise); Muon's update of a (named, stacked, multi-axis) weight is near-orthogonal per layer; bad values
are refused naming the key; a run resumed from a checkpoint continues Sophia's state bit for bit."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from levanter.checkpoint import CheckpointerConfig, restore
from levanter.data.loader import Batch
from levanter.training import lm_loss_fn
from levanter.models import Gpt2Config
from levanter.optim import AdamConfig, MuonConfig, SophiaHConfig
from levanter.optim.sophia import hutchinson_diagonal, scale_by_sophia_h
from levanter.training import DataEndedError, Trainer, TrainerConfig, TrainHooks, named_batch

VOCAB = hax.Axis("vocab", 61)


def _data(n: int, seed: int = 0, batch: int = 8):
    rng = np.random.default_rng(seed)
    return [{"tokens": jax.device_put(rng.integers(0, 61, (batch, 16)).astype(np.int32))} for _ in range(n)]


def _losses(model_cfg, optimizer, steps: int, *, accumulate=False):
    # With accumulation: a batch of two sequences per device, one per microbatch.
    batch_size = 2 * jax.device_count() if accumulate else 8
    tcfg = TrainerConfig(num_train_steps=steps, train_batch_size=batch_size, require_accelerator=False,
                         per_device_parallelism=1 if accumulate else -1)
    trainer = Trainer(tcfg, optimizer.build(steps), lm_loss_fn(0.0, 60))
    state = trainer.initial_state(lambda k: model_cfg.build(VOCAB, key=k), key=jax.random.PRNGKey(3))
    data, losses = _data(2, batch=batch_size), []
    for s in range(steps):
        with hax.partitioning.set_mesh(trainer.mesh):
            batch = named_batch(data[s % 2], model_cfg.Pos)
        state, m = trainer.train_step(state, batch, batch_size)
        assert not bool(m["skipped"])
        losses.append(float(m["loss"]))
    return losses


GPT2 = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)


class _Elementwise(eqx.Module):
    w: hax.NamedArray


def _elementwise_loss(model, batch):
    # Sum over rows and features of (x w - y)^2: a diagonal Hessian, 2 sum_rows x^2 / rows for the mean loss.
    err = batch["x"] * model.w - batch["y"]
    return hax.sum(err * err).array, jnp.float32(batch["x"].axis_size("batch"))


def test_sophia_through_the_trainer_estimates_on_the_first_microbatch_and_trains():
    Feature = hax.Axis("feature", 4)
    n = 2 * jax.device_count()  # two microbatches of one row per device
    tcfg = TrainerConfig(num_train_steps=8, train_batch_size=n, require_accelerator=False, per_device_parallelism=1,
                         mp="f32")
    beta2 = 0.5
    # gamma 1: the update is a (clipped) Newton step on this quadratic.
    opt = SophiaHConfig(learning_rate=0.3, warmup=0.0, lr_schedule="constant", weight_decay=0.0, beta2=beta2, gamma=1.0,
                        update_interval=2).build(8)
    trainer = Trainer(tcfg, opt, _elementwise_loss)
    state = trainer.initial_state(lambda k: _Elementwise(hax.zeros(Feature)), key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32) * np.array([1.0, 2.0, 0.5, 3.0], np.float32)
    y = x * np.array([1.0, -1.0, 0.5, 2.0], np.float32)
    with hax.partitioning.set_mesh(trainer.mesh):
        batch = hax.shard({"x": hax.named(jnp.asarray(x), ("batch", "feature")),
                           "y": hax.named(jnp.asarray(y), ("batch", "feature"))}, trainer.compute_mapping)
    losses = []
    for step in range(8):
        state, m = trainer.train_step(state, batch, n)
        losses.append(float(m["loss"]))
        if step == 0:
            # The first microbatch is rows 0, 2, 4, ... (microbatch m takes rows m, m + 2, ...).
            first = 2 * (x[::2] ** 2).mean(0)
            np.testing.assert_allclose(np.asarray(state.opt_state[0].h.w.array), (1 - beta2) * first, rtol=1e-5)
            assert not np.allclose(first, 2 * (x ** 2).mean(0), rtol=1e-2)  # the whole batch's would differ
    assert int(state.opt_state[0].hessian_count) == 4  # steps 0, 2, 4, 6
    assert losses[-1] < 0.2 * losses[0], losses


@pytest.mark.slow
def test_sophia_h_trains_a_tiny_gpt2_with_grad_accumulation():
    # Two microbatches: the Hessian-vector product runs on the first, every second step.
    opt = SophiaHConfig(learning_rate=3e-3, warmup=0.0, lr_schedule="constant", update_interval=2)
    losses = _losses(GPT2, opt, 12, accumulate=True)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-2:]) < losses[0] - 0.4, losses


def test_muon_trains_a_tiny_gpt2():
    opt = MuonConfig(learning_rate=2e-2, adam_lr=1e-2, warmup=0.0, lr_schedule="constant", weight_decay=0.01)
    losses = _losses(GPT2, opt, 10)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-2:]) < losses[0] - 0.4, losses


# -- Sophia's Hessian estimate ------------------------------------------------------------------------------
def _quadratic(a: jax.Array):
    """``f(p) = 1/2 x^T A x`` with ``x`` the concatenation of a plain array and a named one (a pytree of two
    leaves, as parameters are), and its params at a point."""
    X = hax.Axis("x", 3)

    def f(p):
        x = jnp.concatenate([p["plain"], p["named"].array])
        return 0.5 * x @ a @ x

    params = {"plain": jnp.array([0.3, -1.0, 2.0]), "named": hax.named(jnp.array([0.5, 0.1, -0.7]), X)}
    return f, params


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(tree["plain"]), np.asarray(tree["named"].array)])


def test_hutchinson_estimate_is_exact_for_a_diagonal_hessian():
    # Rademacher probes: z_i^2 = 1, so one probe gives a diagonal Hessian exactly.
    d = jnp.array([1.0, -2.0, 3.0, 0.5, 4.0, 0.0])
    f, params = _quadratic(jnp.diag(d))
    est = hutchinson_diagonal(f, params, jax.random.PRNGKey(0))
    np.testing.assert_allclose(_flat(est), np.asarray(d), rtol=1e-6)


def test_hutchinson_estimate_matches_the_diagonal_in_expectation():
    a = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (6, 6)))
    a = a + a.T  # symmetric, with off-diagonal terms that make single probes noisy
    f, params = _quadratic(jnp.asarray(a))
    n = 4000
    ests = jax.vmap(lambda k: hutchinson_diagonal(f, params, k))(jax.random.split(jax.random.PRNGKey(2), n))
    mean = _flat(jax.tree.map(lambda x: x.mean(0), ests))
    # One Rademacher probe's estimate of H_ii has variance sum_{j != i} H_ij^2; the tolerance is 5 standard
    # errors of the mean of n probes (the seed is fixed, so the check is deterministic).
    off = (a ** 2).sum(1) - np.diag(a) ** 2
    tol = 5 * np.sqrt(off / n)
    assert np.all(np.abs(mean - np.diag(a)) < tol), (mean, np.diag(a), tol)
    assert np.all(tol < 0.5)  # and the check is tight enough to mean something


def test_sophia_refreshes_its_hessian_average_every_update_interval_steps():
    d = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    f, params = _quadratic(jnp.diag(d))
    opt = scale_by_sophia_h(beta1=0.9, beta2=0.5, epsilon=1e-12, gamma=1.0, clip_threshold=None,
                            update_interval=3, rng_seed=0)
    state = opt.init(params)
    grads = jax.grad(f)(params)
    hs, counts = [], []
    for _ in range(7):
        u, state = opt.update(grads, state, params, obj_fn=f, loss=jnp.float32(0))
        hs.append(_flat(state.h))
        counts.append(int(state.hessian_count))
    # Estimates on steps 0, 3 and 6, each exact here: h = (1 - 0.5^k) diag after k of them.
    assert counts == [1, 1, 1, 2, 2, 2, 3]
    for k, h in zip(counts, hs):
        np.testing.assert_allclose(h, (1 - 0.5 ** k) * np.asarray(d), rtol=1e-6)
    # The update is the bias-corrected momentum (= the constant gradient) over gamma x h, unclipped.
    np.testing.assert_allclose(_flat(u), _flat(grads) / hs[-1], rtol=1e-5)


def test_sophia_clips_the_preconditioned_update():
    f, params = _quadratic(jnp.diag(jnp.full((6,), 1e-3)))  # a flat curvature: m / (gamma h) is large
    opt = scale_by_sophia_h(beta1=0.9, beta2=0.99, epsilon=1e-12, gamma=0.01, clip_threshold=1.0,
                            update_interval=10, rng_seed=0)
    u, _ = opt.update(jax.grad(f)(params), opt.init(params), params, obj_fn=f)
    assert np.max(np.abs(_flat(u))) == 1.0
    np.testing.assert_array_equal(np.sign(_flat(u)), np.sign(_flat(jax.grad(f)(params))))


def test_sophia_needs_the_objective():
    opt = scale_by_sophia_h(beta1=0.9, beta2=0.99, epsilon=1e-12, gamma=0.01, clip_threshold=1.0,
                            update_interval=10, rng_seed=0)
    p = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="needs the parameters and obj_fn="):
        opt.update(p, opt.init(p), p)


# -- Muon -----------------------------------------------------------------------------------------------------
class _Tiny(eqx.Module):
    proj: hnn.Linear  # embed -> (heads, head_dim), stacked over layers
    lm_head: hnn.Linear  # embed -> vocab: AdamW's, as upstream
    scale: hax.NamedArray  # a vector: AdamW's


Layers, Embed, Heads, HeadDim, Vocab = (hax.Axis("layers", 3), hax.Axis("embed", 16), hax.Axis("heads", 2),
                                       hax.Axis("head_dim", 4), hax.Axis("vocab", 5))


def _tiny(key):
    k1, k2 = jax.random.split(key)
    proj = hnn.Linear(weight=hax.random.normal(k1, (Layers, Heads, HeadDim, Embed)), bias=None, In=Embed,
                      Out=(Heads, HeadDim))
    head = hnn.Linear.init(Embed, Vocab, key=k2, use_bias=False)
    return _Tiny(proj, head, hax.ones(Embed))


def test_muon_update_of_a_stacked_multi_axis_weight_is_near_orthogonal_per_layer():
    model = _tiny(jax.random.PRNGKey(0))
    grads = _tiny(jax.random.PRNGKey(1))
    opt = MuonConfig(learning_rate=1.0, adam_lr=0.1, warmup=0.0, lr_schedule="constant", momentum=0.0,
                     max_grad_norm=None).build(10)
    updates, _ = opt.update(grads, opt.init(model), model)
    u = -np.asarray(updates.proj.weight.array)  # (layers, heads, head_dim, embed)
    g = np.asarray(grads.proj.weight.array)
    for layer in range(Layers.size):
        # The matrix is embed (in) x heads*head_dim (out): 16 x 8, so the size factor sqrt(max(1, 8/16)) is 1.
        m = u[layer].reshape(8, 16).T
        s = np.linalg.svd(m, compute_uv=False)
        # Muon's quintic Newton-Schulz gives singular values near 1 (within about 0.3-1.2), not exactly 1.
        assert s.min() > 0.5 and s.max() < 1.3, s
        # ... and the direction of the exact orthogonal factor of the gradient.
        uu, _, vt = np.linalg.svd(g[layer].reshape(8, 16).T, full_matrices=False)
        polar = uu @ vt
        cos = (m * polar).sum() / np.linalg.norm(m) / np.linalg.norm(polar)
        assert cos > 0.95, cos
    # The output head and the vector go to AdamW: its first step is +/- adam_lr per element.
    np.testing.assert_allclose(np.abs(np.asarray(updates.lm_head.weight.array)), 0.1, rtol=1e-3)
    np.testing.assert_allclose(np.abs(np.asarray(updates.scale.array)), 0.1, rtol=1e-3)


def test_muon_kimi_scaling_sizes_updates_like_adamw():
    model, grads = _tiny(jax.random.PRNGKey(0)), _tiny(jax.random.PRNGKey(1))
    opt = MuonConfig(learning_rate=1.0, warmup=0.0, lr_schedule="constant", momentum=0.0, use_kimi_scaling=True,
                     max_grad_norm=None).build(10)
    updates, _ = opt.update(grads, opt.init(model), model)
    u = np.asarray(updates.proj.weight.array)[0].reshape(8, 16)
    # 0.2 sqrt(max(16, 8)) x an orthogonal 8 x 16 matrix (Frobenius norm sqrt(8)): RMS about 0.2.
    rms = np.sqrt((u ** 2).mean())
    assert 0.12 < rms < 0.26, rms


# -- bad values ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, kw, fragment", [
    (SophiaHConfig, {"learning_rate": -1e-3}, "optimizer.learning_rate must be non-negative"),
    (SophiaHConfig, {"gamma": 0.0}, "optimizer.gamma must be positive"),
    (SophiaHConfig, {"beta2": 1.0}, r"optimizer.beta2 must be in \[0, 1\)"),
    (SophiaHConfig, {"epsilon": 0.0}, "optimizer.epsilon must be positive"),
    (SophiaHConfig, {"clip_threshold": -1.0}, "optimizer.clip_threshold must be positive or null"),
    (SophiaHConfig, {"update_interval": 0}, "optimizer.update_interval must be a whole number of steps >= 1"),
    (SophiaHConfig, {"gamma": float("nan")}, "optimizer.gamma must be a finite number"),
    (MuonConfig, {"learning_rate": -1.0}, "optimizer.learning_rate must be non-negative"),
    (MuonConfig, {"adam_lr": -1e-3}, "optimizer.adam_lr must be non-negative"),
    (MuonConfig, {"momentum": 1.0}, r"optimizer.momentum must be in \[0, 1\)"),
    (MuonConfig, {"backend_steps": 0}, "optimizer.backend_steps must be a whole number >= 1"),
    (MuonConfig, {"muon_epsilon": 0.0}, "optimizer.muon_epsilon must be positive"),
    (MuonConfig, {"max_grad_norm": 0.0}, "optimizer.max_grad_norm must be positive or null"),
    (MuonConfig, {"lr": 0.01}, "optimizer.lr=0.01 is not supported: .*learning_rate"),
])
def test_bad_values_are_refused_naming_the_key(cls, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        cls(**kw)


# -- resume ---------------------------------------------------------------------------------------------------
def test_sophia_state_resumes_from_a_checkpoint_bit_for_bit(tmp_path):
    """2 steps, checkpoint, restore, 2 more steps: the same parameters and Sophia state (momentum, Hessian
    average, estimate count) as 4 uninterrupted steps; with update_interval 2 an estimate falls after the
    resume, so its probe must be drawn as the uninterrupted run drew it."""
    model_cfg = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    ckpt = CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=[])
    tcfg = TrainerConfig(num_train_steps=4, train_batch_size=8, require_accelerator=False, checkpointer=ckpt)
    opt = SophiaHConfig(learning_rate=3e-3, warmup=0.0, update_interval=2, rng_seed=7)
    trainer = Trainer(tcfg, opt.build(4), lm_loss_fn(0.0, 60))
    data = _data(4, seed=1)

    def batches(steps):
        return [Batch(step=s, global_offset=8 * s, batch_size=8, data=data[s]) for s in steps]

    def to_named(d):
        return named_batch(d, model_cfg.Pos)

    def fresh():
        return trainer.initial_state(lambda k: model_cfg.build(VOCAB, key=k), key=jax.random.PRNGKey(3))

    full = trainer.train(fresh(), batches(range(4)), to_named=to_named, checkpointer=ckpt.create("full"),
                         hooks=TrainHooks())
    with pytest.raises(DataEndedError):  # the data ends at step 2: checkpointed there
        trainer.train(fresh(), batches(range(2)), to_named=to_named, checkpointer=ckpt.create("half"),
                      hooks=TrainHooks())
    restored = restore(fresh(), tcfg.resume_point("half"))
    assert int(restored.step) == 2 and int(restored.opt_state[0].hessian_count) == 1
    resumed = trainer.train(restored, batches(range(2, 4)), to_named=to_named, checkpointer=ckpt.create("half"),
                            hooks=TrainHooks())
    assert int(resumed.opt_state[0].hessian_count) == 2
    for a, b in zip(jax.tree.leaves((resumed.model, resumed.opt_state)), jax.tree.leaves((full.model, full.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adam_ignores_the_objective_the_trainer_passes():
    # The trainer passes obj_fn to every optimizer taking extra arguments (Adam with skip_bad_steps): Adam's
    # update never calls it, so a poisoned objective changes nothing.
    opt = AdamConfig(learning_rate=1e-2, warmup=0.0, skip_bad_steps=True).build(10)
    p = {"w": jnp.ones(3)}

    def poisoned(_):
        raise AssertionError("Adam must not evaluate the objective")

    u1, _ = opt.update(p, opt.init(p), p, loss=jnp.float32(1.0), obj_fn=poisoned)
    u2, _ = opt.update(p, opt.init(p), p, loss=jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(u1["w"]), np.asarray(u2["w"]))


def test_sophia_with_skip_bad_steps_gets_the_objective_through_the_wrapper():
    d = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    f, params = _quadratic(jnp.diag(d))
    opt = SophiaHConfig(learning_rate=0.1, warmup=0.0, beta2=0.5, skip_bad_steps=True).build(10)
    state = opt.init(params)
    _, state = opt.update(jax.grad(f)(params), state, params, loss=f(params), obj_fn=f)
    h = [s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "hessian_count"))
         if hasattr(s, "hessian_count")][0].h
    np.testing.assert_allclose(_flat(h), 0.5 * np.asarray(d), rtol=1e-6)
