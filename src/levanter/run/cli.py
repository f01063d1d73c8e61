"""The command line every entry point shares: the mapping of failures to exit statuses (:func:`cli_errors`,
``docs/reference/errors.md``), ``--help`` and the parse of a config (:func:`run_config_command`), and what
``python -m levanter.main.<entry>`` does once imported (:func:`start_command`).

The statuses are the same for every entry point, so a launch script can tell "fix the config" (2) from
"the run failed" (1) and "out of space" (74) without knowing which command it ran; the price is one list of
exception types here that every part's user-facing errors must belong to.
"""

from __future__ import annotations

__all__ = ["cli_errors", "run_config_command", "start_command"]

import contextlib
import logging
import os
import sys
from typing import Callable

from levanter.checkpoint import CheckpointSaveError
from levanter.data.load_errors import DataLoadError
from levanter.distributed import DistributedStartupError
from levanter.errors import OUT_OF_SPACE_EXIT_CODE, OutOfSpaceError, ReadOnlyStorageError
from levanter.tracker import TrackerError
from levanter.training import DataEndedError

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def cli_errors(interrupted: str = "interrupted before training started: nothing was saved"):
    """Around an entry point's work: user errors (bad config values, missing or damaged files) print one
    ``error:`` paragraph and exit with status 2; a full disk or a read-only filesystem exits with 74; run
    failures (a coordinator that never answered, unreadable data, a NaN loss, a failed save) exit with 1;
    Ctrl-C before the step loop prints ``interrupted`` and exits with 130. None prints a traceback (``docs/reference/errors.md``)."""
    from levanter.memory import device_oom_as_error

    try:
        with device_oom_as_error():  # a device out of memory the up-front check did not foresee: exit 2
            yield
    except (OutOfSpaceError, ReadOnlyStorageError) as e:  # a full disk or read-only storage: fix it and rerun
        print(f"error: {e}", file=sys.stderr)
        sys.exit(OUT_OF_SPACE_EXIT_CODE)
    except (ValueError, FileNotFoundError) as e:  # bad config or input: fix it and rerun
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the step loop (which checkpoints on it) or while it cleans up
        print(interrupted, file=sys.stderr)
        sys.exit(130)
    except (DistributedStartupError, DataLoadError, DataEndedError, FloatingPointError,
            CheckpointSaveError, TrackerError) as e:
        # the run failed (a coordinator that never answered, unreadable data, a NaN loss, a failed save)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def run_config_command(module_name: str, cli_main: Callable, argv=None) -> None:
    """The command line of an entry point whose work is ``cli_main`` (a :func:`levanter.config.main`
    function): ``--help`` (or ``-h``) prints the keys of the config of ``module_name``'s ``cli_main`` and
    exits 0; anything else is parsed and run under :func:`cli_errors`."""
    import levanter.config

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        levanter.config.print_help(sys.modules[module_name])
        sys.exit(0)
    with cli_errors():
        cli_main(argv=argv)


def start_command(cli: Callable[[], None]) -> None:
    """What ``python -m levanter.main.<entry>`` does once imported: console logging (levanter's INFO on the
    console, every record in the run's debug log), a debug line when the process re-executed itself for
    huge-page malloc (:mod:`levanter.utils.malloc`), then ``cli()``."""
    from levanter.progress import setup_console_logging
    from levanter.utils.malloc import MARKER

    setup_console_logging()
    if os.environ.get(MARKER) == "1":
        logger.debug("re-executed with GLIBC_TUNABLES=%s (levanter/utils/malloc.py; LEVANTER_MALLOC_HUGETLB=0 "
                     "turns this off)", os.environ.get("GLIBC_TUNABLES"))
    cli()
