"""Plan a run's data without training: ``python -m levanter.main.data_schedule --config_path X``.

Options: ``--steps N`` (plan N steps instead of ``trainer.num_train_steps``), ``--dump START:END
FILE.jsonl`` (one JSON line per position of steps ``[START, END)``: global index, source, source index,
store row), ``--plot FILE.png`` (stacked per-step composition by source, with the stage boundaries).
Other ``--a.b value`` arguments override the config as in ``train_lm``.

``X`` is a whole ``train_lm`` config: the plan needs ``trainer.train_batch_size``,
``trainer.num_train_steps``, ``trainer.seed`` / ``data_seed`` and ``model.seq_len`` as well as ``data``.
A data-only config (the ``data:`` section alone, as ``cache_dataset`` takes) is planned with
``--batch_size N --num_train_steps N`` (both required then) and ``--seq_len N`` (default: train_lm's
default model's); its overrides are written without the ``data.`` prefix (``--cache_dir /tmp/c``).
The training set is built exactly as ``train_lm`` builds it (same ``train_set`` call, same key from
the same :func:`levanter.lm_config.data_key`), so the plan is what training will read. Building it needs
the sources' lengths, so missing token caches are built first (as training would); no accelerator
and no model are involved.

The numbers come from :mod:`levanter.data.planner` in closed form, so planning a million steps takes
about as long as planning ten. ``main(config, ...)`` returns what it printed, as a dict, for tests and
scripts. User errors (missing ``--config_path``, bad values, a bad dump range) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from levanter.config import ConfigError, parse_config, split_config_path

if TYPE_CHECKING:
    from levanter.data.planner import DataPlan

__all__ = ["format_plan", "write_dump", "write_plot", "main", "config_doc", "load_config", "cli"]

# The planner (jax, the datasets) and the run config are imported where used, so that a usage error is
# reported in a fraction of a second instead of after seconds of imports.

logger = logging.getLogger(__name__)


# -- formatting ---------------------------------------------------------------------------------------
def _n(x) -> str:
    return "-" if x is None else f"{x:,}"


def _f(x, digits=4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _steps(first: int, last: Optional[int]) -> str:
    return f"from step {first:,}, not reached" if last is None else f"steps {first:,}..{last:,}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    # First column left-aligned (names), numbers right-aligned.
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def format_plan(plan: DataPlan) -> str:
    """The human-readable plan: a header, one table per stage, the sources' totals and events."""
    out = []
    sizes = ", ".join(
        f"{bs} from step {lo:,}" if lo else f"{bs}" for lo, _, bs in plan.batch_segments
    )
    kind = f"mixture of {len(plan.sources)} sources" if plan.is_mixture else "single source"
    out.append(f"data plan: {plan.num_steps:,} steps, batch size {sizes}, seq_len {plan.seq_len}, {kind}")
    if plan.is_mixture:
        block = "None (every batch's composition exact)" if plan.block_size is None else f"{plan.block_size}"
        out.append(f"  stop_strategy {plan.stop_strategy}, mixture_block_size {block}")
    if plan.end_step == 0:
        out.append(f"  the data ends before step 0 can be filled ({plan.ended_by or 'a source'} exhausted)")
    elif plan.end_step is not None:
        out.append(
            f"  the data ends at step {plan.end_step:,} ({plan.ended_by or 'a source'} exhausted): "
            f"training stops after step {plan.end_step - 1:,}, {plan.num_steps - plan.end_step:,} steps early"
        )
    for st in plan.stages:
        out.append("")
        span = _steps(st.first_step, st.last_step)
        out.append(
            f"stage {st.index}: {span} ({st.steps:,} steps, {st.sequences:,} sequences, {st.tokens:,} tokens)"
        )
        rows = [
            [
                s.source,
                _n(s.sequences),
                _n(s.tokens),
                _f(s.target_fraction),
                _f(s.achieved_fraction),
                _f(s.epochs, 3),
                _f(s.cumulative_epochs, 3),
            ]
            for s in st.sources
        ]
        out += _table(["source", "sequences", "tokens", "target", "achieved", "epochs", "cum. epochs"], rows)
    out.append("")
    out.append(f"sources over steps 0..{plan.steps - 1:,}:" if plan.steps else "sources:")
    # A single source wraps too when train_lm's epoch repeats it.
    wrap_col = plan.stop_strategy in ("restart", "all_exhausted") or any(s.wrap_step is not None for s in plan.sources)
    exhaust_col = plan.stop_strategy in (None, "first_exhausted", "all_exhausted")
    header = ["source", "length (seqs)", "tokens", "drawn", "epochs"]
    if wrap_col:
        header.append("first wrap")
    if exhaust_col:
        header.append("exhausted")
    rows = []
    for s in plan.sources:
        r = [s.name, _n(s.length), _n(s.tokens_available), _n(s.sequences), _f(s.epochs, 3)]
        if wrap_col:
            r.append("never" if s.wrap_step is None else f"step {s.wrap_step:,}")
        if exhaust_col:
            r.append("never" if s.exhausted_step is None else f"step {s.exhausted_step:,}")
        rows.append(r)
    out += _table(header, rows)
    return "\n".join(out)


# -- outputs ------------------------------------------------------------------------------------------
def write_dump(train_set, schedule, start: int, end: int, path: str) -> int:
    """Write :func:`planner.dump_rows` as JSON lines; returns the number of rows."""
    from levanter.data import planner

    n = 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in planner.dump_rows(train_set, schedule, start, end):
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def write_plot(plan: DataPlan, segments, path: str) -> None:
    """Stacked areas of sequences per step by source (one flat piece per constant-count segment), with
    dashed vertical lines at stage starts."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'levanter[plot]'") from None
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt
    import numpy as np

    if not segments:
        raise ValueError("--plot: nothing to plot, the data ends before step 0 can be filled")
    names = [s.name for s in plan.sources]
    # Step-function data: each segment contributes its start; the last end closes the final piece.
    xs = [lo for lo, _, _ in segments] + [segments[-1][1]]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    base = np.zeros(len(xs))
    for name in names:
        vals = np.array([c[name] for _, _, c in segments] + [segments[-1][2][name]])
        ax.fill_between(xs, base, base + vals, step="post", label=name, linewidth=0)
        base = base + vals
    for st in plan.stages[1:]:
        if st.first_step < plan.steps:
            ax.axvline(st.first_step, color="black", linestyle="--", linewidth=1)
            ax.text(st.first_step, base.max() * 1.02, f" stage {st.index}", va="bottom", fontsize=8)
    if plan.end_step is not None:
        ax.axvline(plan.end_step, color="red", linewidth=1)
    ax.set_xlim(0, plan.steps)
    ax.set_ylim(0, base.max() * 1.12)
    ax.set_xlabel("training step")
    exact = not plan.is_mixture or plan.block_size is None
    mean = f" (mean over blocks of {plan.block_size})"
    ax.set_ylabel("sequences per step" + ("" if exact else mean))
    ax.set_title("per-step data composition by source")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # outside: never covers data
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- entry points -------------------------------------------------------------------------------------
def main(config, *, steps: Optional[int] = None, dump=None, plot: Optional[str] = None) -> dict:
    """Plan ``config`` (a ``TrainLmConfig``); print the tables; optionally dump and plot.

    ``steps`` overrides ``trainer.num_train_steps``; ``dump`` is ``(start, end, path)`` for steps
    ``[start, end)``; ``plot`` a PNG path. Returns the plan as a dict (``DataPlan.to_dict()``) plus
    ``"dump_rows"`` and ``"plot"`` when written.
    """
    from levanter.data import planner
    from levanter.lm_config import data_key

    num_steps = config.trainer.num_train_steps if steps is None else steps
    if num_steps < 1:
        raise ValueError(f"--steps must be >= 1, got {num_steps}")
    schedule = config.trainer.batch_schedule
    seq_len = config.model.seq_len
    if dump is not None:
        start, end, _ = dump
        if not (0 <= start < end):
            raise ValueError(f"--dump: need 0 <= START < END, got {start}:{end}")

    train_set = config.data.train_set(seq_len, schedule, key=data_key(config), epochs=config.epoch)
    plan = planner.plan_data(train_set, schedule, num_steps, seq_len=seq_len)
    print(format_plan(plan))
    result = plan.to_dict()

    if dump is not None:
        start, end, path = dump
        if end > plan.steps:
            raise ValueError(f"--dump: END={end} is past the last planned step ({plan.steps - 1})")
        result["dump_rows"] = write_dump(train_set, schedule, start, end, path)
        print(f"\nwrote {result['dump_rows']:,} rows (steps {start:,}..{end - 1:,}) to {path}")
    if plot is not None:
        write_plot(plan, planner.composition_segments(train_set, schedule, plan.steps), plot)
        result["plot"] = plot
        print(f"wrote {plot}")
    return result


def _dump_range(text: str) -> tuple[int, int]:
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = int(start), int(end)
    except ValueError:
        raise ValueError(f"--dump: expected START:END (steps, END exclusive), got {text!r}") from None
    if not 0 <= lo < hi:
        # Checked before the config is read and caches are built: fail fast on a typo.
        raise ValueError(f"--dump: need 0 <= START < END, got {text!r}")
    return lo, hi


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line (as every entry point prints them), not a usage
    screen followed by a line that starts with the program's name."""

    def error(self, message):
        raise ConfigError(f"command line: {message}")


def config_doc():
    """``--help`` and docs/reference/config.md: the options above, then train_lm's keys."""
    from levanter.config_doc import EntryPoint, FieldDoc
    from levanter.lm_config import TrainLmConfig

    def opt(key, type_, default, text):
        return FieldDoc(key, type_, default, text)

    return EntryPoint(
        "levanter.main.data_schedule",
        __doc__.split("\n")[0],
        TrainLmConfig,
        options=[
            opt("config_path", "str", "(required)", "a train_lm config, or a data-only config (YAML)"),
            opt("steps", "int or null", "null", "steps to plan; null: trainer.num_train_steps"),
            opt("dump", "START:END FILE.jsonl", "null",
                "write one JSON line per position of steps [START, END): global index, source, source "
                "index, store row"),
            opt("plot", "FILE.png", "null", "plot the per-step composition by source (needs matplotlib)"),
            opt("batch_size", "int or null", "null",
                "sequences per step (sets trainer.train_batch_size); required with a data-only config"),
            opt("num_train_steps", "int or null", "null",
                "steps of the run (sets trainer.num_train_steps); required with a data-only config"),
            opt("seq_len", "int or null", "null",
                "tokens per sequence (sets model.seq_len); default: the config's, or train_lm's default "
                "model's for a data-only config"),
        ],
        note="The config's keys are train_lm's (below). A data-only config holds the data section's keys "
        "at the top level, and its overrides drop the data. prefix (--cache_dir /tmp/c).",
    )


def _is_data_only(raw: dict) -> bool:
    """A config whose top level holds none of ``TrainLmConfig``'s keys: the ``data`` section alone."""
    import dataclasses

    from levanter.lm_config import TrainLmConfig

    # ``tokenizer`` is a key of both (train_lm's top-level one is upstream's spelling of data.tokenizer), so
    # it tells nothing about which kind of file this is.
    return bool(raw) and not set(raw) & ({f.name for f in dataclasses.fields(TrainLmConfig)} - {"tokenizer"})


def load_config(config_path: str, overrides: Sequence[str], *, batch_size=None, num_train_steps=None,
                seq_len=None):
    """The ``TrainLmConfig`` to plan: ``config_path`` is a whole train_lm config, or a data-only config
    (then ``batch_size`` and ``num_train_steps`` are required); the three options override the config."""
    from levanter.config import load_yaml
    from levanter.lm_config import TrainLmConfig

    extra: dict = {}
    if batch_size is not None or num_train_steps is not None:
        extra["trainer"] = {}
    if batch_size is not None:
        extra["trainer"]["train_batch_size"] = batch_size
    if num_train_steps is not None:
        extra["trainer"]["num_train_steps"] = num_train_steps
    if seq_len is not None:
        extra["model"] = {"seq_len": seq_len}
    if not _is_data_only(load_yaml(config_path)):
        overrides = [*overrides] + [f"--{k}.{n}={v}" for k, d in extra.items() for n, v in d.items()]
        return parse_config(TrainLmConfig, config_path, overrides)
    # train_lm's default model; the plan reads only its seq_len.
    extra["model"] = {"type": "llama", **extra.get("model", {})}
    given = (("--batch_size", batch_size), ("--num_train_steps", num_train_steps))
    missing = [option for option, value in given if value is None]
    if missing:
        raise ConfigError(
            f"{config_path} is a data-only config (no trainer or model section): give "
            f"{' and '.join(missing)} to plan it (and --seq_len, default 2048), or pass a whole train_lm config"
        )
    data_overrides = [f"--data.{a[2:]}" if a.startswith("--") else a for a in overrides]
    return parse_config(TrainLmConfig, config_path, data_overrides, section="data", extra=extra)


def cli(argv: Optional[Sequence[str]] = None) -> dict:
    # allow_abbrev=False: config overrides such as --data.cache_dir must never be taken for our options.
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        from levanter.config_doc import format_help

        print(format_help(config_doc()), end="")
        raise SystemExit(0)
    parser = _Parser(
        prog="python -m levanter.main.data_schedule", description=__doc__.split("\n")[0], allow_abbrev=False,
        add_help=False,
    )
    # --config_path is taken out before argparse sees the rest, exactly as train_lm and cache_dataset take it.
    parser.add_argument("--config_path", help="a train_lm config (YAML); required")
    parser.add_argument("--steps", type=int, default=None, help="steps to plan (default: num_train_steps)")
    parser.add_argument("--dump", nargs=2, metavar=("START:END", "FILE.jsonl"), default=None)
    parser.add_argument("--plot", metavar="FILE.png", default=None)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--num_train_steps", type=int, default=None)
    parser.add_argument("--seq_len", type=int, default=None)
    try:
        config_path, rest = split_config_path(argv)
        args, overrides = parser.parse_known_args(rest)
        if config_path is None:
            raise ConfigError("--config_path is required: give the train_lm config (YAML) to plan")
        dump = None
        if args.dump is not None:
            dump = (*_dump_range(args.dump[0]), args.dump[1])
        config = load_config(config_path, overrides, batch_size=args.batch_size,
                             num_train_steps=args.num_train_steps, seq_len=args.seq_len)
        return main(config, steps=args.steps, dump=dump, plot=args.plot)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli()
