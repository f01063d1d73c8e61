"""Mistral's own pieces (levanter.models.mistral): ``type: mistral`` with upstream's keys and defaults, the
sliding window limiting what a position sees (materialised and blockwise kernels alike), its refusals, the
``config.json`` mapping, ``--dry_run`` on the shipped nano config and that config training with falling loss.
The shared model tests (causality, segments, loss, flops, parameter shapes) run Mistral through
tests/models/test_models.py; logits against transformers' MistralForCausalLM are in tests/compat/test_hf_checkpoints.py, the
window in each attention kernel in tests/models/test_attention.py."""

from __future__ import annotations

import dataclasses
import os
import re

import draccus
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import haliax as hax
from accelerator import tol
from helpers import loss_fall, train_nano_config
from levanter.config import parse_config
from levanter.main import train_lm
from levanter.models import LmConfig, MistralConfig, parameter_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Vocab = hax.Axis("vocab", 100)
B, Pos = hax.Axis("batch", 2), hax.Axis("position", 16)


def tiny(**kw):
    base = dict(hidden_dim=32, intermediate_dim=64, num_heads=4, num_kv_heads=2, num_layers=1, seq_len=16,
                sliding_window=4, attn_backend="vanilla")
    return MistralConfig(**{**base, **kw})


def test_type_mistral_decodes_with_upstream_defaults():
    """upstream's config/mistral_7b.yaml says only ``type: mistral``: the defaults are Mistral 7B v0.1's."""
    cfg = draccus.decode(LmConfig, {"type": "mistral"})
    assert type(cfg) is MistralConfig
    assert (cfg.seq_len, cfg.hidden_dim, cfg.intermediate_dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        8192, 4096, 14336, 32, 32, 8)
    assert (cfg.sliding_window, cfg.attention_window, cfg.layer_norm_epsilon, cfg.activation_function) == (
        4096, 4096, 1e-6, "silu")
    none = draccus.decode(LmConfig, {"type": "mistral", "sliding_window": None})
    assert none.attention_window is None


@pytest.mark.parametrize("window", [0, -3, True, 2.5])
def test_bad_windows_name_the_key(window):
    with pytest.raises(ValueError, match="model.sliding_window must be a positive"):
        tiny(sliding_window=window)


@pytest.mark.parametrize("backend", ["vanilla", "jax_flash"])
def test_the_window_limits_what_a_position_sees(backend):
    """One layer, a window of 4: position 10 sees 7..10, so tokens before 7 do not change its logits (in
    either kernel); without the window they do."""
    cfg = tiny(attn_backend=backend, flash_attention_block_size=4)
    model = cfg.build(Vocab, key=jax.random.PRNGKey(0))
    tokens = hax.random.randint(jax.random.PRNGKey(1), (B, Pos), 0, Vocab.size)
    changed = hax.named(tokens.array.at[:, :7].set((tokens.array[:, :7] + 3) % Vocab.size), tokens.axes)
    a, b = np.asarray(model(tokens).array), np.asarray(model(changed).array)
    np.testing.assert_allclose(a[:, 10:], b[:, 10:], atol=tol(1e-5))
    assert not np.allclose(a[:, 6], b[:, 6], atol=1e-4)
    full = dataclasses.replace(model, config=dataclasses.replace(cfg, sliding_window=None))
    assert not np.allclose(np.asarray(full(tokens).array)[:, 10:], np.asarray(full(changed).array)[:, 10:], atol=1e-4)


def test_blockwise_model_equals_materialised_with_the_window():
    """The whole model with packed documents: jax_flash (a block that does not divide the window) gives the
    vanilla kernel's logits."""
    cfg = tiny(num_layers=2, sliding_window=5)
    model = cfg.build(Vocab, key=jax.random.PRNGKey(2))
    flash = dataclasses.replace(model, config=dataclasses.replace(cfg, attn_backend="jax_flash",
                                                                  flash_attention_block_size=3))
    tokens = hax.random.randint(jax.random.PRNGKey(3), (B, Pos), 0, Vocab.size)
    seg = hax.named(jnp.asarray([[0] * 6 + [1] * 10, [0] * 16]), (B, Pos))
    np.testing.assert_allclose(np.asarray(flash(tokens, seg).array), np.asarray(model(tokens, seg).array),
                               atol=tol(2e-5), rtol=tol(2e-5))


def test_hf_config_mapping_and_refusals():
    from levanter.compat.hf_checkpoints import hf_config_to_lm, lm_to_hf_config

    cfg = tiny(sliding_window=8)
    doc = lm_to_hf_config(cfg, 300)
    assert (doc["model_type"], doc["architectures"], doc["sliding_window"]) == ("mistral", ["MistralForCausalLM"], 8)
    back, vocab = hf_config_to_lm(doc)
    assert vocab == 300 and type(back) is MistralConfig
    shape = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "sliding_window")
    assert [getattr(back, f) for f in shape] == [getattr(cfg, f) for f in shape]
    assert hf_config_to_lm({**doc, "sliding_window": None})[0].sliding_window is None
    with pytest.raises(ValueError, match="field 'sliding_window' must be a positive integer"):
        hf_config_to_lm({**doc, "sliding_window": 0})
    with pytest.raises(ValueError, match="field 'layer_types'"):
        hf_config_to_lm({**doc, "layer_types": ["sliding_attention", "full_attention"]})
    assert hf_config_to_lm({**doc, "layer_types": ["sliding_attention"] * 1})[0].sliding_window == 8
    with pytest.raises(ValueError, match="model.use_bias true .* Hugging Face Mistral"):
        lm_to_hf_config(tiny(use_bias=True), 300)


@pytest.mark.devices(8)  # the plan is 8 simulated CPU devices'
def test_dry_run_plans_the_nano_config(tmp_path, capsys, monkeypatch):
    """``--dry_run`` on config/mistral_nano.yaml (one layer, to keep the compile short) prints Llama's FLOPs per
    token for the same shape (the window is not credited) and the parameter count, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    path = os.path.join(REPO, "config/mistral_nano.yaml")
    over = ["--model.num_layers", "1"]
    train_lm.cli(["--config_path", path, "--dry_run", "--device_memory", "1GiB", *over])
    out = capsys.readouterr().out
    cfg = parse_config(train_lm.TrainLmConfig, path, over)
    assert cfg.model.attention_window == 32 < cfg.model.seq_len
    assert f"FLOPs per token       {cfg.model.flops_per_token(257):,.4g}" in out, out
    d, q, kv, mlp, vocab, seq = 128, 128, 2 * 32, 384, 257, 128
    forward = 2 * (d * q + 2 * d * kv + q * d + 3 * d * mlp) + 2 * 2 * seq * q + 2 * d * vocab
    assert cfg.model.flops_per_token(vocab) == pytest.approx(3 * forward)
    count = int(re.search(r"\(([\d,]+) in all, float32\)", out).group(1).replace(",", ""))
    assert count == sum(x.size for x in jax.tree.leaves(parameter_shapes(cfg.model, 257)))
    assert "fits" in out and not os.listdir(tmp_path)


@pytest.mark.slow
def test_the_nano_config_trains_with_falling_loss(tmp_path):
    """config/mistral_nano.yaml (a window shorter than the sequence), shortened: the loss is finite and falls."""
    cfg, by_step = train_nano_config(tmp_path, "mistral_nano", steps=24, batch_size=8)
    assert type(cfg.model) is MistralConfig and cfg.model.sliding_window < cfg.model.seq_len
    assert loss_fall(by_step) > 1.0, by_step
