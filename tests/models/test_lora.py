"""levanter.lora: adapters that leave a fresh model's function unchanged, select layers by upstream's
``target_modules`` rules, train alone under the trainer's ``is_trainable`` (the base weights stay bit for bit),
and merge into a plain model that computes what the adapted one does."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from levanter.lora import LoraConfig, LoraLinear, lora_layer_paths, lora_trainable, loraize, merge_lora
from levanter.main.train_lm import lm_loss_fn
from levanter.models import Gpt2Config, LlamaConfig, MixtralConfig
from levanter.quantization import QuantizationConfig, quantize
from levanter.training import Trainer, TrainerConfig

Vocab = hax.Axis("vocab", 64)
GPT2 = Gpt2Config(seq_len=16, hidden_dim=32, num_heads=4, num_layers=2, gradient_checkpointing=False)
LLAMA = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    gradient_checkpointing=False)
TOKENS = hax.named(jnp.arange(32).reshape(2, 16) % 64, ("batch", "position"))


def _build(config):
    return config.build(Vocab, key=jax.random.PRNGKey(0))


def _short(paths):
    return sorted(p.rsplit(".", 1)[-1] for p in paths)


def _with_nonzero_b(model):
    """The adapters as training would leave them: lora_b no longer zero."""
    def bump(node):
        if not isinstance(node, LoraLinear):
            return node
        noise = jax.random.normal(jax.random.PRNGKey(len(node.lora_b.axes)), node.lora_b.array.shape) * 0.1
        return eqx.tree_at(lambda n: n.lora_b, node, hax.named(noise, node.lora_b.axes))
    return jax.tree.map(bump, model, is_leaf=lambda x: isinstance(x, LoraLinear))


@pytest.mark.parametrize("config", [GPT2, LLAMA, LlamaConfig(**{**LLAMA.__dict__, "scan_layers": False})],
                         ids=["gpt2", "llama", "llama-unrolled"])
def test_a_fresh_adapter_changes_nothing_and_a_trained_one_merges_into_the_same_function(config):
    base = _build(config)
    adapted = loraize(base, LoraConfig(r=4, alpha=8.0), key=jax.random.PRNGKey(1))
    assert np.array_equal(np.asarray(adapted(TOKENS).array), np.asarray(base(TOKENS).array))
    trained = _with_nonzero_b(adapted)
    out = np.asarray(trained(TOKENS).array)
    assert np.abs(out - np.asarray(base(TOKENS).array)).max() > 1e-2  # the adapters are in play
    merged = merge_lora(trained)
    assert type(merged) is type(base) and lora_layer_paths(merged) == []
    assert not [x for x in jax.tree.leaves(merged, is_leaf=lambda x: isinstance(x, LoraLinear))
                if isinstance(x, LoraLinear)]
    np.testing.assert_allclose(np.asarray(merged(TOKENS).array), out, atol=2e-5)
    # The merged weights are the base weights plus the adapters' product; nothing else moved.
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(merged))]
    assert sum(m > 0 for m in moved) == len(lora_layer_paths(adapted))


def test_target_modules_follow_upstreams_rules_and_the_output_projection_is_left_alone():
    llama = _build(LLAMA)
    every = lora_layer_paths(loraize(llama, LoraConfig(), key=jax.random.PRNGKey(1)))
    assert _short(every) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]  # no lm_head
    assert _short(lora_layer_paths(loraize(llama, LoraConfig(target_modules=["q_proj", "v_proj"]),
                                           key=jax.random.PRNGKey(1)))) == ["q_proj", "v_proj"]
    assert _short(lora_layer_paths(loraize(llama, LoraConfig(target_modules=".*mlp.*"),
                                           key=jax.random.PRNGKey(1)))) == ["down_proj", "gate_proj", "up_proj"]
    assert _short(lora_layer_paths(loraize(_build(GPT2), LoraConfig(target_modules=["c_attn"]),
                                           key=jax.random.PRNGKey(1)))) == ["c_attn"]


@pytest.mark.parametrize("config, message", [
    (LoraConfig(target_modules=["wqkv"]), r"lora\.target_modules=\['wqkv'\] matches none of the model's linear layers"),
    (LoraConfig(target_modules="(("), r"lora\.target_modules='\(\(' is not a valid regular expression"),
    (LoraConfig(r=0), r"lora\.r=0 must be at least 1"),
    (LoraConfig(dropout=0.1), r"lora\.dropout=0\.1 is not supported"),
])
def test_settings_that_cannot_be_honoured_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        loraize(_build(LLAMA), config, key=jax.random.PRNGKey(1))


def test_quantized_layers_and_grouped_experts_are_refused_rather_than_skipped():
    with pytest.raises(ValueError, match=r"lora: the layer .* computes through a quantized kernel"):
        loraize(quantize(_build(LLAMA), QuantizationConfig(int8=True)), LoraConfig(), key=jax.random.PRNGKey(1))
    moe = dict(seq_len=16, hidden_dim=32, intermediate_dim=24, num_layers=1, num_heads=4, num_kv_heads=2,
               num_local_experts=4, num_experts_per_tok=2, gradient_checkpointing=False)
    dense = loraize(MixtralConfig(**moe).build(Vocab, key=jax.random.PRNGKey(0)), LoraConfig(),
                    key=jax.random.PRNGKey(1))
    assert {"w1", "w2", "w3"} <= set(_short(lora_layer_paths(dense)))
    assert np.isfinite(np.asarray(_with_nonzero_b(dense)(TOKENS).array)).all()
    grouped = loraize(MixtralConfig(**moe, moe_dispatch="grouped").build(Vocab, key=jax.random.PRNGKey(0)),
                      LoraConfig(), key=jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match=r"model\.moe_dispatch: grouped .*LoRA adapters do not run"):
        grouped(TOKENS)


def test_only_the_adapters_train_and_the_base_weights_stay_bit_for_bit():
    tcfg = TrainerConfig(num_train_steps=4, train_batch_size=8, require_accelerator=False, mp="f32")
    tcfg.validate()
    trainer = Trainer(tcfg, optax.adam(1e-2), lm_loss_fn(0.0, eos_id=0), is_trainable=lora_trainable)
    state = trainer.initial_state(
        lambda k: loraize(LLAMA.build(Vocab, key=k), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), key=k),
        key=jax.random.PRNGKey(0))
    base = [np.array(x) for x in jax.tree.leaves(trainer.split_trained(state.model)[1]) if eqx.is_inexact_array(x)]
    assert len(jax.tree.leaves(trainer.trained(state.model))) == 4  # lora_a and lora_b of q_proj and v_proj
    assert len([x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]) == 2 * 4
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, LLAMA.seq_len), 1, Vocab.size)
    batch = {"tokens": hax.named(tokens, (hax.Axis("batch", 8), LLAMA.Pos))}
    with hax.partitioning.set_mesh(trainer.mesh):
        batch = hax.shard(batch, trainer.compute_mapping)
    losses = []
    for _ in range(4):
        state, m = trainer.train_step(state, batch, 8)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0], losses
    after = [np.asarray(x) for x in jax.tree.leaves(trainer.split_trained(state.model)[1]) if eqx.is_inexact_array(x)]
    assert len(after) == len(base) and all(np.array_equal(a, b) for a, b in zip(base, after))
