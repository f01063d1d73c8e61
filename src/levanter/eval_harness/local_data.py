"""Local JSON-lines data for lm-evaluation-harness tasks shipped with levanter (``tasks/``).

A task YAML names its data by ``dataset_path`` (the Hugging Face Hub, or a packaged builder such as
``json`` with ``dataset_kwargs.data_files``); relative ``data_files`` are read from the working directory,
which cannot locate files installed with a package. The shipped tasks instead say
``custom_dataset: !function levanter.eval_harness.local_data.shipped_jsonl`` with
``dataset_kwargs: {files: {split: file}}``, and :func:`shipped_jsonl` reads those files from the shipped
tasks' directory, wherever levanter is installed. Nothing is downloaded.
"""

from __future__ import annotations

import os
from typing import Dict

__all__ = ["SHIPPED_TASKS_DIR", "shipped_jsonl"]

# The directory of the task YAMLs and their JSON-lines files shipped with levanter.
SHIPPED_TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def shipped_jsonl(files: Dict[str, str], **_metadata):
    """The ``datasets.DatasetDict`` of ``{split: JSON-lines file}``, the files named relative to
    :data:`SHIPPED_TASKS_DIR` (the harness passes the task's metadata too, unused here)."""
    import json

    import datasets

    paths = {split: os.path.join(SHIPPED_TASKS_DIR, name) for split, name in files.items()}
    for split, path in paths.items():
        if not os.path.isfile(path):
            raise ValueError(f"the shipped task data {path!r} (split {split!r}) is missing: reinstall levanter")
    out = {}
    for split, path in paths.items():
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        # From the rows in memory: nothing is written to the datasets cache.
        out[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(out)
