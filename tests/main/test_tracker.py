"""Trackers: config parsing, the JSON-lines format and its resume truncation, fan-out, and the wandb
(offline/disabled) and TensorBoard backends writing only where they are told to."""

import dataclasses
import glob
import json
import logging
import os
import struct
from typing import Optional, Tuple, Union

import draccus
import numpy as np
import pytest
import yaml

from levanter.config import parse_config
from levanter.tracker import (
    CompositeTracker,
    DictTracker,
    JsonConfig,
    JsonTracker,
    NoopConfig,
    NoopTracker,
    TensorboardConfig,
    Tracker,
    TrackerConfig,
    TrackerStartError,
    WandbConfig,
    init_trackers,
    to_python,
)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    tracker: Union[TrackerConfig, Tuple[TrackerConfig, ...]] = dataclasses.field(default_factory=NoopConfig)


def _decode(text: str) -> _Cfg:
    return draccus.decode(_Cfg, yaml.safe_load(text))


# ---------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, expected",
    [
        ("tracker: {type: json}", JsonConfig()),
        ("tracker: {type: json_logger}", JsonConfig()),
        (
            "tracker: {type: json_logger, logger_name: lev, level: 10}",
            JsonConfig(logger_name="lev", level=10),
        ),
        ("tracker: {type: wandb, mode: offline, project: p}", WandbConfig(mode="offline", project="p")),
        ("tracker: {type: wandb, tags: [a, b], resume: true}", WandbConfig(tags=["a", "b"], resume=True)),
        ("tracker: {type: tensorboard}", TensorboardConfig()),
        ("tracker: {type: noop}", NoopConfig()),
        ("tracker: {project: q}", WandbConfig(project="q")),  # upstream's default type is wandb
        ("{}", NoopConfig()),
    ],
)
def test_parse_single(text, expected):
    assert _decode(text).tracker == expected


def test_parse_list_and_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "tracker:\n"
        "  - type: json_logger\n"
        "  - type: wandb\n"
        "    mode: offline\n"
        "    project: p\n"
    )
    cfg = parse_config(_Cfg, str(path))
    assert cfg.tracker == (JsonConfig(), WandbConfig(mode="offline", project="p"))
    # Two elements is the case draccus 0.11.6 encodes without `type` keys unless tracker.py corrects it.
    for trackers in [cfg.tracker, cfg.tracker + (TensorboardConfig(logdir="x"),), cfg.tracker[:1]]:
        encoded = draccus.encode(_Cfg(trackers))
        assert [t["type"] for t in encoded["tracker"]] == ["json", "wandb", "tensorboard"][: len(trackers)]
        assert draccus.decode(_Cfg, encoded) == _Cfg(trackers)
    assert _decode("tracker: []").tracker == ()
    assert parse_config(_Cfg, str(path), ["--tracker", "{type: noop}"]).tracker == NoopConfig()


# ------------------------------------------------------------------------------------------ normalising


def test_to_python_scalars():
    import jax.numpy as jnp

    assert to_python(np.float32(0.1)) == float(np.float32(0.1)) and type(to_python(np.float32(0.1))) is float
    assert to_python(jnp.asarray(0.1, dtype=jnp.bfloat16)) == float(jnp.asarray(0.1, dtype=jnp.bfloat16))
    assert to_python(jnp.asarray(0.1, dtype=jnp.float32)) == float(np.float32(0.1))
    assert to_python(np.int64(7)) == 7 and type(to_python(np.int64(7))) is int
    assert to_python(jnp.asarray(True)) is True
    assert to_python(np.array(2.5)) == 2.5
    arr = np.arange(3)
    assert to_python(arr) is arr  # arrays with elements are left to the backend


# ------------------------------------------------------------------------------------------------- json


def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def test_json_writes_exact_lines(tmp_path):
    import jax.numpy as jnp

    tracker = JsonConfig().init("run", str(tmp_path))
    tracker.log({"loss": 0.1 + 0.2, "f32": np.float32(0.1), "n": np.int64(7)}, step=0)
    tracker.log({"loss": jnp.asarray(1 / 3, dtype=jnp.float32), "name": "x", "ok": np.bool_(True)}, step=1)
    tracker.log({"eval/loss": float("nan")}, step=1)  # same step again: a second line
    tracker.finish()

    path = tmp_path / "run" / "metrics.jsonl"
    assert _lines(path) == [
        '{"step": 0, "loss": 0.30000000000000004, "f32": 0.10000000149011612, "n": 7}',
        '{"step": 1, "loss": 0.3333333432674408, "name": "x", "ok": true}',
        '{"step": 1, "eval/loss": NaN}',
    ]
    records = [json.loads(line) for line in _lines(path)]
    assert records[0]["loss"] == 0.1 + 0.2
    assert np.float32(records[0]["f32"]) == np.float32(0.1)
    assert np.float32(records[1]["loss"]) == np.float32(1 / 3)
    assert np.isnan(records[2]["eval/loss"])


def test_json_rejects_metric_named_step(tmp_path):
    with JsonConfig().init("run", str(tmp_path)) as tracker:
        with pytest.raises(ValueError, match="step"):
            tracker.log({"step": 3}, step=3)


def test_json_log_dir_override_and_logger_mirror(tmp_path, caplog):
    other = tmp_path / "elsewhere"
    with caplog.at_level("INFO", logger="lev.json"):
        with JsonConfig(log_dir=str(other), logger_name="lev.json").init("r", str(tmp_path / "unused")) as t:
            t.log({"a": 1}, step=0)
    assert _lines(other / "r" / "metrics.jsonl") == ['{"step": 0, "a": 1}']
    assert not (tmp_path / "unused").exists()
    assert [r.getMessage() for r in caplog.records if r.name == "lev.json"] == ['{"step": 0, "a": 1}']


def _write_attempt(log_dir, steps):
    tracker = JsonConfig().init("run", str(log_dir))
    for s in steps:
        tracker.log({"loss": float(s)}, step=s)
        if s == 2:
            tracker.log({"eval/loss": 9.0}, step=s)
    tracker.finish()


def test_json_resume_truncates_and_drops_partial_line(tmp_path):
    _write_attempt(tmp_path, range(5))
    path = tmp_path / "run" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')  # the process died mid-write

    tracker = JsonConfig().init("run", str(tmp_path), resume_step=3)
    assert [json.loads(line)["step"] for line in _lines(path)] == [0, 1, 2, 2]
    tracker.log({"loss": 3.5}, step=3)
    tracker.finish()
    assert _lines(path)[-2:] == ['{"step": 2, "eval/loss": 9.0}', '{"step": 3, "loss": 3.5}']
    assert sorted(os.listdir(tmp_path / "run")) == ["metrics.jsonl"]  # no temporary files left behind


def test_json_fresh_start_over_an_earlier_attempt_does_not_say_resuming(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _write_attempt(tmp_path, range(3))  # an attempt that saved no checkpoint
    JsonConfig().init("run", str(tmp_path), resume_step=0).finish()
    assert _lines(tmp_path / "run" / "metrics.jsonl") == []
    assert "starting at step 0: removing 4 line(s)" in caplog.text and "resuming" not in caplog.text
    _write_attempt(tmp_path, range(3))
    JsonConfig().init("run", str(tmp_path), resume_step=2).finish()
    assert "removing 2 line(s) with step >= 2 before resuming" in caplog.text


def test_json_without_resume_appends_but_drops_partial_line(tmp_path):
    _write_attempt(tmp_path, range(2))
    path = tmp_path / "run" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')
    with JsonConfig().init("run", str(tmp_path)) as tracker:
        tracker.log({"loss": 2.0}, step=2)
    expected = ['{"step": 0, "loss": 0.0}', '{"step": 1, "loss": 1.0}', '{"step": 2, "loss": 2.0}']
    assert _lines(path) == expected


def test_json_resume_with_no_earlier_file(tmp_path):
    with JsonConfig().init("run", str(tmp_path), resume_step=10) as tracker:
        tracker.log({"loss": 1.0}, step=10)
    assert _lines(tmp_path / "run" / "metrics.jsonl") == ['{"step": 10, "loss": 1.0}']


def test_json_hyperparameters_and_summary(tmp_path):
    with JsonConfig().init("run", str(tmp_path)) as tracker:
        tracker.log_hyperparameters({"trainer": {"seed": 0}, "lr": 1e-3})
        tracker.log_hyperparameters({"lr": 2e-3})
        tracker.log_summary({"best": np.float32(0.5)})
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"trainer": {"seed": 0}, "lr": 2e-3}
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"best": 0.5}
    # a resumed attempt merges into what the first one wrote
    with JsonConfig().init("run", str(tmp_path), resume_step=0) as tracker:
        tracker.log_hyperparameters({"extra": True})
    assert json.loads((tmp_path / "run" / "config.json").read_text())["trainer"] == {"seed": 0}


# -------------------------------------------------------------------------------------------- composite


def test_composite_fans_out():
    a, b = DictTracker(), DictTracker()
    with CompositeTracker([a, b]) as t:
        t.log({"loss": np.float32(1.5)}, step=4)
        t.log_hyperparameters({"lr": 0.1})
        t.log_summary({"best": 1.5})
    for d in (a, b):
        assert d.metrics == [(4, {"loss": 1.5})]
        assert d.history("loss") == [(4, 1.5)]
        assert d.hyperparameters == {"lr": 0.1} and d.summary == {"best": 1.5} and d.finished


@dataclasses.dataclass(frozen=True)
class _DictConfig(TrackerConfig):  # deliberately unregistered: used only to observe init_trackers
    fail: bool = False
    made: list = dataclasses.field(default_factory=list, compare=False)

    def init(self, run_id: str, log_dir: str, *, resume_step: Optional[int] = None) -> Tracker:
        if self.fail:
            raise RuntimeError("backend down")
        t = DictTracker()
        self.made.append(t)
        return t


def test_init_trackers(tmp_path):
    assert isinstance(init_trackers(NoopConfig(), "r", str(tmp_path)), NoopTracker)
    assert isinstance(init_trackers((), "r", str(tmp_path)), NoopTracker)
    single = init_trackers((JsonConfig(),), "r", str(tmp_path))
    assert isinstance(single, JsonTracker)
    single.finish()
    both = init_trackers((JsonConfig(), NoopConfig()), "r", str(tmp_path), resume_step=0)
    assert isinstance(both, CompositeTracker) and [t.name for t in both.trackers] == ["json", "noop"]
    both.finish()

    first = _DictConfig()
    with pytest.raises(TrackerStartError, match=r"trainer.tracker \(_dict\) could not start: RuntimeError: backend down"):
        init_trackers((first, _DictConfig(fail=True)), "r", str(tmp_path))
    assert first.made[0].finished  # the tracker that did start was closed


# ------------------------------------------------------------------------------------------------ wandb


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """A fresh HOME and no wandb settings or credentials from the environment."""
    pytest.importorskip("wandb", reason="wandb is not installed (an offline machine without the project's extras)")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in list(os.environ):
        if var.startswith("WANDB_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return home


def _offline_run_dirs(root, run_id):
    return glob.glob(os.path.join(root, "wandb", f"offline-run-*-{run_id}"))


def test_wandb_offline_writes_under_log_dir(tmp_path, wandb_env):
    log_dir = tmp_path / "logs"
    tracker = WandbConfig(mode="offline", project="p").init("run-a", str(log_dir))
    tracker.log({"loss": np.float32(0.5), "name": "x"}, step=0)
    tracker.log({"loss": 0.25}, step=1)
    tracker.log_hyperparameters({"lr": 0.1})
    tracker.log_summary({"best": 0.25})
    assert tracker.run.id == "run-a"
    tracker.finish()
    (run_dir,) = _offline_run_dirs(log_dir, "run-a")
    assert os.path.getsize(os.path.join(run_dir, "run-run-a.wandb")) > 0


def test_wandb_mode_from_env_and_wandb_dir(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wdir"))
    with WandbConfig(project="p").init("run-b", str(tmp_path / "logs")) as tracker:
        tracker.log({"loss": 1.0}, step=0)
    assert len(_offline_run_dirs(tmp_path / "wdir", "run-b")) == 1
    assert not (tmp_path / "logs").exists()


def test_wandb_disabled_writes_nothing(tmp_path, wandb_env):
    with WandbConfig(mode="disabled").init("run-c", str(tmp_path / "logs")) as tracker:
        tracker.log({"loss": 1.0}, step=0)
        tracker.log_summary({"best": 1.0})
    assert sorted(os.listdir(tmp_path)) == ["home"]
    assert list(wandb_env.rglob("*")) == []


def test_wandb_online_needs_credentials_before_any_work(tmp_path, wandb_env, monkeypatch):
    with pytest.raises(ValueError, match="wandb login.*WANDB_API_KEY.*WANDB_MODE=offline"):
        WandbConfig().check_can_start()
    WandbConfig(mode="offline").check_can_start()
    WandbConfig(mode="disabled").check_can_start()
    monkeypatch.setenv("WANDB_MODE", "offline")
    WandbConfig().check_can_start()
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    WandbConfig().check_can_start()
    monkeypatch.delenv("WANDB_API_KEY")
    (wandb_env / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    WandbConfig().check_can_start()  # what `wandb login` writes
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    with pytest.raises(ValueError, match="no credentials"):  # a key for another server does not count
        WandbConfig().check_can_start()


def test_every_tracker_accepts_log_dir(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (an offline machine without the project's extras)")
    assert JsonConfig(log_dir="j").local_dirs("r", "logs") == [("trainer.tracker.log_dir", "j/r")]
    assert TensorboardConfig().local_dirs("r", "logs") == [("trainer.log_dir", "logs/r/tensorboard")]
    assert TensorboardConfig(log_dir="t").local_dirs("r", "logs") == [("trainer.tracker.log_dir", "t/r")]
    assert TensorboardConfig(logdir="t").local_dirs("r", "logs") == [("trainer.tracker.logdir", "t/r")]
    with pytest.raises(ValueError, match="give one"):
        TensorboardConfig(logdir="a", log_dir="b").local_dirs("r", "logs")
    with WandbConfig(mode="offline", log_dir=str(tmp_path / "w")).init("run-d", str(tmp_path / "logs")) as t:
        t.log({"loss": 1.0}, step=0)
    assert len(_offline_run_dirs(tmp_path / "w", "run-d")) == 1


def test_a_wandb_failure_is_one_tracker_error_line():
    from levanter.tracker import TrackerError, WandbTracker

    class BrokenRun:  # stands in for a wandb run whose server went away
        def log(self, *a, **k):
            raise ConnectionError("server unreachable")

        def finish(self):
            raise ConnectionError("server unreachable")

    t = WandbTracker(BrokenRun())
    with pytest.raises(TrackerError, match=r"trainer.tracker \(wandb\) failed logging metrics: ConnectionError"):
        t.log({"loss": 1.0}, step=0)
    with pytest.raises(TrackerError, match="failed finishing the run"):
        t.finish()


def test_wandb_rejects_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        WandbConfig(mode="offlin").init("r", str(tmp_path))


# ------------------------------------------------------------------------------------------ tensorboard


def _read_events(directory):
    """All events in the TFRecord event files under ``directory``: (u64 length, u32 crc, payload, u32 crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 12
            events.append(event_pb2.Event.FromString(data[offset : offset + length]))
            offset += length + 4
    return events


def test_tensorboard_writes_scalars_and_text(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed")
    cfg = _decode(f"tracker: {{type: tensorboard, logdir: {tmp_path / 'tb'}}}").tracker
    with cfg.init("run", str(tmp_path / "unused"), resume_step=2) as tracker:
        tracker.log({"loss": np.float32(0.25), "note": "hello", "skipped": None}, step=3)
        tracker.log({"loss": 0.125, "hist": np.arange(5.0)}, step=4)
        tracker.log_hyperparameters({"lr": 0.1})
    events = _read_events(tmp_path / "tb" / "run")
    values = [(e.step, v) for e in events for v in e.summary.value]
    scalars = [(step, v.tag, v.simple_value) for step, v in values if v.HasField("simple_value")]
    assert scalars == [(3, "loss", 0.25), (4, "loss", 0.125)]
    tags = {v.tag for e in events for v in e.summary.value}
    assert {"note/text_summary", "hist", "hparams/text_summary"} <= tags
    # resume_step becomes the writer's purge step: a START marker at step 2 tells TensorBoard to drop
    # the earlier attempt's events from step 2 on
    assert any(e.HasField("session_log") and e.step == 2 for e in events)
    assert not (tmp_path / "unused").exists()


def test_log_directories_are_checked_before_the_run(tmp_path):
    """check_trackers_writable creates each tracker's directory and leaves nothing else there; a
    directory that cannot be made names the key it came from."""
    from levanter.tracker import check_trackers_writable

    both = (JsonConfig(), TensorboardConfig(logdir=str(tmp_path / "tb")))
    check_trackers_writable(both, "r1", str(tmp_path / "logs"))
    assert os.listdir(tmp_path / "logs" / "r1") == [] and os.listdir(tmp_path / "tb" / "r1") == []
    (tmp_path / "afile").write_text("a file, not a directory")
    with pytest.raises(ValueError, match=r"trainer.log_dir: cannot write logs to .*afile/r1 \(Not a dir"):
        check_trackers_writable(JsonConfig(), "r1", str(tmp_path / "afile"))
    with pytest.raises(ValueError, match=r"trainer.tracker.log_dir: cannot write logs to .*afile/own/r1"):
        own = JsonConfig(log_dir=str(tmp_path / "afile" / "own"))
        check_trackers_writable([own], "r1", str(tmp_path / "logs"))
    with pytest.raises(ValueError, match=r"trainer.tracker.logdir: cannot write logs to .*afile/tb/r1"):
        check_trackers_writable(TensorboardConfig(logdir=str(tmp_path / "afile" / "tb")), "r1", str(tmp_path))
    check_trackers_writable(NoopConfig(), "r1", str(tmp_path / "afile"))  # writes nothing: nothing to check


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_out_of_space_naming_the_metrics_file(tmp_path):
    """Writes to /dev/full fail with the kernel's ENOSPC, as on a full disk: the tracker raises
    OutOfSpaceError (exit 74 in the CLIs) naming metrics.jsonl, and its clean-up does not fail again."""
    from levanter.errors import OutOfSpaceError

    tracker = JsonConfig().init("r1", str(tmp_path))
    tracker.log({"loss": 1.0}, step=0)
    tracker._file.close()
    tracker._file = open("/dev/full", "a", encoding="utf-8")  # the disk fills up from here on
    with pytest.raises(OutOfSpaceError, match=r"out of disk space while logging metrics at .*/metrics.jsonl"):
        tracker.log({"loss": 0.5}, step=1)
    tracker.finish()
    with open(tmp_path / "r1" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0]


# ---------------------------------------------------------------------------------------- object stores
# memory:// is an object store in this process (fsspec's memory filesystem, reached through
# levanter.utils.fs like gs:// and s3://): no append, whole-object writes. The real servers are exercised
# end to end in tests/store/test_object_store_e2e.py.


@pytest.fixture
def store_dir():
    import uuid

    from levanter.utils import fs

    url = f"memory://tracker-{uuid.uuid4().hex}"
    yield url
    fs.remove_tree(url)


def test_json_on_an_object_store_uploads_the_whole_file(tmp_path, store_dir):
    """Lines are kept in memory and uploaded as one object: when ``flush_secs`` has passed at a ``log``,
    at ``flush`` and at ``finish``; what is stored then is byte for byte what a local tracker writes."""
    from levanter.utils import fs

    now = [0.0]
    url = fs.join(store_dir, "logs", "run", "metrics.jsonl")
    remote = JsonTracker(fs.join(store_dir, "logs", "run"), flush_secs=30, clock=lambda: now[0])
    local = JsonTracker(str(tmp_path / "run"))
    calls = [({"loss": 0.1 + 0.2, "f32": np.float32(0.1)}, 0), ({"loss": float("nan")}, 1), ({"x": 1}, 2),
             ({"eval/loss": 2.5}, 2)]
    for metrics, step in calls:
        local.log(metrics, step=step)
    remote.log(*calls[0][:1], step=0)
    assert not fs.exists(url)  # nothing uploaded before flush_secs have passed
    now[0] = 31.0
    remote.log(calls[1][0], step=1)
    assert len(fs.read_text(url).splitlines()) == 2  # flush_secs passed: the whole file so far
    remote.log(calls[2][0], step=2)
    assert len(fs.read_text(url).splitlines()) == 2
    remote.flush()
    assert len(fs.read_text(url).splitlines()) == 3
    remote.log(calls[3][0], step=2)
    remote.finish()
    local.finish()
    assert fs.read_bytes(url) == (tmp_path / "run" / "metrics.jsonl").read_bytes()
    remote.finish()  # harmless twice
    with pytest.raises(RuntimeError, match="after finish"):
        remote.log({"loss": 1.0}, step=3)


def test_json_on_an_object_store_resumes_like_a_local_file(store_dir):
    """A resumed run drops the stored lines with step >= resume_step and a trailing partial line, and
    stores the result at once; config.json and summary.json merge into what the earlier attempt wrote."""
    from levanter.utils import fs

    run = fs.join(store_dir, "run")
    url = fs.join(run, "metrics.jsonl")
    with JsonConfig().init("run", store_dir) as first:
        first.log_hyperparameters({"lr": 1e-3, "seed": 0})
        for step in range(5):
            first.log({"loss": float(step)}, step=step)
    fs.atomic_write_bytes(url, fs.read_bytes(url) + b'{"step": 5, "lo')  # cut off mid-line
    tracker = JsonConfig().init("run", store_dir, resume_step=3)
    assert [json.loads(line)["step"] for line in fs.read_text(url).splitlines()] == [0, 1, 2]
    tracker.log({"loss": 3.5}, step=3)
    tracker.log_hyperparameters({"lr": 2e-3})
    tracker.log_summary({"best": np.float32(0.5)})
    tracker.finish()
    assert fs.read_text(url).splitlines()[-1] == '{"step": 3, "loss": 3.5}'
    assert json.loads(fs.read_text(fs.join(run, "config.json"))) == {"lr": 2e-3, "seed": 0}
    assert json.loads(fs.read_text(fs.join(run, "summary.json"))) == {"best": 0.5}
    assert sorted(fs.listdir(run)) == ["config.json", "metrics.jsonl", "summary.json"]


def test_tensorboard_on_an_object_store_uploads_its_event_files(tmp_path, store_dir):
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed")
    from levanter.utils import fs

    cfg = TensorboardConfig(logdir=fs.join(store_dir, "tb"))
    tracker = cfg.init("run", "unused-log-dir")
    staging = tracker._staging
    tracker.log({"loss": np.float32(0.25)}, step=3)
    tracker.flush()
    names = fs.listdir(fs.join(store_dir, "tb", "run"))
    assert len(names) == 1 and names[0].startswith("events.out.tfevents.")
    tracker.log({"loss": 0.125}, step=4)
    tracker.finish()
    assert not os.path.exists(staging)  # the local copy is removed once uploaded
    data = fs.read_bytes(fs.join(store_dir, "tb", "run", names[0]))
    (tmp_path / names[0]).write_bytes(data)
    scalars = [(e.step, v.simple_value) for e in _read_events(tmp_path) for v in e.summary.value]
    assert scalars == [(3, 0.25), (4, 0.125)]
    assert not os.path.exists("unused-log-dir")
