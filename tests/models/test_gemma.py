"""Gemma's own pieces (levanter.models.gemma): ``type: gemma`` / ``gemma2`` in YAML, the (1 + weight) RMS norm, the
sqrt(hidden_dim) embedding scale, a head size independent of hidden_dim / num_heads, FLOPs per token from the
attention width, Gemma 2's window, caps and refusals, ``--dry_run`` on the shipped nano config, and that config training with falling loss.
The shared model tests (causality, segments, GQA/MQA, remat/scan equivalence, shapes) run Gemma through
tests/models/test_models.py; logits against transformers are in tests/compat/test_hf_checkpoints.py."""

from __future__ import annotations

import dataclasses
import math
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
from levanter.models import Gemma2Config, GemmaConfig, LmConfig, parameter_shapes
from levanter.models.gemma import GemmaRmsNorm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Vocab = hax.Axis("vocab", 100)
B, Pos = hax.Axis("batch", 2), hax.Axis("position", 16)


def tiny(**kw):
    base = dict(hidden_dim=32, intermediate_dim=64, num_heads=4, head_dim=16, num_kv_heads=2, num_layers=2,
                seq_len=16)
    return GemmaConfig(**{**base, **kw})


def ids(seed=0):
    return hax.random.randint(jax.random.PRNGKey(seed), (B, Pos), 0, Vocab.size)


def test_type_gemma_decodes_with_upstream_keys():
    cfg = draccus.decode(LmConfig, {
        "type": "gemma", "hidden_dim": 64, "intermediate_dim": 128, "num_heads": 2, "head_dim": 48,
        "num_kv_heads": 1, "num_layers": 3, "seq_len": 32, "activation_function": "gelu_new",
        "norm_embeddings": True, "rope_theta": 5000.0, "use_flash_attention": True,
    })
    assert type(cfg) is GemmaConfig
    assert (cfg.HeadSize.size, cfg.Heads.size, cfg.KVHeads.size, cfg.Embed.size) == (48, 2, 1, 64)
    assert cfg.attention_backend == "jax_flash" and cfg.tie_word_embeddings and cfg.max_seq_len is None
    defaults = GemmaConfig()  # Gemma 2B's shape
    assert (defaults.hidden_dim, defaults.num_heads, defaults.head_dim, defaults.num_kv_heads) == (2048, 8, 256, 1)
    with pytest.raises(draccus.utils.ParsingError) as info:
        draccus.decode(LmConfig, {"type": "gemma", "num_heads": 8, "num_kv_heads": 3})
    assert "model.num_kv_heads" in str(info.value.__cause__)


def test_norm_scales_by_one_plus_weight_in_float32():
    Embed = hax.Axis("embed", 8)
    x = hax.random.normal(jax.random.PRNGKey(1), (B, Embed)) * 3.0
    norm = GemmaRmsNorm.init(Embed, eps=1e-6)
    assert np.all(np.asarray(norm.weight.array) == 0.0)  # zero offset: scale 1 at init
    w = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    norm = GemmaRmsNorm(hax.named(jnp.asarray(w), (Embed,)), Embed, 1e-6)
    xa = np.asarray(x.array, dtype=np.float64)
    expected = xa / np.sqrt(np.mean(xa**2, axis=-1, keepdims=True) + 1e-6) * (1.0 + w)
    np.testing.assert_allclose(np.asarray(norm(x).array), expected, rtol=tol(1e-5), atol=tol(1e-6))
    # bfloat16 activations: the result is bfloat16, and a tiny offset is not lost to 1 + w in bfloat16
    small = GemmaRmsNorm(hax.named(jnp.full((8,), 2.0**-10, jnp.bfloat16), (Embed,)), Embed, 1e-6)
    ones = hax.ones((Embed,), dtype=jnp.bfloat16)
    out = small(ones * 4.0)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out.array, np.float32), 1.0 + 2.0**-10, rtol=2e-3)


def test_embeddings_enter_scaled_by_sqrt_hidden_and_the_tied_head_does_not():
    config = tiny()
    scaled = config.build(Vocab, key=jax.random.PRNGKey(0))
    plain = tiny(norm_embeddings=False).build(Vocab, key=jax.random.PRNGKey(0))
    # The same hidden states come out of the unscaled model given sqrt(d) x the embedding table...
    pre = eqx.tree_at(lambda m: m.embed_tokens.weight, plain, plain.embed_tokens.weight * math.sqrt(32))
    tokens = ids(3)
    np.testing.assert_allclose(np.asarray(scaled.activations(tokens).array),
                               np.asarray(pre.activations(tokens).array), rtol=tol(1e-5), atol=tol(1e-5))
    # ...but the logits use the table itself: the head is the unscaled embedding matrix.
    assert scaled.lm_head is None and scaled.get_lm_head() is scaled.embed_tokens.weight
    assert not np.allclose(np.asarray(scaled(tokens).array), np.asarray(plain(tokens).array), atol=1e-3)


def test_head_size_is_independent_of_hidden_dim():
    model = tiny(hidden_dim=24, num_heads=3, head_dim=40, num_kv_heads=1).build(Vocab, key=jax.random.PRNGKey(2))
    attn = model.layers.stacked.self_attn
    sizes = {a.name: a.size for a in attn.q_proj.weight.axes}
    assert (sizes["heads"], sizes["head_size"], sizes["embed"]) == (3, 40, 24)
    assert {a.name: a.size for a in attn.k_proj.weight.axes}["kv_heads"] == 1
    out = model(ids(4))
    assert out.axes == (B, Pos, Vocab) and bool(jnp.all(jnp.isfinite(out.array)))


def test_flops_per_token_counts_the_attention_width():
    c = tiny(hidden_dim=32, num_heads=4, head_dim=16, num_kv_heads=1, intermediate_dim=64, num_layers=1, seq_len=8)
    d, q, kv, m, s, v = 32, 64, 16, 64, 8, 100
    per_layer = 2 * (d * q + 2 * d * kv + q * d) + 2 * 3 * d * m + 2 * 2 * s * q
    assert c.flops_per_token(v) == 3 * (per_layer + 2 * d * v)


def tiny2(**kw):
    base = dict(hidden_dim=32, intermediate_dim=64, num_heads=4, head_dim=16, num_kv_heads=2, num_layers=2,
                seq_len=16, sliding_window=4, attn_logit_softcapping=1.0, final_logit_softcapping=0.5)
    return Gemma2Config(**{**base, **kw})


def test_gemma2_decodes_and_refuses_what_it_cannot_run():
    cfg = draccus.decode(LmConfig, {"type": "gemma2", "hidden_dim": 64, "num_heads": 4, "head_dim": 32,
                                    "sliding_window": 8, "final_logit_softcapping": None})
    assert type(cfg) is Gemma2Config and isinstance(cfg, GemmaConfig)
    assert (cfg.sliding_window, cfg.final_logit_softcapping, cfg.attn_logit_softcapping) == (8, None, 50.0)
    assert tiny2(num_layers=5).sliding_layers() == [True, False, True, False, True]
    assert tiny2(sliding_window=None).sliding_layers() == [False, False]
    with pytest.raises(ValueError, match="model.attn_backend 'jax_flash' cannot run Gemma 2"):
        tiny2(attn_backend="jax_flash")
    with pytest.raises(ValueError, match="model.attn_backend 'jax_flash' cannot run Gemma 2"):
        tiny2(use_flash_attention=True)
    with pytest.raises(ValueError, match="model.cross_entropy_block_size cannot be combined"):
        tiny2(cross_entropy_block_size=64)
    assert tiny2(cross_entropy_block_size=64, final_logit_softcapping=None).cross_entropy_block_size == 64
    with pytest.raises(ValueError, match="model.sliding_window must be positive"):
        tiny2(sliding_window=0)


def test_memory_suggestions_leave_out_what_gemma2_refuses():
    """A step that does not fit is answered with keys that lower it; for Gemma 2 those are only the ones its
    config accepts (no blockwise loss under the logit cap), never a config that would fail its own check."""
    from levanter.memory import model_alternatives

    keys = [k for k, _, _ in model_alternatives(tiny2(seq_len=512, gradient_checkpointing=False), 50_000)]
    assert keys == ["model.gradient_checkpointing"]
    uncapped = tiny2(seq_len=512, gradient_checkpointing=False, final_logit_softcapping=None)
    assert [k for k, _, _ in model_alternatives(uncapped, 50_000)] == [
        "model.gradient_checkpointing", "model.cross_entropy_block_size"]


def test_gemma2_logits_are_capped_and_the_window_limits_what_a_sliding_layer_sees():
    model = tiny2(final_logit_softcapping=0.5).build(Vocab, key=jax.random.PRNGKey(0))
    model = jax.tree.map(lambda a: a * 20 if eqx.is_inexact_array(a) else a, model)  # scores and logits large
    tokens = ids(5)
    logits = np.asarray(model(tokens).array)
    assert np.abs(logits).max() <= 0.5 and np.abs(logits).max() > 0.4  # near the cap, never past it
    # A one-layer model whose only layer slides: position 10 sees 7..10, so tokens before 7 do not matter
    # to it; with the window off, they do.
    one = tiny2(num_layers=1, final_logit_softcapping=None)
    m = one.build(Vocab, key=jax.random.PRNGKey(1))
    changed = hax.named(tokens.array.at[:, :7].set((tokens.array[:, :7] + 3) % Vocab.size), tokens.axes)
    a, b = np.asarray(m(tokens).array), np.asarray(m(changed).array)
    np.testing.assert_allclose(a[:, 10:], b[:, 10:], atol=tol(1e-5))
    assert not np.allclose(a[:, 6], b[:, 6], atol=1e-4)
    full = dataclasses.replace(m, config=dataclasses.replace(one, sliding_window=None))
    assert not np.allclose(np.asarray(full(tokens).array)[:, 10:], np.asarray(full(changed).array)[:, 10:], atol=1e-4)


@pytest.mark.devices(8)  # the plan is 8 simulated CPU devices'
def test_dry_run_plans_the_nano_config(tmp_path, capsys, monkeypatch):
    """``--dry_run`` on config/gemma_nano.yaml (one layer: a quarter of the compile) prints the model's own
    FLOPs per token and its parameter count, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    path = os.path.join(REPO, "config/gemma_nano.yaml")
    over = ["--model.num_layers", "1"]
    train_lm.cli(["--config_path", path, "--dry_run", "--device_memory", "1GiB", *over])
    out = capsys.readouterr().out
    cfg = parse_config(train_lm.TrainLmConfig, path, over)
    assert f"FLOPs per token       {cfg.model.flops_per_token(257):,.4g}" in out, out
    count = int(re.search(r"\(([\d,]+) in all, float32\)", out).group(1).replace(",", ""))
    assert count == sum(x.size for x in jax.tree.leaves(parameter_shapes(cfg.model, 257)))
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_the_nano_config_trains_with_falling_loss(tmp_path):
    """config/gemma_nano.yaml, shortened: the loss is finite and falls."""
    cfg, by_step = train_nano_config(tmp_path, "gemma_nano", steps=24, batch_size=8)
    assert type(cfg.model) is GemmaConfig
    assert loss_fall(by_step) > 1.0, by_step
