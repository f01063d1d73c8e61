"""Hugging Face import and export (levanter.compat.hf_checkpoints, train_lm's initialize_from_hf and
hf_save_path, export_lm_to_hf), against real ``transformers`` models on CPU, offline.

Tiny random GPT-2, Llama, Qwen, Mistral, Gemma, Gemma 2 and OLMo 2 models (grouped-query and multi-query
attention, tied and untied heads, a non-default rope theta, llama3 and yarn rope scaling, Gemma heads wider and
narrower than hidden / heads, its norm offsets randomised, Gemma 2's and Mistral's windows and Gemma 2's soft caps
in play, OLMo 2's whole-projection q/k norms and post-norms perturbed away from one) are made by
``transformers`` once per module; our import must give transformers' logits on the same tokens (float32, max abs difference < 1e-4), an export must load in transformers and give ours, and
export -> import is bit-identical. One short training run serves several assertions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import haliax as hax

from accelerator import tol
from levanter.compat import load_hf_checkpoint, load_hf_config, save_hf_checkpoint
from levanter.models import (
    Gemma2Config,
    GemmaConfig,
    Gpt2Config,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
)
from levanter.models.rope import Llama3RopeConfig, YarnRopeConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 260  # >= the byte tokenizer's 257, so that train_lm can start from the Llama
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 12))


def hf_configs():
    quiet = dict(bos_token_id=0, eos_token_id=0)
    return {
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **quiet),
        "llama-gqa-untied": transformers.LlamaConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, rope_theta=5000.0, max_position_embeddings=64, rms_norm_eps=1e-5, **quiet),
        "llama-tied": transformers.LlamaConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=64, **quiet),
        # Head size 16 and these wavelength bounds put frequencies in all three llama3 bands (kept, blended,
        # divided) and a partial yarn ramp; yarn's factor also scales cos/sin (attention factor ~1.14).
        "llama-rope-llama3": transformers.LlamaConfig(
            hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=128, rope_parameters={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **quiet),
        "llama-rope-yarn": transformers.LlamaConfig(
            hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=256, rope_parameters={
                "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 64}, **quiet),
        # Multi-query, tied (Gemma 2B's shape in miniature): 4 heads of 16 on a 32-wide stream.
        "gemma-mqa-tied": transformers.GemmaConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6, **quiet),
        # Grouped-query, untied, heads narrower than hidden / heads (4 x 8 on 48), another rope theta.
        "gemma-gqa-untied": transformers.GemmaConfig(
            hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=5000.0,
            **quiet),
        # Gemma 2: three layers (sliding, full, sliding) with a window of 4 of the 12 positions, a score scale
        # other than head_dim's, and caps small enough to bend the scores and logits.
        "gemma2": transformers.Gemma2Config(
            hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, query_pre_attn_scalar=24, sliding_window=4,
            attn_logit_softcapping=2.0, final_logit_softcapping=0.5, **quiet),
        "qwen2": transformers.Qwen2Config(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, rope_theta=1e6, max_position_embeddings=64, rms_norm_eps=1e-6, **quiet),
        # head_dim 16 is not hidden_size / heads (8), as in released Qwen3 models; tied head.
        "qwen3": transformers.Qwen3Config(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=True, **quiet),
        "qwen3-bias": transformers.Qwen3Config(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, attention_bias=True, **quiet),
        # A window of 4 of the 12 positions on every layer; grouped-query heads.
        "mistral": transformers.MistralConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4, rope_theta=5000.0, **quiet),
        # The q/k norms span the whole projection (4 x 8 queries, 2 x 8 keys); OLMo 2's rope base.
        "olmo2": transformers.Olmo2Config(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=64, rope_theta=500000.0, **quiet),
        "olmo2-bias": transformers.Olmo2Config(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=VOCAB, max_position_embeddings=64, attention_bias=True, tie_word_embeddings=True, **quiet),
    }


# transformers initialises biases to zero and norm scales to one; a mapping that swapped or dropped them
# would go unseen, so these models get every parameter perturbed.
PERTURBED = ("qwen2", "qwen3", "qwen3-bias", "mistral", "olmo2", "olmo2-bias")


def torch_attention(name: str) -> dict:
    """transformers' attention for model ``name``, for building and for loading alike. Gemma 2's soft-capped
    scores need the eager path: the sdpa path ignores the cap, and releases before 5.18 pick sdpa for Gemma 2
    by default, so a reload that left the choice to transformers would compare two different models."""
    return {"attn_implementation": "eager"} if name == "gemma2" else {}


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def our_logits(model) -> np.ndarray:
    B, Pos = hax.Axis("batch", TOKENS.shape[0]), hax.Axis("position", TOKENS.shape[1])
    out = model(hax.named(jax.numpy.asarray(TOKENS), (B, Pos)))
    return np.asarray(out.rearrange((B, Pos, out.resolve_axis("vocab"))).array)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (directory of a saved random transformers model, its logits on TOKENS)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for name, cfg in hf_configs().items():
        model = transformers.AutoModelForCausalLM.from_config(cfg, **torch_attention(name)).eval()
        if name in PERTURBED:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        elif name.startswith("gemma"):
            # Gemma's norm weights start at zero (the scale is 1 + weight): random offsets make the test
            # see whether the offset is added, and added once. Gemma 2 gets every weight enlarged, so that
            # its scores and logits reach the soft caps (at transformers' 0.02 init the caps change nothing).
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if pname.endswith("norm.weight") or name == "gemma2":
                        p.add_(0.3 * torch.randn_like(p))
        model.save_pretrained(root / name)
        out[name] = (str(root / name), torch_logits(model))
    return out


@pytest.fixture(scope="module")
def imported(hf_dirs):
    return {name: load_hf_checkpoint(d) for name, (d, _) in hf_dirs.items()}


CLASSES = {"gpt2": Gpt2Config, "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma": GemmaConfig, "gemma2": Gemma2Config, "mistral": MistralConfig, "olmo2": Olmo2Config}


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied", "llama-tied", "llama-rope-llama3", "llama-rope-yarn",
                                  "qwen2", "qwen3", "qwen3-bias", "gemma-mqa-tied", "gemma-gqa-untied",
                                  "gemma2", "mistral", "olmo2", "olmo2-bias"])
def test_import_gives_transformers_logits(name, hf_dirs, imported):
    config, model = imported[name]
    assert type(config) is CLASSES[name.split("-")[0]]
    if name == "qwen2":
        assert model.layers.stacked.self_attn.q_proj.bias is not None and model.layers.stacked.self_attn.o_proj.bias is None
        assert config.rope_theta == 1e6 and config.layer_norm_epsilon == 1e-6
    if name == "qwen3":
        assert config.head_dim == 16 and config.HeadSize.size == 16 and model.lm_head is None
        assert model.layers.stacked.self_attn.q_norm is not None and model.layers.stacked.self_attn.q_proj.bias is None
    if name == "qwen3-bias":
        assert config.attention_bias and config.head_dim is None
        assert model.layers.stacked.self_attn.o_proj.bias is not None
    if name == "gemma-mqa-tied":
        assert (config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (1, 16, True)
        assert model.lm_head is None and config.activation_function == "gelu_pytorch_tanh"
        assert float(np.abs(np.asarray(model.norm.weight.array)).max()) > 0.1  # the offsets came through
    if name == "gemma-gqa-untied":
        assert (config.num_kv_heads, config.head_dim, config.rope_theta, config.tie_word_embeddings) == (
            2, 8, 5000.0, False)
        assert model.lm_head is not None
    if name == "gemma2":
        assert (config.query_pre_attn_scalar, config.sliding_window, config.attn_logit_softcapping,
                config.final_logit_softcapping) == (24, 4, 2.0, 0.5)
        assert float(np.abs(np.asarray(model.layers.stacked.post_feedforward_layernorm.weight.array)).max()) > 0.1
    if name == "mistral":
        assert (config.sliding_window, config.num_kv_heads, config.rope_theta) == (4, 2, 5000.0)
        # The window is in play: without it the same weights give other logits.
        unwindowed = dataclasses.replace(model, config=dataclasses.replace(config, sliding_window=None))
        assert np.abs(our_logits(unwindowed) - hf_dirs[name][1]).max() > 1e-2
    if name == "olmo2":
        attn = model.layers.stacked.self_attn
        assert attn.q_norm.weight.array.shape == (2, 4, 8) and attn.k_norm.weight.array.shape == (2, 2, 8)
        assert model.layers.stacked.input_layernorm is None and attn.q_proj.bias is None
        assert (config.layer_norm_epsilon, config.rope_theta) == (1e-5, 500000.0)  # transformers' OLMo 2 eps
    if name == "olmo2-bias":
        assert config.attention_bias and model.lm_head is None
        assert model.layers.stacked.self_attn.o_proj.bias is not None
    if name == "llama-gqa-untied":
        assert (config.num_kv_heads, config.rope_theta, config.tie_word_embeddings) == (2, 5000.0, False)
        assert model.lm_head is not None
    if name == "llama-tied":
        assert config.tie_word_embeddings and model.lm_head is None
    if name == "llama-rope-llama3":
        assert config.rope == Llama3RopeConfig(theta=1e4, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=64)
    if name == "llama-rope-yarn":
        assert config.rope == YarnRopeConfig(theta=100.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
                                             original_max_position_embeddings=64)
        assert config.rope.attention_scaling() > 1.1  # the cos/sin scaling is exercised
    assert jax.tree.leaves(model)[0].dtype == np.float32
    diff = np.abs(our_logits(model) - hf_dirs[name][1]).max()
    assert diff < tol(1e-4), diff


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied", "llama-rope-llama3", "llama-rope-yarn", "qwen2",
                                  "qwen3", "qwen3-bias", "gemma-mqa-tied", "gemma-gqa-untied",
                                  "gemma2", "mistral", "olmo2", "olmo2-bias"])
def test_export_loads_in_transformers_and_imports_bit_identically(name, hf_dirs, imported, tmp_path):
    config, model = imported[name]
    out = tmp_path / "out"
    # Sharded: a limit below the model's size gives several files and the index transformers reads.
    save_hf_checkpoint(model, config, str(out), max_shard_size=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / f).is_file() for f in shards)
    assert not (out / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), **torch_attention(name)).eval()
    assert np.abs(torch_logits(reloaded) - hf_dirs[name][1]).max() < 1e-4
    config2, model2 = load_hf_checkpoint(str(out))
    assert config2 == config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(model2)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # Written again over an export: replaced whole (single file now), never merged with the old shards.
    save_hf_checkpoint(model, config, str(out))
    assert sorted(p.name for p in out.iterdir()) == [".levanter-export.json", "config.json", "model.safetensors"]


def test_bfloat16_export_loads_in_transformers(hf_dirs, imported, tmp_path):
    config, model = imported["llama-tied"]
    save_hf_checkpoint(model, config, str(tmp_path / "bf16"), dtype="bfloat16")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert reloaded.dtype == torch.bfloat16
    _, ours = load_hf_checkpoint(str(tmp_path / "bf16"))
    assert np.abs(our_logits(ours) - hf_dirs["llama-tied"][1]).max() < 0.1  # bfloat16 rounding only


def test_export_to_an_object_store_commits_with_config_json_last(imported):
    """No rename on a bucket: the old config.json goes first and comes back last, stale shards are removed,
    and the directory imports bit-identically (``memory://`` takes the object-store path of fs)."""
    from levanter.utils import fs

    config, model = imported["llama-tied"]
    url = "memory://hf-export-test/run/step-1"
    save_hf_checkpoint(model, config, url, max_shard_size=40_000)
    assert "model.safetensors.index.json" in fs.listdir(url)
    save_hf_checkpoint(model, config, url)
    assert fs.listdir(url) == [".levanter-export.json", "config.json", "model.safetensors"]
    _, again = load_hf_checkpoint(url)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    fs.remove_tree("memory://hf-export-test")


def test_offline_hub_id_fails_fast_with_one_paragraph(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from levanter.utils.hub import hub_unreachable

    if hub_unreachable() is None:
        pytest.skip("the hub resolves here: this test is about machines without network")
    with pytest.raises(ValueError) as e:
        load_hf_config("some-org/some-model")
    message = str(e.value)
    assert "'some-org/some-model'" in message and "unreachable" in message and "\n" not in message


def test_config_refusals_name_the_field(tmp_path):
    def write(doc):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(doc))
        return str(d)

    llama = hf_configs()["llama-gqa-untied"].to_dict()
    with pytest.raises(ValueError, match="rope_parameters.*'longrope'"):
        load_hf_config(write({**llama, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}}))
    with pytest.raises(ValueError, match="rope_scaling.*'dynamic'"):
        load_hf_config(write({**llama, "rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}))
    with pytest.raises(ValueError, match="attention_bias"):
        load_hf_config(write({**llama, "attention_bias": True}))
    with pytest.raises(ValueError, match="model_type 't5' is not supported.*'qwen3'"):
        load_hf_config(write({**llama, "model_type": "t5"}))
    qwen = hf_configs()["qwen2"].to_dict()
    with pytest.raises(ValueError, match="field 'use_sliding_window' true"):
        load_hf_config(write({**qwen, "use_sliding_window": True}))
    with pytest.raises(ValueError, match=r"field 'layer_types' names \['sliding_attention'\]"):
        load_hf_config(write({**qwen, "layer_types": ["full_attention", "sliding_attention"]}))
    linear = load_hf_config(write({**llama, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}))
    assert linear.rope_theta_and_factor == (1e4, 2.0)
    # Older config.json spelling: rope_scaling with "type", theta at the top level, original length omitted
    # (transformers then uses max_position_embeddings).
    old = load_hf_config(write({**llama, "rope_parameters": None, "rope_theta": 5e5, "max_position_embeddings": 128,
                                "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0}}))
    assert old.rope == Llama3RopeConfig(theta=5e5, original_max_position_embeddings=128)


def test_gemma_config_json_fields(tmp_path, hf_dirs, imported):
    """What a Gemma config.json says that a Llama one does not: the legacy activation name, head_dim's own
    default, the options refused by field; and what our Gemma cannot say in one (refused on export)."""
    from levanter.compat import hf_config_to_lm, lm_to_hf_config

    gemma = hf_configs()["gemma-mqa-tied"].to_dict()
    # The original releases wrote hidden_act "gelu", meaning the tanh approximation (transformers rewrites it).
    assert hf_config_to_lm({**gemma, "hidden_act": "gelu"})[0].activation_function == "gelu_pytorch_tanh"
    # Older transformers read hidden_activation before hidden_act.
    assert hf_config_to_lm({**gemma, "hidden_activation": "gelu_new"})[0].activation_function == "gelu_new"
    # Without head_dim, transformers' default (256) applies, not hidden_size / num_attention_heads.
    assert hf_config_to_lm({k: v for k, v in gemma.items() if k != "head_dim"})[0].head_dim == 256
    with pytest.raises(ValueError, match="'attention_bias' true"):
        hf_config_to_lm({**gemma, "attention_bias": True})
    with pytest.raises(ValueError, match="'use_bidirectional_attention' true"):
        hf_config_to_lm({**gemma, "use_bidirectional_attention": True})
    config, _ = imported["gemma-mqa-tied"]
    doc = lm_to_hf_config(config, VOCAB)
    assert (doc["model_type"], doc["head_dim"], doc["hidden_act"], doc["hidden_activation"]) == (
        "gemma", 16, "gelu_pytorch_tanh", "gelu_pytorch_tanh")
    assert hf_config_to_lm(doc)[0] == config  # the document maps back to the same config
    for change, fragment in [({"activation_function": "gelu"}, "'gelu' \\(exact\\)"),
                             ({"norm_embeddings": False}, "model.norm_embeddings false"),
                             ({"use_bias": True}, "model.use_bias true")]:
        with pytest.raises(ValueError, match=fragment):
            lm_to_hf_config(dataclasses.replace(config, **change), VOCAB)


def test_gemma2_config_json_fields(imported):
    from levanter.compat import hf_config_to_lm, lm_to_hf_config

    config, _ = imported["gemma2"]
    doc = lm_to_hf_config(config, VOCAB)
    assert (doc["model_type"], doc["architectures"], doc["layer_types"]) == (
        "gemma2", ["Gemma2ForCausalLM"], ["sliding_attention", "full_attention", "sliding_attention"])
    assert hf_config_to_lm(doc)[0] == config
    # null caps and window are transformers' "off"
    off = hf_config_to_lm({**doc, "sliding_window": None, "attn_logit_softcapping": None})[0]
    assert off.sliding_window is None and off.attn_logit_softcapping is None
    with pytest.raises(ValueError, match="'layer_types'"):
        hf_config_to_lm({**doc, "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="'sliding_window' must be a positive number"):
        hf_config_to_lm({**doc, "sliding_window": 0})


def test_gemma_run_config_takes_the_checkpoint_shape(hf_dirs):
    from levanter.compat import merge_hf_model_config

    path = hf_dirs["gemma-gqa-untied"][0]
    merged, vocab = merge_hf_model_config(GemmaConfig(seq_len=16, attn_backend="vanilla"), path)
    assert (merged.hidden_dim, merged.head_dim, merged.num_kv_heads, merged.tie_word_embeddings) == (48, 8, 2, False)
    assert (merged.seq_len, merged.attn_backend, vocab) == (16, "vanilla", VOCAB)
    with pytest.raises(ValueError, match="model.head_dim=32 disagrees"):
        merge_hf_model_config(GemmaConfig(seq_len=16, head_dim=32), path)
    with pytest.raises(ValueError, match="is a gemma checkpoint but model.type is llama"):
        merge_hf_model_config(LlamaConfig(seq_len=16), path)


@pytest.fixture(scope="module")
def trained(hf_dirs, tmp_path_factory):
    """One train_lm run from the untied GQA Llama (byte tokenizer, embedded corpus), exporting at steps 2 and 3."""
    from levanter.checkpoint import CheckpointerConfig, CheckpointInterval
    from levanter.data.config import UrlSingleDatasetLMConfig
    from levanter.main import train_lm
    from levanter.optim import AdamConfig
    from levanter.tracker import JsonConfig
    from levanter.training import TrainerConfig

    tmp = tmp_path_factory.mktemp("hf-train")
    config = train_lm.TrainLmConfig(
        data=UrlSingleDatasetLMConfig(train_urls=["embedded://python-docs/validation"], tokenizer="byte",
                                      cache_dir=str(tmp / "cache")),
        # Shape keys left at their defaults: they come from the checkpoint; the run settings are the YAML's.
        model=LlamaConfig(seq_len=32, gradient_checkpointing=False, scan_layers=False),
        trainer=TrainerConfig(num_train_steps=3, train_batch_size=8, require_accelerator=False, id="hf", mp="f32",
                              log_dir=str(tmp / "logs"), tracker=JsonConfig(), steps_per_eval=100,
                              checkpointer=CheckpointerConfig(base_path=str(tmp / "ckpt"),
                                                              keep=[CheckpointInterval(every=100)])),
        optimizer=AdamConfig(learning_rate=1e-4, warmup=0.0, weight_decay=0.0, lr_schedule="constant"),
        initialize_from_hf=hf_dirs["llama-gqa-untied"][0],
        hf_save_path=str(tmp / "hf-out"),
        hf_save_steps=2,
        prefetch_depth=2,
    )
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("levanter")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # the INFO lines reach the handler whatever the root logger's level
    try:
        summary = train_lm.main(config)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return tmp, {**summary, "log": records}


@pytest.mark.slow
def test_training_starts_from_the_hf_weights_and_exports_what_it_trained(trained, hf_dirs, imported, tmp_path):
    from levanter.checkpoint import read_checkpoint_metadata
    from levanter.main import export_lm_to_hf

    tmp, summary = trained
    assert summary["final_step"] == 3
    # it says what it loaded, as initialize_from_checkpoint_path does
    hf_dir = hf_dirs["llama-gqa-untied"][0]
    assert f"loaded the weights of Hugging Face checkpoint {hf_dir} (the optimizer starts fresh)" in summary["log"]
    exports = tmp / "hf-out" / "hf"
    assert sorted(p.name for p in exports.iterdir()) == ["step-2", "step-3"]
    _, start = imported["llama-gqa-untied"]
    config3, step3 = load_hf_checkpoint(str(exports / "step-3"))
    assert (config3.num_kv_heads, config3.rope_theta, config3.hidden_dim) == (2, 5000.0, 32)
    # Three Adam steps of 1e-4 move each weight by at most ~3e-4 from where it started: the run began from
    # the checkpoint's weights (another initialisation would differ by ~0.05), and trained them.
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(step3))]
    assert max(moved) < 2e-3 and max(moved) > 0
    # The export loads in transformers and computes what our model computes.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(exports / "step-3")).eval()
    assert np.abs(torch_logits(reloaded) - our_logits(step3)).max() < tol(1e-4)
    # The checkpoint records its model; export_lm_to_hf needs nothing else and writes the same weights.
    ckpt = tmp / "ckpt" / "hf" / "step-3"
    record = read_checkpoint_metadata(str(ckpt))["metadata"]
    assert record["model"]["type"] == "llama" and record["vocab_size"] == VOCAB
    assert record["initialized_from"] == {"hf_checkpoint": hf_dirs["llama-gqa-untied"][0]}
    export_lm_to_hf.cli(["--checkpoint_path", str(tmp / "ckpt" / "hf"), "--output_dir", str(tmp_path / "x")])
    _, again = load_hf_checkpoint(str(tmp_path / "x"))
    # From the command line: levanter's lines on the console, every record in logs/export_lm_to_hf/debug.log.
    from test_command_logs import check_console_and_debug_log

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "levanter.main.export_lm_to_hf", "--checkpoint_path",
                        str(tmp / "ckpt" / "hf"), "--output_dir", "y"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "y" / "model.safetensors").read_bytes() == (tmp_path / "x" / "model.safetensors").read_bytes()
    check_console_and_debug_log(r.stderr, r.stdout, tmp_path / "logs" / "export_lm_to_hf" / "debug.log")
    for a, b in zip(jax.tree.leaves(step3), jax.tree.leaves(again)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert (tmp_path / "x" / "model.safetensors").read_bytes() == (exports / "step-3" / "model.safetensors").read_bytes()


def test_run_model_keys_that_disagree_with_the_checkpoint_are_refused(hf_dirs):
    from levanter.compat import merge_hf_model_config

    path = hf_dirs["gpt2"][0]
    merged, vocab = merge_hf_model_config(Gpt2Config(seq_len=16, attn_backend="vanilla"), path)
    assert (merged.hidden_dim, merged.num_layers, merged.seq_len, merged.attn_backend, vocab) == (32, 2, 16, "vanilla", VOCAB)
    with pytest.raises(ValueError, match="model.hidden_dim=48 disagrees"):
        merge_hf_model_config(Gpt2Config(seq_len=16, hidden_dim=48, num_heads=4), path)
    with pytest.raises(ValueError, match="model.type is llama"):
        merge_hf_model_config(LlamaConfig(seq_len=16), path)
    assert merge_hf_model_config(Gpt2Config(seq_len=16, hidden_dim=48, num_heads=4), path,
                                 use_hf_model_config=True)[0].hidden_dim == 32
    with pytest.raises(ValueError, match="exceeds the 64 learned positions"):
        merge_hf_model_config(Gpt2Config(seq_len=128), path)
    assert os.path.isdir(path)


def test_qwen_merge_takes_the_shape_and_refuses_another_type(hf_dirs):
    from levanter.compat import merge_hf_model_config

    run = Qwen3Config(seq_len=32, scan_layers=False)
    merged, vocab = merge_hf_model_config(run, hf_dirs["qwen3"][0])
    assert (type(merged), merged.head_dim, merged.hidden_dim, merged.num_kv_heads) == (Qwen3Config, 16, 32, 2)
    assert (merged.seq_len, merged.scan_layers, vocab) == (32, False, VOCAB)
    with pytest.raises(ValueError, match="is a qwen3 checkpoint but model.type is llama"):
        merge_hf_model_config(LlamaConfig(seq_len=32), hf_dirs["qwen3"][0])
    with pytest.raises(ValueError, match="model.head_dim=8 disagrees"):
        merge_hf_model_config(Qwen3Config(seq_len=32, head_dim=8), hf_dirs["qwen3"][0])


def test_an_exporter_writes_each_due_step_once(tmp_path):
    """``hf_save_steps`` 2 of a 5-step run: steps 2, 4 and the last; a step asked twice (a SIGTERM's forced save
    after the step's own) is written once."""
    from levanter.compat.hf_checkpoints import HfExporter

    config = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    model = config.build(hax.Axis("vocab", 64), key=jax.random.PRNGKey(0))
    exporter = HfExporter(str(tmp_path / "hf"), every=2, last_step=5, config=config)
    written = []
    for step in (1, 2, 2, 3, 4, 5, 5):
        exporter.on_step(model, step)
        written.append(sorted((p.parent.name, p.stat().st_mtime_ns) for p in (tmp_path / "hf").glob("step-*/config.json")))
    assert exporter.exported == [str(tmp_path / "hf" / f"step-{s}") for s in (2, 4, 5)]
    assert [name for name, _ in written[-1]] == ["step-2", "step-4", "step-5"]
    assert written[2] == written[1] and written[6] == written[5]  # the second call for a step wrote nothing
