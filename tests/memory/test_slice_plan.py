"""``train_lm --dry_run --slice NAME``: the train step compiled by the TPU compiler for a named slice on
this CPU machine (levanter.memory.slice_plan), and the slice table (levanter.memory.tpu_slices).

The plans here compile one-layer nano models (seconds each); the 7B ones (config/llama2_7b.yaml) are
slow-marked subprocesses. Every test that compiles needs the TPU compiler, the libtpu wheel
(``pip install -e '.[tpu]'``): without it they skip, saying so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from levanter.memory import hlo, slice_plan, tpu_compile, tpu_slices
from levanter.main import train_lm

REPO = Path(__file__).resolve().parents[2]
NANO = str(REPO / "config/llama_nano.yaml")
ONE_LAYER = ["--model.num_layers", "1", "--model.scan_layers", "true"]

try:
    import libtpu  # noqa: F401

    _NO_LIBTPU = ""
except ImportError as e:  # pragma: no cover -- CI installs it (.ci/run)
    _NO_LIBTPU = f"libtpu cannot be imported ({e}): pip install -e '.[tpu]'"
needs_libtpu = pytest.mark.skipif(bool(_NO_LIBTPU), reason=_NO_LIBTPU or "libtpu is installed")


def _size(text: str, row: str) -> float:
    """A row's figure in bytes (``  total   7.08 MiB``)."""
    m = re.search(rf"^  {row}\s+([\d,.]+) (GiB|MiB|KiB|B)\b", text, re.M)
    assert m, f"no {row!r} row in:\n{text}"
    return float(m.group(1).replace(",", "")) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)]


def _assert_total_counts_the_runtime_reserve(out: str) -> None:
    """The total is the arguments and what the TPU runtime reserves for the temporaries, which is at most
    the compiler's temporaries (levanter.memory.tpu_reserve). The compiler's arguments are at least the
    rows above (it pads small arrays to the chip's tiles); the figures are printed to 2 decimals."""
    reserve, temp = _size(out, "runtime reserve"), _size(out, "compiled temporaries")
    assert 0 < reserve <= temp
    arguments = sum(_size(out, row) for row in ("parameters", "optimizer state", "batch"))
    assert _size(out, "total") >= 0.99 * (arguments + reserve)
    assert "(arguments + reserve: the chip's peak_bytes_in_use + peak_bytes_reserved)" in out


def _collectives(text: str, heading: str) -> dict:
    """``{kind: bytes}`` of the collectives table under ``heading``."""
    block = text.split(heading, 1)[1].split("\n")[1:]
    out = {}
    for line in block:
        m = re.match(r"  ([a-z\-]+)\s+([\d,.]+) (GiB|MiB|KiB|B)\s+\(([\d,]+) (ops|transfers)\)", line)
        if not m:
            break
        out[m.group(1)] = float(m.group(2).replace(",", "")) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10,
                                                                "B": 1}[m.group(3)]
    return out


def test_slice_names_map_to_topologies():
    v5e = tpu_slices.parse_slice("v5e-256")
    assert (v5e.topology, v5e.chips, v5e.hbm, v5e.wrap) == ("v5e:16x16", 256, 16 * 2**30, (False,) * 3)
    assert tpu_slices.parse_slice("v5litepod-8").topology == "v5e:2x4"  # Cloud's accelerator-type name
    v4 = tpu_slices.parse_slice("v4-64")  # TensorCores: 32 chips
    assert (v4.topology, v4.chips, v4.hbm, v4.wrap) == ("v4:2x4x4", 32, 32 * 2**30, (False,) * 3)
    assert v4.chip_config == "megacore"
    v5p = tpu_slices.parse_slice("v5p-128")  # a whole 4x4x4 cube: a torus
    assert (v5p.topology, v5p.chips, v5p.hbm, v5p.wrap) == ("v5p:4x4x4", 64, 95 * 2**30, (True,) * 3)
    assert tpu_slices.parse_slice("v6e-8").hbm == 32 * 2**30
    assert tpu_slices.parse_slice("v5e-1").chips_per_host_bounds() == (1, 1, 1)
    for bad in ("v5e-7", "v4-63", "v4-2", "v9-8", "v5e", "256"):
        with pytest.raises(ValueError, match="valid names: v4-"):
            tpu_slices.parse_slice(bad)
    assert "v5e-256" in tpu_slices.slice_names() and "v4-64" in tpu_slices.slice_names()


@needs_libtpu
def test_slice_devices_are_one_per_chip_in_slice_order():
    """A v4 chip's two TensorCores are one device (megacore), as a v4 run sees them; several slices come
    slice after slice (the trainer's data axis runs across them)."""
    v4 = tpu_compile.slice_devices(tpu_slices.parse_slice("v4-16"))
    assert len(v4) == 8 and {d.device_kind for d in v4} == {"TPU v4"}
    two = tpu_compile.slice_devices(tpu_slices.parse_slice("v5e-4"), num_slices=2)
    assert [d.slice_index for d in two] == [0] * 4 + [1] * 4


HLO = """\
HloModule step

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]) parameter(0)
  %x = f32[1024]{0} get-tuple-element(%p), index=1
  %ag = f32[4096]{0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %ar = f32[1024]{0} all-reduce(%x), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[1024]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  %c = s32[] constant(12)
  %p = (s32[], f32[1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %rs = bf16[256]{0} reduce-scatter(%a), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %w = (s32[], f32[1024]) while(%init), condition=%cond, body=%body
  %tok = token[] after-all()
  %s = (bf16[512]{0}, u32[], token[]) send(%rs, %tok), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="ag.1",_xla_megascale_transfer_type="ALL_GATHER"}
  %r = (bf16[1024]{0}, u32[], token[]) recv(%tok), channel_id=5, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="ag.1",_xla_megascale_transfer_type="ALL_GATHER"}
  ROOT %out = f32[1024]{0} get-tuple-element(%w), index=1
}
"""


def test_collectives_are_weighted_by_loop_trips():
    """A hand-written module: the loop body's collectives count 12 times (its condition's bound), each at
    the larger of input and output; a transfer between slices at the larger of its send and receive."""
    c = hlo.collectives(HLO)
    assert c.ici["all-gather"] == 12 * 4096 * 4 and c.ici_count["all-gather"] == 12
    assert c.ici["all-reduce"] == 12 * 1024 * 4
    assert c.ici["reduce-scatter"] == 1024 * 4 and c.ici_count["reduce-scatter"] == 1  # its f32 input
    assert c.dcn["all-gather"] == 1024 * 2 and c.dcn_count["all-gather"] == 1
    assert c.ici["all-to-all"] == c.ici["collective-permute"] == 0


@needs_libtpu
def test_plan_for_a_slice_prints_per_chip_memory_and_collectives(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train_lm.cli(["--config_path", NANO, "--dry_run", "--slice", "v5e-8", *ONE_LAYER])
    out = capsys.readouterr().out
    assert "slice plan for" in out and "v5e-8 (v5e:2x4, 8 chips of TPU v5 lite), mesh data=8 x model=1" in out
    count = int(re.search(r"\(([\d,]+) in all\)", out).group(1).replace(",", ""))
    # One layer of the nano Llama in float32 (mp: f32), sharded 8 ways over embed (FSDP); Adam twice that.
    assert 0.99 * count * 4 / 8 <= _size(out, "parameters") < 1.1 * count * 4 / 8  # printed to 2 decimals
    assert _size(out, "optimizer state") == pytest.approx(2 * _size(out, "parameters"), rel=0.05)
    _assert_total_counts_the_runtime_reserve(out)
    assert re.search(r"HBM\s+16.00 GiB\s+\(v5e HBM per chip\): fits", out)
    assert "per_device_parallelism: auto would pick 4" in out  # the whole batch: 32 / 8 chips
    # `default` is what a TPU run resolves it to: splash's Pallas kernel, per chip under shard_map.
    assert re.search(r"attention\s+splash \(model.attn_backend 'default' on a TPU\): the Pallas kernel on each "
                     r"chip's shard \(shard_map\), [1-9]\d* kernel calls", out), out
    ici = _collectives(out, "collectives per step, per chip (ICI):")
    # FSDP gathers the parameters (forward and backward) and reduces the gradients.
    assert ici.get("all-gather", 0) > _size(out, "parameters") and ici.get("reduce-scatter", 0) > 0
    assert "DCN" not in out
    assert not os.listdir(tmp_path)


@needs_libtpu
def test_one_chip_plan_compiles_the_splash_kernel_for_the_tpu(tmp_path, capsys, monkeypatch):
    """`model.attn_backend: splash` (TPU only) is planned on this CPU machine: the Pallas kernel is lowered
    and compiled for the slice's chip, with the microbatch the config fixes, in one compile."""
    monkeypatch.chdir(tmp_path)
    train_lm.cli(["--config_path", NANO, "--dry_run", "--slice", "v5e-1", *ONE_LAYER, "--model.attn_backend", "splash",
                  "--trainer.per_device_parallelism", "16"])
    out = capsys.readouterr().out
    assert "v5e-1 (v5e:1x1, 1 chip of TPU v5 lite), mesh data=1 x model=1" in out
    assert re.search(r"attention\s+splash: the Pallas kernel on the chip, [1-9]\d* kernel calls", out), out
    assert "16 sequences per chip per microbatch, 2 microbatches" in out
    assert "per_device_parallelism: 16 as configured" in out and "(1 compile, " in out
    _assert_total_counts_the_runtime_reserve(out)


@needs_libtpu
def test_two_slices_show_transfers_over_dcn(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train_lm.cli(["--config_path", NANO, "--dry_run", "--slice", "v5e-4", "--num_slices", "2", *ONE_LAYER])
    out = capsys.readouterr().out
    assert "2 x v5e-4 (v5e:2x2, 8 chips of TPU v5 lite), mesh data=8 x model=1" in out
    assert "the data axis spans the 2 slices (4 chips each), over DCN" in out
    dcn = _collectives(out, "collectives per step, per chip between slices (DCN):")
    ici = _collectives(out, "collectives per step, per chip inside a slice (ICI):")
    # The FSDP all-gathers cross the slices: a share goes over DCN, the rest stays inside each slice.
    assert dcn.get("all-gather", 0) > 0 and ici.get("all-gather", 0) > 0
    assert sum(dcn.values()) > 0


@needs_libtpu
def test_a_step_that_does_not_fit_lists_compiled_levers(tmp_path, capsys, monkeypatch):
    """2 MiB of 'HBM' per chip: the whole batch does not fit; the plan compiles a smaller microbatch and
    larger slices (the first that fits ends the search) and says which fit."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        train_lm.cli(["--config_path", NANO, "--dry_run", "--slice", "v5e-4", "--device_memory", "3MiB", *ONE_LAYER,
                      "--model.gradient_checkpointing", "true"])
    assert exit_.value.code == 3  # the plan does not fit: a launch script can gate on it
    out = capsys.readouterr().out
    assert re.search(r"HBM\s+3.00 MiB\s+\(--device_memory\): DOES NOT FIT", out)
    levers = out.split("levers (compiled)", 1)[1].split("per_device_parallelism: auto", 1)[0]
    assert "trainer.per_device_parallelism: " in levers
    slices = re.findall(r"--slice: (v5e-\d+) -> ([\d.,]+) (MiB|KiB)( \(fits\))?", levers)
    assert slices and slices[0][0] == "v5e-8"
    assert len(slices) <= slice_plan.LARGER_SLICES and all(not s[3] for s in slices[:-1])
    total = _size(out, "total")
    first = float(slices[0][1].replace(",", "")) * {"MiB": 2**20, "KiB": 2**10}[slices[0][2]]
    assert first < total  # twice the chips: less per chip (FSDP shards the state, the batch splits)
    assert re.search(r"\((\d+) compiles, ", out)


@needs_libtpu
def test_plan_without_a_tpu_prints_nothing_on_stderr_but_its_log(tmp_path):
    """On a machine without TPUs (this one) libtpu's start-up complaints stay off the terminal; and with
    JAX's persistent compilation cache set, a second plan does not stumble on the TPU executables the
    first would have stored (no client here can load them): the slice's compiles bypass the cache."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the plan forces the CPU itself
    env.update(XLA_FLAGS="", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla-cache"))
    (tmp_path / "run").mkdir()
    cmd = [sys.executable, "-m", "levanter.main.train_lm", "--config_path", NANO, "--dry_run", "--slice", "v5e-4",
           *ONE_LAYER]
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=tmp_path / "run", env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "slice plan for" in proc.stdout
        for noise in ("TPU_WORKER_HOSTNAMES", "libtpu_init_utils", "Failed to find host bounds", "Traceback",
                      "persistent compilation cache"):
            assert noise not in proc.stderr, proc.stderr
    assert not os.listdir(tmp_path / "run")


def _plan_7b(tmp_path, slice_name: str, *extra: str, status: int = 0) -> str:
    """The 7B plan's output; ``status``: the exit status expected (3: the plan does not fit)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "levanter.main.train_lm", "--config_path", str(REPO / "config/llama2_7b.yaml"),
           "--dry_run", "--slice", slice_name, "--vocab_size", "32000", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert not os.listdir(tmp_path)
    return proc.stdout


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("name,chips", [("v5e-256", 256), ("v4-64", 32)])
def test_llama2_7b_fits_the_slices_it_is_planned_for(tmp_path, name, chips):
    out = _plan_7b(tmp_path, name)
    assert f"{chips} chips" in out and "batch of 256 x 4096 tokens" in out
    count = int(re.search(r"\(([\d,]+) in all\)", out).group(1).replace(",", ""))
    assert 6.5e9 < count < 7e9  # Llama 2 7B with a 32,000 vocabulary: 6.74B
    assert _size(out, "parameters") == pytest.approx(count * 4 / chips, rel=0.05)  # float32, FSDP over all
    assert re.search(r"HBM\s+[\d.]+ GiB\s+\(v[45]e? HBM per chip\): fits", out)
    assert "per_device_parallelism: auto picks" in out
    ici = _collectives(out, "collectives per step, per chip (ICI):")
    # FSDP brings every chip the bfloat16 weights (twice with remat): as all-gathers, or on v4 partly as
    # the collective-permutes the compiler decomposes gathers into.
    assert ici.get("all-gather", 0) + ici.get("collective-permute", 0) > 2 * count


@pytest.mark.slow
@needs_libtpu
def test_llama2_7b_does_not_fit_a_v5e_8(tmp_path):
    out = _plan_7b(tmp_path, "v5e-8", status=3)
    assert "DOES NOT FIT" in out
    levers = out.split("levers (compiled)", 1)[1].split("compute:", 1)[0]
    fits = re.findall(r"--slice: (v5e-\d+) -> [\d.,]+ GiB \(fits\)", levers)
    assert fits, out
