"""OLMo 2's own pieces (levanter.models.olmo): ``type: olmo2`` with the model block of upstream's
config/olmo2_sft.yaml, the upstream keys refused or accepted, the query/key norm over the whole projection,
the norms on the residual branches' outputs (none on their inputs), the ``config.json`` mapping, ``--dry_run``
on the shipped nano config and that config training with falling loss. The shared model tests run OLMo 2
through tests/models/test_models.py; logits against transformers' Olmo2ForCausalLM are in tests/compat/test_hf_checkpoints.py."""

from __future__ import annotations

import os
import re

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import haliax as hax
from accelerator import tol
from helpers import loss_fall, train_nano_config
from levanter.config import parse_config
from levanter.main import train_lm
from levanter.models import LmConfig, Olmo2Config, parameter_shapes
from levanter.models.rope import DefaultRopeConfig
from levanter.refused_keys import check_refused

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Vocab = hax.Axis("vocab", 100)
B, Pos = hax.Axis("batch", 2), hax.Axis("position", 16)

# The model block of upstream's config/olmo2_sft.yaml (OLMo 2 7B), key for key.
UPSTREAM_7B = {
    "type": "olmo2", "seq_len": 4096, "hidden_dim": 4096, "intermediate_dim": 11008, "num_layers": 32,
    "num_heads": 32, "num_kv_heads": 32, "flash_attention_block_size": 512, "use_bias": False,
    "use_layer_norm_weight": True, "initializer_range": 0.02, "layer_norm_epsilon": 1e-6,
    "activation_function": "silu", "attention_bias": False, "upcast_attn": True,
    "rope": {"type": "default", "theta": 500000},
}


def tiny(**kw):
    base = dict(hidden_dim=32, intermediate_dim=64, num_heads=4, num_kv_heads=2, num_layers=2, seq_len=16)
    return Olmo2Config(**{**base, **kw})


def test_upstream_model_block_decodes():
    cfg = draccus.decode(LmConfig, UPSTREAM_7B)
    assert type(cfg) is Olmo2Config and cfg.rope == DefaultRopeConfig(theta=500000.0)
    assert (cfg.HeadSize.size, cfg.upcast_attn, cfg.qk_norm, cfg.qkv_bias) == (128, True, True, False)
    check_refused(cfg, "model")
    default = Olmo2Config()  # upstream's defaults: OLMo 2 7B's shape
    assert (default.seq_len, default.hidden_dim, default.intermediate_dim, default.num_kv_heads,
            default.layer_norm_epsilon) == (4096, 4096, 11008, 32, 1e-6)
    # upstream's own reference checkpoint changes nothing; another one, or attention dropout, is refused.
    check_refused(draccus.decode(LmConfig, {"type": "olmo2", "reference_checkpoint": "allenai/OLMo-2-1124-7B"}))
    with pytest.raises(ValueError, match="model.reference_checkpoint='org/other' is not supported"):
        check_refused(draccus.decode(LmConfig, {"type": "olmo2", "reference_checkpoint": "org/other"}), "model")
    with pytest.raises(ValueError, match="model.attention_dropout=0.1 is not supported"):
        check_refused(draccus.decode(LmConfig, {"type": "olmo2", "attention_dropout": 0.1}), "model")


def test_qk_norm_spans_the_whole_projection():
    """The query norm's scale is [heads, head_size] and its statistic is the mean square over every head of a
    position at once (OLMo 2), not over each head alone (Qwen3); keys: [kv_heads, head_size]."""
    model = tiny().build(Vocab, key=jax.random.PRNGKey(0))
    attn = model.layers.stacked.self_attn
    assert attn.q_norm.weight.axes[1:] == (hax.Axis("heads", 4), hax.Axis("head_size", 8))
    assert attn.k_norm.weight.axes[1:] == (hax.Axis("kv_heads", 2), hax.Axis("head_size", 8))
    norm = jax.tree.map(lambda x: x["layers", 0] if isinstance(x, hax.NamedArray) else x, attn.q_norm,
                        is_leaf=lambda x: isinstance(x, hax.NamedArray))
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 8)).astype(np.float32)
    norm = eqx.tree_at(lambda n: n.weight, norm, hax.named(jnp.asarray(weight), norm.weight.axes))
    q = rng.standard_normal((16, 4, 8)).astype(np.float32) * np.array([1, 5, 0.2, 3], np.float32)[None, :, None]
    got = np.asarray(norm(hax.named(jnp.asarray(q), (Pos, norm.weight.axes[0], norm.weight.axes[1]))).array)
    flat = q.reshape(16, 32)
    want = (flat / np.sqrt(np.mean(flat**2, axis=-1, keepdims=True) + 1e-6)).reshape(16, 4, 8) * weight
    np.testing.assert_allclose(got, want, rtol=tol(1e-5), atol=tol(1e-5))


def test_norms_sit_on_the_branch_outputs():
    """No norm on a block's input; with both output norms' scales at zero every block adds nothing, so the
    hidden states are the final norm of the embeddings -- the norms sit on the branches, before the adds."""
    model = tiny().build(Vocab, key=jax.random.PRNGKey(1))
    layers = model.layers.stacked
    assert layers.input_layernorm is None and layers.pre_feedforward_layernorm is None
    tokens = hax.random.randint(jax.random.PRNGKey(2), (B, Pos), 0, Vocab.size)
    silent = eqx.tree_at(lambda m: (m.layers.stacked.post_attention_layernorm.weight,
                                    m.layers.stacked.post_feedforward_layernorm.weight),
                         model, (layers.post_attention_layernorm.weight * 0, layers.post_feedforward_layernorm.weight * 0))
    want = model.norm(model.embed_tokens.embed(tokens))
    np.testing.assert_allclose(np.asarray(silent.activations(tokens).array), np.asarray(want.array), atol=tol(1e-6))
    assert not np.allclose(np.asarray(model.activations(tokens).array), np.asarray(want.array), atol=1e-3)


def test_hf_config_mapping_and_refusals():
    from levanter.compat.hf_checkpoints import hf_config_to_lm, lm_to_hf_config

    cfg = tiny(attention_bias=True, rope_theta=500000.0, layer_norm_epsilon=1e-6)
    doc = lm_to_hf_config(cfg, 300)
    assert (doc["model_type"], doc["architectures"], doc["attention_bias"]) == ("olmo2", ["Olmo2ForCausalLM"], True)
    back, vocab = hf_config_to_lm(doc)
    assert vocab == 300 and type(back) is Olmo2Config
    shape = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "attention_bias",
             "layer_norm_epsilon", "rope_theta")
    assert [getattr(back, f) for f in shape] == [getattr(cfg, f) for f in shape]
    # transformers' OLMo 2 default epsilon when config.json leaves it out.
    assert hf_config_to_lm({k: v for k, v in doc.items() if k != "rms_norm_eps"})[0].layer_norm_epsilon == 1e-5
    with pytest.raises(ValueError, match="model.use_bias true .* Hugging Face OLMo 2"):
        lm_to_hf_config(tiny(use_bias=True), 300)


@pytest.mark.devices(8)  # the plan is 8 simulated CPU devices'
def test_dry_run_plans_the_nano_config(tmp_path, capsys, monkeypatch):
    """``--dry_run`` on config/olmo2_nano.yaml (one layer) prints the model's FLOPs per token and its parameter
    count, counted by hand from the YAML: Llama's matmuls, two norms per block plus the whole-width q and k
    norms, the final norm; and writes nothing."""
    monkeypatch.chdir(tmp_path)
    path = os.path.join(REPO, "config/olmo2_nano.yaml")
    over = ["--model.num_layers", "1"]
    train_lm.cli(["--config_path", path, "--dry_run", "--device_memory", "1GiB", *over])
    out = capsys.readouterr().out
    cfg = parse_config(train_lm.TrainLmConfig, path, over)
    d, mlp, vocab, seq = 128, 384, 257, 128
    matmuls = 4 * d * d + 3 * d * mlp
    count = int(re.search(r"\(([\d,]+) in all, float32\)", out).group(1).replace(",", ""))
    assert count == 2 * vocab * d + matmuls + 2 * d + 2 * d + d
    assert count == sum(x.size for x in jax.tree.leaves(parameter_shapes(cfg.model, vocab)))
    flops = float(re.search(r"FLOPs per token\s+([\d,.e+]+)", out).group(1).replace(",", ""))
    assert flops == pytest.approx(3 * (2 * matmuls + 2 * 2 * seq * d + 2 * d * vocab), rel=1e-3)
    assert "fits" in out and not os.listdir(tmp_path)


@pytest.mark.slow
def test_the_nano_config_trains_with_falling_loss(tmp_path):
    """config/olmo2_nano.yaml, shortened: the loss is finite and falls."""
    cfg, by_step = train_nano_config(tmp_path, "olmo2_nano", steps=24, batch_size=8)
    assert type(cfg.model) is Olmo2Config
    assert loss_fall(by_step) > 1.0, by_step
