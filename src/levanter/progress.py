"""What a training run shows while it runs: a progress bar or progress lines, eval losses, the summary,
and where the details go (the debug log).

Two kinds of output, chosen per stream:

* On a terminal (stderr is a TTY of non-zero width: a pseudo-terminal of size 0x0, as ``script -c ... >
  file`` gives, counts as a file, since tqdm draws nothing there), a ``tqdm`` bar on stderr; while it is shown, log records go through
  ``tqdm.write`` (:func:`tqdm.contrib.logging.logging_redirect_tqdm`), so a line never glues onto the bar,
  and the bar is closed exactly once.
* Elsewhere (a file, a pipe, a batch job's log), a bar would print nothing useful until it ends, so a
  plain line is printed to stdout every ``trainer.progress_interval`` (and for the first and last step):
  ``step 120/300 loss 2.4312 | 23,456 tok/s | data wait 0.4 ms/step | ETA 1m12s``. The ETA is the
  remaining steps at the pace since the previous line, which never includes the process's first step (its
  compile); the first step's line says ``ETA after step 2`` instead. When stdout is not a terminal these
  lines are printed even if a bar is shown on stderr (``train_lm ... > run.log``).

Whatever the output, every evaluation's losses (``eval/...`` metrics, one line) and an end-of-run summary
(steps, final train loss, the time from the process's start to its first step, last eval losses, wall time,
tokens/s, where metrics and checkpoints went) are printed to stdout.

The console shows INFO records of ``levanter`` and warnings of everything else; third-party libraries'
INFO chatter (JAX's "Unable to initialize backend 'tpu'", say) goes only to the debug log,
``<trainer.log_dir>/<run id>/debug.log``, which holds every record at DEBUG level from the start of the
process (the last 10,000 records before the run's id is known are kept in memory, then written). The
trade-off: a process that dies before its run id is known leaves no debug log; the console still shows
its errors. A debug log that cannot be written (a full disk) drops its records quietly (:class:`_DebugLog`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, TextIO

__all__ = [
    "setup_console_logging",
    "open_debug_log",
    "open_command_debug_log",
    "format_eval",
    "RunProgress",
    "DEBUG_LOG_NAME",
    "seconds_since_process_start",
]

CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEBUG_LOG_NAME = "debug.log"
_BUFFER_CAPACITY = 10_000


class _ConsoleFilter(logging.Filter):
    """INFO and above from ``levanter`` and ``__main__``; WARNING and above from everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if record.levelno < logging.INFO:
            return False
        name = record.name
        return name == "__main__" or name == "levanter" or name.startswith("levanter.")


class _Buffer(logging.Handler):
    """The records logged before the debug log's directory is known: the last ``capacity`` of them (a
    process that never opens a debug log keeps a bounded amount)."""

    def __init__(self, capacity: int):
        super().__init__(logging.DEBUG)
        self.records: collections.deque = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_buffer: Optional[_Buffer] = None


class _DebugLog(logging.FileHandler):
    """The run's ``debug.log``. A record that cannot be written (the log's disk is full, the file went
    away) is dropped rather than reported with logging's own "--- Logging error ---" traceback: the debug
    log usually shares its disk with the checkpoints and caches, whose writes report a full disk once,
    with exit status 74, and a record emitted in between must not add a traceback beside that message.
    Another I/O error is said once, in one line."""

    _warned = False

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)  # a broken log call (bad format arguments): a bug to see
            return
        if self._warned or getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return
        self._warned = True
        print(f"warning: cannot write the debug log {self.baseFilename} ({err.strerror or err}); its records "
              "are dropped", file=sys.stderr)


def setup_console_logging() -> None:
    """Log to stderr (:class:`_ConsoleFilter`) and buffer every record for the debug log, which
    :func:`open_debug_log` writes once the run's directory is known. Called once, by a command's
    ``__main__``; library code never configures logging."""
    global _buffer
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    console.addFilter(_ConsoleFilter())
    root.addHandler(console)
    _buffer = _Buffer(_BUFFER_CAPACITY)
    root.addHandler(_buffer)


def open_debug_log(directory: str, key: Optional[str] = "trainer.log_dir",
                   fix: str = "Choose a writable directory.") -> Optional[str]:
    """Write the buffered records, and every later one, to ``<directory>/debug.log`` (appended to, so that
    a resumed run keeps its earlier attempts' records); returns its path, or None when console logging
    was not set up by :func:`setup_console_logging` (``main`` called from Python) or the directory is on
    an object store (which cannot be appended to). A directory that cannot be written is a ``ValueError``
    naming ``key`` (the setting that chose it, if any) and saying ``fix``; a full disk an
    :class:`~levanter.errors.OutOfSpaceError`."""
    global _buffer
    if _buffer is None:
        return None
    root = logging.getLogger()
    if "://" in directory:
        root.removeHandler(_buffer)
        _buffer = None
        return None
    path = os.path.join(directory, DEBUG_LOG_NAME)
    try:
        os.makedirs(directory, exist_ok=True)
        handler = _DebugLog(path, encoding="utf-8")
    except OSError as e:
        from levanter.errors import is_out_of_space, out_of_space_error

        if is_out_of_space(e):
            raise out_of_space_error("opening the debug log", path) from None
        prefix = f"{key}: " if key else ""
        raise ValueError(f"{prefix}cannot write the debug log {path} ({e.strerror or e}). {fix}") from None
    buffer, _buffer = _buffer, None
    root.removeHandler(buffer)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    for record in buffer.records:
        handler.handle(record)
    root.addHandler(handler)
    return path


def open_command_debug_log(command: str, log_dir: str = "logs") -> Optional[str]:
    """The debug log of a command that has no run of its own (``cache_dataset``, ``export_lm_to_hf``):
    ``<log_dir>/<command>/debug.log``, appended to by every invocation (each record carries its process id).
    None when console logging was not set up (the command called from Python)."""
    return open_debug_log(os.path.join(log_dir, command), key=None, fix=f"Run {command} from a writable directory.")


_IMPORTED = time.monotonic()  # the fallback origin of seconds_since_process_start


def seconds_since_process_start() -> float:
    """Seconds since this process started (the kernel's start time: interpreter start-up, imports and a
    re-exec for huge-page malloc included, which keeps the process); where ``/proc`` cannot say (not
    Linux), since this module was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks after boot
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_eval(step: int, metrics: Mapping[str, Any]) -> Optional[str]:
    """One line of an evaluation's ``eval/...`` metrics: ``eval at step 100: loss 2.41 | python-docs/loss
    2.30 | ...`` (the overall ``eval/loss`` first); None if there are none. The averaged weights' metrics
    (``eval/ema/...``, ``trainer.model_averaging``) print as ``eval of the averaged weights at step 100: ...``."""
    prefix, label = "eval/", "eval"
    if _is_averaged_eval(metrics):  # trainer.model_averaging's evaluation, logged as eval/ema/...
        prefix, label = "eval/ema/", "eval of the averaged weights"
    items = [(k[len(prefix):], v) for k, v in metrics.items() if k.startswith(prefix)]
    if not items:
        return None
    items.sort(key=lambda kv: (kv[0] != "loss", kv[0]))
    parts = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in items]
    return f"{label} at step {step}: " + " | ".join(parts)


def _is_averaged_eval(metrics: Mapping[str, Any]) -> bool:
    keys = [k for k in metrics if k.startswith("eval/")]
    return bool(keys) and all(k.startswith("eval/ema/") for k in keys)


class RunProgress:
    """The console side of one training run: :meth:`step` after every step, :meth:`eval` after every
    evaluation, :meth:`summary` at the end, :meth:`close` however the run ends (the bar closes once).

    ``interval_s``: seconds between progress lines (0: every step). ``out``/``err``: the streams (stdout
    and stderr by default); ``enabled=False`` (processes other than the first) prints nothing.
    """

    def __init__(self, total: int, start_step: int, *, interval_s: float, enabled: bool = True,
                 out: Optional[TextIO] = None, err: Optional[TextIO] = None):
        self.total = total
        self.start_step = start_step
        self.interval_s = interval_s
        self.enabled = enabled
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.bar = None
        self._closed = False
        if enabled and _isatty(self.err):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start_step, desc="train", unit="step", file=self.err,
                            dynamic_ncols=True)
        self.lines = enabled and (self.bar is None or not _isatty(self.out))
        self._t_start = time.perf_counter()
        self._t_last_line = -math.inf
        # accumulated since the last progress line
        self._steps = 0
        self._tokens = 0
        self._seconds = 0.0
        self._wait = 0.0
        # over the whole run
        self.steps_done = 0
        self.tokens_done = 0
        self.train_seconds = 0.0
        self._steady_tokens = 0
        self._steady_seconds = 0.0
        self.last_loss: Optional[float] = None
        self.last_step: Optional[int] = None
        self.last_eval: Optional[tuple[int, Dict[str, Any]]] = None
        # seconds from process start until the first step of this process was done (its compiles included)
        self.time_to_first_step: Optional[float] = None

    @contextlib.contextmanager
    def logging_around_bar(self) -> Iterator[None]:
        """Within this block, log records print above the bar instead of onto it."""
        if self.bar is None:
            yield
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm():
            yield

    def _print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def step(self, step: int, loss: float, tokens: int, seconds: float, wait_seconds: float) -> None:
        """Record step ``step`` (0-based): its loss, tokens trained on, seconds taken and data wait."""
        self._steps += 1
        self._tokens += tokens
        self._seconds += seconds
        self._wait += wait_seconds
        self.steps_done += 1
        if self.steps_done == 1:
            self.time_to_first_step = seconds_since_process_start()
        self.tokens_done += tokens
        self.train_seconds += seconds
        if self.steps_done > 1:  # the first step of a process includes compiling it
            self._steady_tokens += tokens
            self._steady_seconds += seconds
        self.last_loss, self.last_step = loss, step
        if self.bar is not None:
            tok_s = f"{tokens / max(seconds, 1e-9):,.0f}"
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=tok_s, refresh=False)
            self.bar.update(1)
        if not self.lines:
            return
        now = time.perf_counter()
        done = step + 1
        if now - self._t_last_line < self.interval_s and done != self.total and self.steps_done != 1:
            return
        self._t_last_line = now
        tok_s = self._tokens / max(self._seconds, 1e-9)
        step_s = self._seconds / max(self._steps, 1)
        if done >= self.total:
            eta = "ETA 0s"
        elif self.steps_done == 1:
            # the process's first step includes compiling it: an ETA at its pace would be many times too long
            eta = f"ETA after step {done + 1}"
        else:
            # the window since the previous line, which is never the first step (that one always has a line)
            eta = f"ETA {_duration((self.total - done) * step_s)}"
        self._print(
            f"step {done}/{self.total} loss {loss:.4f} | {tok_s:,.0f} tok/s | {step_s:.3f} s/step | "
            f"data wait {1000 * self._wait / max(self._steps, 1):.1f} ms/step | {eta}"
        )
        self._steps, self._tokens, self._seconds, self._wait = 0, 0, 0.0, 0.0

    def eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Print one evaluation's losses."""
        line = format_eval(step, metrics)
        if line is None:
            return
        if not _is_averaged_eval(metrics):  # the summary's last eval is the trained weights'
            self.last_eval = (step, dict(metrics))
        self._print(line)

    def summary(self, *, final_step: int, where: List[str], warnings: List[str] = ()) -> None:
        """Print the end-of-run summary; ``where``: lines saying where metrics and checkpoints went;
        ``warnings``: what the run did that its config did not ask for (skipped steps, say), a line each."""
        wall = time.perf_counter() - self._t_start
        if self._steady_seconds > 0:
            tok_s = self._steady_tokens / self._steady_seconds
            speed = f"{tok_s:,.0f} tokens/s after the first step's compile"
        else:
            speed = f"{self.tokens_done / max(self.train_seconds, 1e-9):,.0f} tokens/s"
        lines = [f"finished at step {final_step}/{self.total}: trained {self.steps_done} step(s) in "
                 f"{_duration(wall)} (wall), {speed}"]
        if self.last_loss is not None:
            lines.append(f"  final train loss {self.last_loss:.4f} (step {self.last_step})")
        if self.time_to_first_step is not None:
            lines.append(f"  first step done {_duration(self.time_to_first_step)} after the process started "
                         "(start-up and compiles)")
        if self.last_eval is not None:
            lines.append("  last " + format_eval(*self.last_eval))
        lines.extend(f"  warning: {w}" for w in warnings)
        lines.extend(f"  {w}" for w in where)
        self.close()
        for line in lines:
            self._print(line)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _isatty(stream) -> bool:
    """A terminal a bar can be drawn on: a TTY of size 0x0 (``script -c ... > file``) counts as a file."""
    from .utils.terminal import draws_bars

    return draws_bars(stream)
