"""``trainer.quantization``: int8 training of the linear layers through haliax's AQT int8 kernel (the
parameters stay float), layer selection by ``targets``, and fp8 refused naming the key."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import pytest

from levanter.config import parse_config
from levanter.main import train_lm
from levanter.main.train_lm import lm_loss_fn
from levanter.models import Gpt2Config
from levanter.quantization import QuantizationConfig, quantize, quantized_layer_paths
from levanter.trainer import Trainer, TrainerConfig

TINY = Gpt2Config(seq_len=16, hidden_dim=32, num_heads=4, num_layers=2, gradient_checkpointing=False)
Vocab = hax.Axis("vocab", 64)
INT8 = QuantizationConfig(int8=True)


def _model():
    return eqx.filter_jit(lambda k: TINY.build(Vocab, key=k))(jax.random.PRNGKey(0))


def test_every_linear_layer_gets_the_int8_kernel():
    paths = quantized_layer_paths(quantize(_model(), INT8))
    assert sorted(p.rsplit(".", 2)[-2] + "." + p.rsplit(".", 1)[-1] for p in paths) == [
        "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert quantized_layer_paths(_model()) == []
    assert quantize(_model(), None) is not None and quantize(_model(), QuantizationConfig()) is not None


@pytest.mark.parametrize("targets, expected", [
    (["c_fc"], ["mlp.c_fc"]),
    (".*attn.*", ["attn.c_attn", "attn.c_proj"]),
])
def test_targets_select_the_layers(targets, expected):
    paths = quantized_layer_paths(quantize(_model(), QuantizationConfig(int8=True, targets=targets)))
    assert sorted(p.rsplit(".", 2)[-2] + "." + p.rsplit(".", 1)[-1] for p in paths) == expected


def test_targets_matching_nothing_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer\.quantization\.targets=\['q_proj'\] matches none"):
        quantize(_model(), QuantizationConfig(int8=True, targets=["q_proj"]))


def test_a_tiny_model_trains_with_int8_and_its_step_multiplies_in_int8():
    tcfg = TrainerConfig(num_train_steps=8, train_batch_size=8, require_accelerator=False, mp="f32",
                         quantization=INT8)
    tcfg.validate()
    import optax

    trainer = Trainer(tcfg, optax.adam(3e-3), lm_loss_fn(0.0, eos_id=0, quantization=tcfg.quantization))
    state = trainer.initial_state(lambda k: TINY.build(Vocab, key=k), key=jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, TINY.seq_len), 1, Vocab.size)
    batch = {"tokens": hax.named(tokens, (hax.Axis("batch", 8), TINY.Pos))}
    with hax.partitioning.set_mesh(trainer.mesh):
        batch = hax.shard(batch, trainer.compute_mapping)
    hlo = trainer.lower_train_step(state, batch, 8).as_text()
    assert hlo.count("xi8>") >= 8  # int8 operands in the step (forward and backward products)
    losses = []
    for _ in range(8):
        state, m = trainer.train_step(state, batch, 8)
        losses.append(float(m["loss"]))
    assert all(jnp.isfinite(jnp.array(losses)))
    assert losses[-1] < losses[0] - 0.5, losses  # it learns the repeated batch
    # The state keeps float parameters and no quantizer: checkpoints are those of an unquantized run.
    assert quantized_layer_paths(state.model) == []
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array)))


def test_the_int8_loss_is_close_to_the_float_loss_but_not_equal():
    model = _model()
    tokens = hax.named(jnp.arange(32).reshape(2, 16) % 64, ("batch", "position"))
    batch = {"tokens": tokens}
    plain = eqx.filter_jit(lambda m: lm_loss_fn(0.0, eos_id=0)(m, batch))(model)
    int8 = eqx.filter_jit(lambda m: lm_loss_fn(0.0, eos_id=0, quantization=INT8)(m, batch))(model)
    p, q = float(plain[0] / plain[1]), float(int8[0] / int8[1])
    assert p != q and abs(p - q) < 0.05 * abs(p)


def _parse(tmp_path: Path, block: str):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_urls: [memory://x/train.jsonl]\ntrainer:\n  require_accelerator: false\n"
                    + block)
    return parse_config(train_lm.TrainLmConfig, str(path))


def test_upstream_spellings_parse(tmp_path):
    assert _parse(tmp_path, "  quantization: null\n").trainer.quantization is None
    cfg = _parse(tmp_path, "  quantization:\n    int8: true\n    targets: [c_fc, c_proj]\n")
    assert cfg.trainer.quantization == QuantizationConfig(int8=True, targets=["c_fc", "c_proj"])
    cfg.trainer.validate()


@pytest.mark.parametrize("block, fragment", [
    ("    fp8: true\n", r"trainer\.quantization\.fp8=true is not supported: .*platform \('(cpu|tpu)'\).*int8: true"),
    ("    int8: true\n    amax_history_length: 16\n", r"trainer\.quantization\.amax_history_length applies to fp8"),
    ("    targets: [c_fc]\n", r"trainer\.quantization\.targets is set but int8 is not"),
    ("    int8: true\n    targets: '(('\n", r"trainer\.quantization\.targets='\(\(' is not a valid regular"),
])
def test_settings_that_cannot_be_honoured_are_refused_before_any_work(tmp_path, block, fragment):
    cfg = _parse(tmp_path, "  quantization:\n" + block)
    with pytest.raises(ValueError, match=fragment):
        cfg.trainer.validate()


def test_the_evaluator_computes_through_the_int8_kernels_too():
    import optax

    from levanter.eval import Evaluator

    model = _model()
    batch = {"tokens": hax.named(jnp.arange(32).reshape(2, 16) % 64, ("batch", "position"))}
    batch["loss_mask"] = hax.ones(batch["tokens"].axes)
    batch["segment_ids"] = hax.zeros(batch["tokens"].axes, dtype=jnp.int32)
    counts = {}
    for q in (None, INT8):
        tcfg = TrainerConfig(num_train_steps=1, train_batch_size=8, require_accelerator=False, quantization=q)
        trainer = Trainer(tcfg, optax.identity(), lambda m, b: None)
        ev = Evaluator(trainer, [], batch_size=2, Pos=TINY.Pos, byte_lengths=None)
        with hax.partitioning.set_mesh(trainer.mesh), hax.axis_mapping(trainer.compute_mapping):
            lowered = ev._sums_fn().lower(ev._on_mesh(model), (batch, ev._byte_lengths))
            counts[q] = lowered.as_text().count("xi8>")
    assert counts[None] == 0 and counts[INT8] > 0


@pytest.mark.slow
def test_train_lm_runs_with_int8_and_skip_bad_steps(tmp_path):
    """The whole entry point with both options on: it trains, logs every step as applied, and finishes."""
    import dataclasses

    from test_train_lm import metrics, tiny_config, train_losses

    cfg = tiny_config(tmp_path, steps=4, quantization=INT8)
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, skip_bad_steps=True))
    train_lm.main(cfg)
    rows = metrics(tmp_path)
    assert len(train_losses(rows)) == 4
    assert [r["train/skipped_step"] for r in rows if "train/skipped_step" in r] == [0, 0, 0, 0]
