"""The blockwise next-token loss (``model.cross_entropy_block_size``) against the full-logits loss.

The kernel (``levanter.models.loss.blockwise_logsumexp``) is checked against ``jax.nn.logsumexp`` of the
materialised logits, values and gradients, for vocabularies that are and are not a multiple of the block;
the named loss against :func:`next_token_loss` with and without z-loss and loss masks, in float32 and
bfloat16; Llama's loss and a whole trainer step (GPT-2, tied embedding) with and without blocks;
``check_memory`` counting one block of logits instead of the vocabulary; and the full loss's own derivative
(gradients and forward-over-reverse products as autodiff's, no float32 copy of bfloat16 logits kept).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from accelerator import tol
from levanter.training import lm_loss_fn
from levanter.memory import check_memory
from levanter.models import Gpt2Config, LlamaConfig, blockwise_next_token_loss, next_token_loss
from levanter.models.loss import blockwise_logsumexp
from levanter.training import Trainer, TrainerConfig

RTOL, ATOL = tol(2e-5), tol(2e-6)  # tenfold on a TPU (tests/accelerator.py)


def _close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@pytest.mark.parametrize("vocab,block", [(40, 8), (37, 8)])
def test_blockwise_logsumexp_matches_full(vocab, block):
    """40 = 5 blocks of 8; 37 ends in a partial block (read overlapping the previous one)."""
    kh, kw, kg = jax.random.split(jax.random.PRNGKey(vocab * 100 + block), 3)
    h = jax.random.normal(kh, (11, 16)) * 2.0
    w = jax.random.normal(kw, (vocab, 16))
    g = jax.random.normal(kg, (11,))

    def blockwise(h, w):
        return jnp.sum(blockwise_logsumexp(h, w, block) * g)

    def full(h, w):
        return jnp.sum(jax.nn.logsumexp(h @ w.T, axis=-1) * g)

    _close(blockwise_logsumexp(h, w, block), jax.nn.logsumexp(h @ w.T, axis=-1))
    got, want = jax.jit(jax.grad(blockwise, (0, 1)))(h, w), jax.jit(jax.grad(full, (0, 1)))(h, w)
    for a, b in zip(got, want):
        _close(a, b, atol=tol(1e-5))


def test_blockwise_logsumexp_refuses_bad_block():
    h, w = jnp.zeros((2, 4)), jnp.zeros((5, 4))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="block_size must be a positive integer"):
            blockwise_logsumexp(h, w, bad)


def _named_case(vocab: int, key: int = 0):
    Batch, Pos = hax.Axis("batch", 3), hax.Axis("position", 9)
    Embed, Vocab = hax.Axis("embed", 16), hax.Axis("vocab", vocab)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(key), 4)
    hidden = hax.random.normal(k1, (Batch, Pos, Embed))
    lm_head = hax.random.normal(k2, (Vocab, Embed)) * 0.7
    tokens = hax.random.randint(k3, (Batch, Pos), 0, vocab)
    mask = hax.random.bernoulli(k4, (Batch, Pos), 0.6)
    return hidden, lm_head, tokens, mask


@pytest.mark.parametrize("vocab,z_loss,masked", [(48, 0.0, False), (45, 1e-2, True)])
def test_blockwise_loss_and_gradients_match_full(vocab, z_loss, masked):
    """A vocabulary of whole blocks without z-loss or mask; a partial last block with both."""
    hidden, lm_head, tokens, mask = _named_case(vocab, key=vocab)
    mask = mask if masked else None

    def full(hidden, lm_head, reduction):
        logits = hax.dot(hidden, lm_head, axis="embed")
        return next_token_loss(logits, tokens, mask, reduction=reduction, z_loss_weight=z_loss)

    def blockwise(hidden, lm_head, reduction):
        return blockwise_next_token_loss(
            hidden, lm_head, tokens, mask, block_size=8, reduction=reduction, z_loss_weight=z_loss
        )

    def reductions(loss):  # every reduction in one compiled program
        return jax.jit(lambda h, w: (loss(h, w, "mean"), loss(h, w, None).array, loss(h, w, "sum_and_count")))

    (b_mean, b_per_pos, (bt, bc)) = reductions(blockwise)(hidden, lm_head)
    (f_mean, f_per_pos, (ft, fc)) = reductions(full)(hidden, lm_head)
    _close(b_mean, f_mean)
    _close(b_per_pos, f_per_pos)
    _close(bt, ft)
    assert float(bc) == float(fc) > 0

    def summed(loss):
        return lambda h, w: loss(h, w, "sum_and_count")[0]

    got = jax.jit(jax.grad(summed(blockwise), argnums=(0, 1)))(hidden, lm_head)
    want = jax.jit(jax.grad(summed(full), argnums=(0, 1)))(hidden, lm_head)
    for a, b in zip(got, want):
        assert a.axes == b.axes
        _close(a.array, b.array, atol=tol(1e-5))


def test_blockwise_loss_in_bfloat16_is_close():
    """bfloat16 hidden states and projection: the blockwise logits accumulate in float32, the full path
    casts bfloat16 logits, so the two agree within bfloat16 precision."""
    hidden, lm_head, tokens, mask = _named_case(45, key=3)
    h16, w16 = hidden.astype(jnp.bfloat16), lm_head.astype(jnp.bfloat16)
    full = next_token_loss(hax.dot(h16, w16, axis="embed"), tokens, mask)
    block = blockwise_next_token_loss(h16, w16, tokens, mask, block_size=16)
    exact = next_token_loss(hax.dot(hidden, lm_head, axis="embed"), tokens, mask)
    assert abs(float(block) - float(full)) < 0.05 * abs(float(full))
    assert abs(float(block) - float(exact)) < 0.05 * abs(float(exact))


TINY_LLAMA = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, gradient_checkpointing=False)
TINY_GPT2 = Gpt2Config(seq_len=16, hidden_dim=32, num_heads=4, num_layers=1, gradient_checkpointing=False)


@pytest.mark.slow
def test_llama_untied_loss_with_blocks_equals_full():
    """The same parameters (the block size does not change the initialisation) give the same loss through
    ``compute_next_token_loss`` for Llama's untied lm head (GPT-2's tied embedding, and gradients, are in
    the trainer step below; the kernel's gradients in the tests above)."""
    Vocab = hax.Axis("vocab", 61)
    # Initialised under jit (op by op, a model's init dispatches hundreds of tiny programs).
    full_model = eqx.filter_jit(lambda k: TINY_LLAMA.build(Vocab, key=k))(jax.random.PRNGKey(0))
    block_model = dataclasses.replace(
        full_model, config=dataclasses.replace(TINY_LLAMA, cross_entropy_block_size=16)
    )
    ids = hax.random.randint(jax.random.PRNGKey(1), (hax.Axis("batch", 2), TINY_LLAMA.Pos), 0, Vocab.size)
    mask = hax.random.bernoulli(jax.random.PRNGKey(2), ids.axes, 0.8)

    def loss(model):
        return model.compute_next_token_loss(ids, mask, z_loss_weight=1e-3)

    full, block = eqx.filter_jit(lambda a, b: (loss(a), loss(b)))(full_model, block_model)
    _close(block, full)


@pytest.mark.slow
def test_trainer_step_with_blocks_equals_full():
    """One optimizer step of the trainer (the loss train_lm uses, 8 data-parallel devices, GPT-2's tied
    embedding as the lm head) gives the same loss, gradient norm and parameters with
    ``cross_entropy_block_size`` as with the full loss (plain SGD, so parameters differ by the gradients'
    rounding only)."""
    tcfg = TrainerConfig(num_train_steps=2, train_batch_size=8, require_accelerator=False, mp="f32")
    Vocab = hax.Axis("vocab", 50)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (8, TINY_GPT2.seq_len), 0, Vocab.size)
    trainer = Trainer(tcfg, optax.sgd(0.5), lm_loss_fn(1e-3, eos_id=0))
    initial = trainer.initial_state(lambda k: TINY_GPT2.build(Vocab, key=k), key=jax.random.PRNGKey(0))
    batch = {"tokens": hax.named(tokens, (hax.Axis("batch", 8), TINY_GPT2.Pos))}
    with hax.partitioning.set_mesh(trainer.mesh):
        batch = hax.shard(batch, trainer.compute_mapping)
    results = []
    for block in (None, 12):
        # The same initial state with the block size set (the step donates its input: a copy each time).
        config = dataclasses.replace(TINY_GPT2, cross_entropy_block_size=block)
        model = dataclasses.replace(initial.model, config=config)
        state = dataclasses.replace(jax.tree.map(jnp.copy, initial), model=jax.tree.map(jnp.copy, model))
        results.append(trainer.train_step(state, batch, 8))
    (full_state, full_m), (block_state, block_m) = results
    _close(block_m["loss"], full_m["loss"])
    _close(block_m["grad_norm"], full_m["grad_norm"])
    for a, b in zip(jax.tree.leaves(eqx.filter(block_state.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(full_state.model, eqx.is_array))):
        _close(a, b, atol=tol(1e-5))


def test_config_refuses_bad_block_size():
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"model.cross_entropy_block_size must be a positive"):
            LlamaConfig(cross_entropy_block_size=bad)
        with pytest.raises(ValueError, match=r"model.cross_entropy_block_size must be a positive"):
            Gpt2Config(cross_entropy_block_size=bad)
    assert LlamaConfig(cross_entropy_block_size=4096).loss_logit_entries(128_256) == 4096
    assert LlamaConfig().loss_logit_entries(128_256) == 128_256
    assert LlamaConfig(cross_entropy_block_size=10**6).loss_logit_entries(1000) == 1000


def test_check_memory_counts_one_block_of_logits():
    """A vocabulary whose full float32 logits cannot fit is refused; with a block size the same model
    passes (its parameters fit, and only one block of logits is counted)."""
    from levanter.lm_config import TrainLmConfig

    model = Gpt2Config(seq_len=512, hidden_dim=16, num_heads=2, num_layers=1)
    trainer = TrainerConfig(train_batch_size=64, require_accelerator=False)
    config = TrainLmConfig(model=model, trainer=trainer)
    vocab = 1_000_000  # params + Adam ~ 256 MB; full logits 64 x 512 x 1M x 4 B = 131 GB
    available = (4 * 2**30, "a 4 GiB test budget")
    with pytest.raises(ValueError, match=r"cannot fit.*1,000,000 vocabulary entries"):
        check_memory(config, vocab, available)
    blocked = dataclasses.replace(config, model=dataclasses.replace(model, cross_entropy_block_size=1024))
    check_memory(blocked, vocab, available)


def test_check_memory_counts_the_full_loss_logits_in_the_compute_dtype():
    """The full loss keeps the logits as the model computes them (bfloat16 under ``mp: p=f32,c=bfloat16``), so the
    estimate counts two bytes per entry there: a vocabulary whose float32 logits would not fit in the budget,
    but whose bfloat16 ones do, is refused under float32 compute only; the refusal names the dtype."""
    from levanter.lm_config import TrainLmConfig

    model = Gpt2Config(seq_len=512, hidden_dim=16, num_heads=2, num_layers=1)
    vocab = 50_000  # logits of 64 x 512 tokens: 6.1 GiB in float32, 3.1 GiB in bfloat16; parameters ~13 MB
    available = (4 * 2**30, "a 4 GiB test budget")
    for mp, fits in (("f32", False), ("p=f32,c=bfloat16", True)):
        trainer = TrainerConfig(train_batch_size=64, require_accelerator=False, mp=mp)
        config = TrainLmConfig(model=model, trainer=trainer)
        if fits:
            check_memory(config, vocab, available)
        else:
            with pytest.raises(ValueError, match=r"cannot fit.*float32 logits of a batch of 64 x 512 positions"):
                check_memory(config, vocab, available)


def _autodiff_loss(logits, tokens, mask, z_loss):
    """The full loss as plain autodiff sees it: float32 logits, logsumexp and a gather."""
    x = logits.astype(jnp.float32)
    targets = jnp.roll(tokens, -1, axis=-1)
    valid = mask & (jnp.arange(tokens.shape[-1]) < tokens.shape[-1] - 1)
    log_z = jax.nn.logsumexp(x, axis=-1)
    per = log_z - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0] + z_loss * log_z**2
    return jnp.sum(jnp.where(valid, per, 0.0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_full_loss_derivatives_match_autodiff(dtype, z_loss):
    """next_token_loss writes its own derivative (a JVP rule): value, gradient and a Hessian-vector product
    (forward over reverse, as Sophia takes them) match autodiff of the plain formula, masked positions
    included."""
    B, P, V = hax.Axis("batch", 3), hax.Axis("position", 7), hax.Axis("vocab", 37)
    kl, kt, km, kv = jax.random.split(jax.random.PRNGKey(3), 4)
    logits = (jax.random.normal(kl, (3, 7, 37)) * 3).astype(dtype)
    tokens = jax.random.randint(kt, (3, 7), 0, 37)
    mask = jax.random.bernoulli(km, 0.7, (3, 7))
    probe = jax.random.normal(kv, logits.shape).astype(dtype)

    def ours(x):
        return next_token_loss(hax.named(x, (B, P, V)), hax.named(tokens, (B, P)), hax.named(mask, (B, P)),
                               reduction="sum", z_loss_weight=z_loss)

    def ref(x):
        return _autodiff_loss(x, tokens, mask, z_loss)

    tol_ = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else {}
    _close(ours(logits), ref(logits), **tol_)
    _close(jax.grad(ours)(logits).astype(jnp.float32), jax.grad(ref)(logits).astype(jnp.float32), **tol_)
    hvp = lambda f: jax.jvp(jax.grad(f), (logits,), (probe,))[1].astype(jnp.float32)  # noqa: E731
    _close(hvp(ours), hvp(ref), **tol_)


def test_full_loss_keeps_no_float32_copy_of_bfloat16_logits():
    """What the gradient keeps from the forward pass: the bfloat16 logits and one float32 normaliser per token;
    never the logits (or the softmax) in float32, which is what autodiff of the upcast kept."""
    B, P, V = hax.Axis("batch", 2), hax.Axis("position", 8), hax.Axis("vocab", 64)
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 64)).astype(jnp.bfloat16)
    tokens = hax.named(jnp.zeros((2, 8), jnp.int32), (B, P))

    def loss(x):
        return next_token_loss(hax.named(x, (B, P, V)), tokens, reduction="sum")

    _, backward = jax.vjp(loss, logits)  # its leaves are what the backward pass reads from the forward
    saved = [jax.typeof(x) for x in jax.tree.leaves(backward)]
    big = [a for a in saved if a.shape == logits.shape]
    assert big and all(a.dtype == jnp.bfloat16 for a in big), saved
    assert not any(a.dtype == jnp.float32 and a.size >= logits.size for a in saved), saved
