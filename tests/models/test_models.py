"""GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Gemma, Gemma 2 and OLMo 2 on tiny configs: shapes, causality,
segment isolation, GQA, training, loss, configs."""

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import haliax as hax
from accelerator import tol
from levanter.models import (
    Gemma2Config,
    GemmaConfig,
    Gpt2Config,
    LlamaConfig,
    LmConfig,
    LmHeadModel,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
    causal_attention,
    causal_segment_mask,
    next_token_loss,
)
from levanter.models.rope import DefaultRopeConfig, Llama3RopeConfig, YarnRopeConfig

Vocab = hax.Axis("vocab", 100)
Batch = hax.Axis("batch", 2)


def tiny_gpt2(**kw):
    return Gpt2Config(**{"hidden_dim": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16, **kw})


def tiny_llama(**kw):
    base = {"hidden_dim": 32, "intermediate_dim": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2}
    return LlamaConfig(**{**base, "seq_len": 16, **kw})


def tiny_qwen2(**kw):
    base = {"hidden_dim": 32, "intermediate_dim": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2}
    return Qwen2Config(**{**base, "seq_len": 16, **kw})


def tiny_qwen3(**kw):
    # A head size (16) apart from hidden_dim / num_heads (8), as released Qwen3 models have.
    base = {"hidden_dim": 32, "intermediate_dim": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2, "head_dim": 16}
    return Qwen3Config(**{**base, "seq_len": 16, **kw})


def tiny_mixtral(**kw):
    base = {"hidden_dim": 32, "intermediate_dim": 24, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2,
            "num_local_experts": 4, "num_experts_per_tok": 2}
    return MixtralConfig(**{**base, "seq_len": 16, **kw})


def tiny_gemma(**kw):
    # Heads of 16 on a 32-wide stream: the attention width (64) differs from hidden_dim; multi-query.
    base = {"hidden_dim": 32, "intermediate_dim": 64, "num_heads": 4, "head_dim": 16, "num_kv_heads": 1,
            "num_layers": 2}
    return GemmaConfig(**{**base, "seq_len": 16, **kw})


def tiny_gemma2(**kw):
    # A window of 4 on layers 0, 2, ...; a score scale other than head_dim's; both soft caps on.
    base = {"hidden_dim": 32, "intermediate_dim": 64, "num_heads": 4, "head_dim": 16, "num_kv_heads": 2,
            "num_layers": 2, "sliding_window": 4, "query_pre_attn_scalar": 24}
    return Gemma2Config(**{**base, "seq_len": 16, **kw})


def tiny_mistral(**kw):
    # A window of 4 positions of the 16: the causality and segment checks run with it in play.
    base = {"hidden_dim": 32, "intermediate_dim": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2,
            "sliding_window": 4}
    return MistralConfig(**{**base, "seq_len": 16, **kw})


def tiny_olmo2(**kw):
    base = {"hidden_dim": 32, "intermediate_dim": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2}
    return Olmo2Config(**{**base, "seq_len": 16, **kw})


CONFIGS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3,
           "mixtral": tiny_mixtral, "gemma": tiny_gemma, "gemma2": tiny_gemma2, "mistral": tiny_mistral,
           "olmo2": tiny_olmo2}


@eqx.filter_jit
def forward(model, ids, segment_ids=None, key=None):
    return model(ids, segment_ids, key=key)


def random_ids(seed, Pos, batch=Batch):
    return hax.random.randint(jax.random.PRNGKey(seed), (batch, Pos), 0, Vocab.size)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request) -> LmHeadModel:
    return CONFIGS[request.param]().build(Vocab, key=jax.random.PRNGKey(0))


def test_output_axes_and_dtype(model):
    ids = random_ids(1, model.Pos)
    logits = forward(model, ids)
    assert logits.axes == (Batch, model.Pos, Vocab)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits.array)))
    assert model.Vocab == Vocab and model.Pos.name == "position" and model.config.seq_len == 16


def test_causal(model):
    ids = random_ids(2, model.Pos)
    base = forward(model, ids).array
    for t in (0, 5, 14):
        changed = ids.array.at[:, t + 1 :].set((ids.array[:, t + 1 :] + 7) % Vocab.size)
        out = forward(model, hax.named(changed, ids.axes)).array
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], atol=tol(1e-5))
        assert not np.allclose(out[:, t + 1 :], base[:, t + 1 :], atol=1e-3)


def test_segment_isolation(model):
    ids = random_ids(3, model.Pos)
    seg = hax.named(jnp.array([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]), ids.axes)
    base = forward(model, ids, seg).array
    in_segment_0 = jnp.arange(16) < 5
    changed = jnp.where(in_segment_0, (ids.array + 11) % Vocab.size, ids.array)
    out = forward(model, hax.named(changed, ids.axes), seg).array
    # row 0: segments 1 and 2 never see segment 0
    np.testing.assert_allclose(out[0, 5:], base[0, 5:], atol=tol(1e-5))
    assert not np.allclose(out[0, :5], base[0, :5], atol=1e-3)
    # row 1 is one document, so later positions do see the change
    assert not np.allclose(out[1, 5:], base[1, 5:], atol=1e-3)
    # Llama's rotary encoding is relative, so a packed segment's logits equal those of the same
    # tokens alone in a fresh row (GPT-2's absolute positions make this untrue by design).
    if isinstance(model.config, LlamaConfig):
        Pos4 = model.Pos.resize(4)
        alone = forward(model, hax.named(ids.array[:, 12:], (Batch, Pos4))).array
        np.testing.assert_allclose(base[0, 12:], alone[0], atol=tol(1e-4))


def _reference_attention(q, k, v, mask):
    """numpy: q [b, s, h, d], k/v [b, s, kvh, d], mask [b, s, s]; head h uses kv head h // group."""
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(mask[:, None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", w, v)


def test_gqa_attention_matches_reference():
    sizes = {"position": 6, "heads": 4, "kv_heads": 2, "head_size": 8}
    Pos, Heads, KVHeads, HeadSize = (hax.Axis(n, s) for n, s in sizes.items())
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(4), 3)
    q = hax.random.normal(kq, (Batch, Pos, Heads, HeadSize))
    k = hax.random.normal(kk, (Batch, Pos, KVHeads, HeadSize))
    v = hax.random.normal(kv, (Batch, Pos, KVHeads, HeadSize))
    seg = hax.named(jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]]), (Batch, Pos))
    mask = causal_segment_mask(Pos, seg)
    assert mask.dtype == jnp.bool_ and mask.axes == (Batch, Pos, hax.Axis("key_position", 6))

    out = causal_attention(q, k, v, mask)
    assert out.axes == (Batch, Pos, Heads, HeadSize)
    expected = _reference_attention(*(np.asarray(x.array) for x in (q, k, v, mask)))
    np.testing.assert_allclose(np.asarray(out.array), expected, atol=tol(1e-5))

    # GQA == multi-head attention with each kv head repeated for its group of query heads
    k_rep = hax.named(jnp.repeat(k.array, 2, axis=2), (Batch, Pos, Heads, HeadSize))
    v_rep = hax.named(jnp.repeat(v.array, 2, axis=2), (Batch, Pos, Heads, HeadSize))
    np.testing.assert_allclose(out.array, causal_attention(q, k_rep, v_rep, mask).array, atol=tol(1e-5))

    with pytest.raises(TypeError, match="boolean"):
        causal_attention(q, k, v, mask.astype(jnp.float32))


def _autodiff_attention(q, k, v, mask):
    """The same forward as softmax_attention, differentiated by JAX."""
    scores = jnp.where(mask, jnp.einsum("...qd,...kd->...qk", q, k), -1e9)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize("segments", [None, [0, 0, 1, 1, 1, 2, 2, 2]])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_softmax_attention_gradients_match_autodiff(lead, segments):
    from levanter.models.attention import softmax_attention

    n, d = 8, 4
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(len(lead) + 7 * (segments is None)), 4)
    q, k, v, g = (jax.random.normal(key, (*lead, n, d)) for key in (kq, kk, kv, kg))
    mask = np.tril(np.ones((n, n), bool))
    if segments is not None:
        seg = np.asarray(segments)
        mask &= seg[:, None] == seg[None, :]
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, jnp.asarray(mask)) * g)  # noqa: E731
    ours, ours_grads = jax.value_and_grad(loss(softmax_attention), argnums=(0, 1, 2))(q, k, v)
    ref, ref_grads = jax.value_and_grad(loss(_autodiff_attention), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(ours, ref, rtol=tol(1e-5), atol=tol(1e-5))
    for name, a, b in zip("qkv", ours_grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=tol(1e-4), atol=tol(1e-5), err_msg=f"d{name}")
    # under jit too (the compiled backward is the one training uses)
    jitted = jax.jit(jax.grad(loss(softmax_attention), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(jitted, ref_grads):
        np.testing.assert_allclose(a, b, rtol=tol(1e-4), atol=tol(1e-5))


def test_causal_attention_gradients_match_the_reference():
    """Grouped heads, packed segments and the scale, through causal_attention's custom backward."""
    sizes = {"position": 6, "heads": 4, "kv_heads": 2, "head_size": 8}
    Pos, Heads, KVHeads, HeadSize = (hax.Axis(n, s) for n, s in sizes.items())
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(5), 4)
    q = hax.random.normal(kq, (Batch, Pos, Heads, HeadSize))
    k = hax.random.normal(kk, (Batch, Pos, KVHeads, HeadSize))
    v = hax.random.normal(kv, (Batch, Pos, KVHeads, HeadSize))
    g = jax.random.normal(kg, (2, 6, 4, 8))
    seg = hax.named(jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]]), (Batch, Pos))
    mask = causal_segment_mask(Pos, seg)

    def ours(q, k, v):
        named = [hax.named(a, ax) for a, ax in zip((q, k, v), (q_axes, kv_axes, kv_axes))]
        return jnp.sum(causal_attention(*named, mask).array * g)

    def reference(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
        scores = jnp.where(mask.array[:, None], scores, -jnp.inf)
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v) * g)

    q_axes, kv_axes = q.axes, k.axes
    args = (q.array, k.array, v.array)
    for a, b in zip(jax.grad(ours, argnums=(0, 1, 2))(*args), jax.grad(reference, argnums=(0, 1, 2))(*args)):
        np.testing.assert_allclose(a, b, rtol=tol(1e-4), atol=tol(1e-5))


def test_attention_dropout_path_matches_the_custom_backward_path():
    """With a dropout rate too small to drop anything, the dropout path (JAX's derivative) gives the same
    output as the default path (written-out backward), for multi-head and grouped heads."""
    sizes = {"position": 6, "heads": 4, "kv_heads": 2, "head_size": 8}
    Pos, Heads, KVHeads, HeadSize = (hax.Axis(n, s) for n, s in sizes.items())
    keys = jax.random.split(jax.random.PRNGKey(9), 3)
    q = hax.random.normal(keys[0], (Batch, Pos, Heads, HeadSize))
    seg = hax.named(jnp.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]), (Batch, Pos))
    mask = causal_segment_mask(Pos, seg)
    for KV in (Heads, KVHeads):
        k = hax.random.normal(keys[1], (Batch, Pos, KV, HeadSize))
        v = hax.random.normal(keys[2], (Batch, Pos, KV, HeadSize))
        plain = causal_attention(q, k, v, mask)
        dropped = causal_attention(q, k, v, mask, dropout=1e-12, key=jax.random.PRNGKey(0))
        assert dropped.axes == plain.axes
        np.testing.assert_allclose(dropped.array, plain.array, rtol=tol(1e-5), atol=tol(1e-6))


def test_token_dot_equals_the_named_dot():
    from levanter.models.token_dot import linear, token_dot

    sizes = [("batch", 2), ("position", 3), ("embed", 4), ("heads", 2), ("hd", 5)]
    B, P, E, H, D = (hax.Axis(n, s) for n, s in sizes)
    x = hax.random.normal(jax.random.PRNGKey(0), (B, P, E))
    w = hax.random.normal(jax.random.PRNGKey(1), (H, D, E))
    out = token_dot(x, w, E)
    ref = hax.dot(x, w, axis=E)
    assert out.axes == (B, P, H, D)
    np.testing.assert_allclose(out.array, ref.rearrange(out.axes).array, rtol=tol(1e-6))
    # several contracted axes, given in an order other than the array's
    x2 = hax.random.normal(jax.random.PRNGKey(2), (B, H, P, D))
    w2 = hax.random.normal(jax.random.PRNGKey(3), (H, D, E))
    out2 = token_dot(x2, w2, (D, H))
    assert out2.axes == (B, P, E)
    np.testing.assert_allclose(out2.array, hax.dot(x2, w2, axis=(H, D)).rearrange(out2.axes).array, rtol=tol(1e-5))
    # an outer axis shared with the weight is a batch axis of the product: the plain dot is used
    w3 = hax.random.normal(jax.random.PRNGKey(4), (B, E, H))
    np.testing.assert_allclose(token_dot(x, w3, E).array, hax.dot(x, w3, axis=E).array, rtol=tol(1e-6))
    # linear() = the Linear module, bias included
    layer = hax.nn.Linear.init(E, (H, D), key=jax.random.PRNGKey(5), use_bias=True)
    layer = eqx.tree_at(lambda m: m.bias, layer, hax.random.normal(jax.random.PRNGKey(6), (H, D)))
    np.testing.assert_allclose(linear(layer, x).array, layer(x).rearrange((B, P, H, D)).array, rtol=tol(1e-5))
    assert linear(layer, x).axes == (B, P, H, D)


def test_gqa_model_matches_repeated_kv_mha():
    """A 2-kv-head Llama equals a 4-kv-head Llama whose k/v weights repeat each kv head twice."""
    gqa = tiny_llama(num_kv_heads=2).build(Vocab, key=jax.random.PRNGKey(5))
    mha = tiny_llama(num_kv_heads=4).build(Vocab, key=jax.random.PRNGKey(6))

    def repeated(w, like):
        w = w.rearrange(("layers", "kv_heads", "head_size", "embed"))
        axes = (w.axes[0], like.resolve_axis("kv_heads"), *w.axes[2:])
        out = hax.named(jnp.repeat(w.array, 2, axis=1), axes)
        return out.rearrange(like.axes)

    src, dst = gqa.layers.stacked.self_attn, mha.layers.stacked.self_attn
    k_weight = repeated(src.k_proj.weight, dst.k_proj.weight)
    v_weight = repeated(src.v_proj.weight, dst.v_proj.weight)
    attn = eqx.tree_at(
        lambda a: (a.q_proj, a.o_proj, a.k_proj.weight, a.v_proj.weight),
        dst,
        (src.q_proj, src.o_proj, k_weight, v_weight),
    )
    equivalent = eqx.tree_at(
        lambda m: (m.layers.stacked.self_attn, m.layers.stacked.mlp, m.embed_tokens, m.lm_head),
        mha,
        (attn, gqa.layers.stacked.mlp, gqa.embed_tokens, gqa.lm_head),
    )
    ids = random_ids(7, gqa.Pos)
    np.testing.assert_allclose(forward(gqa, ids).array, forward(equivalent, ids).array, atol=tol(1e-5))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_decreases_with_adam(name):
    model = CONFIGS[name](seq_len=16).build(Vocab, key=jax.random.PRNGKey(8))
    ids = random_ids(9, model.Pos, batch=hax.Axis("batch", 4))
    mask = hax.ones(ids.axes, dtype=bool)
    opt = optax.adam(1e-2)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(lambda m: m.compute_next_token_loss(ids, mask))(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(20):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[0] == pytest.approx(np.log(Vocab.size), rel=0.05)  # near-uniform at init
    assert losses[-1] < 0.5 * losses[0], losses


def test_next_token_loss_matches_numpy():
    rng = np.random.default_rng(0)
    B, P, V = hax.Axis("batch", 2), hax.Axis("position", 5), hax.Axis("vocab", 7)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    tokens = rng.integers(0, 7, size=(2, 5))
    mask = np.array([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=bool)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp = log_softmax(logits.astype(np.float64))
    terms = [-lp[b, t, tokens[b, t + 1]] for b in range(2) for t in range(4) if mask[b, t]]
    expected = np.mean(terms)

    named = (hax.named(logits, (B, P, V)), hax.named(tokens, (B, P)), hax.named(mask, (B, P)))
    assert float(next_token_loss(*named)) == pytest.approx(expected, rel=tol(1e-5))
    assert float(next_token_loss(*named, reduction="sum")) == pytest.approx(np.sum(terms), rel=tol(1e-5))
    # sum_and_count: the sum and the number of counted positions (what a trainer divides by over a step)
    total, count = next_token_loss(*named, reduction="sum_and_count")
    assert float(count) == len(terms) == 6 and float(total) == float(next_token_loss(*named, reduction="sum"))
    with pytest.raises(ValueError, match="reduction must be"):
        next_token_loss(*named, reduction="average")
    per_pos = next_token_loss(*named, reduction=None)
    assert per_pos.axes == (B, P) and float(per_pos.array[0, 4]) == 0.0  # last position never counts
    # a float mask means the same as its boolean version; bfloat16 logits are upcast
    float_mask = hax.named(mask.astype(np.float32), (B, P))
    assert float(next_token_loss(named[0], named[1], float_mask)) == pytest.approx(expected, rel=tol(1e-5))
    bf16 = next_token_loss(named[0].astype(jnp.bfloat16), named[1], named[2])
    assert bf16.dtype == jnp.float32 and float(bf16) == pytest.approx(expected, rel=2e-2)
    # no mask: every position but the last; z-loss adds weight * logsumexp**2
    all_terms = [-lp[b, t, tokens[b, t + 1]] for b in range(2) for t in range(4)]
    assert float(next_token_loss(named[0], named[1])) == pytest.approx(np.mean(all_terms), rel=tol(1e-5))
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    z = np.mean([lse[b, t] ** 2 for b in range(2) for t in range(4) if mask[b, t]])
    got = float(next_token_loss(*named, z_loss_weight=1e-2))
    assert got == pytest.approx(expected + 1e-2 * z, rel=tol(1e-5))
    # nothing counted: mean is 0, not NaN
    none = hax.named(np.zeros((2, 5), dtype=bool), (B, P))
    assert float(next_token_loss(named[0], named[1], none)) == 0.0


def test_draccus_selects_architecture():
    spec = {"type": "gpt2", "hidden_dim": 32, "num_heads": 4, "num_layers": 2, "seq_len": 64}
    gpt2 = draccus.decode(LmConfig, spec)
    assert type(gpt2) is Gpt2Config and (gpt2.hidden_dim, gpt2.num_heads, gpt2.num_layers) == (32, 4, 2)
    assert gpt2.seq_len == 64 and gpt2.max_seq_len == 64
    assert gpt2.Pos == hax.Axis("position", 64) and gpt2.KeyPos == hax.Axis("key_position", 64)
    assert gpt2.Embed == hax.Axis("embed", 32)

    llama = draccus.decode(
        LmConfig,
        {
            "type": "llama",
            "hidden_dim": 32,
            "intermediate_dim": 64,
            "num_heads": 4,
            "num_kv_heads": 2,
            "num_layers": 2,
            "seq_len": 64,
            "rope": {"type": "default", "theta": 500000.0},
            "reference_checkpoint": "/local/ref",
        },
    )
    assert type(llama) is LlamaConfig and llama.num_kv_heads == 2 and llama.max_seq_len is None
    assert llama.rope == DefaultRopeConfig(theta=500000.0) and llama.rope_theta_and_factor == (500000.0, 1.0)
    assert draccus.decode(LmConfig, {"type": "llama", "rope_theta": 1e6}).rope_theta_and_factor == (1e6, 1.0)
    # Upstream's spelling of the scaled variants; unset keys take transformers'/upstream's defaults.
    llama3 = draccus.decode(LmConfig, {"type": "llama", "rope": {"type": "llama3", "factor": 32.0}})
    assert llama3.rope == Llama3RopeConfig(theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)
    yarn = draccus.decode(LmConfig, {"type": "llama", "rope": {
        "type": "yarn", "theta": 1e6, "factor": 4.0, "beta_fast": 16, "original_max_position_embeddings": 4096,
        "mscale": 0.7, "mscale_all_dim": 0.7}})
    assert yarn.rope == YarnRopeConfig(theta=1e6, factor=4.0, beta_fast=16.0, original_max_position_embeddings=4096,
                                       mscale=0.7, mscale_all_dim=0.7)
    assert yarn.rope.attention_scaling() == 1.0  # equal mscales cancel, as in transformers

    qwen3 = draccus.decode(LmConfig, {"type": "qwen3", "hidden_dim": 32, "num_heads": 4, "num_kv_heads": 2,
                                      "head_dim": 16, "attention_bias": True})
    assert type(qwen3) is Qwen3Config and qwen3.HeadSize.size == 16 and qwen3.qk_norm and qwen3.o_bias
    qwen2 = draccus.decode(LmConfig, {"type": "qwen2", "rope_theta": 1e6})
    assert type(qwen2) is Qwen2Config and qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm

    with pytest.raises(draccus.utils.DecodingError, match="hidden_size"):
        draccus.decode(LmConfig, {"type": "gpt2", "hidden_size": 32})
    with pytest.raises(draccus.utils.DecodingError):
        draccus.decode(LmConfig, {"type": "no_such_model"})


@pytest.mark.parametrize(
    "make, kwargs, field",
    [
        (tiny_gpt2, {"num_heads": 5}, "model.hidden_dim"),
        (tiny_gpt2, {"num_layers": 0}, "model.num_layers"),
        (tiny_gpt2, {"activation_function": "nope"}, "model.activation_function"),
        (tiny_llama, {"num_kv_heads": 3}, "model.num_kv_heads"),
        (tiny_llama, {"num_heads": 3}, "model.num_heads"),
        (tiny_llama, {"intermediate_dim": -1}, "model.intermediate_dim"),
        (tiny_gemma, {"num_kv_heads": 3}, "model.num_kv_heads"),
        (tiny_gemma, {"head_dim": 7}, "model.head_dim"),
        (tiny_gemma, {"layer_norm_epsilon": -1.0}, "model.layer_norm_epsilon"),
        (tiny_qwen3, {"head_dim": 0}, "model.head_dim"),
        (tiny_qwen3, {"head_dim": 7}, "model.head_dim"),
    ],
)
def test_invalid_sizes_name_the_field(make, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make(**kwargs)


def test_invalid_sizes_through_draccus_keep_the_message():
    with pytest.raises(draccus.utils.ParsingError) as info:
        draccus.decode(LmConfig, {"type": "llama", "num_heads": 32, "num_kv_heads": 5})
    assert isinstance(info.value.__cause__, ValueError) and "model.num_kv_heads" in str(info.value.__cause__)


def test_gpt2_rejects_inputs_longer_than_seq_len():
    model = tiny_gpt2(seq_len=8).build(Vocab, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="model.seq_len"):
        model(random_ids(0, hax.Axis("position", 9)))
    assert forward(model, random_ids(0, hax.Axis("position", 4))).axes[1].size == 4  # shorter is fine


def _matmul_weights(model):
    """Count of matmul weights (blocks + output projection), embedding lookups and norms excluded."""
    count = 0
    def is_named(x):
        return isinstance(x, hax.NamedArray)

    for path, leaf in jax.tree_util.tree_leaves_with_path(model, is_leaf=is_named):
        name = jax.tree_util.keystr(path)
        excluded = ("norm", "ln_", "wte", "wpe", "embed_tokens")
        if is_named(leaf) and name.endswith(".weight") and not any(e in name for e in excluded):
            count += leaf.size
    return count


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_flops_per_token(name):
    flops = {n: CONFIGS[name](num_layers=n, seq_len=64).flops_per_token(Vocab.size) for n in (1, 2, 4, 8)}
    assert all(f > 0 for f in flops.values())
    # linear in depth: constant increment per layer (the lm head is the intercept)
    per_layer = flops[2] - flops[1]
    assert flops[4] - flops[2] == pytest.approx(2 * per_layer)
    assert flops[8] - flops[4] == pytest.approx(4 * per_layer)
    # equals 6 x (matmul weights, lm head included) + 3 x the attention matmuls (4 * seq * query width per
    # layer; the query width is hidden_dim except where head_dim is set apart, as in the Qwen3 config here)
    config = CONFIGS[name](num_layers=2, seq_len=64)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    tied = name == "gpt2" or getattr(config, "tie_word_embeddings", False)
    n = _matmul_weights(model) + (config.hidden_dim * Vocab.size if tied else 0)  # a tied head is still a matmul
    if name == "mixtral":  # only the experts a token is routed to do work: the others' weights do not count
        experts = sum(x.size for x in (model.layers.stacked.block_sparse_moe.w1.weight,
                                       model.layers.stacked.block_sparse_moe.w2.weight,
                                       model.layers.stacked.block_sparse_moe.w3.weight))
        n -= experts * (1 - config.num_experts_per_tok / config.num_local_experts)
    width = config.num_heads * config.HeadSize.size
    assert (width != config.hidden_dim) == (name in ("qwen3", "gemma", "gemma2"))
    expected = 6 * n + 3 * 4 * config.seq_len * width * config.num_layers
    assert flops[2] == pytest.approx(expected)


def test_gpt2_dropout_only_with_key():
    config = tiny_gpt2(embed_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    ids = random_ids(10, model.Pos)
    a, b = forward(model, ids).array, forward(model, ids).array
    np.testing.assert_array_equal(a, b)
    c = forward(model, ids, key=jax.random.PRNGKey(1)).array
    assert not np.allclose(a, c)


def test_tied_llama_and_scaled_gpt2_run():
    tied = tiny_llama(tie_word_embeddings=True, num_kv_heads=1).build(Vocab, key=jax.random.PRNGKey(0))
    assert tied.lm_head is None
    assert forward(tied, random_ids(0, tied.Pos)).axes[-1] == Vocab
    scaled = tiny_gpt2(scale_attn_by_inverse_layer_idx=True, upcast_attn=False, gradient_checkpointing=False)
    model = scaled.build(Vocab, key=jax.random.PRNGKey(0))
    assert bool(jnp.all(jnp.isfinite(forward(model, random_ids(0, model.Pos)).array)))


# The layer stack (scan or unrolled) is shared code: GPT-2's and Llama's blocks plus those with blocks of
# their own (Gemma 2's attention, Mixtral's experts, OLMo 2's post-norms) cover it; Qwen, Mistral and Gemma
# use Llama's block.
@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2", "mixtral", "olmo2"])
def test_unrolled_layers_are_the_same_model(name):
    """scan_layers=False only changes how the layer loop is traced: same parameters, same outputs and
    gradients (up to float reassociation) as the scanned model."""
    scanned = CONFIGS[name](num_layers=3).build(Vocab, key=jax.random.PRNGKey(3))
    unrolled = CONFIGS[name](num_layers=3, scan_layers=False).build(Vocab, key=jax.random.PRNGKey(3))
    leaves_s = jax.tree.leaves(eqx.filter(scanned, eqx.is_array))
    leaves_u = jax.tree.leaves(eqx.filter(unrolled, eqx.is_array))
    assert len(leaves_s) == len(leaves_u)
    for a, b in zip(leaves_s, leaves_u):
        assert a.shape == b.shape and bool(jnp.all(a == b))
    Pos = scanned.config.Pos
    ids = random_ids(5, Pos)
    seg = hax.named(jnp.array([[0] * 8 + [1] * 8, [0] * 16]), (Batch, Pos))
    np.testing.assert_allclose(forward(scanned, ids, seg).array, forward(unrolled, ids, seg).array, rtol=tol(2e-5), atol=tol(2e-5))

    def loss(m):
        return next_token_loss(m(ids, seg), ids)

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    gs = grad(scanned)
    gu = grad(unrolled)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gu)):
        np.testing.assert_allclose(a, b, rtol=tol(1e-4), atol=tol(1e-6))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_shapes_match_a_real_build_without_allocating(name):
    """The memory estimate's shapes (jax.eval_shape of build) are the built model's, leaf for leaf, and
    tree_nbytes counts their bytes, at their own dtype or a given one. A 10^9-token vocabulary (128 GB of
    embedding at float32) is traced without allocating anything."""
    from levanter.models import parameter_shapes, tree_nbytes

    cfg = CONFIGS[name]()
    built = cfg.build(Vocab, key=jax.random.PRNGKey(0))
    shapes = parameter_shapes(cfg, Vocab.size)
    real = jax.tree.leaves(eqx.filter(built, eqx.is_array))
    traced = jax.tree.leaves(shapes)
    assert [(x.shape, x.dtype) for x in real] == [(x.shape, x.dtype) for x in traced]
    n = sum(x.size for x in real if jnp.issubdtype(x.dtype, jnp.inexact))
    assert tree_nbytes(shapes) == sum(x.nbytes for x in real if jnp.issubdtype(x.dtype, jnp.inexact))
    assert tree_nbytes(shapes, jnp.bfloat16) == 2 * n
    huge = parameter_shapes(cfg, 10**9)
    assert tree_nbytes(huge) >= 10**9 * cfg.hidden_dim * 4
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(huge))  # shapes, no buffers


def test_qwen_attention_parameters():
    """Qwen2: biases on q/k/v only; Qwen3: a [head_size] RMS scale for queries and keys, no biases unless
    attention_bias; the q/k norm changes the output (it is applied, not just stored)."""
    attn2 = tiny_qwen2().build(Vocab, key=jax.random.PRNGKey(0)).layers.stacked.self_attn
    assert [getattr(attn2, p).bias is not None for p in ("q_proj", "k_proj", "v_proj", "o_proj")] == [True] * 3 + [False]
    assert attn2.q_norm is None and attn2.k_norm is None
    model3 = tiny_qwen3().build(Vocab, key=jax.random.PRNGKey(0))
    attn3 = model3.layers.stacked.self_attn
    assert attn3.q_proj.bias is None and attn3.o_proj.bias is None
    assert attn3.q_norm.weight.axes == (hax.Axis("layers", 2), hax.Axis("head_size", 16))
    ids = random_ids(4, model3.Pos)
    scaled = eqx.tree_at(lambda m: m.layers.stacked.self_attn.q_norm.weight, model3, attn3.q_norm.weight * 3.0)
    assert not np.allclose(forward(model3, ids).array, forward(scaled, ids).array, atol=1e-4)
    biased = tiny_qwen3(attention_bias=True).build(Vocab, key=jax.random.PRNGKey(0)).layers.stacked.self_attn
    assert all(getattr(biased, p).bias is not None for p in ("q_proj", "k_proj", "v_proj", "o_proj"))


def test_gpt2_queries_keys_and_values_equal_the_one_fused_product():
    """GPT-2 computes q, k and v as three products with the slices of ``c_attn`` (so that each bias add fuses
    into its product): the same values, and the same gradients for the fused weight and bias, as ``c_attn``
    applied whole and sliced afterwards."""
    from levanter.models.token_dot import linear

    model = tiny_gpt2().build(Vocab, key=jax.random.PRNGKey(0))
    attn = jax.tree.map(lambda x: x["layers", 0] if isinstance(x, hax.NamedArray) else x, model.blocks.stacked.attn,
                        is_leaf=lambda x: isinstance(x, hax.NamedArray))
    # A bias that is not zero, so that each slice's bias must be the right one.
    bias = attn.c_attn.bias
    attn = eqx.tree_at(lambda a: a.c_attn.bias, attn, hax.random.normal(jax.random.PRNGKey(1), bias.axes))
    x = hax.random.normal(jax.random.PRNGKey(2), (Batch, model.Pos, model.config.Embed))
    cot = [hax.random.normal(jax.random.PRNGKey(3 + i), (Batch, model.Pos, *attn.c_attn.Out[1:])) for i in range(3)]

    def objective(layer, split):
        if split:
            q, k, v = eqx.tree_at(lambda a: a.c_attn, attn, layer)._qkv(x)
        else:
            qkv = linear(layer, x)
            q, k, v = (qkv["qkv", i] for i in range(3))
        return sum(hax.sum(p * c.rearrange(p.axes)).array for p, c in zip((q, k, v), cot)), (q, k, v)

    (val_s, outs_s), grad_s = eqx.filter_value_and_grad(objective, has_aux=True)(attn.c_attn, True)
    (val_f, outs_f), grad_f = eqx.filter_value_and_grad(objective, has_aux=True)(attn.c_attn, False)
    np.testing.assert_allclose(val_s, val_f, rtol=tol(1e-5))
    for a, b in zip(outs_s, outs_f):
        assert a.axes == b.axes
        np.testing.assert_allclose(a.array, b.array, rtol=tol(1e-5), atol=tol(1e-6))
    np.testing.assert_allclose(grad_s.weight.array, grad_f.weight.array, rtol=tol(1e-5), atol=tol(1e-5))
    np.testing.assert_allclose(grad_s.bias.array, grad_f.bias.array, rtol=tol(1e-5), atol=tol(1e-5))
    assert float(jnp.abs(grad_s.bias.array).min()) > 0  # every slice's bias receives its gradient
