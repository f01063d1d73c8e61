"""JAX's persistent compilation cache, on by default for the training and evaluation runs.

A run compiles its programs (the initialisation, the train step, the evaluation's sums) before its first
step: minutes for a 350M Llama on a TPU chip, paid again by every relaunch of the same config, which a
preempted slice relaunches often. JAX can keep each compiled executable in a directory, keyed by the
program, its compile options, the devices and the JAX and jaxlib versions, and load it on the next launch
instead of compiling; a key that differs in any of these is simply a miss, so sharing one directory
between runs and configs is safe. ``train_lm``, ``sft``, ``lora_lm`` and ``eval_lm`` call
:func:`use_compilation_cache` with ``trainer.jax_compilation_cache_dir`` (upstream Levanter's key):

* a directory, or a ``gs://`` / ``s3://`` URL: the cache goes there;
* ``off`` (or ``false``, which is what YAML makes of a bare ``off``): no persistent cache (every launch
  compiles everything);
* null (the default): a directory set before the run starts is kept (``JAX_COMPILATION_CACHE_DIR`` in the
  environment, or ``jax.config.update("jax_compilation_cache_dir", ...)`` by a program that calls ``main``),
  else ``<trainer.checkpointer.base_path>/jax-cache``.

Why beside the checkpoints, rather than in the user's home (``~/.cache``): a relaunch finds its checkpoints
there, so it finds the cache too, with one rule for every kind of storage: checkpoints on ``gs://`` put the
cache in the same bucket, shared by every host of a slice and by relaunches on fresh machines (a home
directory on a preempted TPU VM is gone with it). The space it takes shows where the run's outputs are and
goes when they are deleted, and runs writing to scratch directories (tests, benchmarks) never fill a home
directory. The cost: runs with different ``base_path`` values do not share programs (set the key to one
directory to share them). JAX never evicts entries; deleting the directory is safe at any time.

What is stored: programs that took at least :data:`MIN_COMPILE_SECONDS` (0.1 s) to compile, of any size
(``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` / ``..._MIN_ENTRY_SIZE_BYTES`` in the environment, or
``trainer.jax_config``, override both). JAX's own threshold, 1 s, keeps the programs that matter most (GPT-2
small on a TPU v5e chip: the train step 46 s, the initialisation 14 s, the evaluation 9 s) but compiles
again, at every launch, the dozen programs of 0.1-0.7 s (random keys, the step's finite check), about 3 s;
below 0.1 s (elementwise programs of a few tens of milliseconds) a fetch from an object store costs about as
much as the compile. JAX caches on TPU, GPU and CPU alike (JAX 0.10.2); only process 0 of a multi-process
run writes entries, every process reads them.

A directory that cannot be written is an error naming the key (or the environment variable) before any
work: JAX itself would only warn at each write and go on compiling everything, which is the slow start
the cache exists to remove. :class:`CacheStats` counts what the cache did (from JAX's monitoring events),
for the run's summary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Optional

from . import fs

__all__ = [
    "OFF",
    "DEFAULT_NAME",
    "ENV_VAR",
    "MIN_COMPILE_SECONDS",
    "CacheStats",
    "default_cache_dir",
    "resolve_cache_dir",
    "use_compilation_cache",
    "cache_stats",
]

logger = logging.getLogger(__name__)

OFF = "off"  # trainer.jax_compilation_cache_dir: no persistent cache
DEFAULT_NAME = "jax-cache"  # the default's folder under trainer.checkpointer.base_path
ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
KEY = "trainer.jax_compilation_cache_dir"
# Programs that compile faster than this are not written: fetching one from an object store costs about as
# much. JAX's own default (1 s) would leave out programs of 0.1-0.9 s that a run compiles every launch.
MIN_COMPILE_SECONDS = 0.1
_MIN_TIME_OPTION = "jax_persistent_cache_min_compile_time_secs"
_MIN_SIZE_OPTION = "jax_persistent_cache_min_entry_size_bytes"
_MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_MIN_SIZE_ENV = "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"

# The directory this module last pointed JAX at (a run's, from Python): told apart from one the calling
# program set itself, which a later run with the key null keeps.
_last_set: Optional[str] = None


def default_cache_dir(checkpoint_base_path: str) -> Optional[str]:
    """``<checkpoint_base_path>/jax-cache`` (made absolute when local); None for an in-memory
    (``memory://``) checkpoint path, which JAX cannot use and which no relaunch finds again."""
    if fs.url_scheme(checkpoint_base_path) == "memory":
        return None
    return fs.join(fs.abspath(checkpoint_base_path), DEFAULT_NAME)


def resolve_cache_dir(value: Optional[str], checkpoint_base_path: str) -> tuple[Optional[str], str]:
    """``(directory or None, where it came from)`` for ``trainer.jax_compilation_cache_dir = value``: the
    value itself (``"key"``), None for ``off`` (``"key"``), else a directory set before the run (the
    environment's ``JAX_COMPILATION_CACHE_DIR``: ``"env"``; JAX's option, set by the calling program:
    ``"jax"``), else the default beside the checkpoints (``"default"``)."""
    import jax

    if value is not None and str(value).strip().lower() in (OFF, "false"):  # YAML reads a bare off as false
        return None, "key"
    if value:
        return fs.expand_user(value), "key"
    env = os.environ.get(ENV_VAR)
    if env:
        return fs.expand_user(env), "env"
    current = jax.config.jax_compilation_cache_dir
    if current and current != _last_set:
        return current, "jax"
    return default_cache_dir(checkpoint_base_path), "default"


def use_compilation_cache(value: Optional[str], checkpoint_base_path: str, *, check: bool = True) -> Optional[str]:
    """Point JAX's persistent compilation cache where ``trainer.jax_compilation_cache_dir = value`` says
    (:func:`resolve_cache_dir`) and set what it stores; returns the directory, or None when it is off. With
    ``check``, the directory is created and a probe file written and deleted first: one that cannot be
    written is a ``ValueError`` naming the setting that chose it. Call before the run compiles its
    programs; calling it again with another directory (runs started from Python one after another)
    switches JAX to it. Every call starts counting :func:`cache_stats` afresh."""
    global _last_set
    import jax

    directory, source = resolve_cache_dir(value, checkpoint_base_path)
    if directory is not None and not fs.is_url(directory):
        directory = fs.abspath(directory)
    cache_stats().reset(directory)
    if directory is None:
        _switch(None)
        _last_set = None
        logger.info("persistent compilation cache: off (%s)", KEY if value else "a memory:// checkpoint path")
        return None
    if check:
        _check_writable(directory, source)
    _switch(directory)
    _last_set = directory
    # What is stored (module docstring): set unless the environment or the program chose other thresholds.
    if _MIN_TIME_ENV not in os.environ and getattr(jax.config, _MIN_TIME_OPTION) == 1.0:  # JAX's default
        jax.config.update(_MIN_TIME_OPTION, MIN_COMPILE_SECONDS)
    if _MIN_SIZE_ENV not in os.environ and getattr(jax.config, _MIN_SIZE_OPTION) == 0:
        jax.config.update(_MIN_SIZE_OPTION, -1)  # no minimum size (-1: nor may JAX raise one)
    logger.info("persistent compilation cache: %s (%s)", fs.redact(directory), _SOURCES[source])
    return directory


_SOURCES = {
    "key": KEY,
    "env": ENV_VAR,
    "jax": "jax_compilation_cache_dir, set before the run",
    "default": f"{KEY} is null: beside trainer.checkpointer.base_path",
}


def _switch(directory: Optional[str]) -> None:
    """Set JAX's cache directory (None: none) and, if it changes, let JAX open the new one: JAX opens its
    cache once per process, at the first compile after a directory is set."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    enabled = directory is not None
    if jax.config.jax_compilation_cache_dir == directory and jax.config.jax_enable_compilation_cache == enabled:
        return
    jax.config.update("jax_enable_compilation_cache", enabled)
    jax.config.update("jax_compilation_cache_dir", directory)
    cc.reset_cache()


def _check_writable(directory: str, source: str) -> None:
    """A probe file written and deleted in ``directory`` (created if missing); a ``ValueError`` naming the
    setting that chose it (``source``, :func:`resolve_cache_dir`) and the fix if that fails."""
    try:
        if fs.is_url(directory):
            fs.check_access(directory, None, write=True)
        else:
            fs.probe_writable(directory)
    except (OSError, ValueError) as e:
        from levanter.errors import is_out_of_space, out_of_space_error

        if isinstance(e, OSError) and is_out_of_space(e):
            raise out_of_space_error("creating the persistent compilation cache", directory) from None
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        where = fs.redact(directory)
        fix = f"set {KEY} to a writable directory (or gs:// URL), or to {OFF} to compile at every launch"
        if source == "env":
            head, fix = f"{ENV_VAR}={where}", f"Point {ENV_VAR} at a writable directory, or unset it and {fix}."
        elif source == "default":
            head, fix = (f"{KEY} is null, so the persistent compilation cache goes beside "
                         f"trainer.checkpointer.base_path, to {where}",
                         f"Choose a writable trainer.checkpointer.base_path, or {fix}.")
        elif source == "jax":
            head, fix = f"jax_compilation_cache_dir={where} (set before the run)", f"Change it, or {fix}."
        else:
            head, fix = f"{KEY}={where}", fix[0].upper() + fix[1:] + "."
        raise ValueError(f"{head}: cannot write the persistent compilation cache there ({why}). {fix}") from None


@dataclasses.dataclass
class CacheStats:
    """What the persistent cache did since :func:`use_compilation_cache` (JAX's monitoring events):
    ``lookups`` (compiles that asked the cache), ``hits`` (executables loaded instead of compiled),
    ``written`` (entries added) and ``seconds_saved`` (the compile time the hits recorded, less the time to
    load them)."""

    directory: Optional[str] = None
    lookups: int = 0
    hits: int = 0
    written: int = 0
    seconds_saved: float = 0.0

    def reset(self, directory: Optional[str]) -> None:
        self.directory, self.lookups, self.hits, self.written, self.seconds_saved = directory, 0, 0, 0, 0.0

    def summary(self) -> Optional[str]:
        """One line for the run's summary; None when the cache is off."""
        if self.directory is None:
            return None
        return (f"compilation cache: {fs.redact(self.directory)} ({self.hits} of {self.lookups} programs loaded, "
                f"{self.seconds_saved:.0f}s of compiling saved; {self.written} written)")

    def _on_event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            self.lookups += 1
        elif event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":  # JAX records it when it writes an entry
            self.written += 1

    def _on_duration(self, event: str, duration_secs: float, **kwargs) -> None:
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            self.seconds_saved += max(duration_secs, 0.0)


_stats: Optional[CacheStats] = None
_stats_lock = threading.Lock()


def cache_stats() -> CacheStats:
    """The process's :class:`CacheStats` (its listeners registered with JAX on first use)."""
    global _stats
    with _stats_lock:
        if _stats is None:
            import jax.monitoring

            _stats = CacheStats()
            jax.monitoring.register_event_listener(_stats._on_event)
            jax.monitoring.register_event_duration_secs_listener(_stats._on_duration)
        return _stats
