"""Whether a stream is a terminal that a progress bar can be drawn on.

A bar needs a TTY of non-zero width. ``script -c CMD > file`` (and some CI runners) give the process a
pseudo-terminal of size 0x0: ``isatty()`` is true, yet tqdm, sizing its bar to the width, draws nothing
at all. Such a stream is treated like a file or a pipe: the caller prints plain progress lines instead, so
a run is never silent. A TTY whose size cannot be asked (a stream without a file descriptor) is trusted.
"""

from __future__ import annotations

import io
import os

__all__ = ["draws_bars"]


def draws_bars(stream) -> bool:
    """True when ``stream`` is a terminal whose width is not known to be zero."""
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, io.UnsupportedOperation, OSError, ValueError):  # no descriptor or size to ask
        return True
