"""Evaluation per source and tag (levanter.training.eval, levanter.main.eval_lm) and branching a run from another
run's checkpoint (trainer.initialize_from, initialize_from_checkpoint_path).

One tiny two-source run (tagged sources, byte tokens) is trained once for the module; its checkpoint is
evaluated by ``eval_lm`` and checked against losses computed here from the model's logits with numpy, and
branched from."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_train_lm import metrics, tiny_config  # noqa: E402

from levanter.checkpoint import initialize_from, load_checkpoint, read_checkpoint_metadata  # noqa: E402
from levanter.data.config import LMMixtureDatasetConfig  # noqa: E402
from levanter.data.source_config import LMDatasetSourceConfig  # noqa: E402
from levanter.training import EvalResult, SourceTotals, format_table, token_byte_lengths  # noqa: E402
from levanter.ingest import ByteTokenizer, train_bpe  # noqa: E402
from levanter.training import lm_loss_fn  # noqa: E402
from levanter.training import Trainer  # noqa: E402
from levanter.main import eval_lm, train_lm  # noqa: E402


def two_source_config(tmp: Path, run_id: str = "origin", steps: int = 2, **trainer_kw):
    cfg = tiny_config(tmp, steps=steps, id=run_id, steps_per_eval=100, max_eval_batches=2, **trainer_kw)
    data = LMMixtureDatasetConfig(
        tokenizer="byte", cache_dir=str(tmp / "cache"), mixture_block_size=None,
        configs={
            "prose": LMDatasetSourceConfig(train_urls=["embedded://python-docs/validation"],
                                           validation_urls=["embedded://python-docs/validation"],
                                           tags=["text/en"]),
            "code": LMDatasetSourceConfig(train_urls=["embedded://python-code/validation"],
                                          validation_urls=["embedded://python-code/validation"],
                                          tags=["text/py", "code_like"]),
        },
        train_weights={"prose": 0.5, "code": 0.5},
    )
    return dataclasses.replace(cfg, data=data)


COOLDOWN = {"prose": 0.1, "code": 0.9}  # a branch's own data schedule


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("origin")
    cfg = two_source_config(tmp)
    train_lm.main(cfg)
    return tmp, cfg


def model_from(cfg, path):
    # Shapes only (building the model outside jit would run its initialisation op by op, for seconds).
    template = jax.eval_shape(lambda: cfg.model.build(hax.Axis("vocab", 257), key=jax.random.PRNGKey(0)))
    return load_checkpoint(template, path, subpath="model")


def test_eval_lm_losses_and_bits_per_byte_equal_an_independent_computation(origin, capsys):
    tmp, cfg = origin
    run_dir = tmp / "ckpt" / "origin"
    ecfg = eval_lm.EvalLmConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                                checkpoint_path=str(run_dir))
    got = eval_lm.main(ecfg)
    out = capsys.readouterr().out
    assert "micro average" in out and "macro average" in out and "prose" in out
    # it says where the metrics went
    assert f"metrics of run origin-eval at step 2:\n  json metrics: {tmp / 'logs' / 'origin-eval' / 'metrics.jsonl'}" in out

    path = str(run_dir / "step-2")
    model = model_from(cfg, path)
    forward = eqx.filter_jit(lambda m, t, s: m(t, s).array)
    bs, n_batches = 8, 2  # the first training batch size; trainer.max_eval_batches
    sums = {}
    for name, ds in cfg.data.validation_sets(cfg.model.seq_len).items():
        batch = asyncio.run(ds.get_batch(0, list(range(bs * n_batches)))).tree
        tokens = np.asarray(batch["tokens"])
        mask = np.asarray(batch["loss_mask"]).astype(bool)
        seg = np.asarray(batch["segment_ids"])
        Pos = cfg.model.Pos
        B = hax.Axis("batch", tokens.shape[0])
        logits = np.asarray(forward(model, hax.named(tokens, (B, Pos)), hax.named(seg, (B, Pos))), np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        targets = tokens[:, 1:]
        nll = -np.take_along_axis(logp[:, :-1], targets[..., None], -1)[..., 0]
        valid = mask[:, :-1]
        loss, count = nll[valid].sum(), valid.sum()
        nbytes = (targets[valid] < 256).sum()  # byte tokens are one byte each; EOS (256) none
        sums[name] = (loss, count, nbytes)
        assert got[f"eval/{name}/loss"] == pytest.approx(loss / count, rel=1e-5)
        assert got[f"eval/{name}/bpb"] == pytest.approx(loss / (math.log(2) * nbytes), rel=1e-5)
    total = [sum(v[i] for v in sums.values()) for i in range(3)]
    assert got["eval/loss"] == pytest.approx(total[0] / total[1], rel=1e-5)
    assert got["eval/bpb"] == pytest.approx(total[0] / (math.log(2) * total[2]), rel=1e-5)
    assert got["eval/macro_loss"] == pytest.approx(np.mean([v[0] / v[1] for v in sums.values()]), rel=1e-5)
    assert got["eval/text/micro_loss"] == pytest.approx(got["eval/loss"])
    assert got["eval/code_like/loss"] == got["eval/code/loss"]
    # The same metrics are what train_lm logged at its last step's eval.
    logged = [r for r in metrics(tmp, "origin") if "eval/loss" in r][-1]
    assert logged["step"] == 2 and logged["eval/prose/bpb"] == pytest.approx(got["eval/prose/bpb"], rel=1e-6)
    written = [json.loads(x) for x in open(tmp / "logs" / "origin-eval" / "metrics.jsonl")]
    assert written[-1]["step"] == 2 and written[-1]["eval/loss"] == pytest.approx(got["eval/loss"])

    # The same weights exported in the Hugging Face layout and evaluated from there give the same metrics.
    from levanter.compat.hf_checkpoints import save_hf_checkpoint

    save_hf_checkpoint(model, cfg.model, str(tmp / "hf"))
    hf = eval_lm.main(dataclasses.replace(ecfg, checkpoint_path=None, hf_checkpoint=str(tmp / "hf")))
    assert hf.keys() == got.keys()
    for k, v in got.items():
        assert hf[k] == pytest.approx(v, rel=1e-5), k


@pytest.mark.devices(8)
def test_eval_metrics_do_not_depend_on_how_batches_are_split_over_devices(origin):
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    tmp, cfg = origin
    model = model_from(cfg, str(tmp / "ckpt" / "origin" / "step-2"))
    sets = cfg.data.validation_sets(cfg.model.seq_len)
    results = []
    for model_axis_size in (1, 8):  # each batch over 8 data-parallel devices, or over 1
        tcfg = dataclasses.replace(cfg.trainer, model_axis_size=model_axis_size)
        trainer = Trainer(tcfg, optax.identity(), lm_loss_fn())
        replicated = NamedSharding(trainer.mesh, PartitionSpec())
        placed = jax.tree.map(lambda x: jax.device_put(x, replicated) if eqx.is_array(x) else x, model)
        run = dataclasses.replace(cfg, trainer=tcfg)
        ev = train_lm.make_evaluator(run, trainer, sets, ByteTokenizer(), 257)
        results.append(ev.evaluate(placed).metrics())
    assert results[0].keys() == results[1].keys()
    for k, v in results[0].items():
        assert results[1][k] == pytest.approx(v, rel=1e-6), k


def test_the_evaluator_calls_its_sums_through_a_flat_jit_that_keeps_the_model(origin):
    """The evaluator's sums run through FlatStep (a jax.jit over flat leaves, built once per structure; not
    the named_jit fallback) without donating the model: evaluating twice gives the same result and the
    model's arrays are still there; each batch's sums equal named_jit's."""
    import optax

    from levanter.training import FlatStep

    tmp, cfg = origin
    model = model_from(cfg, str(tmp / "ckpt" / "origin" / "step-2"))
    trainer = Trainer(cfg.trainer, optax.identity(), lm_loss_fn())
    ev = train_lm.make_evaluator(cfg, trainer, cfg.data.validation_sets(cfg.model.seq_len), ByteTokenizer(), 257)
    first = ev.evaluate(model).metrics()
    assert ev.evaluate(model).metrics() == first
    assert not any(x.is_deleted() for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    fn = ev._sums_fn()
    assert isinstance(fn, FlatStep) and fn.compile_count() == 1
    assert all(entry is not None for entry in fn._by_structure.values())  # not the fallback
    rows = {"tokens": np.arange(2 * cfg.model.seq_len, dtype=np.int32).reshape(2, -1) % 200,
            "loss_mask": np.ones((2, cfg.model.seq_len), np.int32),
            "segment_ids": np.zeros((2, cfg.model.seq_len), np.int32)}
    named = {k: hax.named(jax.numpy.asarray(v), ("batch", cfg.model.Pos.name)) for k, v in rows.items()}
    placed = ev._on_mesh(model)  # what evaluate() hands the sums: the model on the trainer's mesh
    with hax.partitioning.set_mesh(trainer.mesh), hax.axis_mapping(trainer.compute_mapping):
        flat = fn(placed, (named, ev._byte_lengths))
        reference = fn._named(placed, (named, ev._byte_lengths))
    assert [float(x) for x in flat] == [float(x) for x in reference]


def test_metric_averages_and_tags_by_hand():
    r = EvalResult(
        {"a": SourceTotals(loss=10.0, tokens=5, bytes=4, sequences=1),
         "b": SourceTotals(loss=30.0, tokens=10, bytes=20, sequences=2),
         "c": SourceTotals(loss=6.0, tokens=6, bytes=6, sequences=1)},
        {"a": ("web/en",), "b": ("web/de", "big"), "c": ("big",)}, has_bytes=True,
    )
    m = r.metrics()
    ln2 = math.log(2)
    assert m["eval/a/loss"] == 2.0 and m["eval/a/bpb"] == pytest.approx(10 / (4 * ln2))
    assert m["eval/loss"] == pytest.approx(46 / 21) and m["eval/macro_loss"] == pytest.approx((2 + 3 + 1) / 3)
    assert m["eval/bpb"] == pytest.approx(46 / (30 * ln2))
    assert m["eval/macro_bpb"] == pytest.approx((10 / 4 + 30 / 20 + 6 / 6) / 3 / ln2)
    assert m["eval/web/micro_loss"] == pytest.approx(40 / 15)
    assert m["eval/web/macro_loss"] == pytest.approx(2.5)
    assert m["eval/big/loss"] == pytest.approx(36 / 16)
    assert m["eval/big/macro_bpb"] == pytest.approx(2.5 / 2 / ln2)
    assert "eval/web/en/macro_loss" not in m and m["eval/web/en/loss"] == 2.0
    assert format_table(r).splitlines()[-1].split()[:3] == ["macro", "average", "2.0000"]


def test_bytes_per_token_of_byte_and_bpe_tokenizers(tmp_path):
    text = "naïve café — déjà vu\n"
    byte = token_byte_lengths(ByteTokenizer(260), 260)
    assert byte[:256].sum() == 256 and byte[256:].sum() == 0
    tok = train_bpe([text * 20, "plain ascii words and more words"], 300, str(tmp_path / "bpe"))
    lengths = token_byte_lengths(tok, tok.vocab_size + 3)
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merged tokens, several bytes each
    assert lengths[ids].sum() == len(text.encode("utf-8"))
    assert lengths[tok.eos_token_id] == 0 and lengths[-3:].sum() == 0


def test_a_branch_starts_at_step_0_with_the_origins_weights_and_optimizer_state(origin):
    tmp, cfg = origin
    origin_step = str(tmp / "ckpt" / "origin" / "step-2")
    # trainer.initialize_from: weights and optimizer state, the learning-rate schedule restarted.
    bcfg = two_source_config(tmp, run_id="branch", steps=2, initialize_from=str(tmp / "ckpt" / "origin"))
    bcfg = dataclasses.replace(bcfg, data=dataclasses.replace(bcfg.data, train_weights=COOLDOWN))
    trainer = Trainer(bcfg.trainer, bcfg.optimizer.build(2), lm_loss_fn())
    vocab = hax.Axis("vocab", 257)
    fresh = trainer.initial_state(lambda k: bcfg.model.build(vocab, key=k), key=jax.random.PRNGKey(1))
    state = initialize_from(fresh, origin_step, optimizer_state=True,
                                               key="trainer.initialize_from")
    saved = load_checkpoint(fresh, origin_step)
    assert int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(saved.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adam = [s for s in state.opt_state if hasattr(s, "mu")][0]
    saved_adam = [s for s in saved.opt_state if hasattr(s, "mu")][0]
    for a, b in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(saved_adam.mu)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(adam.count) == 2 and int(state.opt_state[-1].count) == 0


def test_a_branch_run_records_its_origin_and_resumes_from_its_own_checkpoints(origin):
    tmp, cfg = origin
    origin_step = str(tmp / "ckpt" / "origin" / "step-2")
    bcfg = two_source_config(tmp, run_id="wbranch", steps=2, initialize_from=None)
    bcfg = dataclasses.replace(bcfg, data=dataclasses.replace(bcfg.data, train_weights=COOLDOWN))
    # End to end, weights only: the run trains steps 0..1, records where it started, and a rerun with more
    # steps resumes from its own step-2 checkpoint (the data schedule of the branch is its own).
    wcfg = dataclasses.replace(bcfg, initialize_from_checkpoint_path=str(tmp / "ckpt" / "origin"))
    wcfg = dataclasses.replace(wcfg, trainer=dataclasses.replace(
        wcfg.trainer, checkpointer=dataclasses.replace(wcfg.trainer.checkpointer, keep=[])))
    out = train_lm.main(wcfg)
    assert out["final_step"] == 2
    rows = metrics(tmp, "wbranch")
    assert min(r["step"] for r in rows if "train/loss" in r) == 0
    meta = read_checkpoint_metadata(str(tmp / "ckpt" / "wbranch" / "step-2"))["metadata"]
    assert meta["initialized_from"] == {"path": origin_step, "step": 2, "optimizer_state": False}
    config_json = json.loads(open(tmp / "logs" / "wbranch" / "config.json").read())
    assert config_json["initialized_from"]["step"] == 2
    longer = dataclasses.replace(wcfg, trainer=dataclasses.replace(wcfg.trainer, num_train_steps=3))
    assert train_lm.main(longer)["final_step"] == 3
    rows = metrics(tmp, "wbranch")
    assert [r["step"] for r in rows if "train/loss" in r] == [0, 1, 2]
    meta = read_checkpoint_metadata(str(tmp / "ckpt" / "wbranch" / "step-3"))["metadata"]
    assert meta["initialized_from"]["path"] == origin_step


@pytest.mark.parametrize("name", ["gpt2_nano.yaml", "llama_nano.yaml", "gemma_nano.yaml", "gpt2_nano_curriculum.yaml"])
def test_the_shipped_nano_configs_evaluate_every_validation_source(name, tmp_path):
    """An eval reads the first ``trainer.max_eval_batches`` batches of each validation source, in file order,
    so a source of several validation files would leave the later ones unread (the README job once read
    only the prose file of its two). The nano configs give each validation file a source of its own, and
    every source gets its batches: both the prose and the code split are evaluated and reported."""
    from levanter.config import parse_config
    from levanter.training import make_evaluator

    repo = Path(__file__).resolve().parents[2]
    cfg = parse_config(train_lm.TrainLmConfig, str(repo / "config" / name))
    sources = getattr(cfg.data, "configs", None) or {"": cfg.data}
    assert all(len(s.validation_urls) == 1 for s in sources.values()), sources
    data = dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "cache"))
    sets = data.validation_sets(cfg.model.seq_len)
    evaluator = make_evaluator(Trainer(cfg.trainer, None, None), data, sets, data.the_tokenizer(), 257, cfg.model.Pos)
    assert [es.name for es in evaluator.eval_sets] == ["prose", "code"]
    for es in evaluator.eval_sets:  # each source holds its max_eval_batches batches
        assert asyncio.run(es.dataset.async_len()) >= cfg.trainer.max_eval_batches * cfg.trainer.eval_batch_size


def test_eval_lm_without_a_config_takes_the_model_and_tokenizer_from_the_checkpoint(origin, tmp_path, capsys):
    """``eval_lm --checkpoint_path ...`` with no --config_path builds the model and the tokenizer the checkpoint's
    metadata.json records: given only the validation files (and the batch and device settings), it evaluates the
    origin run's prose source as that run's own eval did."""
    tmp, cfg = origin
    eval_lm.cli(["--checkpoint_path", str(tmp / "ckpt" / "origin"),
                 "--data.validation_urls", '["embedded://python-docs/validation"]',
                 "--data.cache_dir", str(tmp_path / "cache"), "--trainer.require_accelerator", "false",
                 "--trainer.train_batch_size", "8", "--trainer.max_eval_batches", "2",
                 "--trainer.log_dir", str(tmp_path / "logs"), "--trainer.id", "bare"])
    written = [json.loads(x) for x in open(tmp_path / "logs" / "bare-eval" / "metrics.jsonl")]
    logged = [r for r in metrics(tmp, "origin") if "eval/loss" in r][-1]
    assert written[-1]["step"] == 2
    assert written[-1]["eval/loss"] == pytest.approx(logged["eval/prose/loss"], rel=1e-6)
    assert "'byte'" not in capsys.readouterr().err  # no tokenizer error: the byte tokenizer was used
