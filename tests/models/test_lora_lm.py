"""``python -m levanter.main.lora_lm``: upstream's LoRA config trains adapters on a Hugging Face model (a tiny
random ``transformers`` Llama stands in for Llama 2), the base weights stay bit for bit, and the exports load
in ``transformers`` (the merged model) and in PEFT (the adapters; by hand where ``peft`` is not installed),
each computing what our adapted model computes. One short run serves several assertions."""

from __future__ import annotations

import json
import os
import sys

import haliax as hax
import jax
import numpy as np
import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from accelerator import tol  # noqa: E402
from test_hf_checkpoints import hf_configs, our_logits, torch_logits  # noqa: E402

from levanter.config import parse_config  # noqa: E402
from levanter.main import lora_lm  # noqa: E402

STEPS = 3
TARGETS = ["q_proj", "v_proj", "down_proj"]


def upstream_shaped_yaml(tmp, hf_dir, **overrides) -> dict:
    """A config with the keys and values of upstream's config/lora_llama2.yaml, with the tiny model, the
    embedded corpus, a short run and local outputs put in."""
    raw = {
        "data": {"tokenizer": "byte", "train_urls": ["embedded://python-docs/validation"],
                 "cache_dir": str(tmp / "cache")},
        "initialize_from_hf": hf_dir,
        "peft_save_path": str(tmp / "peft"),
        "merged_hf_save_path": str(tmp / "merged"),
        "hf_save_steps": 2,
        "max_train_length": 32,
        "lora": {"r": 4, "alpha": 8.0, "target_modules": TARGETS},
        "trainer": {
            "mp": "p=f32,c=bfloat16",
            "tracker": {"type": "json"},
            "num_train_steps": STEPS,
            "train_batch_size": -1,  # upstream's: per_device_parallelism on every device
            "per_device_parallelism": 1,
            "tensor_parallel_axes": ["mlp", "heads"],
            "require_accelerator": False,
            "id": "lora",
            "log_dir": str(tmp / "logs"),
            "steps_per_eval": 100,
            "checkpointer": {"base_path": str(tmp / "ckpt")},
        },
        # A constant rate: a run stopped early and resumed takes the straight run's steps.
        "optimizer": {"learning_rate": 3e-2, "weight_decay": 0.1, "warmup": 0.0, "lr_schedule": "constant"},
    }
    for key, value in overrides.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return raw


def write(tmp, raw, name="lora.yaml"):
    path = tmp / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A saved random transformers Llama (grouped-query attention, untied head) and the loaded model."""
    root = tmp_path_factory.mktemp("hf-lora")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_configs()["llama-gqa-untied"]).eval()
    model.save_pretrained(root / "base")
    return str(root / "base")


@pytest.fixture(scope="module")
def run(hf_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-run")
    path = write(tmp, upstream_shaped_yaml(tmp, hf_llama))
    summary = lora_lm.main(parse_config(lora_lm.LoraLmConfig, path))
    return tmp, path, summary


def _checkpoint_model(path):
    """The model of a lora_lm checkpoint, as the run built it (adapters included)."""
    from levanter.checkpoint import load_checkpoint, read_checkpoint_metadata
    from levanter.lora import lora_from_record, loraize
    from levanter.models import LmConfig

    import draccus

    record = read_checkpoint_metadata(path)["metadata"]
    config = draccus.decode(LmConfig, record["model"])
    Vocab = hax.Axis("vocab", record["vocab_size"])
    template = jax.eval_shape(lambda k: loraize(config.build(Vocab, key=k), lora_from_record(record), key=k),
                              jax.random.PRNGKey(0))
    return load_checkpoint(template, path, subpath="model"), record


def test_the_adapters_train_and_the_base_weights_stay_bit_for_bit(run, hf_llama):
    import equinox as eqx

    from levanter.compat import load_hf_checkpoint
    from levanter.lora import lora_layer_paths, split_adapters

    tmp, _, summary = run
    assert summary["final_step"] == STEPS
    model, record = _checkpoint_model(str(tmp / "ckpt" / "lora" / f"step-{STEPS}"))
    assert record["lora"] == {"target_modules": TARGETS, "r": 4, "alpha": 8.0}
    assert sorted(p.rsplit(".", 1)[-1] for p in lora_layer_paths(model)) == sorted(TARGETS)
    adapters, base = split_adapters(model)
    _, loaded = load_hf_checkpoint(hf_llama)
    fixed = jax.tree.leaves(eqx.filter(base, eqx.is_inexact_array))
    assert len(fixed) == len(jax.tree.leaves(loaded))
    for a, b in zip(fixed, jax.tree.leaves(loaded)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # lora_b started at zero: it moved, so the adapters trained
    assert all(float(np.abs(np.asarray(x)).max()) > 0 for x in jax.tree.leaves(adapters))
    counts = json.loads((tmp / "logs" / "lora" / "summary.json").read_text())
    trained = sum(x.size for x in jax.tree.leaves(adapters))
    assert counts["trainable_parameter_count"] == trained < counts["parameter_count"]


def _hand_applied(hf_dir, peft_dir):
    """The transformers base model with the PEFT adapters folded into its weights by hand (scale alpha / r)."""
    from safetensors.numpy import load_file

    cfg = json.loads(open(os.path.join(peft_dir, "adapter_config.json")).read())
    tensors = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    params = dict(model.named_parameters())
    scale = cfg["lora_alpha"] / cfg["r"]
    with torch.no_grad():
        for key in tensors:
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len("base_model.model."):-len(".lora_A.weight")]
            A, B = tensors[key], tensors[key.replace("lora_A", "lora_B")]
            params[f"{module}.weight"].add_(torch.tensor(scale * (B @ A)))
    return model


def test_peft_export_has_peft_names_shapes_and_config(run, hf_llama):
    tmp, _, _ = run
    exports = tmp / "peft" / "lora"
    assert sorted(p.name for p in exports.iterdir()) == ["step-2", f"step-{STEPS}"]
    final = exports / f"step-{STEPS}"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg == {"base_model_name_or_path": hf_llama, "bias": "none", "fan_in_fan_out": False,
                   "inference_mode": True, "lora_alpha": 8.0, "lora_dropout": 0.0, "modules_to_save": None,
                   "peft_type": "LORA", "r": 4, "target_modules": sorted(TARGETS), "task_type": "CAUSAL_LM",
                   "use_rslora": False}
    from safetensors.numpy import load_file

    tensors = load_file(str(final / "adapter_model.safetensors"))
    shapes = {"q_proj": (32, 32), "v_proj": (16, 32), "down_proj": (32, 48)}  # (out, in) of the HF weight
    expected = {}
    for i in range(2):
        for name, (out, inp) in shapes.items():
            group = "mlp" if name == "down_proj" else "self_attn"
            module = f"base_model.model.model.layers.{i}.{group}.{name}"
            expected[f"{module}.lora_A.weight"] = (4, inp)
            expected[f"{module}.lora_B.weight"] = (out, 4)
    assert {k: v.shape for k, v in tensors.items()} == expected
    # The adapters applied by hand to transformers' base model give the merged export's logits, and the merged
    # export loads in transformers and gives our adapted model's logits.
    merged_dir = tmp / "merged" / "lora" / f"step-{STEPS}"
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    model, _ = _checkpoint_model(str(tmp / "ckpt" / "lora" / f"step-{STEPS}"))
    ours = our_logits(model)
    assert np.abs(torch_logits(merged) - ours).max() < tol(1e-4)
    by_hand = torch_logits(_hand_applied(hf_llama, str(final)))
    assert np.abs(by_hand - torch_logits(merged)).max() < tol(1e-4)
    base = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval())
    assert np.abs(base - ours).max() > 1e-3  # the adapters change what the model computes


def test_peft_loads_the_adapters(run, hf_llama):
    peft = pytest.importorskip("peft")
    tmp, _, _ = run
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp / "peft" / "lora" / f"step-{STEPS}")).eval()
    model, _ = _checkpoint_model(str(tmp / "ckpt" / "lora" / f"step-{STEPS}"))
    assert np.abs(torch_logits(adapted) - our_logits(model)).max() < tol(1e-4)


def test_export_lm_to_hf_merges_a_lora_checkpoint(run, tmp_path):
    from levanter.main import export_lm_to_hf
    from levanter.compat import load_hf_checkpoint

    tmp, _, _ = run
    export_lm_to_hf.cli(["--checkpoint_path", str(tmp / "ckpt" / "lora"), "--output_dir", str(tmp_path / "x")])
    _, ours = load_hf_checkpoint(str(tmp_path / "x"))
    _, exported = load_hf_checkpoint(str(tmp / "merged" / "lora" / f"step-{STEPS}"))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(exported)):  # the merge's products, summed on other shards
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_eval_lm_evaluates_a_lora_checkpoint_through_its_adapters(run, hf_llama, tmp_path):
    """eval_lm rebuilds the adapters a lora_lm checkpoint records: its losses are those of the run's merged
    export, and not those of the base model the adapters were trained on."""
    import dataclasses

    from levanter.lm_config import with_hf_model
    from levanter.main import eval_lm

    tmp, path, _ = run
    base = with_hf_model(lora_lm.to_train_lm_config(parse_config(lora_lm.LoraLmConfig, path)))
    common = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    common.update(
        initialize_from_hf=False,
        data=dataclasses.replace(base.data, validation_urls=["embedded://python-docs/validation"]),
        # float32: the adapters' two products and the merged weight's one then agree far below what they move
        trainer=dataclasses.replace(base.trainer, mp="f32", id="lora-eval", log_dir=str(tmp_path / "logs"),
                                    max_eval_batches=2),
    )

    def evaluate(**which):
        return eval_lm.main(eval_lm.EvalLmConfig(**common, **which))["eval/loss"]

    adapted = evaluate(checkpoint_path=str(tmp / "ckpt" / "lora"))
    merged = evaluate(hf_checkpoint=str(tmp / "merged" / "lora" / f"step-{STEPS}"))
    untrained = evaluate(hf_checkpoint=hf_llama)
    assert adapted == pytest.approx(merged, rel=tol(1e-5))
    assert abs(adapted - untrained) > 100 * tol(1e-5) * abs(untrained), (adapted, untrained)


def test_a_resume_with_other_lora_settings_is_refused(run, capsys):
    tmp, path, _ = run
    with pytest.raises(SystemExit) as e:
        lora_lm.cli(["--config_path", path, "--lora.r", "8", "--trainer.num_train_steps", str(STEPS + 1)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the checkpoint ") and "lora target_modules=['q_proj', 'v_proj', 'down_proj'], r=4" in err
    assert "this run has lora target_modules=['q_proj', 'v_proj', 'down_proj'], r=8" in err
    assert err.count("error:") == 1


def test_a_finished_run_rerun_changes_nothing(run):
    tmp, path, _ = run
    before = (tmp / "peft" / "lora" / f"step-{STEPS}" / "adapter_model.safetensors").read_bytes()
    assert lora_lm.main(parse_config(lora_lm.LoraLmConfig, path))["final_step"] == STEPS
    assert (tmp / "peft" / "lora" / f"step-{STEPS}" / "adapter_model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_a_resumed_run_is_bit_for_bit_the_straight_one(run, tmp_path):
    """Stopped after step 2 and resumed with the same settings: the final checkpoint's model and the PEFT
    export equal the straight run's."""
    tmp, _, _ = run
    hf_dir = json.loads((tmp / "peft" / "lora" / "step-2" / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    raw = upstream_shaped_yaml(tmp_path, hf_dir, data={"cache_dir": str(tmp / "cache")})
    path = write(tmp_path, raw)
    assert lora_lm.main(parse_config(lora_lm.LoraLmConfig, path, ["--trainer.num_train_steps", "2"]))["final_step"] == 2
    assert lora_lm.main(parse_config(lora_lm.LoraLmConfig, path))["final_step"] == STEPS
    a, _ = _checkpoint_model(str(tmp / "ckpt" / "lora" / f"step-{STEPS}"))
    b, _ = _checkpoint_model(str(tmp_path / "ckpt" / "lora" / f"step-{STEPS}"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    name = f"step-{STEPS}/adapter_model.safetensors"
    assert (tmp / "peft" / "lora" / name).read_bytes() == (tmp_path / "peft" / "lora" / name).read_bytes()


@pytest.mark.parametrize("override, message", [
    ({"lora": {"target_modulez": ["q_proj"]}}, "`lora`: unknown key `target_modulez`"),
    ({"peft_hf_upload": "me/adapters"}, "peft_hf_upload"),
    ({"merged_hf_upload": "me/merged"}, "merged_hf_upload"),
    ({"trust_remote_code": True}, "trust_remote_code"),
    ({"lora": {"dropout": 0.1}}, "lora.dropout=0.1 is not supported"),
    ({"lora": {"target_modules": ["wqkv"]}}, "lora.target_modules=['wqkv'] matches none"),
    ({"initialize_from_hf": None}, "initialize_from_hf is not set"),
    ({"hf_save_steps": 0}, "hf_save_steps must be a positive number of steps"),
    ({"trainer": {"quantization": {"int8": True}}}, "trainer.quantization is set, but LoRA"),
])
def test_bad_settings_are_one_error_naming_the_key(hf_llama, tmp_path, capsys, override, message):
    raw = upstream_shaped_yaml(tmp_path, hf_llama, **override)
    if override.get("lora", {}).get("target_modulez"):
        raw["lora"].pop("target_modules")
    with pytest.raises(SystemExit) as e:
        lora_lm.cli(["--config_path", write(tmp_path, raw)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("error:") == 1 and message in err, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("targets, names", [
    (["c_attn"], ["c_attn"]),
    # attn.c_proj alone: "c_proj" would also pick mlp.c_proj, so the modules are named in full
    (".*attn.*", ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_attn",
                  "transformer.h.1.attn.c_proj"]),
])
def test_gpt2_adapters_export_for_peft_over_conv1d_weights(tmp_path, targets, names):
    """GPT-2 stores its weights [in, out] (Conv1D): the adapters' tensors are still lora_A [r, in] and lora_B
    [out, r], fan_in_fan_out is true, and they reproduce our adapted model on transformers' GPT-2."""
    import equinox as eqx

    from levanter.compat import load_hf_checkpoint, save_peft_adapter
    from levanter.lora import LoraConfig, LoraLinear, loraize

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_configs()["gpt2"]).eval()
    hf.save_pretrained(tmp_path / "base")
    _, base = load_hf_checkpoint(str(tmp_path / "base"))
    lora = LoraConfig(r=2, alpha=6.0, target_modules=targets)
    adapted = loraize(base, lora, key=jax.random.PRNGKey(1))

    def bump(node):  # the adapters as training leaves them: lora_b no longer zero
        if not isinstance(node, LoraLinear):
            return node
        noise = jax.random.normal(jax.random.PRNGKey(2), node.lora_b.array.shape) * 0.2
        return eqx.tree_at(lambda n: n.lora_b, node, hax.named(noise, node.lora_b.axes))

    adapted = jax.tree.map(bump, adapted, is_leaf=lambda x: isinstance(x, LoraLinear))
    out = tmp_path / "peft"
    save_peft_adapter(adapted, lora, str(out), base_model_name_or_path=str(tmp_path / "base"))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["fan_in_fan_out"] is True and cfg["target_modules"] == names and cfg["lora_alpha"] == 6.0
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (2, 32)
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (96, 2)
    ours = our_logits(adapted)
    assert np.abs(ours - torch_logits(hf)).max() > 1e-3
    params = dict(hf.named_parameters())
    with torch.no_grad():  # by hand: Conv1D's weight is [in, out]
        for key, A in tensors.items():
            if key.endswith(".lora_A.weight"):
                module = key[len("base_model.model."):-len(".lora_A.weight")]
                B = tensors[key.replace("lora_A", "lora_B")]
                params[f"{module}.weight"].add_(torch.tensor(3.0 * (B @ A).T))
    assert np.abs(torch_logits(hf) - ours).max() < tol(1e-4)
    try:
        import peft
    except ImportError:
        return
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    loaded = peft.PeftModel.from_pretrained(fresh, str(out)).eval()
    assert np.abs(torch_logits(loaded) - ours).max() < tol(1e-4)


def test_the_memory_check_counts_gradients_and_optimizer_state_of_the_adapters_alone():
    """A model whose full training state (parameters, gradients, Adam's two moments: 4 copies) cannot fit in
    1.5 GiB fits when only its adapters train (the parameters once, plus the adapters' share)."""
    from levanter.data.config import UrlSingleDatasetLMConfig
    from levanter.lm_config import TrainLmConfig
    from levanter.lora import LoraConfig, lora_trainable, loraize
    from levanter.memory import check_memory
    from levanter.models import LlamaConfig
    from levanter.training import TrainerConfig

    config = TrainLmConfig(
        data=UrlSingleDatasetLMConfig(tokenizer="byte"),
        model=LlamaConfig(seq_len=128, hidden_dim=1024, intermediate_dim=2816, num_layers=8, num_heads=8,
                          num_kv_heads=8),
        trainer=TrainerConfig(train_batch_size=8, require_accelerator=False))
    available = (int(1.5 * 2**30), "the test's budget")
    with pytest.raises(ValueError, match=r"the model cannot fit: training needs at least 2\.\d GiB"):
        check_memory(config, 32000, available)
    check_memory(config, 32000, available, is_trainable=lora_trainable,
                 adapt=lambda m, k: loraize(m, LoraConfig(r=8), key=k))
