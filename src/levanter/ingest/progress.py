"""What a cache build tells its user while it runs: a progress bar on a terminal, log lines elsewhere.

On a terminal (stderr is a TTY of non-zero width) a tqdm bar shows documents, tokens, tokens/s, shards done and an ETA;
when stderr is a file or a pipe (a batch job, CI) a bar would write thousands of carriage returns into
the log, so one INFO line is logged every ``interval_s`` seconds instead. Either way the build ends with
one summary line: documents and tokens of the cache, the time taken and the throughput.

The ETA is extrapolated from the bytes of input shards finished so far (documents vary too much in
length to extrapolate from counts); it is unknown until the first shard is done. Nothing here changes
what is written: the progress reporter only observes commits.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["BuildProgress"]

logger = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class BuildProgress:
    """Counts one cache build's commits and reports them (bar or periodic log lines, then a summary).

    ``label`` names the cache in every line; ``shard_bytes`` maps each shard still to be built to its size
    (for the ETA); ``docs``/``tokens`` are what an interrupted build had committed before this run (the
    throughput counts only this run's tokens). ``terminal`` overrides the TTY detection.
    """

    def __init__(
        self,
        label: str,
        *,
        shard_bytes: dict[str, int],
        shards_total: int,
        docs: int = 0,
        tokens: int = 0,
        backend: str = "process",
        enabled: bool = True,
        terminal: bool | None = None,
        interval_s: float = 10.0,
    ):
        self.label = label
        self.backend = backend
        self.docs, self.tokens = docs, tokens
        self._tokens_at_start = tokens
        self._shard_bytes = dict(shard_bytes)
        self._bytes_total = sum(shard_bytes.values())
        self._bytes_done = 0
        self.shards_total = shards_total
        self.shards_done = shards_total - len(shard_bytes)
        self._enabled = enabled
        self._interval = interval_s
        self._t0 = time.perf_counter()
        self._last_log = self._t0
        self._bar = None
        if terminal is None:
            from ..utils.terminal import draws_bars

            terminal = draws_bars(sys.stderr)  # a TTY of size 0x0 draws no bar: log lines instead
        if enabled and terminal:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=f"caching {label}", unit=" docs", initial=docs, file=sys.stderr)
            self._refresh_bar()

    # -- what the builder calls -------------------------------------------------------------------------
    def committed(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(docs)
            self._refresh_bar()
        elif self._enabled and time.perf_counter() - self._last_log >= self._interval:
            self._last_log = time.perf_counter()
            logger.info("caching %s: %s", self.label, self.status())

    def shard_done(self, shard: str) -> None:
        self.shards_done += 1
        self._bytes_done += self._shard_bytes.get(shard, 0)
        if self._bar is not None:
            self._refresh_bar()

    def close(self, *, finished: bool) -> None:
        """Close the bar; a finished build logs its summary line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if finished and self._enabled:
            logger.info("%s", self.summary())

    # -- the figures ---------------------------------------------------------------------------------------
    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self._t0

    def tokens_per_s(self) -> float:
        return (self.tokens - self._tokens_at_start) / max(self.elapsed_s, 1e-9)

    def eta_s(self) -> float | None:
        """Seconds left, from the input bytes of the shards finished in this run (None: not known yet)."""
        if self._bytes_done <= 0 or self._bytes_total <= 0:
            return None
        left = self._bytes_total - self._bytes_done
        return self.elapsed_s * left / self._bytes_done

    def status(self) -> str:
        eta = self.eta_s()
        return (
            f"{self.docs:,} docs, {self.tokens:,} tokens, {self.tokens_per_s():,.0f} tokens/s, "
            f"{self.shards_done}/{self.shards_total} shards, ETA {'?' if eta is None else _duration(eta)}"
        )

    def summary(self) -> str:
        return (
            f"cached {self.label}: {self.docs:,} docs, {self.tokens:,} tokens in {_duration(self.elapsed_s)} "
            f"({self.tokens_per_s():,.0f} tokens/s, {self.backend} backend)"
        )

    def _refresh_bar(self) -> None:
        eta = self.eta_s()
        self._bar.set_postfix(
            tokens=f"{self.tokens:,}",
            tok_per_s=f"{self.tokens_per_s():,.0f}",
            shards=f"{self.shards_done}/{self.shards_total}",
            eta="?" if eta is None else _duration(eta),
            refresh=False,
        )
