"""lm-evaluation-harness on levanter models (levanter.eval_harness, levanter.main.eval_harness): during training
and after, checked against the harness's own Hugging Face backend on the same weights.

One tiny GPT-2 run (learned absolute positions: the packed requests must each read positions from 0) with a
small byte-level BPE tokenizer is trained once for the module, with upstream's ``gpt2_nano_harness.yaml``
keys and the shipped offline tasks in place of MMLU; its checkpoint is exported with ``export_lm_to_hf`` and
scored by ``lm_eval.models.huggingface.HFLM`` (torch, CPU) through ``lm_eval.simple_evaluate``.

Every test needs ``lm-eval`` (the ``eval`` extra) and skips, saying so, without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]'")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TASKS = ["levanter_mc", "levanter_ppl"]

# Upstream's config/gpt2_nano_harness.yaml, with local data (a two-stage curriculum) and the shipped tasks in
# place of the Hub's (wikitext, MMLU), the run shortened and the model's sequence shortened to 64 tokens.
NANO_HARNESS = """\
eval_harness:
  task_spec:
    - levanter_mc
    - task: levanter_mc
      task_alias: levanter_mc_1shot
      num_fewshot: 1
    - levanter_ppl
  max_examples: 32
  log_samples: true
eval_harness_steps: 2
data:
  tokenizer: {tok}
  cache_dir: {tmp}/cache
  mixture_block_size: null
  configs:
    prose: {{train_urls: ["embedded://python-docs/validation"]}}
    code: {{train_urls: ["embedded://python-code/validation"]}}
  train_weights:  # a curriculum: its second stage starts at step 1
    - [0, {{prose: 1.0, code: 0.0}}]
    - [1, {{prose: 0.5, code: 0.5}}]
model:
  type: gpt2
  hidden_dim: 32
  num_heads: 4
  num_layers: 2
  seq_len: 64
  gradient_checkpointing: false
trainer:
  mp: f32
  num_train_steps: 3
  id: nano
  require_accelerator: false
  log_dir: {tmp}/logs
  tracker: {{type: json}}
  checkpointer:
    base_path: {tmp}/ckpt
    keep:
      - every: 50
    save_interval: 5m
  per_device_parallelism: -1
  train_batch_size: 8
  tensor_parallel_axes: ["mlp", "heads"]
  fsdp_axis: "embed"
  batch_axis: "batch"
optimizer: {{learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0, lr_schedule: constant}}
"""


def make_tokenizer(directory: Path) -> str:
    from levanter.eval_harness import SHIPPED_TASKS_DIR
    from levanter.ingest import train_bpe

    texts = []
    for name in os.listdir(SHIPPED_TASKS_DIR):
        if name.endswith(".jsonl"):
            texts += Path(SHIPPED_TASKS_DIR, name).read_text().splitlines()
    train_bpe(texts * 4, 320, str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from levanter.config import parse_config
    from levanter.main import train_lm

    tmp = tmp_path_factory.mktemp("harness")
    tok = make_tokenizer(tmp / "tok")
    (tmp / "nano.yaml").write_text(NANO_HARNESS.format(tmp=tmp, tok=tok))
    cfg = parse_config(train_lm.TrainLmConfig, str(tmp / "nano.yaml"))
    assert train_lm.main(cfg)["final_step"] == 3
    return tmp, cfg


def rows(tmp: Path, run_id: str):
    with open(tmp / "logs" / run_id / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_training_logs_the_tasks_at_their_steps_and_the_end(trained):
    tmp, _ = trained
    logged = {r["step"]: r for r in rows(tmp, "nano") if "lm_eval/levanter_mc/acc" in r}
    # before the curriculum's second stage (1), every eval_harness_steps (2) and at the end (3)
    assert sorted(logged) == [1, 2, 3]
    for step, r in logged.items():
        for key in ("lm_eval/levanter_mc/acc", "lm_eval/levanter_mc/acc_norm", "lm_eval/levanter_mc_1shot/acc",
                    "lm_eval/levanter_ppl/bits_per_byte", "lm_eval/levanter_ppl/word_perplexity",
                    "lm_eval/averages/macro_avg_acc"):
            assert np.isfinite(r[key]), (step, key)
        report = json.loads((tmp / "logs" / "nano" / f"lm_eval_harness_results.{step}.json").read_text())
        assert report["results"]["levanter_mc"]["acc,none"] == r["lm_eval/levanter_mc/acc"]
        assert report["n-shot"]["levanter_mc_1shot"] == 1 and report["n-shot"]["levanter_mc"] == 0
        assert report["n-samples"]["levanter_mc"]["effective"] == 16  # every document (max_examples: 32)


def hf_reference(export_dir: Path, length: int, tasks, **kw):
    """The harness's own Hugging Face backend on the exported weights, through its simple_evaluate."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from levanter.eval_harness import SHIPPED_TASKS_DIR

    hf = HFLM(pretrained=str(export_dir), max_length=length, batch_size=4, device="cpu", dtype="float32")
    return simple_evaluate(model=hf, tasks=tasks, bootstrap_iters=0, log_samples=True,
                           task_manager=TaskManager(include_path=SHIPPED_TASKS_DIR, include_defaults=False), **kw)


def responses(report, task):
    """``{(doc_id, request index): (log-likelihood, greedy or None)}`` of a report's logged samples."""
    out = {}
    for sample in report["samples"][task]:
        for i, resp in enumerate(sample["resps"]):
            value = resp[0]
            ll, greedy = (value[0], value[1]) if isinstance(value, (list, tuple)) else (value, None)
            out[(sample["doc_id"], i)] = (float(ll), greedy)
    return out


def test_scores_equal_the_harness_hugging_face_backend(trained, tmp_path, capsys):
    from levanter.eval_harness import LmEvalHarnessConfig, TaskConfig
    from levanter.main import eval_harness, export_lm_to_hf

    tmp, cfg = trained
    export = tmp_path / "hf"
    export_lm_to_hf.main(export_lm_to_hf.ExportLmConfig(checkpoint_path=str(tmp / "ckpt" / "nano"),
                                                        output_dir=str(export)))
    spec = ["levanter_mc", TaskConfig(task="levanter_mc", task_alias="levanter_mc_1shot", num_fewshot=1),
            "levanter_ppl"]
    harness = LmEvalHarnessConfig(task_spec=spec, log_samples=True)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields.update(eval_harness=harness, trainer=_replace(cfg.trainer, log_dir=str(tmp_path / "logs")))
    ours = eval_harness.main(eval_harness.EvalHarnessMainConfig(**fields, checkpoint_path=str(tmp / "ckpt" / "nano")))
    out = capsys.readouterr().out
    assert "|levanter_mc" in out and "acc_norm" in out  # the harness's table
    assert (tmp_path / "logs" / "nano-eval_harness" / "lm_eval_harness_results.3.json").exists()

    ref = hf_reference(export, 64, ["levanter_mc", "levanter_ppl"])
    ref_1shot = hf_reference(export, 64, ["levanter_mc"], num_fewshot=1)
    for task, theirs in (("levanter_mc", ref), ("levanter_ppl", ref), ("levanter_mc_1shot", ref_1shot)):
        mine = responses(ours, task)
        other = responses(theirs, task.replace("_1shot", ""))
        assert sorted(mine) == sorted(other) and mine
        for key, (ll, greedy) in other.items():
            assert mine[key][0] == pytest.approx(ll, rel=1e-4), (task, key)
            assert mine[key][1] == greedy, (task, key)
        for metric, value in theirs["results"][task.replace("_1shot", "")].items():
            if isinstance(value, float) and metric.startswith("acc"):  # accuracies to 4 decimals
                assert round(ours["results"][task][metric], 4) == round(value, 4), (task, metric)
            elif isinstance(value, float):  # perplexities and bits per byte to 4 significant digits
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-4), (task, metric)

    # The checkpoint's step-3 scores are what training logged at step 3.
    logged = {r["step"]: r for r in rows(tmp, "nano") if "lm_eval/levanter_mc/acc" in r}[3]
    assert logged["lm_eval/levanter_ppl/bits_per_byte"] == pytest.approx(
        ours["results"]["levanter_ppl"]["bits_per_byte,none"], rel=1e-6)

    # The export, read back as a Hugging Face checkpoint (upstream's checkpoint_is_hf, the same as
    # initialize_from_hf), scores the same.
    fields.update(eval_harness=LmEvalHarnessConfig(task_spec=["levanter_ppl"]),
                  trainer=_replace(cfg.trainer, log_dir=str(tmp_path / "logs-hf"), id="from-hf"))
    from_hf = eval_harness.main(eval_harness.EvalHarnessMainConfig(**fields, checkpoint_path=str(export),
                                                                   checkpoint_is_hf=True))
    assert from_hf["results"]["levanter_ppl"]["bits_per_byte,none"] == pytest.approx(
        ours["results"]["levanter_ppl"]["bits_per_byte,none"], rel=1e-5)


def _replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def write_task(directory: Path, name: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(body)
    return directory


def test_a_generation_task_is_refused_by_name_before_anything_runs(tmp_path):
    from levanter.eval_harness import HarnessEvaluator, LmEvalHarnessConfig

    (tmp_path / "qa.jsonl").write_text('{"q": "2+2?", "a": "4"}\n')
    tasks = write_task(tmp_path / "tasks", "local_qa", f"""\
task: local_qa
dataset_path: json
dataset_kwargs: {{data_files: {{test: {tmp_path / 'qa.jsonl'}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
metric_list: [{{metric: exact_match}}]
""")
    config = LmEvalHarnessConfig(task_spec=["levanter_mc", "local_qa"], include_path=[str(tasks)])
    with pytest.raises(ValueError, match=r"eval_harness.task_spec.1: task 'local_qa' generates text"):
        HarnessEvaluator(config)


def test_a_hub_task_offline_is_one_error_naming_it_and_the_fix(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    from levanter.eval_harness import HarnessEvaluator, LmEvalHarnessConfig

    # HF_HUB_OFFLINE=1, as the libraries read it at import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tasks = write_task(tmp_path / "tasks", "hub_mc", """\
task: hub_mc
dataset_path: someone/some_dataset_that_is_only_on_the_hub
test_split: test
output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list: [{metric: acc}]
""")
    config = LmEvalHarnessConfig(task_spec=["levanter_ppl", "hub_mc"], include_path=[str(tasks)])
    with pytest.raises(ValueError) as e:
        HarnessEvaluator(config)
    message = str(e.value)
    assert message.startswith("eval_harness.task_spec.1: task 'hub_mc' reads its data from the Hugging Face Hub")
    assert "add that directory to eval_harness.include_path" in message


# -- one process and two agree --------------------------------------------------------------------------------

EVAL_CONFIG = """\
eval_harness: {{task_spec: [levanter_mc, levanter_ppl], max_examples: 32, log_samples: true}}
model: {{type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 2, seq_len: 64, gradient_checkpointing: false}}
trainer:
  id: {run_id}
  require_accelerator: false
  per_device_eval_parallelism: 1
  log_dir: {logs}
  tracker: {{type: json}}
"""


def xla_flags(devices: int) -> str:
    """This process's XLA flags (tests/conftest.py's compile level among them) with ``devices`` CPU devices."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])


def launch_eval(tmp: Path, run_id: str, processes: int, devices: int, checkpoint: Path) -> dict:
    """``python -m levanter.main.eval_harness`` on ``checkpoint`` in ``processes`` processes of ``devices``
    devices each; returns the report process 0 wrote."""
    from test_multihost import free_port

    config = tmp / f"{run_id}.yaml"
    config.write_text(EVAL_CONFIG.format(run_id=run_id, logs=tmp / "logs"))
    port = free_port()
    procs = []
    for pid in range(processes):
        env = {**os.environ, "XLA_FLAGS": xla_flags(devices), "PYTHONPATH": str(REPO / "src")}
        args = [sys.executable, "-m", "levanter.main.eval_harness", "--config_path", str(config),
                "--checkpoint_path", str(checkpoint)]
        if processes > 1:
            args += ["--trainer.distributed.coordinator_address", f"127.0.0.1:{port}",
                     "--trainer.distributed.num_processes", str(processes), "--trainer.distributed.process_id",
                     str(pid), "--trainer.distributed.initialization_timeout", "60"]
        procs.append(subprocess.Popen(args, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.time() + 400
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
    return json.loads((tmp / "logs" / f"{run_id}-eval_harness" / "lm_eval_harness_results.3.json").read_text())


@pytest.mark.sockets  # a jax.distributed coordinator on 127.0.0.1
def test_two_processes_score_what_one_process_scores(trained, tmp_path):
    """The training run (one process of 8 devices, 8 rows a batch) scored its step-3 model; two processes of
    two devices each (4 rows a batch; every process packs the same rows and takes part in every batch) score
    the checkpoint identically: every request's log-likelihood and greedy flag bit for bit, and so every
    metric. Exact because no log-probability is a sum of per-device parts (levanter.eval_harness.scoring:
    each device scores the rows it holds with the whole output projection) and each device holds one row in
    both runs, so every device computes its rows the same way (with two rows a device, CPU matmuls over
    other shapes may round differently)."""
    tmp, _ = trained
    one = json.loads((tmp / "logs" / "nano" / "lm_eval_harness_results.3.json").read_text())
    two = launch_eval(tmp_path, "two", 2, 2, tmp / "ckpt" / "nano")
    for task in TASKS:
        mine = responses(two, task)
        assert mine and mine == responses(one, task), task
        numbers = {k: v for k, v in one["results"][task].items() if isinstance(v, float)}
        assert numbers and numbers == {k: v for k, v in two["results"][task].items() if isinstance(v, float)}
