"""The benchmark suite's JSON contract (scripts/bench/run_all.py): the headline keys are always present,
null where a section was not measured, and taken from the right figures when it was."""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "bench")
KEYS = {
    "loader_tokens_per_s", "raw_read_tokens_per_s", "upstream_loader_tokens_per_s", "ttfb_step0_s",
    "ttfb_step1e9_s", "data_wait_p99_s", "train_step_s", "upstream_train_step_s", "object_store_wait_fraction",
}
# The loss section (scripts/bench/loss.py).
KEYS |= {"loss_blockwise_temp_ratio", "loss_blockwise_time_ratio", "llama_vanilla_over_flash_memory"}
# The attention section (scripts/bench/attention.py).
KEYS |= {"attention_flash_temp_ratio", "attention_flash_time_ratio"}
# The checkpoint section (scripts/bench/checkpoint_block.py).
KEYS |= {"checkpoint_block_ratio"}
# The input hash section (scripts/bench/input_hash.py).
KEYS |= {"input_hash_gb_per_s"}


@pytest.fixture(scope="module")
def run_all():
    sys.path.insert(0, BENCH)
    try:
        import run_all

        yield run_all
    finally:
        sys.path.remove(BENCH)


def test_headline_keys_are_null_when_nothing_was_measured(run_all, capsys):
    assert run_all.report({}) == {k: None for k in KEYS}


def test_headline_keys_come_from_the_measured_sections(run_all, capsys):
    s = run_all.stats
    out = {
        "loader": {"64x1024": {"batch": 64, "seq_len": 1024, "batches": 3, "loader": s([3.0, 1.0, 2.0]),
                               "prefetch0": s([1.0]), "raw": s([4.0, 5.0, 6.0]), "loader_over_raw": s([0.5]),
                               "raw_in_flight8": s([9.0])}},
        "upstream_loader": {"throughput": {"64x1024": s([0.25])}, "ttfb_64": {}},
        "ttfb": {64: {"steps": {"0": s([0.01, 0.03, 0.02]), str(10**9): s([0.02])}, "build": s([0.001])}},
        "stalls": {"batch": 8, "seq_len": 1024, "steps": 3, "step_seconds": 0.01, "p50_s": 0.0, "p99_s": 0.004,
                   "max_s": 0.005, "first_step_wait_s": 0.1, "spikes": 0, "first_spike_step": None,
                   "last_spike_step": None, "spike_wait_s": 0.0, "total_wait_s": 0.11, "wait_fraction": 0.001},
    }
    head = run_all.report(out)
    assert set(head) == KEYS
    assert head["loader_tokens_per_s"] == 2.0 and head["raw_read_tokens_per_s"] == 5.0
    assert head["upstream_loader_tokens_per_s"] == 0.25
    assert head["ttfb_step0_s"] == 0.02 and head["ttfb_step1e9_s"] == 0.02
    assert head["data_wait_p99_s"] == 0.004
    assert head["train_step_s"] is None and head["upstream_train_step_s"] is None
    printed = capsys.readouterr().out
    assert "64x1024" in printed and "8.0x" in printed  # ours / upstream = 2.0 / 0.25


def test_object_store_row_is_reported(run_all, capsys):
    def store(tok_s, wait, requests):
        return {"steps": 4, "step_seconds": 0.3, "batch": 64, "seq_len": 1024, "first_wait_s": 0.2,
                "startup_wait_s": 1.0, "mean_wait_s": wait, "p50_wait_s": wait, "p99_wait_s": wait,
                "max_wait_s": wait, "wait_fraction": wait / 0.3, "wait_fraction_with_step1": 0.5, "elapsed_s": 1.5,
                "requests_per_step": requests, "tokens_per_s": tok_s}

    out = {"object_store": {"local": store(4e6, 0.0003, None), "s3": store(2e6, 0.0006, 3.25), "objects": 99,
                            "delay_s": [0.02, 0.05], "fail_fraction": 0.0, "tokens": 1000,
                            "s3_over_local_tokens_per_s": 0.5}}
    head = run_all.report(out)
    assert head["object_store_wait_fraction"] == 0.002
    printed = capsys.readouterr().out
    assert "+20-50 ms" in printed and "0.50x" in printed and "3.2" in printed and "99 objects" in printed


def test_attention_row_is_reported(run_all, capsys):
    def backend(temp, step):
        return {"temp_bytes": temp, "compile_s": 1.0, "step_s": step, "step_s_all": [step]}

    out = {"attention": {"config": {"seq_len": 4096, "heads": 8, "head_size": 64, "batch": 1, "block": 512,
                                    "repeats": 1},
                         "platform": "cpu", "vanilla": backend(2**30, 2.0), "jax_flash": backend(2**27, 1.0),
                         "temp_ratio": 0.125, "time_ratio": 0.5}}
    head = run_all.report(out)
    assert head["attention_flash_temp_ratio"] == 0.125 and head["attention_flash_time_ratio"] == 0.5
    printed = capsys.readouterr().out
    assert "1024.0" in printed and "128.0" in printed and "0.125x" in printed


def test_checkpoint_section_measures_both_modes_and_is_reported(run_all, capsys):
    """A real, tiny run of scripts/bench/checkpoint_block.py: both modes timed, the background save reloads
    bit for bit, and the row and the headline ratio come out of it."""
    import checkpoint_block

    res = checkpoint_block.run({"params": 2e5, "repeats": 1}, verify=True)
    assert res["verified_bit_for_bit"] is True
    assert res["state_bytes"] >= 3 * 4 * 2e5 and res["storage"] == "local disk"
    assert 0 < res["async_block_s"] <= res["async_total_s"] and res["sync_block_s"] > 0
    assert res["block_ratio"] == res["async_block_s"] / res["sync_block_s"]
    head = run_all.report({"checkpoint": res})
    assert head["checkpoint_block_ratio"] == res["block_ratio"]
    printed = capsys.readouterr().out
    assert "Checkpoint save" in printed and "background / synchronous blocking" in printed


def test_checkpoint_loop_summary_counts_the_steps_around_each_save():
    """scripts/bench/checkpoint_loop.py's arithmetic on a run's step times: the steady step leaves out the
    three steps around each background save, the loss per save is their excess over three steady steps (less
    the verification's fingerprint time), the first save is a warm-up left out of the medians, each policy
    has its median and its ratio over the final synchronous save's time, and the dispatch column is the
    longest call of the two steps after a save."""
    sys.path.insert(0, BENCH)
    import checkpoint_loop

    times = {s: 1.0 for s in range(32)}
    times[0] = 30.0  # the compile: left out by skip
    times.update({7: 1.5, 8: 3.0, 9: 1.0, 15: 1.0, 16: 2.0, 17: 1.5, 23: 1.0, 24: 3.5, 25: 2.0})
    records = [{"step": 8, "policy": "auto", "copy": "device+pinned", "blocked_s": 0.1, "waited_s": 0.0,
                "write_s": 4.0},
               {"step": 16, "policy": "auto", "copy": "pinned", "blocked_s": 0.1, "waited_s": 0.0, "write_s": 4.0,
                "fingerprint_s": 0.25},
               {"step": 24, "policy": "host", "copy": "host", "blocked_s": 1.0, "waited_s": 0.5, "write_s": 4.0},
               {"step": 32, "policy": "sync", "copy": "sync", "blocked_s": 10.0, "waited_s": 0.0, "write_s": None}]
    dispatch = [0.01] * 32
    dispatch[17] = 0.5
    res = checkpoint_loop.summarise(times, records, 32, skip=3, dispatch=dispatch)
    assert res["steady_step_s"] == 1.0
    assert [r["around_s"] for r in res["saves"]] == [[1.5, 3.0, 1.0], [1.0, 2.0, 1.5], [1.0, 3.5, 2.0]]
    assert [r["lost_s"] for r in res["saves"]] == [2.5, 1.25, 3.5]
    assert [r["dispatch_s"] for r in res["saves"]] == [0.01, 0.5, 0.01]
    assert res["by_policy"] == {"auto": {"lost_per_save_s": 1.25, "saves": 1, "ratio": 0.125},
                                "host": {"lost_per_save_s": 3.5, "saves": 1, "ratio": 0.35}}
    assert res["lost_per_save_s"] == 1.25 and res["sync_save_s"] == 10.0 and res["ratio"] == 0.125


def test_checkpoint_loop_fingerprints_agree_between_the_devices_and_the_host():
    """--verify's two fingerprints of the same bits (on the devices, of the arrays read back) are equal for
    every stored dtype, and differ once one bit changes."""
    import jax
    import numpy as np

    sys.path.insert(0, BENCH)
    import checkpoint_loop

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((33, 7), dtype=np.float32), rng.standard_normal(5).astype(jax.numpy.bfloat16),
              rng.integers(0, 2**32, 4, dtype=np.uint32), np.int32(7), np.array([True, False, True]),
              rng.integers(-100, 100, 6, dtype=np.int8)]
    on_device = checkpoint_loop.device_fingerprints([jax.device_put(a) for a in arrays])
    assert on_device == [checkpoint_loop.host_fingerprint(np.asarray(a)) for a in arrays]
    flipped = arrays[0].copy()
    flipped.view(np.uint32)[3, 2] ^= 1
    assert checkpoint_loop.host_fingerprint(flipped) != on_device[0]
