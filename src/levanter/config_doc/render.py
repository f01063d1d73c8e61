"""The documentation as text: ``--help`` for one command (:func:`format_help`) and the reference page
``docs/reference/config.md`` for all of them (:func:`format_markdown`, run by
``scripts/gen_config_reference.py``).

``--help`` is printed here rather than by draccus because draccus's help repeats the keys that the
members of a union share, and shows no default for a field without a description.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections.abc import Sequence

from .entry import EntryPoint, entry_sections

__all__ = ["format_help", "format_markdown"]


def _plain(text: str) -> str:
    """reST markup as a terminal shows it: ````x```` as x, ``:func:`~a.b``` as b."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return text.replace("``", "")


def format_help(entry: EntryPoint, width: int = 100) -> str:
    """``--help`` text: usage, then each section's keys with type, default and description, once each; the
    section's refused keys (see :func:`refused`) are named together on its last line."""
    lines = [f"usage: python -m {entry.module} {entry.usage}", "", entry.summary, ""]
    if entry.note:
        lines += textwrap.wrap(entry.note, width=width) + [""]
    lines += textwrap.wrap(
        "Keys are set in the YAML file or on the command line with their dotted names (--a.b value). Keys "
        "listed as refused are accepted from upstream configs but stop the run if given a value. "
        "The same, as tables, with what each refused key would do: docs/reference/config.md.",
        width=width,
    )
    pad = " " * 6
    for s in entry_sections(entry):
        if not s.fields:
            continue
        lines += [""] + textwrap.wrap(_plain(f"{s.title}:" + (f" {s.doc}" if s.doc else "")), width=width,
                                      subsequent_indent="  ")
        for r in s.fields:
            if r.refused:
                continue
            lines.append(f"  --{r.key} ({r.type}; default {r.default})")
            text = _plain(r.description)
            lines += textwrap.wrap(text, width=width, initial_indent=pad, subsequent_indent=pad)
        refused_keys = [f"--{r.key}" for r in s.fields if r.refused]
        if refused_keys:
            text = "refused if set (upstream keys not built here): " + ", ".join(refused_keys)
            lines += textwrap.wrap(text, width=width, initial_indent="  ", subsequent_indent=pad)
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(entries: Sequence[EntryPoint]) -> str:
    """The reference page: per entry point, per section, a table of key, type, default, description. A
    section an earlier command already lists (``data_schedule`` and ``eval_lm`` take ``train_lm``'s
    ``data``, ``trainer``, ...) is named with a link to that table rather than repeated."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config dataclasses by `python scripts/gen_config_reference.py`; "
        "do not edit. -->",
        "",
        "Every key each command accepts, with its type, its default and what it does. A key is set in the",
        "YAML file given with `--config_path`, or on the command line with its dotted name",
        "(`--trainer.num_train_steps 100`). Sections whose title says `type: X` apply when the section's",
        "`type:` is `X`; `<name>` stands for a name you choose (a mixture's source). Keys marked",
        "**refused** are accepted so that upstream Levanter configs load, and stop the run with an error",
        "if set to anything but their default.",
        "",
    ]
    listed: dict = {}  # a section's content -> the heading that lists it
    for e in entries:
        out += [f"## `python -m {e.module}`", "", e.summary, ""]
        out += [f"Usage: `python -m {e.module} {e.usage}`", ""]
        if e.note:
            out += [e.note, ""]
        own, shared = [], []
        for s in entry_sections(e):
            if not s.fields:
                continue
            mark = (s.title, tuple(dataclasses.astuple(r)[:5] for r in s.fields))
            if mark in listed:
                shared.append(f"[{s.title}](#{_anchor(listed[mark])})")
            else:
                listed[mark] = f"{e.module.rsplit('.', 1)[-1]}: {s.title}"
                own.append(s)
        if shared:
            out += ["Also these sections, listed above: " + ", ".join(shared) + ".", ""]
        for s in own:
            out += [f"### {e.module.rsplit('.', 1)[-1]}: {s.title}", ""]
            if s.doc:
                out += [s.doc, ""]
            out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            for r in s.fields:
                desc = _md_cell(r.description or "")
                if r.refused:
                    desc = f"**refused** ({_md_cell(r.refused)}). {desc}"
                out.append(f"| `{r.key}` | {_md_cell(r.type)} | `{_md_cell(r.default)}` | {desc} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
