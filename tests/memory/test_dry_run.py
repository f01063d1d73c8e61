"""``train_lm --dry_run``: the memory plan compiles the train step for abstract inputs and prints the
per-device table, without data, caches or parameters.

The fast case plans ``config/gpt2_nano.yaml`` in-process (8 simulated devices, as every test here has);
the slow one runs ``config/llama_1b.yaml`` (1.2B parameters, a 128k vocabulary, sequence 4096) as a
subprocess with 8 simulated CPU devices, which could never allocate that model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import compiler_refuses_above
from levanter.config import parse_config
from levanter.training import lm_loss_fn
from levanter.main import train_lm
from levanter.memory import DOES_NOT_FIT_EXIT_CODE, StepCompiler, parse_bytes, split_plan_args

REPO = Path(__file__).resolve().parents[2]


def _gib(text: str, row: str) -> float:
    m = re.search(rf"^  {row}\s+([\d,.]+) (GiB|MiB|KiB|B)\b", text, re.M)
    assert m, f"no {row!r} row in:\n{text}"
    scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)]
    return float(m.group(1).replace(",", "")) * scale / 2**30


@pytest.mark.devices(8)  # the plan it checks is 8 CPU devices'
def test_dry_run_gpt2_nano_prints_the_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written: no cache, no logs, no checkpoints
    # One layer of the nano model instead of four: a quarter of the compile, the same plan.
    argv = ["--config_path", str(REPO / "config/gpt2_nano.yaml"), "--dry_run", "--device_memory", "1GiB",
            "--peak_flops", "1e12", "--step_seconds", "0.1", "--model.cross_entropy_block_size", "64",
            "--model.num_layers", "1"]
    train_lm.cli(argv)
    out = capsys.readouterr().out
    assert "8 cpu devices, mesh data=8 x model=1" in out
    assert "vocabulary        257 (from the tokenizer 'byte')" in out
    assert "batch of 32 x 128 tokens" in out and "blockwise, 64 vocabulary entries per block" in out
    params = _gib(out, "parameters")
    count = int(re.search(r"\(([\d,]+) in all, float32\)", out).group(1).replace(",", ""))
    # One layer of 12 d^2 weights plus (257 + 128) x d embeddings (and LayerNorms, biases) at d = 128...
    assert 12 * 128**2 + 385 * 128 < count < 1.05 * (12 * 128**2 + 385 * 128)
    # ... in float32, sharded over the 8 devices by fsdp on the embed axis (biases without an embed axis,
    # a few thousand values, are replicated).
    assert count * 4 / 8 <= params * 2**30 < 1.1 * count * 4 / 8
    assert _gib(out, "optimizer state") == pytest.approx(2 * params, rel=0.05)  # Adam's two moments
    temps, total = _gib(out, "compiled temporaries"), _gib(out, "total")
    assert temps > 0 and total >= temps + params
    assert "fits" in out and "(--device_memory)" in out
    assert "per_device_parallelism: auto would pick 4" in out  # the whole batch (32 / 8 devices) fits
    assert re.search(r"at 0.1 s per step\s+MFU \d", out)
    assert not os.listdir(tmp_path)


@pytest.mark.devices(8)
def test_dry_run_qwen3_nano_counts_its_wider_queries(tmp_path, capsys, monkeypatch):
    """config/qwen3_nano.yaml has a head size (64) apart from hidden_dim / num_heads (32): its queries are
    4 x 64 = 256 wide over a 128-wide residual stream. The plan's parameter count and FLOPs per token are
    checked against a count by hand from the YAML's numbers (one layer, to keep the compile short)."""
    monkeypatch.chdir(tmp_path)
    argv = ["--config_path", str(REPO / "config/qwen3_nano.yaml"), "--dry_run", "--device_memory", "1GiB",
            "--peak_flops", "1e12", "--model.num_layers", "1"]
    train_lm.cli(argv)
    out = capsys.readouterr().out
    d, q, kv, mlp, vocab, seq, head = 128, 4 * 64, 2 * 64, 384, 257, 128, 64
    layer_matmuls = d * q + 2 * d * kv + q * d + 3 * d * mlp  # q, k, v, o; gate, up, down
    norms = 2 * d + 2 * head + d  # two per block, q_norm and k_norm over a head, the final one
    count = int(re.search(r"\(([\d,]+) in all, float32\)", out).group(1).replace(",", ""))
    assert count == 2 * vocab * d + layer_matmuls + norms  # embedding and untied head
    forward = 2 * layer_matmuls + 2 * 2 * seq * q + 2 * d * vocab  # + scores and weighted sum, the head
    flops = float(re.search(r"FLOPs per token\s+([\d,.e+]+)", out).group(1).replace(",", ""))
    assert flops == pytest.approx(3 * forward, rel=1e-3)  # printed to 4 significant digits
    assert not os.listdir(tmp_path)


def test_plan_flags():
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1e9") == 10**9
    argv = ["--config_path", "x.yaml", "--dry_run", "--vocab_size=128256", "--a.b", "1"]
    opts, rest = split_plan_args(argv)
    assert opts is not None and opts.vocab_size == 128256
    assert rest == ["--config_path", "x.yaml", "--a.b", "1"]
    assert split_plan_args(["--config_path", "x.yaml"]) == (None, ["--config_path", "x.yaml"])


def test_help_lists_the_plan_flags(capsys):
    with pytest.raises(SystemExit) as e:
        train_lm.cli(["--help"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in ("--dry_run", "--device_memory", "--vocab_size", "--peak_flops"):
        assert flag in out


@pytest.mark.slow
def test_dry_run_llama_1b_with_8_simulated_devices(tmp_path):
    # Compile-bound (the step of a 1B model, several microbatch sizes): compiled without LLVM's backend
    # optimizations (tests/conftest.py), which leaves the buffer sizes the plan reports unchanged.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    config = str(REPO / "config/llama_1b.yaml")
    cmd = [sys.executable, "-m", "levanter.main.train_lm", "--config_path", config,
           "--dry_run", "--vocab_size", "128256", "--device_memory", "80GiB", "--peak_flops", "989e12"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    # the step as configured does not fit: the exit status says so
    assert proc.returncode == DOES_NOT_FIT_EXIT_CODE, proc.stderr[-3000:]
    out = proc.stdout
    assert "8 cpu devices" in out and "128,256 (from --vocab_size" in out
    assert "batch of 512 x 4096 tokens" in out
    # 1.24B float32 parameters sharded 8 ways (fsdp over embed): ~0.58 GiB per device; Adam twice that.
    params = _gib(out, "parameters")
    assert 0.5 < params < 0.7
    assert _gib(out, "optimizer state") == pytest.approx(2 * params, rel=0.05)
    assert _gib(out, "total") > _gib(out, "compiled temporaries") > 0
    assert re.search(r"at 50% MFU\s+a step takes [\d.,]+ s", out)
    # 64 sequences per device at once do not fit 80 GiB: the plan names the microbatch that does, with its
    # figure (compiled like the step itself), and auto picks that one.
    assert "DOES NOT FIT" in out
    m = re.search(r"what lowers it\s+trainer\.per_device_parallelism: (\d+) -> ([\d.,]+) GiB \(fits\)", out)
    assert m, out
    assert int(m.group(1)) < 64 and float(m.group(2)) < 80 < _gib(out, "total")
    assert f"per_device_parallelism: auto would pick {m.group(1)}" in out
    assert not os.listdir(tmp_path)


# A small model whose step the compiler can be made to refuse: 32 sequences on 8 devices, 4 per device.
SMALL = """\
data: {train_urls: ["embedded://python-docs/validation"], tokenizer: byte, cache_dir: cache}
model: {type: gpt2, hidden_dim: 32, num_heads: 2, num_layers: 1, seq_len: 64, gradient_checkpointing: false}
trainer: {num_train_steps: 2, train_batch_size: 32, require_accelerator: false, id: plan, log_dir: logs}
optimizer: {learning_rate: 0.01, warmup: 0.0, weight_decay: 0.0, lr_schedule: constant}
"""


def _row(text: str, row: str) -> int:
    m = re.search(rf"^  {row}\s+([\d,.]+) (GiB|MiB|KiB|B)\b", text, re.M)
    assert m, f"no {row!r} row in:\n{text}"
    scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)]
    return int(float(m.group(1).replace(",", "")) * scale)


@pytest.mark.devices(8)
def test_a_step_the_compiler_refuses_is_planned_with_its_figure(tmp_path, capsys, monkeypatch):
    """XLA:TPU refuses to compile a step larger than the chip (RESOURCE_EXHAUSTED at compile time), with a
    message that gives the program's total and the memory it had. Simulated here with the TPU compiler's
    message over the CPU compile's own figure (tests/helpers.py): the plan shows that figure as the total, a
    positive shortfall against the compiler's capacity, and the keys that lower the step, each compiled (and
    refused or not) the same way, one of them fitting. The exit status says it does not fit."""
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(train_lm.TrainLmConfig, str(path), [])
    compiler = StepCompiler(cfg.model, cfg.trainer, cfg.optimizer.build(2), lm_loss_fn(0.0, None), 257)
    whole, one = compiler.compile().total, compiler.compile(per_device_parallelism=1).total
    capacity = (whole + one) // 2  # one sequence per device fits, four do not
    tpu = compiler_refuses_above(monkeypatch, capacity)
    # The device reports more than the compiler budgets for a program (a TPU keeps part of it back).
    with pytest.raises(SystemExit) as e:
        train_lm.cli(["--config_path", str(path), "--dry_run", "--device_memory", str(capacity + 4096)])
    assert e.value.code == DOES_NOT_FIT_EXIT_CODE
    out = capsys.readouterr().out
    assert tpu.refused[0] == whole  # the step as configured was refused
    assert "the compiler refused the step: RESOURCE_EXHAUSTED: Ran out of memory on HBM" in out
    total = _row(out, "total")
    assert total == pytest.approx(whole, rel=0.01) and "(the compiler's figure: it refused the step)" in out
    arguments = sum(_row(out, r) for r in ("parameters", "optimizer state", "batch"))
    assert _row(out, "compiled temporaries") == pytest.approx(total - arguments, rel=0.01, abs=2048)
    assert _row(out, "compiled temporaries") > 0
    m = re.search(r"device memory\s+[\d,.]+ \w+\s+"
                  r"\(as the compiler counts it; --device_memory: [\d,.]+ \w+\): "
                  r"DOES NOT FIT \(short by ([\d,.]+) (MiB|KiB|B)\), (\d+)% used", out)
    assert m, out
    short = float(m.group(1).replace(",", "")) * {"MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)]
    assert short == pytest.approx(whole - capacity, rel=0.02) and short > 0 and int(m.group(3)) > 100
    micro = re.search(r"what lowers it\s+trainer\.per_device_parallelism: (\d) -> [\d,.]+ \w+ \(fits\)", out)
    assert micro and int(micro.group(1)) < 4, out
    assert "model.gradient_checkpointing: true ->" in out
    assert "per_device_parallelism: auto would pick" in out
    assert " 0 B" not in out


@pytest.mark.slow  # a dozen compiles of the step: every microbatch, each key, all of them together
@pytest.mark.devices(8)
def test_a_step_that_nothing_makes_fit_says_how_many_devices_would(tmp_path, capsys, monkeypatch):
    """A compiler that has less than the parameters, gradients and optimizer state need: nothing the step's
    keys do fits, each alone or all together, and the plan says so and how many devices would hold them."""
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    monkeypatch.chdir(tmp_path)
    compiler_refuses_above(monkeypatch, 24 * 1024)
    with pytest.raises(SystemExit) as e:
        train_lm.cli(["--config_path", str(path), "--dry_run", "--device_memory", "1MiB"])
    assert e.value.code == DOES_NOT_FIT_EXIT_CODE
    out = capsys.readouterr().out
    assert "DOES NOT FIT (short by" in out and "auto finds no microbatch that fits" in out
    assert ("all of these together: "
            "(trainer.per_device_parallelism: 1, model.gradient_checkpointing: true) -> " in out)
    m = re.search(r"the parameters, their gradients, the optimizer state and the batch alone need ([\d.]+) KiB "
                  r"per device: no microbatch, remat policy or loss lowers that; "
                  r"at least (\d+) devices of 24.00 KiB", out)
    assert m, out
    # 23,040 float32 parameters, as many gradients and two Adam moments (and the batch): 4 x 90 KiB
    assert float(m.group(1)) > 24 and int(m.group(2)) >= 4 * 23040 * 4 // (24 * 1024)


@pytest.mark.devices(8)
def test_state_that_cannot_fit_is_refused_before_any_compile(tmp_path, capsys, monkeypatch):
    """A model or batch that the shapes alone rule out (parameters, gradients, optimizer state and the batch's
    tokens against the devices) is one error, exit 3, with nothing compiled: the 10^12-sequence batch and
    the 10^17-parameter model that used to keep the plan busy for minutes."""
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    monkeypatch.chdir(tmp_path)
    from jax._src import compiler

    real, compiled = compiler.compile_or_get_cached, []

    def compile_(backend, module, *args, **kwargs):
        compiled.append(str(module.operation.attributes["sym_name"]))
        return real(backend, module, *args, **kwargs)

    monkeypatch.setattr(compiler, "compile_or_get_cached", compile_)
    for args, fragments in (
        (["--trainer.train_batch_size", str(10**12)],
         ["the tokens of a batch of 1,000,000,000,000 x 64", "trainer.train_batch_size"]),
        (["--model.hidden_dim", str(2**20), "--model.num_layers", "10000"],
         ["131,941,", "parameters: the tokenizer's vocabulary=257, model.hidden_dim, model.num_layers"]),
    ):
        with pytest.raises(SystemExit) as e:
            train_lm.cli(["--config_path", str(path), "--dry_run", "--device_memory", "16GiB", *args])
        assert e.value.code == DOES_NOT_FIT_EXIT_CODE
        err = capsys.readouterr().err
        assert err.startswith("error: the model cannot fit") and "8 x 16.00 GiB (--device_memory)" in err, err
        for fragment in fragments:
            assert fragment in err, err
    assert not [name for name in compiled if "jit_flat" in name]  # the train step was never compiled
    assert os.listdir(tmp_path) == ["small.yaml"]


def test_a_refusal_without_a_figure_is_no_figure():
    """A compiler that refuses the step without saying how much it needs: the plan says it does not fit and
    shows no figure for the temporaries and the total (never 0 B, never a negative shortfall)."""
    from levanter.memory import MemoryPlan, format_plan

    plan = MemoryPlan(
        devices=1, platform="tpu", mesh_shape={"data": 1, "model": 1}, vocab_size=32000,
        vocab_source="--vocab_size", batch_size=8, seq_len=4096, microbatches=1, param_count=10**9,
        param_bytes=4 * 10**9, param_dtype="float32", opt_bytes=8 * 10**9, batch_bytes=8 * 4096 * 4,
        temp_bytes=None, total_bytes=None, device_memory=16 * 2**30,
        device_memory_source="--device_memory", flops_per_token=6e9, peak_flops=None, peak_source="unknown",
        step_seconds=None, loss="full logits", compiler_oom="RESOURCE_EXHAUSTED: Ran out of memory")
    text = format_plan(plan)
    assert plan.fits is False
    assert re.search(r"compiled temporaries\s+\?", text) and re.search(r"total\s+\?", text)
    assert "DOES NOT FIT (the compiler refused the step)" in text
    assert " 0 B" not in text and "short by -" not in text
