"""What a user sees while a run runs: progress lines at an interval on a stdout that is not a terminal,
the bar on a terminal with log lines above it, and the console log filter that keeps third-party INFO
chatter out. The checks of a real run's output (:func:`check_console_output`,
:func:`check_finished_rerun`) are called from tests/main/test_train_lm.py, which runs ``train_lm`` anyway."""

import io
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_train_lm import metrics, tiny_config  # noqa: E402

from levanter import progress  # noqa: E402
from levanter.main import train_lm  # noqa: E402


def check_console_output(tmp_path, out: str, *, steps: int, evals) -> None:
    """``out`` (a run's stdout, not a terminal, progress_interval 0) holds one progress line per step with
    the loss the tracker logged, every eval's per-source losses and the summary (steps, final train loss,
    last eval, speed, where the metrics and checkpoints went). Called by tests that run ``train_lm``."""
    out = out.splitlines()
    rows = metrics(tmp_path)
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    logged = {r["step"]: r for r in rows if "eval/loss" in r}
    step_lines = [x for x in out if x.startswith("step ")]
    assert [x.split(" |")[0] for x in step_lines] == [
        f"step {s + 1}/{steps} loss {losses[s]:.4f}" for s in range(steps)
    ]
    assert all("tok/s" in x and "data wait" in x and "ETA" in x for x in step_lines)
    assert sorted(logged) == list(evals)
    for s in evals:
        line = next(x for x in out if x.startswith(f"eval at step {s}: "))
        assert f"loss {logged[s]['eval/loss']:.4f}" in line
        assert f"data/loss {logged[s]['eval/data/loss']:.4f}" in line
    i = next(i for i, x in enumerate(out) if x.startswith("finished at step"))
    summary = "\n".join(out[i:])
    assert out[i].startswith(f"finished at step {steps}/{steps}: trained {steps} step(s) in ") and "tokens/s" in out[i]
    assert f"final train loss {losses[steps - 1]:.4f} (step {steps - 1})" in summary
    assert f"last eval at step {evals[-1]}: " in summary
    assert f"json metrics: {tmp_path / 'logs' / 'tiny' / 'metrics.jsonl'}" in summary
    assert f"checkpoints: {tmp_path / 'ckpt' / 'tiny'}" in summary


def check_finished_rerun(tmp_path, capsys, *, steps: int) -> None:
    """Rerunning the finished ``tiny`` run of ``steps`` steps with fewer steps (the same as rerunning it
    as is) says it already reached that step and what to do, and leaves the metrics as they were."""
    n_lines = len(metrics(tmp_path))
    result = train_lm.main(tiny_config(tmp_path, steps=3))
    out = capsys.readouterr().out
    assert result["final_step"] == steps
    assert (f"run tiny already reached step {steps} >= trainer.num_train_steps=3 "
            f"(checkpoint {tmp_path / 'ckpt' / 'tiny' / f'step-{steps}'}); nothing to train") in out
    assert "raise trainer.num_train_steps" in out and "new trainer.id" in out
    assert len(metrics(tmp_path)) == n_lines


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_log_lines_print_above_the_bar_and_the_bar_ends_once(monkeypatch):
    err, out = _Tty(), _Tty()
    monkeypatch.setattr(sys, "stderr", err)  # the console handler writes to the process's stderr
    p = progress.RunProgress(4, 0, interval_s=0, out=out, err=err)
    assert p.bar is not None and not p.lines  # a terminal on both streams: the bar, no progress lines
    log = logging.getLogger("levanter.test_run_output")
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        with p.logging_around_bar():
            p.step(0, 5.0, 100, 0.1, 0.0)
            log.warning("a line of its own")
            p.step(1, 4.0, 100, 0.1, 0.0)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    p.summary(final_step=2, where=["checkpoints: x"])
    p.close()
    text = err.getvalue()
    # the log line starts on a line of its own (the bar was cleared first), and the bar is closed once
    lines = text.replace("\r", "\n").split("\n")
    assert "a line of its own" in lines
    assert text.count("\n", text.rfind("train:")) <= 1
    assert "finished at step 2/4" in out.getvalue()


def test_non_terminal_stdout_gets_lines_at_the_interval():
    out, err = io.StringIO(), io.StringIO()
    p = progress.RunProgress(100, 10, interval_s=3600, out=out, err=err)
    assert p.bar is None and p.lines
    for s in range(10, 100):
        p.step(s, 1.0, 10, 0.01, 0.001)
    lines = out.getvalue().splitlines()
    # the first step and the last one; nothing in between at a one-hour interval
    assert [x.split(" loss")[0] for x in lines] == ["step 11/100", "step 100/100"]
    assert "data wait 1.0 ms/step" in lines[1]


def test_the_eta_leaves_out_the_first_steps_compile():
    """The first step of a process includes its compile (here 60 s against 0.5 s for the others): its line
    gives no ETA at that pace, and later lines estimate from the steps after it."""
    out, err = io.StringIO(), io.StringIO()
    p = progress.RunProgress(240, 0, interval_s=0, out=out, err=err)
    p.step(0, 5.0, 100, 60.0, 0.0)
    p.step(1, 4.9, 100, 0.5, 0.0)
    p.step(2, 4.8, 100, 0.5, 0.0)
    first, second, third = out.getvalue().splitlines()
    assert first.endswith("| ETA after step 2"), first
    assert second.endswith("| ETA 1m59s"), second  # 238 steps left at 0.5 s
    assert third.endswith("| ETA 1m58s"), third
    # a resumed process: its first step's line names the step after it
    out = io.StringIO()
    p = progress.RunProgress(240, 100, interval_s=0, out=out, err=err)
    p.step(100, 3.0, 100, 60.0, 0.0)
    p.step(239, 3.0, 100, 0.5, 0.0)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("| ETA after step 102") and lines[1].endswith("| ETA 0s"), lines


def test_console_filter_keeps_library_info_out():
    f = progress._ConsoleFilter()

    def rec(name, level):
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    assert f.filter(rec("levanter.training", logging.INFO))
    assert f.filter(rec("__main__", logging.INFO))
    assert not f.filter(rec("jax._src.xla_bridge", logging.INFO))  # "Unable to initialize backend 'tpu'"
    assert f.filter(rec("jax._src.xla_bridge", logging.WARNING))
    assert not f.filter(rec("levanter.training", logging.DEBUG))


DEBUG_LOG_SCRIPT = """
import logging, sys
from levanter import progress
progress.setup_console_logging()
logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu': not found")
logging.getLogger("levanter.training").info("a levanter line")
logging.getLogger("levanter.training").debug("a levanter detail")
print(progress.open_debug_log(sys.argv[1]))
logging.getLogger("jax").debug("after the log opened")
"""


def test_library_chatter_goes_to_the_debug_log_only(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-c", DEBUG_LOG_SCRIPT, str(tmp_path / "run")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "run" / "debug.log")
    assert "a levanter line" in r.stderr
    assert "Unable to initialize backend" not in r.stderr and "detail" not in r.stderr
    log = (tmp_path / "run" / "debug.log").read_text()
    for line in ("Unable to initialize backend 'tpu'", "a levanter line", "a levanter detail", "after the log opened"):
        assert line in log


UNWRITABLE_LOG_SCRIPT = """
import logging, sys
from levanter import progress
progress.setup_console_logging()
logging.getLogger("levanter.training").debug("a record from before")
try:
    progress.open_debug_log(sys.argv[1] + "/logs/run")
except ValueError as e:
    print("ValueError:", e)
try:
    progress.open_command_debug_log("cache_dataset", sys.argv[1] + "/logs")
except ValueError as e:
    print("ValueError:", e)
print(progress.open_debug_log(sys.argv[2]))
"""


def test_a_debug_log_that_cannot_be_written_is_one_error_naming_the_key_and_loses_no_record(tmp_path):
    """A log directory under a regular file: a ``ValueError`` naming ``trainer.log_dir`` and the path (the
    command prints it as one ``error:`` line, exit 2), not a traceback; the records buffered so far still
    reach a debug log opened afterwards."""
    import subprocess

    (tmp_path / "afile").write_text("a regular file")
    r = subprocess.run([sys.executable, "-c", UNWRITABLE_LOG_SCRIPT, str(tmp_path / "afile"), str(tmp_path / "ok")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == (f"ValueError: trainer.log_dir: cannot write the debug log {tmp_path}/afile/logs/run/debug.log "
                        "(Not a directory). Choose a writable directory.")
    assert lines[1] == (f"ValueError: cannot write the debug log {tmp_path}/afile/logs/cache_dataset/debug.log "
                        "(Not a directory). Run cache_dataset from a writable directory.")
    assert lines[2] == str(tmp_path / "ok" / "debug.log")
    assert "a record from before" in (tmp_path / "ok" / "debug.log").read_text()


def test_a_terminal_of_size_zero_gets_progress_lines(monkeypatch):
    # script -c CMD > file gives the process a pseudo-terminal of size 0x0: isatty() is true, but tqdm draws
    # nothing at width 0, so the run shows the plain progress lines instead of a bar.
    import fcntl
    import select
    import struct
    import termios

    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        tty = os.fdopen(slave, "w", closefd=False)
        assert tty.isatty()
        p = progress.RunProgress(3, 0, interval_s=0, out=tty, err=tty)
        assert p.bar is None and p.lines
        for s in range(3):
            p.step(s, 2.0, 10, 0.01, 0.0)
        tty.flush()
        shown = ""
        while select.select([master], [], [], 1.0)[0]:
            shown += os.read(master, 65536).decode()
        assert [line.split(" loss")[0] for line in shown.splitlines()] == ["step 1/3", "step 2/3", "step 3/3"], shown
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        sized = progress.RunProgress(3, 0, interval_s=0, out=tty, err=tty)
        assert sized.bar is not None and not sized.lines  # the same terminal with a size: the bar
        sized.close()
    finally:
        os.close(slave)
        os.close(master)
