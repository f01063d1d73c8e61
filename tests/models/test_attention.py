"""Attention backends and remat policies: blockwise attention (``jax_flash``) against the materialised
``vanilla`` kernel (outputs and gradients), the splash kernel in Pallas interpret mode, the platform
refusals of ``splash``/``cudnn``, what ``default`` resolves to, the config keys, whole-model forwards,
sliding windows (the mask's convention, blockwise and splash against the materialised kernel), and that every ``gradient_checkpointing`` policy computes the same loss and gradients.

Shapes are small and each case is one jitted function, so the file stays within a few seconds' compile."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import haliax as hax
import haliax.nn as hnn
from haliax import Axis
from haliax.nn import ScanCheckpointPolicy
from accelerator import ON_TPU, tol
from levanter.models import (
    Gpt2Config,
    LlamaConfig,
    attention_mask,
    causal_attention,
    causal_segment_mask,
    dot_product_attention,
    remat_policy,
    resolve_attn_backend,
)
from levanter.models.attention import (
    SplashBlockSizes,
    blockwise_attention,
    check_backend_platform,
    plan_attention,
    resolve_splash_block_sizes,
    splash_attention,
)

Batch = Axis("batch", 2)
Vocab = Axis("vocab", 100)  # the tiny models of tests/models/test_models.py: their eager init ops are compiled once


# Inputs come from numpy (not eager JAX ops, each of which would compile a program of its own).
def _qkv(seed, Pos, heads, kv_heads, head_size=8, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    Heads, HeadSize = Axis("heads", heads), Axis("head_size", head_size)
    KV = Axis("kv_heads", kv_heads) if kv_heads != heads else Heads

    def normal(*axes):
        return hax.named(jnp.asarray(rng.standard_normal([ax.size for ax in axes]), dtype), axes)

    return normal(Batch, Pos, Heads, HeadSize), normal(Batch, Pos, KV, HeadSize), normal(Batch, Pos, KV, HeadSize)


def _many_documents(seed, Pos):
    """Segment ids of many short packed documents (a new one starts with probability 1/3 per position)."""
    starts = np.random.default_rng(seed).random((Batch.size, Pos.size)) < 1 / 3
    return hax.named(jnp.asarray(np.cumsum(starts, axis=1), jnp.int32), (Batch, Pos))


@jax.jit
def _vanilla_f32(q, k, v, seg):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return causal_attention(*f32, causal_segment_mask(q.resolve_axis("position"), seg))


def _value_and_grads(mask, q, k, v):
    """Attention output and the gradients of a non-trivial scalar of it, for q, k and v."""
    g = jnp.asarray(np.random.default_rng(7).standard_normal(q.array.shape), jnp.float32)

    def loss(qa, ka, va):
        named = hax.named(qa, q.axes), hax.named(ka, k.axes), hax.named(va, v.axes)
        out = dot_product_attention(*named, mask, scale=0.3)
        return jnp.sum(out.array.astype(jnp.float32) * g), out.array

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q.array, k.array, v.array)
    return out, grads


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# (seq_len, block, heads, kv_heads, packed documents): a length that is a multiple of the block and one
# that is not, GQA ratios 1 and 4 (ratio 2: the bfloat16 case and the Llama forward below).
CASES = [(24, 8, 4, 4, False), (13, 4, 4, 1, True)]


@pytest.mark.parametrize("seq_len,block,heads,kv_heads,packed", CASES)
def test_blockwise_matches_vanilla_outputs_and_gradients(seq_len, block, heads, kv_heads, packed):
    Pos = Axis("position", seq_len)
    q, k, v = _qkv(seq_len, Pos, heads, kv_heads)
    seg = _many_documents(seq_len, Pos) if packed else None
    flash_out, flash_grads = _value_and_grads(attention_mask(Pos, seg, "jax_flash", block), q, k, v)
    ref_out, ref_grads = _value_and_grads(attention_mask(Pos, seg, "vanilla"), q, k, v)
    assert _rel_err(flash_out, ref_out) < tol(1e-5)
    for name, ours, ref in zip("qkv", flash_grads, ref_grads):
        assert _rel_err(ours, ref) < tol(1e-5), name


def test_blockwise_bfloat16_within_bfloat16_tolerance():
    Pos = Axis("position", 20)
    q, k, v = _qkv(3, Pos, 4, 2, head_size=16, dtype=jnp.bfloat16)
    seg = _many_documents(3, Pos)
    mask = attention_mask(Pos, seg, "jax_flash", 8)
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask, upcast=False))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = _vanilla_f32(q, k, v, seg)
    # bfloat16 keeps 8 bits of mantissa: outputs of magnitude ~1 agree to a few 1e-3.
    np.testing.assert_allclose(np.asarray(out.array, np.float32), ref.array, atol=3e-2, rtol=3e-2)


def test_blockwise_never_materialises_the_score_matrix():
    """The compiled forward+backward at 512 positions (block 32) holds far fewer bytes of temporaries
    than the materialised kernel's scores alone ([heads, position, key_position] float32)."""
    b, h, length, d = 1, 2, 512, 16
    q = jnp.ones((b, h, 1, length, d))
    k = v = jnp.ones((b, h, length, d))
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, block_size=32)), argnums=(0, 1, 2)))
    temp = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    assert temp < h * length * length * 4 / 4, temp


def test_splash_kernel_in_interpret_mode_matches_blockwise():
    """JAX's Pallas splash kernel runs in interpret mode on CPU: same outputs as the blockwise kernel,
    with grouped heads (GQA ratio 2) and packed documents."""
    b, kv, group, length, d = 1, 1, 2, 128, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, kv, group, length, d)) * 0.25, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    seg = jnp.asarray(np.cumsum(rng.random((b, length)) < 0.05, axis=1), jnp.int32)
    ours = jax.jit(functools.partial(splash_attention, block_size=128, interpret=True))(q, k, v, seg)
    ref = jax.jit(functools.partial(blockwise_attention, block_size=64))(q, k, v, seg)
    np.testing.assert_allclose(ours, ref, atol=tol(2e-5), rtol=tol(2e-5))


@pytest.mark.parametrize("group", [1, 2])
def test_splash_gradients_in_interpret_mode_match_blockwise(group):
    """The splash path's backward pass (the fused kernel; the multi-query kernel per key/value head for
    grouped heads) gives the blockwise kernel's gradients, over two blocks of packed documents."""
    b, kv, length, d = 1, 2, 256, 16
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((b, kv, group, length, d)) * 0.25, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    seg = jnp.asarray(np.cumsum(rng.random((b, length)) < 0.02, axis=1), jnp.int32)
    w = jnp.asarray(rng.standard_normal((b, kv, group, length, d)), jnp.float32)

    def grads(kernel):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(kernel(q, k, v, seg) * w), argnums=(0, 1, 2)))(
            q, k, v
        )

    ours = grads(functools.partial(splash_attention, block_size=128, interpret=True))
    ref = grads(functools.partial(blockwise_attention, block_size=64))
    for a, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, r, atol=tol(5e-5), rtol=tol(5e-5))


@pytest.mark.parametrize("group", [1, 2])
def test_splash_inputs_are_what_a_named_policy_saves(group):
    """Under a policy that saves "query_proj", "key_proj", "value_proj" and "context" (as
    minimal_with_context does), the backward pass keeps the splash kernel's inputs in its own layout and
    nothing of the [position, heads, head_size] projections before them: the rotary encoding, scaling and
    transposes on the way in are not redone. The gradients are those of the unsaved computation."""
    b, kv, length, d = 1, 2, 128, 16
    rng = np.random.default_rng(2)
    # As a model holds them: [batch, position, heads, head_size], then a (linear) step before the kernel.
    q = jnp.asarray(rng.standard_normal((b, length, kv * group, d)) * 0.25, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, length, kv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, length, kv, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, kv, group, length, d)), jnp.float32)

    def attend(q, k, v):
        q5 = (2.0 * q).transpose(0, 2, 1, 3).reshape(b, kv, group, length, d)
        out = splash_attention(q5, (-k).transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), block_size=128,
                               interpret=True)
        return jnp.sum(out * w)

    policy = jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj", "context")
    saving = jax.checkpoint(attend, policy=policy)
    _, backward = jax.vjp(saving, q, k, v)
    saved = {tuple(x.shape) for x in jax.tree.leaves(backward) if x.ndim >= 4}
    assert (b, kv, group, length, d) in saved and (b, kv, length, d) in saved, saved
    assert (b, length, kv * group, d) not in saved and (b, length, kv, d) not in saved, saved
    ours = jax.grad(saving, argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(attend, argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(ours, ref):
        np.testing.assert_allclose(a, r, atol=tol(1e-5), rtol=tol(1e-5))


def test_splash_block_sizes_set_one_by_one_give_the_default_attention():
    """model.splash_block_sizes tiles the forward and backward kernels differently from the shared block
    (256 here: one tile): outputs and gradients equal the default's, with grouped heads and packed
    documents, in interpret mode. A value that cannot tile the sequence is refused naming its key."""
    b, kv, group, length, d = 1, 1, 2, 256, 16
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((b, kv, group, length, d)) * 0.25, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    seg = jnp.asarray(np.cumsum(rng.random((b, length)) < 0.02, axis=1), jnp.int32)
    w = jnp.asarray(rng.standard_normal((b, kv, group, length, d)), jnp.float32)
    sizes = SplashBlockSizes(block_q=128, block_kv=256, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128)
    resolved = resolve_splash_block_sizes(length, 256, sizes)
    assert resolved == {"block_q": 128, "block_kv": 256, "block_kv_compute": 128, "block_q_dkv": 128,
                        "block_kv_dkv": 128, "block_kv_dkv_compute": 128}  # a null compute tile follows its parent
    assert set(resolve_splash_block_sizes(length, 256, None).values()) == {256}

    def run(block_sizes):
        kernel = functools.partial(splash_attention, block_size=256, block_sizes=block_sizes, interpret=True)
        f = jax.value_and_grad(lambda q, k, v: jnp.sum(kernel(q, k, v, seg) * w), argnums=(0, 1, 2))
        return jax.jit(kernel)(q, k, v, seg), jax.jit(f)(q, k, v)

    ours, default = run(sizes), run(None)
    for a, r in zip(jax.tree.leaves(ours), jax.tree.leaves(default)):
        np.testing.assert_allclose(a, r, atol=tol(2e-5), rtol=tol(2e-5))

    with pytest.raises(ValueError, match=r"model.splash_block_sizes.block_kv=96 does not divide the sequence length "
                                         r"256 .* use one of 128, 256, or null"):
        splash_attention(q, k, v, seg, block_size=256, block_sizes=SplashBlockSizes(block_kv=96), interpret=True)
    bad = {"block_q": (64, "block_q=64 is not a multiple of 128"),
           "block_q_dkv": (0, "block_q_dkv must be a positive number of positions, or null .* got 0"),
           "block_kv_dkv_compute": (256, r"block_kv_dkv_compute=256 does not divide model.splash_block_sizes."
                                         r"block_kv_dkv \(128\)")}
    for name, (value, why) in bad.items():
        extra = {"block_kv_dkv": 128} if name == "block_kv_dkv_compute" else {}
        with pytest.raises(ValueError, match=rf"model.splash_block_sizes.{why}"):
            LlamaConfig(seq_len=1024, splash_block_sizes=SplashBlockSizes(**{name: value}, **extra))
    # Above the sequence length a tile is cut to it (as the shared block is).
    assert resolve_splash_block_sizes(128, None, SplashBlockSizes(block_q=1024))["block_q"] == 128
    # Every model family has the key (it is LmConfig's), from YAML too.
    import draccus

    from levanter.models import LmConfig

    for name in LmConfig.get_known_choices():
        cfg = draccus.decode(LmConfig, {"type": name, "seq_len": 256, "splash_block_sizes": {"block_q": 128}})
        assert cfg.splash_block_sizes == SplashBlockSizes(block_q=128), name


def test_sliding_window_mask_is_transformers_convention():
    """With a window of w, query q sees keys q - w + 1 .. q (and only within its segment); a window at least
    as long as the sequence is dropped, so the plain causal kernels run."""
    Pos = Axis("position", 9)
    seg = hax.named(jnp.asarray([[0] * 4 + [1] * 5, [0] * 9]), (Batch, Pos))
    got = np.asarray(causal_segment_mask(Pos, seg, window=3).rearrange((Batch, Pos, "key_position")).array)
    q, k = np.arange(9)[:, None], np.arange(9)[None, :]
    ids = np.asarray(seg.array)
    want = (q - k >= 0) & (q - k < 3) & (ids[:, :, None] == ids[:, None, :])
    np.testing.assert_array_equal(got, want)
    assert attention_mask(Pos, None, "jax_flash", window=9).window is None
    assert attention_mask(Pos, None, "jax_flash", window=8).window == 8
    with pytest.raises(ValueError, match="attention window must be a positive"):
        attention_mask(Pos, None, "vanilla", window=0)


# (seq_len, block, window, packed): a window inside one block, one spanning blocks that is not a multiple of
# the block (so whole key blocks are skipped, forward and backward), grouped heads.
@pytest.mark.parametrize("seq_len,block,window,packed", [(24, 8, 3, False), (29, 4, 7, True)])
def test_blockwise_sliding_window_matches_vanilla(seq_len, block, window, packed):
    Pos = Axis("position", seq_len)
    q, k, v = _qkv(seq_len + 1, Pos, 4, 2)
    # Packed: documents longer than the window, so that both the window and the segments cut.
    seg = hax.named(jnp.asarray([[0] * 12 + [1] * 17, [0] * 5 + [1] * 24]), (Batch, Pos)) if packed else None
    flash_out, flash_grads = _value_and_grads(attention_mask(Pos, seg, "jax_flash", block, window), q, k, v)
    ref_out, ref_grads = _value_and_grads(attention_mask(Pos, seg, "vanilla", window=window), q, k, v)
    full_out, _ = _value_and_grads(attention_mask(Pos, seg, "vanilla"), q, k, v)
    assert _rel_err(full_out, ref_out) > 1e-2  # the window changes the output
    assert _rel_err(flash_out, ref_out) < tol(1e-5)
    for name, ours, ref in zip("qkv", flash_grads, ref_grads):
        assert _rel_err(ours, ref) < tol(1e-5), name


def test_splash_sliding_window_in_interpret_mode_matches_blockwise():
    """splash's local mask is the same window as the blockwise kernel's (grouped heads, packed documents),
    in the forward and the backward pass."""
    b, kv, group, length, d, window = 1, 1, 2, 256, 16, 40
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((b, kv, group, length, d)) * 0.25, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    seg = jnp.asarray(np.cumsum(rng.random((b, length)) < 0.01, axis=1), jnp.int32)
    w = jnp.asarray(rng.standard_normal((b, kv, group, length, d)), jnp.float32)

    def grads(kernel):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(kernel(q, k, v, seg) * w), argnums=(0, 1, 2)))(
            q, k, v
        )

    ours = grads(functools.partial(splash_attention, block_size=128, interpret=True, window=window))
    ref = grads(functools.partial(blockwise_attention, block_size=64, window=window))
    full = grads(functools.partial(blockwise_attention, block_size=64))
    assert not np.allclose(full[0], ref[0], atol=1e-3)
    for a, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, r, atol=tol(5e-5), rtol=tol(5e-5))


def test_platform_refusals_name_the_key():
    for backend, where in (("splash", "TPU"), ("cudnn", "NVIDIA GPUs")):
        with pytest.raises(ValueError, match=rf"model.attn_backend '{backend}' runs only on {where}.*'cpu'"):
            check_backend_platform(backend, "cpu")
    check_backend_platform("splash", "tpu")
    check_backend_platform("cudnn", "gpu")
    if jax.default_backend() == "cpu":
        Pos = Axis("position", 16)
        with pytest.raises(ValueError, match="model.attn_backend 'cudnn'"):
            plan_attention("cudnn", Pos, None, block_size=None, dtype=jnp.bfloat16, head_size=64)


def test_default_backend_per_platform():
    def pick(platform, **kw):
        return resolve_attn_backend("default", platform=platform, **{"seq_len": 4096, **kw})

    assert pick("tpu") == "splash"
    assert pick("tpu", seq_len=1000) == "jax_flash"  # splash needs a multiple of 128
    assert pick("gpu", dtype=jnp.bfloat16, head_size=64) == "cudnn"
    assert pick("gpu", dtype=jnp.float32, head_size=64) == "jax_flash"  # cuDNN needs half precision
    assert pick("gpu", dtype=jnp.bfloat16, head_size=256) == "jax_flash"
    assert pick("cpu") == "jax_flash"
    assert pick("cpu", seq_len=1024) == "vanilla"
    assert pick("tpu", dropout=0.1) == "vanilla"  # only vanilla has attention dropout
    assert resolve_attn_backend("jax_flash", platform="tpu", seq_len=16) == "jax_flash"


def test_config_keys():
    assert Gpt2Config().attention_backend == "default"
    assert Gpt2Config(use_flash_attention=True).attention_backend == "jax_flash"
    assert LlamaConfig(use_flash_attention=False).attention_backend == "vanilla"
    assert LlamaConfig(attn_backend="splash", use_flash_attention=True).attention_backend == "splash"
    with pytest.raises(ValueError, match="model.use_flash_attention=false conflicts with model.attn_backend='jax_flash'"):
        Gpt2Config(use_flash_attention=False, attn_backend="jax_flash")
    with pytest.raises(ValueError, match="model.attn_backend 'flash3' is not one of"):
        LlamaConfig(attn_backend="flash3")
    for bad in (0, -64, 1.5):
        with pytest.raises(ValueError, match="model.flash_attention_block_size must be a positive integer"):
            LlamaConfig(flash_attention_block_size=bad)
    with pytest.raises(ValueError, match="model.attn_pdrop=0.1 needs model.attn_backend: vanilla"):
        Gpt2Config(attn_pdrop=0.1, attn_backend="jax_flash")
    with pytest.raises(ValueError, match="model.attn_backend 'cudnn' needs model.upcast_attn: false"):
        Gpt2Config(attn_backend="cudnn")
    assert LlamaConfig(attn_backend="cudnn").attention_backend == "cudnn"  # Llama's upcast_attn is false
    with pytest.raises(ValueError, match="model.gradient_checkpointing 'sometimes'"):
        LlamaConfig(gradient_checkpointing="sometimes")


def _tiny(kind, num_layers=2, **kw):
    if kind == "gpt2":
        return Gpt2Config(hidden_dim=32, num_heads=4, num_layers=num_layers, seq_len=16, **kw)
    return LlamaConfig(
        hidden_dim=32, intermediate_dim=64, num_heads=4, num_kv_heads=2, num_layers=num_layers, seq_len=16, **kw
    )


def _build(config):
    return config.build(Vocab, key=jax.random.PRNGKey(0))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_model_forward_jax_flash_equals_vanilla(kind):
    """A whole model (packed documents, a block that does not divide the sequence) gives the same logits
    with either kernel, on the same parameters."""
    vanilla = _tiny(kind, attn_backend="vanilla")
    flash = _tiny(kind, attn_backend="jax_flash", flash_attention_block_size=6)
    model = _build(vanilla)
    # The layers take the kernel from the AttentionMask the top-level forward builds from its config.
    flash_model = dataclasses.replace(model, config=flash)
    Pos = vanilla.Pos
    ids = hax.named(jnp.asarray(np.random.default_rng(1).integers(0, Vocab.size, (Batch.size, Pos.size))), (Batch, Pos))
    seg = _many_documents(2, Pos)

    @jax.jit
    def both(ids, seg):
        return model(ids, seg).array, flash_model(ids, seg).array

    ref, ours = both(ids, seg)
    assert _rel_err(ours, ref) < tol(1e-5)


REMAT = [True, "save_dots", "dots_saveable", "offload"]


def test_remat_policy_names():
    assert remat_policy("nothing_saveable") is True and remat_policy(True) is True
    assert remat_policy(False) is False
    assert remat_policy("dots_saveable").jax_policy is jax.checkpoint_policies.dots_saveable
    assert remat_policy("save_dots").jax_policy is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    assert remat_policy("offload") == "offload"  # haliax's policy: layer inputs kept in host memory
    # The models hand the policy to their layer stack (traced shapes only: nothing is initialised).
    for kind, stack in (("gpt2", "blocks"), ("llama", "layers")):
        shapes = jax.eval_shape(lambda: _tiny(kind, gradient_checkpointing="save_dots").build(Vocab, key=jax.random.PRNGKey(0)))
        assert getattr(shapes, stack).gradient_checkpointing == remat_policy("save_dots")


class _Block(eqx.Module):
    """A residual MLP block: weight matmuls, a batched product and elementwise work, like a layer."""

    w1: jax.Array
    w2: jax.Array

    def __call__(self, x):
        h = jnp.tanh(x @ self.w1)
        return x + jnp.einsum("bij,bjk->bik", h, jnp.swapaxes(h, 1, 2)) @ x @ self.w2 * 0.1


def test_remat_policies_give_the_same_loss_and_gradients():
    """Each policy, applied by haliax's Stacked over three layers, gives the gradients of no remat."""
    Layers = Axis("layers", 3)
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((3, 8, 8)) * 0.3, jnp.float32) for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32)
    results = {}
    for policy in [False, *REMAT]:
        stack = hnn.Stacked(_Block(*weights), Layers, ScanCheckpointPolicy._mk(remat_policy(policy)))
        results[policy] = jax.jit(jax.value_and_grad(lambda s, x: jnp.sum(jnp.sin(s.fold(x)))))(stack, x)
    ref_loss, ref_grads = results[False]
    for policy in REMAT:
        loss, grads = results[policy]
        np.testing.assert_allclose(loss, ref_loss, rtol=tol(1e-6), err_msg=str(policy))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(a, b, rtol=tol(1e-5), atol=tol(1e-7), err_msg=str(policy))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_named_save_policies_save_more_and_give_the_same_gradients(kind, capsys):
    """MaxText's named policies keep each layer's input plus the marked activations: the layer scan saves
    more for its backward pass under ``save_qkv_proj`` than under full remat, more again under
    ``save_dot_with_context_except_mlp``, more again under ``minimal_with_context`` (the MLP's matmuls too),
    and every policy gives the loss and gradients of no remat."""
    Pos = Axis("position", 16)
    ids = hax.named(jnp.asarray(np.random.default_rng(2).integers(0, Vocab.size, (2, 16))), (Batch, Pos))
    saved, results = {}, {}
    policies = [False, True, "save_qkv_proj", "save_dot_except_mlp", "save_dot_with_context_except_mlp",
                "minimal_with_context"]
    for policy in policies:
        model = _build(_tiny(kind, attn_backend="jax_flash", flash_attention_block_size=8,
                             gradient_checkpointing=policy))
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def loss(p):
            return jnp.sum(jnp.sin(eqx.combine(p, static)(ids).array))

        print_saved_residuals(loss, params)
        # What the layer scan hands its backward pass: the layers' inputs, plus the saved activations.
        saved[policy] = sum("output of scan" in line for line in capsys.readouterr().out.splitlines())
        results[policy] = jax.jit(jax.value_and_grad(loss))(params)
    assert (saved[True] < saved["save_qkv_proj"] < saved["save_dot_with_context_except_mlp"]
            < saved["minimal_with_context"]), saved
    ref_loss, ref_grads = results[False]
    for policy, (value, grads) in results.items():
        np.testing.assert_allclose(value, ref_loss, rtol=tol(1e-6), err_msg=str(policy))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            # Recomputed and saved activations round differently in float32: agreement to ~1e-5.
            np.testing.assert_allclose(a, b, rtol=tol(1e-4), atol=tol(1e-5), err_msg=str(policy))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_matches_vanilla_on_gpu():
    Pos = Axis("position", 256)
    q, k, v = _qkv(5, Pos, 8, 2, head_size=64, dtype=jnp.bfloat16)
    seg = _many_documents(5, Pos)
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, attention_mask(Pos, seg, "cudnn"), upcast=False))(
        q, k, v
    )
    ref = _vanilla_f32(q, k, v, seg)
    np.testing.assert_allclose(np.asarray(out.array, np.float32), ref.array, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not ON_TPU, reason="the compiled splash kernel runs only on a TPU (CPU runs it in interpret "
                                       "mode above); JAX_PLATFORMS=tpu runs this")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_splash_kernel_on_tpu_matches_blockwise(dtype):
    """The real splash kernel (``interpret=False``) at 1,024 positions, grouped heads (ratio 2) and packed
    documents: outputs and q/k/v gradients agree with the blockwise kernel's (``jax_flash``) on the same
    inputs, both compared with the blockwise kernel in float32 as the reference."""
    b, kv, group, length, d = 2, 2, 2, 1024, 128
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((b, kv, group, length, d)) * d**-0.5, dtype)  # q comes pre-scaled
    k = jnp.asarray(rng.standard_normal((b, kv, length, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, kv, length, d)), dtype)
    seg = jnp.asarray(np.cumsum(rng.random((b, length)) < 1 / 150, axis=1), jnp.int32)  # ~7 documents a row
    w = jnp.asarray(rng.standard_normal((b, kv, group, length, d)), jnp.float32)

    def value_and_grads(kernel, *inputs):
        def loss(q, k, v):
            out = kernel(q, k, v, seg)
            return jnp.sum(out.astype(jnp.float32) * w), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*inputs)
        return [out, *grads]

    # bfloat16 at the default precision: the session's "highest" (tests/conftest.py) asks Mosaic for float32
    # contraction of bfloat16 operands, which it refuses to compile ("Bad lhs type"); for bfloat16 inputs the
    # two precisions compute the same products.
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
        splash = value_and_grads(functools.partial(splash_attention, block_size=512, interpret=False), q, k, v)
        flash = value_and_grads(functools.partial(blockwise_attention, block_size=128), q, k, v)
    upcast = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = value_and_grads(functools.partial(blockwise_attention, block_size=128), *upcast)
    # float32: the kernels agree to float32 rounding (about 1e-6 measured on a v5e: exp and the products
    # round differently block by block); bfloat16 (8 bits of mantissa): to a few 1e-3 of the largest value.
    bound = 1e-4 if dtype == jnp.float32 else 3e-2
    for name, ours, theirs, truth in zip(["out", "dq", "dk", "dv"], splash, flash, ref):
        assert ours.dtype == theirs.dtype == dtype, name
        assert bool(jnp.all(jnp.isfinite(ours.astype(jnp.float32)))), name
        errors = _rel_err(ours, theirs), _rel_err(ours, truth), _rel_err(theirs, truth)
        print(f"{name} {np.dtype(dtype).name}: splash-blockwise {errors[0]:.2e}, splash-f32 {errors[1]:.2e}, "
              f"blockwise-f32 {errors[2]:.2e}")
        assert max(errors) < bound, (name, errors)


def test_splash_on_a_mesh_runs_per_shard_and_matches_one_device():
    """On a mesh of several devices the splash kernel (one custom call XLA cannot partition) runs per shard
    under shard_map, the batch over `data` and the key/value heads over `model`: the same outputs and
    gradients as on one device."""
    b, kv, group, length, d = 4, 2, 2, 128, 16
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((b, kv, group, length, d)) * 0.25, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kv, length, d)), jnp.float32)
    seg = jnp.asarray(np.cumsum(rng.random((b, length)) < 0.05, axis=1), jnp.int32)
    w = jnp.asarray(rng.standard_normal((b, kv, group, length, d)), jnp.float32)

    def grads(**shards):
        kernel = functools.partial(splash_attention, block_size=128, interpret=True, **shards)
        return jax.value_and_grad(lambda q, k, v: jnp.sum(kernel(q, k, v, seg) * w), argnums=(0, 1, 2))

    one = jax.jit(grads())(q, k, v)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        sharded = grads(batch_axes="data", head_axis="model")
        assert "shard_map" in str(jax.make_jaxpr(sharded)(q, k, v))
        many = jax.jit(sharded)(q, k, v)
    for a, r in zip(jax.tree.leaves(many), jax.tree.leaves(one)):
        np.testing.assert_allclose(a, r, atol=tol(1e-5), rtol=tol(1e-5))
    # A named remat policy reaches inside the shard_map: minimal_with_context's names keep the kernel's inputs
    # and its residuals (the per-query logsumexp, "context"), as on one device.
    policy = jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj", "context")
    attend = functools.partial(splash_attention, block_size=128, interpret=True, batch_axes="data", head_axis="model")
    with jax.set_mesh(mesh):
        _, backward = jax.vjp(jax.checkpoint(lambda q, k, v: jnp.sum(attend(q, k, v, seg) * w), policy=policy), q, k, v)
    # (Saved inside the shard_map: each device's shard, stacked along the first axis; counted by size.)
    saved = {x.size for x in jax.tree.leaves(backward) if x.ndim >= 4 and x.shape != w.shape}
    assert saved == {b * kv * group * length * d, b * kv * length * d, b * kv * group * length}, saved
