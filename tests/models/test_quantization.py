"""``trainer.quantization``: int8 training of the linear layers through the project's int8 kernel (its
products and gradients against the float ones, any ``dot_general`` layout; the parameters stay float), fp8
training with its scales and histories kept in the model (overwritten by the backward pass, never seen by the
optimizer, checkpointed and exported around), layer selection by ``targets``, and settings that cannot be
honoured refused naming the key."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.extend
import jax.numpy as jnp
import pytest

from accelerator import ON_TPU, tol
from levanter.config import parse_config
from levanter.main import train_lm
from levanter.main.train_lm import lm_loss_fn
from levanter.models import Gpt2Config, LlamaConfig
from levanter.quantization import QuantizationConfig, quantize, quantized_layer_paths, with_fp8
from levanter.training import Trainer, TrainerConfig, num_microbatches

TINY = Gpt2Config(seq_len=16, hidden_dim=32, num_heads=4, num_layers=2, gradient_checkpointing=False)
Vocab = hax.Axis("vocab", 64)
INT8 = QuantizationConfig(int8=True)
FP8 = QuantizationConfig(fp8=True, amax_history_length=4)


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


def _fp8_trainer(pdp=-1, n=8, model=TINY, sgd=False):
    import optax

    tcfg = TrainerConfig(num_train_steps=8, train_batch_size=n, per_device_parallelism=pdp, require_accelerator=False,
                         mp="f32", quantization=FP8)
    tcfg.validate()
    # Weight decay and a clip: neither may touch the fp8 state (it has no gradient, only its next values).
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))
    if sgd:
        # The update is minus the gradient, so comparing weights compares gradients; no clip, which would hide
        # a gradient off by a constant factor.
        optimizer = optax.sgd(1.0)
    trainer = Trainer(tcfg, optimizer, lm_loss_fn(0.0, eos_id=0, quantization=tcfg.quantization))
    state = trainer.initial_state(lambda k: with_fp8(model.build(Vocab, key=k), FP8), key=jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (n, TINY.seq_len), 1, Vocab.size)
    batch = {"tokens": hax.named(tokens, (hax.Axis("batch", n), TINY.Pos))}
    with hax.partitioning.set_mesh(trainer.mesh):
        batch = hax.shard(batch, trainer.compute_mapping)
    return trainer, state, batch


def _split_fp8(model):
    """(the fp8 state's leaves, the other float leaves) of ``model``."""
    import haliax.quantization as hq

    state, rest = hq.partition_for_grad_overwrite(eqx.filter(model, eqx.is_inexact_array))
    return jax.tree.leaves(state), jax.tree.leaves(rest)


def test_fp8_state_lives_in_the_model_and_the_optimizer_keeps_nothing_for_it():
    model = with_fp8(_model(), FP8)
    assert sorted(p.rsplit(".", 2)[-2] + "." + p.rsplit(".", 1)[-1] for p in quantized_layer_paths(model)) == [
        "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    fp8_leaves, weights = _split_fp8(model)
    assert len(fp8_leaves) == 4 * 6 and len(weights) == len(jax.tree.leaves(eqx.filter(_model(), eqx.is_inexact_array)))
    assert with_fp8(_model(), None) is not None and quantized_layer_paths(with_fp8(_model(), INT8)) == []
    _, state, _ = _fp8_trainer()
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert len(moments) == 2 * len(weights)  # Adam's two moments of each weight, none of the fp8 state


# Llama's untied output projection is a linear layer that the loss reads directly: it keeps the plain kernel.
TINY_LLAMA = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                         gradient_checkpointing=False)


@pytest.mark.parametrize("model", [TINY, TINY_LLAMA], ids=["gpt2", "llama"])
def test_a_tiny_model_trains_with_fp8_and_its_scales_follow_the_data(model):
    trainer, state, batch = _fp8_trainer(model=model)
    assert not [p for p in quantized_layer_paths(state.model) if "lm_head" in p]
    before, _ = _split_fp8(state.model)
    assert all(float(jnp.abs(x).max()) in (0.0, 1.0) for x in before)  # fresh: unit scales, empty histories
    assert len(before) == 6 * len(quantized_layer_paths(state.model))
    losses = []
    for _ in range(8):
        state, m = trainer.train_step(state, batch, 8)
        losses.append(float(m["loss"]))
    assert all(jnp.isfinite(jnp.array(losses))) and losses[-1] < losses[0] - 0.3, losses
    after, _ = _split_fp8(state.model)
    # Every scale moved off 1 and every history (4 entries, 8 steps) is full of positive maxima: each layer
    # that holds fp8 state computes through it.
    assert all(bool(jnp.all(x > 0)) for x in after)
    assert sum(bool(jnp.any(x != 1.0)) for x in after) == len(after)
    assert all(x.dtype == jnp.float32 for x in after)


def test_an_fp8_step_over_microbatches_equals_the_step_in_one_pass():
    """Gradients are summed over microbatches; the fp8 state is not a gradient: the scales are the same in
    every microbatch and the histories' newest entry is the maximum over them, which the one pass gives."""
    n = 4 * len(jax.devices())  # four microbatches of one sequence per device
    # Plain SGD at learning rate 1, not Adam: Adam moves a weight by about the learning rate whatever the size
    # of its gradient, so a gradient near zero whose sign the rounding flips (on a TPU) would move it by twice that
    one_trainer, one, batch = _fp8_trainer(-1, n, sgd=True)
    micro_trainer, micro, _ = _fp8_trainer(1, n, sgd=True)
    assert num_microbatches(micro_trainer.config, n) == 4
    w0 = [jnp.array(w, copy=True) for w in _split_fp8(one.model)[1]]  # the step donates the state
    one, m1 = one_trainer.train_step(one, batch, n)
    micro, m4 = micro_trainer.train_step(micro, batch, n)
    # tol: on a TPU the microbatches' float32 sums round differently (1.1e-5 relative on the loss was measured)
    assert abs(float(m1["loss"]) - float(m4["loss"])) < tol(1e-5) * abs(float(m1["loss"]))
    (s1, w1), (s4, w4) = _split_fp8(one.model), _split_fp8(micro.model)
    update_1 = [a - a0 for a, a0 in zip(w1, w0)]
    state_error = max(float((jnp.abs(a - b) / jnp.maximum(jnp.abs(a), 1e-30)).max()) for a, b in zip(s1, s4))
    if not ON_TPU:
        for a, b in zip(w1, w4):
            assert float(jnp.abs(a - b).max()) < 1e-5
        assert state_error < 1e-5
    else:
        # fp8 turns last-bit differences into whole fp8 steps: a value that the TPU's rounding of a float32
        # product moves across an e4m3/e5m2 rounding boundary changes by 12-25 %, and so do the gradients and
        # amax values behind it. The bounds sit between that noise and the faults this check is for, both
        # measured on CPU (docs/bench/2026-12-06-tpu-test-suite.md).
        diff = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(w1, w4)) ** 0.5
        norm = sum(float(jnp.sum(u ** 2)) for u in update_1) ** 0.5
        assert diff < 0.05 * norm, f"updates differ by {diff / norm:.2e} of their norm"
        assert state_error < 0.1, f"the fp8 state differs by {state_error:.2e} (relative)"
    assert all(float(jnp.abs(a).max()) > 0 for a in s1)  # every scale and history was written
    assert all(float(jnp.abs(u).max()) > 0 for u in update_1)  # every weight moved


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


def test_upstream_fp8_spellings_parse(tmp_path):
    cfg = _parse(tmp_path, "  quantization:\n    fp8: true\n    amax_history_length: 16\n    compute_dtype: bfloat16\n"
                           "    targets: [c_fc]\n")
    assert cfg.trainer.quantization == QuantizationConfig(fp8=True, amax_history_length=16, compute_dtype="bfloat16",
                                                          targets=["c_fc"])
    cfg.trainer.validate()


@pytest.mark.parametrize("block, fragment", [
    ("    fp8: true\n    int8: true\n", r"trainer\.quantization\.fp8 and trainer\.quantization\.int8 are both true"),
    ("    int8: true\n    amax_history_length: 16\n", r"trainer\.quantization\.amax_history_length applies to fp8 only"),
    ("    compute_dtype: bfloat16\n", r"trainer\.quantization\.compute_dtype applies to fp8 only"),
    ("    fp8: true\n    amax_history_length: 0\n", r"trainer\.quantization\.amax_history_length=0 must be at least 1"),
    ("    fp8: true\n    compute_dtype: int8\n", r"trainer\.quantization\.compute_dtype='int8' is not a float dtype"),
    ("    fp8: true\n    compute_dtype: bfloat17\n", r"trainer\.quantization\.compute_dtype='bfloat17' is not a float"),
    ("    targets: [c_fc]\n", r"trainer\.quantization\.targets is set but neither int8 nor fp8 is"),
    ("    int8: true\n    targets: '(('\n", r"trainer\.quantization\.targets='\(\(' is not a valid regular"),
])
def test_settings_that_cannot_be_honoured_are_refused_before_any_work(tmp_path, block, fragment):
    cfg = _parse(tmp_path, "  quantization:\n" + block)
    with pytest.raises(ValueError, match=fragment):
        cfg.trainer.validate()


def test_the_evaluator_computes_through_the_int8_kernels_too():
    import optax

    from levanter.training import Evaluator

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


def test_an_fp8_run_resumes_bit_for_bit_exports_its_weights_and_is_resumed_only_as_fp8(tmp_path, capsys):
    """train_lm with fp8: a run stopped at its step-4 checkpoint and resumed gives the uninterrupted run's losses
    (the scales and histories are checkpointed); export_lm_to_hf writes the weights without the fp8 state; the
    same run resumed with fp8 off, or branched from without it, is refused before any work, naming the key."""
    import dataclasses
    import json as _json

    from test_train_lm import metrics, tiny_config, train_losses

    from levanter import run
    from levanter.compat import load_hf_checkpoint
    from levanter.main import export_lm_to_hf

    fp8 = QuantizationConfig(fp8=True, amax_history_length=16)
    whole = tiny_config(tmp_path / "whole", steps=8, quantization=fp8)
    train_lm.main(whole)
    expected = train_losses(metrics(tmp_path / "whole"))
    stopped = tiny_config(tmp_path / "parts", steps=4, quantization=fp8)
    train_lm.main(stopped)
    train_lm.main(dataclasses.replace(stopped, trainer=dataclasses.replace(stopped.trainer, num_train_steps=8)))
    resumed = train_losses(metrics(tmp_path / "parts"))
    assert resumed == expected and len(expected) == 8

    ckpt = tmp_path / "parts" / "ckpt" / "tiny"
    export_lm_to_hf.cli(["--checkpoint_path", str(ckpt), "--output_dir", str(tmp_path / "hf")])
    index = tmp_path / "hf" / "model.safetensors"
    header = _json.loads(index.read_bytes()[8:8 + int.from_bytes(index.read_bytes()[:8], "little")])
    assert header and not [k for k in header if "dot_general" in k or "scale" in k or "amax" in k]
    _, exported = load_hf_checkpoint(str(tmp_path / "hf"))
    assert quantized_layer_paths(exported) == []
    # eval_lm rebuilds the fp8 state the checkpoint records (its own config says nothing of fp8) and evaluates
    # through it: the run's own last evaluation.
    from levanter.main import eval_lm

    plain = dataclasses.replace(stopped, trainer=dataclasses.replace(stopped.trainer, quantization=None))
    ecfg = eval_lm.EvalLmConfig(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)},
                                checkpoint_path=str(ckpt))
    got = eval_lm.main(ecfg)
    last = [r["eval/loss"] for r in metrics(tmp_path / "parts") if r.get("step") == 8 and "eval/loss" in r]
    assert last and got["eval/loss"] == pytest.approx(last[-1], rel=1e-5)

    capsys.readouterr()
    off = dataclasses.replace(stopped.trainer, num_train_steps=12, quantization=None)
    for trainer in (off, dataclasses.replace(off, id="branch", initialize_from=str(ckpt))):
        with pytest.raises(SystemExit) as info, run.cli_errors():
            train_lm.main(dataclasses.replace(stopped, trainer=trainer))
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "written with trainer.quantization fp8 on (targets=None, amax_history_length=16" in err, err
        assert "this run has fp8 off" in err and "Traceback" not in err
    assert train_losses(metrics(tmp_path / "parts")) == expected  # nothing was trained or logged


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_the_int8_product_and_its_gradients_follow_the_float_ones_within_quantization_error():
    from levanter.quantization import int8_matmul

    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w = jax.random.normal(kx, (64, 96)), jax.random.normal(kw, (96, 40))
    g = jax.random.normal(kg, (64, 40))
    y, vjp = jax.vjp(int8_matmul, x, w)
    dx, dw = vjp(g)
    y_ref, vjp_ref = jax.vjp(jnp.matmul, x, w)
    dx_ref, dw_ref = vjp_ref(g)
    # Round to nearest on 8 bits with per-row and per-column scales: about 1 % of the norm, never exact.
    assert 1e-4 < _rel(y, y_ref) < 0.02 and 1e-4 < _rel(dx, dx_ref) < 0.02
    # The weight's gradient is a float product of the unquantized input and output gradient.
    assert _rel(dw, dw_ref) < tol(1e-6)
    # Each int8 product is exact in int32: the forward equals the dequantized operands' float product.
    sx = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127
    sw = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127
    qdq = (jnp.round(x / sx) * sx) @ (jnp.round(w / sw) * sw)
    assert _rel(y, qdq) < tol(1e-5)


def test_the_int8_products_are_int8_with_int32_accumulation_and_the_weight_gradient_is_float():
    from levanter.quantization import int8_matmul

    x, w, g = jnp.ones((16, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(int8_matmul, x, w)[1](g))(x, w)
    fwd = jax.make_jaxpr(int8_matmul)(x, w)

    def dots(jaxpr):  # (operand dtype, result dtype) of every dot_general, nested jaxprs included
        found = []
        for eqn in jaxpr.eqns:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += dots(sub)
            if eqn.primitive.name == "dot_general":
                found.append((str(eqn.invars[0].aval.dtype), str(eqn.outvars[0].aval.dtype)))
        return found

    assert dots(fwd.jaxpr) == [("int8", "int32")]
    assert sorted(dots(jaxpr.jaxpr)) == [("bfloat16", "bfloat16"), ("int8", "int32"), ("int8", "int32")]


@pytest.mark.parametrize("lhs, rhs, dims, spec", [
    ((4, 6, 32), (32, 3, 5), (((2,), (0,)), ((), ())), "abk,kcd->abcd"),  # many outer and output axes
    ((6, 4, 8), (4, 8, 10), (((1, 2), (0, 1)), ((), ())), "mhd,hde->me"),  # heads x head_size contracted
    ((32, 6), (10, 32), (((0,), (1,)), ((), ())), "km,nk->mn"),  # contracted axes first / last
    ((3, 6, 32), (3, 32, 10), (((2,), (1,)), ((0,), (0,))), "bmk,bkn->bmn"),  # a batch axis
])
def test_the_int8_kernel_takes_any_dot_general_layout(lhs, rhs, dims, spec):
    from levanter.quantization import Int8DotGeneral

    a = jax.random.normal(jax.random.PRNGKey(1), lhs)
    b = jax.random.normal(jax.random.PRNGKey(2), rhs)
    out, ref = Int8DotGeneral()(a, b, dims), jnp.einsum(spec, a, b)
    assert out.shape == ref.shape and 1e-4 < _rel(out, ref) < 0.02
    cotangent = jax.random.normal(jax.random.PRNGKey(3), ref.shape)
    grads = jax.vjp(lambda a, b: Int8DotGeneral()(a, b, dims), a, b)[1](cotangent)
    grads_ref = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)[1](cotangent)
    assert 1e-4 < _rel(grads[0], grads_ref[0]) < 0.02 and _rel(grads[1], grads_ref[1]) < tol(1e-5)


def test_a_layer_kept_in_the_compute_dtype_computes_the_plain_product():
    from levanter.quantization import Int8DotGeneral

    a = jax.random.normal(jax.random.PRNGKey(1), (4, 6, 32), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (32, 3, 5), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))

    cotangent = jnp.ones((4, 6, 3, 5), jnp.bfloat16)

    def grads(op):
        return jax.make_jaxpr(lambda a, b: jax.vjp(lambda a, b: op(a, b, dims), a, b)[1](cotangent))(a, b)

    # No custom gradient, no reshapes around it: jax.lax.dot_general's very program, forward and backward.
    kept = Int8DotGeneral(ways=("float",) * 3)
    assert str(grads(kept)) == str(grads(jax.lax.dot_general))
    assert jnp.array_equal(kept(a, b, dims), jax.lax.dot_general(a, b, dims))
    assert str(grads(Int8DotGeneral())) != str(grads(jax.lax.dot_general))  # off a TPU the plan takes int8


def _program(fn, *args) -> str:
    """The compiled program of ``fn`` without its metadata (source lines, names), for comparing two."""
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    return "\n".join(re.sub(r", metadata=\{[^}]*\}", "", line) for line in text.splitlines()
                     if " = " in line and not re.match(r"^\s*\d+ ", line))


def test_a_model_whose_layers_are_all_kept_trains_through_the_unquantized_program():
    from levanter.quantization import Int8DotGeneral

    model = _model()
    kept = jax.tree_util.tree_map(lambda n: Int8DotGeneral(n.layer, ("float",) * 3)
                                  if isinstance(n, Int8DotGeneral) else n, quantize(model, INT8),
                                  is_leaf=lambda n: isinstance(n, Int8DotGeneral))
    assert len(quantized_layer_paths(kept)) == 4
    tokens = hax.named(jnp.arange(32).reshape(2, 16) % 64, ("batch", "position"))
    loss = lm_loss_fn(0.0, eos_id=0)

    def grad(m):
        return eqx.filter_grad(lambda m: loss(m, {"tokens": tokens})[0])(m)

    # GPT-2's c_attn included: under int8 it takes its weight's slices as the plain product does.
    assert _program(grad, kept) == _program(grad, model)


def test_rows_of_zeros_quantize_to_zeros_not_nan():
    from levanter.quantization import int8_matmul

    x = jnp.zeros((8, 16)).at[0].set(1.0)
    w = jnp.zeros((16, 4)).at[:, 0].set(2.0)
    y, vjp = jax.vjp(int8_matmul, x, w)
    dx, dw = vjp(jnp.zeros((8, 4)))
    assert jnp.array_equal(y, x @ w) and not jnp.any(jnp.isnan(dx)) and not jnp.any(jnp.isnan(dw))


def test_the_int8_plan_times_a_layer_even_while_a_step_is_traced():
    from levanter.quantization.int8 import PLANS, _layer_seconds, product_plan

    # Off a TPU every product is int8 (a numerics simulation), with nothing to log.
    assert product_plan(64, 32, 16, "bfloat16") == ("xla", "xla", "float", "")
    # The timing runs on the device during the trace of another program (as the planner does when the train
    # step is first traced) instead of being staged into it; every plan, at a shape the fused kernels tile.
    seen = []

    @jax.jit
    def step(x):
        seen.extend(_layer_seconds(128, 128, 256, jnp.bfloat16, ways, repeats=2) for ways in PLANS)
        return x + 1

    assert float(step(jnp.float32(1))) == 2.0 and len(seen) == len(PLANS)
    assert all(isinstance(t, float) and t > 0 for t in seen)


def test_the_fused_int8_kernel_computes_what_the_xla_int8_products_do():
    import levanter.quantization.int8 as int8

    kx, kw, kg = jax.random.split(jax.random.PRNGKey(4), 3)
    x, w = jax.random.normal(kx, (1024, 384)), jax.random.normal(kw, (384, 256))
    g = jax.random.normal(kg, (1024, 256))
    xla = jax.vjp(lambda x, w: int8.int8_matmul(x, w, "xla", "xla", "xla"), x, w)
    # Pallas's interpreter off a TPU; the output's columns and the weight gradient's tiles narrowed, so that
    # the kernels run over several tiles each way (the rows always do: blocks of 512).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(int8, "_PRODUCT_COLUMNS", 128)
        patch.setattr(int8, "_GRAD_TILE", (128, 128))
        fused = jax.vjp(lambda x, w: int8.int8_matmul(x, w, "fused", "fused", "fused"), x, w)
        fused_grads = fused[1](g)
    assert _rel(fused[0], xla[0]) < tol(1e-6)
    assert all(_rel(a, b) < tol(1e-6) for a, b in zip(fused_grads, xla[1](g)))
    with pytest.raises(ValueError, match="must be in"):
        int8.int8_matmul(x, w, "int4")
    with pytest.raises(ValueError, match=r"multiples of 128; \[100 x 384\] . \[384 x 256\]"):
        int8.int8_matmul(x[:100], w, "fused", "float", "float")
    with pytest.raises(ValueError, match=r"multiples of 128; \[1024 x 384\] . \[384 x 200\]"):
        int8.int8_matmul(x, w[:, :200], "float", "float", "fused")


def test_the_int8_weight_gradient_scales_each_block_of_tokens_apart():
    from levanter.quantization import int8_matmul

    kx, kw, kg = jax.random.split(jax.random.PRNGKey(5), 3)
    # Two blocks of 512 tokens: the second's gradients 1,000 times larger, its inputs zero. Scaled per block,
    # the gradient is the first block's within quantization error; one scale over all tokens would round the
    # first block's gradients, and with them the whole weight gradient, to zero.
    x = jax.random.normal(kx, (1024, 64)) * (jnp.arange(1024) < 512)[:, None]
    w = jax.random.normal(kw, (64, 32))
    g = jax.random.normal(kg, (1024, 32)) * jnp.where(jnp.arange(1024) < 512, 1.0, 1000.0)[:, None]
    dw = jax.vjp(lambda x, w: int8_matmul(x, w, "float", "float", "xla"), x, w)[1](g)[1]
    assert 1e-4 < _rel(dw, x.T @ g) < 0.02

    # Each block's int8 product is exact in int32: the gradient equals the sum over blocks of the dequantized
    # operands' float products, with one scale per column of each block.
    def qdq(a):
        s = jnp.max(jnp.abs(a), axis=0, keepdims=True) / 127
        s = jnp.where(s > 0, s, 1.0)
        return jnp.round(a / s) * s

    expected = sum(qdq(x[b:b + 512]).T @ qdq(g[b:b + 512]) for b in (0, 512))
    assert _rel(dw, expected) < tol(1e-5)
    assert _rel(qdq(x).T @ qdq(g), x.T @ g) > 0.5  # one scale over all tokens: the gradient lost
