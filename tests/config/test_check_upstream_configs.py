"""``scripts/check_upstream_configs.py``: each top-level YAML of a directory read as a train_lm config (or,
by its top-level keys, as a fine-tuning config of ``levanter.main.sft`` or a LoRA config of
``levanter.main.lora_lm``) and reported as parsing, refused
(the feature named), needing a model family, or an error, with the counts.
The configs here are small ones written for the test, shaped like upstream's (``!include`` of a file in a
subdirectory, relative to the including file)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_upstream_configs.py"


def _script():
    spec = importlib.util.spec_from_file_location("check_upstream_configs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_file_is_classified_and_counted(tmp_path, capsys, monkeypatch):
    workdir = tmp_path / "work"  # the script's working directory: a check writes nothing there
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    tmp_path = tmp_path / "configs"
    tmp_path.mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "source.yaml").write_text("train_urls: [gs://bucket/train.jsonl]\ntokenizer: gpt2\n")
    (tmp_path / "ok.yaml").write_text(
        "data: !include data/source.yaml\nmodel:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n"
        "optimizer:\n  skip_bad_steps: true\n  lr_schedule: inv\n")
    (tmp_path / "muon.yaml").write_text("data: !include data/source.yaml\noptimizer:\n  type: muon\n"
                                        "  lr: 0.01\n")
    (tmp_path / "moe.yaml").write_text("model:\n  type: whisper\n")
    (tmp_path / "harness.yaml").write_text("eval_harness:\n  task_spec: [piqa]\n  max_examples: 32\n"
                                           "eval_harness_steps: 50\nmodel: {type: gpt2, hidden_dim: 32, num_heads: 4}\n")
    (tmp_path / "harness_bad.yaml").write_text("eval_harness:\n  task_spec: [piqa, piqa]\n")
    (tmp_path / "typo.yaml").write_text("trainer:\n  num_train_stepz: 3\n")
    (tmp_path / "sft_mix.yaml").write_text(
        "dataset_type: chat_jsonl\nsupervised_data:\n  a: {cache_dir: gs://b/a, train_urls: [gs://b/a.jsonl]}\n"
        "  b: {train_urls: [gs://b/b.jsonl]}\nmixture_weights: {a: 1, b: 0}\nmax_seq_len: 4096\n"
        "tokenizer: meta-llama/Llama-3.1-8B-Instruct\ninitialize_from_hf: true\nreinit_tokens: true\n"
        "model: {type: llama, seq_len: 4096}\noptimizer: {lr_schedule: linear, warmup: 0.03}\n")
    (tmp_path / "sft_hub.yaml").write_text("dataset_type: huggingface\nsupervised_data: {cache_dir: c}\n")
    (tmp_path / "lora_llama.yaml").write_text(
        "data: {tokenizer: org/llama}\ninitialize_from_hf: org/llama\npeft_save_path: lora_out\n"
        "max_train_length: 2048\ntrainer:\n  mp: p=f32,c=bfloat16\n  wandb: {project: levanter-lora}\n"
        "  num_train_steps: 5000\n  train_batch_size: -1\n  per_device_parallelism: 4\n"
        "  tensor_parallel_axes: [mlp, heads]\noptimizer: {learning_rate: 3e-4, weight_decay: 0.1}\n")
    (tmp_path / "lora_upload.yaml").write_text("initialize_from_hf: org/llama\npeft_hf_upload: me/adapters\n")
    assert _script().main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {}
    for line in lines:
        m = re.match(r"(parses|refused|needs family|error) +(\S+) *(.*)$", line)
        if m is not None:
            rows[m.group(2)] = (m.group(1), m.group(3))
    assert rows["ok.yaml"] == ("parses", "")
    assert rows["muon.yaml"][0] == "refused" and rows["muon.yaml"][1].startswith("optimizer.lr=0.01")
    assert rows["harness.yaml"] == ("parses", "")  # upstream's gpt2_nano_harness.yaml, in short
    assert rows["harness_bad.yaml"][0] == "error" and "eval_harness.task_spec names 'piqa' twice" in rows["harness_bad.yaml"][1]
    assert rows["moe.yaml"] == ("needs family", "whisper")
    assert rows["typo.yaml"][0] == "error" and "num_train_stepz" in rows["typo.yaml"][1]
    assert rows["sft_mix.yaml"] == ("parses", "")
    assert rows["sft_hub.yaml"][0] == "refused" and rows["sft_hub.yaml"][1].startswith("dataset_type='huggingface': ")
    assert rows["lora_llama.yaml"] == ("parses", "")
    assert rows["lora_upload.yaml"][0] == "refused" and rows["lora_upload.yaml"][1].startswith("peft_hf_upload")
    assert sorted(rows) == ["harness.yaml", "harness_bad.yaml", "lora_llama.yaml", "lora_upload.yaml", "moe.yaml", "muon.yaml", "ok.yaml",
                            "sft_hub.yaml", "sft_mix.yaml", "typo.yaml"]  # not data/source.yaml
    assert lines[-1] == "parses: 4, refused: 3, needs family: 1, error: 2 (of 10)"
    assert list(workdir.iterdir()) == []  # not even lora_llama.yaml's relative peft_save_path


def test_a_directory_without_configs_is_an_error(tmp_path, capsys):
    assert _script().main([str(tmp_path)]) == 2
    assert "no *.yaml files directly under" in capsys.readouterr().err
