"""``trainer.model_averaging``: the averaged copy of the weights is the EMA of the trained weights, step by
step; it is checkpointed and a resume from any step gives the same average bit for bit; evaluation sees it
(eval/ema/...) beside the trained weights; the memory plan counts it; resuming a checkpoint that
disagrees with the config on averaging is refused naming the key."""

from __future__ import annotations

import glob
import os

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from levanter.checkpoint import CheckpointerConfig, CheckpointInterval, ResumePoint, restore
from levanter.training import lm_loss_fn
from levanter.models import Gpt2Config
from levanter.optim import AdamConfig, EmaModelAveragingConfig
from levanter.training import Trainer, TrainerConfig, TrainHooks, named_batch
from levanter.data.loader import Batch

MODEL = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
VOCAB = hax.Axis("vocab", 61)
STEPS = 5


def floats(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]


def make_trainer(tmp_path, beta=0.8, every=1):
    ckpt = CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=[CheckpointInterval(every=every)])
    tcfg = TrainerConfig(num_train_steps=STEPS, train_batch_size=8, require_accelerator=False, checkpointer=ckpt,
                         model_averaging=None if beta is None else EmaModelAveragingConfig(beta=beta))
    return Trainer(tcfg, AdamConfig(learning_rate=1e-2, warmup=0.0).build(STEPS), lm_loss_fn(0.0, 60)), ckpt


def fresh(trainer):
    return trainer.initial_state(lambda k: MODEL.build(VOCAB, key=k), key=jax.random.PRNGKey(3))


DATA = [{"tokens": np.random.default_rng(s).integers(0, 61, (8, 16)).astype(np.int32)} for s in range(STEPS)]


def batches(steps):
    return [Batch(step=s, global_offset=8 * s, batch_size=8, data={"tokens": jax.device_put(DATA[s]["tokens"])})
            for s in steps]


def to_named(d):
    return named_batch(d, MODEL.Pos)


def test_the_average_is_the_ema_of_the_trained_weights(tmp_path):
    """avg_0 = the initial weights (a copy, not the same buffers), avg_t = beta avg_(t-1) + (1 - beta) w_t,
    computed by hand from the weights after each step; the trained weights are what they are without
    averaging (the average never feeds back)."""
    beta = 0.8
    trainer, _ = make_trainer(tmp_path, beta=beta)
    state = fresh(trainer)
    assert len(floats(state.averaged_model)) == len(floats(state.model)) > 0
    for a, w in zip(jax.tree.leaves(state.averaged_model), jax.tree.leaves(eqx.filter(state.model,
                                                                                       eqx.is_inexact_array))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
        assert all(x.data.unsafe_buffer_pointer() != y.data.unsafe_buffer_pointer()
                   for x, y in zip(a.addressable_shards, w.addressable_shards))
    hand = [x.astype(np.float64) for x in floats(state.model)]
    plain_trainer, _ = make_trainer(tmp_path / "plain", beta=None)
    plain = fresh(plain_trainer)
    assert plain.averaged_model is None
    for b in batches(range(STEPS)):
        state, _ = trainer.train_step(state, to_named(b.data), 8)
        plain, _ = plain_trainer.train_step(plain, to_named(b.data), 8)
        hand = [beta * h + (1 - beta) * w.astype(np.float64) for h, w in zip(hand, floats(state.model))]
        for h, a in zip(hand, floats(state.averaged_model)):
            np.testing.assert_allclose(a, h, rtol=1e-5, atol=1e-6)
    for a, b in zip(floats(state.model), floats(plain.model)):
        np.testing.assert_array_equal(a, b)
    # After five steps the average lags the weights: it is not a second name for them.
    assert max(np.abs(a - w).max() for a, w in zip(floats(state.averaged_model), floats(state.model))) > 1e-4


class Recorder(TrainHooks):
    def __init__(self):
        self.seen = []

    def is_eval_step(self, step: int) -> bool:
        return step in (2, STEPS)

    def evaluate(self, model, step: int) -> None:
        self.seen.append(("trained", step, floats(model)))

    def evaluate_averaged(self, model, step: int) -> None:
        self.seen.append(("averaged", step, floats(model)))


def test_resume_from_every_step_gives_the_same_average_and_eval_sees_it(tmp_path):
    """A checkpoint after every step; resumed from each, the rest of the run ends with the same weights and
    the same average, bit for bit. Evaluation gets the trained weights, then the averaged ones (with the
    model's non-float leaves), at every eval step."""
    trainer, ckpt = make_trainer(tmp_path)
    hooks = Recorder()
    full = trainer.train(fresh(trainer), batches(range(STEPS)), to_named=to_named, checkpointer=ckpt.create("run"),
                         hooks=hooks)
    assert [(k, s) for k, s, _ in hooks.seen] == [("trained", 2), ("averaged", 2), ("trained", STEPS),
                                                  ("averaged", STEPS)]
    for a, b in zip(hooks.seen[-1][2], floats(full.averaged_model)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(hooks.seen[-2][2], floats(full.model)):
        np.testing.assert_array_equal(a, b)
    run_dir = tmp_path / "ckpt" / "run"
    saved = sorted(int(os.path.basename(p)[5:]) for p in glob.glob(str(run_dir / "step-*")))
    assert saved == list(range(1, STEPS + 1))
    for k in range(1, STEPS):
        point = ResumePoint.read(str(run_dir / f"step-{k}"))
        assert point.holds("averaged_model") and point.holds("model")
        state = restore(fresh(trainer), point)
        assert int(state.step) == k
        end = trainer.train(state, batches(range(k, STEPS)), to_named=to_named,
                            checkpointer=ckpt.create(f"resumed-{k}"))
        for a, b in zip(floats(end.averaged_model) + floats(end.model), floats(full.averaged_model) +
                        floats(full.model)):
            np.testing.assert_array_equal(a, b)


def test_resume_refuses_a_checkpoint_that_disagrees_on_averaging(tmp_path):
    from levanter.training import check_resume_averaging

    with_avg, ckpt = make_trainer(tmp_path / "a")
    with_avg.train(fresh(with_avg), batches(range(STEPS)), to_named=to_named, checkpointer=ckpt.create("r"))
    without, ckpt2 = make_trainer(tmp_path / "b", beta=None)
    without.train(fresh(without), batches(range(STEPS)), to_named=to_named, checkpointer=ckpt2.create("r"))
    averaged_point = ResumePoint.read(str(tmp_path / "a" / "ckpt" / "r" / "step-2"))
    plain_point = ResumePoint.read(str(tmp_path / "b" / "ckpt" / "r" / "step-2"))
    check_resume_averaging(averaged_point, with_avg.config)
    check_resume_averaging(plain_point, without.config)  # a checkpoint without averaging, averaging off
    restore(fresh(without), plain_point)
    with pytest.raises(ValueError, match=r"trainer.model_averaging is set but the checkpoint .* holds no averaged"):
        check_resume_averaging(plain_point, with_avg.config)
    with pytest.raises(ValueError, match=r"holds an averaged copy .* trainer.model_averaging is not set"):
        check_resume_averaging(averaged_point, without.config)
    # A branch (trainer.initialize_from) starts its average at the weights it starts from, also from a
    # checkpoint without one; without averaging it keeps none.
    loaded = restore(fresh(without), plain_point)
    branch = with_avg.restart_average(loaded)
    for a, w in zip(floats(branch.averaged_model), floats(loaded.model)):
        np.testing.assert_array_equal(a, w)
    assert without.restart_average(loaded).averaged_model is None


@pytest.mark.parametrize("beta", [1.0, -0.1, float("nan")])
def test_beta_out_of_range_is_refused_naming_the_key(beta):
    with pytest.raises(ValueError, match=r"trainer.model_averaging.beta must be a number in \[0, 1\)"):
        TrainerConfig(model_averaging=EmaModelAveragingConfig(beta=beta), require_accelerator=False).validate()


def test_memory_plan_counts_the_averaged_copy(tmp_path):
    """The compiled step's arguments include the average: one more copy of the parameters, in the plan's
    own row and in its total; the estimate from shapes counts it too."""
    import dataclasses

    from levanter.memory import PlanOptions, check_memory, make_plan

    from test_train_lm import tiny_config

    cfg = tiny_config(tmp_path)
    plans = {}
    for avg in (None, EmaModelAveragingConfig(beta=0.99)):
        c = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, model_averaging=avg))
        plans[avg is not None] = make_plan(c, lm_loss_fn(0.0, None), PlanOptions(vocab_size=257))
    off, on = plans[False], plans[True]
    assert off.averaged_bytes == 0 and on.averaged_bytes == on.param_bytes > 0
    assert on.total_bytes >= off.total_bytes + on.param_bytes
    from levanter.memory import format_plan

    assert "averaged weights" in format_plan(on) and "averaged weights" not in format_plan(off)
    c = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, model_averaging=EmaModelAveragingConfig()))
    with pytest.raises(ValueError, match=r"parameters and gradients and the averaged copy"):
        check_memory(c, 257, available=(1, "the test"))


@pytest.mark.slow
def test_train_lm_evaluates_and_exports_the_average_and_refuses_to_resume_without_it(tmp_path, capsys):
    """train_lm with model_averaging: every eval logs the trained weights (eval/...) and the averaged ones
    (eval/ema/...); the checkpoint holds the average, and hf_save_path exports exactly it. Resuming that
    run with averaging off is refused before any work, naming the key."""
    import dataclasses

    from levanter.checkpoint import load_checkpoint
    from levanter.compat import load_hf_weights
    from levanter.main import train_lm

    from test_train_lm import metrics, tiny_config

    cfg = tiny_config(tmp_path, steps=6, steps_per_eval=3, model_averaging=EmaModelAveragingConfig(beta=0.5))
    cfg = dataclasses.replace(cfg, hf_save_path=str(tmp_path / "hf"), hf_save_steps=6)
    assert train_lm.main(cfg)["final_step"] == 6
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows if "eval/loss" in r] == [3, 6]
    assert [r["step"] for r in rows if "eval/ema/loss" in r] == [3, 6]
    for step in (3, 6):
        trained = next(r["eval/loss"] for r in rows if r["step"] == step and "eval/loss" in r)
        averaged = next(r for r in rows if r["step"] == step and "eval/ema/loss" in r)
        assert np.isfinite(averaged["eval/ema/loss"]) and averaged["eval/ema/loss"] != trained
        assert "eval/ema/bpb" in averaged
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("eval of the averaged weights at step 6: "))
    assert f"loss {next(r for r in rows if r['step'] == 6 and 'eval/ema/loss' in r)['eval/ema/loss']:.4f}" in line
    step6 = str(tmp_path / "ckpt" / "tiny" / "step-6")
    assert ResumePoint.read(step6).holds("averaged_model")
    trainer = Trainer(cfg.trainer, cfg.optimizer.build(6), lm_loss_fn(0.0, None))
    template = trainer.initial_state(lambda k: cfg.model.build(hax.Axis("vocab", 257), key=k),
                                     key=jax.random.PRNGKey(0))
    state = load_checkpoint(template, step6)
    exported = load_hf_weights(template.model, str(tmp_path / "hf" / "tiny" / "step-6"))
    for a, b in zip(floats(exported), floats(state.eval_model)):
        np.testing.assert_array_equal(a, b)

    longer = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, num_train_steps=8,
                                                                   model_averaging=None))
    with pytest.raises(ValueError, match=r"holds an averaged copy .* trainer.model_averaging is not set"):
        train_lm.main(longer)


def test_the_averaged_weights_eval_prints_its_own_line():
    from levanter.progress import format_eval

    assert format_eval(4, {"eval/ema/loss": 2.5, "eval/ema/bpb": 3.0}) == (
        "eval of the averaged weights at step 4: loss 2.5000 | bpb 3.0000")
    assert format_eval(4, {"eval/loss": 2.5, "eval/a/loss": 2.0}) == "eval at step 4: loss 2.5000 | a/loss 2.0000"
