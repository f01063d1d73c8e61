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

from levanter.main import train_lm
from levanter.memory_plan import parse_bytes, split_plan_args

REPO = Path(__file__).resolve().parent.parent


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
    assert proc.returncode == 0, proc.stderr[-3000:]
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
