"""Chat-format data and ``python -m levanter.main.sft``: conversations rendered by a chat template, the loss
mask over exactly the assistant tokens (stored beside the tokens in the cache, carried by the examples),
text and chat caches of the same files kept apart, upstream's SFT keys mapped onto a train_lm run, and a
tiny fine-tuning run whose loss on the assistant tokens falls. The tokenizer and data are made here
(``tests/chat_data.py``): no network."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

from chat_data import chat_tokenizer, write_chats
from levanter.config import parse_config
from levanter.data.config import LMMixtureDatasetConfig, UrlSingleDatasetLMConfig
from levanter.data.source_config import LmDatasetFormat
from levanter.ingest import CacheMismatchError, load_tokenizer
from levanter.main import sft
from levanter.sft_config import SFTConfig, to_train_lm_config
from levanter.store import TokenCache


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("chat-tok"))


def _chat_data(tmp_path, tok_dir, *, cache_dir=None, template=None) -> UrlSingleDatasetLMConfig:
    return UrlSingleDatasetLMConfig(train_urls=[str(tmp_path / "chat.jsonl")], tokenizer=str(tok_dir),
                                    cache_dir=str(cache_dir or tmp_path / "cache"),
                                    format=LmDatasetFormat(type="chat", chat_template=template))


def _runs(mask: np.ndarray) -> list:
    """``[(start, end)]`` of the runs of ones in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def test_the_loss_mask_marks_exactly_the_assistant_tokens(tmp_path, tok_dir):
    chats = write_chats(tmp_path / "chat.jsonl", 24)
    data = _chat_data(tmp_path, tok_dir)
    cache = data.build_caches("train")
    assert cache.mask_store is not None and cache.metadata["chat"]["messages_field"] == "messages"
    tok = load_tokenizer(str(tok_dir))
    rows = cache.store.read_rows_sync(range(len(chats)))
    masks = cache.mask_store.read_rows_sync(range(len(chats)))
    for chat, ids, mask in zip(chats, rows, masks):
        assert len(ids) == len(mask)
        # The whole row is the template's rendering, then the appended EOS (not trained on).
        rendered = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in chat)
        assert tok.decode(ids) == rendered + "<|endoftext|>"
        assert ids[-1] == tok.eos_token_id and mask[-1] == 0
        # The marked tokens are exactly the assistant messages' generation spans, in order.
        spans = [tok.decode(ids[a:b]) for a, b in _runs(mask)]
        assert spans == [m["content"] + "<|end|>" for m in chat if m["role"] == "assistant"]

    # The examples' loss mask: position t predicts token t + 1, trained on iff that token is an assistant
    # token (never across an EOS, never at a window's last position); read through the planned reads.
    seq_len = 16
    ds = data._dataset(cache, seq_len)
    n = len(ds.dataset)
    (plan,) = asyncio.run(ds.plan([0], [list(range(n))]))
    from levanter.store import read_stacked

    batch = plan.finish(read_stacked(plan.views).result()).tree
    flat_ids = np.concatenate(rows)[: n * seq_len].reshape(n, seq_len)
    flat_mask = np.concatenate(masks)[: n * seq_len].reshape(n, seq_len)
    np.testing.assert_array_equal(batch["tokens"], flat_ids)
    want = np.zeros((n, seq_len), dtype=bool)
    want[:, :-1] = (flat_mask[:, 1:] == 1) & (flat_ids[:, :-1] != tok.eos_token_id)
    np.testing.assert_array_equal(batch["loss_mask"], want)
    assert want.any() and not want.all()
    got = asyncio.run(ds.get_batch(0, list(range(n)))).tree  # the unplanned read gives the same
    np.testing.assert_array_equal(got["loss_mask"], want)


def test_text_and_chat_caches_of_the_same_files_are_not_confused(tmp_path, tok_dir):
    write_chats(tmp_path / "chat.jsonl", 12, with_text=True)
    text = UrlSingleDatasetLMConfig(train_urls=[str(tmp_path / "chat.jsonl")], tokenizer=str(tok_dir),
                                    cache_dir=str(tmp_path / "cache"))
    text_cache = text.build_caches("train")
    assert text_cache.mask_store is None and "chat" not in text_cache.metadata
    assert not os.path.exists(tmp_path / "cache" / "train" / "loss_mask")
    with pytest.raises(CacheMismatchError, match="chat: cache has None"):
        _chat_data(tmp_path, tok_dir).build_caches("train")

    chat = _chat_data(tmp_path, tok_dir, cache_dir=tmp_path / "other" / "cache")
    chat_cache = chat.build_caches("train")
    assert chat_cache.mask_store is not None
    as_text = UrlSingleDatasetLMConfig(train_urls=[str(tmp_path / "chat.jsonl")], tokenizer=str(tok_dir),
                                       cache_dir=str(tmp_path / "other" / "cache"))
    with pytest.raises(CacheMismatchError, match="chat: cache has"):
        as_text.build_caches("train")
    # Reopened, each is what it was built as.
    assert TokenCache.open(str(tmp_path / "other" / "cache" / "train")).mask_store is not None
    assert TokenCache.open(str(tmp_path / "cache" / "train")).mask_store is None


def test_a_template_change_is_another_cache(tmp_path, tok_dir):
    write_chats(tmp_path / "chat.jsonl", 6)
    _chat_data(tmp_path, tok_dir).build_caches("train")
    other = "{% for m in messages %}[{{ m['role'] }}]{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    with pytest.raises(CacheMismatchError, match="chat"):
        _chat_data(tmp_path, tok_dir, template=other).build_caches("train")


SFT_YAML = """\
dataset_type: chat_jsonl
supervised_data:
  chat:
    cache_dir: {tmp}/cache/chat
    train_urls: ["{tmp}/chat.jsonl"]
  unused:
    train_urls: ["{tmp}/missing.jsonl"]
mixture_weights: {{chat: 1, unused: 0}}
mixture_block_size: 64
stop_strategy: restart
max_seq_len: 64
tokenizer: "{tok}"
messages_field: messages
input_role: user
output_role: assistant
reinit_tokens: ["<|assistant|>", "<|end|>"]
model:
  type: llama
  seq_len: 4096
  hidden_dim: 32
  intermediate_dim: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  gradient_checkpointing: false
trainer:
  num_train_steps: {steps}
  train_batch_size: 8
  require_accelerator: false
  id: sft
  log_dir: {tmp}/logs
  tracker: {{type: json}}
  checkpointer: {{base_path: {tmp}/ckpt}}
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0, lr_schedule: constant}}
"""


def test_upstream_sft_keys_map_onto_a_train_lm_run(tmp_path, tok_dir):
    path = tmp_path / "sft.yaml"
    path.write_text(SFT_YAML.format(tmp=tmp_path, tok=tok_dir, steps=10))
    cfg = to_train_lm_config(parse_config(SFTConfig, str(path)))
    assert isinstance(cfg.data, LMMixtureDatasetConfig)
    assert sorted(cfg.data.configs) == ["chat"]  # weight 0 and nothing to evaluate: never read
    assert cfg.data.train_weights == {"chat": 1}
    assert cfg.data.configs["chat"].format.type == "chat" and cfg.data.shuffle is True
    assert cfg.data.tokenizer == str(tok_dir) and cfg.model.seq_len == 64
    assert cfg.initialize_from_hf is False and cfg.hf_save_steps == 10

    single = tmp_path / "single.yaml"
    single.write_text("chat_train_urls: [a.jsonl]\nsupervised_data: {cache_dir: c}\ninitialize_from_hf: true\n"
                      "model_name_or_path: some/model\nhf_save_steps: 5\n")
    cfg = to_train_lm_config(parse_config(SFTConfig, str(single)))
    assert isinstance(cfg.data, UrlSingleDatasetLMConfig) and cfg.data.train_urls == ["a.jsonl"]
    assert cfg.data.cache_dir == "c" and cfg.data.format.messages_field == "messages"
    assert cfg.initialize_from_hf == "some/model" and cfg.use_hf_model_config and cfg.hf_save_steps == 5


@pytest.mark.devices(8)
def test_a_tiny_sft_run_learns_the_assistant_replies(tmp_path, tok_dir):
    write_chats(tmp_path / "chat.jsonl", 200)
    path = tmp_path / "sft.yaml"
    steps = 20
    path.write_text(SFT_YAML.format(tmp=tmp_path, tok=tok_dir, steps=steps))
    out = sft.main(parse_config(SFTConfig, str(path)))
    assert out["final_step"] == steps
    with open(tmp_path / "logs" / "sft" / "metrics.jsonl") as f:
        losses = {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}
    assert sorted(losses) == list(range(steps))
    # The loss is over assistant tokens only: a reply is the user's words swapped and "ok", so the model
    # learns it far below the initial ln(vocab).
    first, last = losses[0], np.mean([losses[s] for s in range(steps - 3, steps)])
    assert first > 5.0 and last < first - 3.0, (first, last)
    assert os.path.isdir(tmp_path / "cache" / "chat" / "train" / "loss_mask")


def test_reinit_tokens_redraws_exactly_those_rows(tok_dir):
    import haliax as hax
    import jax

    from levanter.models import LlamaConfig, reinit_token_rows
    from levanter.sft_config import reinit_token_ids

    cfg = LlamaConfig(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2, num_kv_heads=2, seq_len=16)
    model = cfg.build(hax.Axis("vocab", 330), key=jax.random.PRNGKey(0))
    tok = load_tokenizer(str(tok_dir))
    ids = reinit_token_ids(SFTConfig(reinit_tokens=["<|assistant|>", "<|end|>"]), tok)
    assert ids == [tok.backend.token_to_id("<|assistant|>"), tok.backend.token_to_id("<|end|>")]
    new = reinit_token_rows(model, ids, jax.random.PRNGKey(1))
    head_only = reinit_token_rows(model, ids, jax.random.PRNGKey(1), embeddings=False)
    for get in (lambda m: m.embed_tokens.weight, lambda m: m.lm_head.weight):
        before, after = np.asarray(get(model).rearrange(("vocab", ...)).array), np.asarray(get(new).rearrange(("vocab", ...)).array)
        others = np.setdiff1d(np.arange(330), ids)
        np.testing.assert_array_equal(after[others], before[others])
        assert not np.any(after[ids] == before[ids])
        # Drawn from the trained rows' spread: within 3 standard deviations (per column) of their mean.
        mu, sd = before.mean(0), before.std(0)
        assert np.all(np.abs(after[ids] - mu) <= 3 * sd + 1e-6)
    np.testing.assert_array_equal(np.asarray(head_only.embed_tokens.weight.array),
                                  np.asarray(model.embed_tokens.weight.array))
    with pytest.raises(ValueError, match=r"Llama 3's chat tokens \(reinit_tokens: true\)"):
        reinit_token_ids(SFTConfig(reinit_tokens=True), tok)


CHAT_BUILD = """
import sys
from levanter.ingest import CacheOptions, ChatSpec, build_or_load_cache, load_tokenizer
from chat_data import TEMPLATE

if __name__ == "__main__":
    out, tok, workers, shards = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    build_or_load_cache(shards, out, load_tokenizer(tok), text_key="messages", progress=False,
                        options=CacheOptions(workers, 8, min_bytes_for_pool=0), chat=ChatSpec("messages", TEMPLATE))
"""


def _chat_build(script, out, tok_dir, shards, *, workers=1, kill_at=None):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LEVANTER_FAULT_KILL_AT"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    if kill_at:
        env["LEVANTER_FAULT_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, str(script), str(out), str(tok_dir), str(workers), *map(str, shards)],
                          env=env, capture_output=True, text=True)


@pytest.mark.slow  # six builds in subprocesses (each imports transformers), one with a spawned pool
def test_a_killed_chat_build_resumes_byte_identical_and_workers_agree(tmp_path, tok_dir):
    """The mask store is committed with the tokens by the same ledger: a build killed after an append or a
    commit resumes to the bytes of an uninterrupted one, and a process pool (the chat tokenizer pickled into
    its workers) writes the same bytes as one process."""
    import signal

    from helpers import tree_bytes

    shards = [tmp_path / f"s{i}.jsonl" for i in range(2)]
    for i, s in enumerate(shards):
        write_chats(s, 40, seed=i)
    script = tmp_path / "build.py"
    script.write_text(CHAT_BUILD)
    ref = tmp_path / "ref"
    assert _chat_build(script, ref, tok_dir, shards).returncode == 0
    expected = tree_bytes(ref)
    assert any(k.startswith("loss_mask") for k in expected)
    for point in ("cache_after_append:2", "cache_after_commit:7"):
        out = tmp_path / point.replace(":", "_")
        killed = _chat_build(script, out, tok_dir, shards, kill_at=point)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        resumed = _chat_build(script, out, tok_dir, shards)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert tree_bytes(out) == expected, point
    pooled = tmp_path / "pooled"
    run = _chat_build(script, pooled, tok_dir, shards, workers=2)
    assert run.returncode == 0, run.stderr[-2000:]
    assert tree_bytes(pooled) == expected


def test_a_damaged_mask_store_is_refused(tmp_path, tok_dir):
    write_chats(tmp_path / "chat.jsonl", 6)
    cache = _chat_data(tmp_path, tok_dir).build_caches("train")
    chunk = os.path.join(cache.cache_dir, "loss_mask", "data", "c", "0")
    assert os.path.isfile(chunk)
    os.remove(chunk)
    with pytest.raises(ValueError, match="loss_mask/data/c/0 is missing"):
        TokenCache.open(cache.cache_dir)
