"""Checkpoints: bit-exact round trips (1 device and a 4x2 mesh), clear errors for mismatched templates
and damaged checkpoints, discovery that skips incomplete saves, crash safety under SIGKILL, the
keep/save_interval policy with a fake clock, and duration parsing for the config."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from levanter.checkpoint import (
    METADATA_FILENAME,
    CheckpointerConfig,
    CheckpointInterval,
    CheckpointMismatchError,
    CorruptCheckpointError,
    delete_stale_temporaries,
    discover_latest_checkpoint,
    load_checkpoint,
    read_checkpoint_metadata,
    restore,
    save_checkpoint,
)
from levanter.config import ConfigError, parse_config, parse_timedelta


class Mlp(eqx.Module):
    w: jax.Array
    b: jax.Array
    ids: jax.Array
    scale: float  # a non-array leaf: comes from the template
    act: object = eqx.field(static=True, default=jax.nn.gelu)


def make_state(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    model = Mlp(
        w=jax.random.normal(k[0], (16, 8), jnp.float32),
        b=jax.random.normal(k[1], (8,), jnp.float32).astype(jnp.bfloat16),
        ids=jax.random.randint(k[2], (8,), 0, 1000, jnp.int32),
        scale=0.5,
    )
    opt = optax.adamw(1e-2)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = opt.init(params)
    # one real update so the moments and the count are not all zeros
    _, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return {
        "model": model,
        "opt_state": opt_state,
        "key": jax.random.key(seed + 100),
        "keys": jax.random.split(jax.random.key(seed + 7), 8),
        "step": jnp.asarray(seed + 3, jnp.int32),
    }


def leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def assert_bit_equal(a_tree, b_tree):
    la, lb = leaves(a_tree), leaves(b_tree)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, a), (_, b) in zip(la, lb):
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert b.dtype == a.dtype, path
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if isinstance(a, (jax.Array, np.ndarray, np.generic)):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape, path
            assert a.tobytes() == b.tobytes(), path
        else:
            assert a == b, path


def perturb(tree):
    """Same structure, shapes, dtypes and shardings; different values."""
    def f(x):
        if not isinstance(x, jax.Array):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.device_put(jax.random.wrap_key_data(jax.random.key_data(x) + 1), x.sharding)
        return jax.device_put(jnp.zeros(x.shape, x.dtype) + 1, x.sharding)

    return jax.tree.map(f, tree)


def test_round_trip_single_device(tmp_path):
    state = make_state()
    path = save_checkpoint(state, 3, str(tmp_path / "step-3"), metadata={"note": "hi"})
    template = perturb(state)
    restored = load_checkpoint(template, path)
    assert_bit_equal(state, restored)
    assert restored["model"].scale == 0.5 and restored["model"].act is jax.nn.gelu
    for (_, r), (_, t) in zip(leaves(restored), leaves(template)):
        if isinstance(t, jax.Array):
            assert r.sharding == t.sharding

    # an abstract template without shardings restores onto the first device
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, state
    )
    restored = load_checkpoint(abstract, path)
    assert_bit_equal(state, restored)
    assert restored["model"].w.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])

    meta = read_checkpoint_metadata(path)
    assert meta["step"] == 3 and meta["is_temporary"] is False and meta["metadata"] == {"note": "hi"}
    assert meta["format_version"] == 1 and "timestamp" in meta
    by_name = {r["name"]: r for r in meta["leaves"]}
    assert by_name["model/w"]["shape"] == [16, 8] and by_name["model/b"]["dtype"] == "bfloat16"
    assert by_name["keys"]["dtype"] == "key<fry>" and by_name["keys"]["stored_shape"] == [8, 2]
    assert os.path.isfile(tmp_path / "step-3" / "model" / "w" / "zarr.json")
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".tmp-")]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def shard_state(state, mesh):
    def spec(x):
        if x.ndim == 2 and x.shape[0] % 4 == 0 and x.shape[1] % 2 == 0:
            return P("data", "model")
        if x.ndim == 1 and x.shape[0] % 4 == 0:
            return P("data")
        return P()

    def put(x):
        return jax.device_put(x, NamedSharding(mesh, spec(x))) if eqx.is_array(x) else x

    return jax.tree.map(put, state)


@pytest.mark.devices(8)  # the 4x2 mesh
def test_round_trip_sharded(tmp_path, mesh):
    state = shard_state(make_state(1), mesh)
    assert state["model"].w.sharding.spec == P("data", "model")
    path = save_checkpoint(state, 4, str(tmp_path / "step-4"))
    # one chunk file per distinct shard: 4 x 2 for w, 4 for the keys' data
    w_chunks = [f for _, _, fs in os.walk(tmp_path / "step-4" / "model" / "w" / "c") for f in fs]
    assert len(w_chunks) == 8

    template = perturb(state)
    restored = load_checkpoint(template, path)
    assert_bit_equal(state, restored)
    for (p, r), (_, t) in zip(leaves(restored), leaves(template)):
        if isinstance(t, jax.Array):
            assert r.sharding == t.sharding, p

    # An abstract template (eval_shape-style) carries the shardings without any data.
    abstract = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
        ),
        state,
    )
    restored2 = load_checkpoint(abstract, path)
    assert_bit_equal(state, restored2)
    assert restored2["keys"].sharding == state["keys"].sharding
    assert restored2["model"].w.sharding == state["model"].w.sharding


@pytest.mark.devices(8)  # the 4x2 mesh
def test_reshard_on_load(tmp_path, mesh):
    state = make_state(2)
    path = save_checkpoint(state, 1, str(tmp_path / "ck"))
    target = shard_state(state, mesh)
    shardings = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None, target)
    restored = load_checkpoint(perturb(state), path, shardings=shardings)
    assert_bit_equal(state, restored)
    assert restored["model"].w.sharding == target["model"].w.sharding
    assert restored["keys"].sharding == target["keys"].sharding


def test_odd_keys_numpy_leaves_and_single_array(tmp_path):
    tree = {
        "a/b": np.arange(5, dtype=np.float64) / 3,
        "a_b": {"..": np.float32(1.25)},
        "": jnp.arange(3),
        METADATA_FILENAME: jnp.ones(2, jnp.bfloat16),
    }
    path = save_checkpoint(tree, 0, str(tmp_path / "ck"))
    restored = load_checkpoint(jax.tree.map(lambda x: x * 0, tree), path)
    assert_bit_equal(tree, restored)
    assert isinstance(restored["a/b"], np.ndarray) and isinstance(restored["a_b"][".."], np.float32)
    names = {r["name"] for r in read_checkpoint_metadata(path)["leaves"]}
    assert names == {"a%2Fb", "a_b/%2E%2E", "%", "metadata%2Ejson"}

    single = jnp.arange(6.0)
    p2 = save_checkpoint(single, 0, str(tmp_path / "single"))
    assert_bit_equal(single, load_checkpoint(jnp.zeros(6), p2))


def test_template_mismatch_errors(tmp_path):
    state = make_state()
    path = save_checkpoint(state, 3, str(tmp_path / "ck"))

    bad = make_state()
    bad["model"] = dataclasses.replace(bad["model"], w=jnp.zeros((16, 9)))
    expected = r"\['model'\]\.w.*\(16, 8\) float32.*\(16, 9\) float32"
    with pytest.raises(CheckpointMismatchError, match=expected):
        load_checkpoint(bad, path)

    bad = make_state()
    bad["step"] = jnp.asarray(3, jnp.int16)
    with pytest.raises(CheckpointMismatchError, match="step.*int16"):
        load_checkpoint(bad, path)

    extra = dict(make_state(), more=jnp.zeros(3))
    with pytest.raises(CheckpointMismatchError, match="no entry for template leaves more"):
        load_checkpoint(extra, path)

    fewer = {k: v for k, v in make_state().items() if k != "key"}
    with pytest.raises(CheckpointMismatchError, match="does not have"):
        load_checkpoint(fewer, path)


def test_damaged_checkpoint_errors(tmp_path):
    import shutil

    state = make_state()
    ck = tmp_path / "ck"

    def fresh():
        if ck.exists():
            shutil.rmtree(ck)
        return save_checkpoint(state, 3, str(ck))

    path = fresh()
    shutil.rmtree(ck / "model" / "w")
    with pytest.raises(CorruptCheckpointError, match=rf"{ck}.*\['model'\]\.w \(model/w\) is missing"):
        load_checkpoint(state, path)

    path = fresh()
    chunk = next(os.path.join(d, f) for d, _, fs in os.walk(ck / "model" / "b" / "c") for f in fs)
    os.unlink(chunk)
    with pytest.raises(CorruptCheckpointError, match=r"model/b.*cannot be read"):
        load_checkpoint(state, path)

    path = fresh()
    chunk = next(os.path.join(d, f) for d, _, fs in os.walk(ck / "model" / "w" / "c") for f in fs)
    data = open(chunk, "rb").read()
    open(chunk, "wb").write(data[: len(data) // 2])  # truncated
    with pytest.raises(CorruptCheckpointError, match=r"model/w.*cannot be read"):
        load_checkpoint(state, path)

    path = fresh()
    data = bytearray(open(chunk, "rb").read())
    data[10] ^= 0x01  # one flipped bit: caught by the crc32c codec, not restored as garbage
    open(chunk, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model/w.*cannot be read"):
        load_checkpoint(state, path)

    path = fresh()
    os.unlink(ck / METADATA_FILENAME)
    with pytest.raises(CorruptCheckpointError, match="no metadata.json"):
        load_checkpoint(state, path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(state, str(tmp_path / "nothing-here"))


def test_save_refuses_to_overwrite(tmp_path):
    tree = {"x": jnp.arange(3)}
    path = save_checkpoint(tree, jnp.asarray(1), str(tmp_path / "step-1"))  # a jax scalar step is fine
    assert read_checkpoint_metadata(path)["step"] == 1
    with pytest.raises(TypeError, match="step"):
        save_checkpoint(tree, 1.0, str(tmp_path / "step-x"))
    with pytest.raises(FileExistsError):
        save_checkpoint(tree, 1, path)


def test_discover_latest_skips_temporaries_and_incomplete(tmp_path, caplog):
    assert discover_latest_checkpoint(str(tmp_path / "absent")) is None
    tree = {"x": jnp.arange(3)}
    save_checkpoint(tree, 5, str(tmp_path / "step-5"))
    save_checkpoint(tree, 12, str(tmp_path / "step-12"))
    os.makedirs(tmp_path / "step-20" / "x")  # no metadata.json
    os.makedirs(tmp_path / ".tmp-step-30-abcd")
    (tmp_path / ".tmp-step-30-abcd" / METADATA_FILENAME).write_text("{}")
    os.makedirs(tmp_path / "other")
    with caplog.at_level("WARNING"):
        assert discover_latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-12")
    assert "step-20" in caplog.text
    assert discover_latest_checkpoint(str(tmp_path / "step-5")) == str(tmp_path / "step-5")
    assert delete_stale_temporaries(str(tmp_path)) == [str(tmp_path / ".tmp-step-30-abcd")]
    assert sorted(os.listdir(tmp_path)) == ["other", "step-12", "step-20", "step-5"]


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def ckpt_dirs(path, ck=None):
    """``{step: is_temporary}`` of the checkpoints under ``path``, once ``ck``'s save in flight is done."""
    if ck is not None:
        ck.wait_until_finished()
    out = {}
    for e in sorted(os.listdir(path)):
        assert not e.startswith(".tmp-"), e
        out[int(e.split("-")[1])] = read_checkpoint_metadata(os.path.join(path, e))["is_temporary"]
    return out


def test_keep_policy_and_save_interval(tmp_path):
    clock = FakeClock()
    cfg = CheckpointerConfig(
        base_path=str(tmp_path),
        save_interval=parse_timedelta("10s"),
        keep=[CheckpointInterval(every=2, until=6), CheckpointInterval(every=5)],
    )
    ck = cfg.create("run1", clock=clock)
    run_dir = tmp_path / "run1"
    assert ck.base_path == str(run_dir)
    tree = {"x": jnp.arange(4)}
    saved = []
    for step in range(1, 17):
        clock.t += 3.0
        if ck.on_step(tree, step):
            saved.append(step)
    # permanent: 2, 4 (every 2 below 6), 10, 15 (every 5 from 6 on); temporary: 10 s after the last save
    # 4 -> t=12 at 4, due at step 8 (t=24 >= 22); then 10 (permanent) resets; due again at 14 (t=42 >= 40)
    assert saved == [2, 4, 8, 10, 14, 15]
    # temporary 8 was deleted once 10 was complete; 14 once 15 was; permanent ones stay
    assert ckpt_dirs(run_dir, ck) == {2: False, 4: False, 10: False, 15: False}

    clock.t += 11
    assert ck.on_step(tree, 16)
    assert ckpt_dirs(run_dir, ck)[16] is True
    assert not ck.on_step(tree, 16)  # already saved
    assert ck.on_step(tree, 17, force=True)
    assert ckpt_dirs(run_dir, ck) == {2: False, 4: False, 10: False, 15: False, 17: False}
    # force on a step already saved as temporary makes it permanent instead of saving it twice
    clock.t += 11
    assert ck.on_step(tree, 18)
    assert ckpt_dirs(run_dir, ck)[18] is True
    assert not ck.on_step(tree, 18, force=True)
    assert ckpt_dirs(run_dir, ck)[18] is False
    assert ck.latest_checkpoint() == str(run_dir / "step-18")
    ck.wait_until_finished()


def test_save_due_says_beforehand_what_on_step_will_do(tmp_path):
    """The trainer asks save_due before dispatching the next step (which reuses the state's buffers): it
    answers as the same policy run alongside with on_step alone does, and its time-based answer is the
    one that step's on_step acts on, even if the interval passes in between."""
    keep = [CheckpointInterval(every=2, until=6), CheckpointInterval(every=5)]
    clock, ref_clock = FakeClock(), FakeClock()
    ck = CheckpointerConfig(base_path=str(tmp_path), save_interval=parse_timedelta("10s"), keep=keep).create(
        "asked", clock=clock)
    ref = CheckpointerConfig(base_path=str(tmp_path), save_interval=parse_timedelta("10s"), keep=keep).create(
        "plain", clock=ref_clock)
    tree = {"x": jnp.arange(4)}
    for step in range(1, 17):
        clock.t += 3.0
        ref_clock.t += 3.0
        due = ck.save_due(step, force=step == 16)
        assert due == ref.on_step(tree, step, force=step == 16), step
        if due:
            assert ck.on_step(tree, step, force=step == 16)
    assert ckpt_dirs(tmp_path / "asked", ck) == ckpt_dirs(tmp_path / "plain", ref)
    assert ck.save_due(16, force=True)  # saved as permanent already: on_step has nothing to save
    assert not ck.on_step(tree, 16, force=True)
    clock.t += 5.0
    assert not ck.save_due(17)
    clock.t += 20.0  # the interval passes between the question and on_step: the answer stands
    assert not ck.on_step(tree, 17)
    assert ck.save_due(18) and ck.on_step(tree, 18)
    ck.wait_until_finished()


def test_the_multi_process_time_decision_is_started_one_step_ahead(tmp_path):
    """In a multi-process run the time-based answer is process 0's, carried by a device collective; reading it
    would wait for the step the trainer has just queued, so each step's answer is started at the step before
    (Checkpointer._agreed_due, which a multi-process run calls at every step; here on this process's devices).
    The answer for step s is the clock at step s - 1, and a step that saves restarts it."""
    clock = FakeClock()
    ck = CheckpointerConfig(base_path=str(tmp_path), save_interval=parse_timedelta("10s")).create("r", clock=clock)
    saves = []
    for step in range(1, 17):
        clock.t += 3.0
        if ck._agreed_due(step, 10.0):
            saves.append(step)
            ck._last_save_time = clock.t  # as the save at that step sets it
    # At 3 s a step: 12 s have passed at step 4, seen at step 5; then every 5 steps (a single process, which
    # reads its own clock at once, saves at 4, 8, 12, 16).
    assert saves == [5, 10, 15]
    # A step other than the one started (after a step that saved without asking) agrees at once.
    clock.t += 11.0
    assert ck._agreed_due(40, 10.0)
    assert not ck._agreed_due(41, 10.0)  # started at 40 with the clock restarted there
    ck.wait_until_finished()


def test_temporaries_from_a_previous_attempt(tmp_path):
    clock = FakeClock()
    cfg = CheckpointerConfig(
        base_path=str(tmp_path), save_interval=parse_timedelta(10), keep=[CheckpointInterval(100)]
    )
    tree = {"x": jnp.arange(4)}
    first = cfg.create("r", clock=clock)
    clock.t += 11
    assert first.on_step(tree, 7)
    first.wait_until_finished()
    os.makedirs(tmp_path / "r" / ".tmp-step-8-dead")  # a save killed mid-way

    clock2 = FakeClock()
    second = cfg.create("r", clock=clock2)  # the resumed attempt
    assert sorted(os.listdir(tmp_path / "r")) == ["step-7"]  # stale .tmp removed, step-7 kept for now
    assert second.latest_checkpoint() == str(tmp_path / "r" / "step-7")
    clock2.t += 11
    assert second.on_step(tree, 8)
    assert ckpt_dirs(tmp_path / "r", second) == {8: True}

    keep_cfg = dataclasses.replace(cfg, delete_old_temp_checkpoints=False)
    third = keep_cfg.create("r", clock=clock2)
    clock2.t += 11
    assert third.on_step(tree, 9)
    assert ckpt_dirs(tmp_path / "r", third) == {8: True, 9: True}


def test_checkpointer_config_from_yaml(tmp_path):
    @dataclasses.dataclass
    class Trainer:
        checkpointer: CheckpointerConfig = dataclasses.field(default_factory=CheckpointerConfig)

    @dataclasses.dataclass
    class Top:
        trainer: Trainer = dataclasses.field(default_factory=Trainer)

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        textwrap.dedent(
            """
            trainer:
              checkpointer:
                base_path: /tmp/ck
                save_interval: 5m
                keep:
                  - every: 1000
                    until: 10000
                  - every: 5000
            """
        )
    )
    top = parse_config(Top, str(cfg_file))
    c = top.trainer.checkpointer
    assert c.save_interval.total_seconds() == 300
    assert c.keep == [CheckpointInterval(1000, 10000), CheckpointInterval(5000)]
    assert c.expanded_path("abc") == "/tmp/ck/abc"
    assert dataclasses.replace(c, append_run_id_to_base_path=False).expanded_path("abc") == "/tmp/ck"

    top = parse_config(Top, str(cfg_file), ["--trainer.checkpointer.save_interval", "1h30m"])
    assert top.trainer.checkpointer.save_interval.total_seconds() == 5400
    assert CheckpointerConfig().save_interval.total_seconds() == 900
    assert CheckpointerConfig().keep == [CheckpointInterval(every=10000)]
    assert "save_interval: 15m" in draccus.dump(CheckpointerConfig())

    cfg_file.write_text("trainer:\n  checkpointer:\n    save_interval: soon\n")
    with pytest.raises(ConfigError, match="save_interval.*soon"):
        parse_config(Top, str(cfg_file))


@pytest.mark.parametrize(
    "text,seconds",
    [("15m", 900), ("30s", 30), ("1h", 3600), ("2d", 172800), ("10min", 600), ("90", 90), (45, 45),
     (1.5, 1.5), ("1.5h", 5400), ("1h 30m", 5400), ("2 hours", 7200), (" 5 M ", 300)],
)
def test_parse_timedelta(text, seconds):
    assert parse_timedelta(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "m", "15x", "1 2", "-5s", -3, True, "5m soon", None])
def test_parse_timedelta_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_timedelta(text)


def test_validate_writable(tmp_path):
    cfg = CheckpointerConfig(base_path=str(tmp_path / "ok"))
    assert cfg.validate_writable("run") == str(tmp_path / "ok" / "run")
    assert os.listdir(tmp_path / "ok" / "run") == []  # the probe is gone

    (tmp_path / "afile").write_text("not a directory")
    bad = CheckpointerConfig(base_path=str(tmp_path / "afile" / "sub"))
    with pytest.raises(ValueError, match=r"trainer\.checkpointer\.base_path.*afile/sub"):
        bad.validate_writable("run")


KILL_SCRIPT = """
import sys
import jax.numpy as jnp
from levanter.checkpoint import save_checkpoint
tree = {"a": jnp.arange(1000.0), "b": {"c": jnp.ones((30, 30), jnp.bfloat16), "d": jnp.arange(7)}}
save_checkpoint(tree, 2, sys.argv[1] + "/step-2")
print("survived")
"""


@pytest.mark.parametrize("point", ["checkpoint_mid_write", "checkpoint_before_rename"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, point):
    tree = {
        "a": jnp.arange(1000.0) * 2,
        "b": {"c": jnp.zeros((30, 30), jnp.bfloat16), "d": jnp.arange(7) + 1},
    }
    save_checkpoint(tree, 1, str(tmp_path / "step-1"))
    env = dict(os.environ, LEVANTER_FAULT_KILL_AT=f"{point}:1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device is plenty and starts faster
    cmd = [sys.executable, "-c", KILL_SCRIPT, str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == -9, r.stdout + r.stderr
    tmps = [e for e in os.listdir(tmp_path) if e.startswith(".tmp-step-2-")]
    assert len(tmps) == 1 and not (tmp_path / "step-2").exists()
    has_meta = os.path.exists(tmp_path / tmps[0] / METADATA_FILENAME)
    assert has_meta == (point == "checkpoint_before_rename")

    latest = discover_latest_checkpoint(str(tmp_path))
    assert latest == str(tmp_path / "step-1")
    assert_bit_equal(tree, load_checkpoint(perturb(tree), latest))
    delete_stale_temporaries(str(tmp_path))
    assert os.listdir(tmp_path) == ["step-1"]


# -- integrity: what is refused before it is written or resumed ------------------------------------------
@pytest.mark.devices(8)  # the 4x2 mesh
def test_save_refuses_non_finite_values_and_writes_nothing(tmp_path, mesh):
    from levanter.checkpoint import CheckpointSaveError

    sharded = NamedSharding(mesh, P("data", "model"))
    tree = make_state()
    w = jax.device_put(tree["model"].w.at[3, 1].set(jnp.nan), sharded)
    tree["model"] = dataclasses.replace(tree["model"], w=w)
    with pytest.raises(CheckpointSaveError, match=r"step 5 .*step-5: \['model'\]\.w holds NaN or infinite"):
        save_checkpoint(tree, 5, str(tmp_path / "step-5"))
    assert os.listdir(tmp_path) == []  # not even a temporary directory
    # an infinity in a bfloat16 moment and a NaN in a numpy leaf are caught too, all named
    tree = make_state()
    mu = tree["opt_state"][0].mu
    adam = tree["opt_state"][0]._replace(mu=dataclasses.replace(mu, b=mu.b.at[0].set(jnp.inf)))
    tree["opt_state"] = (adam,) + tuple(tree["opt_state"][1:])
    tree["host"] = np.array([1.0, np.nan])
    with pytest.raises(CheckpointSaveError, match=r"\['host'\], \['opt_state'\]\[0\]\.mu\.b hold NaN"):
        save_checkpoint(tree, 5, str(tmp_path / "step-5"))
    assert os.listdir(tmp_path) == []

    # through the Checkpointer: the earlier checkpoint stays the latest
    ck = CheckpointerConfig(base_path=str(tmp_path), keep=[CheckpointInterval(every=1)]).create("r")
    good = {"x": jnp.arange(4.0), "k": jax.random.key(1), "n": jnp.arange(3)}
    assert ck.on_step(good, 1)
    with pytest.raises(CheckpointSaveError, match=r"\['x'\] holds"):
        ck.on_step({**good, "x": good["x"] / 0.0}, 2)
    assert sorted(os.listdir(tmp_path / "r")) == ["step-1"]
    assert ck.latest_checkpoint() == str(tmp_path / "r" / "step-1")


def test_a_full_disk_during_a_save_is_out_of_space_and_commits_nothing(tmp_path):
    """A real full filesystem (a 256 KiB tmpfs; skipped where mounting one is not allowed)."""
    from levanter.errors import OutOfSpaceError, is_out_of_space

    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                           capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        save_checkpoint({"small": jnp.arange(8.0)}, 1, str(mnt / "step-1"))
        with pytest.raises(OutOfSpaceError) as e:
            save_checkpoint({"big": jnp.ones((512, 256), jnp.float32)}, 2, str(mnt / "step-2"))  # 512 KiB
        assert is_out_of_space(e.value)
        msg = str(e.value)
        assert f"saving the checkpoint of step 2 at {mnt / 'step-2'}" in msg and "No space left" in msg, msg
        assert "tensorstore_spec" not in msg and "\n" not in msg
        assert sorted(os.listdir(mnt)) == ["step-1"]  # no partial step-2, no temporary directory
        assert discover_latest_checkpoint(str(mnt)) == str(mnt / "step-1")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_tensorstore_io_errors_are_reported_without_the_spec_dump():
    """A storage error that is not a full disk is reported by tensorstore's first clause (the text of a
    real one: a chunk directory blocked by a regular file), not by the spec and source locations."""
    from levanter.checkpoint.serialization import io_error_text

    ts_error = ValueError("FAILED_PRECONDITION: Error writing local file \"/x/c/0\": Not a directory "
                          "[os_error_code='20'] [tensorstore_spec='{\"driver\": \"zarr3\"}']")
    expected = ("FAILED_PRECONDITION: Error writing local file \"/x/c/0\": Not a directory "
                "[os_error_code='20']")
    assert io_error_text(ts_error) == expected
    assert io_error_text(ValueError("shape mismatch")) is None


def test_the_process_index_handed_in_decides_who_writes_host_values_commits_and_cleans_up(tmp_path):
    from levanter.checkpoint import Checkpointer

    # Another process writes only its own device shards: a tree of host values leaves it nothing to write,
    # and only process 0 writes metadata.json and commits.
    save_checkpoint({"x": np.arange(3.0)}, 1, str(tmp_path / "step-1"), process_index=1)
    assert os.listdir(tmp_path) == []
    save_checkpoint({"x": np.arange(3.0)}, 1, str(tmp_path / "step-1"), process_index=0)
    assert discover_latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-1")

    os.makedirs(tmp_path / ".tmp-step-3-abcd" / "x")  # an interrupted save
    Checkpointer(str(tmp_path), process_index=1)
    assert sorted(os.listdir(tmp_path)) == [".tmp-step-3-abcd", "step-1"]
    Checkpointer(str(tmp_path), process_index=0)
    assert os.listdir(tmp_path) == ["step-1"]


def test_unreadable_checkpoints_are_step_dirs_with_data_but_no_metadata(tmp_path):
    from levanter.checkpoint import unreadable_checkpoints

    tree = {"x": jnp.arange(3.0)}
    save_checkpoint(tree, 2, str(tmp_path / "step-2"))
    save_checkpoint(tree, 4, str(tmp_path / "step-4"))
    os.unlink(tmp_path / "step-4" / METADATA_FILENAME)
    os.makedirs(tmp_path / "step-6")  # empty: holds nothing to lose
    os.makedirs(tmp_path / ".tmp-step-8-abcd" / "x")  # an interrupted save: the writer's own business
    assert unreadable_checkpoints(str(tmp_path)) == [str(tmp_path / "step-4")]
    assert unreadable_checkpoints(str(tmp_path / "absent")) == []


def restore_config(tmp_path, **kw):
    from levanter.training import TrainerConfig

    return TrainerConfig(id="r", require_accelerator=False,
                         checkpointer=CheckpointerConfig(base_path=str(tmp_path)), **kw)


def test_resume_refuses_damaged_checkpoints_and_missing_load_paths(tmp_path):
    tree = {"x": jnp.arange(3.0)}
    run = tmp_path / "r"
    save_checkpoint({"x": jnp.arange(3.0) + 1}, 2, str(run / "step-2"))
    save_checkpoint({"x": jnp.arange(3.0) + 2}, 4, str(run / "step-4"))
    os.unlink(run / "step-4" / METADATA_FILENAME)

    def resume(**kw):
        point = restore_config(tmp_path, **kw).resume_point("r")
        return restore(tree, point), (point.path if point is not None else None)

    # an intact step-2 does not make it safe: resuming there would overwrite step-4's arrays
    damaged = rf"{run} holds .*: {run}/step-4\..*load_checkpoint: false"
    with pytest.raises(CorruptCheckpointError, match=damaged):
        resume()
    with pytest.raises(CorruptCheckpointError, match="step-4"):
        resume(load_checkpoint=True)
    assert resume(load_checkpoint=False)[1] is None  # asked for: start from scratch
    (run / "step-4" / METADATA_FILENAME).write_text(json.dumps(read_checkpoint_metadata(str(run / "step-2"))))
    state, path = resume()
    assert path == str(run / "step-4")

    with pytest.raises(FileNotFoundError, match=rf"load_checkpoint_path='{tmp_path}/rr' does not exist"):
        resume(load_checkpoint_path=str(tmp_path / "rr"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="load_checkpoint_path=.*empty' holds no complete checkpoint"):
        resume(load_checkpoint_path=str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="load_checkpoint_path=.*step-9' does not exist"):
        resume(load_checkpoint_path=str(run / "step-9"))
    from_step_2 = resume(load_checkpoint_path=str(run / "step-2"))[0]
    np.testing.assert_array_equal(from_step_2["x"], np.arange(3.0) + 1)
    np.testing.assert_array_equal(resume(load_checkpoint_path=str(run))[0]["x"], np.arange(3.0) + 2)


def test_resume_point_carries_the_step_and_records_and_finds_a_finished_run(tmp_path):
    run = tmp_path / "r"
    save_checkpoint({"x": jnp.arange(3.0)}, 4, str(run / "step-4"), metadata={"data_schedule": {"stages": 1}})
    point = restore_config(tmp_path, num_train_steps=10).resume_point("r")
    assert (point.path, point.step, point.records) == (str(run / "step-4"), 4, {"data_schedule": {"stages": 1}})
    assert not point.finished(10) and point.finished(4)
    # A run already at num_train_steps writes nothing: it is found finished even beside a damaged checkpoint,
    # which a run that goes on training refuses.
    os.makedirs(run / "step-6")
    (run / "step-6" / "x").write_text("arrays without their metadata.json")
    assert restore_config(tmp_path, num_train_steps=4).resume_point("r").finished(4)
    with pytest.raises(CorruptCheckpointError, match="step-6"):
        restore_config(tmp_path, num_train_steps=10).resume_point("r")
    # load_checkpoint: true with nothing to resume from is an error naming the directory searched.
    with pytest.raises(FileNotFoundError, match=r"trainer.load_checkpoint is true but no complete checkpoint .*'/"):
        restore_config(tmp_path / "none", load_checkpoint=True).resume_point("r")


@pytest.mark.parametrize("bad", ["../../x", "a/b", "..", ".", "", "a\\b", "x\0"])
def test_run_ids_must_be_one_path_component(bad):
    from levanter.training import TrainerConfig, check_run_id

    with pytest.raises(ValueError, match=r"trainer\.id=.* must be a single directory name"):
        TrainerConfig(id=bad, require_accelerator=False, num_train_steps=1, train_batch_size=8).validate()
    for good in (None, "run-1", "exp.2_b", "..x"):
        check_run_id(good)
