"""Write docs/reference/config.md: every key of every command's config, from the config dataclasses.

    python scripts/gen_config_reference.py          # rewrite the page
    python scripts/gen_config_reference.py --check  # exit 1 if the page is out of date

Types and defaults come from the dataclasses, descriptions from the comment above each field
(:mod:`levanter.config_doc`), the same text ``--help`` prints. To document another command, add its module
to ``ENTRY_POINTS``: a module with a ``levanter.config.main`` function is found as it is; one with its own
options defines ``CONFIG_DOC`` (a ``levanter.config_doc.EntryPoint``). Importing the modules starts no JAX
computation.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# The commands whose keys the page documents, in the order it lists them. Modules that do not exist
# (yet) are skipped, so that the list can name every command the project ships.
ENTRY_POINTS = [
    "levanter.main.train_lm",
    "levanter.main.sft",
    "levanter.main.lora_lm",
    "levanter.main.cache_dataset",
    "levanter.main.data_schedule",
    "levanter.main.eval_lm",
    "levanter.main.eval_harness",
    "levanter.main.export_lm_to_hf",
    "levanter.main.train_tokenizer",
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "reference", "config.md")
COMMAND = "python scripts/gen_config_reference.py"


def entry_points() -> list:
    from levanter.config_doc import entry_point

    found = []
    for name in ENTRY_POINTS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        found.append(entry_point(module))
    return found


def render() -> str:
    from levanter.config_doc import format_markdown

    return format_markdown(entry_points())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    text = render()
    current = open(PAGE, encoding="utf-8").read() if os.path.exists(PAGE) else None
    if args.check:
        if current != text:
            print(f"{PAGE} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if current != text:
        tmp = PAGE + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, PAGE)
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
